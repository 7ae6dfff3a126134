"""The user's real checkpoints, in miniature: tiny models written in the published layouts, run through
the real loading code, ``tools.bench`` and a sweep's ``--dry-run`` (real subprocesses).

- the target as Qwen/Qwen3.6-27B ships: ``Qwen3_5ForConditionalGeneration`` with a ``text_config``,
  weights ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight`` and ``mtp.*``, a
  tokenizer with a chat template and a generation config with two stop ids;
- the drafter as z-lab/Qwen3.6-27B-DFlash ships: ``DFlashDraftModel``, sliding + full layers, its
  DFlash fields in ``dflash_config`` (the newer convention, ``block_size`` included), bf16 weights;
  once as a folder and once inside a Hugging Face cache, loaded offline.

And what must fail at once, creating nothing: a model folder that is not there, a hub id missing from
the cache when models must come from this machine, a drafter field the project does not implement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from tools.tiny import TinyShape, tiny_drafter_config, tiny_target_config
from workers.models.loading import Placement, load_drafter, load_target

pytestmark = pytest.mark.slow  # the bench CLI and sweep CLIs in subprocesses

ROOT = Path(__file__).resolve().parents[2]
SHAPE = TinyShape(vocab_size=64, block_size=6, arch="qwen3_5", drafter_layer_types=("sliding_attention",
                  "full_attention"), drafter_window=8)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<unk>"]
WORDS = ["user", "assistant", "what", "is", "two", "plus", "three", "write", "code", "hello", "a", "poem"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant "
    "{% if enable_thinking is defined and enable_thinking is false %}<think> </think> {% endif %}{% endif %}"
)
HUB_DRAFTER = "z-lab/Tiny3.6-DFlash"  # the drafter's id inside the test's Hugging Face cache


def write_published_target(folder: Path) -> Path:
    """The multimodal checkpoint layout of Qwen3.5/3.6, with a tiny vision tower and an MTP head."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {k: v for k, v in tiny_target_config(SHAPE).items() if k not in ("architectures", "model_type")}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
              "patch_size": 4, "spatial_merge_size": 1, "temporal_patch_size": 1}
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text | {"mtp_num_hidden_layers": 1},
                                                          vision_config=vision))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, SHAPE.init_std)
    model.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    hidden = SHAPE.hidden_size
    weights |= {"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.ones(hidden),
                "mtp.layers.0.input_layernorm.weight": torch.ones(hidden)}  # the MTP head: not ours to run
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in config
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token="<unk>",
                                        additional_special_tokens=SPECIALS[1:5])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def zlab_drafter_config() -> dict:
    """z-lab/Qwen3.6-27B-DFlash's config layout (DFlash fields inside dflash_config), at the tiny size."""
    raw = tiny_drafter_config(SHAPE)
    raw["dflash_config"] |= {"block_size": raw.pop("block_size")}
    return raw | {"dtype": "bfloat16", "max_window_layers": 2}


def write_zlab_drafter(folder: Path, target: torch.nn.Module) -> Path:
    from workers.models.drafter import DFlashDrafter
    from workers.models.drafter_config import DrafterSpec

    raw = zlab_drafter_config()
    torch.manual_seed(1)
    drafter = DFlashDrafter(DrafterSpec.from_dict(raw))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items() if "rotary" not in k}
    save_file(state, folder / "model.safetensors")
    return folder


def write_hub_cache(cache: Path, repo_id: str, files: Path) -> None:
    """A Hugging Face hub cache holding ``files`` as the snapshot of ``repo_id`` (the hub client's layout)."""
    revision = "0" * 40
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in files.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    target_dir = write_published_target(root / "Qwen3.6-Tiny")
    model = load_target(str(target_dir), dtype="float32", placement=Placement(device="cpu"))
    drafter_dir = write_zlab_drafter(root / "Qwen3.6-Tiny-DFlash", model)
    write_hub_cache(root / "hub", HUB_DRAFTER, drafter_dir)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("what is two plus three", "write a poem")))
    return {"target": target_dir, "drafter": drafter_dir, "hub": root / "hub", "prompts": prompts, "root": root}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "RAY_ADDRESS")}
    return env | {"TRANSFORMERS_VERBOSITY": "error"} | extra


def _run(module: str, *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=env or _env(), cwd=cwd, timeout=300)


# -- loading ---------------------------------------------------------------------------------------------


def test_the_multimodal_target_loads_its_language_model_only(published):
    model = load_target(str(published["target"]), dtype="float32", placement=Placement(device="cpu"))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    saved = load_file(published["target"] / "model.safetensors")
    own = model.state_dict()
    for key, value in saved.items():
        if key.startswith("model.language_model."):
            assert torch.equal(own[key.replace("model.language_model.", "model.")], value), key
    assert torch.equal(own["lm_head.weight"], saved["lm_head.weight"])
    assert not any(k.startswith(("mtp.", "model.visual.")) for k in own)


def test_the_zlab_drafter_loads_with_its_declared_attention(published):
    from workers.models.drafter_config import LayerAttention

    model = load_target(str(published["target"]), dtype="float32", placement=Placement(device="cpu"))
    drafter = load_drafter(str(published["drafter"]), model)
    assert drafter.spec.block_size == 6  # read from dflash_config
    assert drafter.spec.layer_attention == (LayerAttention(causal=True, window=8), LayerAttention())
    assert drafter.fc.weight.dtype == torch.float32  # the target's dtype, from bf16 files


# -- the bench CLI and a sweep's dry run on the published layouts ---------------------------------------


def test_bench_runs_the_published_pair_offline_from_a_folder_and_from_the_hub_cache(published):
    for drafter, env in ((str(published["drafter"]), _env()),
                         (HUB_DRAFTER, _env(HF_HUB_CACHE=str(published["hub"])))):
        proc = _run("tools.bench", "--target", str(published["target"]), "--drafter", drafter,
                    "--method", "ddtree", "--tree-budget", "8", "--prompts", str(published["prompts"]),
                    "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "10", "--local-files-only",
                    "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        payload = json.loads(proc.stdout)
        assert payload["status"] == "ok" and payload["metrics"]["lossless_match"] == 1.0
        assert len(payload["outputs"]) == 2  # chat-formatted text prompts


def _sweep(published: dict[str, Path], runs: Path, target: dict | None = None, drafter: dict | None = None) -> dict:
    return {
        "name": "published-layouts",
        "method": "ddtree",
        "target": target or {"model": str(published["target"]), "dtype": "float32", "local_files_only": True},
        "drafter": drafter or {"model": str(published["drafter"]), "local_files_only": True},
        "workers": {"count": 1, "gpus_per_worker": 0},
        "prompts": {"path": str(published["prompts"]), "max_new_tokens": 8},
        "search_space": {"tree_budget": {"type": "int", "low": 2, "high": 16}},
        "objectives": [{"metric": "tokens_per_s", "direction": "maximize"}],
        "n_trials": 2,
        "storage": f"sqlite:///{runs}/optuna.db",
        "mlflow": {"tracking_uri": f"sqlite:///{runs}/mlflow.db", "experiment": "layouts"},
    }


def _sweep_run(tmp_path: Path, config: dict, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess,
                                                                                         float]:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    start = time.monotonic()
    proc = _run("orchestrator.sweep", str(path), env=env, cwd=tmp_path)
    return proc, time.monotonic() - start


def test_a_sweep_dry_run_accepts_the_published_pair(published, tmp_path):
    runs = tmp_path / "runs"
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(_sweep(published, runs)))
    proc = _run("orchestrator.sweep", str(path), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "study      new" in proc.stdout and not runs.exists()


BAD = {
    # name: (target change, drafter change, environment, words the one error line must hold)
    "missing drafter folder": (None, {"model": "/tmp/x/no-such-drafter"}, {}, ["drafter.model", "no such folder"]),
    "missing target folder": ({"model": "./no-such-target", "dtype": "float32"}, None, {},
                              ["target.model", "no such folder"]),
    "hub drafter not cached, local only": (None, {"model": "z-lab/Not-Downloaded", "local_files_only": True}, {},
                                           ["drafter.model", "z-lab/Not-Downloaded", "local_files_only"]),
    "hub target not cached, HF_HUB_OFFLINE": ({"model": "Qwen/Not-Downloaded"}, None, {"HF_HUB_OFFLINE": "1"},
                                              ["target.model", "Qwen/Not-Downloaded", "HF_HUB_OFFLINE"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_model_that_cannot_be_had_exits_2_at_once_creating_nothing(published, tmp_path, case):
    target, drafter, extra, words = BAD[case]
    runs = tmp_path / "runs"
    env = _env(HF_HUB_CACHE=str(tmp_path / "empty-cache"), **extra)
    proc, elapsed = _sweep_run(tmp_path, _sweep(published, runs, target, drafter), env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and all(word in error[0] for word in words), error
    assert not runs.exists() and not (tmp_path / "empty-cache").exists()
    assert elapsed < 60, elapsed  # refused before Ray, Optuna or MLflow start (the old failure took ~3 minutes)


def test_a_drafter_field_not_implemented_is_refused_by_name_creating_nothing(published, tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    raw = zlab_drafter_config()
    raw["dflash_config"]["attention_sink_bias"] = True
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "model.safetensors").write_bytes((published["drafter"] / "model.safetensors").read_bytes())
    runs = tmp_path / "runs"
    proc, _ = _sweep_run(tmp_path, _sweep(published, runs, drafter={"model": str(folder)}))
    assert proc.returncode == 2
    assert "attention_sink_bias" in proc.stderr and str(folder / "config.json") in proc.stderr
    assert not runs.exists()


def test_a_drafter_built_for_another_target_is_refused_before_anything_starts(published, tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    raw = zlab_drafter_config() | {"num_target_layers": 8}
    (folder / "config.json").write_text(json.dumps(raw))
    proc, _ = _sweep_run(tmp_path, _sweep(published, tmp_path / "runs", drafter={"model": str(folder)}))
    assert proc.returncode == 2 and "num_target_layers 8" in proc.stderr, proc.stderr
    assert str(published["target"]) in proc.stderr and not (tmp_path / "runs").exists()


def test_bench_refuses_a_model_that_cannot_be_had_at_once(published, tmp_path):
    env = _env(HF_HUB_CACHE=str(tmp_path / "empty-cache"))
    proc = _run("tools.bench", "--target", str(published["target"]), "--drafter", "z-lab/Not-Downloaded",
                "--method", "ddtree", "--tree-budget", "4", "--prompts", str(published["prompts"]),
                "--device", "cpu", "--local-files-only", env=env)
    assert proc.returncode == 2 and "--drafter z-lab/Not-Downloaded" in proc.stderr, proc.stderr
