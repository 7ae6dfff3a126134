"""The drafter's pass as CUDA graphs: one per (new-context length, rows), replayed every round.

A DFlash round feeds the drafter the taps of the tokens committed last round (1..block_size of
them) plus the block [bonus, MASK...]. ``DraftGraphs`` keeps static input buffers and one drafter
cache for the whole run (graphs hold its addresses, so it is reused across prompts), captures
``DFlashDrafter.forward_at`` + the target's lm_head for each new-context length the first time it
is seen, and replays it after. Longer new contexts (the prompt, once per generation) run eagerly.
DDTree's tree build is captured here too (per tree knobs), since it follows every drafter pass.
"""

from __future__ import annotations

import torch

from workers.decoding.tree import DraftTree, TreeParams, build_tree
from workers.models.drafter import DFlashDrafter
from workers.models.graph_cache import GraphCache, capture


class DraftGraphs:
    def __init__(self, drafter: DFlashDrafter, capacity: int) -> None:
        capacity = -(-capacity // 1024) * 1024  # rounded up so slightly longer prompts reuse the graphs
        weight = drafter.fc.weight
        self.cache = drafter.new_cache(capacity)
        self.capacity = capacity
        self.block_ids = torch.full((1, drafter.block_size), drafter.spec.mask_token_id, dtype=torch.long,
                                    device=weight.device)
        self.context = torch.zeros((1, drafter.block_size, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        self.length = torch.zeros((), dtype=torch.long, device=weight.device)
        # by (new-context length, rows): up to block_size lengths for each of a few drafting depths
        self.graphs = GraphCache(3 * drafter.block_size)
        # DDTree's tree build from the draft logits, by (tree knobs, logits shape): sorts and gathers
        # of fixed shapes, ~290 small kernels: 2.5-5 ms launched one by one from Python on an H200,
        # 0.7-1.1 ms replayed (B <= 256)
        self.tree_graphs = GraphCache(4)

    @classmethod
    def for_run(cls, drafter: DFlashDrafter, capacity: int) -> DraftGraphs:
        """The drafter's graphs for a run needing ``capacity`` slots: kept on the drafter, reset per run."""
        existing = getattr(drafter, "_draft_graphs", None)
        if existing is None or existing.capacity < capacity:
            existing = cls(drafter, capacity)
            drafter._draft_graphs = existing
        existing.cache.reset()
        return existing

    def draft(self, drafter: DFlashDrafter, target, bonus: torch.Tensor, new_context: torch.Tensor, rows: int):
        """Draft logits [rows, V] (the graph's static output, valid until the next call)."""
        num_new = new_context.shape[1]
        if self.cache.length + num_new + drafter.block_size > self.capacity:
            raise RuntimeError(f"drafter cache overflow: {self.cache.length + num_new} > capacity {self.capacity}")
        self.block_ids[0, :1].copy_(bonus.view(1))
        self.context[:, :num_new].copy_(new_context)
        self.length.fill_(self.cache.length)
        key = (num_new, rows)
        if key not in self.graphs:
            self.graphs[key] = self._capture(drafter, target, num_new, rows)
        graph, logits = self.graphs[key]
        graph.replay()
        self.cache.length += num_new
        return logits

    def build_tree(self, draft_logits: torch.Tensor, params: TreeParams) -> DraftTree:
        """``build_tree(log_softmax(draft_logits))`` replayed from a graph (static outputs, valid
        until the next call)."""
        key = (params, tuple(draft_logits.shape), draft_logits.dtype)
        if key not in self.tree_graphs:
            logits = draft_logits.clone()
            graph, tree = capture(lambda: build_tree(torch.log_softmax(logits.float(), dim=-1), params))
            self.tree_graphs[key] = (logits, graph, tree)
        logits, graph, tree = self.tree_graphs[key]
        logits.copy_(draft_logits)
        graph.replay()
        return tree

    def _pass(self, drafter: DFlashDrafter, target, num_new: int, rows: int) -> torch.Tensor:
        embeds = target.model.get_input_embeddings()(self.block_ids)
        hidden = drafter.forward_at(embeds, self.context[:, :num_new], self.cache, self.length)
        return target.model.get_output_embeddings()(hidden[0, 1 : 1 + rows])

    def _capture(self, drafter: DFlashDrafter, target, num_new: int, rows: int):
        # the warm-ups rewrite the same context K/V into the same slots
        return capture(lambda: self._pass(drafter, target, num_new, rows))
