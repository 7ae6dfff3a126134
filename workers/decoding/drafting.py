"""Drafting: the step both speculative engines share, one object per way of running it.

A DFlash round feeds the drafter the taps of the tokens committed last round plus the block
[bonus, MASK x (block_size-1)] (the target's embedding of it); the pass proposes the positions
after the bonus (``Draft``): a DFlash drafter's draft logits through the target's lm_head, a DFlash2
drafter's ``Lattice`` of candidates. DFlash drafts its ``chain``, DDTree builds its tree from it.
``open_drafting`` picks the way once per generation:

- ``EagerDrafting``: the pass launched op by op (CPU, targets split over devices, debugging);
- ``GraphDrafting``: the pass replayed from a CUDA graph per drafted rows (a prompt's context but its
  last block written ahead, by a graph of its own), and the tree build from a graph per tree knobs. Graphs hold the
  addresses of its buffers and drafter cache, so one ``GraphDrafting`` is kept for as long as the
  target lives, by a ``DraftGraphStore`` in the target's ``drafter_graphs`` (beside the target's own
  graphs), and reset per generation.

Both have the same calls: ``draft(bonus, new_context, rows) -> Draft``, ``chain(draft) -> tokens
[rows]`` and ``build_tree(draft, params) -> DraftTree``, and the round's form of ``draft``:
``draft_counted(bonus, context_rows, count, rows)`` takes the new context's length as a device scalar
(the first ``count`` of ``context_rows``; ``DFlashDrafter.forward_at``), so an engine queues the next
draft before its one host read and the GPU never waits for the host between rounds; the engine then
tells ``advance(count)`` what the read said.
"""

from __future__ import annotations

import torch

from workers.decoding.params import TreeParams
from workers.decoding.tree import build_draft_tree
from workers.models.drafter import DFlashDrafter, DrafterCache
from workers.models.graph_cache import GraphCache, capture
from workers.seam import Draft, DraftTree, Lattice, Target


def _eager_pass(drafter: DFlashDrafter, target: Target, cache: DrafterCache, bonus: torch.Tensor,
                new_context: torch.Tensor, rows: int, count: torch.Tensor | None = None) -> Draft:
    """One drafter pass -> its proposal for the first ``rows`` positions after the bonus. The whole
    block always runs (the drafter was trained on full blocks). ``count``: a device scalar, the new
    context is the first ``count`` rows of ``new_context``, which is padded to the block's rows as
    ``GraphDrafting`` pads it (the same products, so the same bits); the caller advances the cache."""
    block_ids = torch.full((1, drafter.block_size), drafter.spec.mask_token_id, dtype=torch.long, device=bonus.device)
    block_ids[0, :1] = bonus.view(1)
    embed = target.model.get_input_embeddings()
    block_embeds = embed(block_ids.to(embed.weight.device)).to(drafter.fc.weight.device)
    if count is None:
        hidden = drafter(block_embeds, new_context, cache)  # [1, block, H]
    else:
        padded = _padded(new_context, drafter.block_size)
        _check_room(cache, padded.shape[1] + drafter.block_size)
        length = torch.tensor(cache.length, device=padded.device)
        hidden = drafter.forward_at(block_embeds, padded, cache, length, count=count.to(padded.device))
    return drafter.propose(hidden[0, 1 : 1 + rows], target.model.get_output_embeddings(), block_ids[0, :1])


def _padded(context_rows: torch.Tensor, width: int) -> torch.Tensor:
    """context_rows [1, m, k*H] (m <= width) followed by zero rows up to ``width`` rows."""
    padded = context_rows.new_zeros((1, width, context_rows.shape[2]))
    padded[:, : context_rows.shape[1]] = context_rows
    return padded


def _check_room(cache: DrafterCache, rows: int) -> None:
    """A pass writes ``rows`` slots past the committed context: refuse one the cache cannot hold."""
    if cache.length + rows > cache.capacity:
        raise RuntimeError(f"drafter cache overflow: {cache.length + rows} > capacity {cache.capacity}")


def chunk_starts(leading: int, chunk: int) -> list[int]:
    """Where each ``chunk``-row write of a prompt's ``leading`` context rows starts: every ``chunk`` rows,
    the last chunk moved back to end at ``leading`` (rows written twice get the same K/V), or one chunk
    at 0 when ``leading`` <= ``chunk`` (the rows past ``leading`` are padding; their K/V land in slots that
    the round's pass rewrites before any mask reaches them)."""
    if leading <= chunk:
        return [0]
    return [*range(0, leading - chunk, chunk), leading - chunk]


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

    def draft_counted(self, bonus: torch.Tensor, context_rows: torch.Tensor, count: torch.Tensor, rows: int) -> Draft:
        """The pass whose new context is the first ``count`` (a device scalar) of ``context_rows`` [1, m,
        k*H]; ``advance(count)`` follows once the host knows it."""
        return _eager_pass(self.drafter, self.target, self.cache, bonus, context_rows, rows, count)

    def advance(self, count: int) -> None:
        """The last ``draft_counted`` pass's new context was ``count`` rows."""
        self.cache.length += count

    def chain(self, draft: Draft) -> torch.Tensor:
        return chain(draft)

    def build_tree(self, draft: Draft, params: TreeParams) -> DraftTree:
        return build_draft_tree(draft, params)  # on the drafter's device


CONTEXT_CHUNK = 256  # rows of a prompt's context that one replay of the write-ahead graph writes


class GraphDrafting:
    def __init__(self, drafter: DFlashDrafter, target: Target, capacity: int, fused: bool = True,
                 chunk: int = CONTEXT_CHUNK) -> None:
        """``fused``: the drafter's layers as ``fused_drafter`` runs them where they allow (False: op by
        op, what ``benchmarks/gpu_speed.py`` compares against). ``chunk``: rows a ``write_ahead`` replay
        writes."""
        capacity = -(-capacity // 1024) * 1024  # rounded up so slightly longer prompts reuse the graphs
        # Fusing moves the layers' q/k/v and gate/up weights into new storage and frees the old: done
        # now, before any graph records a weight's address (fused or not), never after a capture.
        drafter.fused_layers()
        weight = drafter.fc.weight
        self.drafter, self.target, self.fused = drafter, target, fused
        self.cache = drafter.new_cache(capacity)
        self.capacity = capacity
        self.block_ids = torch.full((1, drafter.block_size), drafter.spec.mask_token_id, dtype=torch.long,
                                    device=weight.device)
        self.context = torch.zeros((1, drafter.block_size, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        self.length = torch.zeros((), dtype=torch.long, device=weight.device)
        self.count = torch.zeros((), dtype=torch.long, device=weight.device)  # new context rows of the pass
        # by drafted rows (a few drafting depths); every pass reads block_size context rows, the first
        # ``count`` of them new
        self.graphs = GraphCache(8)
        # DDTree's tree build by (tree knobs, logits shape): ~290 small kernels of fixed shapes, far
        # cheaper replayed than launched one by one from Python (benchmarks/gpu_speed.py)
        self.tree_graphs = GraphCache(4)
        # the write-ahead graph's inputs: a chunk of context rows and the slot of its first row
        self.chunk_context = torch.zeros((1, chunk, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        self.chunk_start = torch.zeros((), dtype=torch.long, device=weight.device)
        self.chunk_rows = torch.arange(chunk, device=weight.device)  # kept: the graph reads it
        self.write_graph: torch.cuda.CUDAGraph | None = None

    def draft(self, bonus: torch.Tensor, new_context: torch.Tensor, rows: int) -> Draft:
        """The proposal for ``rows`` positions, replayed (the graph's static output, valid until the next
        call). A context longer than a block (the prompt, once per generation) has its leading rows
        written ahead (``write_ahead``); its last block of rows rides the round's pass."""
        leading = new_context.shape[1] - self.drafter.block_size
        if leading > 0:
            self.write_ahead(new_context[:, :leading])
            new_context = new_context[:, leading:]
        num_new = new_context.shape[1]
        self.count.fill_(num_new)
        proposal = self._replay(bonus, new_context, rows)
        self.advance(num_new)
        return proposal

    def write_ahead(self, leading_context: torch.Tensor) -> None:
        """leading_context [1, L, k*H] (a prompt's rows before its last block) into the cache at length..,
        by one graph of ``DFlashDrafter.write_context_at`` replayed a chunk at a time (``chunk_starts``).
        Launched eagerly, that write is a score of small kernels a layer, inside the decode time
        (``benchmarks/first_draft.py``)."""
        leading, start, chunk = leading_context.shape[1], self.cache.length, self.chunk_rows.shape[0]
        _check_room(self.cache, max(leading, chunk))
        for offset in chunk_starts(leading, chunk):
            taken = min(chunk, leading - offset)
            self.chunk_context[:, :taken].copy_(leading_context[:, offset : offset + taken])
            self.chunk_start.fill_(start + offset)
            if not self.chunk_rows.is_cuda:  # the CPU tests: the function the graph records, as it is
                self._write_chunk()
                continue
            if self.write_graph is None:  # the warm-ups write this chunk's K/V, as the replay does
                self.write_graph, _ = capture(self._write_chunk)
            self.write_graph.replay()
        self.cache.length = start + leading

    def _write_chunk(self) -> None:
        with torch.no_grad():  # drafting needs no gradients; autograd refused these writes on a GPU
            self.drafter.write_context_at(self.chunk_context, self.cache, self.chunk_start + self.chunk_rows,
                                          self.fused)

    def draft_counted(self, bonus: torch.Tensor, context_rows: torch.Tensor, count: torch.Tensor, rows: int) -> Draft:
        """The pass whose new context is the first ``count`` (a device scalar) of ``context_rows`` [1, m,
        k*H] (m at most block_size), replayed; ``advance(count)`` follows once the host knows it."""
        self.count.copy_(count)
        return self._replay(bonus, context_rows, rows)

    def advance(self, count: int) -> None:
        """The last pass's new context was ``count`` rows."""
        self.cache.length += count

    def _replay(self, bonus: torch.Tensor, context_rows: torch.Tensor, rows: int) -> Draft:
        """Copy the pass's inputs into the graph's buffers and replay it (captured the first time ``rows``
        comes). The committed length is the host's: every pass before this one has been ``advance``d."""
        _check_room(self.cache, self.context.shape[1] + self.drafter.block_size)
        self.block_ids[0, :1].copy_(bonus.view(1))
        self.context[:, : context_rows.shape[1]].copy_(context_rows)
        self.length.fill_(self.cache.length)
        if rows not in self.graphs:  # the warm-ups rewrite the same context K/V into the same slots
            self.graphs[rows] = capture(lambda: self._pass(rows))
        graph, proposal = self.graphs[rows]
        graph.replay()
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

    def _pass(self, rows: int) -> Draft:
        embeds = self.target.model.get_input_embeddings()(self.block_ids)
        hidden = self.drafter.forward_at(embeds, self.context, self.cache, self.length, self.fused, count=self.count)
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
    capacity += 2 * drafter.block_size  # a pass writes a block of context rows and the block past the committed
    if not target.graphs:
        return EagerDrafting(drafter, target, capacity)
    if target.drafter_graphs is None:
        target.drafter_graphs = DraftGraphStore()
    return target.drafter_graphs.open(drafter, target, capacity)
