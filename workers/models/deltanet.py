"""Gated DeltaNet (the linear-attention layers of Qwen3.5 / Qwen3.6 / Qwen3-Next) over a tree of tokens.

A GDN layer carries two things from token to token: the last K-1 inputs of a depthwise causal
convolution (the conv window) and a recurrent state S [H, dk, dv]. Per token t, with q, k
l2-normalised and q scaled by dk^-1/2, g_t <= 0 a log decay and beta_t in (0, 1):

    S' = exp(g_t) S_parent ;  delta_t = beta_t (v_t - S'^T k_t) ;  S_t = S' + k_t delta_t^T ;  o_t = S_t^T q_t

In a draft tree every node continues its *parent's* state, so siblings must not see one another.
Instead of materialising S for every node (B x layers x H x dk x dv: ~150 MB per node on a 27B
hybrid), we use the closed form that the chunked delta-rule kernels use, with "earlier in the
chunk" replaced by "ancestor in the tree". With G_t the sum of g over t's path (t included):

    S_t = exp(G_t) S_0 + sum_{j in path(t)} exp(G_t - G_j) k_j delta_j^T

so the deltas solve a unit lower-triangular system (nodes are in topological order, parents
first) and every output is a masked matrix product. Nothing per node is larger than a token's own
k, v and delta; the [H, q, q] score matrices are transient, one layer and one head group at a time.
After the acceptance walk the committed state is that same sum over the accepted path only
(``state_after``); the runner recomputes the path's keys and deltas by replaying it as a chain,
so a verify pass only has to keep each node's conv input, decay and beta.

Everything runs in float32 like the reference kernels; inputs may be in any dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# -- the short convolution ---------------------------------------------------------------------------
def conv_lag_index(parents: torch.Tensor, window: int) -> torch.Tensor:
    """[q, window+1] rows into ``cat(conv_window, node_inputs)``: column l is the input l steps back.

    parents: [q] parent of each node (-1 for the first node, whose predecessor is the newest input of
    the committed conv window). Row t, column 0 is node t itself (row ``window + t``).
    """
    q = parents.shape[0]
    device = parents.device
    # predecessor of every row of the extended input: committed rows step back one; nodes go to their parent
    committed_prev = torch.clamp(torch.arange(window, device=device) - 1, min=0)
    node_prev = torch.where(parents >= 0, parents + window, torch.full_like(parents, window - 1))
    prev = torch.cat((committed_prev, node_prev))
    lags = [torch.arange(window, window + q, device=device)]
    for _ in range(window):
        lags.append(prev[lags[-1]])
    return torch.stack(lags, dim=1)


def tree_conv(
    node_inputs: torch.Tensor,  # [q, C]
    conv_window: torch.Tensor,  # [window, C] committed inputs, oldest first
    weight: torch.Tensor,  # [C, window+1] depthwise kernel
    bias: torch.Tensor | None,
    lag_index: torch.Tensor,  # [q, window+1] from conv_lag_index
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(causal depthwise conv) of each node over its own ancestry; returns (out [q, C], extended inputs)."""
    extended = torch.cat((conv_window.to(node_inputs.dtype), node_inputs))  # [window+q, C]
    taps = extended[lag_index]  # [q, window+1, C], tap l = input l steps back
    out = torch.einsum("tlc,cl->tc", taps.to(weight.dtype), weight.flip(-1))
    if bias is not None:
        out = out + bias
    return F.silu(out), extended


def window_after(extended: torch.Tensor, lag_index: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """The conv window [window, C] once ``node`` ([1] index tensor) is committed: its last
    ``window`` inputs, oldest first. (Indexing with a tensor, not a Python int, keeps it capturable.)"""
    rows = lag_index.index_select(0, node.view(1))[0, :-1].flip(0)
    return extended[rows]


# -- the delta rule ------------------------------------------------------------------------------------
def tree_delta_rule(
    query: torch.Tensor,  # [q, Hk, dk]
    key: torch.Tensor,  # [q, Hk, dk]
    value: torch.Tensor,  # [q, H, dv]
    log_gate: torch.Tensor,  # [q, H] g <= 0
    beta: torch.Tensor,  # [q, H]
    state: torch.Tensor,  # [H, dk, dv] committed recurrent state (float32)
    visible: torch.Tensor,  # [q, q] bool, visible[t, j] = j is t or an ancestor of t
    head_group: int | None = None,
    with_outputs: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outputs [q, H, dv] of every node, each from its own path; plus (keys [Hk, q, dk], deltas, G) for the commit.

    ``head_group`` bounds the transient [group, q, q] matrices (None = all heads at once);
    ``with_outputs=False`` (a commit's replay needs only the state) skips the outputs and returns None.
    """
    num_heads, dk = value.shape[1], query.shape[-1]
    repeat = num_heads // query.shape[1]  # grouped heads: each q/k head serves `repeat` value heads
    q_ = l2_normalize(query.float()).repeat_interleave(repeat, dim=1).transpose(0, 1) * dk**-0.5  # [H, q, dk]
    k_ = l2_normalize(key.float()).repeat_interleave(repeat, dim=1).transpose(0, 1)  # [H, q, dk]
    v_ = value.float().transpose(0, 1)  # [H, q, dv]
    beta_ = beta.float().transpose(0, 1)  # [H, q]
    visible_f = visible.float()
    G = (visible_f @ log_gate.float()).transpose(0, 1)  # [H, q]
    strict = visible & ~torch.eye(visible.shape[0], dtype=torch.bool, device=visible.device)

    outputs = torch.empty_like(v_)
    deltas = torch.empty_like(v_)
    step = head_group or num_heads
    for h in range(0, num_heads, step):
        hs = slice(h, h + step)
        g, k, qh, S0 = G[hs], k_[hs], q_[hs], state[hs].float()
        # exp(G_t - G_j) on visible pairs only (masked before exp: off-path differences can be > 0)
        decay = (g[:, :, None] - g[:, None, :]).masked_fill(~visible, float("-inf")).exp()  # [h, q, q]
        lower = (beta_[hs, :, None] * decay * (k @ k.transpose(1, 2))).masked_fill(~strict, 0.0)
        lower.diagonal(dim1=1, dim2=2).fill_(1.0)
        rhs = beta_[hs, :, None] * (v_[hs] - g.exp()[:, :, None] * (k @ S0))
        delta = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)  # [h, q, dv]
        if with_outputs:
            outputs[hs] = g.exp()[:, :, None] * (qh @ S0) + (decay * (qh @ k.transpose(1, 2))) @ delta
        deltas[hs] = delta
    return outputs.transpose(0, 1) if with_outputs else None, k_[::repeat].contiguous(), deltas, G


def state_after(
    state: torch.Tensor,  # [H, dk, dv] committed before the pass
    keys: torch.Tensor,  # [Hk, q, dk] from tree_delta_rule
    deltas: torch.Tensor,  # [H, q, dv]
    log_decay: torch.Tensor,  # [H, q] G
    path: torch.Tensor,  # [p] node indices root ... accepted node
) -> torch.Tensor:
    """Recurrent state [H, dk, dv] once the nodes ``path`` are committed."""
    G_path = log_decay[:, path]  # [H, p]
    last = G_path[:, -1:]
    weights = (last - G_path).exp()  # [H, p]
    repeat = deltas.shape[0] // keys.shape[0]
    path_keys = keys[:, path].repeat_interleave(repeat, dim=0) * weights[:, :, None]  # [H, p, dk]
    return last.exp()[:, :, None] * state.float() + path_keys.transpose(1, 2) @ deltas[:, path]


# -- what a verify pass keeps until the commit ---------------------------------------------------------
TRANSIENT_BYTES = 256 * 2**20  # cap on one layer's transient [heads, q, q] float32 matrices


def head_group_for(nodes: int) -> int:
    """Heads per group so the ~4 live [group, q, q] float32 matrices of ``tree_delta_rule`` stay under the cap."""
    return max(1, TRANSIENT_BYTES // (nodes * nodes * 4 * 4))

@dataclass
class PendingLayer:
    """What one linear layer keeps from a verify pass until the commit (the replay's inputs)."""

    extended: torch.Tensor  # [window+q, C] committed conv window, then each node's conv input (model dtype)
    lag_index: torch.Tensor  # [q, window+1] rows of ``extended`` each node's conv reads
    log_gate: torch.Tensor  # [q, H] float32 per-node log decay g
    beta: torch.Tensor  # [q, H] per-node beta (model dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.extended, self.lag_index, self.log_gate, self.beta))


def tree_state_bytes(config, nodes: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a verify pass of ``nodes`` tokens keeps until the commit: every linear layer's
    ``PendingLayer``. Transient [heads, q, q] score matrices are capped separately
    (``TRANSIENT_BYTES`` per layer) and freed layer by layer."""
    cfg = getattr(config, "text_config", None) or config
    layers = sum(kind == "linear_attention" for kind in cfg.layer_types)
    heads, key_heads = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    window = cfg.linear_conv_kernel_dim - 1
    conv_dim = 2 * key_heads * cfg.linear_key_head_dim + heads * cfg.linear_value_head_dim
    element = torch.empty((), dtype=dtype).element_size()
    per_layer = element * (window + nodes) * conv_dim + 8 * nodes * (window + 1) + (4 + element) * nodes * heads
    return layers * per_layer


def full_state_bytes(config, nodes: int) -> int:
    """What keeping a float32 recurrent state per node would cost instead (the naive fork)."""
    cfg = getattr(config, "text_config", None) or config
    layers = sum(kind == "linear_attention" for kind in cfg.layer_types)
    return nodes * layers * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
