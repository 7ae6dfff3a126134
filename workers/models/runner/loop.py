"""The layer loop: one pass of the target's decoder layers over q nodes after the committed past.

``Loop`` runs the decoder layers itself: plain attention layers as ``FusedLayer``, the token mixing
of Gated DeltaNet layers as ``GDNLayer`` (``workers.models.gdn_layer``: every node continues its
parent's conv window and recurrent state), the hybrids' gated attention, norms and MLPs as
``fused_hybrid``'s layers, and anything else (MoE MLPs, unknown layer shapes) through the model's own
modules. transformers' own forward cannot do that: its linear-attention layers ignore a 4-D mask
(siblings leak into each other's state) and its hybrid cache cannot be rolled back. Every tensor a
pass reads or writes lives in the loop's ``State`` (``runner.state``) at a fixed address, which is
what a CUDA graph needs (``runner.graphs``).

A target split over several GPUs (accelerate ``device_map``) runs in segments, a run of layers on one
device each: the hidden state moves to each layer's device and taps are gathered onto the drafter's
device. A tensor-parallel target (``workers.models.tensor_parallel``; one device per rank) runs the
same loop on every rank over that rank's heads and MLP columns: each block's row-parallel output
(attention / GDN out_proj, MLP down_proj) is summed over the ranks (``reduce``) before the residual is
added, so the hidden states, taps and (gathered) logits are the same on every rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from workers.models.attention import grouped_attention_in
from workers.models.fused_hybrid import fused_hybrid_layer_for
from workers.models.fused_layer import PassInputs, fused_layer_for
from workers.models.gdn import TreeShape
from workers.models.gdn_layer import gdn_layer_for
from workers.models.runner.state import State
from workers.models.streams import branches
from workers.seam import VerifyOutput, text_config

# A commit's pieces (the K/V rows' move, each GDN layer's path) queued on this many CUDA streams at once
# (``workers.models.streams``; 1: one after another on the current stream). They are independent, and a
# GDN layer's kernel is short of work (``benchmarks/commit_branches.py`` times the choice; the H200's figures
# are in docs/gpu.md: 4 streams took most of what 8 did off the 27B shape's commit).
COMMIT_BRANCHES = 4


class Loop:
    """The model's parts and each layer's form, and the passes (and commits) over them on ``state``."""

    def __init__(
        self,
        model: nn.Module,
        tap_layer_ids: tuple[int, ...] = (),
        tap_device: torch.device | None = None,
        prefill_chunk: int = 1024,
        segment_starts: tuple[int, ...] = (),
        compile_layers: bool = False,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.config = text_config(model.config)
        base = getattr(model, "model", model)
        self.embed, self.layers, self.norm, self.rotary = base.embed_tokens, base.layers, base.norm, base.rotary_emb
        self.lm_head = model.get_output_embeddings()
        self.layer_types = tuple(getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers))
        self.gdn_ids = tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")
        self.attention_ids = tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")
        self.layer_devices = [next(layer.parameters()).device for layer in self.layers]
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.tap_device = tap_device
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        self.devices = {*self.layer_devices, self.device, self.lm_head.weight.device}
        # sums a row-parallel projection's partial outputs over the ranks (None: one process)
        self.reduce = reduce
        # segments: runs of layers on one device (plus any forced starts); with graphs, one graph per
        # segment and pass width, the hidden state handed from segment to segment between replays
        count = len(self.layers)
        starts = sorted({0, *(i for i in segment_starts if 0 < i < count),
                         *(i for i in range(1, count) if self.layer_devices[i] != self.layer_devices[i - 1])})
        self.segments = list(zip(starts, [*starts[1:], count]))
        # experimental: torch.compile fuses the layers' small elementwise kernels (norms, rotary, gates)
        self.run_layers = torch.compile(self._layers, dynamic=False) if compile_layers else self._layers
        # plain attention layers run as FusedLayer, gated ones as GatedAttentionLayer (few kernels each);
        # GDN layers' norms and MLP as HybridGDNLayer; anything else through transformers' modules.
        # ``reduce`` sums each row-parallel output over the ranks (tensor parallelism; None: one process)
        self.fused = {i: fused_layer_for(self.layers[i], self.config, self.reduce)
                      or fused_hybrid_layer_for(self.layers[i], self.reduce) for i in self.attention_ids}
        self.gdn_blocks = {i: fused_hybrid_layer_for(self.layers[i], self.reduce) for i in self.gdn_ids}
        self.gdn = {i: gdn_layer_for(self.layers[i].linear_attn, self.reduce) for i in self.gdn_ids}
        if self.attention_ids:  # transformers renamed the attention modules' ``past_key_values`` to ``cache``
            params = inspect.signature(self.layers[self.attention_ids[0]].self_attn.forward).parameters
            self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.state = State(self, prefill_chunk)

    # -- a pass ------------------------------------------------------------------------------------
    def forward(self, ids, depths, parents, visible, last_only: bool, attend: int | None = None,
                chain: bool = False, commit: bool = False) -> VerifyOutput:
        """One pass over q nodes after the committed past. ``attend`` = K/V slots read (graphs: all);
        ``chain``: the nodes are a line; ``commit``: GDN layers keep all of them (the prompt)."""
        hidden, per_device = self.head(ids, depths, parents, visible, attend, chain, commit)
        captured: dict[int, torch.Tensor] = {}
        with grouped_attention_in(self.config):
            for start, end in self.segments:
                hidden = self.run_layers(hidden, per_device, captured, commit, start, end)
        return self.tail(hidden, captured, last_only)

    def head(self, ids, depths, parents, visible, attend: int | None, chain: bool, commit: bool = False):
        """The embedding and what every layer of the pass shares: (hidden [1, q, H], ``PerDevice``).
        ``commit``: the pass keeps its nodes as it goes, so its GDN layers need no tree blocks."""
        state = self.state
        q = ids.shape[0]
        if attend is None:  # eager: the committed length is known on the host
            state.committed.fill_(state.length)
            # on CUDA read the whole buffer like a graph does (same kernels, so graph == eager bit for
            # bit); on the CPU only the committed past and this pass
            attend = state.capacity if self.device.type == "cuda" else state.length + q
        length = state.committed
        slots = length + state.columns[:q]
        state.kv.attend = attend
        hidden = self.embed(ids).unsqueeze(0)  # [1, q, H]
        positions = (length + depths).unsqueeze(0)
        if hasattr(self.rotary, "mrope_section"):  # Qwen3.5's multimodal rotary: text uses one position thrice
            positions = positions.unsqueeze(0).expand(3, 1, q)
        cos, sin = self.rotary(hidden, positions)
        mask = self._attention_mask(length, visible, attend)
        shared = {"cos": cos, "sin": sin, "mask": mask, "slots": slots}
        if self.gdn_ids:
            window = self.gdn[self.gdn_ids[0]].window
            shared["tree"] = TreeShape.build(parents, window, chain, commits=commit)
        if any(self.fused.values()):
            groups = self.config.num_attention_heads // self.config.num_key_value_heads
            shared["fused"] = PassInputs.build(cos, sin, slots, mask[0, 0], groups, visible)
        per_device = PerDevice(**shared)
        state.kv.per_device = per_device
        state.state_bytes = 0
        return hidden, per_device

    def tail(self, hidden: torch.Tensor, captured: dict, last_only: bool) -> VerifyOutput:
        """The final norm and lm_head (the last node only with ``last_only``), and the taps."""
        if last_only:
            hidden = hidden[:, -1:]
        hidden = self.norm(hidden.to(self.norm.weight.device))
        logits = self.lm_head(hidden.to(self.lm_head.weight.device))[0]
        self.state.peak_state_bytes = max(self.state.peak_state_bytes, self.state.state_bytes)
        return VerifyOutput(logits=logits, taps=self._taps(captured))

    def _layers(self, hidden, per_device: PerDevice, captured: dict, commit: bool, start: int, end: int):
        """Decoder layers start..end-1 over the pass's hidden states [1, q, H]; fills ``captured`` with taps.

        The layers update the hidden state in place (the residual sums land in the projections'
        epilogues), so ``hidden`` must be the pass's own tensor, and a tap is a copy."""
        kv = self.state.kv
        for i in range(start, end):
            layer = self.layers[i]
            on = per_device.get(self.layer_devices[i])
            hidden = hidden.to(self.layer_devices[i])
            fused = self.fused.get(i)
            if fused is not None:
                hidden = fused(hidden, on["fused"], kv.pairs[i], kv.attend)
            else:
                hidden = self._module_layer(i, layer, hidden, on, commit)
            if i in self.tap_layer_ids:
                captured[i] = hidden.clone()
        return hidden

    def _module_layer(self, i: int, layer: nn.Module, hidden: torch.Tensor, on: dict, commit: bool) -> torch.Tensor:
        """One decoder layer through transformers' own modules (linear attention: our tree form)."""
        state = self.state
        block = self.gdn_blocks.get(i)  # the fused norms and MLP around a GDN mixer, if any
        if self.layer_types[i] == "linear_attention":
            # with the fused block the mixer takes the input norm (at one row inside its projection) and
            # adds its output to hidden in place (in out_proj's epilogue)
            if block is not None:
                mixed, pending = self.gdn[i](hidden, on["tree"], state.conv_windows[i], state.states[i], commit,
                                             residual=hidden, input_norm=block.input_norm)
            else:
                mixed, pending = self.gdn[i](layer.input_layernorm(hidden), on["tree"], state.conv_windows[i],
                                             state.states[i], commit)
            if pending is not None:
                state.pending[i] = pending
                state.state_bytes += pending.nbytes()
            if block is not None:
                return block.finish_summed(mixed)
        else:
            kwargs = {self._cache_kwarg: state.kv}
            mixed = self._reduced(layer.self_attn(
                hidden_states=layer.input_layernorm(hidden), position_embeddings=(on["cos"], on["sin"]),
                attention_mask=on["mask"], **kwargs,
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
        columns = self.state.columns[:attend]
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

    # -- a commit ----------------------------------------------------------------------------------
    def commit(self, count: int) -> None:
        """Device-only commit of the path in the state's ``kept[:count]`` after ``committed`` tokens."""
        for device in self.state.commit_inputs:
            self.state.hand_commit_inputs(device, count)
            self.commit_on(device, count)

    def commit_on(self, device: torch.device, count: int) -> None:
        """The commit's work on one device: the accepted K/V rows of its attention layers move to the
        slots after the committed past, and its GDN layers replay the accepted path from their state."""
        state = self.state
        kept, length, columns = state.commit_inputs[device]
        layers = [i for i in self.gdn_ids if self.layer_devices[i] == device]
        with branches(device, min(COMMIT_BRANCHES, 1 + len(layers))) as on:  # each piece on its own
            with on(0):
                state.kv.move_on(device, length + kept[:count], length + columns[:count])
            for k, i in enumerate(layers, 1):
                with on(k):
                    self.gdn[i].commit(state.pending[i], kept[:count], state.conv_windows[i], state.states[i])


def chain_shape(q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, visibility) of q nodes in a line."""
    return torch.arange(-1, q - 1, device=device), torch.ones(q, q, dtype=torch.bool, device=device).tril()


class PerDevice:
    """The pass's shared inputs (rotary, mask, tree shape, the fused layers' ``PassInputs``), copied
    once to each device that needs them."""

    def __init__(self, **tensors) -> None:
        self.tensors = tensors
        self.copies: dict[torch.device, dict[str, torch.Tensor]] = {}

    def get(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self.copies:
            self.copies[device] = {name: t.to(device) for name, t in self.tensors.items()}
        return self.copies[device]
