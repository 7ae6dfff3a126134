"""The drafter attends per layer as its config declares (workers.models.drafter_config), in every
path that runs it: the cached pass of the engines and the replay, the graph-capturable pass, and the
training pass over many blocks.

The reference here recomputes a drafting pass from scratch for every query on its own: keys and
values of the whole context and block, then, for each query, a softmax over exactly the keys the
rule lets it read (causal: k <= q; window W: q - W < k, and k - q < W when not causal), with each
layer's (window, causal) written in the case, not taken from the resolver.
"""

from __future__ import annotations

import pytest
import torch

from tools.drafter_training import block_hidden
from tools.tiny import TinyShape, tiny_drafter_config
from workers.models.drafter import DFlashDrafter
from workers.models.drafter_config import DrafterSpec, LayerAttention

S, F = "sliding_attention", "full_attention"
HIDDEN, BLOCK = 32, 6

# case: (drafter layers, config change, expected (window, causal) per layer)
CASES = {
    "plain DFlash": (2, {}, [(None, False), (None, False)]),
    "Qwen3.6-27B layout": (3, {"layer_types": [S, S, F], "use_sliding_window": True, "sliding_window": 5},
                           [(5, True), (5, True), (None, False)]),
    "window inside the block": (2, {"layer_types": [S, F], "use_sliding_window": True, "sliding_window": 3},
                                [(3, True), (None, False)]),
    "causal override on": (2, {"layer_types": [S, F], "use_sliding_window": True, "sliding_window": 7,
                               "dflash_config": {"causal": True}}, [(7, True), (None, True)]),
    "causal override off": (2, {"layer_types": [S, F], "use_sliding_window": True, "sliding_window": 4,
                                "dflash_config": {"causal": False}}, [(4, False), (None, False)]),
    "use_swa, own window size": (2, {"sliding_window": 100, "use_sliding_window": True,
                                     "dflash_config": {"use_swa": True, "swa_window_size": 4}},
                                 [(4, False), (4, False)]),
    "top-level is_causal false": (2, {"layer_types": [S, S], "use_sliding_window": True, "sliding_window": 3,
                                      "is_causal": False}, [(3, False), (3, False)]),
    "layer types from max_window_layers": (2, {"use_sliding_window": True, "sliding_window": 6,
                                               "max_window_layers": 1}, [(None, False), (6, True)]),
}


def drafter_for(layers: int, change: dict, seed: int = 0) -> DFlashDrafter:
    raw = tiny_drafter_config(TinyShape(hidden_size=HIDDEN, drafter_layers=layers, block_size=BLOCK))
    dflash = raw["dflash_config"] | change.get("dflash_config", {})
    raw = raw | {k: v for k, v in change.items() if k != "dflash_config"} | {"dflash_config": dflash}
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DrafterSpec.from_dict(raw, source=f"case {change}"))
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3)  # large weights: attention far from uniform, masks matter
    return drafter.eval()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def reads(query: int, key: int, window: int | None, causal: bool) -> bool:
    if causal and key > query:
        return False
    if window is not None and (query - key >= window or (not causal and key - query >= window)):
        return False
    return True


def reference_pass(drafter: DFlashDrafter, rules, block_embeds: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """Hidden states [b, H] of the block at positions T..T+b-1 after the context ``taps`` [T, k*H]."""
    cfg = drafter.spec.qwen3_config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    length, block = taps.shape[0], block_embeds.shape[0]
    context = drafter.hidden_norm(drafter.fc(taps))  # [T, H]
    cos, sin = drafter.rotary_emb(context[None], torch.arange(length + block)[None])  # [1, T+b, D]
    cos, sin = cos[0], sin[0]
    hidden = block_embeds
    for layer, (window, causal) in zip(drafter.layers, rules):
        attn = layer.self_attn
        normed = layer.input_layernorm(hidden)
        sources = torch.cat((context, normed))  # keys and values: the context as it is, the block normed
        q = attn.q_norm(attn.q_proj(normed).view(block, heads, dim))
        k = attn.k_norm(attn.k_proj(sources).view(length + block, kv_heads, dim))
        v = attn.v_proj(sources).view(length + block, kv_heads, dim)
        q, k = _rope(q, cos[length:, None], sin[length:, None]), _rope(k, cos[:, None], sin[:, None])
        out = torch.zeros(block, heads, dim)
        for j in range(block):
            keys = [p for p in range(length + block) if reads(length + j, p, window, causal)]
            for h in range(heads):
                g = h // (heads // kv_heads)
                weights = torch.softmax(k[keys, g] @ q[j, h] * dim**-0.5, dim=0)
                out[j, h] = weights @ v[keys, g]
        hidden = hidden + attn.o_proj(out.reshape(block, heads * dim))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return drafter.norm(hidden)


def inputs(drafter: DFlashDrafter, length: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    taps = torch.randn(length, drafter.fc.in_features, generator=generator)
    block_embeds = torch.randn(BLOCK, HIDDEN, generator=generator)
    return taps, block_embeds


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_layer_attends_as_the_config_declares(case):
    layers, change, expected = CASES[case]
    drafter = drafter_for(layers, change)
    assert [(a.window, a.causal) for a in drafter.spec.layer_attention] == expected


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_cached_and_graph_passes_equal_the_reference_as_the_context_grows(case):
    """Rounds feed a prompt then a few tokens at a time, past the window; every pass's block hidden
    states equal the from-scratch reference, through ``forward`` (its cache trimmed to each window)
    and ``forward_at`` (the whole cache under a mask, as CUDA graphs run it)."""
    layers, change, expected = CASES[case]
    drafter = drafter_for(layers, change)
    taps, block_embeds = inputs(drafter, 40)
    cached, graphed = drafter.new_cache(64), drafter.new_cache(64)
    length = 0
    for new in (9, 1, 4, 2, 6, 1, 5):  # a prompt of 9, then rounds
        context = taps[None, length : length + new]
        want = reference_pass(drafter, expected, block_embeds, taps[: length + new])
        got = drafter(block_embeds[None], context, cached)[0]
        at = drafter.forward_at(block_embeds[None], context, graphed, torch.tensor(length))[0]
        graphed.length += new
        length += new
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(at, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_training_pass_over_many_blocks_equals_the_reference(case):
    """``drafter_training.block_hidden`` (every block of a sequence in one pass) gives each block what
    one drafting pass with the context before its anchor gives."""
    layers, change, expected = CASES[case]
    drafter = drafter_for(layers, change)
    taps, _ = inputs(drafter, 30)
    anchors = torch.tensor([3, 11, 12, 24])
    generator = torch.Generator().manual_seed(5)
    embeds = torch.randn(len(anchors), BLOCK, HIDDEN, generator=generator)
    got = block_hidden(drafter, embeds, taps, anchors)
    for index, anchor in enumerate(anchors.tolist()):
        want = reference_pass(drafter, expected, embeds[index], taps[:anchor])
        torch.testing.assert_close(got[index], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", sorted(set(CASES) - {"plain DFlash"}))
@torch.no_grad()
def test_the_declared_attention_changes_the_drafts(case):
    """The cases are not vacuous: reading every key (what this project did before) gives other hidden states."""
    layers, change, expected = CASES[case]
    drafter = drafter_for(layers, change)
    taps, block_embeds = inputs(drafter, 20)
    declared = reference_pass(drafter, expected, block_embeds, taps)
    everything = reference_pass(drafter, [(None, False)] * layers, block_embeds, taps)
    assert (declared - everything).abs().max() > 1e-2


def test_the_test_fixtures_carry_the_real_layouts(tiny, tiny_small_vocab, tiny_hybrid, tiny_next):
    """The exactness, replay, graph and tensor-parallel suites run these fixtures: their drafters must
    carry the attention of the real checkpoints, with windows shorter than the tests' contexts."""
    sliding, full = LayerAttention(causal=True, window=8), LayerAttention()
    assert tiny.drafter.spec.layer_attention == (full, full)
    assert tiny_small_vocab.drafter.spec.layer_attention == (sliding, full)
    assert tiny_hybrid.drafter.spec.layer_attention == (sliding, full)
    assert tiny_next.drafter.spec.layer_attention == (LayerAttention(causal=False, window=12),) * 2
