"""The per-node path solve of ``workers.models.deltanet.tree_delta_rule`` as one Triton kernel (CUDA only).

One program per (node, key head, block of value columns): it gathers the keys of the node's <= P
ancestors into registers, forms their [P, P] Gram matrix and the node's query products, then, for
each value head that shares this key head, runs the P-step forward substitution on scalars and
sums P gathered rows of r. Nothing is written but the outputs; the torch form in ``deltanet`` is the
reference it is tested against (``tests/workers/models/test_graphs.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_path_kernel(
    Q, K, R, QS, G, BETA, ANC, OUT, nodes,
    HEADS: tl.constexpr, REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, P: tl.constexpr,
    BV: tl.constexpr,
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
        for n in tl.static_range(1, P):  # w_n = e_n - sum_{m<n} w_m U[m, n]
            column = tl.sum(tl.where(m[None, :] == n, U, 0.0), axis=1)
            w = tl.where(m == n, w - tl.sum(w * column), w)
        rows = tl.load(R + (h * nodes + row[:, None]) * DV + cols[None, :], mask=valid[:, None], other=0.0)
        out = tl.exp(g_t) * tl.load(QS + (h * nodes + t) * DV + cols) + tl.sum(w[:, None] * rows, axis=0)
        tl.store(OUT + (t * HEADS + h) * DV + cols, out)


def tree_path_outputs(
    q_: torch.Tensor,  # [H, q, dk] float32 (rows repeated per value head)
    k_: torch.Tensor,  # [Hk, q, dk] float32, one row per key head
    rhs: torch.Tensor,  # [H, q, dv] r
    q_S0: torch.Tensor,  # [H, q, dv]
    G: torch.Tensor,  # [H, q] path sums of the log decay
    beta: torch.Tensor,  # [H, q]
    ancestors: torch.Tensor,  # [q, P] (P a power of two >= 16)
) -> torch.Tensor:
    """Outputs [q, H, dv] float32, as ``deltanet._path_outputs`` computes them."""
    heads, nodes, dv = rhs.shape
    key_heads, _, dk = k_.shape
    repeat = heads // key_heads
    P = ancestors.shape[1]
    out = torch.empty(nodes, heads, dv, dtype=torch.float32, device=rhs.device)
    block = min(dv, 64)
    grid = (nodes, key_heads, dv // block)
    _tree_path_kernel[grid](
        q_[::repeat].contiguous(), k_.contiguous(), rhs.contiguous(), q_S0.contiguous(), G.contiguous(),
        beta.contiguous(), ancestors.contiguous(), out, nodes,
        HEADS=heads, REPEAT=repeat, DK=dk, DV=dv, P=P, BV=block, num_warps=4,
    )
    return out
