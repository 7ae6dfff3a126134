"""The target's CUDA graphs: one class per forward kind, and the capture they share.

A pass is captured once per shape and then replayed: its inputs are first copied into the state's
static buffers (``runner.state``), attention reads the whole K/V buffer under a mask built on the
device from the committed length, and the outputs are the graph's static tensors (valid until the
next replay). ``capture_pass`` records a pass of the layer loop (``runner.loop``): one graph, or on a
target in several segments (split over GPUs, or ``segment_starts``) one graph per segment, the
hidden state and the pass's shared inputs handed to the next segment between replays. A
tensor-parallel rank's all-reduces are captured inside its graphs.

- ``VerifyGraphs``: verify passes by (width, long chain), the few most recently used kept;
- ``AdvanceGraphs``: ``advance``'s passes (a full prompt chunk, AR's one token) by width;
- ``CommitGraphs``: the commit after a replayed verify pass, by (pass, path length): recorded after
  its first eager run, one graph per device of the target, the accepted path handed to each
  device's copy of the commit inputs first.

Every class has ``capture(key)`` (the graph, not yet kept), ``add(key, captured)`` and
``replay(key)``; the target decides when to capture and what to do when a capture fails. The
drafter's pass and tree build are captured beside these by ``workers.decoding.drafting``, whose
store the target keeps in ``drafter_graphs``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.models.attention import grouped_attention_in
from workers.models.graph_cache import GraphCache, capture
from workers.models.kernels import dependent_launches
from workers.models.runner.limits import MAX_VERIFY_GRAPHS
from workers.models.runner.loop import Loop, chain_shape
from workers.seam import VerifyOutput


def capture_pass(loop: Loop, static: tuple, chain: bool, last_only: bool, commit: bool = False):
    """Record the loop's pass over the static inputs ``static`` (ids, depths, parents, visible),
    reading every K/V slot: one graph, or one per segment of layers. Returns (an object whose
    ``replay`` runs it, the outputs)."""
    if len(loop.segments) == 1:
        return capture(lambda: loop.forward(*static, last_only=last_only, attend=loop.state.capacity, chain=chain,
                                            commit=commit))
    return _capture_segments(loop, lambda: loop.head(*static, loop.state.capacity, chain, commit=commit),
                             last_only, commit)


def _capture_segments(loop: Loop, head: Callable, last_only: bool, commit: bool = False):
    """One graph per segment of layers; the first also runs ``head``, the last the final norm and
    lm_head. A segment on the previous one's device reads its output in place; on another device
    it reads static copies of the hidden state and the pass's shared inputs, refreshed between
    replays (the hand-off). Returns (an object whose ``replay`` runs it all, the outputs)."""
    steps, context, keep = [], {}, []

    def first():
        hidden, per_device = head()
        captured: dict[int, torch.Tensor] = {}
        with grouped_attention_in(loop.config):
            hidden = loop.run_layers(hidden, per_device, captured, commit, *loop.segments[0])
        context.update(per_device=per_device, captured=captured)  # those of the recorded call
        return hidden

    graph, hidden = capture(first)
    steps.append(graph.replay)
    # a later segment's warm-ups read this graph's outputs (K/V slots among them): make them real
    graph.replay()
    per_device, captured = context["per_device"], context["captured"]
    last = len(loop.segments) - 1
    for k, (start, end) in enumerate(loop.segments[1:], 1):
        device = loop.layer_devices[start]
        received = hidden
        if device != hidden.device:
            received = torch.empty_like(hidden, device=device)
            copies = per_device.get(device)  # made now, outside any graph: static buffers on `device`
            steps.append(lambda dst=received, src=hidden, copies=copies: (
                dst.copy_(src), [_copy_into(copies[n], per_device.tensors[n]) for n in copies]))

        def segment(inp=received, start=start, end=end, k=k):
            with grouped_attention_in(loop.config):  # a copy: the layers update it in place
                out = loop.run_layers(inp.clone(), per_device, captured, commit, start, end)
            return loop.tail(out, captured, last_only) if k == last else out

        keep.append(received)
        steps[-1]()  # the hand-off (or the previous replay again): real inputs for the warm-ups
        with torch.cuda.device(device):
            graph, hidden = capture(segment)
        steps.append(graph.replay)
        if k < last:
            graph.replay()
    # the graphs hold no Python references: keep every tensor a later graph reads alive with them
    return _Steps(steps, keep=[keep, per_device, captured]), hidden


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


class VerifyGraphs:
    """Verify passes by (width q, long chain), reading the state's verify inputs; the most recently
    used ``MAX_VERIFY_GRAPHS`` kept (``GraphCache``), ``on_evict`` told of each one dropped."""

    def __init__(self, loop: Loop, on_evict: Callable[[tuple[int, bool]], None]) -> None:
        self.loop, self.state = loop, loop.state
        self.cache = GraphCache(MAX_VERIFY_GRAPHS, on_evict=on_evict)

    def __contains__(self, key: tuple[int, bool]) -> bool:
        return key in self.cache

    def capture(self, key: tuple[int, bool]):
        """Record the width-q pass reading the static inputs; returns (graph, outputs, pending, state bytes)."""
        q, long_chain = key
        state = self.state
        static = (state.ids[:q], state.depths[:q], state.parents[:q], state.visible[:q, :q])
        # the warm-ups write K/V only after the committed past, which is free space
        graph, out = capture_pass(self.loop, static, chain=long_chain, last_only=False)
        pending = dict(state.pending)
        return graph, out, pending, sum(p.nbytes() for p in pending.values())

    def add(self, key: tuple[int, bool], captured) -> None:
        self.cache[key] = captured

    def replay(self, key: tuple[int, bool]) -> VerifyOutput:
        """The pass replayed; its outputs (and pending GDN data) are the graph's, valid until its next replay."""
        graph, out, pending, state_bytes = self.cache[key]
        graph.replay()
        state = self.state
        state.pending, state.state_bytes = dict(pending), state_bytes
        state.peak_state_bytes = max(state.peak_state_bytes, state_bytes)
        return out


class AdvanceGraphs:
    """``advance``'s passes by width: a chain read from the state's advance inputs, committed as it goes."""

    def __init__(self, loop: Loop) -> None:
        self.loop, self.state = loop, loop.state
        self.graphs: dict[int, tuple] = {}  # width -> (graph, outputs)
        self.shapes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # width -> parents, visible

    def __contains__(self, q: int) -> bool:
        return q in self.graphs

    def capture(self, q: int):
        """Record the width-q pass; returns (graph, outputs). The GDN state is as it was before."""
        state = self.state
        live = [*state.states.values(), *state.conv_windows.values()]
        saved = [t.clone() for t in live]  # capture's warm-ups run the pass, advancing the GDN state
        # the chain's constant shape stays alive with the graph, which reads it on every replay
        self.shapes[q] = chain_shape(q, self.loop.device)
        static = (state.advance_ids[:q], state.advance_depths[:q], *self.shapes[q])
        try:  # with several segments: one graph per segment, as for a split target's verify pass
            with dependent_launches(q == 1):  # AR's step: its kernels launched early (kernels.dependent_launches)
                return capture_pass(self.loop, static, chain=True, last_only=True, commit=True)
        finally:
            for tensor, copy in zip(live, saved):
                tensor.copy_(copy)

    def add(self, q: int, captured) -> None:
        self.graphs[q] = captured

    def clear(self) -> None:
        self.graphs.clear()

    def replay(self, q: int) -> VerifyOutput:
        graph, out = self.graphs[q]
        graph.replay()
        # the graph's outputs are overwritten by its next replay (a later chunk): copies
        return VerifyOutput(logits=out.logits.clone(), taps=out.taps.clone() if self.loop.tap_layer_ids else out.taps)


class CommitGraphs:
    """The commit after a replayed verify pass, by (that pass's key, path length)."""

    def __init__(self, loop: Loop) -> None:
        self.loop, self.state = loop, loop.state
        self.graphs: dict[tuple[tuple[int, bool], int], torch.cuda.CUDAGraph] = {}

    def run(self, pass_key: tuple[int, bool], count: int) -> None:
        """Commit the state's ``kept[:count]``: replayed, or the first time run eagerly and then recorded
        (recording executes nothing)."""
        key = (pass_key, count)
        if key in self.graphs:
            self.graphs[key].replay()
        else:
            self.loop.commit(count)
            self.graphs[key] = self._capture(count)

    def drop(self, pass_key: tuple[int, bool]) -> None:
        """Forget the commits after a verify pass whose graph was dropped."""
        for key in [key for key in self.graphs if key[0] == pass_key]:
            del self.graphs[key]

    def _capture(self, count: int):
        """The commit as one graph per device (with the hand-off copies between them when split)."""
        inputs = self.state.commit_inputs
        if len(inputs) == 1:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.loop.commit(count)
            return graph
        steps = []
        for device in inputs:
            steps.append(lambda device=device: self.state.hand_commit_inputs(device, count))
            with torch.cuda.device(device):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.loop.commit_on(device, count)
            steps.append(graph.replay)
        return _Steps(steps, keep=[])
