"""What the driver checks about a target before anything starts, without its weights or the
model code: its vocabulary, positions, tokenizer and config (``target_facts``), and whether a drafter
declares thinking-mode training. The sweep's validation imports this module, not ``loading``, so a
``--dry-run`` or a bad sweep file answers without importing the models' code."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.errors import BadInputError, UnsupportedModelError
from workers.models.sources import ModelSource, local_only
from workers.seam import check_supported

# Files that hold a tokenizer's vocabulary. A folder with none of them is a model without a
# tokenizer: transformers 5 would still return a stand-in (one token, eos id 0) for it, which turns
# id 0 into a stop token and silently truncates every output.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tiktoken.model")


def has_tokenizer_files(name_or_path: str, local_files_only: bool = False) -> bool:
    """True when the folder (or the hub repo, through the local cache or the hub) has a real vocabulary."""
    folder = Path(name_or_path)
    if folder.is_dir():
        return any((folder / name).is_file() for name in TOKENIZER_FILES)
    from transformers.utils import cached_file

    for name in TOKENIZER_FILES:
        try:
            found = cached_file(name_or_path, name, local_files_only=local_files_only,
                                _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False)
        except Exception:  # gated or unknown repo: no tokenizer we can use
            found = None
        if found is not None:
            return True
    return False


def load_tokenizer(name_or_path: str, local_files_only: bool = False):
    """The target's tokenizer, or None for a model that ships no tokenizer files (prompts then give
    ids, and stop tokens come from the model's generation config alone)."""
    from transformers import AutoTokenizer

    local_files_only = local_only(local_files_only)
    if ModelSource.parse(name_or_path).is_random or not has_tokenizer_files(name_or_path, local_files_only):
        return None
    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only)
    except Exception:  # unreadable tokenizer files: callers fall back to {"input_ids": [...]} prompts
        return None


@dataclass(frozen=True)
class TargetFacts:
    """What prompts and the drafter are checked against before anything starts."""

    vocab_rows: int
    max_positions: int | None
    tokenizer: object | None
    config: Any  # the target's transformers config


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.pth")


def target_facts(name_or_path: str) -> TargetFacts | None:
    """The target's vocabulary size, positions and tokenizer without loading its weights, checked as
    the worker would check them (architecture supported, weight files present in a local folder).

    None when the target is not on this machine (a hub id that is not in the local cache): the
    worker checks it after loading. Never touches the network.
    """
    from transformers import AutoConfig

    from workers.models.shapes import target_config
    from workers.seam import text_config

    shape = ModelSource.parse(name_or_path).shape
    folder = Path(name_or_path)
    if shape is not None:
        try:
            config = target_config(shape)
        except KeyError as exc:
            raise BadInputError(f"target {name_or_path}: {exc.args[0]}") from None
    else:
        try:
            config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
        except Exception as exc:
            if not folder.exists():
                return None  # a hub id not cached here: the worker fetches and checks it
            raise BadInputError(f"{name_or_path}: cannot load the target config from this folder ({exc})") from exc
        try:
            check_supported(config)
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{name_or_path}: {exc}") from None
        if folder.is_dir() and not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
            raise BadInputError(f"{name_or_path}: cannot load the target weights (no weight files in the folder)")
    text = text_config(config)
    tokenizer = None if shape is not None else load_tokenizer(name_or_path, local_files_only=True)
    return TargetFacts(int(text.vocab_size), getattr(text, "max_position_embeddings", None), tokenizer, config)


def declares_thinking(folder: str | Path) -> bool:
    """Whether a local drafter's config.json says it was trained on thinking-mode output."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    flags = (raw.get("thinking"), raw.get("supports_thinking"), (raw.get("dflash_config") or {}).get("thinking"))
    return any(bool(flag) for flag in flags)


def thinking_warning(drafter: str | None, enable_thinking: bool) -> str | None:
    """The warning to print when thinking is on and the drafter does not declare thinking support."""
    if not enable_thinking or drafter is None or declares_thinking(drafter):
        return None
    return (
        f"warning: thinking mode is on, but drafter {drafter} does not declare thinking support; published "
        "DFlash drafters were trained without thinking traces and their acceptance collapses (tau near 2)"
    )
