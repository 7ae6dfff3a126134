"""Matrix products of a few rows (a decode step, a short verify) as one Triton kernel (CUDA only).

out [M, N] = x [M, K] @ weight [N, K]^T, or out += it in place, for M up to ``MOST_ROWS``. At so few
rows a product only streams its weight: each program reads BN whole rows of it, K in steps of BK;
one row of x is multiplied by a sum along K, more rows by a tensor-core product with x padded to 16
rows (the padding costs nothing where the weight read is the time).

Where it runs (``benchmarks/skinny_gemm.py`` times it against cuBLAS per projection of both model
shapes; results in ``benchmarks/results/wide_passes_h200.md``): the plain product of one row (a
decode step's q/k/v and gate/up), and the residual sum in place from 1 to 16 rows (a decode step's
and a short verify's o_proj and down_proj, where cuBLAS runs a split-K pass and a reduce). At one
row the sum splits K too (``split_count``): the last split of a tile to arrive adds the splits'
float32 sums in their order, so the result is the same on every call. Only on the GPUs it was timed
on (``FASTER_ON``).

The one-row product also takes the RMS norm before it (``fused_layer.norm_linear``: a decode step's
q/k/v and gate/up): the norm's scale is one number per row, so the kernel multiplies x by the norm's
weight as it streams, sums x^2 beside it, and scales the sums at the end: one kernel, not two, and no
reduction in front of the first weight load (a norm done first in each program was slower than the
two kernels: ``benchmarks/results/wide_passes_h200.md``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from workers.models.pdl_triton import launch_options, wait_for_inputs

MOST_ROWS = 16
# (rows of the weight per program, K per step, warps, pipeline stages) per class of product, tried in
# this order on each device until one compiles within its shared memory. The first are the fastest
# measured on an H200 (``benchmarks/skinny_gemm.py --grid``): one row over K <= 4096 (Qwen3-8B's
# q/k/v and gate/up) 16 x 512 x 8 warps, over K = 5120 (Qwen3.6-27B's) 16 x 256 x 4, and for the
# widest weight (its gate/up, 34816 rows) 32 x 256 x 4: with the norm inside, 16-row programs re-read
# x and the norm's weight too often; no one choice is within 10% of the best on every product. (One
# row takes no shared memory: its loads feed no tensor-core product, so they are not staged.) One row
# summed into the residual (o_proj, down_proj) 16 x 256 x 4 with K split in 4. 2-16 rows: 64 x 256 x
# 4 x 4 (120 KB), or on a GPU of less shared memory (an RTX A6000: 99 KB) 32 x 256 x 4 x 2 (24 KB;
# ``benchmarks/kernel_resources.py``).
TILES = {"one row, short": ((16, 512, 8, 4),),
         "one row": ((16, 256, 4, 4),),
         "one row, wide": ((32, 256, 4, 2),),
         "one row, summed": ((16, 256, 4, 4),),
         "few rows": ((64, 256, 4, 4), (32, 256, 4, 2))}
STEP = 256  # K must be a multiple of every step (512: only where it divides K)
WIDE = 32768  # weight rows from which a one-row product is "wide"
SUMMED_SPLITS = 4  # splits of K for one row summed into the residual (2 where 4 do not divide K in steps)
# the compute capabilities where the kernel was measured faster than cuBLAS (an H200); elsewhere (an RTX
# A6000 is 8.6) the layers keep cuBLAS until ``benchmarks/skinny_gemm.py`` shows a gain there
FASTER_ON = frozenset({(9, 0)})
_CHOSEN: dict[tuple[str, str], tuple[int, int, int, int]] = {}  # (device, class) -> tiles


def split_count(rows: int, inner: int, step: int, add: bool) -> int:
    """Splits of K: one row summed into ``out`` (a decode step's o_proj and down_proj, whose few weight
    rows make too few programs to stream at full speed; cuBLAS splits K there too) takes SUMMED_SPLITS
    (or 2) where they cut K into whole steps; the rest one (``benchmarks/skinny_gemm.py --grid`` times
    every count: 4 were the fastest or within 1% on both model shapes)."""
    if rows != 1 or not add:
        return 1
    return next((count for count in (SUMMED_SPLITS, 2) if inner % (count * step) == 0), 1)


# (device) -> int32 counts of the splits arrived per output tile, kept at 0 between calls (the last split
# resets its tile's); made outside a graph capture, so that a captured pass and eager calls share them
MOST_TILES = 1 << 14
_ARRIVED: dict[str, torch.Tensor] = {}


def arrival_counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's split counts, or None (no split then): more tiles than MOST_TILES, or first asked
    for inside a graph capture (an allocation there would belong to that graph's memory pool)."""
    counts = _ARRIVED.get(str(device))
    if counts is None and tiles <= MOST_TILES and not (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):  # asked only until they exist
        counts = _ARRIVED[str(device)] = torch.zeros(MOST_TILES, dtype=torch.int32, device=device)
    return counts if tiles <= MOST_TILES else None


def tile_class(rows: int, inner: int, width: int = 0, add: bool = False) -> str:
    """Which TILES a product of ``rows`` rows over ``inner`` (K) into ``width`` columns (N) takes;
    ``add``: summed into its output."""
    if rows > 1:
        return "few rows"
    if add:
        return "one row, summed"
    if inner <= 4096 and inner % 512 == 0:
        return "one row, short"
    return "one row, wide" if width >= WIDE else "one row"


@triton.jit
def _skinny_kernel(X, W, OUT, NORM_W, WORK, ARRIVED, N, stride_x, stride_out, eps, K: tl.constexpr,
                   M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr,
                   SPLITS: tl.constexpr, PDL: tl.constexpr):
    """Program (tile, split): output columns n = tile * BN.. of OUT [M, N] from W's rows n [., K]
    (contiguous rows) and X's M rows over the split's K / SPLITS columns (a multiple of BK); ADD: added
    to what OUT holds. NORM (one row): X's RMS norm with weight NORM_W (1: w, 2: 1 + w) taken first,
    as a product by x * w and one scale at the end, so the weight stream starts at once (the norm's
    reduction runs beside it, not before it). SPLITS > 1: each split writes its float32 sums to WORK
    ([SPLITS, N] for one row, else [SPLITS, 16, N]) and counts itself in ARRIVED[tile]; the last to
    arrive adds the splits in their order (the result does not depend on which was last) into OUT and
    sets the count back to 0."""
    wait_for_inputs(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n = tile * BN + tl.arange(0, BN)
    cols = tl.arange(0, BK)
    in_n = n < N
    begin = split * (K // SPLITS)
    w_rows = W + n[:, None].to(tl.int64) * K + begin + cols[None, :]  # [BN, BK] pointers to the first step
    if M == 1:
        acc = tl.zeros((BN,), dtype=tl.float32)
        squares = tl.zeros((BK,), dtype=tl.float32)
        for step in range(K // SPLITS // BK):
            w = tl.load(w_rows + step * BK, mask=in_n[:, None], other=0.0).to(tl.float32)
            x = tl.load(X + begin + step * BK + cols).to(tl.float32)
            if NORM > 0:
                squares += x * x
                scale = tl.load(NORM_W + step * BK + cols).to(tl.float32)
                if NORM == 2:
                    scale += 1.0
                x = x * scale
            acc += tl.sum(w * x[None, :], axis=1)
        if NORM > 0:  # sum_k w[n,k] x[k] s w_k = s * sum_k w[n,k] (x[k] w_k), s = rsqrt(mean(x^2) + eps)
            acc = acc * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        out = OUT + n
        keep = in_n
        part = WORK + n  # split 0's sums [N]; split s's at + s * N
        split_stride = N
    else:
        m = tl.arange(0, 16)
        x_rows = X + m[:, None] * stride_x + begin + cols[None, :]
        acc = tl.zeros((BN, 16), dtype=tl.float32)
        for step in range(K // SPLITS // BK):
            w = tl.load(w_rows + step * BK, mask=in_n[:, None], other=0.0)
            x = tl.load(x_rows + step * BK, mask=m[:, None] < M, other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
        out = OUT + m[None, :] * stride_out + n[:, None]  # [BN, 16]
        keep = in_n[:, None] & (m[None, :] < M)
        part = WORK + m[None, :] * N + n[:, None]  # split 0's sums [16, N]
        split_stride = 16 * N
    if SPLITS > 1:
        tl.store(part + split * split_stride, acc, mask=keep)
        tl.debug_barrier()  # every thread's sums stored before the count says so (the atomic releases them)
        if tl.atomic_add(ARRIVED + tile, 1, sem="acq_rel") == SPLITS - 1:
            acc = tl.load(part, mask=keep, other=0.0, cache_modifier=".cg")  # from L2: other SMs wrote them
            for other in tl.static_range(1, SPLITS):
                acc += tl.load(part + other * split_stride, mask=keep, other=0.0, cache_modifier=".cg")
            if ADD:
                acc += tl.load(out, mask=keep, other=0.0).to(tl.float32)
            tl.store(out, acc.to(OUT.dtype.element_ty), mask=keep)
            tl.atomic_xchg(ARRIVED + tile, 0)  # ready for the next call (a graph replays it as it is)
    else:
        if ADD:
            acc += tl.load(out, mask=keep, other=0.0).to(tl.float32)
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=keep)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the layers give this product to the kernel: CUDA on a GPU of FASTER_ON, half precision,
    1..MOST_ROWS rows (contiguous along K), a contiguous weight whose K the steps divide."""
    rows, inner = x.shape
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and 1 <= rows <= MOST_ROWS and x.stride(1) == 1 and weight.is_contiguous() and inner % STEP == 0
            and capability(x.device) in FASTER_ON)


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                  tiles: tuple[int, int, int, int] | None = None,
                  norm: tuple[torch.Tensor, float, bool] | None = None, splits: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N]; with ``out`` [M, N] the product is added into it in place (and
    returned). ``tiles``: (weight rows per program, K per step, warps, stages); None: TILES'. ``norm``
    (one row, no ``out``): (norm weight [K], eps, one_plus): the product of x's RMS norm, x * rsqrt(mean(x^2)
    + eps) * w (one_plus: * (1 + w)), not rounded between norm and product. ``splits`` of K (None:
    ``split_count``'s). Callers check ``takes`` first."""
    rows, inner = x.shape
    width = weight.shape[0]
    add = out is not None
    if norm is not None and (rows != 1 or add or (splits or 1) > 1):
        raise ValueError("skinny_linear: a norm is taken for one row without out= or splits only")
    norm_weight, eps, one_plus = norm if norm is not None else (x, 0.0, False)  # (x: an unread placeholder)
    norm_kind = 0 if norm is None else 2 if one_plus else 1
    if out is None:
        out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    key = (str(x.device), tile_class(rows, inner, width, add))
    choices = (tiles,) if tiles else (_CHOSEN[key],) if key in _CHOSEN else TILES[key[1]]
    for index, (block_n, block_k, warps, stages) in enumerate(choices):
        tile_count = triton.cdiv(width, block_n)
        count = splits or split_count(rows, inner, block_k, add)
        if inner % (count * block_k):
            raise ValueError(f"skinny_linear: {count} splits of K = {inner} in steps of {block_k}")
        arrived = arrival_counts(x.device, tile_count) if count > 1 else None
        if arrived is None:
            count = 1
        work = (torch.empty(count, 1 if rows == 1 else 16, width, dtype=torch.float32, device=x.device)
                if count > 1 else out)
        try:
            _skinny_kernel[(tile_count, count)](
                x, weight, out, norm_weight, work, arrived if arrived is not None else out, width, x.stride(0),
                out.stride(0), eps, K=inner, M=rows, BN=block_n, BK=block_k, ADD=add, NORM=norm_kind,
                SPLITS=count, num_warps=warps, num_stages=stages, **launch_options(x.device),
            )
        except OutOfResources:  # raised when compiling, before any launch (``out`` untouched): the next tiles
            if index + 1 < len(choices):
                continue
            raise
        if tiles is None:
            _CHOSEN[key] = choices[index]
        return out
    raise AssertionError("unreachable: the loop returns or raises")
