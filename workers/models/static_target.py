"""The target seam on static buffers with our own decoder loop: hybrids, and CUDA graphs for every model.

``StaticTarget`` runs the decoder layers itself (this module is the loop and the state): plain
attention layers as ``FusedLayer``, the token mixing of Gated DeltaNet layers as ``GDNLayer``
(``workers.models.gdn_layer``: every node continues its parent's conv window and recurrent state),
the hybrids' gated attention, norms and MLPs as ``fused_hybrid``'s layers, and anything else (MoE MLPs,
unknown layer shapes) through the model's own modules. transformers' own forward
cannot do that: its linear-attention layers ignore a 4-D mask (siblings leak into each other's
state) and its hybrid cache cannot be rolled back. For attention-only models the same loop gives
static K/V buffers and a forward whose every tensor has a fixed address, which is what a CUDA graph
needs.

State per sequence: a preallocated K/V buffer per attention layer, and per linear layer the conv
window [K-1, C] and recurrent state [H, dk, dv], all updated in place. A verify pass writes its K/V
after the committed past and leaves each node's conv input, decay and beta (``PendingLayer``);
``commit`` moves the accepted K/V rows into place and replays the accepted path as a short chain
from the committed linear state. The prompt goes through the same loop in chunks, each a chain kept
whole: its GDN layers take the chunked delta rule and one batched conv and advance their state inside
the pass, so nothing is replayed.

With ``graphs=True`` (CUDA), a verify pass of q nodes is captured once as a CUDA graph and then
replayed: its inputs (ids, depths, parents, visibility, committed length) are copied into static
buffers, attention reads the whole K/V buffer under a mask built on the device from the committed
length, and the outputs are the graph's static tensors (valid until the next pass). The commit after
a replayed pass is captured too, per (pass width, path length); the prompt runs eagerly.

A target split over several GPUs (accelerate ``device_map``) runs in segments, a run of layers on
one device each: eagerly the hidden state moves to each layer's device and taps are gathered onto
the drafter's device; with ``graphs=True`` (every part on CUDA) a verify pass is one graph per
segment, the hidden state and the pass's shared inputs handed to the next segment between replays
(``segment_starts`` forces more segments, e.g. two on one GPU to test this); its full prompt chunks
replay segment graphs the same way, and its commit is one graph per device, the accepted path handed
to each device's copy of the commit inputs first.

A tensor-parallel target (``tp``, ``workers.models.tensor_parallel``; one device per rank) runs the
same loop on every rank over that rank's heads and MLP columns: K/V buffers and GDN state hold the
local heads, and each block's row-parallel output (attention / GDN out_proj, MLP down_proj) is
all-reduced before the residual is added, so the hidden states, taps and (gathered) logits are the
same on every rank. With graphs the collectives are captured inside each rank's graphs.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from torch import nn

from workers.errors import UnsupportedModelError
from workers.models.attention import grouped_attention_in
from workers.models.fused_hybrid import fused_hybrid_layer_for
from workers.models.fused_layer import PassInputs, fused_layer_for
from workers.models.gdn import MAX_PATH, PendingLayer, TreeShape
from workers.models.gdn_layer import gdn_layer_for
from workers.models.graph_cache import GraphCache, capture
from workers.models.tensor_parallel import TPGroup
from workers.seam import DraftTree, VerifyOutput, attention_head_dim, check_supported, text_config

MAX_VERIFY_GRAPHS = 4  # verify widths kept captured (a trial uses 1 for AR, n+1, or B+1)


class _KVBuffers:
    """A duck-typed transformers cache for the attention layers: static [1, kv_heads, capacity, D] buffers.

    The buffers of all attention layers on one device are views into one tensor
    [layers, 2 (K, V), 1, kv_heads, capacity, D], so a commit moves every layer's accepted rows with
    one gather and one scatter. ``update`` writes the pass's K/V at ``slots`` (device indices after
    the committed past) and returns the first ``attend`` slots, which the attention module reads
    under the pass's mask.
    """

    def __init__(self, layer_devices: dict[int, torch.device], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.stacks: list[torch.Tensor] = []  # one per device, slots on dim 4
        self.pairs: dict[int, torch.Tensor] = {}  # layer id -> its [2, 1, kv_heads, capacity, D]
        for device in dict.fromkeys(layer_devices.values()):
            ids = [i for i, d in layer_devices.items() if d == device]
            stack = torch.zeros((len(ids), 2, *shape), dtype=dtype, device=device)
            self.stacks.append(stack)
            for j, i in enumerate(ids):
                self.keys[i], self.values[i], self.pairs[i] = stack[j, 0], stack[j, 1], stack[j]
        self.per_device = None  # the pass's shared inputs (``_PerDevice``): its "slots" are where K/V go
        self.attend = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        slots = self.per_device.get(keys.device)["slots"]
        self.keys[layer_idx].index_copy_(2, slots, keys)
        self.values[layer_idx].index_copy_(2, slots, values)
        return self.keys[layer_idx][:, :, : self.attend], self.values[layer_idx][:, :, : self.attend]

    def move_on(self, device: torch.device, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy the K/V of slots ``source`` to slots ``destination`` (both on ``device``) in every
        attention layer on ``device``."""
        for stack in self.stacks:
            if stack.device == device:
                stack.index_copy_(4, destination, stack.index_select(4, source))


class StaticTarget:
    """A causal LM (attention-only or hybrid) plus its static state for one sequence (batch 1)."""

    def __init__(
        self,
        model: nn.Module,
        tap_layer_ids: tuple[int, ...] = (),
        tap_device: torch.device | None = None,
        prefill_chunk: int = 1024,
        graphs: bool = False,
        compile_layers: bool = False,
        segment_starts: tuple[int, ...] = (),
        tp: TPGroup | None = None,
    ) -> None:
        check_supported(model.config)
        self.model = model
        self.config = text_config(model.config)
        base = getattr(model, "model", model)
        self.embed, self.layers, self.norm, self.rotary = base.embed_tokens, base.layers, base.norm, base.rotary_emb
        self.lm_head = model.get_output_embeddings()
        self.layer_types = tuple(getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers))
        self.linear_ids = tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")
        self.attention_ids = tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")
        self.layer_devices = [next(layer.parameters()).device for layer in self.layers]
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.tap_device = tap_device
        self.prefill_chunk = prefill_chunk
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        devices = {*self.layer_devices, self.device, self.lm_head.weight.device}
        if graphs and any(device.type != "cuda" for device in devices):
            raise UnsupportedModelError("CUDA graphs need every part of the target on CUDA devices")
        self.graphs = graphs
        self.drafter_graphs = None  # the drafter's graphs beside ours (``workers.decoding.drafting``)
        self.one_device = len(devices) == 1
        self.tp = tp if tp is not None and tp.world > 1 else None
        if self.tp is not None and not self.one_device:
            raise UnsupportedModelError("a tensor-parallel target keeps each rank's share on one device")
        # sums a row-parallel projection's partial outputs over the ranks (None: one process)
        self.reduce = self.tp.all_reduce_ if self.tp is not None else None
        # segments: runs of layers on one device (plus any forced starts); with graphs, one graph per
        # segment and pass width, the hidden state handed from segment to segment between replays
        count = len(self.layers)
        starts = sorted({0, *(i for i in segment_starts if 0 < i < count),
                         *(i for i in range(1, count) if self.layer_devices[i] != self.layer_devices[i - 1])})
        self.segments = list(zip(starts, [*starts[1:], count]))
        # experimental: torch.compile fuses the layers' small elementwise kernels (norms, rotary, gates)
        self._run_layers = torch.compile(self._layers, dynamic=False) if compile_layers else self._layers
        # plain attention layers run as FusedLayer, gated ones as GatedAttentionLayer (few kernels each);
        # GDN layers' norms and MLP as HybridLinearLayer; anything else through transformers' modules.
        # ``reduce`` sums each row-parallel output over the ranks (tensor parallelism; None: one process)
        self.fused = {i: fused_layer_for(self.layers[i], self.config, self.reduce)
                      or fused_hybrid_layer_for(self.layers[i], self.reduce) for i in self.attention_ids}
        self.linear_blocks = {i: fused_hybrid_layer_for(self.layers[i], self.reduce) for i in self.linear_ids}
        self.gdn = {i: gdn_layer_for(self.layers[i].linear_attn, self.reduce) for i in self.linear_ids}
        if self.attention_ids:  # transformers renamed the attention modules' ``past_key_values`` to ``cache``
            params = inspect.signature(self.layers[self.attention_ids[0]].self_attn.forward).parameters
            self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.length = 0
        self.capacity = 0
        self.state_bytes = 0  # extra bytes the last verify pass held for the tree (see PendingLayer)
        self.peak_state_bytes = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, capacity: int, max_verify: int) -> None:
        """Zero state for one sequence of at most ``capacity`` tokens (buffers reused when they fit)."""
        self.length, self.peak_state_bytes, self.state_bytes = 0, 0, 0
        if capacity + max_verify > self.capacity or max_verify > self._max_verify_allocated():
            self._allocate(capacity, max_verify)
        for i in self.linear_ids:
            self.states[i].zero_()
            self.conv_windows[i].zero_()
        self.pending: dict[int, PendingLayer] = {}

    def close(self) -> None:
        self.pending = {}

    def _max_verify_allocated(self) -> int:
        return self._ids.shape[0] if self.capacity else 0

    def _allocate(self, capacity: int, max_verify: int) -> None:
        """Buffers at fixed addresses for the whole run (captured graphs read them), sized once.

        Made as normal tensors even under inference mode, so a later caller outside it (training the
        tiny drafter on the target's taps) may still update them in place.
        """
        with torch.inference_mode(False):
            self._allocate_buffers(capacity, max_verify)

    def _allocate_buffers(self, capacity: int, max_verify: int) -> None:
        cfg, device = self.config, self.device
        # a verify pass writes its K/V after at most ``capacity`` committed tokens; rounding up keeps
        # later, slightly longer prompts from reallocating (and re-capturing every graph)
        capacity = -(-(capacity + max_verify) // 1024) * 1024
        self.capacity = capacity
        head_dim = attention_head_dim(cfg)
        kv_heads = cfg.num_key_value_heads  # this process's K/V heads: all, or one rank's share
        if self.attention_ids:
            kv_heads = self.layers[self.attention_ids[0]].self_attn.k_proj.out_features // head_dim
        self.kv = _KVBuffers({i: self.layer_devices[i] for i in self.attention_ids},
                             (1, kv_heads, capacity, head_dim), self.dtype)
        self.conv_windows: dict[int, torch.Tensor] = {}
        self.states: dict[int, torch.Tensor] = {}
        for i in self.linear_ids:
            self.conv_windows[i], self.states[i] = self.gdn[i].new_state(self.dtype, self.layer_devices[i])
        # the verify pass's inputs: sliced to q nodes in eager mode, read whole by a graph of width q
        self._ids = torch.zeros(max_verify, dtype=torch.long, device=device)
        self._depths = torch.zeros(max_verify, dtype=torch.long, device=device)
        self._parents = torch.zeros(max_verify, dtype=torch.long, device=device)
        self._visible = torch.zeros(max_verify, max_verify, dtype=torch.bool, device=device)
        self._kept = torch.zeros(max(max_verify, self.prefill_chunk), dtype=torch.long, device=device)
        self._length = torch.zeros((), dtype=torch.long, device=device)
        self._columns = torch.arange(capacity, device=device)
        # the commit's inputs per device holding layers: the buffers themselves on the target's device,
        # static copies elsewhere (a commit graph on one device cannot read another's memory)
        self._commit_inputs: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for layer_device in dict.fromkeys(self.layer_devices):
            if layer_device == device:
                self._commit_inputs[layer_device] = (self._kept, self._length, self._columns)
            else:
                self._commit_inputs[layer_device] = (self._kept.to(layer_device), self._length.to(layer_device),
                                                     self._columns.to(layer_device))
        # verify graphs by pass width (a few kept), commit graphs by (width, path length)
        self._graphs = GraphCache(MAX_VERIFY_GRAPHS, on_evict=self._drop_commit_graphs)
        self._commit_graphs: dict[tuple[tuple[int, bool], int], torch.cuda.CUDAGraph] = {}
        self._graph_width: tuple[int, bool] | None = None  # (width, long chain) of the last pass if replayed
        self._chains: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # q -> depths, parents, visible
        # ``advance``'s passes (a full prompt chunk, AR's one token), captured once per width (graphs only)
        self._advance_ids = torch.zeros(self.prefill_chunk, dtype=torch.long, device=device)
        self._advance_depths = torch.arange(self.prefill_chunk, device=device)
        self._advance_graphs: dict[int, tuple] = {}  # width -> (graph, outputs)
        self._advance_shapes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # width -> parents, visible
        self._buffers_hold_chain: int | None = None  # width of the chain whose shape the input buffers hold

    def _drop_commit_graphs(self, graph_key: tuple[int, bool]) -> None:
        for key in [key for key in self._commit_graphs if key[0] == graph_key]:
            del self._commit_graphs[key]

    # -- forwards ----------------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor) -> VerifyOutput:
        """The prompt [1, T] in chunks, each advanced (a chain pass that commits it); last logits [1, V], all taps."""
        taps, logits = [], None
        for begin in range(0, input_ids.shape[1], self.prefill_chunk):
            out = self.advance(input_ids[0, begin : begin + self.prefill_chunk])
            taps.append(out.taps)
            logits = out.logits
        self.peak_state_bytes = 0  # the metric is about verify rounds, not the prompt
        return VerifyOutput(logits=logits, taps=torch.cat(taps, dim=1) if self.tap_layer_ids else torch.empty(0))

    def advance(self, tokens: torch.Tensor) -> VerifyOutput:
        """tokens [q] kept whole after the committed ones (a prompt chunk, AR's one token a round): one
        chain pass that commits them as it goes (GDN layers advance their state inside the pass, K/V rows
        land in place), so no verify's pending data and no commit. Last logits [1, V], the q nodes' taps."""
        out = self._advance(tokens.to(self.device))
        self.length += tokens.shape[0]
        self.pending = {}
        return out

    def verify_chain(self, tokens: torch.Tensor) -> VerifyOutput:
        """tokens [q] = [bonus, draft...] at positions length..length+q-1, each after the one before."""
        q = tokens.shape[0]
        if q not in self._chains:  # constant per width: made once
            self._chains[q] = (torch.arange(q, device=self.device), *_chain(q, self.device))
        return self._verify(tokens.to(self.device), *self._chains[q], chain=True)

    def verify_tree(self, root_token: torch.Tensor, tree: DraftTree) -> VerifyOutput:
        """[root, nodes...] in one pass; every node sees (and continues the state of) its own ancestry."""
        ids = torch.cat((root_token.view(1).to(self.device), tree.tokens.to(self.device)))
        depths = torch.cat((torch.zeros(1, dtype=torch.long, device=self.device), tree.depths.to(self.device)))
        return self._verify(ids, depths, tree.parents.to(self.device), tree.visibility.to(self.device))

    def _advance(self, chunk: torch.Tensor) -> VerifyOutput:
        """``advance``'s pass. With graphs, a full prompt chunk and AR's one token replay a pass captured
        once per width (other widths, a prompt's last partial chunk, run eagerly)."""
        q = chunk.shape[0]
        if not self.graphs or q not in (1, self.prefill_chunk):
            parents, visible = _chain(q, self.device)
            return self._forward(chunk, torch.arange(q, device=self.device), parents, visible, last_only=True,
                                 chain=True, commit=True)
        self._advance_ids[:q].copy_(chunk)
        self._length.fill_(self.length)
        if q not in self._advance_graphs:
            live = [*self.states.values(), *self.conv_windows.values()]
            saved = [t.clone() for t in live]  # capture's warm-ups run the pass, advancing the GDN state
            # the chain's constant shape stays alive with the graph, which reads it on every replay
            self._advance_shapes[q] = _chain(q, self.device)
            static = (self._advance_ids[:q], self._advance_depths[:q], *self._advance_shapes[q])
            failed = False
            try:
                if len(self.segments) == 1:
                    self._advance_graphs[q] = capture(lambda: self._forward(*static, last_only=True,
                                                                            attend=self.capacity, chain=True,
                                                                            commit=True))
                else:  # one graph per segment, as for a split target's verify pass
                    self._advance_graphs[q] = self._capture_segments(
                        lambda: self._head(*static, self.capacity, True, commit=True), last_only=True, commit=True)
            except RuntimeError as exc:  # as for a verify pass: run eagerly from here on
                warnings.warn(f"CUDA graph capture failed ({type(exc).__name__}: {str(exc)[:200]}); running eagerly",
                              stacklevel=3)
                failed = True
            finally:
                for tensor, copy in zip(live, saved):
                    tensor.copy_(copy)
            if self._any_rank(failed):  # every rank runs eagerly if one must
                self.graphs = False
                self._advance_graphs.clear()
            if not self.graphs:
                return self._advance(chunk)
        graph, out = self._advance_graphs[q]
        graph.replay()
        # the graph's outputs are overwritten by its next replay (a later chunk): copies
        return VerifyOutput(logits=out.logits.clone(), taps=out.taps.clone() if self.tap_layer_ids else out.taps)

    # -- commit ------------------------------------------------------------------------------------
    def commit(self, kept: torch.Tensor) -> None:
        """Keep the verified nodes ``kept`` (root ... accepted node, a path) of the last pass.

        ``kept`` may be on the host or the device; engines pass a device tensor, so the copy into
        the commit's input buffer waits for nothing.

        After a graph-replayed pass the commit is a graph too, one per (pass width, path length) and
        device of the target: the first time it runs eagerly and is then recorded (recording executes
        nothing). A split target hands the path and the committed length to each device's copies first.
        """
        count = int(kept.shape[0])
        self._kept[:count].copy_(kept)
        self._length.fill_(self.length)
        key = (self._graph_width, count)
        if self._graph_width is None:
            self._commit_core(count)
        elif key in self._commit_graphs:
            self._commit_graphs[key].replay()
        else:
            self._commit_core(count)
            self._commit_graphs[key] = self._capture_commit(count)
        self.pending = {}
        self.length += count

    def _commit_core(self, count: int) -> None:
        """Device-only commit of the path in ``_kept[:count]`` after ``_length`` committed tokens."""
        for device in self._commit_inputs:
            self._hand_commit_inputs(device, count)
            self._commit_on(device, count)

    def _capture_commit(self, count: int):
        """The commit as one graph per device (with the hand-off copies between them when split)."""
        if len(self._commit_inputs) == 1:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._commit_core(count)
            return graph
        steps = []
        for device in self._commit_inputs:
            steps.append(lambda device=device: self._hand_commit_inputs(device, count))
            with torch.cuda.device(device):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._commit_on(device, count)
            steps.append(graph.replay)
        return _Steps(steps, keep=[])

    def _hand_commit_inputs(self, device: torch.device, count: int) -> None:
        """Copy the path and the committed length to ``device``'s static commit inputs (no-op on the
        target's own device, whose inputs are the buffers themselves)."""
        kept, length, _ = self._commit_inputs[device]
        if kept is not self._kept:
            kept[:count].copy_(self._kept[:count])
            length.copy_(self._length)

    def _commit_on(self, device: torch.device, count: int) -> None:
        """The commit's work on one device: the accepted K/V rows of its attention layers move to the
        slots after the committed past, and its GDN layers replay the accepted path from their state."""
        kept, length, columns = self._commit_inputs[device]
        self.kv.move_on(device, length + kept[:count], length + columns[:count])
        for i in self.linear_ids:
            if self.layer_devices[i] == device:
                self.gdn[i].commit(self.pending[i], kept[:count], self.conv_windows[i], self.states[i])

    # -- internals ---------------------------------------------------------------------------------
    def _verify(self, ids, depths, parents, visible, chain: bool = False) -> VerifyOutput:
        q = ids.shape[0]
        # a chain too long for the tree form goes through GDN layers in chunked form: its own graphs
        long_chain = chain and q > MAX_PATH
        if not self.graphs:
            return self._forward(ids, depths, parents, visible, last_only=False, chain=long_chain)
        self._ids[:q].copy_(ids)
        # every small copy before a replay is a launch the idle GPU waits for: a chain's shape is
        # copied only when the buffers do not already hold the chain of this width
        if not (chain and self._buffers_hold_chain == q):
            self._depths[:q].copy_(depths)
            self._parents[:q].copy_(parents)
            self._visible[:q, :q].copy_(visible)
            self._buffers_hold_chain = q if chain else None
        self._length.fill_(self.length)
        key = (q, long_chain)
        if key not in self._graphs:
            captured, failed = None, False
            try:
                captured = self._capture(q, long_chain)
            except RuntimeError as exc:  # e.g. MoE routing with data-dependent shapes cannot be captured
                warnings.warn(f"CUDA graph capture failed ({type(exc).__name__}: {str(exc)[:200]}); running eagerly",
                              stacklevel=2)
                failed = True
            if self._any_rank(failed):  # every rank runs eagerly if one must
                self.graphs = False
                return self._forward(ids, depths, parents, visible, last_only=False, chain=long_chain)
            self._graphs[key] = captured
        graph, out, pending, state_bytes = self._graphs[key]
        graph.replay()
        self._graph_width = key
        self.pending, self.state_bytes = dict(pending), state_bytes
        self.peak_state_bytes = max(self.peak_state_bytes, state_bytes)
        return out

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a one-rank decision made the same on all); ``flag`` alone
        without tensor parallelism."""
        if self.tp is None:
            return flag
        return bool(self.tp.all_reduce_(torch.tensor([int(flag)], device=self.device)).item())  # once per capture

    def _capture(self, q: int, chain: bool):
        """Record the width-q pass reading the static inputs; returns (graph, outputs, pending, state bytes)."""
        static = (self._ids[:q], self._depths[:q], self._parents[:q], self._visible[:q, :q])
        # the warm-ups write K/V only after the committed past, which is free space
        if len(self.segments) == 1:
            graph, out = capture(lambda: self._forward(*static, last_only=False, attend=self.capacity, chain=chain))
        else:
            graph, out = self._capture_segments(lambda: self._head(*static, self.capacity, chain), last_only=False)
        pending = dict(self.pending)
        return graph, out, pending, sum(p.nbytes() for p in pending.values())

    def _capture_segments(self, head, last_only: bool, commit: bool = False):
        """One graph per segment of layers; the first also runs ``head``, the last the final norm and
        lm_head. A segment on the previous one's device reads its output in place; on another device
        it reads static copies of the hidden state and the pass's shared inputs, refreshed between
        replays (the hand-off). Returns (an object whose ``replay`` runs it all, the outputs)."""
        steps, context, keep = [], {}, []

        def first():
            hidden, per_device = head()
            captured: dict[int, torch.Tensor] = {}
            with grouped_attention_in(self.config):
                hidden = self._run_layers(hidden, per_device, captured, commit, *self.segments[0])
            context.update(per_device=per_device, captured=captured)  # those of the recorded call
            return hidden

        graph, hidden = capture(first)
        steps.append(graph.replay)
        # a later segment's warm-ups read this graph's outputs (K/V slots among them): make them real
        graph.replay()
        per_device, captured = context["per_device"], context["captured"]
        last = len(self.segments) - 1
        for k, (start, end) in enumerate(self.segments[1:], 1):
            device = self.layer_devices[start]
            received = hidden
            if device != hidden.device:
                received = torch.empty_like(hidden, device=device)
                copies = per_device.get(device)  # made now, outside any graph: static buffers on `device`
                steps.append(lambda dst=received, src=hidden, copies=copies: (
                    dst.copy_(src), [_copy_into(copies[n], per_device.tensors[n]) for n in copies]))

            def segment(inp=received, start=start, end=end, k=k):
                with grouped_attention_in(self.config):  # a copy: the layers update it in place
                    out = self._run_layers(inp.clone(), per_device, captured, commit, start, end)
                return self._tail(out, captured, last_only) if k == last else out

            keep.append(received)
            steps[-1]()  # the hand-off (or the previous replay again): real inputs for the warm-ups
            with torch.cuda.device(device):
                graph, hidden = capture(segment)
            steps.append(graph.replay)
            if k < last:
                graph.replay()
        # the graphs hold no Python references: keep every tensor a later graph reads alive with them
        return _Steps(steps, keep=[keep, per_device, captured]), hidden

    def _forward(self, ids, depths, parents, visible, last_only: bool, attend: int | None = None,
                 chain: bool = False, commit: bool = False) -> VerifyOutput:
        """One pass over q nodes after the committed past. ``attend`` = K/V slots read (graphs: all);
        ``chain``: the nodes are a line; ``commit``: GDN layers keep all of them (the prompt)."""
        hidden, per_device = self._head(ids, depths, parents, visible, attend, chain, commit)
        captured: dict[int, torch.Tensor] = {}
        with grouped_attention_in(self.config):
            for start, end in self.segments:
                hidden = self._run_layers(hidden, per_device, captured, commit, start, end)
        return self._tail(hidden, captured, last_only)

    def _head(self, ids, depths, parents, visible, attend: int | None, chain: bool, commit: bool = False):
        """The embedding and what every layer of the pass shares: (hidden [1, q, H], ``_PerDevice``).
        ``commit``: the pass keeps its nodes as it goes, so its GDN layers need no tree blocks."""
        q = ids.shape[0]
        self._graph_width = None
        if attend is None:  # eager: the committed length is known on the host
            self._length.fill_(self.length)
            # on CUDA read the whole buffer like a graph does (same kernels, so graph == eager bit for
            # bit); on the CPU only the committed past and this pass
            attend = self.capacity if self.device.type == "cuda" else self.length + q
        length = self._length
        slots = length + self._columns[:q]
        self.kv.attend = attend
        hidden = self.embed(ids).unsqueeze(0)  # [1, q, H]
        positions = (length + depths).unsqueeze(0)
        if hasattr(self.rotary, "mrope_section"):  # Qwen3.5's multimodal rotary: text uses one position thrice
            positions = positions.unsqueeze(0).expand(3, 1, q)
        cos, sin = self.rotary(hidden, positions)
        mask = self._attention_mask(length, visible, attend)
        shared = {"cos": cos, "sin": sin, "mask": mask, "slots": slots}
        if self.linear_ids:
            window = self.gdn[self.linear_ids[0]].window
            shared["tree"] = TreeShape.build(parents, window, chain, commits=commit)
        if any(self.fused.values()):
            groups = self.config.num_attention_heads // self.config.num_key_value_heads
            shared["fused"] = PassInputs.build(cos, sin, slots, mask[0, 0], groups)
        per_device = _PerDevice(**shared)
        self.kv.per_device = per_device
        self.state_bytes = 0
        return hidden, per_device

    def _tail(self, hidden: torch.Tensor, captured: dict, last_only: bool) -> VerifyOutput:
        if last_only:
            hidden = hidden[:, -1:]
        hidden = self.norm(hidden.to(self.norm.weight.device))
        logits = self.lm_head(hidden.to(self.lm_head.weight.device))[0]
        self.peak_state_bytes = max(self.peak_state_bytes, self.state_bytes)
        return VerifyOutput(logits=logits, taps=self._taps(captured))

    def _layers(self, hidden, per_device: _PerDevice, captured: dict, commit: bool, start: int, end: int):
        """Decoder layers start..end-1 over the pass's hidden states [1, q, H]; fills ``captured`` with taps.

        The layers update the hidden state in place (the residual sums land in the projections'
        epilogues), so ``hidden`` must be the pass's own tensor, and a tap is a copy."""
        for i in range(start, end):
            layer = self.layers[i]
            on = per_device.get(self.layer_devices[i])
            hidden = hidden.to(self.layer_devices[i])
            fused = self.fused.get(i)
            if fused is not None:
                hidden = fused(hidden, on["fused"], self.kv.pairs[i], self.kv.attend)
            else:
                hidden = self._module_layer(i, layer, hidden, on, commit)
            if i in self.tap_layer_ids:
                captured[i] = hidden.clone()
        return hidden

    def _module_layer(self, i: int, layer: nn.Module, hidden: torch.Tensor, on: dict, commit: bool) -> torch.Tensor:
        """One decoder layer through transformers' own modules (linear attention: our tree form)."""
        block = self.linear_blocks.get(i)  # the fused norms and MLP around a GDN mixer, if any
        mixed = block.norm(hidden) if block is not None else layer.input_layernorm(hidden)
        if self.layer_types[i] == "linear_attention":
            # with the fused block the mixer adds its output to hidden in place (in out_proj's epilogue)
            residual = hidden if block is not None else None
            mixed, pending = self.gdn[i](mixed, on["tree"], self.conv_windows[i], self.states[i], commit, residual)
            if pending is not None:
                self.pending[i] = pending
                self.state_bytes += pending.nbytes()
            if block is not None:
                return block.finish_summed(mixed)
        else:
            kwargs = {self._cache_kwarg: self.kv}
            mixed = self._reduced(layer.self_attn(
                hidden_states=mixed, position_embeddings=(on["cos"], on["sin"]), attention_mask=on["mask"], **kwargs
            )[0])
        hidden = hidden + mixed
        mlp_out = layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden + self._reduced(mlp_out[0] if isinstance(mlp_out, tuple) else mlp_out)

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel block output summed over the ranks (unchanged in one process)."""
        return partial if self.reduce is None else self.reduce(partial)

    def _attention_mask(self, length: torch.Tensor, visible: torch.Tensor, attend: int) -> torch.Tensor:
        """Additive [1, 1, q, attend]: the committed past, then the pass's own block by ``visible``."""
        q = visible.shape[0]
        columns = self._columns[:attend]
        relative = columns - length  # column's index inside the pass's block
        in_block = (relative >= 0) & (relative < q)
        block = visible[:, relative.clamp(0, q - 1)] & in_block  # [q, attend]
        allowed = (columns < length) | block
        mask = torch.full((q, attend), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(allowed, 0.0)[None, None]

    def _taps(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        if not self.tap_layer_ids:
            return torch.empty(0)
        device = self.tap_device or captured[self.tap_layer_ids[0]].device
        return torch.cat([captured[i].to(device) for i in self.tap_layer_ids], dim=-1)


def _chain(q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, visibility) of q nodes in a line."""
    return torch.arange(-1, q - 1, device=device), torch.ones(q, q, dtype=torch.bool, device=device).tril()


class _Steps:
    """Segment graphs and the copies between them, replayed in order (quacks like a CUDA graph)."""

    def __init__(self, steps: list, keep: list) -> None:
        self.steps, self.keep = steps, keep

    def replay(self) -> None:
        for step in self.steps:
            step()


def _copy_into(target, source) -> None:
    """Refresh a static copy (a tensor, or an object of tensors such as ``TreeShape``) from ``source``."""
    if isinstance(target, torch.Tensor):
        target.copy_(source)
        return
    for name, value in vars(target).items():
        if isinstance(value, torch.Tensor):
            value.copy_(getattr(source, name))


class _PerDevice:
    """The pass's shared inputs (rotary, mask, tree shape, the fused layers' ``PassInputs``), copied
    once to each device that needs them."""

    def __init__(self, **tensors) -> None:
        self.tensors = tensors
        self.copies: dict[torch.device, dict[str, torch.Tensor]] = {}

    def get(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self.copies:
            self.copies[device] = {name: t.to(device) for name, t in self.tensors.items()}
        return self.copies[device]


def make_target(
    model: nn.Module,
    tap_layer_ids: tuple[int, ...] = (),
    tap_device: torch.device | None = None,
    graphs: bool | None = None,
    compile_layers: bool = False,
    tp: TPGroup | None = None,
):
    """The runner for ``model``: ``StaticTarget`` (own decoder loop on static buffers; hybrids need
    it), with CUDA graphs when ``graphs`` is None and the whole model sits on one CUDA device.
    ``tp``: the model is this rank's shard (``tensor_parallel.shard_model``); one CUDA device per rank
    keeps graphs available, their all-reduces captured."""
    check_supported(model.config)
    devices = {p.device for p in model.parameters()}
    one_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
    use_graphs = one_cuda if graphs is None else graphs and one_cuda
    return StaticTarget(model, tap_layer_ids, tap_device, graphs=use_graphs, compile_layers=compile_layers, tp=tp)
