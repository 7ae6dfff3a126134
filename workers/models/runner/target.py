"""The target seam (``workers.seam.Target``) on static buffers with our own decoder loop: hybrids, and
CUDA graphs for every model.

``StaticTarget`` composes the layer loop (``runner.loop``), the sequence's buffers (``runner.state``)
and the graphs of each forward kind (``runner.graphs``). A verify pass (a chain or a tree) writes its
K/V after the committed past and leaves each GDN node's pending data; ``commit`` moves the accepted
K/V rows into place and replays the accepted path as a short chain from the committed linear state.
``advance`` keeps its tokens whole (a prompt chunk, AR's one token a round): one chain pass whose GDN
layers take the chunked delta rule and one batched conv and advance their state inside the pass, so
nothing is replayed. With ``graphs`` (every part of the target on CUDA) each pass replays a graph
captured the first time its shape comes; a pass that cannot be captured (MoE routing) makes the
target run eagerly from then on, on every rank, with a warning.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from workers.errors import UnsupportedModelError
from workers.models.gdn import MAX_PATH
from workers.models.runner.graphs import AdvanceGraphs, CommitGraphs, VerifyGraphs
from workers.models.runner.loop import Loop, chain_shape
from workers.models.tensor_parallel import TPGroup
from workers.seam import DraftTree, VerifyOutput, check_supported


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
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        reduce = self.tp.all_reduce_ if self.tp is not None else None
        self.loop = loop = Loop(model, tap_layer_ids, tap_device, prefill_chunk, segment_starts, compile_layers, reduce)
        if graphs and any(device.type != "cuda" for device in loop.devices):
            raise UnsupportedModelError("CUDA graphs need every part of the target on CUDA devices")
        if self.tp is not None and len(loop.devices) != 1:
            raise UnsupportedModelError("a tensor-parallel target keeps each rank's share on one device")
        self.state = loop.state
        self.graphs = graphs
        self.drafter_graphs = None  # the drafter's graphs beside ours (``workers.decoding.drafting``)
        # what the rest of the code reads of the model's layout
        self.config, self.device, self.dtype = loop.config, loop.device, loop.dtype
        self.layers, self.lm_head, self.layer_devices = loop.layers, loop.lm_head, loop.layer_devices
        self.segments, self.prefill_chunk, self.tap_layer_ids = loop.segments, prefill_chunk, loop.tap_layer_ids
        self.attention_ids, self.gdn_ids = loop.attention_ids, loop.gdn_ids
        self.fused, self.gdn_blocks = loop.fused, loop.gdn_blocks
        self._chains: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # q -> depths, parents, visible
        self._new_graphs()

    @property
    def length(self) -> int:
        """Tokens committed."""
        return self.state.length

    @property
    def capacity(self) -> int:
        """K/V slots allocated (a verify pass writes after the committed ones)."""
        return self.state.capacity

    @property
    def state_bytes(self) -> int:
        """Extra bytes the last verify pass held for the tree (see ``PendingLayer``)."""
        return self.state.state_bytes

    @property
    def peak_state_bytes(self) -> int:
        return self.state.peak_state_bytes

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, capacity: int, max_verify: int) -> None:
        """Zero state for one sequence of at most ``capacity`` tokens (buffers reused when they fit)."""
        if self.state.ensure(capacity, max_verify):
            self._new_graphs()  # the old ones read the old buffers
        self.state.reset()

    def close(self) -> None:
        self.state.pending = {}

    def _new_graphs(self) -> None:
        """No graphs yet: verify graphs by pass width (a few kept), commit graphs by (width, path
        length), advance graphs by width."""
        self.commit_graphs = CommitGraphs(self.loop)
        self.verify_graphs = VerifyGraphs(self.loop, on_evict=self.commit_graphs.drop)
        self.advance_graphs = AdvanceGraphs(self.loop)
        self._replayed: tuple[int, bool] | None = None  # the last verify pass's graph key if replayed

    # -- forwards ----------------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor) -> VerifyOutput:
        """The prompt [1, T] in chunks, each advanced (a chain pass that commits it); last logits [1, V], all taps."""
        taps, logits = [], None
        for begin in range(0, input_ids.shape[1], self.prefill_chunk):
            out = self.advance(input_ids[0, begin : begin + self.prefill_chunk])
            taps.append(out.taps)
            logits = out.logits
        self.state.peak_state_bytes = 0  # the metric is about verify rounds, not the prompt
        return VerifyOutput(logits=logits, taps=torch.cat(taps, dim=1) if self.tap_layer_ids else torch.empty(0))

    def advance(self, tokens: torch.Tensor) -> VerifyOutput:
        """tokens [q] kept whole after the committed ones (a prompt chunk, AR's one token a round): one
        chain pass that commits them as it goes (GDN layers advance their state inside the pass, K/V rows
        land in place), so no verify's pending data and no commit. Last logits [1, V], the q nodes' taps."""
        out = self._advance(tokens.to(self.device))
        self.state.length += tokens.shape[0]
        self.state.pending = {}
        return out

    def verify_chain(self, tokens: torch.Tensor) -> VerifyOutput:
        """tokens [q] = [bonus, draft...] at positions length..length+q-1, each after the one before."""
        q = tokens.shape[0]
        if q not in self._chains:  # constant per width: made once
            self._chains[q] = (torch.arange(q, device=self.device), *chain_shape(q, self.device))
        return self._verify(tokens.to(self.device), *self._chains[q], chain=True)

    def verify_tree(self, root_token: torch.Tensor, tree: DraftTree) -> VerifyOutput:
        """[root, nodes...] in one pass; every node sees (and continues the state of) its own ancestry."""
        ids = torch.cat((root_token.view(1).to(self.device), tree.tokens.to(self.device)))
        depths = torch.cat((torch.zeros(1, dtype=torch.long, device=self.device), tree.depths.to(self.device)))
        return self._verify(ids, depths, tree.parents.to(self.device), tree.visibility.to(self.device))

    def commit(self, kept: torch.Tensor) -> None:
        """Keep the verified nodes ``kept`` (root ... accepted node, a path) of the last pass.

        ``kept`` may be on the host or the device; engines pass a device tensor, so the copy into
        the commit's input buffer waits for nothing. After a graph-replayed pass the commit is a graph
        too (``CommitGraphs``).
        """
        count = int(kept.shape[0])
        self.state.load_commit(kept)
        if self._replayed is None:
            self.loop.commit(count)
        else:
            self.commit_graphs.run(self._replayed, count)
        self.state.pending = {}
        self.state.length += count

    # -- graphs or eager ---------------------------------------------------------------------------
    def _verify(self, ids, depths, parents, visible, chain: bool = False) -> VerifyOutput:
        q = ids.shape[0]
        # a chain too long for the tree form goes through GDN layers in chunked form: its own graphs
        key = (q, chain and q > MAX_PATH)
        self._replayed = None
        if self.graphs:
            self.state.load_verify(ids, depths, parents, visible, chain)
            if key in self.verify_graphs or self._captured(self.verify_graphs, key, stacklevel=3):
                self._replayed = key
                return self.verify_graphs.replay(key)
        return self.loop.forward(ids, depths, parents, visible, last_only=False, chain=key[1])

    def _advance(self, chunk: torch.Tensor) -> VerifyOutput:
        """``advance``'s pass. With graphs, a full prompt chunk and AR's one token replay a pass captured
        once per width (other widths, a prompt's last partial chunk, run eagerly)."""
        q = chunk.shape[0]
        self._replayed = None
        if self.graphs and q in (1, self.prefill_chunk):
            self.state.load_advance(chunk)
            if q in self.advance_graphs or self._captured(self.advance_graphs, q, stacklevel=4):
                return self.advance_graphs.replay(q)
            self.advance_graphs.clear()
        parents, visible = chain_shape(q, self.device)
        return self.loop.forward(chunk, torch.arange(q, device=self.device), parents, visible, last_only=True,
                                 chain=True, commit=True)

    def _captured(self, graphs: VerifyGraphs | AdvanceGraphs, key, stacklevel: int) -> bool:
        """Capture ``key`` into ``graphs``; False on every rank if it failed on any: then this target
        runs eagerly from here on (warned, ``stacklevel`` counted from here)."""
        captured, failed = None, False
        try:
            captured = graphs.capture(key)
        except RuntimeError as exc:  # e.g. MoE routing with data-dependent shapes cannot be captured
            warnings.warn(f"CUDA graph capture failed ({type(exc).__name__}: {str(exc)[:200]}); running eagerly",
                          stacklevel=stacklevel)
            failed = True
        if self._any_rank(failed):  # every rank runs eagerly if one must
            self.graphs = False
            return False
        graphs.add(key, captured)
        return True

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a one-rank decision made the same on all); ``flag`` alone
        without tensor parallelism."""
        if self.tp is None:
            return flag
        return bool(self.tp.all_reduce_(torch.tensor([int(flag)], device=self.device)).item())  # once per capture


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
