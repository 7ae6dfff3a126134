"""Prompt files: JSONL with one ``{"prompt": "..."}`` or ``{"input_ids": [...]}`` per line.

Text prompts go through the target tokenizer's chat template when it has one (thinking off, as the
published DFlash drafters were trained without thinking traces); id prompts are used as they are,
for models that ship no tokenizer (the tiny offline models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workers.errors import BadInputError


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    category: str | None = None


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
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
        return Prompt(text=record["prompt"], category=category)
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise BadInputError(f"{where}: 'input_ids' must be a non-empty list of non-negative ints")
        return Prompt(input_ids=tuple(ids), category=category)
    raise BadInputError(f"{where}: needs a 'prompt' (text) or 'input_ids' (list of ints) field")


def encode(prompt: Prompt, tokenizer, vocab_rows: int, enable_thinking: bool = False) -> list[int]:
    """Token ids for one prompt; checks ids fit the target's embedding."""
    if prompt.input_ids is not None:
        ids = list(prompt.input_ids)
    elif tokenizer is None:
        raise BadInputError("a text prompt needs a tokenizer, and the target folder has none (use input_ids)")
    elif getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt.text}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, enable_thinking=enable_thinking
        )
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        ids = tokenizer(prompt.text)["input_ids"]
    bad = [i for i in ids if i >= vocab_rows]
    if bad:
        raise BadInputError(f"prompt token ids {bad[:5]} are outside the target's {vocab_rows}-row vocabulary")
    return ids


def stop_token_ids(tokenizer, model_config) -> tuple[int, ...]:
    """The target's eos token(s): from the generation config, else the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))
