"""``python -m tools.bench``: the JSON contract other tools rely on, and its errors (real subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.tiny import write_prompts

pytestmark = pytest.mark.slow  # the bench CLI in subprocesses


def _run(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tools.bench", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("bench")
    prompts = folder / "prompts.jsonl"
    write_prompts(prompts, tiny.shape, count=3)
    return {"target": str(tiny.target_dir), "drafter": str(tiny.drafter_dir), "prompts": str(prompts)}


def _base(files, *extra: str) -> list[str]:
    return ["--target", files["target"], "--drafter", files["drafter"], "--prompts", files["prompts"],
            "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "12", *extra]


def test_json_contract_ddtree(files):
    proc = _run(*_base(files, "--method", "ddtree", "--tree-budget", "16", "--max-depth", "5", "--branching", "3",
                       "--depth-discount", "0.8", "--limit", "2", "--json"))
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert payload["method"] == "ddtree"
    assert payload["params"] == {"tree_budget": 16, "max_depth": 5, "branching": 3, "depth_discount": 0.8}
    for name in ("tokens_per_s", "tau", "speedup", "ttft_s", "tpot_s", "lossless_match", "peak_memory_gib"):
        assert name in payload["metrics"]
    assert payload["metrics"]["lossless_match"] == 1.0
    assert len(payload["outputs"]) == 2
    for out in payload["outputs"]:
        assert len(out["token_ids"]) == 12
        assert all(1 <= a <= 6 for a in out["acceptance_lengths"])


def test_json_ar_and_dflash_agree(files):
    ar = json.loads(_run(*_base(files, "--method", "ar", "--json")).stdout)
    dflash = json.loads(_run(*_base(files, "--method", "dflash", "--num-draft-tokens", "3", "--json")).stdout)
    assert all(set(o["acceptance_lengths"]) == {1} for o in ar["outputs"])
    assert [o["token_ids"] for o in ar["outputs"]] == [o["token_ids"] for o in dflash["outputs"]]


def test_table_without_json(files):
    proc = _run(*_base(files, "--method", "ar", "--no-baseline"))
    assert proc.returncode == 0, proc.stderr
    assert "tokens_per_s" in proc.stdout


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "ddtree"], "needs --tree-budget"),
        (["--method", "ddtree", "--tree-budget", "0"], "--tree-budget must be >= 1"),
        (["--method", "ddtree", "--tree-budget", "8", "--depth-discount", "1.5"], "--depth-discount must be in (0, 1]"),
        (["--method", "bogus"], "invalid choice"),
        (["--method", "dflash", "--tree-budget", "4"], "apply to --method ddtree"),
        (["--method", "ar", "--num-draft-tokens", "4"], "applies to --method dflash"),
        (["--method", "dflash", "--temperature", "-1"], "temperature must be >= 0"),
        (["--method", "ddtree", "--tree-budget", "8", "--max-depth", "8"], "exceeds the drafter's block_size-1 = 7"),
        (["--method", "dflash", "--num-draft-tokens", "9"], "exceeds the drafter's block_size-1 = 7"),
    ],
)
def test_bad_flags_exit_2_with_one_line(files, extra, message):
    proc = _run(*_base(files, *extra))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""


def test_missing_drafter_flag(files):
    proc = _run("--target", files["target"], "--prompts", files["prompts"], "--method", "dflash", "--device", "cpu")
    assert proc.returncode == 2 and "needs --drafter" in proc.stderr


def test_mismatched_drafter_exits_2(files, tmp_path):
    bad = tmp_path / "drafter"
    bad.mkdir()
    config = json.loads((Path(files["drafter"]) / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 40]
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((Path(files["drafter"]) / "model.safetensors").read_bytes())
    proc = _run("--target", files["target"], "--drafter", str(bad), "--prompts", files["prompts"], "--method",
                "dflash", "--dtype", "float32", "--device", "cpu")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "target_layer_ids" in lines[0] and "config.json" in lines[0]


def test_bad_prompts_file_exits_2(files, tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"input_ids": [1, 2]}\n{"text": "no field"}\n')
    proc = _run("--target", files["target"], "--prompts", str(broken), "--method", "ar", "--device", "cpu")
    assert proc.returncode == 2 and "broken.jsonl:2" in proc.stderr
    missing = _run("--target", files["target"], "--prompts", str(tmp_path / "nope.jsonl"), "--method", "ar")
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr


def test_missing_target_exits_2(files, tmp_path):
    proc = _run("--target", str(tmp_path / "absent"), "--prompts", files["prompts"], "--method", "ar")
    assert proc.returncode == 2 and "absent" in proc.stderr


def test_tensor_parallel_two_local_ranks_give_the_greedy_output(files, tiny):
    """``--tensor-parallel 2``: two gloo processes, rank 0's result, the same tokens as greedy AR in one process."""
    import torch

    from workers.decoding import ar
    from workers.decoding.generation import GenerationConfig

    proc = _run(*_base(files, "--method", "ddtree", "--tree-budget", "16", "--limit", "2", "--json",
                       "--tensor-parallel", "2"))
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["status"] == "ok" and payload["metrics"]["lossless_match"] == 1.0
    lines = Path(files["prompts"]).read_text().splitlines()[:2]
    config = GenerationConfig(max_new_tokens=12, stop_token_ids=(0,))  # the tiny target's eos
    with torch.inference_mode():
        expected = [ar.generate(tiny.target, None, torch.tensor([json.loads(line)["input_ids"]]), config).token_ids
                    for line in lines]
    assert [o["token_ids"] for o in payload["outputs"]] == expected
