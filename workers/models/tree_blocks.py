"""How the CUDA tree kernel of the GDN layers (``gdn_triton.tree_outputs``) groups a tree's
nodes: ``TREE_BLOCK`` consecutive nodes of the preorder per block, with the ancestors of the block's
first node before them, so that a block holds every root-to-node path its nodes need. A pass's tree has
one root, node 0 (the last committed token's successor); where the other nodes fill whole blocks, the
root is left out of them (``root_apart``) and the kernel gives it a program of its own.
"""

from __future__ import annotations

import torch

TREE_BLOCK = 16  # nodes per block of the CUDA tree kernel


def preorder(ancestors: torch.Tensor) -> torch.Tensor:
    """[q] the nodes in depth-first preorder (children in index order), from an ``ancestor_table``.

    Preorder is the lexicographic order of root-to-node paths of node ids. The paths are packed into
    int64 keys, as many ids per key as fit, and sorted key by key from the least significant (stable
    sorts, so no host read: it runs inside a captured pass).
    """
    q, width = ancestors.shape
    depth = (ancestors < q).sum(1) - 1  # [q]
    back = depth[:, None] - torch.arange(width, device=ancestors.device)  # column of the depth-j ancestor
    path = torch.where(back >= 0, ancestors.gather(1, back.clamp(min=0)) + 1, 0)  # [q, width], 0 past the node
    bits = max(1, q.bit_length())
    per_key = 63 // bits
    order = torch.arange(q, device=ancestors.device)
    for start in reversed(range(0, width, per_key)):
        columns = path[:, start : start + per_key]
        shifts = bits * (per_key - 1 - torch.arange(columns.shape[1], device=ancestors.device))
        key = (columns << shifts).sum(1)
        order = order[torch.sort(key[order], stable=True).indices]
    return order


def root_apart(q: int, block: int = TREE_BLOCK) -> bool:
    """Whether the root stays out of the blocks: when the other q - 1 nodes fill whole blocks, as at every
    budget of whole blocks (q = B + 1: 17, 65, 257, 1025), so that it does not make a block of its own.
    Its path is itself: its own program costs a fraction of a block's, and the grid one block fewer."""
    return q > 1 and q % block == 1


def tree_blocks(ancestors: torch.Tensor, block: int = TREE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA tree kernel's blocks: (slots [n, W + block] long, mask [n, W + block, W + block] bool),
    W = ancestors.shape[1], n = ceil(q / block), or (q - 1) / block when ``root_apart(q, block)``.

    Block i holds ``block`` consecutive nodes of the preorder (without the root when ``root_apart``:
    the preorder's first node, an ancestor of every other; slots W..) and, before them, the strict
    ancestors of its first node (slots 0..W-2, parent first; slot W-1 and slots past the root hold the
    sentinel q). In preorder every ancestor of a node in the block is in the block or an ancestor of its
    first node, so the slots hold every path the block's nodes need. mask[i, a, b]: slot b is slot a or
    one of its ancestors (both real nodes).
    """
    q, width = ancestors.shape
    order = preorder(ancestors)[int(root_apart(q, block)):]  # the root is the preorder's first node
    count = -(-order.shape[0] // block)
    members = torch.cat((order, order.new_full((count * block - order.shape[0],), q))).view(count, block)
    with_sentinel = torch.cat((ancestors, ancestors.new_full((1, width), q)))  # row q: the sentinel's
    context = with_sentinel[members[:, 0], 1:]  # [n, W-1]
    slots = torch.cat((context, members.new_full((count, 1), q), members), dim=1)  # [n, S]
    paths = with_sentinel[slots]  # [n, S, W]
    mask = (paths[:, :, None, :] == slots[:, None, :, None]).any(-1) & (slots < q)[:, None, :]
    return slots, mask
