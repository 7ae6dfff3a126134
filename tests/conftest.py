"""Shared fixtures: tiny random checkpoints written to a temp folder once per test session."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from workers.drafter import DFlashDrafter, load_drafter  # noqa: E402
from workers.loading import Placement, load_target  # noqa: E402
from workers.target import AttentionTarget  # noqa: E402
from workers.tiny import TinyShape, write_tiny_pair  # noqa: E402

TINY = TinyShape()  # vocab 32, 4 target layers, 2 drafter layers, block 8
TINY_SMALL_VOCAB = TinyShape(vocab_size=6, block_size=6)  # chains get accepted often


@dataclass
class TinyModels:
    shape: TinyShape
    target_dir: Path
    drafter_dir: Path
    model: torch.nn.Module
    drafter: DFlashDrafter
    target: AttentionTarget


def _load(shape: TinyShape, folder: Path) -> TinyModels:
    target_dir, drafter_dir = write_tiny_pair(folder, shape)
    model = load_target(str(target_dir), dtype="float32", placement=Placement(device="cpu"))
    drafter = load_drafter(str(drafter_dir), model)
    return TinyModels(shape, target_dir, drafter_dir, model, drafter, AttentionTarget(model, drafter.spec.target_layer_ids))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    """Float32 CPU target + drafter (vocab 32, block 8), loaded through the real loading code."""
    return _load(TINY, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_small_vocab(tmp_path_factory) -> TinyModels:
    """Same, with a 6-token vocabulary and block 6, so random drafts are often accepted."""
    return _load(TINY_SMALL_VOCAB, tmp_path_factory.mktemp("tiny_small_vocab"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices gain nothing from intra-op threads; one thread is as fast and leaves a core free."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
