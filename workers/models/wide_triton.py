"""Matrix products of a wide verify pass (a DDTree tree of 256 nodes and its root: 257 rows) as one
Triton kernel (CUDA only).

out [M, N] = x [M, K] @ weight [N, K]^T, or out += it in place, for M from ``FEWEST_ROWS`` to
``MOST_ROWS``. cuBLAS runs far from its floor here (``benchmarks/projection_gemms.py``): the output
projections' outputs (257 x 4096-5120) make fewer tiles than the GPU has SMs, and the 257th row costs
a whole tile of rows. So each program computes the transposed tile, BN weight rows against BM rows
of x (the weight is the tensor-core product's left operand, "swap AB"), the last block of rows takes
up to TAIL more rows in a second, 16-wide product beside it instead of a block of its own, and K may
be split over ``splits`` programs per tile. As in ``skinny_triton``, each split writes its float32
sums aside and counts itself in a per-tile counter; the last split to arrive adds the splits in their
order (so the bits do not depend on which finished last) into the output and sets the counter back
to 0. x and the weight come by TMA (tensor descriptors).

Where it runs: nowhere yet. The layers hand it products only on the GPUs where it was timed faster
than cuBLAS (``FASTER_ON``), and on an H200 it lost in every tile choice and split count
(``benchmarks/wide_gemm.py --grid``; the figures and why in
``benchmarks/results/wide_passes_h200.md``): at 257 rows a split's float32 sums are 2 x splits x M / K
of the weight's bytes, and without splits the tiles small enough to fill the SMs keep the tensor
cores half idle. It stays as the tested starting point of the next try (a persistent, warp-specialised
kernel); ``benchmarks/gpu_speed.py --wide-triton`` runs a pass with it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from workers.models.pdl_triton import launch_options, wait_for_inputs
from workers.models.skinny_triton import arrival_counts

FEWEST_ROWS, MOST_ROWS = 256, 272  # a 256-node tree with or without its root (B = 255 or 256), up to a tail
TAIL = 16  # rows the last block takes beside its BM (the tensor cores' narrowest product)
# (weight rows per program BN, x rows per block BM, K per step BK, warps, stages): the choice timed at
# 2048 rows too; at 257 the grid's best differ per product (none beat cuBLAS)
TILES = (128, 256, 64, 8, 3)
STEP = 64  # K must be a multiple of every BK
# the compute capabilities where the layers hand it their products: none (see the module's docstring)
FASTER_ON: frozenset[tuple[int, int]] = frozenset()


@triton.jit
def _wide_kernel(x_desc, tail_desc, w_desc, OUT, WORK, ARRIVED, M, N, K, splits, stride_out,
                 BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, TAIL: tl.constexpr, ADD: tl.constexpr,
                 SPLIT: tl.constexpr, PDL: tl.constexpr):
    """Program (tile, block, split): OUT [M, N]'s columns n = tile * BN.. and rows m = block * BM..
    (plus the TAIL rows after them when TAIL > 0: the last block) from the weight's rows n (w_desc:
    [N, K] in [BN, BK] blocks) and x's rows m (x_desc: [M, K] in [BM, BK] blocks; tail_desc in [TAIL,
    BK] blocks) over this split's share of the K / BK steps; ADD: added to what OUT holds. The blocks
    come by TMA (rows past M read as zeros). SPLIT: the sums go through WORK [splits, M, N] float32 and
    the per-tile count ARRIVED[block * tiles + tile]; the last split to arrive adds them in order into
    OUT and sets the count back to 0."""
    wait_for_inputs(PDL)
    tile = tl.program_id(0)
    block = tl.program_id(1)
    split = tl.program_id(2)
    n = tile * BN + tl.arange(0, BN)
    m = block * BM + tl.arange(0, BM)
    in_n = n < N
    in_m = m < M
    steps = K // BK
    first = split * steps // splits
    last = (split + 1) * steps // splits
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if TAIL > 0:
        t = (block + 1) * BM + tl.arange(0, TAIL)
        in_t = (t < M) & (block == tl.num_programs(1) - 1)  # (the last block's; the others' products are lost)
        tail = tl.zeros((BN, TAIL), dtype=tl.float32)
    for step in range(first, last):
        w = w_desc.load([tile * BN, step * BK])  # [BN, BK]
        acc = tl.dot(w, x_desc.load([block * BM, step * BK]).T, acc)  # [BN, BK] @ [BK, BM]
        if TAIL > 0:
            tail = tl.dot(w, tail_desc.load([(block + 1) * BM, step * BK]).T, tail)
    out = OUT + m[None, :] * stride_out + n[:, None]  # [BN, BM]: out^T
    keep = in_n[:, None] & in_m[None, :]
    if TAIL > 0:
        tail_out = OUT + t[None, :] * stride_out + n[:, None]
        tail_keep = in_n[:, None] & in_t[None, :]
    if SPLIT:
        part = WORK + m[None, :].to(tl.int64) * N + n[:, None]  # split 0's sums; split s's at + s * M * N
        tl.store(part + split * M * N, acc, mask=keep)
        if TAIL > 0:
            tail_part = WORK + t[None, :].to(tl.int64) * N + n[:, None]
            tl.store(tail_part + split * M * N, tail, mask=tail_keep)
        tl.debug_barrier()  # every thread's sums stored before the count says so (the atomic releases them)
        counter = ARRIVED + block * tl.num_programs(0) + tile
        if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
            # the last to arrive re-reads its own sums too, CHUNK rows at a time (no second [BN, BM] tile
            # in registers beside acc)
            _sum_splits(WORK, OUT, block * BM, M, M, n, in_n, N, splits, stride_out, BM, ADD)
            if TAIL > 0:
                _sum_splits(WORK, OUT, (block + 1) * BM, M, tl.where(block == tl.num_programs(1) - 1, M, 0), n,
                            in_n, N, splits, stride_out, TAIL, ADD)
            tl.atomic_xchg(counter, 0)  # ready for the next call (a graph replays it as it is)
    else:
        _store(acc, out, keep, ADD)
        if TAIL > 0:
            _store(tail, tail_out, tail_keep, ADD)


@triton.jit
def _sum_splits(WORK, OUT, first_row, M, end, n, in_n, N, splits, stride_out, ROWS: tl.constexpr,
                ADD: tl.constexpr, CHUNK: tl.constexpr = 16):
    """OUT's rows first_row.. (ROWS of them, those below ``end``) and columns n = the splits' sums in
    WORK [splits, M, N] added in their order (and to OUT with ADD), CHUNK rows at a time."""
    for chunk in tl.static_range(0, ROWS, CHUNK):
        rows = first_row + chunk + tl.arange(0, CHUNK)
        keep = (rows < end)[:, None] & in_n[None, :]
        part = WORK + rows[:, None].to(tl.int64) * N + n[None, :]  # [CHUNK, BN], n contiguous
        total = tl.load(part, mask=keep, other=0.0, cache_modifier=".cg")  # from L2: other SMs wrote them
        for other in range(1, splits):
            total += tl.load(part + other * M * N, mask=keep, other=0.0, cache_modifier=".cg")
        _store(total, OUT + rows[:, None] * stride_out + n[None, :], keep, ADD)


@triton.jit
def _store(acc, out, keep, ADD: tl.constexpr):
    """acc (float32) into the pointers ``out`` where ``keep``, added to what they hold with ADD."""
    if ADD:
        acc += tl.load(out, mask=keep, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out.dtype.element_ty), mask=keep)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the layers give this product to the kernel: CUDA on a GPU of FASTER_ON, half precision,
    FEWEST_ROWS..MOST_ROWS rows (contiguous along K, 16-byte aligned as TMA reads them), a contiguous
    weight whose K the steps divide."""
    rows, inner = x.shape
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and FEWEST_ROWS <= rows <= MOST_ROWS and x.stride(1) == 1 and weight.is_contiguous()
            and x.data_ptr() % 16 == 0 == weight.data_ptr() % 16
            and x.stride(0) * x.element_size() % 16 == 0
            and inner % STEP == 0 and capability(x.device) in FASTER_ON)


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def processors(device: torch.device) -> int:
    """The device's SMs (the interpreter's CPU: as many as an H200, so that its tests split as one does)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def blocks_of(rows: int, block_m: int) -> tuple[int, int]:
    """(blocks of block_m rows, tail): the rows past the last whole block go in a TAIL-row tail when there
    are at most TAIL of them, else in one more (masked) block."""
    blocks, left = divmod(rows, block_m)
    if left == 0:
        return blocks, 0
    if left <= TAIL and blocks > 0:
        return blocks, TAIL
    return blocks + 1, 0


def split_count(tiles: int, steps: int, device: torch.device) -> int:
    """Splits of K per tile: as many as keep the programs within one wave of the device's SMs (the
    output projections' 257 x 4096-5120 outputs are 32-40 tiles of 128 columns on 132 SMs), at least 8
    steps each."""
    return max(1, min(processors(device) // tiles, steps // 8))


def wide_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                tiles: tuple[int, int, int, int, int] | None = None, splits: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N]; with ``out`` [M, N] the product is added into it in place (and
    returned). ``tiles``: (BN, BM, BK, warps, stages), None: TILES. ``splits`` of K (None:
    ``split_count``'s). Callers check ``takes`` first."""
    rows, inner = x.shape
    width = weight.shape[0]
    block_n, block_m, block_k, warps, stages = tiles or TILES
    if inner % block_k:
        raise ValueError(f"wide_linear: K = {inner} is not a multiple of the step {block_k}")
    add = out is not None
    if out is None:
        out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    blocks, tail = blocks_of(rows, block_m)
    tile_count = triton.cdiv(width, block_n)
    steps = inner // block_k
    count = splits or split_count(tile_count * blocks, steps, x.device)
    if not 1 <= count <= steps:
        raise ValueError(f"wide_linear: {count} splits of {steps} steps of K")
    arrived = arrival_counts(x.device, tile_count * blocks) if count > 1 else None
    if arrived is None:
        count = 1
    work = torch.empty(count, rows, width, dtype=torch.float32, device=x.device) if count > 1 else out
    x_blocks = TensorDescriptor.from_tensor(x, [block_m, block_k])
    tail_blocks = TensorDescriptor.from_tensor(x, [TAIL, block_k]) if tail else x_blocks
    _wide_kernel[(tile_count, blocks, count)](
        x_blocks, tail_blocks, TensorDescriptor.from_tensor(weight, [block_n, block_k]), out, work,
        arrived if arrived is not None else out, rows, width, inner, count, out.stride(0), BN=block_n, BM=block_m,
        BK=block_k, TAIL=tail, ADD=add, SPLIT=count > 1, num_warps=warps, num_stages=stages,
        **launch_options(x.device),
    )
    return out
