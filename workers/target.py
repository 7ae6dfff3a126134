"""The target model seen by the engines: prefill, verify a chain or a tree, commit what was accepted.

This is the one seam between the decoding algorithms and a model's cache. ``make_target`` gives the
runner the engines use, ``workers.static_target.StaticTarget`` (its own decoder loop on static
buffers: Gated DeltaNet hybrids need it, and it is what CUDA graphs capture). ``AttentionTarget``,
below, runs attention-only models (Qwen3 / Llama style) through transformers' own forward and
``DynamicCache``: the plain reference path, kept for comparison and tests.

Verify inputs (token ids, positions, the additive tree mask) live in buffers allocated once per
generation at the largest size the run can ask for and sliced per round; with ``bucket_sizes`` the
slice is padded up to a fixed size so a later CUDA-graph capture sees a handful of shapes only.
Padding nodes sit at the root's position, see only the committed past and are never accepted.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from workers.errors import UnsupportedModelError
from workers.tree import DraftTree

# model_type values whose every layer is softmax attention over a KV cache we can index.
ATTENTION_ONLY_TYPES = frozenset({"qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "llama", "mistral"})
# model_type values mixing Gated DeltaNet ("linear_attention") and "full_attention" layers.
HYBRID_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"})
HYBRID_LAYER_TYPES = frozenset({"linear_attention", "full_attention"})


def text_config(config):
    """The language model's config (multimodal Qwen3.5 / 3.6 checkpoints nest it as ``text_config``)."""
    inner = getattr(config, "text_config", None)
    return inner if inner is not None else config


def is_hybrid(config) -> bool:
    return getattr(config, "model_type", None) in HYBRID_TYPES


def check_supported(config) -> None:
    """Refuse, by name, an architecture whose output the engines cannot guarantee to be exact."""
    model_type = getattr(config, "model_type", "?")
    supported = ", ".join(sorted(ATTENTION_ONLY_TYPES | HYBRID_TYPES))
    if model_type in HYBRID_TYPES:
        layer_types = set(getattr(text_config(config), "layer_types", None) or ())
        if not layer_types or not layer_types <= HYBRID_LAYER_TYPES:
            raise UnsupportedModelError(
                f"target architecture '{model_type}' with layer types {sorted(layer_types)} is not supported "
                f"(hybrid layers must be {sorted(HYBRID_LAYER_TYPES)})"
            )
        return
    if model_type not in ATTENTION_ONLY_TYPES:
        raise UnsupportedModelError(f"target architecture '{model_type}' is not supported (supported: {supported})")
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise UnsupportedModelError(f"target architecture '{model_type}' with sliding-window layers is not supported")


@dataclass(frozen=True)
class VerifyOutput:
    logits: torch.Tensor  # [q, V] float, one row per verified node (root first)
    taps: torch.Tensor  # [1, q, k*H] hidden states after the tapped layers, on the drafter's device


def make_target(
    model: nn.Module,
    tap_layer_ids: tuple[int, ...] = (),
    tap_device: torch.device | None = None,
    graphs: bool | None = None,
    compile_layers: bool = False,
):
    """The runner for ``model``: ``StaticTarget`` (own decoder loop on static buffers; hybrids need
    it), with CUDA graphs when ``graphs`` is None and the whole model sits on one CUDA device."""
    from workers.static_target import StaticTarget

    check_supported(model.config)
    devices = {p.device for p in model.parameters()}
    one_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
    use_graphs = one_cuda if graphs is None else graphs and one_cuda
    return StaticTarget(model, tap_layer_ids, tap_device, graphs=use_graphs, compile_layers=compile_layers)


def bucket_for(size: int, bucket_sizes: tuple[int, ...] | None) -> int:
    """Smallest bucket >= size (the exact size when bucketing is off or no bucket is large enough)."""
    if bucket_sizes:
        for bucket in bucket_sizes:
            if bucket >= size:
                return bucket
    return size


class AttentionTarget:
    """An attention-only causal LM plus its KV cache for one sequence (batch 1)."""

    def __init__(
        self,
        model: nn.Module,
        tap_layer_ids: tuple[int, ...] = (),
        tap_device: torch.device | None = None,
        bucket_sizes: tuple[int, ...] | None = None,
    ) -> None:
        check_supported(model.config)
        if is_hybrid(model.config):
            raise UnsupportedModelError(f"'{model.config.model_type}' is a hybrid model: use workers.static_target.StaticTarget")
        self.model = model
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.tap_device = tap_device
        self.bucket_sizes = bucket_sizes
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        # transformers renamed ``past_key_values`` to ``cache``; pass whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._captured: dict[int, torch.Tensor] = {}
        layers = _decoder_layers(model)
        self._hooks = [layers[i].register_forward_hook(self._capture_hook(i)) for i in set(self.tap_layer_ids)]
        self.cache = None
        self.length = 0  # committed tokens in the cache

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, capacity: int, max_verify: int) -> None:
        """Fresh cache and verify buffers for one sequence of at most ``capacity`` tokens."""
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.length = 0
        width = bucket_for(max_verify, self.bucket_sizes)
        self._ids = torch.zeros((1, width), dtype=torch.long, device=self.device)
        self._positions = torch.zeros((1, width), dtype=torch.long, device=self.device)
        self._mask = torch.zeros((1, 1, width, capacity + width), dtype=self.dtype, device=self.device)
        self._last_block: tuple[int, int] = (0, 0)  # (start column, width) of the previous tree block

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    # -- forwards ----------------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor) -> VerifyOutput:
        """Run the prompt [1, T]; returns the last position's logits [1, V] and taps of all T tokens."""
        positions = torch.arange(input_ids.shape[1], device=self.device).unsqueeze(0)
        logits = self._forward(input_ids.to(self.device), positions, mask=None, logits_to_keep=1)
        self.length = input_ids.shape[1]
        return VerifyOutput(logits=logits, taps=self._taps())

    def verify_chain(self, tokens: torch.Tensor) -> VerifyOutput:
        """tokens [q] = [bonus, draft...] at positions length..length+q-1, causal among themselves."""
        q = tokens.shape[0]
        positions = torch.arange(self.length, self.length + q, device=self.device).unsqueeze(0)
        logits = self._forward(tokens.to(self.device).unsqueeze(0), positions, mask=None, logits_to_keep=0)
        return VerifyOutput(logits=logits, taps=self._taps())

    def verify_tree(self, root_token: torch.Tensor, tree: DraftTree) -> VerifyOutput:
        """Verify [root, nodes...] in one pass: node i at position length + depth(i), seeing the
        committed past and its own ancestors only (additive float mask, since bool masks misbehave
        with eager attention). Returns rows for the real nodes only, padding dropped."""
        n = 1 + tree.num_nodes
        width = bucket_for(n, self.bucket_sizes)
        past = self.length
        ids, positions = self._ids[:, :width], self._positions[:, :width]
        ids.zero_()
        ids[0, 0] = root_token
        ids[0, 1:n] = tree.tokens.to(self.device)
        positions.fill_(past)
        positions[0, 1:n] += tree.depths.to(self.device)
        # Columns before `past` must read 0 (everyone sees the committed past): the buffer starts at
        # zero, so only the previous round's tree block needs clearing, not the whole past.
        last_start, last_width = self._last_block
        self._mask[0, 0, :last_width, last_start : last_start + last_width] = 0.0
        self._last_block = (past, width)
        mask = self._mask[:, :, :width, : past + width]
        block = mask[0, 0, :, past:]
        block.fill_(torch.finfo(self.dtype).min)
        block[:n, :n].masked_fill_(tree.visibility.to(self.device), 0.0)
        if width > n:  # padding rows see the past and themselves, so no row is fully masked
            pad = torch.arange(n, width, device=self.device)
            block[pad, pad] = 0.0
        logits = self._forward(ids, positions, mask=mask, logits_to_keep=0)
        return VerifyOutput(logits=logits[:n], taps=self._taps()[:, :n])

    # -- commit ------------------------------------------------------------------------------------
    def commit(self, kept: torch.Tensor) -> None:
        """Keep the verified nodes at indices ``kept`` (ascending, root first) of the last pass.

        Their K/V rows move to slots length..length+len(kept)-1 and everything after is dropped. The
        positions they were computed at are already the committed ones (start + depth), so no
        re-rotation is needed. A chain commit is kept = arange(a+1), a plain truncation.
        """
        past, count = self.length, int(kept.shape[0])
        contiguous = bool(kept[-1].item() == count - 1)  # the one host read of the commit (path length known)
        for layer_keys, layer_values, set_kv in _cache_layers(self.cache):
            if not contiguous:
                index = kept.to(layer_keys.device)
                layer_keys[:, :, past : past + count] = layer_keys[:, :, past + index]
                layer_values[:, :, past : past + count] = layer_values[:, :, past + index]
            set_kv(layer_keys[:, :, : past + count], layer_values[:, :, : past + count])
        self.length = past + count

    # -- internals ---------------------------------------------------------------------------------
    def _forward(self, ids, positions, mask, logits_to_keep: int) -> torch.Tensor:
        self._captured.clear()
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self._cache_kwarg: self.cache},
        )
        return out.logits[0]

    def _capture_hook(self, layer_id: int):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[layer_id] = hidden

        return hook

    def _taps(self) -> torch.Tensor:
        if not self.tap_layer_ids:
            return torch.empty(0)
        device = self.tap_device or self._captured[self.tap_layer_ids[0]].device
        return torch.cat([self._captured[i].to(device) for i in self.tap_layer_ids], dim=-1)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def _cache_layers(cache):
    """Yield (keys, values, setter) per layer of a transformers DynamicCache (5.x ``layers`` layout)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue

        def set_kv(keys, values, layer=layer):
            layer.keys, layer.values = keys, values

        yield layer.keys, layer.values, set_kv
