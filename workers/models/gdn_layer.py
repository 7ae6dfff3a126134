"""One GDN token mixer (Qwen3.5 / Qwen3.6 / Qwen3-Next ``linear_attn``) over a pass's nodes.

The layer object beside ``FusedLayer``: it holds the model's own modules (projections, conv
weights, gated norm, ``out_proj``) and runs, for the nodes of one pass,

    projections -> conv over each node's ancestry -> gated delta rule from the committed state ->
    gated RMSNorm -> out_proj

with ``workers.models.gdn``'s tree forms, so every node continues its parent's conv window and
recurrent state. The state itself (conv window [K-1, C], recurrent state [H, dk, dv]) belongs to the
runner, which passes it in; a pass leaves a ``PendingLayer`` (the nodes' conv inputs, decays and
betas) and ``commit`` replays the accepted path from it into that state, in place.

Under tensor parallelism the mixer holds one rank's heads (``workers.models.tensor_parallel``): the
state is that of the local heads, and ``reduce`` (an all-reduce) sums out_proj's partial output.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.fused_layer import add_projection_, fuse_rows, norm_linear, one_plus_rms_norm, product
from workers.models.gdn import (
    MAX_PATH,
    PendingLayer,
    TreeShape,
    chain_conv,
    chain_delta_rule,
    chain_delta_rule_normalized,
    conv_lag_index,
    kernel_fits,
    tree_conv,
    tree_delta_rule,
    window_after,
)
from workers.models.kernels import triton_available


class GDNLayer:
    """The token mixer of one GDN decoder layer; see the module docstring."""

    def __init__(self, mixer: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.mixer = mixer
        self.reduce = reduce  # sums out_proj's row-parallel partial output over ranks; None: one process
        self.window = mixer.conv_kernel_size - 1
        self.conv_dim = mixer.conv_dim
        self.state_shape = (mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
        self.projection = None  # Qwen3.5's four input projections as one matrix (the modules' weights view it)
        if all(hasattr(mixer, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
            modules = (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a)
            if all(m.bias is None for m in modules):
                with torch.inference_mode(False), torch.no_grad():
                    self.projection = fuse_rows(modules, "weight")
                self.splits = [m.out_features for m in modules]
        # the Triton kernels (conv prologue, tree solve, gated norm) on CUDA when the heads fit their tiles
        weight = mixer.conv1d.weight
        self.device = weight.device
        self.conv_weight = weight  # the weights this object was made for (replaced when the model is sharded)
        self.kernels = (weight.is_cuda and mixer.head_k_dim == mixer.head_v_dim
                        and kernel_fits(mixer.head_k_dim, mixer.head_v_dim) and triton_available())
        if self.kernels:  # every commit length compiled now, not inside a timed round
            from workers.models.gdn_triton import compile_commit_lengths

            try:
                compile_commit_lengths(mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, weight.shape[-1],
                                       weight.dtype, mixer.conv1d.bias is not None, weight.device, MAX_PATH)
            except Exception as exc:  # an optimisation only: commits then compile each length on first use
                warnings.warn(f"compiling the GDN commit kernel ahead failed ({type(exc).__name__}: "
                              f"{str(exc)[:200]}); each path length compiles on its first commit", stacklevel=2)

    def is_current(self) -> bool:
        """Whether the mixer's projection weights are still views of this object's fused matrix."""
        if self.mixer.conv1d.weight is not self.conv_weight or self.mixer.conv1d.weight.device != self.device:
            return False
        return self.projection is None or self.mixer.in_proj_qkv.weight.data_ptr() == self.projection.data_ptr()

    def new_state(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (conv window [K-1, C] in the model dtype, recurrent state [H, dk, dv] float32)."""
        return (torch.zeros(self.window, self.conv_dim, dtype=dtype, device=device),
                torch.zeros(self.state_shape, dtype=torch.float32, device=device))

    def __call__(self, hidden: torch.Tensor, shape: TreeShape, conv_window: torch.Tensor, state: torch.Tensor,
                 commit: bool = False, residual: torch.Tensor | None = None, input_norm: nn.Module | None = None):
        """hidden [1, q, H] (after the input norm) -> (mixed [1, q, H], PendingLayer or None).

        ``commit`` (the prompt: a chain kept whole) advances (conv_window, state) in place over all
        nodes and keeps nothing; otherwise the pass leaves the state alone and returns what
        ``commit`` needs to replay any accepted path. ``residual`` [1, q, H]: if given, mixed is
        residual itself, the mixer's output added in place (on CUDA by out_proj's matrix product's
        epilogue). ``input_norm``: the layer's (1 + w) input norm, not yet taken (hidden is the residual
        stream): taken here, at one row on CUDA inside the input projection's product.
        """
        mixer, q = self.mixer, hidden.shape[1]
        if input_norm is not None and not (self.kernels and self.projection is not None):
            hidden, input_norm = one_plus_rms_norm(hidden, input_norm), None  # taken before the projections
        if self.kernels:
            return self._with_kernels(hidden, shape, conv_window, state, commit, residual, input_norm)
        conv_inputs, z, b, a = _project(mixer, hidden[0])
        beta = b.sigmoid()
        log_gate = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)  # [q, H] <= 0
        weight, bias = mixer.conv1d.weight[:, 0, :], mixer.conv1d.bias  # [C, K]
        if shape.chain:
            conv_out, extended = chain_conv(conv_inputs, conv_window, weight, bias)
        else:
            conv_out, extended = tree_conv(conv_inputs, conv_window, weight, bias, shape.lag_index)
        query, key, value = self._heads(conv_out.to(conv_inputs.dtype))
        if shape.ancestors is None or commit:  # a chain: the chunked form
            out, new_state = chain_delta_rule(query, key, value, log_gate, beta, state, with_outputs=True)
        else:
            out = tree_delta_rule(query, key, value, log_gate, beta, state, shape.ancestors)
        pending = None
        if commit:
            state.copy_(new_state)
            conv_window.copy_(extended[extended.shape[0] - self.window :])
        else:
            pending = PendingLayer(extended, shape.lag_index, log_gate, beta)
        out = mixer.norm(out.to(hidden.dtype).reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
        mixed = self._reduced(mixer.out_proj(out.reshape(1, q, -1)))
        return (mixed if residual is None else residual.add_(mixed)), pending

    def _with_kernels(self, hidden, shape: TreeShape, conv_window, state, commit: bool, residual, input_norm=None):
        """``__call__`` through the Triton kernels: one projection (``input_norm``, with the fused
        projection only: the norm before it), one conv prologue (with the gates and the extended conv
        inputs), the tree kernel (the gated norm in its epilogue) or the chunked delta rule and one gated
        norm, out_proj."""
        mixer, q = self.mixer, hidden.shape[1]
        if self.projection is not None:  # views of one [q, C + H*dv + 2H] product: rows strided
            projected = (product(hidden[0], self.projection) if input_norm is None
                         else norm_linear(hidden[0], input_norm, self.projection, one_plus=True))
            conv_inputs, z, b, a = torch.split(projected, self.splits, dim=-1)
        else:
            conv_inputs, z, b, a = _project(mixer, hidden[0])
            z = z.reshape(q, -1)
        from workers.models.gdn_triton import advance_state, gated_norm, prologue, tree_outputs

        # cat(window, inputs), as the commit replays from it: written by the prologue, not concatenated
        extended = torch.empty(self.window + q, self.conv_dim, dtype=conv_inputs.dtype, device=conv_inputs.device)
        key_heads, heads = mixer.num_k_heads, mixer.num_v_heads
        kq, v_, beta, log_gate = prologue(conv_window, conv_inputs, shape.lag_index, mixer.conv1d.weight[:, 0, :],
                                          mixer.conv1d.bias, key_heads, heads, mixer.head_k_dim, extended,
                                          (b, a, mixer.A_log, mixer.dt_bias))
        pending = normed = None
        if commit and q <= MAX_PATH:  # a few tokens kept whole (AR's one): the recurrence, state in registers
            out = advance_state(kq[:, 0], kq[:, 1], v_, log_gate, beta, state)
        elif shape.ancestors is None or commit:  # a long chain (prompt chunks): the chunked form
            if hidden.dtype != torch.float32 and (fla_rule := fla_chunk_rule()) is not None:
                out = _fla_chunked(fla_rule, kq, v_, log_gate, beta, state, commit)
            else:  # float32 (exact to rounding against the CPU path) or fla-core not installed
                out, new_state = chain_delta_rule_normalized(kq[:, 1], kq[:, 0], v_, log_gate, beta, state)
                if commit:
                    state.copy_(new_state)
        else:  # a tree: its gated norm in the tree kernel's epilogue
            blocks = None if shape.block_slots is None else (shape.block_slots, shape.block_mask)
            normed = tree_outputs(kq, v_, log_gate, beta, state, shape.ancestors, blocks, hidden.dtype,
                                  norm=(z, mixer.norm.weight, mixer.norm.variance_epsilon))
        if commit:
            conv_window.copy_(extended[extended.shape[0] - self.window :])
        else:
            pending = PendingLayer(extended, shape.lag_index, log_gate, beta)
        if normed is None:
            normed = gated_norm(out, z, mixer.norm.weight, mixer.norm.variance_epsilon, hidden.dtype)
        if residual is None:
            return self._reduced(mixer.out_proj(normed).unsqueeze(0)), pending
        # the residual sum in out_proj's epilogue, in place (sharded: added after the reduce)
        add_projection_(residual[0], normed, mixer.out_proj, self.reduce)
        return residual, pending

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.reduce is None else self.reduce(partial)

    def commit(self, pending: PendingLayer, path: torch.Tensor, conv_window: torch.Tensor, state: torch.Tensor) -> None:
        """Advance (conv_window, state) in place over the nodes ``path`` (root ... accepted node) of
        the pass that left ``pending``: the path replayed as a chain from the committed state."""
        mixer, count, window = self.mixer, path.shape[0], self.window
        if self.kernels:  # one kernel: conv over the path, the recurrence with the state in registers, window
            from workers.models.gdn_triton import commit_path

            commit_path(pending.extended, path, mixer.conv1d.weight[:, 0, :], mixer.conv1d.bias, pending.log_gate,
                        pending.beta, state, conv_window, mixer.num_k_heads)
            return
        parents = torch.arange(-1, count - 1, device=path.device)
        conv_out, _ = tree_conv(pending.extended[window + path], conv_window, mixer.conv1d.weight[:, 0, :],
                                mixer.conv1d.bias, conv_lag_index(parents, window))
        query, key, value = self._heads(conv_out.to(pending.extended.dtype))
        _, new_state = chain_delta_rule(query, key, value, pending.log_gate[path], pending.beta[path], state,
                                        with_outputs=False)
        new_window = window_after(pending.extended, pending.lag_index, path[-1:])
        state.copy_(new_state)  # in place: captured graphs read these tensors
        conv_window.copy_(new_window)

    def _heads(self, conv_out: torch.Tensor):
        """query, key [q, Hk, dk] and value [q, H, dv] from the conv output [q, C]."""
        mixer, q = self.mixer, conv_out.shape[0]
        query, key, value = torch.split(conv_out, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        return (query.reshape(q, -1, mixer.head_k_dim), key.reshape(q, -1, mixer.head_k_dim),
                value.reshape(q, -1, mixer.head_v_dim))


@functools.cache
def fla_chunk_rule() -> Callable | None:
    """``fla-core``'s Triton ``chunk_gated_delta_rule`` (tensor-core chunks) if installed, else None. An
    install that fails to import (say, against another Triton) warns once and leaves the torch form."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    except Exception as exc:  # an optional accelerator must not stop a run
        warnings.warn(f"fla-core is installed but failed to import ({type(exc).__name__}: {str(exc)[:200]}); "
                      "prompt chunks use the torch chunked form", stacklevel=2)
        return None
    return chunk_gated_delta_rule


def _fla_chunked(rule: Callable, kq: torch.Tensor, v_: torch.Tensor, log_gate: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, commit: bool) -> torch.Tensor:
    """The chunked delta rule through ``rule`` (fla's layout: [1, q, heads, d], keys once per key head,
    as the prologue writes them): outputs [q, H, dv] float32; with ``commit`` the final state is
    written into ``state``."""
    query, key = (kq[:, part].transpose(0, 1).unsqueeze(0) for part in (1, 0))  # [1, q, Hk, d]
    out, final = rule(query, key, v_.transpose(0, 1).unsqueeze(0), log_gate.unsqueeze(0), beta.unsqueeze(0),
                      scale=1.0, initial_state=state.unsqueeze(0), output_final_state=commit)
    if commit:
        state.copy_(final[0])
    return out[0]


def _project(mixer: nn.Module, hidden: torch.Tensor):
    """(conv input [q, C], z [q, H, dv], b [q, H], a [q, H]) for Qwen3.5's split projections or
    Qwen3-Next's fused, per-key-head interleaved ones."""
    q = hidden.shape[0]
    if hasattr(mixer, "in_proj_qkvz"):
        query, key, value, z, b, a = mixer.fix_query_key_value_ordering(
            mixer.in_proj_qkvz(hidden[None]), mixer.in_proj_ba(hidden[None])
        )
        mixed = torch.cat([x.reshape(q, -1) for x in (query, key, value)], dim=-1)
        return mixed, z[0], b[0], a[0]
    z = mixer.in_proj_z(hidden).reshape(q, -1, mixer.head_v_dim)
    return mixer.in_proj_qkv(hidden), z, mixer.in_proj_b(hidden), mixer.in_proj_a(hidden)


def gdn_layer_for(mixer: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> GDNLayer:
    """The mixer's ``GDNLayer``, made once and kept on the mixer (its fused projection is what the
    mixer's weights view); made again if they stopped being views of it (the model was moved, cast
    or sharded). ``reduce``: see ``GDNLayer``."""
    existing = getattr(mixer, "_gdn_layer", None)
    if existing is not None and existing.is_current():
        existing.reduce = reduce
        return existing
    layer = GDNLayer(mixer, reduce)
    mixer._gdn_layer = layer  # a plain attribute (not a submodule): no second state_dict entry
    return layer
