"""Where models come from: the target (and its tokenizer) onto one device or split over several
GPUs, DFlash drafter checkpoints (z-lab layout) into the project's own module, and random-weight
models of a named shape. A model name is decided once by ``ModelSource.parse``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from workers.errors import BadInputError, CheckpointMismatchError, UnsupportedModelError
from workers.models.drafter import DFlashDrafter
from workers.models.drafter2 import drafter_for
from workers.models.drafter_config import DrafterSpec
from workers.models.sources import ModelSource, local_only
from workers.seam import check_supported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


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

    from workers.models.shapes import build_random_target

    source = ModelSource.parse(name_or_path)
    if source.is_random:
        if placement.gpus > 1:
            raise BadInputError(f"target {name_or_path}: random-weight shapes are built on one device")
        try:
            return build_random_target(source.shape, parse_dtype(dtype), placement.resolve_device())
        except KeyError as exc:
            raise BadInputError(f"target {name_or_path}: {exc.args[0]}") from None

    local_files_only = local_only(local_files_only)
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


# -- DFlash drafter checkpoints ------------------------------------------------------------------
def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint; any damage names the file."""
    single, index = path / WEIGHTS_FILE, path / WEIGHTS_INDEX_FILE
    if single.exists():
        files = [single]
    elif index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointMismatchError(f"{index}: not a valid safetensors index ({exc!r})") from exc
        files = [path / shard for shard in shards]
    else:
        raise CheckpointMismatchError(f"{path}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} in the drafter folder")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(file))
        except Exception as exc:  # missing shard, truncated or corrupt file: safetensors raises several types
            raise CheckpointMismatchError(f"{file}: cannot read drafter weights ({exc})") from exc
    return weights


def resolve_checkpoint_dir(name_or_path: str, local_files_only: bool = False) -> Path:
    """A local folder as it is, otherwise a hub repo id fetched (config + safetensors only)."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.exists() or name_or_path.startswith((".", "/", "~")):
        raise CheckpointMismatchError(f"{name_or_path}: drafter path is not a folder")
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name_or_path, allow_patterns=["config.json", "*.safetensors", "*.json"],
                                   local_files_only=local_only(local_files_only))
    except Exception as exc:  # hub errors come in many types; one message is what the user needs
        raise CheckpointMismatchError(f"{name_or_path}: cannot find the drafter locally or on the hub ({exc})") from exc
    return Path(folder)


def load_drafter(
    name_or_path: str,
    target: nn.Module,
    device: torch.device | str | None = None,
    local_files_only: bool = False,
) -> DFlashDrafter:
    """Load a z-lab drafter checkpoint into DFlashDrafter (DFlash2Drafter for a DFlash2 one), checked
    against the target.

    The drafter takes the target's dtype and, unless told otherwise, the device of the target's
    lm_head (it feeds that lm_head every round). ``random:<shape>`` builds a random-weight drafter
    of that target shape (``workers.models.shapes``).
    """
    source = ModelSource.parse(name_or_path)
    if source.is_random:
        from workers.models.shapes import build_random_drafter

        try:
            return build_random_drafter(source.shape, target)
        except KeyError as exc:
            raise CheckpointMismatchError(f"drafter {name_or_path}: {exc.args[0]}") from None
    folder = resolve_checkpoint_dir(name_or_path, local_files_only)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointMismatchError(f"{folder}: no config.json in the drafter folder")
    spec = DrafterSpec.from_config_file(config_path)
    embeddings = target.get_input_embeddings().weight
    spec.check_fits(target.config, embedding_rows=embeddings.shape[0], source=str(config_path))

    drafter = drafter_for(spec)
    weights = _read_weights(folder)
    if weights and all(key.startswith("model.") for key in weights):
        weights = {key.removeprefix("model."): value for key, value in weights.items()}
    separate = sorted(key for key in weights if "mask_embedding" in key)
    if separate:  # MiMo-style drafters embed MASK with their own vector instead of the target's row
        raise CheckpointMismatchError(
            f"{folder}: the drafter ships its own mask embedding ({separate[0]}); a separate MASK embedding is "
            "not implemented here (the block's MASK slots take the target's embedding of mask_token_id)"
        )
    expected = {k for k in drafter.state_dict() if not k.startswith("rotary_emb.")}
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"{folder}: drafter weights in {WEIGHTS_FILE} do not match config.json "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''})"
        )
    own = drafter.state_dict()
    for key, value in weights.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise CheckpointMismatchError(
                f"{folder}/{WEIGHTS_FILE}: weight '{key}' has shape {tuple(value.shape)}, "
                f"config.json implies {tuple(own[key].shape)}"
            )
    drafter.load_state_dict(weights, strict=False)  # rotary buffers are computed, not stored
    lm_head = target.get_output_embeddings().weight
    return drafter.to(device=device or lm_head.device, dtype=lm_head.dtype).eval()


def save_drafter(drafter: DFlashDrafter, folder: Path, raw_config: dict[str, Any]) -> None:
    """Write a drafter in the z-lab layout (used to make tiny offline checkpoints)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw_config, indent=2))
    state = {k: v.contiguous() for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    save_file(state, folder / WEIGHTS_FILE)
