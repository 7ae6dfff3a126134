"""The project's own DFlash drafter: loads z-lab checkpoints as published, without remote code.

A DFlash drafter is a few Qwen3-style layers at the target's width with no embedding or LM head of
its own. Per pass it reads:
  * context: the target's hidden states after layers ``target_layer_ids`` for newly committed tokens,
    concatenated [1, T, k*H], projected by ``fc`` and ``hidden_norm``, then turned into extra keys and
    values by every layer's own k_proj/v_proj (+k_norm). The context never passes through a layer's
    norms or MLP, and its K/V stay in the drafter cache for later rounds;
  * the block: the target's embedding of [bonus, MASK x (block_size-1)] at positions start..start+b-1.
Attention is non-causal with no mask: every block query sees all context and the whole block. One
pass gives the hidden states of the block; the target's lm_head turns positions 1.. into one
distribution per future token. The block's own K/V are never cached.

Checkpoint layout (z-lab/*-DFlash*): config.json (a Qwen3 config plus ``block_size``,
``num_target_layers`` and ``dflash_config.{mask_token_id,target_layer_ids}``) and model.safetensors
(or a sharded index) with keys ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``...{q,k}_norm.weight``,
``layers.N.mlp.{gate,up,down}_proj.weight``, ``layers.N.{input,post_attention}_layernorm.weight``,
``norm.weight``, ``fc.weight``, ``hidden_norm.weight``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from workers.errors import CheckpointMismatchError
from workers.models.attention import NO_CUDNN, grouped_attention


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread taps over target layers 1..N-3 (the DFlash convention when the config omits them)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def check_is_drafter(raw: Any, source: str) -> None:
    """Refuse, by name, a target checkpoint given where a DFlash drafter is expected.

    A drafter's config carries ``block_size`` and ``dflash_config``; a plain causal LM's config has
    neither, and the field-by-field errors further on would only say that ``block_size`` is missing.
    """
    if not isinstance(raw, dict) or "block_size" in raw or "dflash_config" in raw:
        return
    kind = ", ".join(raw.get("architectures") or []) or raw.get("model_type") or "a model"
    raise CheckpointMismatchError(
        f"{source}: this is a target model ({kind}), not a DFlash drafter: its config has no block_size "
        "or dflash_config (give the drafter's folder, e.g. a z-lab/<Target>-DFlash checkpoint)"
    )


@dataclass(frozen=True)
class DrafterSpec:
    """The fields of a drafter config.json the engines depend on, validated."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    hidden_size: int
    qwen3_config: Qwen3Config  # the layer shapes, norms and RoPE settings

    @classmethod
    def from_config_file(cls, config_path: Path) -> DrafterSpec:
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointMismatchError(f"{config_path}: cannot read drafter config ({exc})") from exc
        return cls.from_dict(raw, source=str(config_path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "drafter config") -> DrafterSpec:
        def need(container: dict[str, Any], field: str, name: str | None = None) -> Any:
            if field not in container:
                raise CheckpointMismatchError(f"{source}: missing field '{name or field}'")
            return container[field]

        def need_int(container: dict[str, Any], field: str, name: str | None = None) -> int:
            value = need(container, field, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise CheckpointMismatchError(f"{source}: field '{name or field}' must be an integer, got {value!r}")
            return value

        if not isinstance(raw, dict):
            raise CheckpointMismatchError(f"{source}: the config must be a JSON object")
        check_is_drafter(raw, source)
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise CheckpointMismatchError(f"{source}: 'dflash_config' must be a mapping")
        block_size = need_int(raw, "block_size")
        if block_size < 2:
            raise CheckpointMismatchError(f"{source}: 'block_size' must be >= 2, got {block_size}")
        hidden_size = need_int(raw, "hidden_size")
        num_heads = need_int(raw, "num_attention_heads")
        num_layers = need_int(raw, "num_hidden_layers")
        num_target_layers = need_int(raw, "num_target_layers")
        mask_token_id = need_int(dflash, "mask_token_id", "dflash_config.mask_token_id")
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        if not isinstance(layer_ids, list) or not all(isinstance(i, int) for i in layer_ids) or not layer_ids:
            raise CheckpointMismatchError(f"{source}: 'dflash_config.target_layer_ids' must be a list of ints")
        keep = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "dflash_config")}
        keep.setdefault("head_dim", hidden_size // num_heads)
        try:
            qwen3_config = Qwen3Config(**keep)
        except Exception as exc:  # transformers validates shapes and rope settings its own way
            raise CheckpointMismatchError(f"{source}: not a valid Qwen3-style layer config ({exc})") from exc
        return cls(
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(layer_ids),
            num_target_layers=num_target_layers,
            hidden_size=hidden_size,
            qwen3_config=qwen3_config,
        )

    def check_fits(self, target_config: Any, embedding_rows: int, source: str) -> None:
        """Refuse a drafter built for another target, naming the field that disagrees."""
        text_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        target_hidden = int(text_config.hidden_size)
        target_layers = int(text_config.num_hidden_layers)
        if self.hidden_size != target_hidden:
            raise CheckpointMismatchError(
                f"{source}: hidden_size {self.hidden_size} does not match the target's {target_hidden}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target_layers]
        if bad:
            raise CheckpointMismatchError(
                f"{source}: dflash_config.target_layer_ids {list(bad)} are outside the target's "
                f"{target_layers} layers (0..{target_layers - 1})"
            )
        if self.num_target_layers != target_layers:
            raise CheckpointMismatchError(
                f"{source}: num_target_layers {self.num_target_layers} does not match the target's "
                f"{target_layers} layers (this drafter was built for another target)"
            )
        if not 0 <= self.mask_token_id < embedding_rows:
            raise CheckpointMismatchError(
                f"{source}: dflash_config.mask_token_id {self.mask_token_id} is outside the target's "
                f"vocabulary of {embedding_rows} embedding rows"
            )


class DrafterCache:
    """Preallocated context K/V of every drafter layer: [layers][1, kv_heads, capacity, head_dim].

    Holds the projected context of committed tokens 0..length-1; block K/V are never stored.
    """

    def __init__(self, spec: DrafterSpec, capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        cfg = spec.qwen3_config
        shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
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


class DFlashDrafter(nn.Module):
    """Parameter names match the z-lab safetensors keys exactly, so state dicts load as they are."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        cfg = spec.qwen3_config
        self.spec = spec
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(len(spec.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=cfg)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def new_cache(self, capacity: int) -> DrafterCache:
        weight = self.fc.weight
        return DrafterCache(self.spec, capacity, weight.device, weight.dtype)

    def _rope(self, x: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + length, device=x.device).unsqueeze(0)
        return self.rotary_emb(x, positions)  # cos, sin [1, length, D]

    def forward(self, block_embeds: torch.Tensor, new_context: torch.Tensor, cache: DrafterCache) -> torch.Tensor:
        """One drafting pass.

        block_embeds [1, b, H]: target embedding of [bonus, MASK...] at positions start..start+b-1,
            where start = cache.length + T (the bonus sits right after the last committed context).
        new_context  [1, T, k*H]: target taps of the tokens committed since the last pass.
        Returns the final-normed hidden states of the block [1, b, H]; feed them to the target lm_head.
        """
        num_new = new_context.shape[1]
        ctx_start, block_start = cache.length, cache.length + num_new
        if block_start > cache.capacity:
            raise RuntimeError(f"drafter cache overflow: {block_start} > capacity {cache.capacity}")
        context = self.hidden_norm(self.fc(new_context))
        ctx_rope = self._rope(context, ctx_start, num_new)
        block_rope = self._rope(block_embeds, block_start, block_embeds.shape[1])
        hidden = block_embeds
        for index, layer in enumerate(self.layers):
            keys, values = cache.keys[index], cache.values[index]
            if num_new:
                k_ctx, v_ctx = layer.self_attn.key_value(context, *ctx_rope)
                keys[:, :, ctx_start:block_start] = k_ctx
                values[:, :, ctx_start:block_start] = v_ctx
            attn = layer.self_attn(
                layer.input_layernorm(hidden), block_rope, keys[:, :, :block_start], values[:, :, :block_start]
            )
            hidden = hidden + attn
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        cache.length = block_start
        return self.norm(hidden)

    def forward_at(
        self, block_embeds: torch.Tensor, new_context: torch.Tensor, cache: DrafterCache, length: torch.Tensor
    ) -> torch.Tensor:
        """``forward`` with the committed context length as a device scalar, for CUDA-graph capture:
        the new context's K/V go to slots length.., and attention reads the whole cache under a mask
        instead of a host-sized slice. Leaves ``cache.length`` to the caller."""
        num_new, block = new_context.shape[1], block_embeds.shape[1]
        positions = (length + torch.arange(num_new + block, device=new_context.device)).unsqueeze(0)
        context = self.hidden_norm(self.fc(new_context))
        ctx_rope = self.rotary_emb(context, positions[:, :num_new])
        block_rope = self.rotary_emb(block_embeds, positions[:, num_new:])
        columns = torch.arange(cache.capacity + block, device=new_context.device)
        visible = (columns < length + num_new) | (columns >= cache.capacity)  # committed context, then the block
        mask = torch.full((block, cache.capacity + block), torch.finfo(block_embeds.dtype).min,
                          dtype=block_embeds.dtype, device=block_embeds.device)
        mask = mask.masked_fill_(visible, 0.0)[None, None]
        hidden = block_embeds
        for index, layer in enumerate(self.layers):
            keys, values = cache.keys[index], cache.values[index]
            k_ctx, v_ctx = layer.self_attn.key_value(context, *ctx_rope)
            keys.index_copy_(2, positions[0, :num_new], k_ctx)
            values.index_copy_(2, positions[0, :num_new], v_ctx)
            hidden = hidden + layer.self_attn(layer.input_layernorm(hidden), block_rope, keys, values, mask)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)
