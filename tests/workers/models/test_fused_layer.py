"""FusedLayer (plain attention layers in few kernels) against transformers' own forward.

Every supported family (Qwen3 with q/k norms, Qwen2 with q/k/v biases, Llama, Mistral) is built
from config with random weights; in float32 every tree node's logits must equal the plain forward on
prompt + root + that node's path, before and after a commit that moves K/V rows. The fused matrices
must share storage with the model's own weights (nothing stored twice), and both attention branches
(batched products for few rows, SDPA for many) must agree.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from workers.decoding.params import TreeParams
from workers.decoding.tree import build_tree
from workers.models import attention
from workers.models.attention import attend_folded, grouped_attention
from workers.models.fused_layer import FusedLayer, fused_layer_for, visible_ends
from workers.models.runner.target import StaticTarget

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 50
FAMILIES = {"qwen3": {}, "qwen2": {}, "llama": {}, "mistral": {"sliding_window": None}}


def random_model(model_type: str, seed: int):
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        **FAMILIES[model_type],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # larger than the default init, so attention is not flat
            parameter.normal_(0, 0.3)
    return model


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def path_tokens(tree, root: int, node: int) -> list[int]:
    nodes = []
    while node > 0:
        nodes.append(node)
        node = int(tree.parents[node])
    return [root] + [int(tree.tokens[n - 1]) for n in reversed(nodes)]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("seed", range(3))
def test_tree_nodes_and_commits_match_the_plain_forward(model_type, seed):
    model = random_model(model_type, seed)
    target = StaticTarget(model, tap_layer_ids=(1,))
    assert all(isinstance(f, FusedLayer) for f in target.fused.values()) and len(target.fused) == 3
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (9 + seed,), generator=generator).tolist()
    tree = build_tree(torch.log_softmax(torch.randn(4, VOCAB, generator=generator) * 2, -1),
                      TreeParams(8 + 4 * seed, max_depth=4))
    target.start(capacity=64, max_verify=32)
    with torch.no_grad():
        target.prefill(torch.tensor([prompt]))
        verified = target.verify_tree(torch.tensor(prompt[-1]), tree)
    for node in range(1 + tree.num_nodes):
        expected = plain_logits(model, prompt + path_tokens(tree, prompt[-1], node))
        torch.testing.assert_close(verified.logits[node], expected, atol=2e-5, rtol=1e-5)

    # commit the path to the deepest node (off the first chain when the tree branches), then go on
    deepest = int(tree.depths.argmax()) + 1
    nodes = [deepest]
    while nodes[-1] > 0:
        nodes.append(int(tree.parents[nodes[-1]]))
    with torch.no_grad():
        target.commit(torch.tensor(nodes[::-1]))
        more = [3, 1, 4]
        chain = target.verify_chain(torch.tensor(more))
    text = prompt + path_tokens(tree, prompt[-1], deepest)  # the root was verified (and committed) too
    for k in range(3):
        torch.testing.assert_close(chain.logits[k], plain_logits(model, text + more[: k + 1]), atol=2e-5, rtol=1e-5)


def test_each_node_ends_after_the_last_pass_key_it_sees():
    """``visible_ends``: a tree's nodes see only earlier nodes, so each ends after its own slot; a
    visibility that reaches a later node (a drafter's block sees all of itself) ends after that one, for
    that node and every later one (a running maximum)."""
    slots = torch.arange(40, 47)
    tree = build_tree(torch.log_softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)), -1),
                      TreeParams(budget=6))
    assert torch.equal(visible_ends(tree.visibility, slots), (slots + 1).to(torch.int32))
    visible = torch.eye(7, dtype=torch.bool)
    visible[2, 5] = visible[4, 6] = True
    assert visible_ends(visible, slots).tolist() == [41, 42, 46, 46, 47, 47, 47]
    assert visible_ends(torch.ones(7, 7, dtype=torch.bool), slots).tolist() == [47] * 7


def test_fused_weights_are_views_of_the_model_weights():
    model = random_model("qwen2", 0)
    layer = model.model.layers[0]
    before = {name: p.clone() for name, p in layer.named_parameters()}
    count = sum(p.numel() for p in model.parameters())
    fused = fused_layer_for(layer, model.config)
    assert fused_layer_for(layer, model.config) is fused  # made once per layer
    attn, mlp = layer.self_attn, layer.mlp
    for name, p in layer.named_parameters():  # same values, same parameter count
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
    assert sum(p.numel() for p in model.parameters()) == count
    stacked = fused.qkv_weight.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == stacked for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert attn.q_proj.bias.untyped_storage().data_ptr() == fused.qkv_bias.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == fused.gate_up_weight.untyped_storage().data_ptr()
    with torch.no_grad():  # an in-place update of the model's weight is what the fused layer reads
        attn.k_proj.weight.add_(1.0)
    torch.testing.assert_close(fused.qkv_weight[64:96], before["self_attn.k_proj.weight"] + 1.0)
    model.double()  # a cast (or move) makes new tensors: the next request fuses them again
    refused = fused_layer_for(layer, model.config)
    assert refused is not fused and refused.qkv_weight.dtype == torch.float64 and refused.is_current(layer)


def test_gated_layers_are_not_plain_layers(tiny_hybrid):
    """Qwen3.5's gated, partial-rotary attention (and its 1 + weight norms) is not a plain layer
    (``fused_hybrid`` runs it: tests/workers/models/test_fused_hybrid.py)."""
    target = StaticTarget(tiny_hybrid.model)
    assert target.attention_ids and not any(isinstance(f, FusedLayer) for f in target.fused.values())
    assert not any(FusedLayer.supports(tiny_hybrid.model.model.layers[i], tiny_hybrid.model.config)
                   for i in target.attention_ids)


@pytest.mark.parametrize("rows", [1, 5, 24])
def test_both_attention_branches_agree(monkeypatch, rows):
    generator = torch.Generator().manual_seed(rows)
    query, key, value = (torch.randn(2, n, 16, generator=generator) for n in (rows, 40, 40))
    mask = torch.where(torch.rand(rows, 40, generator=generator) < 0.3, torch.finfo(torch.float32).min, 0.0)
    mask[:, 0] = 0.0  # every row sees something
    naive = torch.softmax(query @ key.transpose(1, 2) * 0.25 + mask, dim=-1) @ value
    naive_unmasked = torch.softmax(query @ key.transpose(1, 2) * 0.25, dim=-1) @ value
    for rows_limit in (10**6, 0):  # the batched-product branch, then SDPA's
        monkeypatch.setattr(attention, "SMALL_ATTENTION_ROWS", rows_limit)
        torch.testing.assert_close(attend_folded(query, key, value, mask, 0.25), naive, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(attend_folded(query, key, value, None, 0.25), naive_unmasked, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 3])
def test_grouped_attention_equals_attention_with_repeated_heads(length):
    """Folding 4 query heads per K/V head into rows = repeating each K/V head 4 times (transformers' way)."""
    generator = torch.Generator().manual_seed(length)
    query, key, value = (torch.randn(1, 8, length, 16, generator=generator),
                         *torch.randn(2, 1, 2, 10, 16, generator=generator))
    mask = torch.zeros(1, 1, length, 10)
    mask[..., -1] = torch.finfo(torch.float32).min
    repeated_key, repeated_value = key.repeat_interleave(4, dim=1), value.repeat_interleave(4, dim=1)
    for m in (mask, None):
        want = torch.nn.functional.scaled_dot_product_attention(query, repeated_key, repeated_value, attn_mask=m)
        torch.testing.assert_close(grouped_attention(query, key, value, m), want, atol=1e-5, rtol=1e-5)


def test_a_fused_model_can_be_deep_copied_and_the_copy_fuses_itself():
    """Fusing under inference mode (as a worker does) must leave plain leaf tensors behind."""
    import copy

    model = random_model("qwen3", 1)
    with torch.inference_mode():
        StaticTarget(model)
    clone = copy.deepcopy(model)
    target = StaticTarget(clone)
    assert all(f.is_current(layer) for f, layer in zip(target.fused.values(), clone.model.layers))
    prompt = torch.tensor([[5, 7, 11, 13]])
    target.start(capacity=16, max_verify=4)
    with torch.no_grad():
        torch.testing.assert_close(target.prefill(prompt).logits[0], plain_logits(model, prompt[0].tolist()),
                                   atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_layer_kernels_equal_their_torch_forms(dtype):
    """The plain norm kernel and the heads kernel in its plain layout (Qwen3's q/k norms, or none as in
    Llama) against the torch forms the CPU runs."""
    from torch import nn

    from workers.models import fused_hybrid_triton
    from workers.models.fused_layer import PassInputs, norm_rotate_heads, norm_rotate_heads_torch

    generator = torch.Generator().manual_seed(3)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    norm = nn.Module()
    norm.weight, norm.variance_epsilon = (torch.randn(4096, generator=generator) * 0.3).to("cuda", dtype), 1e-6
    for x in ((torch.randn(7, 4096, generator=generator) * 3).to("cuda", dtype),
              torch.randn(3, 9, 4096, generator=generator).to("cuda", dtype)[:, 2:6]):
        want = torch.nn.functional.rms_norm(x, (4096,), norm.weight, norm.variance_epsilon)
        torch.testing.assert_close(fused_hybrid_triton.rms_norm(x, norm.weight, 1e-6), want, **tolerance)
    for q, hq, hkv, d in ((1, 32, 8, 128), (257, 32, 8, 128), (5, 4, 2, 16), (256, 0, 8, 128)):  # 0: K/V only
        heads = torch.randn(q, hq + 2 * hkv, d, generator=generator).to("cuda", dtype)
        q_norm, k_norm = nn.Module(), nn.Module()
        q_norm.weight, k_norm.weight = ((torch.randn(d, generator=generator) * 0.3).to("cuda", dtype) for _ in range(2))
        q_norm.variance_epsilon = k_norm.variance_epsilon = 1e-6
        angles = torch.rand(1, q, d // 2, generator=generator).repeat(1, 1, 2) * 6
        inputs = PassInputs.build(angles.cos().to("cuda", dtype), angles.sin().to("cuda", dtype),
                                  torch.arange(3, 3 + q, device="cuda"), torch.zeros(q, 4), hq // hkv)
        for norms in ((q_norm, k_norm), (None, None)):
            results = []
            for run in (norm_rotate_heads_torch, norm_rotate_heads):
                kv = torch.zeros(2, 1, hkv, q + 5, d, dtype=dtype, device="cuda")
                results.append((run(heads.clone(), *norms, inputs, kv, hq, hkv), kv))
            for got, want in zip(results[1], results[0]):
                torch.testing.assert_close(got, want, **tolerance)
