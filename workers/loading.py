"""Loading the target model (and its tokenizer) onto one device or split over several GPUs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from workers.errors import BadInputError
from workers.target import check_supported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """Where the target goes.

    device:     "cpu", "cuda", "cuda:N" or "auto" (cuda when available, else cpu) for one device;
    gpus:       when > 1, split the target over that many visible GPUs with accelerate's
                device_map="auto" (layers kept whole), leaving ``max_memory_per_gpu`` as the cap per
                GPU so caches and tree buffers have headroom.
    """

    device: str = "auto"
    gpus: int = 1
    max_memory_per_gpu: str | None = None

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BadInputError(f"--device {self.device}: no CUDA device is visible on this machine")
        return device

    def from_pretrained_kwargs(self) -> dict:
        device = self.resolve_device()
        if device.type != "cuda" or self.gpus <= 1:
            return {"device_map": {"": device}}
        visible = torch.cuda.device_count()
        if visible < self.gpus:
            raise BadInputError(f"placement asks for {self.gpus} GPUs but only {visible} are visible")
        cap = self.max_memory_per_gpu or f"{int(torch.cuda.get_device_properties(0).total_memory * 0.9 / 2**30)}GiB"
        return {"device_map": "auto", "max_memory": {i: cap for i in range(self.gpus)}}


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
    """AutoModelForCausalLM from a hub id or a local folder, checked to be an architecture we run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(name_or_path, local_files_only=local_files_only)
    except Exception as exc:  # missing folder, no hub access, bad config: one message for the user
        where = "folder" if Path(name_or_path).exists() else "model id or folder"
        raise BadInputError(f"{name_or_path}: cannot load the target config from this {where} ({exc})") from exc
    check_supported(config)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path,
        dtype=parse_dtype(dtype),
        attn_implementation=attn_implementation,
        local_files_only=local_files_only,
        **placement.from_pretrained_kwargs(),
    )
    return model.eval()


def load_tokenizer(name_or_path: str, local_files_only: bool = False):
    """The target's tokenizer, or None for a model folder that ships none (prompts then give ids)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only)
    except Exception:  # no tokenizer files: callers fall back to {"input_ids": [...]} prompts
        return None
