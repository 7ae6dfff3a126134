"""The decoder layers' small per-token work as Triton kernels (CUDA only; ``fused_hybrid`` and
``fused_layer`` have the torch forms). Both the hybrids' layers and plain attention layers use them.

``rms_norm``: an RMSNorm row in one program (transformers computes it as six to nine small kernels:
cast, square, mean, add, rsqrt, two products, cast back), reduced in float32 and stored rounded to
the model dtype once; Qwen3.5's ``1 + weight`` form or the plain ``weight`` form.
``norm_rotate_heads``: an attention layer's q/k norms, rotary, K/V cache write and query fold in one
kernel, for the gated layout (a gate row after each query head) and the plain one.
``output_gate``: the attention output times the sigmoid of its gate, in the layout o_proj reads.
``silu_mul``: the MLP's activation. Tested against the torch forms in
``tests/workers/models/test_fused_hybrid.py`` and ``test_fused_layer.py`` (GPU-marked) and through
Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.models.pdl_triton import launch_options, wait_for_inputs

# the norms a kernel applies (constexpr switches)
NO_NORM, PLAIN_NORM, ONE_PLUS_NORM = 0, 1, 2


@triton.jit
def _rms_norm_kernel(X, W, OUT, stride_a, stride_b, inner, n, eps, ONE_PLUS: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)  # row = a * inner + b of the [outer, inner, n] input
    a = row // inner
    b = row % inner
    cols = tl.arange(0, BLOCK)
    valid = cols < n
    x = tl.load(X + a * stride_a + b * stride_b + cols, mask=valid, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=valid, other=0.0).to(tl.float32)
    if ONE_PLUS:
        w = 1.0 + w
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps) * w
    tl.store(OUT + row * n + cols, y.to(OUT.dtype.element_ty), mask=valid)


def one_plus_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's norm, x * rsqrt(mean(x^2) + eps) * (1 + weight): x [..., N] (rows contiguous, leading
    dims any strides of a 2- or 3-D view) -> contiguous, x's dtype."""
    return _rms_norm(x, weight, eps, one_plus=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain norm, x * rsqrt(mean(x^2) + eps) * weight, rounded once (as ``F.rms_norm``); as above."""
    return _rms_norm(x, weight, eps, one_plus=False)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    n = x.shape[-1]
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.contiguous()
    view = x if x.dim() == 3 else x.reshape(1, -1, n)  # [outer, inner, N]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = view.shape[0] * view.shape[1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](view, weight, out, view.stride(0), view.stride(1), view.shape[1], n, eps,
                              ONE_PLUS=one_plus, BLOCK=block, num_warps=min(16, max(1, block // 512)),
                              **launch_options(x.device))
    return out


@triton.jit
def _heads_kernel(
    HEADS, QW, KW, COS, SIN, SLOTS, FOLDED, KV,
    stride_token, stride_cos, stride_kv, stride_head, stride_slot, nodes, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr,
    HB: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):
    """Program (node t, block of HB heads j: 0..HQ-1 query heads, then HKV key heads, then HKV value
    heads), each head a row of the [HB, BLOCK] tile."""
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    j = tl.program_id(1) * HB + tl.arange(0, HB)
    in_heads = j < HQ + 2 * HKV
    is_q = j < HQ
    is_v = j >= HQ + HKV
    # heads rows per node, gated: [q_0, gate_0, ..., q_{HQ-1}, gate_{HQ-1}, k_0.., v_0..]; plain: [q_0.., k_0.., v_0..]
    if GATED:
        row = tl.where(is_q, 2 * j, HQ + j)
    else:
        row = j
    src = HEADS + t * stride_token + row[:, None] * D
    cols = tl.arange(0, BLOCK)
    half = R // 2
    partner = tl.where(cols < half, cols + half, tl.where(cols < R, cols - half, cols))  # rotate_half's source
    valid = in_heads[:, None] & (cols < D)[None, :]
    x = tl.load(src + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    x_partner = tl.load(src + partner[None, :], mask=valid, other=0.0).to(tl.float32)
    # the norm's output is rounded to the model dtype before the rotary, as transformers' module returns it
    if NORM != 0:
        in_cols = cols < D
        w = tl.where(is_q[:, None], tl.load(QW + cols, mask=in_cols, other=0.0)[None, :],
                     tl.load(KW + cols, mask=in_cols, other=0.0)[None, :]).to(tl.float32)
        w_partner = tl.where(is_q[:, None], tl.load(QW + partner, mask=in_cols, other=0.0)[None, :],
                             tl.load(KW + partner, mask=in_cols, other=0.0)[None, :]).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    if NORM == 2:  # 1 + weight, in float32
        y = (x * inv * (1.0 + w)).to(HEADS.dtype.element_ty).to(tl.float32)
        y_partner = (x_partner * inv * (1.0 + w_partner)).to(HEADS.dtype.element_ty).to(tl.float32)
    elif NORM == 1:  # weight times the rounded normalised row, rounded (as F.rms_norm(x) * weight)
        y = ((x * inv).to(HEADS.dtype.element_ty).to(tl.float32) * w).to(HEADS.dtype.element_ty).to(tl.float32)
        y_partner = (x_partner * inv).to(HEADS.dtype.element_ty).to(tl.float32) * w_partner
        y_partner = y_partner.to(HEADS.dtype.element_ty).to(tl.float32)
    else:
        y = x
        y_partner = x_partner
    turning = cols < R
    cos = tl.load(COS + t * stride_cos + cols, mask=turning, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(SIN + t * stride_cos + cols, mask=turning, other=0.0).to(tl.float32)[None, :]  # first half negated
    out = tl.where(is_v[:, None], x, y * cos + y_partner * sin).to(FOLDED.dtype.element_ty)
    # queries to the folded rows [HKV, g*q, D]: row r*q + t of K/V head j // g is query head j = kv*g + r
    if HQ > 0:  # none where only K and V are written (a drafter's context written ahead)
        groups = HQ // HKV
        folded_row = (j // groups) * groups * nodes + (j % groups) * nodes + t
        tl.store(FOLDED + folded_row[:, None] * D + cols[None, :], out, mask=valid & is_q[:, None])
    slot = tl.load(SLOTS + t)
    head = tl.where(is_v, j - HQ - HKV, j - HQ)
    target = KV + is_v.to(tl.int64) * stride_kv + head * stride_head + slot * stride_slot
    tl.store(target[:, None] + cols[None, :], out, mask=valid & (j >= HQ)[:, None])


# heads per program of the heads kernel: a few hundred nodes x 48 heads as one-warp programs were
# thousands of launches' worth of block scheduling (``benchmarks/gpu_speed.py --profile``)
HEADS_PER_PROGRAM = 8


def norm_rotate_heads(heads: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                      cos: torch.Tensor, sin_signed: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
                      query_heads: int, kv_heads: int, gated: bool = True, norm: int = ONE_PLUS_NORM) -> torch.Tensor:
    """``fused_hybrid.norm_rotate_heads_torch`` (gated; ``norm`` ONE_PLUS_NORM) or the plain layer's
    ``fused_layer.norm_rotate_heads_torch`` (``norm`` PLAIN_NORM, or NO_NORM with no weights) in one
    kernel: heads [q, 2Hq + 2Hkv, D] (gated) or [q, Hq + 2Hkv, D] -> folded queries [Hkv, g*q, D]; K
    and V written into kv [2, 1, Hkv, C, D] at slots [q]. ``query_heads`` 0: K and V alone (no folded rows)."""
    if norm == NO_NORM:  # no weights read: any pointer will do
        q_weight = k_weight = heads
    q, _, d = heads.shape
    rotary = cos.shape[-1]
    folded = torch.empty(kv_heads, (query_heads // kv_heads) * q, d, dtype=heads.dtype, device=heads.device)
    block = triton.next_power_of_2(d)
    _heads_kernel[(q, triton.cdiv(query_heads + 2 * kv_heads, HEADS_PER_PROGRAM))](
        heads, q_weight, k_weight, cos, sin_signed, slots, folded, kv,
        heads.stride(0), cos.stride(0), kv.stride(0), kv.stride(2), kv.stride(3), q, eps,
        HQ=query_heads, HKV=kv_heads, D=d, R=rotary, BLOCK=block, HB=HEADS_PER_PROGRAM,
        GATED=gated, NORM=norm, num_warps=4 if block <= 128 else 8, **launch_options(heads.device),
    )
    return folded


@triton.jit
def _silu_mul_kernel(GATE_UP, OUT, inner, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < inner
    gate = tl.load(GATE_UP + row * 2 * inner + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + row * 2 * inner + inner + cols, mask=valid, other=0.0)
    # rounded as torch's F.silu(gate) * up: the SiLU to the model dtype, then the product
    activated = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(OUT + row * inner + cols, (activated.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=valid)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [q, 2I] (contiguous: gate columns, then up) -> silu(gate) * up [q, I], one kernel."""
    gate_up = gate_up.contiguous()
    q, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(q, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(q, triton.cdiv(inner, block))](gate_up, out, inner, BLOCK=block, num_warps=4,
                                                     **launch_options(out.device))
    return out


@triton.jit
def _output_gate_kernel(OUT, HEADS, GATED, stride_token, HQ: tl.constexpr, D: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    t = tl.program_id(0)  # node: all its query heads
    h = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    valid = (h < HQ)[:, None] & (cols < D)[None, :]
    out = tl.load(OUT + t * HQ * D + h[:, None] * D + cols[None, :], mask=valid, other=0.0)
    gate = tl.load(HEADS + t * stride_token + (2 * h[:, None] + 1) * D + cols[None, :], mask=valid,
                   other=0.0).to(tl.float32)
    # rounded as torch's sigmoid(gate) * out: the sigmoid to the model dtype, then the product
    opened = (1.0 / (1.0 + tl.exp(-gate))).to(out.dtype).to(tl.float32)
    tl.store(GATED + t * HQ * D + h[:, None] * D + cols[None, :], (opened * out.to(tl.float32)).to(out.dtype),
             mask=valid)


def output_gate(out: torch.Tensor, heads: torch.Tensor, query_heads: int) -> torch.Tensor:
    """out [q, Hq*D] (the attention's output, each node's query heads side by side) and heads
    [q, 2Hq + 2Hkv, D] (the projection's rows per node: query 0, gate 0, query 1, gate 1, ...) ->
    sigmoid(gate) * out as [q, Hq*D], one kernel."""
    q, d = heads.shape[0], heads.shape[-1]
    out = out.contiguous()
    gated = torch.empty(q, query_heads * d, dtype=out.dtype, device=out.device)
    _output_gate_kernel[(q,)](out, heads, gated, heads.stride(0), HQ=query_heads, D=d,
                              BLOCK_H=triton.next_power_of_2(query_heads), BLOCK_D=triton.next_power_of_2(d),
                              num_warps=4, **launch_options(out.device))
    return gated
