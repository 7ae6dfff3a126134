"""The hybrids' fused layers (``workers.models.fused_hybrid``) against transformers' own layer forwards.

On the Qwen3.5 (dense MLP) and Qwen3-Next (MoE MLP) tiny targets, in float32 on CPU: a gated
attention layer's output and the K/V it writes equal transformers' layer under the same mask; a
GDN layer's fused norms and MLP around the mixer equal transformers' layer with the same
mixer output; the fused matrices are views of the model's own weights; ``reduce`` sees every
row-parallel partial output. GPU-marked: the Triton norm equals the torch form, graph == eager.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

from workers.models.fused_hybrid import (
    GatedAttentionLayer,
    HybridGDNLayer,
    fused_hybrid_layer_for,
    one_plus_rms_norm,
)
from workers.models.fused_layer import PassInputs
from workers.models.runner.target import StaticTarget

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HYBRIDS = ("tiny_hybrid", "tiny_next")


def _model(request, name: str, seed: int = 0) -> nn.Module:
    """A private copy of the fixture's model with random norm weights (the checkpoint's are zeros)."""
    model = copy.deepcopy(request.getfixturevalue(name).model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for module_name, parameter in model.named_parameters():
            if "norm" in module_name:
                parameter.normal_(0, 0.3)
    return model


def _rotary(model, hidden: torch.Tensor, start: int):
    """cos, sin [1, q, r] at positions start.. as ``StaticTarget`` asks for them (text: one position thrice)."""
    rotary, q = model.model.rotary_emb, hidden.shape[1]
    positions = torch.arange(start, start + q)[None]
    if hasattr(rotary, "mrope_section"):
        positions = positions.unsqueeze(0).expand(3, 1, q)
    return rotary(hidden, positions)


def _layers(model, kind: str):
    base = model.model
    return [(i, layer) for i, layer in enumerate(base.layers) if base.config.layer_types[i] == kind]


class _RecordingCache:
    """The transformers cache interface of one pass without past: keeps the K/V a layer writes."""

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.key, self.value = key, value
        return key, value


def _tree_mask(q: int, generator: torch.Generator) -> torch.Tensor:
    """A random visibility (each node sees itself and some earlier nodes), additive [q, q]."""
    visible = (torch.rand(q, q, generator=generator) < 0.5).tril() | torch.eye(q, dtype=torch.bool)
    return torch.zeros(q, q).masked_fill_(~visible, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("q", [1, 5])
def test_gated_attention_layer_equals_transformers_layer(request, name, q):
    model = _model(request, name, seed=q)
    generator = torch.Generator().manual_seed(q)
    hidden = torch.randn(1, q, model.config.hidden_size, generator=generator)
    cos, sin = _rotary(model, hidden, 3)  # [1, q, r]
    mask = _tree_mask(q, generator)
    for i, layer in _layers(model, "full_attention"):
        fused = fused_hybrid_layer_for(layer)
        assert isinstance(fused, GatedAttentionLayer)
        assert cos.shape[-1] < fused.head_dim  # the tiny configs rotate part of each head
        cache = _RecordingCache()
        # transformers renamed the layers' ``past_key_values`` to ``cache`` (as StaticTarget checks)
        cache_kwarg = "cache" if "cache" in inspect.signature(layer.self_attn.forward).parameters else "past_key_values"
        with torch.no_grad():
            want = layer(hidden, position_embeddings=(cos, sin), attention_mask=mask[None, None],
                         **{cache_kwarg: cache})
            kv = torch.zeros(2, 1, fused.kv_heads, q + 3, fused.head_dim)
            inputs = PassInputs.build(cos, sin, torch.arange(q), mask, fused.query_heads // fused.kv_heads)
            got = fused(hidden, inputs, kv, attend=q)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(kv[0, :, :, :q], cache.key, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(kv[1, :, :, :q], cache.value, atol=2e-5, rtol=1e-5)
        assert not kv[:, :, :, q:].any()  # nothing written past the pass's slots


class _FixedMixer(nn.Module):
    """Stands in for the token mixer: records its input, returns a fixed output."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, hidden_states, **kwargs):
        self.seen = hidden_states
        return self.out


@pytest.mark.parametrize("name", HYBRIDS)
def test_linear_layer_norms_and_mlp_equal_transformers_layer(request, name, monkeypatch):
    model = _model(request, name, seed=7)
    generator = torch.Generator().manual_seed(7)
    hidden, mixed = (torch.randn(1, 4, model.config.hidden_size, generator=generator) for _ in range(2))
    for i, layer in _layers(model, "linear_attention"):
        fused = fused_hybrid_layer_for(layer)
        assert isinstance(fused, HybridGDNLayer)
        stub = _FixedMixer(mixed)
        monkeypatch.setattr(layer, "linear_attn", stub)
        with torch.no_grad():
            want = layer(hidden, position_embeddings=None)
            got_norm, got = fused.norm(hidden), fused.finish_summed(hidden + mixed)
        torch.testing.assert_close(got_norm, stub.seen, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        assert (fused.mlp.gate_up_weight is None) == (name == "tiny_next")  # MoE keeps the module


def test_fused_weights_are_views_and_reduce_sees_each_partial_output(request):
    model = _model(request, "tiny_hybrid")
    count = sum(p.numel() for p in model.parameters())
    i, layer = _layers(model, "full_attention")[0]
    calls = []

    def reduce(partial: torch.Tensor) -> torch.Tensor:  # one process: the identity, counted
        calls.append(partial.shape)
        return partial

    plain, reduced = fused_hybrid_layer_for(layer), fused_hybrid_layer_for(layer, reduce)
    assert reduced is not plain and fused_hybrid_layer_for(layer, reduce) is reduced  # one per reduce
    assert sum(p.numel() for p in model.parameters()) == count
    attn, mlp = layer.self_attn, layer.mlp
    stacked = reduced.qkv_weight.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == stacked for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == reduced.mlp.gate_up_weight.untyped_storage().data_ptr()
    hidden = torch.randn(1, 3, model.config.hidden_size)
    cos, sin = _rotary(model, hidden, 0)
    mask = torch.zeros(3, 3).masked_fill_(torch.ones(3, 3, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    inputs = PassInputs.build(cos, sin, torch.arange(3), mask, reduced.query_heads // reduced.kv_heads)
    with torch.no_grad():
        want = plain(hidden, inputs, torch.zeros(2, 1, plain.kv_heads, 3, plain.head_dim), 3)
        got = reduced(hidden, inputs, torch.zeros(2, 1, plain.kv_heads, 3, plain.head_dim), 3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert calls == [(3, model.config.hidden_size)] * 2  # o_proj, then down_proj


@pytest.mark.parametrize("name", HYBRIDS)
def test_static_target_runs_every_hybrid_layer_fused(request, name):
    target = StaticTarget(request.getfixturevalue(name).model)
    assert target.attention_ids and all(isinstance(f, GatedAttentionLayer) for f in target.fused.values())
    assert target.gdn_ids and all(isinstance(b, HybridGDNLayer) for b in target.gdn_blocks.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_norm_equals_the_torch_form(dtype):
    from workers.models.fused_hybrid_triton import one_plus_rms_norm as kernel

    norm = nn.Module()  # what the torch form reads: .weight [N], .eps
    norm.weight, norm.eps = torch.randn(5120) * 0.3, 1e-6
    for x in (torch.randn(7, 5120, dtype=dtype) * 3,
              torch.randn(3, 12, 256, dtype=dtype)[:, 2:9]):  # strided rows (the q/k norm's input)
        small = nn.Module()
        small.weight, small.eps = norm.weight[: x.shape[-1]], norm.eps
        want = one_plus_rms_norm(x, small)  # on the CPU: the torch form
        got = kernel(x.cuda(), small.weight.cuda(), small.eps)
        assert got.is_contiguous() and got.shape == x.shape
        torch.testing.assert_close(got.cpu(), want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_kernel_equals_torch(dtype):
    from workers.models.fused_hybrid_triton import silu_mul

    generator = torch.Generator().manual_seed(1)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    gate_up = torch.randn(9, 2 * 3000, generator=generator).to("cuda", dtype) * 3
    want = torch.nn.functional.silu(gate_up[:, :3000]) * gate_up[:, 3000:]
    torch.testing.assert_close(silu_mul(gate_up), want, **tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_gate_kernel_equals_torch(dtype):
    from workers.models.fused_hybrid_triton import output_gate

    generator = torch.Generator().manual_seed(2)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    for q, hq, hkv, d in ((1, 24, 4, 256), (257, 24, 4, 256), (9, 4, 2, 64)):
        heads = (torch.randn(q, 2 * hq + 2 * hkv, d, generator=generator) * 3).to("cuda", dtype)
        out = torch.randn(q, hq * d, generator=generator).to("cuda", dtype)
        want = torch.sigmoid(heads[:, : 2 * hq].view(q, hq, 2, d)[:, :, 1]) * out.view(q, hq, d)
        torch.testing.assert_close(output_gate(out, heads, hq), want.reshape(q, hq * d), **tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 2, 8, 2), (5, 4, 2, 8, 8), (17, 24, 4, 256, 64)])  # q, Hq, Hkv, D, r
def test_heads_kernel_equals_the_torch_form(dtype, shape):
    from workers.models.fused_hybrid import norm_rotate_heads, norm_rotate_heads_torch

    q, hq, hkv, d, rotary = shape
    generator = torch.Generator().manual_seed(q)
    heads = torch.randn(q, 2 * hq + 2 * hkv, d, generator=generator).to("cuda", dtype)
    q_norm, k_norm = nn.Module(), nn.Module()
    q_norm.weight, k_norm.weight = (torch.randn(d, generator=generator).cuda() * 0.3 for _ in range(2))
    q_norm.eps = k_norm.eps = 1e-6
    angles = torch.rand(1, q, rotary // 2, generator=generator).repeat(1, 1, 2) * 6
    inputs = PassInputs.build(angles.cos().to("cuda", dtype), angles.sin().to("cuda", dtype),
                              torch.arange(3, 3 + q, device="cuda"), torch.zeros(q, 4), hq // hkv)
    results = []
    for run in (norm_rotate_heads_torch, norm_rotate_heads):
        kv = torch.zeros(2, 1, hkv, q + 5, d, dtype=dtype, device="cuda")
        results.append((run(heads, q_norm, k_norm, inputs, kv, hq, hkv), kv))
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", HYBRIDS)
def test_graph_replay_equals_eager_with_fused_layers(request, name):
    model = copy.deepcopy(request.getfixturevalue(name).model).cuda()
    eager, graphed = StaticTarget(model, graphs=False), StaticTarget(model, graphs=True)
    assert all(isinstance(f, GatedAttentionLayer) for f in graphed.fused.values())
    prompt = torch.randint(1, 6, (1, 11), generator=torch.Generator().manual_seed(0)).cuda()
    outputs = []
    for target in (eager, graphed):
        target.start(capacity=64, max_verify=16)
        with torch.no_grad():
            target.prefill(prompt)
            first = target.verify_chain(torch.tensor([1, 2, 3, 4], device="cuda")).logits.clone()
            target.commit(torch.tensor([0, 1], device="cuda"))
            second = target.verify_chain(torch.tensor([5, 1, 2], device="cuda")).logits.clone()
        outputs.append((first, second))
    for got, want in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
