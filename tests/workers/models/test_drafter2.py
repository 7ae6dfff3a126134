"""The DFlash2 drafter (workers.models.drafter2) against a reference written from the published
description, position by position; its z-lab layout loaded from a folder this test writes; its
config fields checked by name; its lattice trees against the DFlash tree build where they must agree.

The reference recomputes a pass with explicit loops: for every block row and channel the convolution
sum over taps (the learned base plus the row's group delta, rows before the block zero), the
attention over the context and block keys the layer may read, then for every draft position the
lm_head's top-k and, for every (predecessor, candidate) pair, the selector's score
logit + sum_r A[p, r] g[r] B[c, r], and the greedy walk from the anchor.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.workers.models.test_drafter_attention import _rope, reads
from tools.tiny import TinyShape, tiny_drafter_config, write_tiny_pair
from workers.decoding.params import TreeParams
from workers.decoding.tree import build_lattice_tree, build_tree
from workers.errors import CheckpointMismatchError
from workers.models.drafter2 import DFlash2Drafter, drafter_for
from workers.models.drafter_config import DrafterSpec
from workers.models.loading import Placement, load_drafter, load_target
from workers.seam import Lattice

HIDDEN, BLOCK, VOCAB = 32, 6, 24


def dflash2_drafter(kernel: int = 2, top_k: int = 5, window: int | None = None, seed: int = 0) -> DFlash2Drafter:
    shape = TinyShape(vocab_size=VOCAB, hidden_size=HIDDEN, drafter_layers=2, block_size=BLOCK, dflash2=True,
                      selector_top_k=top_k, conv_kernel_size=kernel, drafter_window=window,
                      drafter_layer_types=None if window is None else ("sliding_attention",) * 2,
                      drafter_causal=None if window is None else False)
    torch.manual_seed(seed)
    drafter = drafter_for(DrafterSpec.from_dict(tiny_drafter_config(shape)))
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3)  # large weights: every term of the score matters
    return drafter.eval()


def reference_conv(conv, normed: torch.Tensor, rows: torch.Tensor, side: int) -> torch.Tensor:
    """out[i, c] = sum_t (base[side, t, c] + delta[i, side, t, c // group]) * rows[i - t, c]; rows < 0 are 0."""
    delta = normed @ conv.kernel_projection.weight.T  # [b, 2 * K * G], side-major, then tap, then group
    taps, groups = conv.kernel, conv.groups
    out = torch.zeros_like(rows)
    for i in range(rows.shape[0]):
        for t in range(taps):
            if i - t < 0:
                continue
            for c in range(rows.shape[1]):
                weight = conv.base_kernel[side, t, c] + delta[i, (side * taps + t) * groups + c // conv.group]
                out[i, c] += weight * rows[i - t, c]
    return out


def reference_pass(drafter: DFlash2Drafter, block_embeds: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states [b, H] of the block at positions T.. after the context ``taps`` [T, k*H]."""
    cfg = drafter.spec.qwen3_config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    length, block = taps.shape[0], block_embeds.shape[0]
    context = drafter.hidden_norm(drafter.fc(taps))
    cos, sin = drafter.rotary_emb(context[None], torch.arange(length + block)[None])
    cos, sin = cos[0], sin[0]
    hidden = block_embeds
    for layer, rule in zip(drafter.layers, drafter.spec.layer_attention):
        attn = layer.self_attn
        normed = layer.input_layernorm(hidden)
        mixed = reference_conv(layer.attention_conv, normed, normed, side=0)
        sources = torch.cat((context, mixed))  # context K/V never pass through the convolutions
        q = attn.q_norm(attn.q_proj(mixed).view(block, heads, dim))
        k = attn.k_norm(attn.k_proj(sources).view(length + block, kv_heads, dim))
        v = attn.v_proj(sources).view(length + block, kv_heads, dim)
        q, k = _rope(q, cos[length:, None], sin[length:, None]), _rope(k, cos[:, None], sin[:, None])
        out = torch.zeros(block, heads, dim)
        for j in range(block):
            keys = [p for p in range(length + block) if reads(length + j, p, rule.window, rule.causal)]
            for h in range(heads):
                g = h // (heads // kv_heads)
                out[j, h] = torch.softmax(k[keys, g] @ q[j, h] * dim**-0.5, dim=0) @ v[keys, g]
        attended = attn.o_proj(out.reshape(block, heads * dim))
        hidden = hidden + reference_conv(layer.attention_conv, normed, attended, side=1)
        normed = layer.post_attention_layernorm(hidden)
        mlp_in = reference_conv(layer.mlp_conv, normed, normed, side=0)
        hidden = hidden + reference_conv(layer.mlp_conv, normed, layer.mlp(mlp_in), side=1)
    return drafter.norm(hidden)


def reference_selector(drafter: DFlash2Drafter, hidden: torch.Tensor, lm_head: torch.Tensor, anchor: int):
    """(candidates [n, K], scores [n, K, K], greedy [n]) for the draft rows ``hidden`` [n, H]."""
    selector = drafter.candidate_selector
    logits = hidden @ lm_head.T
    top_k = drafter.spec.selector.selector_top_k
    candidates = [sorted(range(logits.shape[1]), key=lambda t, row=row: -float(logits[row, t]))[:top_k]
                  for row in range(logits.shape[0])]
    gate = hidden @ selector.hidden_projection.weight.T  # [n, r]
    scores = torch.zeros(len(candidates), top_k, top_k)
    for j, row in enumerate(candidates):
        parents = [anchor] * top_k if j == 0 else candidates[j - 1]
        for p, parent in enumerate(parents):
            for c, token in enumerate(row):
                bilinear = sum(float(selector.predecessor_codebook[parent, r] * gate[j, r]
                                     * selector.successor_codebook[token, r]) for r in range(gate.shape[1]))
                scores[j, p, c] = float(logits[j, token]) + bilinear
    greedy, state = [], 0
    for j in range(len(candidates)):
        state = int(scores[j, state].argmax())
        greedy.append(candidates[j][state])
    return torch.tensor(candidates), scores, greedy


@pytest.mark.parametrize(("kernel", "window"), [(2, None), (3, None), (2, 4)],
                         ids=["published", "kernel-3", "non-causal-window"])
@torch.no_grad()
def test_pass_and_selector_equal_the_reference_as_the_context_grows(kernel, window):
    drafter = dflash2_drafter(kernel=kernel, window=window)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB + 1, bias=False)
    torch.nn.init.normal_(lm_head.weight, std=0.5)
    generator = torch.Generator().manual_seed(3)
    cache, fed = drafter.new_cache(64), 0
    taps = torch.empty(0, drafter.fc.in_features)
    graph_cache = drafter.new_cache(64)
    for new in (9, 1, 3, 2):  # a prompt, then rounds' few committed tokens
        taps = torch.cat((taps, torch.randn(new, drafter.fc.in_features, generator=generator)))
        block_embeds = torch.randn(BLOCK, HIDDEN, generator=generator)
        anchor = int(torch.randint(VOCAB, (), generator=generator))
        expected = reference_pass(drafter, block_embeds, taps)
        got = drafter(block_embeds[None], taps[None, fed:], cache)[0]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        length = torch.tensor(fed)
        at = drafter.forward_at(block_embeds[None], taps[None, fed:], graph_cache, length)[0]  # the graph's pass
        torch.testing.assert_close(at, expected, rtol=1e-4, atol=1e-5)
        fed += new

        lattice = drafter.propose(got[1:], lm_head, torch.tensor([anchor]))
        candidates, scores, greedy = reference_selector(drafter, got[1:], lm_head.weight, anchor)
        assert torch.equal(lattice.tokens, candidates)
        torch.testing.assert_close(lattice.log_probs, torch.log_softmax(scores, dim=-1), rtol=1e-4, atol=1e-5)
        assert lattice.greedy.tolist() == greedy
        assert torch.allclose(lattice.log_probs[0], lattice.log_probs[0, :1].expand_as(lattice.log_probs[0]))


def test_the_z_lab_layout_loads_from_a_folder(tmp_path):
    target_dir, drafter_dir = write_tiny_pair(tmp_path, TinyShape(dflash2=True))
    with safe_open(drafter_dir / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
    assert "candidate_selector.predecessor_codebook" in keys and "layers.0.attention_conv.base_kernel" in keys
    assert not any(key.startswith("model.") for key in keys)
    model = load_target(str(target_dir), dtype="float32", placement=Placement(device="cpu"))
    drafter = load_drafter(str(drafter_dir), model)
    assert isinstance(drafter, DFlash2Drafter) and drafter.spec.kind == "dflash2"

    # a codebook of the wrong width is refused by name
    weights = load_file(drafter_dir / "model.safetensors")
    weights["candidate_selector.successor_codebook"] = torch.zeros(33, 3)
    save_file(weights, drafter_dir / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match="successor_codebook"):
        load_drafter(str(drafter_dir), model)


def _raw(**dflash) -> dict:
    raw = tiny_drafter_config(TinyShape(dflash2=True))
    raw["dflash_config"] |= dflash
    return raw


@pytest.mark.parametrize(("change", "match"), [
    ({"conv_group_size": 5}, "conv_group_size.*does not divide hidden_size"),
    ({"selector_top_k": 0}, "selector_top_k.*must be >= 1"),
    ({"selector_rank": "8"}, "selector_rank.*must be an integer"),
    ({"kernel_bias": True}, "dflash_config.kernel_bias is not a field"),
])
def test_dflash2_fields_are_checked_by_name(change, match):
    with pytest.raises(CheckpointMismatchError, match=match):
        DrafterSpec.from_dict(_raw(**change))


def test_a_missing_dflash2_field_and_a_stray_one_are_refused():
    raw = _raw()
    del raw["dflash_config"]["selector_rank"]
    with pytest.raises(CheckpointMismatchError, match="missing field 'selector_rank'"):
        DrafterSpec.from_dict(raw)
    v1 = tiny_drafter_config(TinyShape())
    v1["dflash_config"]["selector_top_k"] = 4
    with pytest.raises(CheckpointMismatchError, match="selector_top_k is a DFlash2 field"):
        DrafterSpec.from_dict(v1)


def test_a_top_k_larger_than_the_vocabulary_is_refused(tmp_path):
    target_dir, _ = write_tiny_pair(tmp_path, TinyShape(dflash2=True))
    model = load_target(str(target_dir), dtype="float32", placement=Placement(device="cpu"))
    spec = DrafterSpec.from_dict(_raw(selector_top_k=40))
    with pytest.raises(CheckpointMismatchError, match="selector_top_k 40 exceeds"):
        spec.check_fits(model.config, embedding_rows=33, source="config.json")


# -- lattice trees -----------------------------------------------------------------------------------


def _lattice(depth: int, top_k: int, seed: int, same_rows: bool = False) -> Lattice:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(depth, 1 if same_rows else top_k, top_k, generator=generator).expand(depth, top_k, top_k)
    tokens = torch.stack([torch.randperm(50, generator=generator)[:top_k] for _ in range(depth)])
    return Lattice(tokens, torch.log_softmax(scores, dim=-1), tokens[:, 0])


@pytest.mark.parametrize("params", [TreeParams(6), TreeParams(20, max_depth=3), TreeParams(30, branching=2),
                                    TreeParams(1), TreeParams(64)])
def test_a_lattice_whose_rows_agree_gives_the_dflash_tree(params):
    """With every parent row the same, a lattice is DFlash's independent positions: the same tree."""
    lattice = _lattice(depth=5, top_k=4, seed=1, same_rows=True)
    got = build_lattice_tree(lattice, params)
    log_probs = torch.full((5, 50), -1e4).scatter(1, lattice.tokens, lattice.log_probs[:, 0])
    expected = build_tree(log_probs, params, kernels=False)
    for name in ("tokens", "depths", "parents", "visibility"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


@pytest.mark.parametrize("seed", range(4))
def test_a_lattice_tree_holds_the_most_probable_walks(seed):
    """Against enumeration: the tree's nodes are the ``budget`` most probable walks (with their
    ancestors), each node's token the candidate its walk chose, children at most ``branching``."""
    lattice, budget = _lattice(depth=3, top_k=3, seed=seed), 9
    tree = build_lattice_tree(lattice, TreeParams(budget))
    walks = {}
    for a in range(3):
        walks[(a,)] = float(lattice.log_probs[0, 0, a])
        for b in range(3):
            walks[(a, b)] = walks[(a,)] + float(lattice.log_probs[1, a, b])
            for c in range(3):
                walks[(a, b, c)] = walks[(a, b)] + float(lattice.log_probs[2, b, c])
    best = sorted(walks.values(), reverse=True)[:budget]
    torch.testing.assert_close(sorted(tree.log_probs.tolist(), reverse=True), best)
    for node in range(1, tree.num_nodes + 1):  # a node's token is a candidate of its depth
        assert int(tree.tokens[node - 1]) in lattice.tokens[int(tree.depths[node - 1]) - 1].tolist()
    capped = build_lattice_tree(lattice, TreeParams(budget, branching=1))
    assert capped.num_nodes == 3 and capped.tokens.tolist() == [
        int(lattice.tokens[d, s]) for d, s in enumerate(_greedy_states(lattice))]


def _greedy_states(lattice: Lattice) -> list[int]:
    states, state = [], 0
    for depth in range(lattice.rows):
        state = int(lattice.log_probs[depth, state].argmax())
        states.append(state)
    return states
