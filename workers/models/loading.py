"""Loading the target model (and its tokenizer) onto one device or split over several GPUs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from workers.errors import BadInputError, UnsupportedModelError
from workers.seam import check_supported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """Where the target goes.

    device:     "cpu", "cuda", "cuda:N" or "auto" (cuda when available, else cpu) for one device;
    gpus:       when > 1, split the target over that many visible GPUs (``workers.models.placement``:
                layers kept whole, headroom reserved for caches, tree buffers and the drafter, which
                goes with the last layers and lm_head); ``max_memory_per_gpu`` optionally caps the
                weights per GPU further.
    drafter_bytes: the drafter's weight bytes, reserved on the GPU that gets lm_head.
    """

    device: str = "auto"
    gpus: int = 1
    max_memory_per_gpu: str | None = None
    drafter_bytes: int = 0

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BadInputError(f"--device {self.device}: no CUDA device is visible on this machine")
        return device

    def from_pretrained_kwargs(self, config=None, dtype: torch.dtype = torch.bfloat16) -> dict:
        device = self.resolve_device()
        if device.type != "cuda" or self.gpus <= 1:
            return {"device_map": {"": device}}
        from accelerate.utils import convert_file_size_to_int

        from workers.models.placement import plan_split

        visible = torch.cuda.device_count()
        if visible < self.gpus:
            raise BadInputError(f"placement asks for {self.gpus} GPUs but only {visible} are visible")
        sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(self.gpus)]
        cap = convert_file_size_to_int(self.max_memory_per_gpu) if self.max_memory_per_gpu else None
        plan = plan_split(config, sizes, dtype, drafter_bytes=self.drafter_bytes, weight_cap=cap)
        return {"device_map": plan.device_map}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise BadInputError(f"dtype '{name}' is not one of {', '.join(DTYPES)}") from None


def load_target(
    name_or_path: str,
    dtype: str = "bfloat16",
    placement: Placement = Placement(),
    attn_implementation: str = "sdpa",
    local_files_only: bool = False,
) -> nn.Module:
    """AutoModelForCausalLM from a hub id or a local folder, checked to be an architecture we run.

    ``random:<shape>`` (``workers.models.shapes``) builds that shape with random weights on the device instead.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.models.shapes import build_random_target, random_shape_name

    try:
        shape = random_shape_name(name_or_path)
    except KeyError as exc:
        raise BadInputError(f"target {name_or_path}: {exc.args[0]}") from None
    if shape is not None:
        if placement.gpus > 1:
            raise BadInputError(f"target {name_or_path}: random-weight shapes are built on one device")
        return build_random_target(shape, parse_dtype(dtype), placement.resolve_device())

    try:
        config = AutoConfig.from_pretrained(name_or_path, local_files_only=local_files_only)
    except Exception as exc:  # missing folder, no hub access, bad config: one message for the user
        where = "folder" if Path(name_or_path).exists() else "model id or folder"
        raise BadInputError(f"{name_or_path}: cannot load the target config from this {where} ({exc})") from exc
    try:
        check_supported(config)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{name_or_path}: {exc}") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path,
            dtype=parse_dtype(dtype),
            attn_implementation=attn_implementation,
            local_files_only=local_files_only,
            **placement.from_pretrained_kwargs(config, parse_dtype(dtype)),
        )
    except OSError as exc:  # weight files missing, unreadable or not on the hub: the user's input, not a crash
        raise BadInputError(f"{name_or_path}: cannot load the target weights ({exc})") from exc
    return model.eval()


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

    if name_or_path.startswith("random:") or not has_tokenizer_files(name_or_path, local_files_only):
        return None
    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only)
    except Exception:  # unreadable tokenizer files: callers fall back to {"input_ids": [...]} prompts
        return None


@dataclass(frozen=True)
class TargetFacts:
    """What prompts are checked against before anything starts: the embedding rows and positions."""

    vocab_rows: int
    max_positions: int | None
    tokenizer: object | None


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.pth")


def target_facts(name_or_path: str) -> TargetFacts | None:
    """The target's vocabulary size, positions and tokenizer without loading its weights, checked as
    the worker would check them (architecture supported, weight files present in a local folder).

    None when the target is not on this machine (a hub id that is not in the local cache): the
    worker checks it after loading. Never touches the network.
    """
    from transformers import AutoConfig

    from workers.models.shapes import random_shape_name, target_config
    from workers.seam import text_config

    try:
        shape = random_shape_name(name_or_path)
    except KeyError as exc:
        raise BadInputError(f"target {name_or_path}: {exc.args[0]}") from None
    folder = Path(name_or_path)
    if shape is not None:
        config = target_config(shape)
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
    return TargetFacts(int(text.vocab_size), getattr(text, "max_position_embeddings", None), tokenizer)
