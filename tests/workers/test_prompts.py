"""Prompt sources (our JSONL, named benchmarks from local files, the hub offline), chat formatting with
a real tokenizer and chat template, stop tokens, and per-category metrics."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tools.tiny import TinyShape, write_tiny_pair
from workers.decoding.params import ARParams, TreeParams
from workers.errors import BadInputError
from workers.prompts import (
    BENCHMARKS,
    ChatFormat,
    Prompt,
    PromptSource,
    encode,
    load_source,
    stop_token_ids,
)
from workers.wire import TrialSpec, WorkerConfig
from workers.worker import Worker

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<unk>"]
WORDS = ["user", "assistant", "what", "is", "two", "plus", "three", "write", "code", "hello", "a", "poem"]
# Qwen3-style: an empty think block is emitted when thinking is off.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant "
    "{% if enable_thinking is defined and enable_thinking is false %}<think> </think> {% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    """A tiny target folder that ships a tokenizer with a chat template (vocab 64 > 18 tokens)."""
    folder = tmp_path_factory.mktemp("chat")
    target_dir, drafter_dir = write_tiny_pair(folder, TinyShape(vocab_size=64))
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<unk>",
                                        additional_special_tokens=SPECIALS[1:5])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(target_dir)
    return target_dir


@pytest.fixture(scope="module")
def tokenizer(chat_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_target)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def test_chat_template_with_thinking_off_by_default(tokenizer):
    prompt = Prompt(text="what is two plus three")
    default = encode(prompt, tokenizer, 65)
    think_block = _ids(tokenizer, "<think> </think>")
    assert default[-2:] == think_block  # the template's "thinking off" form
    assert default[:2] == _ids(tokenizer, "<|im_start|> user")
    thinking = encode(prompt, tokenizer, 65, ChatFormat(enable_thinking=True))
    assert thinking == default[:-2]
    raw = encode(prompt, tokenizer, 65, ChatFormat(chat_template=False))
    assert raw == _ids(tokenizer, "what is two plus three")


def test_stop_tokens_are_eos_and_end_of_turn(tokenizer):
    class Config:
        eos_token_id = 0

    stops = stop_token_ids(tokenizer, Config())
    assert stops == (0, tokenizer.convert_tokens_to_ids("<|im_end|>"))


def test_token_ids_outside_the_vocabulary_are_refused(tokenizer):
    with pytest.raises(BadInputError, match="outside the target's 10-row vocabulary"):
        encode(Prompt(text="write a poem"), tokenizer, 10)


# -- sources -------------------------------------------------------------------------------------------

RECORDS = {
    "gsm8k": [{"question": f"question {i}", "answer": "42"} for i in range(6)],
    "math500": [{"problem": "p1", "answer": "1"}],
    "humaneval": [{"task_id": "t/0", "prompt": "def f():\n    pass"}],
    "mbpp": [{"prompt": "Write f.", "task_id": 1}],
    "mt-bench": [{"prompt": ["first turn", "second turn"], "category": "writing"}],
    "alpaca": [{"instruction": "Do x.", "input": "", "output": "y"},
               {"instruction": "Do z.", "input": "data", "output": "w"}],
}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_named_benchmarks_from_local_files(name, suffix, tmp_path):
    path = tmp_path / f"{name}{suffix}"
    frame = pd.DataFrame(RECORDS[name])
    frame.to_parquet(path) if suffix == ".parquet" else frame.to_json(path, orient="records", lines=True)
    prompts = load_source(PromptSource(path=str(path), dataset=name))
    assert len(prompts) == len(RECORDS[name])
    first = prompts[0]
    expected = {
        "gsm8k": ("question 0", "\\boxed{}", "math"),
        "math500": ("p1", "\\boxed{}", "math"),
        "humaneval": ("```python\ndef f():\n    pass\n```", "passes the tests", "code"),
        "mbpp": ("Write f.", "Write f.", "code"),
        "mt-bench": ("first turn", "first turn", "writing"),
        "alpaca": ("Do x.", "Do x.", "chat"),
    }[name]
    assert expected[0] in first.text and expected[1] in first.text and first.category == expected[2]
    if name == "mt-bench":
        assert "second turn" not in first.text  # first turn only
    if name == "alpaca":
        assert prompts[1].text == "Do z.\n\nInput:\ndata"


def test_missing_field_names_the_field_and_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"problem": "not the gsm8k field"}) + "\n")
    with pytest.raises(BadInputError, match=r"gsm8k\.jsonl record 0: dataset 'gsm8k' needs field 'question'"):
        load_source(PromptSource(path=str(path), dataset="gsm8k"))


def test_unknown_dataset_and_missing_file(tmp_path):
    with pytest.raises(BadInputError, match="unknown dataset 'gsm9k'"):
        PromptSource(dataset="gsm9k")
    with pytest.raises(BadInputError, match="no such dataset file"):
        load_source(PromptSource(path=str(tmp_path / "absent.parquet"), dataset="gsm8k"))
    with pytest.raises(BadInputError, match="give a path, a dataset name, or both"):
        PromptSource()


def test_hub_dataset_offline_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BadInputError, match=r"cannot load 'mbpp' \(google-research-datasets/mbpp, split test\)"):
        load_source(PromptSource(dataset="mbpp"))


def test_hub_dataset_without_the_datasets_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: the import raises ImportError
    with pytest.raises(BadInputError, match=r"not installed \(pip install 'specdec-orchestrator\[datasets\]'"):
        load_source(PromptSource(dataset="gsm8k"))


def test_limit_and_seeded_sampling(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    pd.DataFrame(RECORDS["gsm8k"]).to_json(path, orient="records", lines=True)
    first = load_source(PromptSource(path=str(path), dataset="gsm8k", limit=3))
    assert [p.text.split("\n")[0] for p in first] == ["question 0", "question 1", "question 2"]
    sampled = load_source(PromptSource(path=str(path), dataset="gsm8k", limit=3, seed=7))
    again = load_source(PromptSource(path=str(path), dataset="gsm8k", limit=3, seed=7))
    other = load_source(PromptSource(path=str(path), dataset="gsm8k", limit=3, seed=8))
    assert sampled == again and len(sampled) == 3 and sampled != first
    assert {p.text for p in other} != {p.text for p in sampled} or other != sampled


def test_shipped_prompt_sets():
    for name, count in (("math", 36), ("code", 36), ("chat", 36), ("mixed", 108)):
        prompts = load_source(PromptSource(path=str(ROOT / "data" / "prompts" / f"{name}.jsonl")))
        assert len(prompts) == count and len({p.text for p in prompts}) == count
        assert all(p.text and p.category in ("math", "code", "chat") for p in prompts)
    mixed = load_source(PromptSource(path=str(ROOT / "data" / "prompts" / "mixed.jsonl"), limit=6))
    assert [p.category for p in mixed] == ["math", "code", "chat"] * 2


# -- the worker: chat prompts end to end, per-category metrics ------------------------------------------


def test_worker_reports_metrics_per_category(chat_target):
    drafter = chat_target.parent / "drafter"
    worker = Worker(WorkerConfig(str(chat_target), str(drafter), dtype="float32", device="cpu")).load()
    prompts = (Prompt(text="what is two plus three", category="math"), Prompt(text="write a poem", category="chat"),
               Prompt(text="write code", category="code"), Prompt(text="hello", category="chat"))
    result = worker.run_trial(TrialSpec(TreeParams(8), prompts, max_new_tokens=6))
    assert result.status == "ok", result.error
    for category in ("math", "chat", "code"):
        for metric in ("tau", "tokens_per_s", "speedup"):
            assert result.metrics[f"{metric}.{category}"] is not None, (metric, category)
    assert result.metrics["lossless_match"] == 1.0


@pytest.mark.slow  # the bench CLI in a subprocess
def test_bench_cli_with_a_local_dataset_and_stop_override(chat_target, tmp_path):
    import subprocess
    import sys

    path = tmp_path / "mbpp.jsonl"
    pd.DataFrame([{"prompt": "write code"}, {"prompt": "write a poem"}]).to_json(path, orient="records", lines=True)
    drafter = chat_target.parent / "drafter"
    command = [sys.executable, "-m", "tools.bench", "--target", str(chat_target), "--drafter", str(drafter),
               "--method", "dflash", "--dataset", "mbpp", "--prompts", str(path), "--dtype", "float32",
               "--device", "cpu", "--max-new-tokens", "5", "--stop-token-ids", "63", "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert len(payload["outputs"]) == 2 and payload["metrics"]["tau.code"] is not None
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_target_without_tokenizer_files_gets_no_stand_in_tokenizer(tmp_path):
    """transformers 5 returns a one-token stand-in (eos id 0) for a folder without tokenizer files;
    the worker must not take it, or id 0 becomes a stop token and outputs are silently cut short."""
    from workers.models.facts import has_tokenizer_files, load_tokenizer

    target_dir, _ = write_tiny_pair(tmp_path, TinyShape())
    for name in ("config.json", "generation_config.json"):  # eos 31: the model's own stop token, not 0
        path = target_dir / name
        path.write_text(json.dumps(json.loads(path.read_text()) | {"eos_token_id": 31}))
    assert not has_tokenizer_files(str(target_dir))
    assert load_tokenizer(str(target_dir)) is None
    worker = Worker(WorkerConfig(target=str(target_dir), dtype="float32", device="cpu")).load()
    assert worker.tokenizer is None
    prompts = tuple(Prompt(input_ids=tuple(range(1 + k, 9 + k))) for k in range(8))
    # sampled, so that id 0 turns up among the 8 x 24 tokens (a fixed seed: the same tokens every run)
    spec = TrialSpec(ARParams(), prompts, max_new_tokens=24, temperature=1.0, seed=3, baseline=False, warmup=False)
    _, gen = worker._prepare(spec)
    assert gen.stop_token_ids == (31,)
    result = worker.run_trial(spec)
    assert result.status == "ok", result.error
    outputs = [o.token_ids for o in result.outputs]
    assert any(0 in ids[:-1] for ids in outputs), outputs  # id 0 is generated and does not stop anything
    assert all(len(ids) == 24 or ids[-1] == 31 for ids in outputs), outputs
