"""DDTree draft trees: build the tree from drafter log-probs, and follow it after verification.

Both run on whatever device the log-probs are on (the GPU in production, the CPU in tests), with
fixed shapes for given knobs and no host read. The tree is indexed with the root (the bonus token,
already committed-to-be) at 0 and the drafted nodes at 1..n in best-first order, which is
topological: every node's parent has a smaller index.

Best-first construction (DDTree paper, Algorithm 1): treating the drafter's per-position
distributions as independent, the tree of n nodes that maximises expected acceptance is the set of
the n most probable prefixes. The paper pops them from a heap one node at a time; here they are
found one depth at a time: the best n prefixes of depth d all extend the best n of depth d-1, so
each depth is one sort over (kept parent, top-K token) pairs, and one last sort merges the depths.
Exact ties in path probability go to the shallower prefix, then to the child of the better-placed
parent, then to the better-ranked token, so the tree is deterministic.
"""

from __future__ import annotations

import functools

import torch

from workers.decoding.params import TreeParams
from workers.models.kernels import triton_available
from workers.seam import Draft, DraftTree, Lattice


def build_tree(draft_log_probs: torch.Tensor, params: TreeParams, kernels: bool | None = None) -> DraftTree:
    """draft_log_probs [L, V] (log-softmax of the drafter, one row per future position) -> DraftTree.

    Path log-probs are summed in float64 (root to leaf), so the order of near-equal prefixes is stable.
    ``kernels``: the depths, merge and ancestor matrix as ``tree_triton``'s few kernels (the same
    tree, bit for bit); None: on CUDA when Triton is installed.
    """
    num_positions, vocab_size = draft_log_probs.shape
    device = draft_log_probs.device
    depth_limit = num_positions if params.max_depth is None else min(params.max_depth, num_positions)
    top_k = min(params.budget, vocab_size)
    if params.branching is not None:
        top_k = min(top_k, params.branching)
    top_vals, top_ids = torch.topk(draft_log_probs[:depth_limit], k=top_k, dim=-1)  # [D, K], best first
    top_vals = _discounted(top_vals.double(), params, depth_limit)
    pairs = _level_pairs(depth_limit, top_k, params.budget, device)
    if (draft_log_probs.is_cuda and triton_available()) if kernels is None else kernels:
        from workers.decoding.tree_triton import best_prefixes

        return DraftTree(*best_prefixes(top_vals, top_ids, params.budget, pairs))

    # Per depth, the kept prefixes best first: path score, parent entry and token. Entries are
    # numbered across depths (depth 1 first); the root is entry -1. Candidates are enumerated
    # parent-major, rank-minor, so a stable sort on score alone breaks exact ties by (parent, rank).
    scores = torch.zeros(1, dtype=torch.float64, device=device)  # the root
    parent_offset, next_offset = -1, 0  # entry number of the previous depth's first prefix, of this one's
    levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for depth, (parent, rank) in enumerate(pairs):
        candidates = scores[parent] + top_vals[depth, rank]  # [C]
        best = torch.sort(candidates, descending=True, stable=True).indices[: params.budget]
        scores = candidates[best]
        depths = torch.full_like(best, depth + 1)
        levels.append((scores, parent[best] + parent_offset, top_ids[depth, rank[best]], depths))
        parent_offset, next_offset = next_offset, next_offset + best.numel()

    return _merge_levels(levels, params.budget, depth_limit)


def build_lattice_tree(lattice: Lattice, params: TreeParams) -> DraftTree:
    """A DFlash2 drafter's ``Lattice`` -> DraftTree: the ``budget`` most probable walks from the anchor,
    a walk's log-prob the sum of the selector's log-probs along it (each candidate's given the one
    before it), at most ``max_depth`` deep and ``branching`` children a node.

    The same construction as ``build_tree`` (the best prefixes of depth d extend the best of depth
    d - 1; one sort per depth, one merge), where a child's log-prob now depends on its parent's
    candidate: every kept prefix carries its candidate's index as its state. Ties break as there:
    the shallower prefix, then the better-placed parent, then the better child (then the better logit).
    """
    num_positions, top_k = lattice.tokens.shape
    device = lattice.tokens.device
    depth_limit = num_positions if params.max_depth is None else min(params.max_depth, num_positions)
    width = min(top_k, params.budget, params.branching or top_k)
    # every parent state's children, best first: [D, K (parent), width]
    child_vals, child_of = torch.sort(lattice.log_probs[:depth_limit].double(), dim=-1, descending=True, stable=True)
    child_vals, child_of = _discounted(child_vals[..., :width], params, depth_limit), child_of[..., :width]
    scores = torch.zeros(1, dtype=torch.float64, device=device)  # the root
    states = torch.zeros(1, dtype=torch.long, device=device)  # the root's row: at depth 1 every row is the anchor's
    parent_offset, next_offset = -1, 0
    levels = []
    for depth in range(depth_limit):
        candidates = (scores[:, None] + child_vals[depth, states]).reshape(-1)  # [kept x width], parent-major
        best = torch.sort(candidates, descending=True, stable=True).indices[: params.budget]
        parent, rank = best // width, best % width
        states = child_of[depth, states[parent], rank]
        scores = candidates[best]
        levels.append((scores, parent + parent_offset, lattice.tokens[depth, states], torch.full_like(best, depth + 1)))
        parent_offset, next_offset = next_offset, next_offset + best.numel()
    return _merge_levels(levels, params.budget, depth_limit)


def _discounted(log_probs: torch.Tensor, params: TreeParams, depth_limit: int) -> torch.Tensor:
    """log_probs [D, ...] (float64, depth first) times depth d's weight ``params.depth_weights``; as they are
    without a discount. Every factor is positive and every log-prob <= 0, so scores still fall along a path."""
    weights = params.depth_weights(depth_limit)
    if weights is None:
        return log_probs
    factor = torch.tensor(weights, dtype=log_probs.dtype, device=log_probs.device)
    return log_probs * factor.view(-1, *([1] * (log_probs.dim() - 1)))


def build_draft_tree(draft: Draft, params: TreeParams) -> DraftTree:
    """The tree of a drafter pass's proposal: DFlash's draft logits (``build_tree`` of their
    log-softmax) or DFlash2's lattice (``build_lattice_tree``)."""
    if isinstance(draft, Lattice):
        return build_lattice_tree(draft, params)
    return build_tree(torch.log_softmax(draft.float(), dim=-1), params)


def _merge_levels(levels: list[tuple[torch.Tensor, ...]], budget: int, depth_limit: int) -> DraftTree:
    """Per depth (score, parent entry, token, depth), best first -> the tree of the ``budget`` best
    entries: entries in depth order, then a stable sort by score."""
    device = levels[0][0].device
    all_scores, parent_entry, tokens, depth_of = (torch.cat(column) for column in zip(*levels))
    order = torch.sort(all_scores, descending=True, stable=True).indices[:budget]  # node i+1 = entry order[i]
    # entry -> node index (1..n), shifted by one so that the root's entry -1 maps to node 0
    node_of = torch.zeros(all_scores.numel() + 1, dtype=torch.long, device=device)
    node_of[order + 1] = torch.arange(1, order.numel() + 1, device=device)
    parents = torch.cat((torch.full((1,), -1, dtype=torch.long, device=device), node_of[parent_entry[order] + 1]))
    return DraftTree(
        tokens=tokens[order],
        depths=depth_of[order],
        parents=parents,
        visibility=ancestor_matrix(parents, depth_limit),
        log_probs=all_scores[order],
    )


def _level_pairs(depth_limit: int, top_k: int, budget: int,
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each depth's candidate (parent, rank) pairs: the previous depth keeps min(budget, its
    candidates) prefixes (the root alone before depth 1), whose children these are."""
    pairs, parents = [], 1
    for _ in range(depth_limit):
        parent, rank = _candidate_pairs(parents, top_k, budget, device)
        pairs.append((parent, rank))
        parents = min(budget, parent.numel())
    return pairs


@functools.lru_cache(maxsize=64)
def _candidate_pairs(
    num_parents: int, top_k: int, budget: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent, rank) of the children that can be among a depth's best ``budget``, parent-major.

    With parents and tokens each sorted best first, child (j, r) is beaten by every (j' <= j, r' <= r)
    (no lower score, earlier on ties): if there are more than ``budget`` of those, (j+1)(r+1) > budget,
    it cannot make the cut. This keeps ~budget * ln(budget) candidates instead of budget * K. Cached
    (the first call of a captured tree build runs outside the capture, so no copy happens inside it).
    """
    pairs = [(j, r) for j in range(num_parents) for r in range(min(top_k, budget // (j + 1)))]
    parent, rank = torch.tensor(pairs, dtype=torch.long).T.contiguous()  # (the kernels read them flat)
    return parent.to(device), rank.to(device)


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [n+1] -> bool [n+1, n+1], row i marks i and all its ancestors (the root included).

    Vectorised over nodes: each step ORs in the parent's row, so after max_depth steps every row
    holds its whole ancestry; a fixed number of steps, no host read.
    """
    size = parents.numel()
    identity = torch.eye(size, dtype=torch.bool, device=parents.device)
    parent_rows = parents.clamp(min=0)  # the root's own row stands in for its missing parent
    visibility = identity
    for _ in range(max_depth):
        visibility = identity | visibility[parent_rows]
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
