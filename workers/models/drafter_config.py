"""A DFlash drafter's config.json, read into a ``DrafterSpec``: every field that changes the drafter's
arithmetic is either implemented or refused by name, never ignored.

A drafter that runs with the wrong attention stays lossless (verification catches every wrong
guess) and so fails nothing; it only drafts worse, and every speed a sweep reports is then wrong.
So a field this module does not understand is an error naming the field and the file.

DFlash-specific fields are read from ``dflash_config`` first, then from the top level (the older
z-lab layout kept ``block_size`` there). How each layer attends is ``resolve_layer_attention``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from workers.errors import CheckpointMismatchError

SLIDING, FULL = "sliding_attention", "full_attention"
ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_2 = "DFlash2DraftModel"  # DFlash2: dynamic convolutions and a candidate selector (SelectorSpec)

# dflash_config keys this project reads; any other key is refused (it may change the arithmetic)
DFLASH_FIELDS = frozenset({
    "block_size", "mask_token_id", "target_layer_ids", "num_target_layers",  # the DFlash contract
    "use_swa", "swa_window_size", "causal", "is_causal",  # per-layer attention (resolve_layer_attention)
    "thinking", "supports_thinking",  # what the drafter was trained on (a warning, no arithmetic)
    # accepted only at their neutral values (checked in _refuse_unsupported)
    "attention_sink_bias", "use_aux_hidden_state", "input_embedding_scale", "output_multiplier",
    "final_logit_softcapping", "target_hidden_size",
    "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",  # DFlash2 only (SelectorSpec)
})
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class SelectorSpec:
    """What a DFlash2 drafter adds to a DFlash one (``workers.models.drafter2``).

    conv_kernel_size:  taps of the grouped dynamic causal convolutions around every layer's attention
                       and MLP (the current position and the ones before it, inside the block);
    conv_group_size:   channels sharing one dynamic coefficient (hidden_size / group_size groups);
    selector_rank:     width of the predecessor / successor codebooks and the hidden projection;
    selector_top_k:    candidates per draft position (the lm_head's top-k), among which the selector
                       walks the chain and the tree branches.
    """

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


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
class LayerAttention:
    """Which keys one drafter layer's block queries see.

    causal: a block query sees the block's keys up to its own position only (context keys always
            precede the block, so they are never hidden by causality);
    window: a query at position q sees keys k with q - window < k (and, when not causal, also
            k - q < window); None: no window.
    """

    causal: bool = False
    window: int | None = None

    @property
    def sees_everything(self) -> bool:
        """The original DFlash attention: every context key and the whole block, no mask needed."""
        return not self.causal and self.window is None

    def visible(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """[Q] and [K] absolute positions -> bool [Q, K], True where the query may read the key."""
        q, k = query_positions[:, None], key_positions[None, :]
        allowed = torch.ones((q.shape[0], k.shape[1]), dtype=torch.bool, device=query_positions.device)
        if self.causal:
            allowed &= k <= q
        if self.window is not None:
            allowed &= q - k < self.window
            if not self.causal:
                allowed &= k - q < self.window
        return allowed


def resolve_layer_attention(
    layer_types: list[str], use_swa: bool, causal: bool | None, window: int | None, source: str
) -> tuple[LayerAttention, ...]:
    """Each drafter layer's attention, as the serving engines resolve it (vLLM's
    ``qwen3_dflash._resolve_layer_attention``, z-lab's ``Qwen3DFlashAttention``):

        layer_types[i]      use_swa   window   causal (unless overridden)
        sliding_attention   any       W        yes
        full_attention      false     none     no
        full_attention      true      W        no

    ``causal`` (``dflash_config.causal``, else the top-level ``is_causal``), when set, overrides the
    causality of every layer. W is ``dflash_config.swa_window_size``, else the top-level
    ``sliding_window`` (which Qwen3Config keeps only when ``use_sliding_window`` is true). Absent
    ``layer_types`` are Qwen3Config's own (sliding from ``max_window_layers`` on, when
    ``use_sliding_window``), as both engines read them.
    """
    resolved = []
    for index, layer_type in enumerate(layer_types):
        if layer_type not in (SLIDING, FULL):
            raise CheckpointMismatchError(
                f"{source}: layer_types[{index}] is '{layer_type}'; a DFlash drafter layer is '{SLIDING}' or '{FULL}'"
            )
        sliding = use_swa or layer_type == SLIDING
        if sliding and window is None:
            raise CheckpointMismatchError(
                f"{source}: layer {index} is sliding ({'dflash_config.use_swa' if use_swa else 'layer_types'}) but no "
                "window is given: set sliding_window with use_sliding_window: true, or dflash_config.swa_window_size"
            )
        layer_causal = (layer_type == SLIDING) if causal is None else causal
        resolved.append(LayerAttention(causal=layer_causal, window=window if sliding else None))
    return tuple(resolved)


@dataclass(frozen=True)
class DrafterSpec:
    """The fields of a drafter config.json the engines depend on, validated."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    hidden_size: int
    qwen3_config: Qwen3Config  # the layer shapes, norms and RoPE settings
    layer_attention: tuple[LayerAttention, ...]  # one per layer
    selector: SelectorSpec | None = None  # a DFlash2 drafter's convolutions and selector; None: DFlash v1

    @classmethod
    def from_config_file(cls, config_path: Path) -> DrafterSpec:
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointMismatchError(f"{config_path}: cannot read drafter config ({exc})") from exc
        return cls.from_dict(raw, source=str(config_path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "drafter config") -> DrafterSpec:
        if not isinstance(raw, dict):
            raise CheckpointMismatchError(f"{source}: the config must be a JSON object")
        check_is_drafter(raw, source)
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise CheckpointMismatchError(f"{source}: 'dflash_config' must be a mapping")
        _refuse_unsupported(raw, dflash, source)
        fields = _Fields(raw, dflash, source)

        block_size = fields.integer("block_size")
        if block_size < 2:
            raise CheckpointMismatchError(f"{source}: '{fields.name('block_size')}' must be >= 2, got {block_size}")
        hidden_size = fields.integer("hidden_size", top_level_only=True)
        num_heads = fields.integer("num_attention_heads", top_level_only=True)
        num_layers = fields.integer("num_hidden_layers", top_level_only=True)
        num_target_layers = fields.integer("num_target_layers")
        mask_token_id = fields.integer("mask_token_id")
        layer_ids = fields.get("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        if not isinstance(layer_ids, list) or not layer_ids or not all(_is_int(i) for i in layer_ids):
            raise CheckpointMismatchError(f"{source}: '{fields.name('target_layer_ids')}' must be a list of ints")
        target_hidden = fields.get("target_hidden_size")
        if target_hidden is not None and target_hidden != hidden_size:
            raise CheckpointMismatchError(
                f"{source}: {fields.name('target_hidden_size')} {target_hidden} differs from hidden_size "
                f"{hidden_size}; a drafter that projects another width than its own is not supported"
            )

        declared = raw.get("layer_types")
        if declared is not None and (not isinstance(declared, list) or len(declared) != num_layers):
            raise CheckpointMismatchError(
                f"{source}: layer_types must list one entry for each of the {num_layers} layers (num_hidden_layers), "
                f"got {declared!r}"
            )
        keep = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "dflash_config")}
        keep.setdefault("head_dim", hidden_size // num_heads)
        try:
            qwen3_config = Qwen3Config(**keep)
        except Exception as exc:  # transformers validates shapes and rope settings its own way
            raise CheckpointMismatchError(f"{source}: not a valid Qwen3-style layer config ({exc})") from exc
        layer_types = list(qwen3_config.layer_types)  # Qwen3Config's own when the file has none
        window = fields.get("swa_window_size", dflash_only=True)
        if window is None:
            window = qwen3_config.sliding_window
        if window is not None and (not _is_int(window) or window < 1):
            raise CheckpointMismatchError(f"{source}: the sliding window must be a positive integer, got {window!r}")
        use_swa = bool(fields.get("use_swa", dflash_only=True) or False)
        causal = dflash.get("causal", dflash.get("is_causal", raw.get("is_causal")))
        if causal is not None and not isinstance(causal, bool):
            raise CheckpointMismatchError(f"{source}: 'causal' / 'is_causal' must be true or false, got {causal!r}")
        selector = None
        if ARCHITECTURE_2 in (raw.get("architectures") or []):
            selector = SelectorSpec(*(fields.integer(name) for name in DFLASH2_FIELDS))
            for name in DFLASH2_FIELDS:
                if getattr(selector, name) < 1:
                    raise CheckpointMismatchError(f"{source}: '{fields.name(name)}' must be >= 1")
            if hidden_size % selector.conv_group_size:
                raise CheckpointMismatchError(
                    f"{source}: '{fields.name('conv_group_size')}' {selector.conv_group_size} does not divide "
                    f"hidden_size {hidden_size}")
        return cls(
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(layer_ids),
            num_target_layers=num_target_layers,
            hidden_size=hidden_size,
            qwen3_config=qwen3_config,
            layer_attention=resolve_layer_attention(layer_types, use_swa, causal, window, source),
            selector=selector,
        )

    @property
    def kind(self) -> str:
        """"dflash2" for a DFlash2 drafter (selector and convolutions), else "dflash"."""
        return "dflash" if self.selector is None else "dflash2"

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
        if self.selector is not None and self.selector.selector_top_k > embedding_rows:
            raise CheckpointMismatchError(
                f"{source}: dflash_config.selector_top_k {self.selector.selector_top_k} exceeds the target's "
                f"vocabulary of {embedding_rows}"
            )
        if not 0 <= self.mask_token_id < embedding_rows:
            raise CheckpointMismatchError(
                f"{source}: dflash_config.mask_token_id {self.mask_token_id} is outside the target's "
                f"vocabulary of {embedding_rows} embedding rows"
            )


class _Fields:
    """A DFlash field from ``dflash_config`` first, then the top level; errors name where it was read."""

    def __init__(self, raw: dict[str, Any], dflash: dict[str, Any], source: str) -> None:
        self.raw, self.dflash, self.source = raw, dflash, source

    def name(self, field: str) -> str:
        return f"dflash_config.{field}" if field in self.dflash else field

    def get(self, field: str, dflash_only: bool = False, top_level_only: bool = False) -> Any:
        if field in self.dflash and not top_level_only:
            return self.dflash[field]
        return None if dflash_only else self.raw.get(field)

    def integer(self, field: str, top_level_only: bool = False) -> int:
        value = self.get(field, top_level_only=top_level_only)
        if value is None:
            raise CheckpointMismatchError(f"{self.source}: missing field '{field}'"
                                          + ("" if top_level_only else f" (nor dflash_config.{field})"))
        if not _is_int(value):
            raise CheckpointMismatchError(
                f"{self.source}: field '{self.name(field)}' must be an integer, got {value!r}")
        return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse_unsupported(raw: dict[str, Any], dflash: dict[str, Any], source: str) -> None:
    """Fields that would change the arithmetic in ways this drafter does not implement, by name."""
    def either(field: str) -> Any:
        return dflash.get(field, raw.get(field))

    architectures = raw.get("architectures") or []
    unknown = [a for a in architectures if a not in (ARCHITECTURE, ARCHITECTURE_2)]
    if unknown or len(architectures) > 1:
        raise CheckpointMismatchError(
            f"{source}: architectures {architectures} are not a DFlash drafter this project implements (expected "
            f"['{ARCHITECTURE}'] or ['{ARCHITECTURE_2}'])"
        )
    stray = [f for f in DFLASH2_FIELDS if f in dflash or f in raw]
    if stray and ARCHITECTURE_2 not in architectures:  # convolutions or a selector on a DFlash v1 drafter
        raise CheckpointMismatchError(
            f"{source}: {stray[0]} is a DFlash2 field, but architectures is {architectures or 'not given'} "
            f"(a DFlash2 drafter declares ['{ARCHITECTURE_2}'])"
        )
    if raw.get("model_type", "qwen3") != "qwen3":
        raise CheckpointMismatchError(
            f"{source}: model_type '{raw['model_type']}': DFlash drafter layers are Qwen3-style (model_type 'qwen3')"
        )
    extra = sorted(set(dflash) - DFLASH_FIELDS)
    if extra:
        raise CheckpointMismatchError(
            f"{source}: dflash_config.{extra[0]} is not a field this project implements (known: "
            f"{', '.join(sorted(DFLASH_FIELDS))}); refusing rather than running the drafter without it"
        )
    neutral = {  # field: (value, the value that changes nothing)
        "attention_sink_bias": (either("attention_sink_bias") or raw.get("add_swa_attention_sink_bias"), False),
        "use_aux_hidden_state": (either("use_aux_hidden_state"), True),
        "input_embedding_scale": (either("input_embedding_scale"), 1.0),
        "output_multiplier": (either("output_multiplier"), 1.0),
        "final_logit_softcapping": (either("final_logit_softcapping") or None, None),
        "mlp_bias": (raw.get("mlp_bias"), False),
    }
    for field, (value, plain) in neutral.items():
        if value is not None and value != plain:
            raise CheckpointMismatchError(
                f"{source}: {field} = {value!r} is not implemented by this project's drafter (only {plain!r}); "
                "refusing rather than drafting with different arithmetic"
            )
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) if isinstance(rope, dict) else 1
    if partial != 1.0:
        raise CheckpointMismatchError(f"{source}: partial_rotary_factor {partial} is not implemented for drafters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        raise CheckpointMismatchError(f"{source}: rope mrope_section is not implemented for drafters")


def attention_mask(kind: LayerAttention, query_positions: torch.Tensor, key_positions: torch.Tensor,
                   exists: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask [1, 1, Q, K] of a layer that attends as ``kind``, from the queries' and keys'
    absolute positions [Q], [K] and ``exists`` [Q, K] or [K]: the keys that are there for each query at
    all (None: every key). None when the layer sees every key."""
    if kind.sees_everything:
        visible = exists
    else:
        visible = kind.visible(query_positions, key_positions)
        if exists is not None:
            visible = visible & exists
    return None if visible is None else additive_mask(visible, query_positions.shape[0], dtype)


def additive_mask(visible: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """bool [Q, K] or [K] (True: read) -> additive float [1, 1, Q, K] of 0 and the dtype's minimum."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask = mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.expand(rows, -1)[None, None] if mask.dim() == 1 else mask[None, None]
