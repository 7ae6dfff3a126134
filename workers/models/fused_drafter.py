"""A DFlash drafter's capturable pass in few kernels: its layers as the target's ``FusedLayer``.

A drafter layer is a Qwen3 decoder layer whose attention also reads the context: the target's taps
of the newly committed tokens, through ``fc`` and ``hidden_norm``, become extra keys and values by
the layer's own k_proj/v_proj (+k_norm, rotary), kept in the drafter cache. Written op by op
(``DFlashDrafter.forward_at``) a layer issues ~50 kernels (six per RMSNorm, a rotary of ten, two
projections for the context's K/V, SDPA over the whole cache); the weights read take a fraction of
the pass. Here each layer is one ``FusedLayer`` (its q/k/v and gate/up matrices fused, views of
the drafter's own weights) and the context rides in the block's products:

    x      = [context (T rows); norm(block) (b rows)]          one q/k/v product over T + b rows
    heads  -> q/k normed and rotated, K/V of all T + b rows written at their positions (slot =
              position), queries folded                        one kernel on CUDA
    attend  folded rows over the cache up to the block's last slot, under the layer's mask
    block += o_proj(attended block rows); block += down(silu(gate) * up)(norm(block))

The block's own K/V thus sit in the cache right after the context (the next round overwrites them
with its context), so one attention over the cache replaces "cache, then the block". The context
rows' queries are attended too and dropped: a handful of rows, cheaper than a copy to leave them
out. The attention reads the mask from slot 0 (a sliding layer hides the oldest keys), and no key
past the block's last slot (``attention_triton.attend_until`` on CUDA in half precision).

Off CUDA the same arithmetic runs in torch (``fused_layer``'s ``*_torch`` forms), so CPU tests hold
this pass to the plain one (``tests/workers/models/test_drafter_static.py``,
``test_drafter_attention.py``). Layers of another kind (DFlash2's convolutions) keep the plain pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.attention import attend_folded
from workers.models.drafter_config import attention_mask
from workers.models.fused_layer import (
    FusedLayer,
    PassInputs,
    add_projection_,
    norm_linear,
    norm_rotate_heads,
    norm_rotate_heads_torch,
    rms_norm,
)
from workers.models.kernels import triton_available


def context_slots(length: torch.Tensor, num_new: int, block: int, count: torch.Tensor | None) -> torch.Tensor:
    """The cache slot (= position) of each row of a pass over T = ``num_new`` context rows then ``block``
    rows, after ``length`` committed ones [T + b]: the first ``count`` context rows (all when None) at
    length.., the block right after them, and the context rows past ``count`` (padding) after the block,
    so that their K/V land where neither this pass's masks nor a later pass's reach before it rewrites
    them."""
    rows = torch.arange(num_new + block, device=length.device)
    if count is None:
        return length + rows
    context = torch.where(rows[:num_new] < count, rows[:num_new], rows[:num_new] + block)
    return torch.cat((length + context, length + count + rows[:block]))


def fused_pass(drafter: nn.Module, layers: list[FusedLayer], block_embeds: torch.Tensor,
               new_context: torch.Tensor, cache, length: torch.Tensor,
               count: torch.Tensor | None = None) -> torch.Tensor:
    """``DFlashDrafter.forward_at`` through ``layers``: block_embeds [1, b, H] at positions length + T..,
    new_context [1, T, k*H] (taps of tokens at length..length+T-1), cache with room for T + b slots
    past length -> the final-normed block hidden states [1, b, H]. ``count``: a device scalar, how many
    of the T context rows are new context (None: all; the slots as ``context_slots``). Leaves
    ``cache.length`` to the caller."""
    num_new, block = new_context.shape[1], block_embeds.shape[1]
    device = block_embeds.device
    positions = context_slots(length, num_new, block, count)  # [T + b]: the context's, then the block's (= slots)
    context = rms_norm(F.linear(new_context[0], drafter.fc.weight), drafter.hidden_norm)  # [T, H]
    cos, sin = drafter.rotary_emb(context, positions[None])  # [1, T + b, D]
    slots = torch.arange(cache.capacity, device=device)
    exists = slots <= positions[-1]  # the committed context, this pass's context and the block
    groups = layers[0].query_heads // layers[0].kv_heads
    kinds = drafter.spec.layer_attention
    inputs = {kind: PassInputs.build(cos, sin, positions,  # layers that attend alike share their inputs
                                     attention_mask(kind, positions, slots, exists, block_embeds.dtype)[0, 0], groups)
              for kind in set(kinds)}
    # attention bounds: the mask read from slot 0 on (a sliding layer hides the oldest keys), nothing past the block
    reads = torch.stack((torch.zeros_like(positions[0]), positions[-1]))
    hidden = block_embeds[0].clone()  # [b, H], updated in place layer by layer
    for index, layer in enumerate(layers):
        layer_step(layer, hidden, context, inputs[kinds[index]], cache.pairs[index], reads)
    return rms_norm(hidden, drafter.norm)[None]


def fused_write_context(drafter: nn.Module, layers: list[FusedLayer], new_context: torch.Tensor, cache,
                        slots: torch.Tensor) -> None:
    """``DFlashDrafter.write_context_at`` through ``layers``: the context's part of ``fused_pass``.
    new_context [1, T, k*H]; slots [T]: each row's cache slot (= position). Per layer one product by the
    K and V rows of the fused q/k/v weight and one kernel that norms, rotates and writes them."""
    context = rms_norm(F.linear(new_context[0], drafter.fc.weight), drafter.hidden_norm)  # [T, H]
    cos, sin = drafter.rotary_emb(context, slots[None])  # [1, T, D]
    inputs = PassInputs.build(cos, sin, slots, None, 1)  # nothing attends: no mask
    for layer, kv in zip(layers, cache.pairs, strict=True):
        query_rows = layer.query_heads * layer.head_dim  # the weight's rows: queries, then keys, then values
        bias = None if layer.qkv_bias is None else layer.qkv_bias[query_rows:]
        heads = F.linear(context, layer.qkv_weight[query_rows:], bias)
        write_heads(layer, heads.view(context.shape[0], 2 * layer.kv_heads, layer.head_dim), inputs, kv, 0)


def write_heads(layer: FusedLayer, heads: torch.Tensor, inputs: PassInputs, kv: torch.Tensor,
                query_heads: int) -> torch.Tensor:
    """``norm_rotate_heads`` of one layer's heads [q, query_heads + 2Hkv, D] (all of the layer's query
    heads, or none): K and V into kv at ``inputs.slots``, the queries folded returned (one kernel on CUDA)."""
    args = (heads, layer.q_norm, layer.k_norm, inputs, kv, query_heads, layer.kv_heads)
    return norm_rotate_heads(*args) if heads.is_cuda and triton_available() else norm_rotate_heads_torch(*args)


def layer_step(layer: FusedLayer, hidden: torch.Tensor, context: torch.Tensor, inputs: PassInputs,
               kv: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
    """The block's hidden [b, H] through one drafter layer, in place; the context [T, H] (already
    ``fc`` + ``hidden_norm``) only gives K/V. kv [2, 1, Hkv, C, D]: this layer's cache; ``inputs``:
    rotary, slots and folded mask of the T + b rows; ``reads``: the attention's first masked and last
    read slot."""
    num_new, block = context.shape[0], hidden.shape[0]
    rows, hq, hkv, d = num_new + block, layer.query_heads, layer.kv_heads, layer.head_dim
    x = torch.cat((context, rms_norm(hidden, layer.input_norm)))  # [T + b, H]
    heads = F.linear(x, layer.qkv_weight, layer.qkv_bias).view(rows, hq + 2 * hkv, d)
    folded = write_heads(layer, heads, inputs, kv, hq)
    out = attend_folded(folded, kv[0, 0], kv[1, 0], inputs.mask, layer.scale, slots=reads, nodes=rows)  # [T+b, Hq*D]
    add_projection_(hidden, out[num_new:], layer.o_proj)  # the block's rows
    add_projection_(hidden, norm_linear(hidden, layer.post_norm, layer.gate_up_weight, silu=True), layer.down_proj)
    return hidden
