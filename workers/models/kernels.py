"""The project's Triton kernels as the torch code sees them: whether they can run here, the sizes both
sides must agree on (the memory plan reads them without importing Triton), and where they launch with
programmatic dependent launch (``dependent_launches``)."""

from __future__ import annotations

import contextlib
import functools

import torch

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


# (owner, device) -> int32 counts of the parts arrived per output tile, kept at 0 between calls (the last
# part to arrive merges the tile and resets its count). Made outside a graph capture, so that a captured pass
# and eager calls share them. Each owner's kernels run one at a time per device (a pass's layers in order;
# the commit that runs beside the next draft takes neither a product of few rows nor attention), so one
# buffer per owner serves all its calls.
MOST_TILES = 1 << 14
_ARRIVED: dict[tuple[str, str], torch.Tensor] = {}


def arrival_counts(owner: str, device: torch.device, tiles: int) -> torch.Tensor | None:
    """``owner``'s counts on this device, or None (no merge by the last part then): more tiles than
    MOST_TILES, or first asked for inside a graph capture (an allocation there would belong to that graph's
    memory pool)."""
    counts = _ARRIVED.get((owner, str(device)))
    if counts is None and tiles <= MOST_TILES and not (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):  # asked only until they exist
        counts = _ARRIVED[(owner, str(device))] = torch.zeros(MOST_TILES, dtype=torch.int32, device=device)
    return counts if tiles <= MOST_TILES else None
