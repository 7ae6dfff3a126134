"""The project's own DFlash drafter: loads z-lab checkpoints as published, without remote code.

A DFlash drafter is a few Qwen3-style layers at the target's width with no embedding or LM head of
its own. Per pass it reads:
  * context: the target's hidden states after layers ``target_layer_ids`` for newly committed tokens,
    concatenated [1, T, k*H], projected by ``fc`` and ``hidden_norm``, then turned into extra keys and
    values by every layer's own k_proj/v_proj (+k_norm). The context never passes through a layer's
    norms or MLP, and its K/V stay in the drafter cache for later rounds;
  * the block: the target's embedding of [bonus, MASK x (block_size-1)] at positions start..start+b-1.
Each layer attends as its config declares (``drafter_config.resolve_layer_attention``): the
original DFlash layer sees all context and the whole block with no mask; a sliding layer sees keys
within its window only, and a causal one the block up to its own position. One pass gives the
hidden states of the block; the target's lm_head turns positions 1.. into one distribution per
future token. The block's own K/V are never cached.

Checkpoint layout (z-lab/*-DFlash*): config.json (``drafter_config.DrafterSpec`` reads it) and
model.safetensors (or a sharded index) with keys ``layers.N.self_attn.{q,k,v,o}_proj.weight``,
``...{q,k}_norm.weight``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
``layers.N.{input,post_attention}_layernorm.weight``, ``norm.weight``, ``fc.weight``, ``hidden_norm.weight``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from workers.models.attention import NO_CUDNN, grouped_attention
from workers.models.drafter_config import DrafterSpec, LayerAttention, attention_mask
from workers.models.fused_drafter import context_slots, fused_pass, fused_write_context
from workers.models.fused_layer import FusedLayer, fused_layer_for


class DrafterCache:
    """Preallocated context K/V of every drafter layer: pairs[layer] [2 (K, V), 1, kv_heads, capacity,
    head_dim], with keys[layer] and values[layer] views of its halves.

    Holds the projected context of committed tokens 0..length-1. The plain pass never stores the
    block's K/V; the fused pass (``fused_drafter``) writes them in the slots after the context, which
    the next round's context overwrites.
    """

    def __init__(self, spec: DrafterSpec, capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        cfg = spec.qwen3_config
        shape = (2, 1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.pairs = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.keys = [pair[0] for pair in self.pairs]
        self.values = [pair[1] for pair in self.pairs]
        self.capacity = capacity
        self.length = 0

    def reset(self) -> None:
        self.length = 0


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [1, heads, T, D] with cos/sin [1, T, D] (rotate-half convention of Qwen3)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DrafterAttention(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.scaling = self.head_dim**-0.5  # (grouped_attention's default; ``FusedLayer`` reads it)
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(1, x.shape[1], n, self.head_dim)  # [1, T, n, D]

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, T, H] -> rotated keys, values [1, kv_heads, T, D]."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(
        self,
        block: torch.Tensor,  # [1, b, H] (after input_layernorm)
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_keys: torch.Tensor,  # [1, kv_heads, C, D], already rotated
        context_values: torch.Tensor,
        mask: torch.Tensor | None = None,  # additive [1, 1, b, C + b]; None: every column visible
    ) -> torch.Tensor:
        cos, sin = block_rope
        q = _rotate(self.q_norm(self._heads(self.q_proj(block), self.num_heads)).transpose(1, 2), cos, sin)
        k_block, v_block = self.key_value(block, cos, sin)
        k = torch.cat((context_keys, k_block), dim=2)
        v = torch.cat((context_values, v_block), dim=2)
        out = grouped_attention(q, k, v, mask, backends=NO_CUDNN)  # non-causal: all context, all of the block
        return self.o_proj(out.transpose(1, 2).reshape(1, block.shape[1], -1))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def block_step(self, hidden: torch.Tensor, block_rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                   values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The block's hidden states [1, b, H] through this layer (context K/V already in keys/values)."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), block_rope, keys, values, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(nn.Module):
    """Parameter names match the z-lab safetensors keys exactly, so state dicts load as they are."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        cfg = spec.qwen3_config
        self.spec = spec
        self.layers = nn.ModuleList(self._new_layer() for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(len(spec.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=cfg)

    def _new_layer(self) -> nn.Module:
        return DrafterLayer(self.spec.qwen3_config)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def new_cache(self, capacity: int) -> DrafterCache:
        weight = self.fc.weight
        return DrafterCache(self.spec, capacity, weight.device, weight.dtype)

    def _rope(self, x: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + length, device=x.device).unsqueeze(0)
        return self.rotary_emb(x, positions)  # cos, sin [1, length, D]

    def layer_masks(self, query_positions: torch.Tensor, key_positions: torch.Tensor,
                    exists: torch.Tensor | None, dtype: torch.dtype) -> list[torch.Tensor | None]:
        """``attention_mask`` for every layer (layers that attend alike share one)."""
        kinds = self.spec.layer_attention
        by_kind = {kind: attention_mask(kind, query_positions, key_positions, exists, dtype) for kind in set(kinds)}
        return [by_kind[kind] for kind in kinds]

    def write_context(self, new_context: torch.Tensor, cache: DrafterCache) -> None:
        """The context part of a pass: every layer's K/V of new_context [1, T, k*H] (target taps of the
        tokens committed since the last pass) into cache slots length..length+T-1, and length advanced.
        It needs no block, so a long context (a prompt) can be written ahead of the pass that drafts."""
        num_new, start = new_context.shape[1], cache.length
        if start + num_new > cache.capacity:
            raise RuntimeError(f"drafter cache overflow: {start + num_new} > capacity {cache.capacity}")
        if num_new:
            context = self.hidden_norm(self.fc(new_context))
            rope = self._rope(context, start, num_new)
            for layer, keys, values in zip(self.layers, cache.keys, cache.values, strict=True):
                keys[:, :, start : start + num_new], values[:, :, start : start + num_new] = (
                    layer.self_attn.key_value(context, *rope))
        cache.length = start + num_new

    def write_context_at(self, new_context: torch.Tensor, cache: DrafterCache, slots: torch.Tensor,
                         fused: bool = True) -> None:
        """``write_context`` at device-side ``slots`` [T] (= positions), for CUDA-graph capture
        (``GraphDrafting.write_ahead``); leaves ``cache.length`` to the caller. ``fused``: as
        ``fused_drafter`` writes the context where every layer allows (a product and one kernel a layer,
        against a score of kernels op by op)."""
        layers = self.fused_layers() if fused else None
        if layers is not None:
            return fused_write_context(self, layers, new_context, cache, slots)
        context = self.hidden_norm(self.fc(new_context))
        rope = self.rotary_emb(context, slots[None])
        for layer, keys, values in zip(self.layers, cache.keys, cache.values, strict=True):
            key, value = layer.self_attn.key_value(context, *rope)
            keys.index_copy_(2, slots, key)
            values.index_copy_(2, slots, value)

    def forward(self, block_embeds: torch.Tensor, new_context: torch.Tensor, cache: DrafterCache) -> torch.Tensor:
        """One drafting pass.

        block_embeds [1, b, H]: target embedding of [bonus, MASK...] at positions start..start+b-1,
            where start = cache.length + T (the bonus sits right after the last committed context).
        new_context  [1, T, k*H]: target taps of the tokens committed since the last pass.
        Returns the final-normed hidden states of the block [1, b, H]; feed them to the target lm_head.
        A sliding layer reads only the cache slots its window reaches (slot = position).
        """
        self.write_context(new_context, cache)
        block, block_start = block_embeds.shape[1], cache.length
        block_rope = self._rope(block_embeds, block_start, block)
        device = block_embeds.device
        block_positions = torch.arange(block_start, block_start + block, device=device)
        reach: dict[LayerAttention, tuple[int, torch.Tensor | None]] = {}  # first slot read, mask
        for kind in set(self.spec.layer_attention):
            first = 0 if kind.window is None else max(0, block_start - kind.window + 1)
            key_positions = torch.arange(first, block_start + block, device=device)
            reach[kind] = (first, attention_mask(kind, block_positions, key_positions, None, block_embeds.dtype))
        hidden = block_embeds
        for index, layer in enumerate(self.layers):
            first, mask = reach[self.spec.layer_attention[index]]
            hidden = layer.block_step(hidden, block_rope, cache.keys[index][:, :, first:block_start],
                                      cache.values[index][:, :, first:block_start], mask)
        return self.norm(hidden)

    def forward_at(
        self, block_embeds: torch.Tensor, new_context: torch.Tensor, cache: DrafterCache, length: torch.Tensor,
        fused: bool = True, count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward`` with the committed context length as a device scalar, for CUDA-graph capture:
        the new context's K/V go to slots length.., and attention reads the whole cache under a mask
        instead of a host-sized slice. Leaves ``cache.length`` to the caller. ``count``: a device scalar,
        how many of new_context's T rows are new context (None: all); the block then sits at length +
        count, the other rows' K/V go past the block (``context_slots``) where no mask reaches, and the
        cache needs room for T + block slots past length. ``fused``: run the layers as ``fused_drafter``
        does, where every layer allows (False: op by op, as the benchmarks compare)."""
        layers = self.fused_layers() if fused else None
        if layers is not None:
            return fused_pass(self, layers, block_embeds, new_context, cache, length, count)
        num_new, block = new_context.shape[1], block_embeds.shape[1]
        device = new_context.device
        positions = context_slots(length, num_new, block, count).unsqueeze(0)  # [1, T + b]
        self.write_context_at(new_context, cache, positions[0, :num_new], fused=False)
        block_rope = self.rotary_emb(block_embeds, positions[:, num_new:])
        slots = torch.arange(cache.capacity, device=device)
        key_positions = torch.cat((slots, positions[0, num_new:]))  # the cache's slots, then the block
        exists = torch.cat((slots < positions[0, -1] + 1 - block, torch.ones(block, dtype=torch.bool, device=device)))
        masks = self.layer_masks(positions[0, num_new:], key_positions, exists, block_embeds.dtype)
        hidden = block_embeds
        for index, layer in enumerate(self.layers):
            hidden = layer.block_step(hidden, block_rope, cache.keys[index], cache.values[index], masks[index])
        return self.norm(hidden)

    def fused_layers(self) -> list[FusedLayer] | None:
        """Every layer as a ``FusedLayer`` (made once, kept on the layer) for ``fused_drafter``'s pass, or
        None when a layer is of another kind (DFlash2's) or shape."""
        if not all(type(layer) is DrafterLayer for layer in self.layers):
            return None
        fused = [fused_layer_for(layer, self.spec.qwen3_config) for layer in self.layers]
        return None if any(f is None for f in fused) else fused

    def propose(self, hidden: torch.Tensor, lm_head: nn.Module, anchor: torch.Tensor) -> torch.Tensor:
        """What a pass proposes from the block's draft rows ``hidden`` [n, H] (after the anchor): the
        draft logits [n, V] (the target's lm_head). ``anchor``: the block's first token [1] (DFlash2's
        selector reads it)."""
        return lm_head(hidden.to(lm_head.weight.device))
