"""Where a model name points, decided without torch: ``random:<shape>`` (random weights of a named
shape), a folder on this machine, or a hub id; whether it must come from this machine only; and
whether it is here at all (checked before a sweep creates anything, in seconds).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from workers.errors import BadInputError

RANDOM_PREFIX = "random:"


@dataclass(frozen=True)
class ModelSource:
    """A model name as the user gave it: ``random:<shape>`` (random weights of a named shape,
    ``workers.models.shapes``), a local folder, or a hub id."""

    name: str
    shape: str | None = None  # set for random:<shape>

    @classmethod
    def parse(cls, name: str) -> ModelSource:
        if name.startswith(RANDOM_PREFIX):
            return cls(name, name.removeprefix(RANDOM_PREFIX))
        return cls(name)

    @property
    def is_random(self) -> bool:
        return self.shape is not None


def local_only(local_files_only: bool = False) -> bool:
    """Whether models must come from this machine: asked for, or ``HF_HUB_OFFLINE=1`` in the
    environment (honoured as the hub client honours it). Then nothing tries the network, so a missing
    file fails at once instead of after the hub client's retries."""
    return local_files_only or os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "org/name"


def looks_local(name: str) -> bool:
    """A model name that can only mean a folder here: absolute, ``./``, ``../``, ``~``, or not a hub id."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or not _HUB_ID.match(name)


def check_model_available(name: str, role: str, local_files_only: bool = False) -> None:
    """One clear error, at once and without the network, for a model that cannot be had: a folder
    name that is not there, or (models from this machine only) a hub id the local cache lacks.
    ``role`` names the model in the message ("target", "drafter")."""
    if ModelSource.parse(name).is_random:
        return
    folder = Path(name).expanduser()
    if folder.exists():
        if not folder.is_dir():
            raise BadInputError(f"{role} {name}: not a folder")
        return
    if looks_local(name):
        raise BadInputError(f"{role} {name}: no such folder")
    if local_only(local_files_only):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise BadInputError(
                f"{role} {name}: not in this machine's Hugging Face cache, and models must come from this machine "
                "(local_files_only / HF_HUB_OFFLINE=1): download it first (huggingface-cli download) or give its folder"
            )


def cached_config_file(name: str) -> Path | None:
    """A model's config.json when it is on this machine (its folder, or the local hub cache), else
    None; never touches the network."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder / "config.json"
    if looks_local(name):
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json")
    return Path(found) if isinstance(found, str) else None
