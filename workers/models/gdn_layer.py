"""One Gated DeltaNet token mixer (Qwen3.5 / Qwen3.6 / Qwen3-Next ``linear_attn``) over a pass's nodes.

The layer object beside ``FusedLayer``: it holds the model's own modules (projections, conv
weights, gated norm, ``out_proj``) and runs, for the nodes of one pass,

    projections -> conv over each node's ancestry -> gated delta rule from the committed state ->
    gated RMSNorm -> out_proj

with ``workers.models.deltanet``'s tree forms, so every node continues its parent's conv window and
recurrent state. The state itself (conv window [K-1, C], recurrent state [H, dk, dv]) belongs to the
runner, which passes it in; a pass leaves a ``PendingLayer`` (the nodes' conv inputs, decays and
betas) and ``commit`` replays the accepted path from it into that state, in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.deltanet import (
    PendingLayer,
    conv_lag_index,
    state_after,
    tree_conv,
    tree_delta_rule,
    window_after,
)


class GDNLayer:
    """The token mixer of one linear-attention decoder layer; see the module docstring."""

    def __init__(self, mixer: nn.Module) -> None:
        self.mixer = mixer
        self.window = mixer.conv_kernel_size - 1
        self.conv_dim = mixer.conv_dim
        self.state_shape = (mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)

    def new_state(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (conv window [K-1, C] in the model dtype, recurrent state [H, dk, dv] float32)."""
        return (torch.zeros(self.window, self.conv_dim, dtype=dtype, device=device),
                torch.zeros(self.state_shape, dtype=torch.float32, device=device))

    def __call__(self, hidden: torch.Tensor, parents: torch.Tensor, visible: torch.Tensor,
                 conv_window: torch.Tensor, state: torch.Tensor, head_group: int | None):
        """hidden [1, q, H] (after the input norm) -> (mixed [1, q, H], what the commit needs)."""
        mixer, q = self.mixer, hidden.shape[1]
        mixed_qkv, z, b, a = _project(mixer, hidden[0])
        beta = b.sigmoid()
        log_gate = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)  # [q, H] <= 0
        lag_index = conv_lag_index(parents, self.window)
        out, _, extended = self._delta_rule(mixed_qkv, log_gate, beta, lag_index, visible, conv_window, state,
                                            head_group)
        pending = PendingLayer(extended, lag_index, log_gate, beta)
        out = mixer.norm(out.to(hidden.dtype).reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
        return mixer.out_proj(out.reshape(1, q, -1)), pending

    def commit(self, pending: PendingLayer, path: torch.Tensor, conv_window: torch.Tensor, state: torch.Tensor) -> None:
        """Advance (conv_window, state) in place over the nodes ``path`` (root ... accepted node)."""
        count, window = path.shape[0], self.window
        parents = torch.arange(-1, count - 1, device=path.device)
        visible = torch.ones(count, count, dtype=torch.bool, device=path.device).tril()
        _, (keys, deltas, G), _ = self._delta_rule(
            pending.extended[window + path], pending.log_gate[path], pending.beta[path],
            conv_lag_index(parents, window), visible, conv_window, state, head_group=None, with_outputs=False,
        )
        new_state = state_after(state, keys, deltas, G, torch.arange(count, device=path.device))
        new_window = window_after(pending.extended, pending.lag_index, path[-1:])
        state.copy_(new_state)  # in place: captured graphs read these tensors
        conv_window.copy_(new_window)

    def _delta_rule(self, conv_inputs, log_gate, beta, lag_index, visible, conv_window, state, head_group,
                    with_outputs=True):
        """Conv + gated delta rule from the committed state over nodes shaped by (lag_index, visible);
        returns (outputs [q, H, dv] or None, (keys, deltas, G) for ``state_after``, conv inputs)."""
        mixer, q = self.mixer, conv_inputs.shape[0]
        weight = mixer.conv1d.weight[:, 0, :]  # [C, K]
        conv_out, extended = tree_conv(conv_inputs, conv_window, weight, mixer.conv1d.bias, lag_index)
        query, key, value = torch.split(
            conv_out.to(conv_inputs.dtype), [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1
        )
        query = query.reshape(q, -1, mixer.head_k_dim)
        key = key.reshape(q, -1, mixer.head_k_dim)
        value = value.reshape(q, -1, mixer.head_v_dim)
        out, keys, deltas, G = tree_delta_rule(query, key, value, log_gate, beta, state, visible, head_group,
                                               with_outputs)
        return out, (keys, deltas, G), extended


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
