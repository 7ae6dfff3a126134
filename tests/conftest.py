"""Shared fixtures: tiny random checkpoints written to a temp folder once per test session."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from tools.tiny import TinyShape, write_tiny_pair  # noqa: E402
from workers.models.drafter import DFlashDrafter
from workers.models.loading import (  # noqa: E402
    Placement,
    load_drafter,  # noqa: E402
    load_target,
)
from workers.models.runner.target import make_target  # noqa: E402

TINY = TinyShape()  # vocab 32, 4 target layers, 2 drafter layers, block 8; every drafter layer sees everything
# The drafter of the user's real pair (z-lab/Qwen3.6-27B-DFlash) mixes causal sliding-window layers with
# a full one; here with a window of 8, shorter than most contexts of the tests, so the window binds.
MIXED_DRAFTER = {"drafter_layer_types": ("sliding_attention", "full_attention"), "drafter_window": 8}
TINY_SMALL_VOCAB = TinyShape(vocab_size=6, block_size=6, **MIXED_DRAFTER)  # chains get accepted often
# Hybrid targets (GDN + attention layers): Qwen3.5 with a small vocabulary so drafts are
# accepted often, and Qwen3-Next (fused projections, MoE MLPs) at the default vocabulary, whose
# drafter makes every layer sliding and non-causal (dflash_config.use_swa, as MiMo's drafters do).
TINY_HYBRID = TinyShape(vocab_size=6, block_size=6, arch="qwen3_5", **MIXED_DRAFTER)
TINY_HYBRID_KERNELS = replace(TINY_HYBRID, gdn_head_dim=16)  # the GDN kernels' tiles fit
TINY_NEXT = TinyShape(arch="qwen3_next", drafter_window=12, drafter_use_swa=True)
# DFlash2 drafters (convolutions, candidate selector) laid out as the published one: every layer sliding
# and non-causal (is_causal false), here with a window of 8; on a Qwen3 target and on a Qwen3.5 hybrid.
DFLASH2_DRAFTER = {"dflash2": True, "drafter_layer_types": ("sliding_attention", "sliding_attention"),
                   "drafter_window": 8, "drafter_causal": False}
TINY_DFLASH2 = TinyShape(vocab_size=6, block_size=6, **DFLASH2_DRAFTER)
TINY_HYBRID_DFLASH2 = TinyShape(vocab_size=6, block_size=6, arch="qwen3_5", **DFLASH2_DRAFTER)


@dataclass
class TinyModels:
    shape: TinyShape
    target_dir: Path
    drafter_dir: Path
    model: torch.nn.Module
    drafter: DFlashDrafter
    target: object  # a StaticTarget (workers.models.runner.target.make_target)


def _load(shape: TinyShape, folder: Path) -> TinyModels:
    target_dir, drafter_dir = write_tiny_pair(folder, shape)
    model = load_target(str(target_dir), dtype="float32", placement=Placement(device="cpu"))
    drafter = load_drafter(str(drafter_dir), model)
    return TinyModels(shape, target_dir, drafter_dir, model, drafter, make_target(model, drafter.spec.target_layer_ids))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    """Float32 CPU target + drafter (vocab 32, block 8), loaded through the real loading code."""
    return _load(TINY, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_small_vocab(tmp_path_factory) -> TinyModels:
    """Same, with a 6-token vocabulary and block 6, so random drafts are often accepted."""
    return _load(TINY_SMALL_VOCAB, tmp_path_factory.mktemp("tiny_small_vocab"))


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory) -> TinyModels:
    """A Qwen3.5-style hybrid target (vocab 6, block 6) and its drafter, float32 on CPU."""
    return _load(TINY_HYBRID, tmp_path_factory.mktemp("tiny_hybrid"))


@pytest.fixture(scope="session")
def tiny_hybrid_kernels(tmp_path_factory) -> TinyModels:
    """``tiny_hybrid`` with GDN heads of 16, where the Triton GDN kernels' tiles fit (at 8 a CUDA hybrid
    runs the torch forms)."""
    return _load(TINY_HYBRID_KERNELS, tmp_path_factory.mktemp("tiny_hybrid_kernels"))


@pytest.fixture(scope="session")
def tiny_next(tmp_path_factory) -> TinyModels:
    """A Qwen3-Next-style hybrid target with MoE MLPs (vocab 32, block 8) and its drafter."""
    return _load(TINY_NEXT, tmp_path_factory.mktemp("tiny_next"))


@pytest.fixture(scope="session")
def tiny_dflash2(tmp_path_factory) -> TinyModels:
    """A Qwen3 target (vocab 6, block 6) with a DFlash2 drafter, float32 on CPU."""
    return _load(TINY_DFLASH2, tmp_path_factory.mktemp("tiny_dflash2"))


@pytest.fixture(scope="session")
def tiny_hybrid_dflash2(tmp_path_factory) -> TinyModels:
    """A Qwen3.5-style hybrid target (vocab 6, block 6) with a DFlash2 drafter, float32 on CPU."""
    return _load(TINY_HYBRID_DFLASH2, tmp_path_factory.mktemp("tiny_hybrid_dflash2"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices gain nothing from intra-op threads; one thread is as fast and leaves a core free."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
