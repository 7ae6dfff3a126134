"""The project's Triton kernels as the torch code sees them: whether they can run here, the sizes both
sides must agree on (the memory plan reads them without importing Triton), and where they launch with
programmatic dependent launch (``dependent_launches``)."""

from __future__ import annotations

import contextlib
import functools

# ``attention_triton``: the most query rows per program, and the most splits of the keys (which it
# makes with at most 4 programs a multiprocessor in all, ``split_count``; their partial sums are
# float32 [splits, Hkv, R, D], so under 4 x multiprocessors x ROW_BLOCK rows of D)
ROW_BLOCK = 128
MAX_KEY_SPLITS = 8


def row_block(rows: int, most: int = ROW_BLOCK) -> int:
    """Query rows per program of the attention kernel for a pass of ``rows`` folded rows, at most
    ``most``: the fewest of 16, 32, 64 that hold them (a decode step's few rows need no 64-row tile),
    and 128 from 256 rows on (below that two programs of 64 rows beat one of 128:
    ``benchmarks/attention_kernels.py``)."""
    if rows >= 256 and most >= 128:
        return 128
    return min(most, 64, max(16, 1 << (max(rows, 1) - 1).bit_length()))


@functools.cache
def triton_available() -> bool:
    """Triton is installed (the only check of it: every kernel path asks here)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_dependent_launches = False


@contextlib.contextmanager
def dependent_launches(on: bool = True):
    """Inside (``on``): the Triton kernels launch with programmatic dependent launch, where the GPU has
    it (``pdl_triton``). The target's one-row pass (AR's step) captures its graph inside: its products
    are the project's own kernels, each launched early behind the one before; wider passes, where PDL
    measured slower, are captured outside (``benchmarks/pdl_ab.py``, docs/gpu.md)."""
    global _dependent_launches
    before, _dependent_launches = _dependent_launches, on
    try:
        yield
    finally:
        _dependent_launches = before


def dependent_launches_on() -> bool:
    return _dependent_launches
