"""A tree pass's shape for the GDN layers, in two Triton launches (CUDA; ``gdn.TreeShape.build`` calls it).

Every GDN layer of a tree pass reads, per node, its ancestors (``gdn.ancestor_table``) and the rows of
its conv taps (``gdn.conv_lag_index``), and the CUDA tree kernel reads its blocks
(``tree_blocks.tree_blocks``). Built once per pass in torch they take about 70 small kernels (of a
27B tree pass's 832), three stable sorts among them. Here they are two kernels, equal to the torch
forms element for element (``tests/workers/models/test_interpreted_kernels.py``).

The blocks need the nodes in depth-first preorder (children in index order). Here each node's place
in it is counted, not sorted. The nodes before t are its depth(t) strict ancestors and, for each node
a on its path, the subtrees of a's earlier siblings:

    place(t) = depth(t) + sum over a on t's path (t included) of left(a),
    left(a)  = sum of size(s) over the siblings s < a,  size(s) = the nodes in s's subtree.

One program does the counting. Each phase reads what the whole program wrote in the phase before,
through global memory after a barrier. A second launch, a program per block, writes the blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.models.pdl_triton import launch_options, wait_for_inputs
from workers.models.tree_blocks import TREE_BLOCK, root_apart

NODES_PER_STEP = 512  # nodes a step of the counting program's walks takes (a 257-node pass in one)
PAIRS_SIDE = 64  # the counting program's sibling test: [64, 64] pairs a step


@triton.jit
def _tree_count_places_kernel(PARENTS, ANC, LAG, DEPTH, SIZE, LEFT, ORDER, nodes, WINDOW: tl.constexpr,
                              P: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr):
    """One program. PARENTS [nodes] (-1: a root); writes ANC [nodes, P] (node t, its parent, ..., then the
    sentinel ``nodes``), LAG [nodes, WINDOW + 1] (rows of cat(conv window, node inputs)), and ORDER
    [nodes] int32, the preorder; DEPTH, SIZE, LEFT [nodes] int32 are its scratch."""
    wait_for_inputs(PDL)
    for start in range(0, nodes, BT):
        t = start + tl.arange(0, BT)
        tl.store(SIZE + t, tl.zeros((BT,), tl.int32), mask=t < nodes)
    tl.debug_barrier()
    # each node's path (its ancestors, its depth, one more node in every subtree on it), its conv rows
    for start in range(0, nodes, BT):
        t = start + tl.arange(0, BT)
        real = t < nodes
        node = tl.where(real, t, nodes)
        depth = tl.full((BT,), -1, tl.int32)
        for m in tl.static_range(P):
            tl.store(ANC + t * P + m, node, mask=real)
            on = node < nodes
            tl.atomic_add(SIZE + node, tl.full((BT,), 1, tl.int32), mask=on)
            depth += on.to(tl.int32)
            parent = tl.load(PARENTS + node, mask=on, other=-1).to(tl.int32)
            node = tl.where(parent >= 0, parent, nodes)
        tl.store(DEPTH + t, depth, mask=real)
        row = t + WINDOW  # tap 0: the node's own input; each tap one step back
        for lag in tl.static_range(WINDOW + 1):
            tl.store(LAG + t * (WINDOW + 1) + lag, row, mask=real)
            committed = row < WINDOW  # a committed row steps back one (the oldest stays); a node to its parent
            parent = tl.load(PARENTS + row - WINDOW, mask=real & ~committed, other=-1).to(tl.int32)
            row = tl.where(committed, tl.maximum(row - 1, 0), tl.where(parent >= 0, parent + WINDOW, WINDOW - 1))
    tl.debug_barrier()
    # left(a): the sizes of the subtrees of a's earlier siblings (only nodes before a's step can be)
    for start in range(0, nodes, BS):
        a = start + tl.arange(0, BS)
        parent_a = tl.load(PARENTS + a, mask=a < nodes, other=-2)
        left = tl.zeros((BS,), tl.int32)
        for other in range(0, start + BS, BS):
            s = other + tl.arange(0, BS)
            parent_s = tl.load(PARENTS + s, mask=s < nodes, other=-3)
            size_s = tl.load(SIZE + s, mask=s < nodes, other=0)
            sibling = (parent_s[None, :] == parent_a[:, None]) & (s[None, :] < a[:, None])
            left += tl.sum(tl.where(sibling, size_s[None, :], 0), axis=1)
        tl.store(LEFT + a, left, mask=a < nodes)
    tl.debug_barrier()
    for start in range(0, nodes, BT):
        t = start + tl.arange(0, BT)
        real = t < nodes
        place = tl.load(DEPTH + t, mask=real, other=0)
        for m in tl.static_range(P):
            a = tl.load(ANC + t * P + m, mask=real, other=nodes)
            place += tl.load(LEFT + a, mask=a < nodes, other=0)
        tl.store(ORDER + place, t, mask=real)


@triton.jit
def _tree_block_slots_kernel(ANC, ORDER, SLOTS, MASK, nodes, skipped, P: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
    """Program (block i): SLOTS[i] [S = P + BLOCK] = the strict ancestors of the block's first node
    (parent first, the sentinel past the root), the sentinel, its BLOCK nodes of the preorder after its
    first ``skipped`` (1: the root apart) (the sentinel past the last); MASK[i] [S, S] uint8: slot b is
    slot a or one of its ancestors, both real."""
    wait_for_inputs(PDL)
    i = tl.program_id(0)
    S: tl.constexpr = P + BLOCK
    j = tl.arange(0, S)
    first = tl.load(ORDER + skipped + i * BLOCK)
    context = tl.load(ANC + first * P + 1 + j, mask=j < P - 1, other=nodes)
    at = skipped + i * BLOCK + j - P
    member = tl.load(ORDER + at, mask=(j >= P) & (at < nodes), other=nodes)
    slot = tl.where(j < P - 1, context, tl.where(j >= P, member, nodes))
    tl.store(SLOTS + i * S + j, slot)
    seen = tl.zeros((S, S), tl.int1)
    for m in tl.static_range(P):
        up = tl.load(ANC + slot * P + m, mask=slot < nodes, other=nodes)  # slot a's m-th ancestor
        seen = seen | (up[:, None] == slot[None, :])
    seen = seen & (slot < nodes)[None, :]
    tl.store(MASK + i * S * S + j[:, None] * S + j[None, :], seen.to(tl.uint8))


def tree_shape(parents: torch.Tensor, window: int, width: int) -> tuple[torch.Tensor, ...]:
    """(ancestors [q, width], lag_index [q, window + 1], block slots [n, width + TREE_BLOCK], block mask
    [n, S, S] bool) of the tree ``parents`` [q] (-1 for the root): ``gdn.ancestor_table(parents, width)``,
    ``gdn.conv_lag_index(parents, window)`` and ``tree_blocks.tree_blocks`` of those ancestors."""
    nodes, device = parents.shape[0], parents.device
    skipped = int(root_apart(nodes))
    count, side = -(-(nodes - skipped) // TREE_BLOCK), width + TREE_BLOCK
    ancestors = torch.empty(nodes, width, dtype=torch.long, device=device)
    lag_index = torch.empty(nodes, window + 1, dtype=torch.long, device=device)
    scratch = torch.empty(4, nodes, dtype=torch.int32, device=device)  # depth, size, left, the preorder
    slots = torch.empty(count, side, dtype=torch.long, device=device)
    mask = torch.empty(count, side, side, dtype=torch.uint8, device=device)
    _tree_count_places_kernel[(1,)](
        parents.contiguous(), ancestors, lag_index, *scratch, nodes, WINDOW=window, P=width, BT=NODES_PER_STEP,
        BS=PAIRS_SIDE, **launch_options(device))
    _tree_block_slots_kernel[(count,)](ancestors, scratch[3], slots, mask, nodes, skipped, P=width,
                                       BLOCK=TREE_BLOCK, **launch_options(device))
    return ancestors, lag_index, slots, mask.view(torch.bool)
