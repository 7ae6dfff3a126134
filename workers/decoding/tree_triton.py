"""DDTree's tree build as a few Triton kernels (CUDA; ``tree.build_tree`` calls it there).

``tree.build_tree`` in torch issues ~12 small kernels per depth plus the merge and the ancestor
matrix, about 290 launches for a 15-deep tree, which cost more than their work even replayed from a
CUDA graph. Here each depth is two kernels (the count, the writes), the merge one, and the outputs one:

    depth d:  candidate c = (kept parent j, token rank r), score = parent score + top_vals[d, r];
              its place in the depth's best-first order = #{candidates that beat it}, where c' beats
              c if its score is higher, or equal with c' enumerated first (counted by programs that
              each take a block of candidates and a share of the others; a depth of many blocks by
              a kernel that compares each pair once); the first ``keep`` places are written (score,
              parent entry, token)
    merge:    the same order over all depths' entries (depth order, each depth best first), each
              entry's place by a binary search in every depth (each is sorted), gives each entry's
              node index; the first ``budget`` become nodes 1..n
    finish:   the nodes' tokens, depths, log-probs and parents, and the ancestor matrix (each row
              walks its node's entries up to the root)

Counting who beats whom is exactly a stable descending sort, so the tree equals the torch build's
bit for bit, ties included (``tests/workers/decoding/test_tree.py`` on a GPU,
``tests/workers/models/test_interpreted_kernels.py`` through Triton's CPU interpreter). Scores are
float64, as in the torch build. The count is quadratic in a depth's candidates (~budget x ln budget)
but spread over the GPU (``benchmarks/tree_build.py`` times the build per budget).
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

from workers.models.attention_triton import multiprocessors
from workers.models.pdl_triton import launch_options, wait_for_inputs

BLOCK = 64  # candidates (or entries) per program, and per step of the count
# A depth of at least WIDE_COUNT_BLOCKS blocks of candidates takes _tree_wide_count_kernel, spread over
# 2 programs a multiprocessor, others _tree_count_kernel over 1 (benchmarks/tree_build.py)
WIDE_COUNT_BLOCKS = 32
# The kernels' sizes and offsets change with the tree knobs and the depth: they are left unspecialised
# (``do_not_specialize``), else Triton compiles a variant per divisibility by 16 and per value 1 of each.


@triton.jit
def _load_candidates(SCORE, TOP_VALS, PARENT, RANK, c, valid, parent_offset, top_row):
    """Scores of candidates c: the parent's path score (the root's is 0) plus the token's log-prob at
    this depth (row ``top_row`` of TOP_VALS)."""
    parent = tl.load(PARENT + c, mask=valid, other=0)
    rank = tl.load(RANK + c, mask=valid, other=0)
    parent_score = tl.load(SCORE + parent_offset + parent, mask=valid & (parent_offset >= 0), other=0.0)
    return parent, rank, parent_score + tl.load(TOP_VALS + top_row + rank, mask=valid, other=0.0)


@triton.jit
def _beats(score, e, other_score, other):
    """[n, m] whether each other beats each entry e: a higher score, or an equal one enumerated first."""
    return (other_score[None, :] > score[:, None]) | ((other_score[None, :] == score[:, None])
                                                      & (other[None, :] < e[:, None]))


@triton.jit
def _beaten_by(score, e, other_score, other, in_range):
    """[n] how many of the others (where ``in_range``) beat each entry e."""
    return tl.sum((_beats(score, e, other_score, other) & in_range[None, :]).to(tl.int32), axis=1)


@triton.jit(do_not_specialize=["count", "parent_offset", "depth", "top_k", "share"])
def _tree_count_kernel(TOP_VALS, PARENT, RANK, SCORE, PLACE, count, parent_offset, depth, top_k, share,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (block of a depth's candidates, share of the others): adds to PLACE [count] (zeroed
    before) how many of others share*s .. share*(s+1)-1 beat each candidate. Each program recomputes
    the scores it compares against (a gather and an add) rather than reading them from a launch
    before."""
    wait_for_inputs(PDL)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = c < count
    top_row = (depth - 1) * top_k
    _, _, score = _load_candidates(SCORE, TOP_VALS, PARENT, RANK, c, valid, parent_offset, top_row)
    place = tl.zeros((BLOCK,), dtype=tl.int32)
    first = tl.program_id(1) * share
    last = tl.minimum(count, first + share)
    for start in range(first, last, BLOCK):
        other = start + tl.arange(0, BLOCK)
        in_range = other < last
        _, _, other_score = _load_candidates(SCORE, TOP_VALS, PARENT, RANK, other, in_range, parent_offset, top_row)
        place += _beaten_by(score, c, other_score, other, in_range)
    tl.atomic_add(PLACE + c, place, mask=valid)  # integer sums: the same in any order


@triton.jit
def _others(SCORE, TOP_VALS, PARENT, RANK, start, last, parent_offset, top_row, BLOCK: tl.constexpr):
    """Scores of candidates start..start+BLOCK-1 and their indices; from ``last`` on the scores read as
    -inf, so that they beat no candidate enumerated before them."""
    other = start + tl.arange(0, BLOCK)
    in_range = other < last
    _, _, score = _load_candidates(SCORE, TOP_VALS, PARENT, RANK, other, in_range, parent_offset, top_row)
    return tl.where(in_range, score, float("-inf")), other


@triton.jit(do_not_specialize=["count", "parent_offset", "depth", "top_k", "share"])
def _tree_wide_count_kernel(TOP_VALS, PARENT, RANK, SCORE, PLACE, count, parent_offset, depth, top_k, share,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``_tree_count_kernel`` for a depth of many candidates: the others enumerated before the block beat
    a candidate where their score is no lower, those after it where it is higher, and only within the
    block is the order compared. So each pair costs one comparison and one add into a [BLOCK, BLOCK]
    tile, summed once at the end; where a depth has few blocks, this costs more than it saves."""
    wait_for_inputs(PDL)
    block = tl.program_id(0) * BLOCK
    c = block + tl.arange(0, BLOCK)
    valid = c < count
    top_row = (depth - 1) * top_k
    _, _, score = _load_candidates(SCORE, TOP_VALS, PARENT, RANK, c, valid, parent_offset, top_row)
    first = tl.program_id(1) * share  # a multiple of BLOCK, as ``block`` is: the others come in whole blocks
    last = tl.minimum(count, first + share)
    beaten = tl.zeros((BLOCK, BLOCK), dtype=tl.int32)
    for start in range(first, tl.minimum(last, block), BLOCK):
        other_score = _others(SCORE, TOP_VALS, PARENT, RANK, start, last, parent_offset, top_row, BLOCK)[0]
        beaten += (other_score[None, :] >= score[:, None]).to(tl.int32)
    if (first <= block) & (block < last):
        other_score, other = _others(SCORE, TOP_VALS, PARENT, RANK, block, last, parent_offset, top_row, BLOCK)
        beaten += _beats(score, c, other_score, other).to(tl.int32)
    for start in range(tl.maximum(first, block + BLOCK), last, BLOCK):
        other_score = _others(SCORE, TOP_VALS, PARENT, RANK, start, last, parent_offset, top_row, BLOCK)[0]
        beaten += (other_score[None, :] > score[:, None]).to(tl.int32)
    tl.atomic_add(PLACE + c, tl.sum(beaten, axis=1), mask=valid)  # integer sums: the same in any order


@triton.jit(do_not_specialize=["count", "keep", "parent_offset", "offset", "depth", "top_k"])
def _tree_depth_kernel(TOP_VALS, TOP_IDS, PARENT, RANK, SCORE, PLACE, PARENT_ENTRY, TOKEN, DEPTH,
                       count, keep, parent_offset, offset, depth, top_k, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Depth ``depth`` (1..D): its ``count`` candidates (PARENT / RANK [count]), children of the
    previous depth's entries from ``parent_offset`` on (-1: the root), whose places in the depth's
    best-first order ``_tree_count_kernel`` counted into PLACE; its ``keep`` best written as entries
    offset..offset+keep-1 of SCORE / PARENT_ENTRY / TOKEN / DEPTH."""
    wait_for_inputs(PDL)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = c < count
    top_row = (depth - 1) * top_k
    parent, rank, score = _load_candidates(SCORE, TOP_VALS, PARENT, RANK, c, valid, parent_offset, top_row)
    place = tl.load(PLACE + c, mask=valid, other=0)
    kept = valid & (place < keep)
    entry = offset + place
    tl.store(SCORE + entry, score, mask=kept)
    tl.store(PARENT_ENTRY + entry, tl.where(parent_offset >= 0, parent + parent_offset, -1), mask=kept)
    tl.store(TOKEN + entry, tl.load(TOP_IDS + top_row + rank, mask=valid, other=0), mask=kept)
    tl.store(DEPTH + entry, tl.zeros_like(place).to(tl.int64) + depth, mask=kept)


@triton.jit(do_not_specialize=["count", "nodes", "depths"])
def _tree_merge_kernel(SCORE, BOUNDS, ORDER, NODE_OF, count, nodes, depths, STEPS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Entries [count] in depth order, depth d's at BOUNDS[d]..BOUNDS[d+1]-1 best first -> ORDER [nodes]
    (node i+1 = entry ORDER[i]) and NODE_OF [count] (entry -> its node index, for the kept entries).

    An entry's place is how many entries beat it (a higher score, or an equal one enumerated first),
    summed over the depths: its own depth's entries before it, and in every other depth, whose scores
    fall along it, a binary search of STEPS halvings (an earlier depth's equal scores beat it, a later
    one's do not)."""
    wait_for_inputs(PDL)
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = e < count
    score = tl.load(SCORE + e, mask=valid, other=0.0)
    place = tl.zeros((BLOCK,), dtype=tl.int32)
    for d in range(depths):
        first, after = tl.load(BOUNDS + d), tl.load(BOUNDS + d + 1)
        earlier = after <= e  # depth d is enumerated before each entry's own (ties beat it)
        lo = tl.zeros((BLOCK,), dtype=tl.int32) + first
        hi = tl.zeros((BLOCK,), dtype=tl.int32) + after
        for _ in tl.static_range(STEPS):  # lo: the first of depth d's entries that does not beat it
            open_ = lo < hi
            mid = (lo + hi) // 2
            other = tl.load(SCORE + mid, mask=valid & open_, other=0.0)
            beats = (other > score) | (earlier & (other == score))
            lo = tl.where(open_ & beats, mid + 1, lo)
            hi = tl.where(open_ & ~beats, mid, hi)
        own = (first <= e) & (e < after)
        place += tl.where(own, e - first, lo - first)
    kept = valid & (place < nodes)
    tl.store(ORDER + place, e.to(tl.int64), mask=kept)
    tl.store(NODE_OF + e, (place + 1).to(tl.int64), mask=kept)


@triton.jit(do_not_specialize=["nodes", "max_depth"])
def _tree_finish_kernel(ORDER, NODE_OF, SCORE, PARENT_ENTRY, TOKEN, DEPTH, TOKENS, DEPTHS, LOG_PROBS, PARENTS,
                        VISIBLE, nodes, max_depth, ROWS: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr):
    """Program (block of rows 0..nodes of the ancestor matrix, block of its columns): VISIBLE
    [nodes+1, nodes+1] (uint8), row r = node r, its ancestors and the root; each row walks its entry's
    parents (at most max_depth). The column-block-0 programs also write the nodes' fields."""
    wait_for_inputs(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    is_node = (r >= 1) & (r <= nodes)
    entry = tl.load(ORDER + r - 1, mask=is_node, other=-1)
    if tl.program_id(1) == 0:
        parent_entry = tl.load(PARENT_ENTRY + entry, mask=is_node, other=-1)
        parent = tl.load(NODE_OF + parent_entry, mask=parent_entry >= 0, other=0)  # the root: node 0
        tl.store(TOKENS + r - 1, tl.load(TOKEN + entry, mask=is_node, other=0), mask=is_node)
        tl.store(DEPTHS + r - 1, tl.load(DEPTH + entry, mask=is_node, other=0), mask=is_node)
        tl.store(LOG_PROBS + r - 1, tl.load(SCORE + entry, mask=is_node, other=0.0), mask=is_node)
        tl.store(PARENTS + r, tl.where(r == 0, -1, parent), mask=r <= nodes)
    visible = (cols[None, :] == 0) | (cols[None, :] == r[:, None])
    for _ in range(max_depth):  # a loop, not unrolled: one [ROWS, COLS] tile live
        entry = tl.load(PARENT_ENTRY + entry, mask=entry >= 0, other=-1)
        ancestor = tl.load(NODE_OF + entry, mask=entry >= 0, other=0)
        visible |= cols[None, :] == ancestor[:, None]
    tl.store(VISIBLE + r[:, None] * (nodes + 1) + cols[None, :], visible.to(tl.uint8),
             mask=(r <= nodes)[:, None] & (cols <= nodes)[None, :])


def _shares(blocks: int, device: torch.device, per_multiprocessor: int) -> int:
    """How many shares of the others a depth's count is split into: enough programs to give every
    multiprocessor ``per_multiprocessor`` (a count of blocks x blocks steps in one program each was the
    build's cost, one launch after another: ``benchmarks/gpu_speed.py --profile``), at most one block of
    others a share."""
    return max(1, min(blocks, triton.cdiv(per_multiprocessor * multiprocessors(device), blocks)))


@functools.lru_cache(maxsize=64)
def _depth_bounds(keeps: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[depths + 1] int32: where each depth's entries start, then their count. Cached, as the pairs are
    (a captured build finds it made by the warm-up before the capture)."""
    return torch.tensor(list(itertools.accumulate(keeps, initial=0)), dtype=torch.int32).to(device)


def best_prefixes(top_vals: torch.Tensor, top_ids: torch.Tensor, budget: int,
                  pairs: list[tuple[torch.Tensor, torch.Tensor]]):
    """The best-first tree from each depth's top-K: top_vals [D, K] float64 log-probs (best first),
    top_ids [D, K] their tokens, pairs[d] = (parent, rank) of depth d's candidates (parent-major, as
    ``tree._candidate_pairs`` enumerates them). Returns (tokens [n], depths [n], parents [n+1],
    visibility [n+1, n+1] bool, log_probs [n] float64), as ``tree.build_tree``."""
    device = top_vals.device
    keeps = [min(budget, parent.numel()) for parent, _ in pairs]
    entries = sum(keeps)
    nodes = min(budget, entries)
    score = torch.empty(entries, dtype=torch.float64, device=device)
    parent_entry, token, depth_of = (torch.empty(entries, dtype=torch.long, device=device) for _ in range(3))
    top_vals, top_ids = top_vals.contiguous(), top_ids.contiguous()
    counts = [parent.numel() for parent, _ in pairs]
    places = torch.zeros(sum(counts), dtype=torch.int32, device=device)  # each depth's count, from its start
    offset, parent_offset, first = 0, -1, 0  # the first entry of this depth, of the one before (-1: the root)
    for depth, ((parent, rank), keep, count) in enumerate(zip(pairs, keeps, counts), 1):
        place = places[first : first + count]
        blocks = triton.cdiv(count, BLOCK)
        wide = blocks >= WIDE_COUNT_BLOCKS
        share = BLOCK * triton.cdiv(blocks, _shares(blocks, device, 2 if wide else 1))
        (_tree_wide_count_kernel if wide else _tree_count_kernel)[(blocks, triton.cdiv(count, share))](
            top_vals, parent, rank, score, place, count, parent_offset, depth, top_vals.shape[1], share,
            BLOCK=BLOCK, num_warps=4, **launch_options(device))
        _tree_depth_kernel[(blocks,)](
            top_vals, top_ids, parent, rank, score, place, parent_entry, token, depth_of, count, keep, parent_offset,
            offset, depth, top_vals.shape[1], BLOCK=BLOCK, num_warps=4, **launch_options(device))
        parent_offset, offset, first = offset, offset + keep, first + count
    order = torch.empty(nodes, dtype=torch.long, device=device)
    node_of = torch.empty(entries, dtype=torch.long, device=device)
    _tree_merge_kernel[(triton.cdiv(entries, BLOCK),)](
        score, _depth_bounds(tuple(keeps), device), order, node_of, entries, nodes, len(keeps),
        STEPS=max(keeps).bit_length(), BLOCK=BLOCK, num_warps=4, **launch_options(device))
    tokens, depths = (torch.empty(nodes, dtype=torch.long, device=device) for _ in range(2))
    log_probs = torch.empty(nodes, dtype=torch.float64, device=device)
    parents = torch.empty(nodes + 1, dtype=torch.long, device=device)
    visible = torch.empty(nodes + 1, nodes + 1, dtype=torch.uint8, device=device)
    rows, cols = 16, 128
    _tree_finish_kernel[(triton.cdiv(nodes + 1, rows), triton.cdiv(nodes + 1, cols))](
        order, node_of, score, parent_entry, token, depth_of, tokens, depths, log_probs, parents, visible, nodes,
        len(pairs), ROWS=rows, COLS=cols, num_warps=4, **launch_options(device))
    return tokens, depths, parents, visible.view(torch.bool), log_probs
