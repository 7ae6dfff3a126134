"""Drafting: the step both speculative engines share, one object per way of running it.

A DFlash round feeds the drafter the taps of the tokens committed last round plus the block
[bonus, MASK x (block_size-1)] (the target's embedding of it); the pass proposes the positions
after the bonus (``Draft``): a DFlash drafter's draft logits through the target's lm_head, a DFlash2
drafter's ``Lattice`` of candidates. DFlash drafts its ``chain``, DDTree builds its tree from it.
``open_drafting`` picks the way once per generation:

- ``EagerDrafting``: the pass launched op by op (CPU, targets split over devices, debugging);
- ``GraphDrafting``: the pass replayed from a CUDA graph per (new-context length, rows), and the
  tree build from a graph per tree knobs. Graphs hold the addresses of its buffers and drafter
  cache, so one ``GraphDrafting`` is kept for as long as the target lives, by a ``DraftGraphStore``
  in the target's ``drafter_graphs`` (beside the target's own graphs), and reset per generation.

Both have the same calls: ``draft(bonus, new_context, rows) -> Draft``, ``chain(draft) -> tokens
[rows]`` and ``build_tree(draft, params) -> DraftTree``.
"""

from __future__ import annotations

import torch

from workers.decoding.params import TreeParams
from workers.decoding.tree import build_draft_tree
from workers.models.drafter import DFlashDrafter, DrafterCache
from workers.models.graph_cache import GraphCache, capture
from workers.seam import Draft, DraftTree, Lattice, Target


def _eager_pass(drafter: DFlashDrafter, target: Target, cache: DrafterCache, bonus: torch.Tensor,
                new_context: torch.Tensor, rows: int) -> Draft:
    """One drafter pass -> its proposal for the first ``rows`` positions after the bonus. The whole
    block always runs (the drafter was trained on full blocks)."""
    block_ids = torch.full((1, drafter.block_size), drafter.spec.mask_token_id, dtype=torch.long, device=bonus.device)
    block_ids[0, 0] = bonus[0]
    embed = target.model.get_input_embeddings()
    block_embeds = embed(block_ids.to(embed.weight.device)).to(drafter.fc.weight.device)
    hidden = drafter(block_embeds, new_context, cache)  # [1, block, H]
    return drafter.propose(hidden[0, 1 : 1 + rows], target.model.get_output_embeddings(), block_ids[0, :1])


def chain(draft: Draft) -> torch.Tensor:
    """The chain a DFlash round drafts [rows]: the drafter's greedy guesses (argmax of the draft
    logits; DFlash2: the selector's greedy walk), at any temperature."""
    return draft.greedy if isinstance(draft, Lattice) else draft.argmax(dim=-1)


class EagerDrafting:
    def __init__(self, drafter: DFlashDrafter, target: Target, capacity: int) -> None:
        self.drafter, self.target = drafter, target
        self.cache = drafter.new_cache(capacity)

    def draft(self, bonus: torch.Tensor, new_context: torch.Tensor, rows: int) -> Draft:
        return _eager_pass(self.drafter, self.target, self.cache, bonus, new_context, rows)

    def chain(self, draft: Draft) -> torch.Tensor:
        return chain(draft)

    def build_tree(self, draft: Draft, params: TreeParams) -> DraftTree:
        return build_draft_tree(draft, params)  # on the drafter's device


class GraphDrafting:
    def __init__(self, drafter: DFlashDrafter, target: Target, capacity: int, fused: bool = True) -> None:
        """``fused``: the drafter's layers as ``fused_drafter`` runs them where they allow (False: op by
        op, what ``benchmarks/gpu_speed.py`` compares against)."""
        capacity = -(-capacity // 1024) * 1024  # rounded up so slightly longer prompts reuse the graphs
        weight = drafter.fc.weight
        self.drafter, self.target, self.fused = drafter, target, fused
        self.cache = drafter.new_cache(capacity)
        self.capacity = capacity
        self.block_ids = torch.full((1, drafter.block_size), drafter.spec.mask_token_id, dtype=torch.long,
                                    device=weight.device)
        self.context = torch.zeros((1, drafter.block_size, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        self.length = torch.zeros((), dtype=torch.long, device=weight.device)
        # by (new-context length, rows): up to block_size lengths for each of a few drafting depths
        self.graphs = GraphCache(3 * drafter.block_size)
        # DDTree's tree build by (tree knobs, logits shape): ~290 small kernels of fixed shapes, far
        # cheaper replayed than launched one by one from Python (benchmarks/gpu_speed.py)
        self.tree_graphs = GraphCache(4)

    def draft(self, bonus: torch.Tensor, new_context: torch.Tensor, rows: int) -> Draft:
        """The proposal for ``rows`` positions: replayed for a round's few new tokens (the graph's
        static output, valid until the next call), eager for a longer context (the prompt, once per
        generation)."""
        num_new = new_context.shape[1]
        if num_new > self.drafter.block_size:
            return _eager_pass(self.drafter, self.target, self.cache, bonus, new_context, rows)
        if self.cache.length + num_new + self.drafter.block_size > self.capacity:
            raise RuntimeError(f"drafter cache overflow: {self.cache.length + num_new} > capacity {self.capacity}")
        self.block_ids[0, :1].copy_(bonus.view(1))
        self.context[:, :num_new].copy_(new_context)
        self.length.fill_(self.cache.length)
        key = (num_new, rows)
        if key not in self.graphs:  # the warm-ups rewrite the same context K/V into the same slots
            self.graphs[key] = capture(lambda: self._pass(num_new, rows))
        graph, proposal = self.graphs[key]
        graph.replay()
        self.cache.length += num_new
        return proposal

    def chain(self, draft: Draft) -> torch.Tensor:
        return chain(draft)

    def build_tree(self, draft: Draft, params: TreeParams) -> DraftTree:
        """``build_draft_tree(draft)`` replayed (static outputs, valid until the next call)."""
        key = (params, draft.rows) if isinstance(draft, Lattice) else (params, tuple(draft.shape), draft.dtype)
        if key not in self.tree_graphs:
            static = draft.clone()
            graph, tree = capture(lambda: build_draft_tree(static, params))
            self.tree_graphs[key] = (static, graph, tree)
        static, graph, tree = self.tree_graphs[key]
        static.copy_(draft)
        graph.replay()
        return tree

    def _pass(self, num_new: int, rows: int) -> Draft:
        embeds = self.target.model.get_input_embeddings()(self.block_ids)
        hidden = self.drafter.forward_at(embeds, self.context[:, :num_new], self.cache, self.length, self.fused)
        return self.drafter.propose(hidden[0, 1 : 1 + rows], self.target.model.get_output_embeddings(),
                                    self.block_ids[0, :1])


class DraftGraphStore:
    """One ``GraphDrafting`` kept across generations (its graphs stay valid), grown when a run
    needs more drafter-cache slots than it holds."""

    def __init__(self) -> None:
        self._drafting: GraphDrafting | None = None

    def open(self, drafter: DFlashDrafter, target: Target, capacity: int) -> GraphDrafting:
        current = self._drafting
        reusable = current is not None and current.drafter is drafter and current.target is target
        if not reusable or current.capacity < capacity:
            current = self._drafting = GraphDrafting(drafter, target, capacity)
        current.cache.reset()
        return current


def open_drafting(drafter: DFlashDrafter, target: Target, capacity: int) -> EagerDrafting | GraphDrafting:
    """Graph drafting when the target replays graphs itself (the store kept in its ``drafter_graphs``),
    else eager."""
    if not target.graphs:
        return EagerDrafting(drafter, target, capacity)
    if target.drafter_graphs is None:
        target.drafter_graphs = DraftGraphStore()
    return target.drafter_graphs.open(drafter, target, capacity)
