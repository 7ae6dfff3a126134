"""A plain attention decoder layer (Qwen3 / Qwen2 / Llama / Mistral) in few, larger kernels.

At batch 1 a verify pass reads every weight once and does little arithmetic, so its time is the
weight reads plus one launch per kernel: transformers' layer issues ~64 kernels (six per RMSNorm,
ten for the rotary, five projections), most of them a few microseconds of nothing. This layer runs
the same arithmetic as

    x = x + o_proj(attention(rope(norm_qk(q_proj(n))), rope(norm_qk(k_proj(n))), v_proj(n)))   n = norm(x)
    x = x + down_proj(silu(gate_proj(m)) * up_proj(m))                                           m = norm(x)

in about ten kernels: q/k/v projections as one matrix and gate/up as one (larger matrices also
stream closer to full memory bandwidth: ``benchmarks/projection_gemms.py``), the residual sums inside
the output projections' matrix products, and the attention of a few rows as two batched matrix
products (cheaper than a fused SDPA kernel for so few rows: ``benchmarks/attention_kernels.py``). On
CUDA, the small work is ``fused_hybrid_triton``'s kernels, shared with the hybrids' layers: each
RMSNorm one kernel; q and k normalised and rotated, K and V written to the cache and the queries
folded in one; the SiLU and product one. Elsewhere the same arithmetic in torch (``*_torch``).

The fused matrices are built once per layer and the model's own ``q_proj.weight`` (etc.) become
views into them, so no weight is stored twice and transformers' forward still sees the same values.
Layers of any other shape (gated or partial-rotary attention, MoE) keep transformers' modules.

Under tensor parallelism (``workers.models.tensor_parallel``) the layer holds this rank's heads and
MLP columns: head counts come from the (sharded) weight shapes, and ``reduce`` (an all-reduce) sums
the partial outputs of o_proj and down_proj over the ranks before the residual is added.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.attention import attend_folded
from workers.models.kernels import triton_available

# transformers' RMSNorm classes computing weight * (x * rsqrt(mean(x^2) + eps)) (not 1 + weight)
PLAIN_NORMS = frozenset({"Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm"})


# passes of fewer nodes fill few blocks of the attention kernel's rows, whose furthest key is the pass's last
ENDS_FROM_NODES = 64


@dataclass
class PassInputs:
    """What every fused layer of one pass shares, built once per pass.

    cos, sin_signed: [q, 1, D]   rotary tables; sin_signed = sin with its first half negated, so that
                                 rope(x) = x * cos + swap_halves(x) * sin_signed
    slots:           [q]         K/V buffer slots this pass writes
    mask:            [g*q, C]    additive mask per folded query row (row r*q + t is node t); None in a
                                 pass that attends nothing (a drafter's context written ahead)
    ends:            [q] or None one past the last K/V slot nodes 0..t see (``visible_ends``); the
                                 attention kernel stops each block of rows at its last node's (a
                                 prompt chunk's causal triangle is not read)
    """

    cos: torch.Tensor
    sin_signed: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None
    ends: torch.Tensor | None = None

    @classmethod
    def build(cls, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, groups: int,
              visible: torch.Tensor | None = None):
        """cos/sin [1, q, D] as transformers' rotary gives them; mask additive [q, C] or None; ``visible`` [q, q]:
        which of the pass's nodes each node sees (gives ``ends``)."""
        half = sin.shape[-1] // 2
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        ends = None if visible is None or visible.shape[0] < ENDS_FROM_NODES else visible_ends(visible, slots)
        folded_mask = None if mask is None else mask.repeat(groups, 1)
        return cls(cos[0].unsqueeze(1), sin_signed[0].unsqueeze(1), slots, folded_mask, ends)

    def to(self, device: torch.device) -> PassInputs:
        return PassInputs(*(None if t is None else t.to(device)
                            for t in (self.cos, self.sin_signed, self.slots, self.mask, self.ends)))


def visible_ends(visible: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """visible [q, q] (node t sees node j), slots [q] increasing -> [q] int32: one past the slot of the
    last node that nodes 0..t see, each itself at least (a running maximum, so a block of consecutive
    nodes finds its bound at its last node, one load). A tree's nodes see only their ancestors, which
    come first, so this is each node's own slot + 1; computed rather than assumed, it holds for any
    visibility."""
    nodes = torch.arange(visible.shape[0], device=visible.device)
    furthest = torch.where(visible, nodes, nodes[:, None]).amax(dim=1)  # itself when it sees nothing later
    return (slots[furthest.cummax(dim=0).values] + 1).to(torch.int32)


class FusedLayer:
    """One decoder layer's weights regrouped for few kernels; see the module docstring."""

    def __init__(self, layer: nn.Module, config, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.head_dim = attn.head_dim
        # this process's heads (all of them, or one rank's share of a tensor-parallel model)
        self.query_heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.reduce = reduce  # sums row-parallel partial outputs over ranks; None: one process
        self.scale = attn.scaling
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.o_proj, self.down_proj = attn.o_proj, mlp.down_proj
        with torch.inference_mode(False), torch.no_grad():  # (this order: inference_mode(False) enables grad)
            self.qkv_weight = fuse_rows((attn.q_proj, attn.k_proj, attn.v_proj), "weight")
            self.qkv_bias = fuse_rows((attn.q_proj, attn.k_proj, attn.v_proj), "bias")
            self.gate_up_weight = fuse_rows((mlp.gate_proj, mlp.up_proj), "weight")
            self.q_norm = self.k_norm = None  # Qwen3: RMSNorm over each head's D before the rotary
            if hasattr(attn, "q_norm"):
                self.q_norm, self.k_norm = attn.q_norm, attn.k_norm

    @staticmethod
    def supports(layer: nn.Module, config) -> bool:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return False
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if hasattr(attn, "q_norm"):
            norms += [attn.q_norm, attn.k_norm]
        # no output gate folded into q_proj: query rows per K/V row as the config's heads (sharding keeps the ratio)
        q_rows, kv_rows = attn.q_proj.out_features, attn.k_proj.out_features
        return (
            q_rows * config.num_key_value_heads == kv_rows * config.num_attention_heads
            and getattr(config, "partial_rotary_factor", 1.0) == 1.0
            and all(type(norm).__name__ in PLAIN_NORMS for norm in norms)
            and getattr(config, "hidden_act", None) == "silu"
            and all(m.bias is None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        )

    def is_current(self, layer: nn.Module) -> bool:
        """Whether the layer's own weights are still views of this object's fused matrices."""
        return (layer.self_attn.q_proj.weight.data_ptr() == self.qkv_weight.data_ptr()
                and layer.mlp.gate_proj.weight.data_ptr() == self.gate_up_weight.data_ptr())

    def __call__(self, hidden: torch.Tensor, inputs: PassInputs, kv: torch.Tensor, attend: int) -> torch.Tensor:
        """hidden [1, q, H] -> hidden, updated in place; writes this pass's K/V into kv [2, 1, Hkv, C, D] at
        inputs.slots."""
        q, hq, hkv, d = hidden.shape[1], self.query_heads, self.kv_heads, self.head_dim
        residual = hidden[0]  # [q, H]
        heads = norm_linear(residual, self.input_norm, self.qkv_weight, self.qkv_bias).view(q, hq + 2 * hkv, d)
        args = (heads, self.q_norm, self.k_norm, inputs, kv, hq, hkv)
        folded = norm_rotate_heads(*args) if heads.is_cuda and triton_available() else norm_rotate_heads_torch(*args)
        out = attend_folded(folded, kv[0, 0, :, :attend], kv[1, 0, :, :attend], inputs.mask, self.scale,
                            slots=inputs.slots, nodes=q, ends=inputs.ends)  # [q, Hq*D]
        add_projection_(residual, out, self.o_proj, self.reduce)
        activated = norm_linear(residual, self.post_norm, self.gate_up_weight, silu=True)
        add_projection_(residual, activated, self.down_proj, self.reduce)
        return hidden


def norm_rotate_heads_torch(heads: torch.Tensor, q_norm: nn.Module | None, k_norm: nn.Module | None,
                            inputs: PassInputs, kv: torch.Tensor, query_heads: int, kv_heads: int) -> torch.Tensor:
    """The attention's inputs from the projection's output heads [q, Hq + 2Hkv, D] (query heads, key
    heads, value heads): queries and keys normalised (when the layer has q/k norms) and rotated; K and
    V written into kv [2, 1, Hkv, C, D] at ``inputs.slots``. Returns the queries folded per K/V head
    [Hkv, g*q, D] (``attend_folded``'s rows)."""
    q, _, d = heads.shape
    hq, hkv = query_heads, kv_heads
    query_key = heads[:, : hq + hkv]
    if q_norm is not None:
        query_key = torch.cat((F.rms_norm(query_key[:, :hq], (d,), eps=q_norm.variance_epsilon) * q_norm.weight,
                               F.rms_norm(query_key[:, hq:], (d,), eps=k_norm.variance_epsilon) * k_norm.weight), 1)
    swapped = query_key.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)
    # rotated q and k overwrite their rows of ``heads``, so K and V then go to the cache in one copy
    torch.addcmul(query_key * inputs.cos, swapped, inputs.sin_signed, out=heads[:, : hq + hkv])
    kv[:, 0].index_copy_(2, inputs.slots, heads[:, hq:].view(q, 2, hkv, d).permute(1, 2, 0, 3))
    # fold each K/V head's query heads into rows: [Hkv, g*q, D], row r*q + t = head kv*g + r, node t
    return heads[:, :hq].transpose(0, 1).reshape(hkv, (hq // hkv) * q, d)


def norm_rotate_heads(heads: torch.Tensor, q_norm: nn.Module | None, k_norm: nn.Module | None,
                      inputs: PassInputs, kv: torch.Tensor, query_heads: int, kv_heads: int) -> torch.Tensor:
    """``norm_rotate_heads_torch`` as one Triton kernel (CUDA)."""
    from workers.models import fused_hybrid_triton as kernels

    if q_norm is None:
        weights, eps, norm = (None, None), 0.0, kernels.NO_NORM
    else:
        weights, eps, norm = (q_norm.weight, k_norm.weight), q_norm.variance_epsilon, kernels.PLAIN_NORM
    return kernels.norm_rotate_heads(heads, *weights, eps, inputs.cos, inputs.sin_signed, inputs.slots, kv,
                                     query_heads, kv_heads, gated=False, norm=norm)


def rms_norm(hidden: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """A plain RMSNorm (``weight * normalised``, rounded once) of hidden's rows: one kernel on CUDA."""
    if hidden.is_cuda and triton_available():
        from workers.models.fused_hybrid_triton import rms_norm as kernel

        return kernel(hidden, norm.weight, norm.variance_epsilon)
    return F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)


def one_plus_rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """Qwen3.5's RMSNorm of the rows of x [..., N] with ``norm``'s weight [N] (and eps), in x's dtype."""
    if x.is_cuda and triton_available():
        from workers.models.fused_hybrid_triton import one_plus_rms_norm as kernel

        return kernel(x, norm.weight, norm.eps)
    normed = F.rms_norm(x.float(), norm.weight.shape, eps=norm.eps)
    return (normed * (1.0 + norm.weight.float())).to(x.dtype)


def norm_linear(x: torch.Tensor, norm: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu: bool = False, one_plus: bool = False) -> torch.Tensor:
    """linear(norm(x), weight, bias) for x [q, H]; ``silu``: weight is [2I, H] (gate rows, then up) and the
    result silu(gate) * up [q, I]. ``norm``: a plain RMSNorm, or Qwen3.5's (``one_plus``). On CUDA: the
    norm kernel, the product and the activation kernel; one row: the norm inside ``skinny_triton``'s
    product (where it takes the product, as in ``product``), not rounded between the two."""
    if x.shape[0] == 1 and (kernel := triton_product(x, weight, bias)) is not None:
        eps = norm.eps if one_plus else norm.variance_epsilon
        out = kernel(x, weight, norm=(norm.weight, eps, one_plus))
    else:
        out = product(one_plus_rms_norm(x, norm) if one_plus else rms_norm(x, norm), weight, bias)
    return silu_mul(out) if silu else out


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [q, K]; on CUDA one row by ``skinny_triton`` (it streams the
    weight faster than cuBLAS's one-row kernels: ``benchmarks/skinny_gemm.py``), a wide verify's rows
    by ``wide_triton`` on the GPUs where it was timed faster (none yet: ``benchmarks/wide_gemm.py``),
    and more than MOST_SKINNY rows by the cuBLASLt algorithm ``lt_product`` timed fastest for the shape."""
    if (x.shape[0] == 1 or x.shape[0] > MOST_SKINNY) and (kernel := triton_product(x, weight, bias)) is not None:
        return kernel(x, weight)
    if bias is None and x.shape[0] > MOST_SKINNY and (out := lt_linear(x, weight)) is not None:
        return out
    return F.linear(x, weight, bias)


def lt_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``lt_product.linear`` on CUDA (x @ weight^T, or out += it, by the cuBLASLt algorithm timed fastest
    for the shape), or None: torch's own call is the choice, or not CUDA."""
    if not x.is_cuda:
        return None
    from workers.models import lt_product

    return lt_product.linear(x, weight, out)


MOST_SKINNY = 16  # skinny_triton.MOST_ROWS (not imported here: Triton is imported only where it runs)


def triton_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The Triton function that takes x @ weight^T, or None:
    ``skinny_triton.skinny_linear`` for 1-16 rows, ``wide_triton.wide_linear`` for a wide verify's rows
    (CUDA, no bias, the rows, dtypes and GPUs of their ``takes``)."""
    if bias is None and x.is_cuda and triton_available():
        from workers.models import skinny_triton, wide_triton

        if skinny_triton.takes(x, weight):
            return skinny_triton.skinny_linear
        if wide_triton.takes(x, weight):
            return wide_triton.wide_linear
    return None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [q, 2I] (gate columns, then up) -> silu(gate) * up [q, I]: one kernel on CUDA."""
    if gate_up.is_cuda and triton_available():
        from workers.models.fused_hybrid_triton import silu_mul as kernel

        return kernel(gate_up)
    inner = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inner]) * gate_up[:, inner:]


def add_projection_(residual: torch.Tensor, x: torch.Tensor, linear: nn.Linear,
                    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """residual += linear(x) in place, for 2-D operands; returns residual. Without bias or ``reduce``
    the sum is the matrix product's epilogue, one kernel (``torch.addmm`` into a new tensor would
    first copy residual there: a copy per projection).

    With ``reduce`` (tensor parallel) linear(x) is this rank's partial sum: reduced first, then added.
    From 1 to 16 rows on CUDA the sum is ``skinny_triton``'s epilogue (cuBLAS runs split-K and a
    reduce there; the kernel's one-row form splits K too, the last split adding into the residual:
    ``benchmarks/skinny_gemm.py``), at a wide verify's rows ``wide_triton``'s where ``product``
    takes it, and beyond 16 rows that of the cuBLASLt algorithm ``lt_linear`` chose for the shape."""
    if reduce is None and (kernel := triton_product(x, linear.weight, linear.bias)) is not None:
        return kernel(x, linear.weight, out=residual)
    if (reduce is None and linear.bias is None and x.shape[0] > MOST_SKINNY
            and lt_linear(x, linear.weight, out=residual) is not None):
        return residual
    if reduce is not None:
        return residual.add_(reduce(F.linear(x, linear.weight, linear.bias)))
    if linear.bias is not None:
        return residual.add_(linear(x))
    return residual.addmm_(x, linear.weight.t())


def fuse_rows(modules: tuple[nn.Linear, ...], name: str) -> torch.Tensor | None:
    """Stack the modules' ``name`` tensors along the output rows and make each module's tensor a view
    of the stack (so the weights are stored once). None when the modules have no such tensor."""
    parts = [getattr(m, name) for m in modules]
    if any(p is None for p in parts):
        return None
    stacked = torch.cat([p.detach() for p in parts])
    begin = 0
    for module, part in zip(modules, parts):
        rows = part.shape[0]
        setattr(module, name, nn.Parameter(stacked[begin : begin + rows], requires_grad=part.requires_grad))
        begin += rows
    return stacked


def fused_layer_for(layer: nn.Module, config,
                    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> FusedLayer | None:
    """The layer's ``FusedLayer`` (made once and kept on the layer: its weights are views), or None.

    Made again if the model's weights stopped being views of it (the model was moved, cast or
    sharded since). ``reduce``: see ``FusedLayer``.
    """
    existing = getattr(layer, "_fused_layer", None)
    if existing is not None and existing.is_current(layer):
        existing.reduce = reduce
        return existing
    if not FusedLayer.supports(layer, config):
        return None
    fused = FusedLayer(layer, config, reduce)
    layer._fused_layer = fused  # a plain attribute (not a submodule): no second state_dict entry
    return fused
