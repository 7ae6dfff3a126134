"""The reference runner: an attention-only target through transformers' own forward and cache.

``AttentionTarget`` runs Qwen3 / Llama style models with ``DynamicCache`` and a 4-D additive tree
mask: slow, but independent of our own decoder loop, so the tests and benchmarks compare
``StaticTarget`` against it. Hybrids are refused (transformers' GDN layers cannot fork state).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from workers.errors import UnsupportedModelError
from workers.seam import DraftTree, VerifyOutput, check_supported, is_hybrid


class AttentionTarget:
    """An attention-only causal LM plus its KV cache for one sequence (batch 1)."""

    graphs = False  # transformers' own forward, launched op by op
    drafter_graphs = None

    def __init__(
        self,
        model: nn.Module,
        tap_layer_ids: tuple[int, ...] = (),
        tap_device: torch.device | None = None,
    ) -> None:
        check_supported(model.config)
        if is_hybrid(model.config):
            raise UnsupportedModelError(
                f"'{model.config.model_type}' is a hybrid model: use workers.models.runner.target.StaticTarget"
            )
        self.model = model
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.tap_device = tap_device
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
        width = max_verify
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

    def advance(self, tokens: torch.Tensor) -> VerifyOutput:
        """tokens [q] kept whole after the committed ones: a chain pass and its full commit; last logits [1, V]."""
        out = self.verify_chain(tokens)
        self.commit(torch.arange(tokens.shape[0]))
        return VerifyOutput(logits=out.logits[-1:], taps=out.taps)

    def verify_chain(self, tokens: torch.Tensor) -> VerifyOutput:
        """tokens [q] = [bonus, draft...] at positions length..length+q-1, causal among themselves."""
        q = tokens.shape[0]
        positions = torch.arange(self.length, self.length + q, device=self.device).unsqueeze(0)
        logits = self._forward(tokens.to(self.device).unsqueeze(0), positions, mask=None, logits_to_keep=0)
        return VerifyOutput(logits=logits, taps=self._taps())

    def verify_tree(self, root_token: torch.Tensor, tree: DraftTree) -> VerifyOutput:
        """Verify [root, nodes...] in one pass: node i at position length + depth(i), seeing the
        committed past and its own ancestors only (additive float mask, since bool masks misbehave
        with eager attention). """
        n = 1 + tree.num_nodes
        width = n
        past = self.length
        ids, positions = self._ids[:, :width], self._positions[:, :width]
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
        logits = self._forward(ids, positions, mask=mask, logits_to_keep=0)
        return VerifyOutput(logits=logits, taps=self._taps())

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
