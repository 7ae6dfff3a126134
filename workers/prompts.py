"""Prompts: where they come from, how they become token ids, and when generation stops.

Sources (``PromptSource``):
  * a JSONL file of our own format, one ``{"prompt": "...", "category": "..."}`` or
    ``{"input_ids": [...]}`` per line (the shipped sets under data/prompts/ are of this kind);
  * a named benchmark (gsm8k, math500, humaneval, mbpp, mt-bench, alpaca) loaded from the hub with
    the ``datasets`` library, or the same benchmark from a local JSONL / Parquet / JSON file with the
    benchmark's own fields (offline).
A source may sample ``limit`` prompts with a ``seed`` (shuffled) or take the first ``limit``.

Text prompts go through the target tokenizer's chat template (unless ``chat_template=False``), with
thinking off by default: the published DFlash drafters were trained without thinking traces and
acceptance collapses when the template emits them. Id prompts are used as they are.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.errors import BadInputError

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# Chat-template end-of-turn markers of common model families (stop tokens besides eos).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    category: str | None = None
    origin: str | None = field(default=None, compare=False)  # "file:line" or "file record i", for messages


@dataclass(frozen=True)
class Benchmark:
    """A named dataset: where it lives on the hub and how one record becomes a prompt."""

    hub_id: str
    config: str | None
    split: str
    category: str
    fields: tuple[str, ...]  # fields a record must have
    format: Callable[[dict[str, Any]], str]


def _alpaca(record: dict[str, Any]) -> str:
    extra = record.get("input") or ""
    return f"{record['instruction']}\n\nInput:\n{extra}" if extra else record["instruction"]


def _first_turn(record: dict[str, Any]) -> str:
    turns = record["prompt"]
    return turns[0] if isinstance(turns, (list, tuple)) else str(turns)


BENCHMARKS: dict[str, Benchmark] = {
    "gsm8k": Benchmark("openai/gsm8k", "main", "test", "math", ("question",), lambda r: r["question"] + BOXED),
    "math500": Benchmark("HuggingFaceH4/MATH-500", None, "test", "math", ("problem",), lambda r: r["problem"] + BOXED),
    "humaneval": Benchmark(
        "openai/openai_humaneval", None, "test", "code", ("prompt",),
        lambda r: "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\n{r['prompt']}\n```",
    ),
    "mbpp": Benchmark("google-research-datasets/mbpp", "sanitized", "test", "code", ("prompt",), lambda r: r["prompt"]),
    "mt-bench": Benchmark("HuggingFaceH4/mt_bench_prompts", None, "train", "chat", ("prompt",), _first_turn),
    "alpaca": Benchmark("tatsu-lab/alpaca", None, "train", "chat", ("instruction",), _alpaca),
}


@dataclass(frozen=True)
class PromptSource:
    path: str | None = None  # our JSONL format, or a benchmark's own records when ``dataset`` is set
    dataset: str | None = None  # a name from BENCHMARKS
    split: str | None = None  # default: the benchmark's usual evaluation split
    limit: int | None = None
    seed: int | None = None  # None: the first ``limit`` prompts; else a seeded random sample

    def __post_init__(self) -> None:
        if self.path is None and self.dataset is None:
            raise BadInputError("prompts: give a path, a dataset name, or both")
        if self.dataset is not None and self.dataset not in BENCHMARKS:
            raise BadInputError(f"prompts.dataset: unknown dataset '{self.dataset}' (known: {', '.join(BENCHMARKS)})")


def load_source(source: PromptSource) -> list[Prompt]:
    if source.dataset is None:
        prompts = load_prompts(source.path)
    else:
        benchmark = BENCHMARKS[source.dataset]
        where = source.path or f"{benchmark.hub_id} ({source.split or benchmark.split})"
        records = _read_records(Path(source.path)) if source.path else _hub_records(source, benchmark)
        prompts = [_from_benchmark(record, benchmark, source.dataset, f"{where} record {i}")
                   for i, record in enumerate(records)]
        if not prompts:
            raise BadInputError(f"{where}: the dataset has no records")
    if source.seed is not None:
        prompts = random.Random(source.seed).sample(prompts, k=min(source.limit or len(prompts), len(prompts)))
    elif source.limit is not None:
        prompts = prompts[: source.limit]
    return prompts


def _from_benchmark(record: dict[str, Any], benchmark: Benchmark, name: str, where: str) -> Prompt:
    missing = [f for f in benchmark.fields if f not in record or record[f] in (None, "")]
    if missing:
        raise BadInputError(f"{where}: dataset '{name}' needs field '{missing[0]}' (fields here: {sorted(record)})")
    category = record.get("category") if name == "mt-bench" and record.get("category") else benchmark.category
    return Prompt(text=benchmark.format(record), category=category, origin=where)


def _read_records(path: Path) -> list[dict[str, Any]]:
    """A benchmark's own records from a local .jsonl / .json / .parquet file (offline use)."""
    import pandas as pd

    if not path.is_file():
        raise BadInputError(f"{path}: no such dataset file")
    try:
        if path.suffix == ".parquet":
            frame = pd.read_parquet(path)
        elif path.suffix == ".jsonl":
            frame = pd.read_json(path, lines=True)
        elif path.suffix == ".json":
            frame = pd.read_json(path)
        else:
            raise BadInputError(f"{path}: dataset files must be .jsonl, .json or .parquet")
    except BadInputError:
        raise
    except Exception as exc:  # pandas / pyarrow parse errors
        raise BadInputError(f"{path}: cannot read the dataset file ({exc})") from exc
    return [{k: _plain(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]


def _plain(value: Any) -> Any:
    """numpy arrays (Parquet list columns) -> lists, so formatters see plain Python."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str) else value


def _hub_records(source: PromptSource, benchmark: Benchmark) -> list[dict[str, Any]]:
    try:
        from datasets import load_dataset
    except ImportError as exc:
        raise BadInputError(
            f"prompts.dataset: '{source.dataset}' comes from the hub through the `datasets` package, which is "
            "not installed (pip install 'specdec-orchestrator[datasets]'; offline: give prompts.path instead)"
        ) from exc
    try:
        data = load_dataset(benchmark.hub_id, benchmark.config, split=source.split or benchmark.split)
    except Exception as exc:  # no network, unknown split, missing package: one line for the user
        raise BadInputError(
            f"prompts.dataset: cannot load '{source.dataset}' ({benchmark.hub_id}, split "
            f"{source.split or benchmark.split}) from the hub: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            " (offline: give prompts.path to a local copy of the dataset)"
        ) from exc
    return [dict(record) for record in data]


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Our JSONL format: {"prompt": text} or {"input_ids": [...]}, optional "category"."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise BadInputError(f"{path}: cannot read the prompts file ({exc.strerror})") from exc
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInputError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
        prompts.append(_parse(record, f"{path}:{number}"))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise BadInputError(f"{path}: no prompts in the file")
    return prompts


def _parse(record: object, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise BadInputError(f"{where}: each line must be a JSON object")
    category = record.get("category")
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise BadInputError(f"{where}: 'prompt' must be a non-empty string")
        return Prompt(text=record["prompt"], category=category, origin=where)
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise BadInputError(f"{where}: 'input_ids' must be a non-empty list of non-negative ints")
        return Prompt(input_ids=tuple(ids), category=category, origin=where)
    raise BadInputError(f"{where}: needs a 'prompt' (text) or 'input_ids' (list of ints) field")


@dataclass(frozen=True)
class ChatFormat:
    chat_template: bool = True  # False: raw prompt text, no template
    enable_thinking: bool = False


def template_has_thinking(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "enable_thinking" in template


def encode(prompt: Prompt, tokenizer, vocab_rows: int, chat: ChatFormat = ChatFormat()) -> list[int]:
    """Token ids for one prompt; checks ids fit the target's embedding."""
    if prompt.input_ids is not None:
        ids = list(prompt.input_ids)
    elif tokenizer is None:
        raise BadInputError("a text prompt needs a tokenizer, and the target folder has none (use input_ids)")
    elif chat.chat_template and getattr(tokenizer, "chat_template", None):
        extra = {"enable_thinking": chat.enable_thinking} if template_has_thinking(tokenizer) else {}
        messages = [{"role": "user", "content": prompt.text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        ids = tokenizer(prompt.text)["input_ids"]
    bad = [i for i in ids if i >= vocab_rows]
    if bad:
        raise BadInputError(f"prompt token ids {bad[:5]} are outside the target's {vocab_rows}-row vocabulary")
    return ids


def check_prompts(prompts: list[Prompt], tokenizer, vocab_rows: int, max_positions: int | None, new_positions: int,
                  chat: ChatFormat = ChatFormat()) -> None:
    """Encode every prompt once and refuse, naming its file and line, one the target cannot run.

    ``new_positions``: positions a generation adds after the prompt (max_new_tokens plus the widest
    verify pass). Checked: the prompt has tokens, its ids fit the embedding, and prompt + new
    positions fit the target's ``max_position_embeddings``.
    """
    for index, prompt in enumerate(prompts):
        where = prompt.origin or f"prompt {index}"
        try:
            ids = encode(prompt, tokenizer, vocab_rows, chat)
        except BadInputError as exc:
            raise BadInputError(f"{where}: {exc}") from None
        if not ids:
            raise BadInputError(f"{where}: the prompt encodes to no tokens")
        if max_positions is not None and len(ids) + new_positions > max_positions:
            raise BadInputError(
                f"{where}: the prompt's {len(ids)} tokens + {new_positions} generated and verify positions exceed "
                f"the target's {max_positions} positions (max_position_embeddings); shorten the prompt or "
                "lower max_new_tokens")


def stop_token_ids(tokenizer, model_config) -> tuple[int, ...]:
    """eos token(s) of the model and tokenizer, plus the chat template's end-of-turn tokens."""
    ids: set[int] = set()
    for source in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    template = getattr(tokenizer, "chat_template", None) or ""
    if tokenizer is not None and template:
        vocab = tokenizer.get_vocab()
        ids.update(vocab[marker] for marker in END_OF_TURN if marker in template and marker in vocab)
    return tuple(sorted(ids))
