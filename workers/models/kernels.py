"""The project's Triton kernels as the torch code sees them: whether they can run here, and the sizes
both sides must agree on (the memory plan reads them without importing Triton)."""

from __future__ import annotations

import functools

# ``attention_triton``: query rows per program, and the most splits of the keys (which it makes only
# while programs are fewer than twice the GPU's multiprocessors; their partial sums are float32
# [splits, Hkv, R, D], so under 4 x multiprocessors x ROW_BLOCK rows of D)
ROW_BLOCK = 64
MAX_KEY_SPLITS = 8


@functools.cache
def triton_available() -> bool:
    """Triton is installed (the only check of it: every kernel path asks here)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
