"""The hybrids' decoder layers (Qwen3.5 / Qwen3.6 / Qwen3-Next) in few, larger kernels.

What ``FusedLayer`` does for plain Qwen3 layers, for the two layer kinds of a hybrid:

    gated attention (``full_attention``), the whole layer:
        heads = [q | gate per query head, k, v] = qkv_proj(n)          n = norm(x), one matrix
        x = x + o_proj(attention(rope_r(norm_q(q)), rope_r(norm_k(k)), v) * sigmoid(gate))
    GDN (``linear_attention``), around the token mixer ``GDNLayer`` runs:
        x = x + mixer(norm(x))
    and in both, the MLP:
        x = x + down_proj(silu(gate_proj(m)) * up_proj(m))             m = norm(x), gate/up one matrix

Every norm here is Qwen3.5's RMSNorm: in float32, x * rsqrt(mean(x^2) + eps) * (1 + weight), then
rounded to the model dtype once; on CUDA that is one Triton kernel (``one_plus_rms_norm``), on CPU
the same arithmetic in torch. ``rope_r`` rotates only the first r = cos.shape[-1] dims of each head
(``partial_rotary_factor``). The residual sums happen in the output projections' matrix products
(``add_projection_``: the residual stream updated in place by the product's epilogue), and K and V go
to the cache with one copy. A layer updates the hidden state it is given in place and returns it.

As in ``FusedLayer``, the fused matrices are built once per layer and the model's own ``q_proj.weight``
(etc.) become views into them, so no weight is stored twice and transformers' forward still reads
the same values. Head counts come from the weights' shapes (a tensor-parallel shard has fewer heads
than the config says). Qwen3-Next's MoE MLPs keep transformers' module (only the norms around them
are fused).

Tensor parallelism: every layer object takes ``reduce`` (None: one process), applied to each
row-parallel partial output (o_proj, down_proj) before its residual add; without it the add stays
in the matrix product's epilogue.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from workers.models.attention import attend_folded
from workers.models.fused_layer import PassInputs, add_projection_, fuse_rows, norm_linear, one_plus_rms_norm
from workers.models.kernels import triton_available

# transformers' RMSNorm classes computing (1 + weight) * (x * rsqrt(mean(x^2) + eps)) in float32
ONE_PLUS_NORMS = frozenset({"Qwen3_5RMSNorm", "Qwen3_5TextRMSNorm", "Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm"})

Reduce = Callable[[torch.Tensor], torch.Tensor]





def _is_one_plus(norm: nn.Module) -> bool:
    return type(norm).__name__ in ONE_PLUS_NORMS and hasattr(norm, "eps")


class HybridMLP:
    """The second half of every hybrid layer: x + mlp(post_attention_layernorm(x)).

    A dense MLP (gate_proj, up_proj, down_proj, SiLU) runs as two matrix products, gate/up fused; an
    MoE block (Qwen3-Next) stays transformers' module.
    """

    def __init__(self, layer: nn.Module, reduce: Reduce | None = None) -> None:
        mlp = layer.mlp
        self.post_norm, self.mlp, self.reduce = layer.post_attention_layernorm, mlp, reduce
        self.gate_up_weight = None
        if self.dense(mlp):
            self.down_proj = mlp.down_proj
            with torch.inference_mode(False), torch.no_grad():  # (this order: inference_mode(False) enables grad)
                self.gate_up_weight = fuse_rows((mlp.gate_proj, mlp.up_proj), "weight")  # [2I, H]

    @staticmethod
    def dense(mlp: nn.Module) -> bool:
        return (all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
                and all(getattr(mlp, n).bias is None for n in ("gate_proj", "up_proj", "down_proj"))
                and getattr(getattr(mlp, "config", None), "hidden_act", None) == "silu")

    def is_current(self) -> bool:
        return self.gate_up_weight is None or self.mlp.gate_proj.weight.data_ptr() == self.gate_up_weight.data_ptr()

    def __call__(self, residual: torch.Tensor) -> torch.Tensor:
        """residual [q, H] -> residual, updated in place."""
        if self.gate_up_weight is None:  # MoE: the module (its router is data-dependent)
            out = self.mlp(one_plus_rms_norm(residual, self.post_norm)[None])
            out = out[0] if isinstance(out, tuple) else out
            return residual.add_(out[0] if self.reduce is None else self.reduce(out[0]))
        activated = norm_linear(residual, self.post_norm, self.gate_up_weight, silu=True, one_plus=True)  # [q, I]
        return add_projection_(residual, activated, self.down_proj, self.reduce)


class HybridGDNLayer:
    """The norms and MLP around a GDN layer's token mixer, which adds the residual itself
    (``GDNLayer``'s ``residual``: the sum in out_proj's epilogue); the runner calls

        hidden = layer.finish_summed(mixer(hidden, residual=hidden, input_norm=layer.input_norm))

    (``norm`` is that input norm alone, for a mixer that does not take it.)
    """

    def __init__(self, layer: nn.Module, reduce: Reduce | None = None) -> None:
        self.input_norm = layer.input_layernorm
        self.mlp = HybridMLP(layer, reduce)

    @staticmethod
    def supports(layer: nn.Module) -> bool:
        return (hasattr(layer, "linear_attn") and hasattr(layer, "mlp")
                and _is_one_plus(layer.input_layernorm) and _is_one_plus(layer.post_attention_layernorm))

    def is_current(self, layer: nn.Module) -> bool:
        return self.mlp.is_current()

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1, q, H] -> the mixer's input [1, q, H]."""
        return one_plus_rms_norm(hidden, self.input_norm)

    def finish_summed(self, summed: torch.Tensor) -> torch.Tensor:
        """summed [1, q, H] (hidden + the mixer's output, the mixer's out_proj having added them) -> the
        layer's output: summed, updated in place."""
        self.mlp(summed[0])
        return summed


class GatedAttentionLayer:
    """A whole gated-attention decoder layer; see the module docstring. Called like ``FusedLayer``."""

    def __init__(self, layer: nn.Module, reduce: Reduce | None = None) -> None:
        attn = layer.self_attn
        self.attn, self.reduce = attn, reduce
        self.head_dim = d = attn.q_norm.weight.shape[0]
        self.query_heads = attn.q_proj.weight.shape[0] // (2 * d)  # q_proj emits [query D | gate D] per head
        self.kv_heads = attn.k_proj.weight.shape[0] // d
        self.scale = attn.scaling
        self.input_norm, self.o_proj = layer.input_layernorm, attn.o_proj
        self.mlp = HybridMLP(layer, reduce)
        with torch.inference_mode(False), torch.no_grad():
            # [2*Hq*D + 2*Hkv*D, H]: rows [q_0, gate_0, q_1, gate_1, ..., k heads, v heads], each head D rows
            self.qkv_weight = fuse_rows((attn.q_proj, attn.k_proj, attn.v_proj), "weight")
            self.qkv_bias = fuse_rows((attn.q_proj, attn.k_proj, attn.v_proj), "bias")

    @staticmethod
    def supports(layer: nn.Module) -> bool:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(layer, "mlp"):
            return False
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")):
            return False
        d = attn.q_norm.weight.shape[0]
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
        return (attn.q_proj.weight.shape[0] == 2 * d * (attn.o_proj.weight.shape[1] // d)  # query + gate per head
                and attn.k_proj.weight.shape == attn.v_proj.weight.shape
                and all(_is_one_plus(norm) for norm in norms))

    def is_current(self, layer: nn.Module) -> bool:
        return self.attn.q_proj.weight.data_ptr() == self.qkv_weight.data_ptr() and self.mlp.is_current()

    def __call__(self, hidden: torch.Tensor, inputs: PassInputs, kv: torch.Tensor, attend: int) -> torch.Tensor:
        """hidden [1, q, H] -> hidden, updated in place; writes this pass's K/V into kv [2, 1, Hkv, C, D] at
        inputs.slots."""
        q, hq, hkv, d = hidden.shape[1], self.query_heads, self.kv_heads, self.head_dim
        residual = hidden[0]  # [q, H]
        heads = norm_linear(residual, self.input_norm, self.qkv_weight, self.qkv_bias, one_plus=True)
        heads = heads.view(q, 2 * hq + 2 * hkv, d)
        args = (heads, self.attn.q_norm, self.attn.k_norm, inputs, kv, hq, hkv)
        folded = norm_rotate_heads(*args) if heads.is_cuda and triton_available() else norm_rotate_heads_torch(*args)
        out = attend_folded(folded, kv[0, 0, :, :attend], kv[1, 0, :, :attend], inputs.mask, self.scale,
                            slots=inputs.slots, nodes=q, ends=inputs.ends)  # [q, Hq*D]
        add_projection_(residual, output_gate(out, heads, hq), self.o_proj, self.reduce)
        self.mlp(residual)
        return hidden


def output_gate(out: torch.Tensor, heads: torch.Tensor, query_heads: int) -> torch.Tensor:
    """The attention's output out [q, Hq*D] times the sigmoid of each query head's gate (the odd rows
    of heads [q, 2Hq + 2Hkv, D]) -> [q, Hq*D], as o_proj reads it; one Triton kernel on CUDA."""
    if out.is_cuda and triton_available():
        from workers.models.fused_hybrid_triton import output_gate as kernel

        return kernel(out, heads, query_heads)
    q, d = heads.shape[0], heads.shape[-1]
    # sigmoid's output is contiguous [q, Hq, D], and the product lands in it
    gated = torch.sigmoid(heads[:, : 2 * query_heads].view(q, query_heads, 2, d)[:, :, 1])
    return gated.mul_(out.view(q, query_heads, d)).view(q, query_heads * d)


def norm_rotate_heads(heads: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module, inputs: PassInputs,
                      kv: torch.Tensor, query_heads: int, kv_heads: int) -> torch.Tensor:
    """``norm_rotate_heads_torch`` as one Triton kernel (CUDA)."""
    from workers.models.fused_hybrid_triton import norm_rotate_heads as kernel

    return kernel(heads, q_norm.weight, k_norm.weight, q_norm.eps, inputs.cos, inputs.sin_signed, inputs.slots, kv,
                  query_heads, kv_heads)


def norm_rotate_heads_torch(heads: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module, inputs: PassInputs,
                            kv: torch.Tensor, query_heads: int, kv_heads: int) -> torch.Tensor:
    """The attention's inputs from the projection's output heads [q, 2Hq + 2Hkv, D] (rows per node:
    query 0, gate 0, ..., key heads, value heads): queries and keys normalised (``1 + weight``) and
    rotated on their first r = cos.shape[-1] dims; K and V written into kv [2, 1, Hkv, C, D] at
    ``inputs.slots``. Returns the queries folded per K/V head [Hkv, g*q, D] (``attend_folded``'s rows)."""
    q, _, d = heads.shape
    hq, hkv, rotary = query_heads, kv_heads, inputs.cos.shape[-1]
    # [q, Hq + 2 Hkv, D]: queries, keys, values contiguous (one copy); q/k normalised and rotated in place
    qkv = torch.cat((heads[:, : 2 * hq].view(q, hq, 2, d)[:, :, 0], heads[:, 2 * hq :]), dim=1)
    query_key = qkv[:, : hq + hkv]
    normed = torch.cat((one_plus_rms_norm(query_key[:, :hq], q_norm), one_plus_rms_norm(query_key[:, hq:], k_norm)),
                       dim=1)
    turning = normed[..., :rotary]
    swapped = turning.unflatten(-1, (2, rotary // 2)).flip(-2).flatten(-2)
    torch.addcmul(turning * inputs.cos, swapped, inputs.sin_signed, out=query_key[..., :rotary])
    if rotary < d:
        query_key[..., rotary:] = normed[..., rotary:]
    kv[:, 0].index_copy_(2, inputs.slots, qkv[:, hq:].view(q, 2, hkv, d).permute(1, 2, 0, 3))
    # fold each K/V head's query heads into rows: [Hkv, g*q, D], row r*q + t = head kv*g + r, node t
    return qkv[:, :hq].transpose(0, 1).reshape(hkv, (hq // hkv) * q, d)


def fused_hybrid_layer_for(layer: nn.Module, reduce: Reduce | None = None):
    """The layer's ``GatedAttentionLayer`` or ``HybridGDNLayer`` (made once and kept on the layer:
    its weights are views), or None for a layer of another shape.

    Made again if the model's weights stopped being views of it (the model was moved or cast since),
    or for another ``reduce``.
    """
    existing = getattr(layer, "_fused_hybrid", None)
    if existing is not None and existing.is_current(layer) and existing.mlp.reduce is reduce:
        return existing
    if GatedAttentionLayer.supports(layer):
        fused = GatedAttentionLayer(layer, reduce)
    elif HybridGDNLayer.supports(layer):
        fused = HybridGDNLayer(layer, reduce)
    else:
        return None
    layer._fused_hybrid = fused  # a plain attribute (not a submodule): no second state_dict entry
    return fused
