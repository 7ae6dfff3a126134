"""A verify pass's attention as one Triton kernel (CUDA only; ``attention.attend_folded`` calls it).

The target's K/V buffers have a fixed capacity C so that a pass replays as a CUDA graph, and SDPA
over them reads all C keys with an additive [rows, C] mask, though only the committed past and the
pass's own q keys are visible. This kernel stops at the pass's last K/V slot, which it reads from the
device (the slots tensor), so a replayed graph does the work of the current length, not of the
capacity. It reads the mask only over the pass's own keys, in a second loop: the committed past
before them is visible to every row, so its tiles need no mask tile.

It is a flash-attention forward (online softmax in float32, P rounded to the inputs' dtype for the
P V product, as SDPA's fused kernels do) over folded rows: query [Hkv, R, D], one program per block
of rows, K/V head and split of the keys; with few row blocks the keys are split and a second kernel
merges the partial results by their log-sum-exps. Or (``SHARED``, off) one round of programs
shares the (row block, K/V head, key tile) work evenly, stream-K, and the same merge joins each block's
parts; or each pass shape takes the faster of the two forms, timed on its first call in a graph's
warm-up (``chosen_form``), as ``lt_product`` chooses the products' algorithms. The mask and the query
are read through block pointers: per-element pointer tensors for a [64, 256] tile would hold 128
registers a thread and spill (``benchmarks/kernel_resources.py`` prints each kernel's registers and
spills per architecture). So are K and V before Hopper; from Hopper on their whole tiles come by TMA
(``uses_descriptors``: at head sizes below 256 only for passes of many rows), and only the last part-tile
by a block pointer, whose rows past the pass's last slot read as zeros. Given each node's ``ends``, a
block of rows reads keys only up to its last node's (a prompt chunk's causal triangle is not read).
Tested against SDPA in ``tests/workers/models/test_attention_triton.py`` (GPU-marked).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from workers.models.kernels import MAX_KEY_SPLITS, ROW_BLOCK, row_block
from workers.models.pdl_triton import launch_options, wait_for_inputs

# (most query rows per program, keys per step, warps, pipeline stages) for head sizes up to 128 and
# for 256, tried in this order on each device, head size and pass width until one compiles within the
# GPU's shared memory; a program takes ``kernels.row_block`` of the pass's folded rows, up to the first
# number. The first choices are the fastest on an H200 (``benchmarks/attention_kernels.py``: at D = 128
# one warp group of 4 per 64 rows, Hopper's wgmma shape; at D = 256, 8 warps keep the [rows, 256]
# float32 sums in registers). An RTX A6000 (99 KB) takes the second at D = 256
# (``benchmarks/kernel_resources.py`` prints each choice's shared memory and spills).
TILES = {128: ((64, 32, 4, 3), (64, 32, 4, 2), (32, 32, 4, 1)),
         256: ((128, 64, 8, 2), (64, 32, 8, 2), (32, 32, 4, 1))}


def tiles_for(dim: int) -> tuple[tuple[int, int, int, int], ...]:
    return TILES[128] if dim <= 128 else TILES[256]


@triton.jit
def _out_rows(head, r, nodes, out_head, out_group, out_node):
    """Offsets in OUT of folded rows r = i * nodes + t (query head i of the K/V head's group, node t):
    [Hkv, R, D] rows (out_head R * D, out_node D, nodes = R) or o_proj's [nodes, Hq * D] (out_head
    g * D, out_group D, out_node Hq * D)."""
    group = r // nodes
    return head * out_head + group * out_group + (r - group * nodes) * out_node


@triton.jit
def _step(query, key, value, mask, best, total, acc, start, hi, scale, BN: tl.constexpr, MASKED: tl.constexpr):
    """One tile of BN keys (key, value [BN, D]) into the online softmax (best, total, acc); MASKED: add
    the mask's tile [BM, BN] and drop keys from hi on (else every key of the tile is visible to every row)."""
    scores = tl.dot(query, tl.trans(key)) * scale
    if MASKED:
        scores += mask.to(tl.float32)
        scores = tl.where((start + tl.arange(0, BN) < hi)[None, :], scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, axis=1))  # finite: every tile has a key in range
    p = tl.exp(scores - new_best[:, None])
    fade = tl.exp(best - new_best)
    acc = acc * fade[:, None] + tl.dot(p.to(value.dtype), value)
    return new_best, total * fade + tl.sum(p, axis=1), acc


@triton.jit
def _tile(blocks, descriptor, head, start, BN: tl.constexpr, D: tl.constexpr, BY_DESCRIPTOR: tl.constexpr):
    """Keys or values start..start+BN-1 of a head [BN, D]: by TMA (``descriptor``, [Hkv, C, D] in
    [1, BN, D] blocks; the tile must lie before hi) or from the block pointer ``blocks`` (rows from hi
    on read as zeros: the K/V buffer past the pass's last slot may hold anything)."""
    if BY_DESCRIPTOR:
        return descriptor.load([head, start, 0]).reshape(BN, D)
    return tl.load(blocks, boundary_check=(0,), padding_option="zero")


@triton.jit
def _block_end(ENDS, block, rows, nodes, end, BM: tl.constexpr, BOUNDED: tl.constexpr):
    """One past the last key row block ``block`` reads: the pass's ``end``, or with BOUNDED its last node's
    end (keys after it are masked for all its rows); a block holding rows of two query heads reads up to
    the last node's."""
    if BOUNDED:
        first_row, last_row = block * BM, tl.minimum(block * BM + BM, rows) - 1
        wraps = first_row // nodes != last_row // nodes
        end = tl.minimum(end, tl.load(ENDS + tl.where(wraps, nodes - 1, last_row % nodes)))
    return end


@triton.jit
def _attend_keys(Q, K, V, K_DESC, V_DESC, MASK, block, head, rows, lo, hi, past, k_head_stride, k_row_stride,
                 mask_stride, scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr):
    """The online softmax (best [BM], total [BM], acc [BM, D], unnormalised) of row block ``block`` of
    K/V head ``head`` over keys lo..hi-1 (lo a multiple of BN): whole tiles of the committed past (keys
    before ``past``) without the mask, the rest with it."""
    unmasked = lo + tl.maximum(0, tl.minimum(hi, past) - lo) // BN * BN  # whole tiles of the past: no mask
    # TMA reads whole tiles up to ``whole``, the part-tile before hi after the loop (block pointers: every
    # tile in the loop, their rows from hi on read as zeros)
    whole = lo + tl.maximum(0, hi - lo) // BN * BN if TMA else hi
    # block pointers, not per-element pointer tensors (see the module docstring)
    query = tl.load(tl.make_block_ptr(Q + head * rows * D, (rows, D), (D, 1), (block * BM, 0), (BM, D), (1, 0)),
                    boundary_check=(0,), padding_option="zero")
    keys = tl.make_block_ptr(K + head * k_head_stride, (hi, D), (k_row_stride, 1), (lo, 0), (BN, D), (1, 0))
    values = tl.make_block_ptr(V + head * k_head_stride, (hi, D), (k_row_stride, 1), (lo, 0), (BN, D), (1, 0))
    best = tl.full((BM,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    for start in range(lo, unmasked, BN):
        key = _tile(keys, K_DESC, head, start, BN, D, TMA)
        value = _tile(values, V_DESC, head, start, BN, D, TMA)
        best, total, acc = _step(query, key, value, None, best, total, acc, start, hi, scale, BN, False)
        keys = tl.advance(keys, (BN, 0))
        values = tl.advance(values, (BN, 0))
    masks = tl.make_block_ptr(MASK, (rows, hi), (mask_stride, 1), (block * BM, unmasked), (BM, BN), (1, 0))
    for start in range(unmasked, whole, BN):
        key = _tile(keys, K_DESC, head, start, BN, D, TMA)
        value = _tile(values, V_DESC, head, start, BN, D, TMA)
        mask = tl.load(masks, boundary_check=(0, 1), padding_option="zero")
        best, total, acc = _step(query, key, value, mask, best, total, acc, start, hi, scale, BN, True)
        keys = tl.advance(keys, (BN, 0))
        values = tl.advance(values, (BN, 0))
        masks = tl.advance(masks, (0, BN))
    if TMA and whole < hi:  # the part-tile before hi: block pointers, whose rows from hi on read as zeros
        key = _tile(keys, K_DESC, head, whole, BN, D, False)
        value = _tile(values, V_DESC, head, whole, BN, D, False)
        mask = tl.load(masks, boundary_check=(0, 1), padding_option="zero")
        best, total, acc = _step(query, key, value, mask, best, total, acc, whole, hi, scale, BN, True)
    return best, total, acc


@triton.jit
def _store_partial(PARTIAL, STATS, at, in_rows, best, total, acc, D: tl.constexpr):
    """One program's unnormalised sums of its rows ``at`` (indices of [parts, Hkv, R] rows) for the merge."""
    tl.store(PARTIAL + at[:, None] * D + tl.arange(0, D)[None, :], acc, mask=in_rows[:, None])
    tl.store(STATS + at * 2, best, mask=in_rows)
    tl.store(STATS + at * 2 + 1, total, mask=in_rows)


@triton.jit
def _attention_kernel(Q, K, V, K_DESC, V_DESC, MASK, SLOTS, ENDS, OUT, PARTIAL, STATS, rows, last, k_head_stride,
                      k_row_stride, mask_stride, scale, nodes, out_head, out_group, out_node, D: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, TMA: tl.constexpr,
                      BOUNDED: tl.constexpr, PDL: tl.constexpr):
    """Program (row block, K/V head, split). Q [Hkv, R, D]; K / V rows at head * k_head_stride +
    key * k_row_stride; MASK [R, C] additive, read only from the pass's first slot SLOTS[0] on (the
    committed past before it is visible to every row); keys past SLOTS[last] are not read. Row
    r = i * nodes + t of head h goes to OUT + h * out_head + i * out_group + t * out_node (``_out_rows``).
    With SPLITS > 1: PARTIAL [SPLITS, Hkv, R, D] unnormalised float32 sums, STATS [SPLITS, Hkv, R, 2]
    (max, sum). TMA: whole K/V tiles come by the tensor descriptors K_DESC / V_DESC (Hopper on), the
    last part-tile of the keys by block pointers. BOUNDED: ENDS [nodes] holds one past the last key nodes
    0..t see (a running maximum), and the program reads keys only up to its last node's (before the
    split)."""
    wait_for_inputs(PDL)
    block = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    heads = tl.num_programs(1)
    past = tl.load(SLOTS).to(tl.int32)  # the committed length
    end = (tl.load(SLOTS + last) + 1).to(tl.int32)  # keys 0..end-1: the committed past and this pass
    end = _block_end(ENDS, block, rows, nodes, end, BM, BOUNDED)
    share = tl.cdiv(tl.cdiv(end, SPLITS), BN) * BN
    lo = split * share
    hi = tl.minimum(end, lo + share)
    best, total, acc = _attend_keys(Q, K, V, K_DESC, V_DESC, MASK, block, head, rows, lo, hi, past, k_head_stride,
                                    k_row_stride, mask_stride, scale, D, BM, BN, TMA)
    r = block * BM + tl.arange(0, BM)
    in_rows = r < rows
    if SPLITS == 1:
        at = _out_rows(head, r, nodes, out_head, out_group, out_node)
        tl.store(OUT + at[:, None] + tl.arange(0, D)[None, :], (acc / total[:, None]).to(OUT.dtype.element_ty),
                 mask=in_rows[:, None])
    else:
        _store_partial(PARTIAL, STATS, (split * heads + head) * rows + r, in_rows, best, total, acc, D)


@triton.jit
def _shared_kernel(Q, K, V, K_DESC, V_DESC, MASK, SLOTS, ENDS, PARTIAL, STATS, PARTS, rows, last, heads,
                   k_head_stride, k_row_stride, mask_stride, scale, nodes, D: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, MOST_PARTS: tl.constexpr, SEGMENTS: tl.constexpr, TMA: tl.constexpr,
                   BOUNDED: tl.constexpr, PDL: tl.constexpr):
    """Program p of the grid's P: the work of every item (row block, K/V head),
    its L tiles of BN keys in order, items in order (block-major), cut into P equal shares (stream-K), and
    share p of it. So every program reads as many tiles, where whole key splits per item would leave
    part of the GPU idle or spill a few programs into a second round. Every item counts as the longest
    (L tiles up to the pass's end): with BOUNDED a block's tiles after its last node's end are skipped,
    and a share (at most ceil(items / P) x L) spans at most SEGMENTS = ceil(items / P) + 1 items, each a
    segment of the program's, unrolled. An item's tiles go to consecutive programs;
    part k of item j (from its k-th program) goes to PARTIAL / STATS [k, head, rows of the block], and
    the program holding its first tile writes how many parts it has to PARTS[j]. The share is at least
    L / (MOST_PARTS - 1), so no item has more than MOST_PARTS parts. The rest as ``_attention_kernel``."""
    wait_for_inputs(PDL)
    program = tl.program_id(0)
    past = tl.load(SLOTS).to(tl.int32)
    end = (tl.load(SLOTS + last) + 1).to(tl.int32)
    tiles = tl.cdiv(end, BN)  # every item's L
    units = tl.cdiv(rows, BM) * heads * tiles
    share = tl.maximum(tl.cdiv(units, tl.num_programs(0)), tl.cdiv(tiles, MOST_PARTS - 1))
    begin = program * share
    stop = tl.minimum(begin + share, units)
    # unrolled: a loop around the key loops took 65 more registers a thread on sm_90
    for segment in tl.static_range(SEGMENTS):
        item = begin // tiles
        item_first = item * tiles
        segment_stop = tl.minimum(stop, item_first + tiles)
        if begin < segment_stop:
            block, head = item // heads, item % heads
            hi = tl.minimum(_block_end(ENDS, block, rows, nodes, end, BM, BOUNDED), (segment_stop - item_first) * BN)
            best, total, acc = _attend_keys(Q, K, V, K_DESC, V_DESC, MASK, block, head, rows, (begin - item_first) * BN,
                                            hi, past, k_head_stride, k_row_stride, mask_stride, scale, D, BM, BN, TMA)
            part = program - item_first // share
            r = block * BM + tl.arange(0, BM)
            _store_partial(PARTIAL, STATS, (part * heads + head) * rows + r, r < rows, best, total, acc, D)
            tl.store(PARTS + item, (item_first + tiles - 1) // share - item_first // share + 1, mask=part == 0)
        begin = segment_stop


@triton.jit
def _merge_kernel(PARTIAL, STATS, PARTS, OUT, count, rows, nodes, out_head, out_group, out_node, D: tl.constexpr,
                  SPLITS: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr, COUNTED: tl.constexpr, PDL: tl.constexpr):
    """Program (block of BR of the count = Hkv x R folded rows): OUT = the splits' PARTIAL sums, each
    weighted by exp(its max - the largest max), over the same weighting of their STATS sums, stored
    as ``_attention_kernel`` stores. The splits' loops are unrolled, so their loads are in flight
    together: a decode step's merge is a few rows, where one dependent load after another would be
    its whole cost. COUNTED: a row's item (its block of BM rows, its K/V head) has PARTS[item] parts
    (``_shared_kernel``), the rest of the SPLITS are not written; else every split is."""
    wait_for_inputs(PDL)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, D)
    in_rows = r < count
    head = r // rows
    if COUNTED:
        parts = tl.load(PARTS + (r - head * rows) // BM * (count // rows) + head, mask=in_rows, other=0)
    else:
        parts = tl.full((BR,), SPLITS, dtype=tl.int32)
    top = tl.full((BR,), float("-inf"), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        here = in_rows & (split < parts)
        top = tl.maximum(top, tl.load(STATS + (split * count + r) * 2, mask=here, other=float("-inf")))
    top = tl.where(in_rows, top, 0.0)  # rows past count: finite, not stored
    acc = tl.zeros((BR, D), dtype=tl.float32)
    total = tl.zeros((BR,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        at = split * count + r
        here = in_rows & (split < parts)
        weight = tl.exp(tl.load(STATS + at * 2, mask=here, other=float("-inf")) - top)  # read no key, or no part: 0
        total += weight * tl.load(STATS + at * 2 + 1, mask=here, other=0.0)
        acc += weight[:, None] * tl.load(PARTIAL + at[:, None] * D + d[None, :], mask=here[:, None], other=0.0)
    total = tl.where(in_rows, total, 1.0)
    at = _out_rows(head, r - head * rows, nodes, out_head, out_group, out_node)
    tl.store(OUT + at[:, None] + d[None, :], (acc / total[:, None]).to(OUT.dtype.element_ty), mask=in_rows[:, None])


# whole K/V tiles by TMA on GPUs that have it (compute capability 9 on), where the buffer's strides allow:
# True always, False never, None as ``uses_descriptors`` says (``benchmarks/attention_kernels.py
# --descriptors`` times both forms)
BY_DESCRIPTOR: bool | None = None

# at head sizes below 256, passes of fewer folded rows (a decode step's, a short chain's) ran faster by
# block pointers on an H200, wider passes by TMA (benchmarks/results/wide_passes_h200.md, eighth session)
TMA_FROM_ROWS = 128


def uses_descriptors(rows: int, dim: int) -> bool:
    """Whether a pass of ``rows`` folded rows at head size ``dim`` takes its whole K/V tiles by TMA."""
    return BY_DESCRIPTOR if BY_DESCRIPTOR is not None else dim >= 256 or rows >= TMA_FROM_ROWS


@contextlib.contextmanager
def by_descriptor(on: bool | None) -> Iterator[None]:
    """Inside: whole K/V tiles by TMA descriptors (``on``), by block pointers (False), or as
    ``uses_descriptors`` says (None), whatever the GPU (the benchmarks time both forms; the resource
    check compiles both)."""
    global BY_DESCRIPTOR
    saved, BY_DESCRIPTOR = BY_DESCRIPTOR, on
    try:
        yield
    finally:
        BY_DESCRIPTOR = saved


def _descriptors(key: torch.Tensor, value: torch.Tensor, keys: int, rows: int):
    """TMA descriptors of K and V [Hkv, C, D] in [1, keys, D] blocks for a pass of ``rows`` folded rows, or
    None: not ``uses_descriptors``, a GPU before Hopper, or strides TMA cannot take (16-byte multiples).
    Off CUDA (Triton's interpreter, the tests) the descriptors are emulated."""
    if (not uses_descriptors(rows, key.shape[-1])
            or (key.is_cuda and torch.cuda.get_device_capability(key.device)[0] < 9)):
        return None
    aligned = all((stride * key.element_size()) % 16 == 0 for stride in key.stride()[:-1])
    if not aligned or key.stride() != value.stride() or key.data_ptr() % 16 or value.data_ptr() % 16:
        return None
    return (TensorDescriptor.from_tensor(key, [1, keys, key.shape[-1]]),
            TensorDescriptor.from_tensor(value, [1, keys, key.shape[-1]]))


# partial sums a program of the merge holds per split ([rows, D]), and the fewest rows it takes
MERGE_ELEMENTS, MERGE_MIN_ROWS = 1024, 2

# (device, head size, pass rows' class: ``kernels.row_block``) -> the first of TILES that fit its
# shared memory, or None: none did (SDPA then)
_CHOSEN: dict[tuple[str, int, int], tuple[int, int, int, int] | None] = {}


@contextlib.contextmanager
def only_tiles(tiles: tuple[int, int, int, int]) -> Iterator[None]:
    """Inside: ``tiles`` (most rows per program, keys per step, warps, stages) alone, at every head size
    on every device (the benchmarks time or compile one choice at a time); the per-device choices are
    forgotten on the way in and out."""
    global TILES
    saved, TILES = TILES, {128: (tiles,), 256: (tiles,)}
    _CHOSEN.clear()
    try:
        yield
    finally:
        TILES = saved
        _CHOSEN.clear()


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessors (1 off CUDA: Triton's interpreter runs the kernels on the CPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.cache
def resident_programs(device: torch.device, rows: int, keys: int, stages: int, dim: int) -> int:
    """Programs of these tiles one multiprocessor holds at once, by their shared memory (the query's tile,
    K and V tiles per stage, a tenth more for what Triton adds), 1 to 4; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    tiles_bytes = 1.1 * 2 * (rows * dim + stages * 2 * keys * dim)
    return max(1, min(4, int(torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor // tiles_bytes)))


# a program's fixed cost (its query tile in, its output or partial sums out) over its keys' work when the
# keys are not split: fitted to the kernel's grids of tiles and splits on an H200 (``split_count``)
PROGRAM_OVERHEAD = 0.3


def split_count(programs: int, resident: int, sms: int) -> int:
    """Key splits for ``programs`` programs (row blocks x K/V heads) on a GPU that holds ``resident`` of
    them at once: the fewest of those that minimise rounds of programs x each program's time
    (PROGRAM_OVERHEAD + 1 / splits), at most ``MAX_KEY_SPLITS`` and at most 4 programs a multiprocessor
    in all (the memory plan's bound on the float32 partial sums, ``placement``). So a part-filled last
    round costs a whole one, and a split costs its program's overhead again. On an H200 this picks the
    fastest measured count at every width (``benchmarks/results/wide_passes_h200.md``, seventh session)."""
    def cost(splits: int) -> float:
        return -(-splits * programs // resident) * (PROGRAM_OVERHEAD + 1 / splits)

    allowed = [splits for splits in range(1, MAX_KEY_SPLITS + 1) if splits == 1 or splits * programs <= 4 * sms]
    return min(allowed, key=cost)  # the first of equal costs: the fewest splits


def supports(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Half-precision inputs, a power-of-two head size the tiles take, rows contiguous, and not a GPU
    found to lack the shared memory for every choice of tiles."""
    dim = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and key.dtype == query.dtype
            and 16 <= dim <= 256 and dim & (dim - 1) == 0 and key.stride(-1) == 1
            and _CHOSEN.get((str(query.device), dim, row_block(query.shape[1])), ()) is not None)


# share each pass's (row block, K/V head, key tile) work evenly among one round of the programs the GPU
# holds at once (``_shared_kernel``, stream-K) instead of splitting each block's keys into whole parts
# (``split_count``): where whole splits leave part of the GPU idle (the 8B shape's 257-row pass: 2 splits,
# 272 of 396 programs) or take a second round for a few programs (items outnumbering the resident
# programs). For a call that names neither ``splits`` nor ``programs``: True shared, False key splits, None
# chosen per pass shape on the GPU at hand (``chosen_form``). Off: on an H200 the shared form lost at every
# pass shape timed, both head sizes (``docs/gpu.md``; ``benchmarks/h200_switches.sh ab`` runs the trials).
SHARED: bool | None = False
FORMS = {"splits": False, "shared": True, "chosen": None}  # SHARED's settings by name (the benchmarks' flag)
MOST_SEGMENTS = 4  # the most items one program of the shared form holds parts of (its key loops are unrolled)
# SHARED None: the shared form is kept for a pass shape where it beats the key splits by this fraction of their
# time, and where its output is within this relative difference of theirs (the same softmax, its partial sums
# merged at other places: half precision's rounding, about 4e-3 in bfloat16)
FORM_MARGIN, FORM_AGREEMENT = 0.03, 1e-2
# (device, query's shape, nodes, ends given) -> shared or not, chosen once per process (``chosen_form``), and
# for those chosen on trial what the trial found (``report``)
_FORMS: dict[tuple, bool] = {}
_TRIALS: dict[tuple, str] = {}


@contextlib.contextmanager
def sharing(on: bool | None) -> Iterator[None]:
    """Inside: passes share their work among one round of resident programs (``on``), split their keys
    (False) or take the form chosen for their shape (None) when neither ``splits`` nor ``programs`` is given."""
    global SHARED
    saved, SHARED = SHARED, on
    try:
        yield
    finally:
        SHARED = saved


def division(blocks: int, heads: int, rows: int, resident: int, sms: int, splits: int | None = None,
             programs: int | None = None, shared: bool = False) -> tuple[int | None, int]:
    """How a pass of ``rows`` folded rows in ``blocks`` row blocks x ``heads`` K/V heads divides its work on a
    GPU of ``sms`` multiprocessors that holds ``resident`` programs at once: (the programs that share it,
    the most parts an item is cut into) or (None, the key splits). Shared among ``programs``, or among
    ``resident`` where ``shared`` and no ``splits`` are given; at least a third of the items' count (a
    program then holds parts of at most MOST_SEGMENTS items). Evenly shared, an item's tiles span at most
    programs / items + 1 programs; at most ``MAX_KEY_SPLITS`` parts and, unless ``programs`` are given, the
    memory plan's bound on the partial sums (4 x multiprocessors x ``ROW_BLOCK`` rows, as ``split_count``
    keeps). Below 2 parts: key splits."""
    items = blocks * heads
    sharers = programs if programs is not None else resident if shared and splits is None else None
    if sharers is not None:
        sharers = max(sharers, -(-items // (MOST_SEGMENTS - 1)))
        most = MAX_KEY_SPLITS if programs is not None else 4 * sms * ROW_BLOCK // (heads * rows)
        parts = min(MAX_KEY_SPLITS, -(-sharers // items) + 1, most)
        if parts >= 2:
            return sharers, parts
    return None, splits or split_count(items, resident, sms)


def attend_until(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                 slots: torch.Tensor, scale: float, splits: int | None = None,
                 rows_per_program: int | None = None, nodes: int | None = None,
                 ends: torch.Tensor | None = None, programs: int | None = None,
                 shared: bool | None = None) -> torch.Tensor | None:
    """Softmax attention of folded rows query [Hkv, R, D] over key/value [Hkv, C, D] (rows contiguous,
    K and V of the same strides) with the additive mask [R, C], reading keys up to the last of
    ``slots`` (the pass's K/V slots; every later key must be masked) -> [Hkv, R, D], or with
    ``nodes`` (R = g x nodes, row i * nodes + t: query head i of the group, node t) -> [nodes, Hq * D],
    each node's query heads side by side as o_proj reads them (no transposing copy after). With ``nodes``,
    ``ends`` [nodes] int32 (one past the last slot nodes 0..t see, ``fused_layer.visible_ends``) lets each
    program stop at its last node's: a prompt chunk's causal triangle is not read. The keys
    before the first slot (the committed past) must be visible to every row: the mask is read from
    there on. ``splits``: of the keys (None: ``split_count``'s, by how many programs the GPU holds at
    once; ``benchmarks/attention_kernels.py --grid`` times others); ``programs``: instead, that many
    programs share the work (``_shared_kernel``); with neither, ``shared`` says whether one round of
    resident programs shares it (None: as ``SHARED`` says); ``rows_per_program``: None, as TILES say (the
    benchmarks set it). None (and ``supports`` false from then on) if this GPU lacks the shared memory for
    every choice of TILES."""
    heads, rows, dim = query.shape
    if ends is not None and nodes is None:
        raise ValueError("attend_until: ends are per node; give nodes too")
    chosen = (str(query.device), dim, row_block(rows))
    if chosen in _CHOSEN and _CHOSEN[chosen] is None:
        return None
    if shared is None and splits is None and programs is None:
        shared = SHARED if SHARED is not None else chosen_form(query, key, value, mask, slots, scale, nodes, ends)
    query = query.contiguous()
    mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    if nodes is None:  # [Hkv, R, D]: one "query head" of R nodes per K/V head
        out = torch.empty_like(query)
        layout = (rows, rows * dim, 0, dim)
    else:
        groups = rows // nodes
        out = torch.empty(nodes, heads * groups * dim, dtype=query.dtype, device=query.device)
        layout = (nodes, groups * dim, dim, heads * groups * dim)
    sms = multiprocessors(query.device)
    for tiles in (_CHOSEN[chosen],) if chosen in _CHOSEN else tiles_for(dim):
        most, keys, warps, stages = tiles
        block_rows = rows_per_program or row_block(rows, most)
        blocks = triton.cdiv(rows, block_rows)
        resident = resident_programs(query.device, block_rows, keys, stages, dim) * sms
        sharers, key_splits = division(blocks, heads, rows, resident, sms, splits, programs, bool(shared))
        partial = stats = parts = out
        if key_splits > 1:
            partial = torch.empty(key_splits, heads, rows, dim, dtype=torch.float32, device=query.device)
            stats = torch.empty(key_splits, heads, rows, 2, dtype=torch.float32, device=query.device)
        descriptors = _descriptors(key, value, keys, rows)
        common = dict(D=dim, BM=block_rows, BN=keys, TMA=descriptors is not None, BOUNDED=ends is not None,
                      num_warps=warps, num_stages=stages, **launch_options(out.device))
        inputs = (query, key, value, *(descriptors or (key, value)), mask, slots, slots if ends is None else ends)
        try:
            if sharers is not None:
                parts = torch.empty(blocks * heads, dtype=torch.int32, device=query.device)
                _shared_kernel[(sharers,)](
                    *inputs, partial, stats, parts, rows, slots.shape[0] - 1, heads, key.stride(0), key.stride(1),
                    mask.stride(0), scale, layout[0], MOST_PARTS=key_splits,
                    SEGMENTS=-(-blocks * heads // sharers) + 1, **common)
            else:
                _attention_kernel[(blocks, heads, key_splits)](
                    *inputs, out, partial, stats, rows, slots.shape[0] - 1, key.stride(0), key.stride(1),
                    mask.stride(0), scale, *layout, SPLITS=key_splits, **common)
        except OutOfResources:  # raised when compiling, before any launch: the next tiles
            continue
        _CHOSEN[chosen] = tiles
        break
    else:
        _CHOSEN[chosen] = None
        return None
    if key_splits > 1:  # rows per program: enough programs for every multiprocessor, up to MERGE_ELEMENTS
        count = heads * rows
        merge_rows = max(MERGE_MIN_ROWS, min(MERGE_ELEMENTS // dim, triton.next_power_of_2(triton.cdiv(count, sms))))
        _merge_kernel[(triton.cdiv(count, merge_rows),)](partial, stats, parts, out, count, rows, *layout, D=dim,
                                                         SPLITS=key_splits, BR=merge_rows, BM=block_rows,
                                                         COUNTED=sharers is not None, num_warps=4,
                                                         **launch_options(out.device))
    return out


def chosen_form(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                slots: torch.Tensor, scale: float, nodes: int | None, ends: torch.Tensor | None) -> bool:
    """Whether a pass of this shape shares its work (``SHARED`` None), chosen at its first call and kept for
    the process, so eager and replayed passes of a shape compute the same bits. First met inside
    ``lt_product.choosing()`` (the graphs' warm-ups), both forms run on this call's own inputs: the shared
    one is kept where its output agrees with the key splits' within FORM_AGREEMENT and its time, by
    ``lt_product.time_calls``, is FORM_MARGIN under theirs. First met anywhere else: key splits (timing a
    prompt's every last partial chunk would land in timed runs, as for ``lt_product``)."""
    from workers.models import lt_product

    shape = (str(query.device), tuple(query.shape), nodes, ends is not None)
    if shape not in _FORMS:
        if lt_product.choosing_now():
            _FORMS[shape], _TRIALS[shape] = _trial(
                lambda shared: attend_until(query, key, value, mask, slots, scale, nodes=nodes, ends=ends,
                                            shared=shared),
                (str(query.device), query.shape[-1], row_block(query.shape[1])), query.device)
        else:
            _FORMS[shape] = False
    return _FORMS[shape]


def _trial(attend, tiles_key: tuple, device: torch.device) -> tuple[bool, str]:
    """``attend(shared)``: the call in one form. (The shared form?, what the trial found): the shared form
    where it gives what the key splits give and beats their time by FORM_MARGIN; never where it cannot run
    (its kernel past this GPU's limits with the tiles the splits took, which stay theirs) or divides the
    work as the splits do."""
    from workers.models import lt_product

    split_out = attend(False)
    if split_out is None:
        return False, "no Triton attention"
    tiles = _CHOSEN.get(tiles_key)
    try:
        shared_out = attend(True)
    except Exception as exc:  # a failure of the form on trial is reported and leaves the proven one in place
        warnings.warn(f"attention_triton: the shared form failed on its trial ({exc!r}); key splits kept")
        shared_out = None
    if shared_out is None:
        _CHOSEN[tiles_key] = tiles
        return False, "shared form failed"
    if torch.equal(shared_out, split_out):  # no round of programs to fill: the same division
        return False, "same division"
    difference = ((shared_out.float() - split_out.float()).norm() / split_out.float().norm()).item()
    if not difference <= FORM_AGREEMENT:  # NaN too
        warnings.warn(f"attention_triton: the shared form's output differs from the key splits' by {difference:.2e} "
                      f"(relative) on its trial; key splits kept")
        return False, f"shared form differs by {difference:.1e}"
    split_ms, shared_ms = lt_product.time_calls([lambda: attend(False), lambda: attend(True)], device)
    per_call = 1e3 / lt_product.TIMED_CALLS
    return (shared_ms < (1 - FORM_MARGIN) * split_ms,
            f"splits {split_ms * per_call:.1f} us, shared {shared_ms * per_call:.1f} us")


def report() -> list[str]:
    """A line per pass shape whose form was chosen on trial (``SHARED`` None): what the trial found, the form."""
    lines = []
    for shape, found in _TRIALS.items():
        device, query, nodes, bounded = shape
        lines.append(f"{device} query {list(query)}{' by node' if nodes else ''}{' with ends' if bounded else ''}: "
                     f"{found} -> {'shared' if _FORMS[shape] else 'key splits'}")
    return lines
