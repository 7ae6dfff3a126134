"""DDTree draft trees: build the tree from drafter log-probs, and follow it after verification.

Both functions are pure and run on CPU in tests. The tree is indexed with the root (the bonus token,
already committed-to-be) at 0 and the drafted nodes at 1..n in heap pop order, which is topological:
every node's parent has a smaller index.

Best-first construction (DDTree paper, Algorithm 1): treating the drafter's per-position
distributions as independent, the tree of n nodes that maximises expected acceptance is the set of
the n most probable prefixes. A max-heap over (depth, rank-at-depth) pops them in order, pushing
for each popped node its next sibling and its first child.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TreeParams:
    """The tree knobs a sweep tunes.

    budget:    drafted nodes besides the root (>= 1).
    max_depth: deepest level drafted (1..block_size-1); None = every drafter position.
    branching: most children per node, i.e. top-K per depth; None = unlimited (K = min(budget, V)).
    """

    budget: int
    max_depth: int | None = None
    branching: int | None = None

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"tree budget must be >= 1, got {self.budget}")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        if self.branching is not None and self.branching < 1:
            raise ValueError(f"branching must be >= 1, got {self.branching}")


@dataclass(frozen=True)
class DraftTree:
    """A drafted tree of n nodes plus the root (built on CPU; ``to`` moves it for verification).

    tokens:     [n]   token id of node i+1
    depths:     [n]   depth of node i+1 (root is depth 0, so these are >= 1)
    parents:    [n+1] parent index of each node; parents[0] = -1 for the root
    visibility: [n+1, n+1] bool, visibility[i, j] = j is i or an ancestor of i
    log_probs:  [n]   path log-probability of each node under the factorised drafter
    """

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    visibility: torch.Tensor
    log_probs: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    def to(self, device: torch.device) -> DraftTree:
        """The same tree on ``device`` (one copy per round, shared by verify and the walk)."""
        return DraftTree(*(t.to(device, non_blocking=True) for t in
                           (self.tokens, self.depths, self.parents, self.visibility, self.log_probs)))


def build_tree(draft_log_probs: torch.Tensor, params: TreeParams) -> DraftTree:
    """draft_log_probs [L, V] (log-softmax of the drafter, one row per future position) -> DraftTree.

    Ties in path probability are broken by the rank path (lexicographically smaller first), as in the
    reference implementation, so the tree is deterministic.
    """
    num_positions, vocab_size = draft_log_probs.shape
    depth_limit = num_positions if params.max_depth is None else min(params.max_depth, num_positions)
    top_k = min(params.budget, vocab_size)
    if params.branching is not None:
        top_k = min(top_k, params.branching)

    # One device->host copy of the top-K table; the heap then runs on numpy scalars.
    top_vals, top_ids = torch.topk(draft_log_probs[:depth_limit], k=top_k, dim=-1)
    vals = top_vals.double().cpu().numpy()  # path sums in float64: the order of near-equal prefixes is stable
    ids = top_ids.cpu().numpy()

    tokens = np.empty(params.budget, dtype=np.int64)
    depths = np.empty(params.budget, dtype=np.int64)
    parents = np.full(params.budget + 1, -1, dtype=np.int64)
    log_probs = np.empty(params.budget, dtype=np.float64)

    # Heap entry: (-path log-prob, rank path, parent index, depth, rank at depth, path log-prob).
    heap = [(-vals[0, 0], (0,), 0, 1, 0, vals[0, 0])]
    count = 0
    while heap and count < params.budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        tokens[count] = ids[depth - 1, rank]
        depths[count] = depth
        log_probs[count] = score
        count += 1
        parents[count] = parent
        node = count
        if rank + 1 < top_k:  # next sibling: same parent, next-ranked token at this depth
            sibling_score = score - vals[depth - 1, rank] + vals[depth - 1, rank + 1]
            heapq.heappush(heap, (-sibling_score, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sibling_score))
        if depth < depth_limit:  # first child: best token one level deeper
            child_score = score + vals[depth, 0]
            heapq.heappush(heap, (-child_score, ranks + (0,), node, depth + 1, 0, child_score))

    parents_t = torch.from_numpy(parents[: count + 1])
    return DraftTree(
        tokens=torch.from_numpy(tokens[:count]),
        depths=torch.from_numpy(depths[:count]),
        parents=parents_t,
        visibility=ancestor_matrix(parents_t, depth_limit),
        log_probs=torch.from_numpy(log_probs[:count]),
    )


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [n+1] -> bool [n+1, n+1], row i marks i and all its ancestors (the root included).

    Vectorised over nodes: one step up the tree per iteration, at most max_depth iterations.
    """
    size = parents.numel()
    visibility = torch.eye(size, dtype=torch.bool)
    rows = torch.arange(size)
    ancestor = parents.clone()
    for _ in range(max_depth):
        has_ancestor = ancestor >= 0
        if not bool(has_ancestor.any()):
            break
        visibility[rows[has_ancestor], ancestor[has_ancestor]] = True
        ancestor = torch.where(has_ancestor, parents[ancestor.clamp(min=0)], ancestor)
    return visibility


def follow_tree(
    node_tokens: torch.Tensor, parents: torch.Tensor, visibility: torch.Tensor, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the verified tree from the root, following the target's own choice at every node.

    node_tokens   [n]        drafted token of nodes 1..n
    parents       [n+1]      parent index of each node (parents[0] = -1)
    visibility    [n+1, n+1] ancestor-or-self matrix
    target_tokens [n+1]      the target's sampled token *after* each node (root included)
    (all on one device)

    Returns (path, next_token): path = accepted node indices [a+1], root first, in depth order;
    next_token = the target's token after the last accepted node (the next round's bonus).

    Node i is accepted iff every node on its root path was the target's choice at its parent.
    Siblings carry distinct tokens, so the accepted nodes form one chain: no Python loop per node.
    """
    accepted = accepted_nodes(node_tokens, parents, visibility, target_tokens)
    path = accepted.nonzero().squeeze(1)  # ascending index is ascending depth along one chain
    return path, target_tokens[path[-1]]


def accepted_nodes(
    node_tokens: torch.Tensor, parents: torch.Tensor, visibility: torch.Tensor, target_tokens: torch.Tensor
) -> torch.Tensor:
    """bool [n+1]: node i is accepted iff every node on its root path is the target's choice at its
    parent (``follow_tree``'s walk as a mask, computed on the device without a host read)."""
    matches = torch.ones(parents.shape[0], dtype=torch.bool, device=parents.device)
    matches[1:] = target_tokens[parents[1:]] == node_tokens
    return ~(visibility & ~matches.unsqueeze(0)).any(dim=1)
