"""Gated DeltaNet's per-token work as Triton kernels (CUDA only): the tree solve, the conv prologue, the gated norm.

``tree_path_outputs``: the per-node path solve of ``workers.models.deltanet.tree_delta_rule``.
One program per (node, key head, block of value columns): it gathers the keys of the node's <= P
ancestors into registers, forms their [P, P] Gram matrix and the node's query products, then, for
each value head that shares this key head, runs the P-step forward substitution on scalars and
sums P gathered rows of r. Nothing is written but the outputs; the torch form in ``deltanet`` is the
reference it is tested against (``tests/workers/models/test_gdn_triton.py``).

``prologue``: each node's conv over its ancestry, SiLU and the q/k l2 norms in one kernel (one program
per node and head), replacing ~20 small torch kernels; ``gated_norm``: the output's RMSNormGated in
one. Both follow the torch path's roundings to the model dtype, so they agree with it to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TREE_WARPS = 1


@triton.jit
def _tree_path_kernel(
    Q, K, R, QS, G, BETA, ANC, OUT, nodes,
    HEADS: tl.constexpr, REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, P: tl.constexpr,
    BV: tl.constexpr, STEPS: tl.constexpr,
):
    t = tl.program_id(0)
    hk = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    m = tl.arange(0, P)
    d = tl.arange(0, DK)
    anc = tl.load(ANC + t * P + m)  # [P]; == nodes past the root
    valid = anc < nodes
    row = tl.where(valid, anc, 0)
    keys = tl.load(K + (hk * nodes + row[:, None]) * DK + d[None, :], mask=valid[:, None], other=0.0)  # [P, DK]
    query = tl.load(Q + (hk * nodes + t) * DK + d)  # [DK]
    gram = tl.dot(keys, tl.trans(keys), input_precision="ieee")  # [P, P]
    qk = tl.sum(keys * query[None, :], axis=1)  # [P]
    upper = (m[None, :] > m[:, None]) & valid[None, :]
    for r in tl.static_range(REPEAT):
        h = hk * REPEAT + r
        g_path = tl.load(G + h * nodes + row, mask=valid, other=0.0)
        b_path = tl.load(BETA + h * nodes + row, mask=valid, other=0.0)
        g_t = tl.load(G + h * nodes + t)
        # U[m, n] = beta_{a_m} exp(G_{a_m} - G_{a_n}) gram[m, n], n > m on the path (masked before exp)
        U = b_path[:, None] * tl.exp(tl.where(upper, g_path[:, None] - g_path[None, :], float("-inf"))) * gram
        w = tl.where(valid, tl.exp(g_t - g_path) * qk, 0.0)  # starts as e
        for n in tl.static_range(1, STEPS):  # w_n = e_n - sum_{m<n} w_m U[m, n] (paths have <= STEPS nodes)
            column = tl.sum(tl.where(m[None, :] == n, U, 0.0), axis=1)
            w = tl.where(m == n, w - tl.sum(w * column), w)
        rows = tl.load(R + (h * nodes + row[:, None]) * DV + cols[None, :], mask=valid[:, None], other=0.0)
        out = tl.exp(g_t) * tl.load(QS + (h * nodes + t) * DV + cols) + tl.sum(w[:, None] * rows, axis=0)
        tl.store(OUT + (t * HEADS + h) * DV + cols, out)


def tree_path_outputs(
    q_: torch.Tensor,  # [Hk, q, dk] float32, one row per key head (scaled by dk^-1/2)
    k_: torch.Tensor,  # [Hk, q, dk] float32, one row per key head
    rhs: torch.Tensor,  # [H, q, dv] r
    q_S0: torch.Tensor,  # [H, q, dv]
    G: torch.Tensor,  # [H, q] path sums of the log decay
    beta: torch.Tensor,  # [H, q]
    ancestors: torch.Tensor,  # [q, P] (P a power of two >= 16)
    num_warps: int | None = None,
) -> torch.Tensor:
    """Outputs [q, H, dv] float32, as ``deltanet._path_outputs`` computes them."""
    heads, nodes, dv = rhs.shape
    key_heads, _, dk = k_.shape
    repeat = heads // key_heads
    P = ancestors.shape[1]
    out = torch.empty(nodes, heads, dv, dtype=torch.float32, device=rhs.device)
    # one warp per program: the forward substitution's reductions stay inside the warp (no barriers)
    _tree_path_kernel[(nodes, key_heads, 1)](
        q_.contiguous(), k_.contiguous(), rhs.contiguous(), q_S0.contiguous(), G.contiguous(),
        beta.contiguous(), ancestors.contiguous(), out, nodes,
        HEADS=heads, REPEAT=repeat, DK=dk, DV=dv, P=P, BV=dv, STEPS=min(P, nodes), num_warps=num_warps or TREE_WARPS,
    )
    return out


@triton.jit
def _prologue_kernel(
    EXT, LAG, W, BIAS, QN, KN, V, nodes, channels,
    KEY_HEADS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, TAPS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE: tl.constexpr,
):
    """Program (node t, head segment s): the conv over t's ancestry + SiLU of one head's channels, then
    (q, k heads) the l2 norm; writes q_ / k_ [Hk, q, D] and v [H, q, D] in float32."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    c = s * D + tl.arange(0, D)  # q heads, then k heads, then v heads: the conv channels in order
    acc = tl.zeros((D,), dtype=tl.float32)
    for lag in tl.static_range(TAPS):  # tap `lag` reads the input `lag` steps back with weight[:, K-1-lag]
        row = tl.load(LAG + t * TAPS + lag)
        x = tl.load(EXT + row * channels + c).to(tl.float32)
        acc += x * tl.load(W + c * TAPS + (TAPS - 1 - lag)).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + c).to(tl.float32)
    x = acc * tl.sigmoid(acc)
    x = x.to(EXT.dtype.element_ty).to(tl.float32)  # the torch path rounds the conv output to the model dtype
    if s < 2 * KEY_HEADS:
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)
        if s < KEY_HEADS:
            tl.store(QN + (s * nodes + t) * D + tl.arange(0, D), x * SCALE)
        else:
            tl.store(KN + ((s - KEY_HEADS) * nodes + t) * D + tl.arange(0, D), x)
    else:
        tl.store(V + ((s - 2 * KEY_HEADS) * nodes + t) * D + tl.arange(0, D), x)


def prologue(extended: torch.Tensor, lag_index: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             key_heads: int, heads: int, head_dim: int):
    """(q_ [Hk, q, D] scaled, k_ [Hk, q, D], v [H, q, D]) float32 from the conv inputs ``extended``
    [window+q, C] as ``deltanet.tree_conv`` + l2 normalisation compute them (dk = dv = D)."""
    nodes, taps = lag_index.shape
    channels = extended.shape[1]
    device = extended.device
    q_ = torch.empty(key_heads, nodes, head_dim, dtype=torch.float32, device=device)
    k_ = torch.empty_like(q_)
    v = torch.empty(heads, nodes, head_dim, dtype=torch.float32, device=device)
    _prologue_kernel[(nodes, 2 * key_heads + heads)](
        extended, lag_index, weight.contiguous(), bias if bias is not None else weight, q_, k_, v, nodes, channels,
        KEY_HEADS=key_heads, HEADS=heads, D=head_dim, TAPS=taps, HAS_BIAS=bias is not None, SCALE=head_dim**-0.5,
        num_warps=1,
    )
    return q_, k_, v


@triton.jit
def _gated_norm_kernel(O, Z, W, OUT, z_stride, eps, HEADS: tl.constexpr, D: tl.constexpr):
    """Program (node t, head h): Qwen3.5's RMSNormGated of one head's output row, with its roundings."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    dtype = OUT.dtype.element_ty
    x = tl.load(O + (t * HEADS + h) * D + d).to(dtype).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)).to(dtype)
    y = (tl.load(W + d).to(dtype) * y).to(tl.float32)
    z = tl.load(Z + t * z_stride + h * D + d).to(tl.float32)
    tl.store(OUT + (t * HEADS + h) * D + d, (y * z * tl.sigmoid(z)).to(dtype))


def gated_norm(out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
               dtype: torch.dtype) -> torch.Tensor:
    """out [q, H, D] float32, z [q, H*D] (rows may be strided) -> [q, H*D] in ``dtype``."""
    nodes, heads, head_dim = out.shape
    result = torch.empty(nodes, heads * head_dim, dtype=dtype, device=out.device)
    _gated_norm_kernel[(nodes, heads)](out, z, weight, result, z.stride(0), eps, HEADS=heads, D=head_dim, num_warps=1)
    return result


@triton.jit
def _chain_state_kernel(K, V, G, BETA, S, count: tl.constexpr, HEADS: tl.constexpr, REPEAT: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """Program (value head h, block of value columns): the recurrent delta rule over ``count`` tokens with
    the state block [DK, BV] in registers, read once and written back in place. (``count`` is a
    compile-time constant: a commit's path length, one variant per length, as the commit graphs are.)"""
    h = tl.program_id(0)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    d = tl.arange(0, DK)
    hk = h // REPEAT
    block = S + h * DK * DV + d[:, None] * DV + cols[None, :]
    state = tl.load(block)
    for t in range(count):
        key = tl.load(K + (hk * count + t) * DK + d)
        value = tl.load(V + (h * count + t) * DV + cols)
        state = state * tl.exp(tl.load(G + t * HEADS + h))
        delta = tl.load(BETA + t * HEADS + h).to(tl.float32) * (value - tl.sum(state * key[:, None], axis=0))
        state += key[:, None] * delta[None, :]
    tl.store(block, state)


def advance_state(k_: torch.Tensor, v_: torch.Tensor, log_gate: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> None:
    """state [H, dk, dv] float32 advanced in place over a chain: k_ [Hk, c, dk] (normalised), v_ [H, c, dv],
    log_gate / beta [c, H] (the sequential kernel's arithmetic: what a commit needs)."""
    key_heads, count, dk = k_.shape
    heads, _, dv = v_.shape
    block = min(dv, 32)
    _chain_state_kernel[(heads, dv // block)](
        k_, v_, log_gate.float().contiguous(), beta.contiguous(), state, count,
        HEADS=heads, REPEAT=heads // key_heads, DK=dk, DV=dv, BV=block, num_warps=4,
    )
