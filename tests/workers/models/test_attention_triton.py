"""The verify pass's Triton attention against SDPA (GPU only; skipped on CPU machines).

Folded rows of a pass (query heads per K/V head x nodes) over a fixed-capacity K/V buffer with the
runner's additive mask: the kernel must give SDPA's outputs, with its keys split or not, and must
not read a key after the pass's last slot (those are NaN here).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.kernel_inputs import attention_pass_inputs as pass_inputs
from workers.models.attention import attend_folded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "groups", "q", "capacity", "length", "dim"),
                         [(4, 6, 257, 2000, 1024, 256), (4, 6, 100, 700, 0, 256), (8, 4, 300, 1500, 333, 128),
                          (2, 8, 1025, 2100, 1000, 128),
                          # a decode step's few rows (16 and 32 rows a program): Qwen3-8B's and Qwen3.6-27B's heads
                          (8, 4, 1, 3072, 1024, 128), (4, 6, 1, 2000, 1024, 256), (4, 6, 3, 700, 5, 256),
                          (8, 4, 2, 300, 0, 128)])
@pytest.mark.parametrize("by_descriptor", [True, False])
@torch.inference_mode()
def test_triton_attention_equals_sdpa_and_stops_at_the_last_slot(dtype, heads, groups, q, capacity, length, dim,
                                                                 by_descriptor, monkeypatch):
    """Whole K/V tiles by TMA (Hopper's default; block pointers on an older GPU) and by block pointers."""
    from workers.models import attention_triton
    from workers.models.attention_triton import attend_until

    monkeypatch.setattr(attention_triton, "BY_DESCRIPTOR", by_descriptor)

    query, key, value, mask, slots, ends = pass_inputs(heads, groups, q, capacity, length, dim, dtype, q, ends=True)
    end = length + q
    want = attend_folded(query, key[:, :end], value[:, :end], mask[:, :end], dim**-0.5).float()
    results = {}
    for splits in (None, 1, 3):
        got = attend_until(query, key, value, mask, slots, dim**-0.5, splits=splits).float()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert ((got - want).norm() / want.norm()).item() < 5e-3
        results[splits] = got
    for programs in (7, 500):  # the work shared: a program holding parts of up to 4 items; more than tiles
        got = attend_until(query, key, value, mask, slots, dim**-0.5, programs=programs).float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert ((got - want).norm() / want.norm()).item() < 5e-3
    # the route the fused layers take: attend_folded with the slots, in o_proj's layout [q, Hq*D]
    routed = attend_folded(query, key, value, mask, dim**-0.5, slots=slots, nodes=q).float()
    assert torch.equal(routed, results[None].reshape(heads * groups, q, dim).transpose(0, 1).reshape(q, -1))
    # each block of rows stopping at its nodes' furthest key (the target passes' form)
    bounded = attend_folded(query, key, value, mask, dim**-0.5, slots=slots, nodes=q, ends=ends).float()
    by_node = want.reshape(heads * groups, q, dim).transpose(0, 1).reshape(q, -1)
    torch.testing.assert_close(bounded, by_node, atol=2e-2, rtol=2e-2)
    assert ((bounded - by_node).norm() / by_node.norm()).item() < 5e-3
    with attention_triton.sharing(True):  # among one round of resident programs, as passes would run it
        shared = attend_folded(query, key, value, mask, dim**-0.5, slots=slots, nodes=q, ends=ends).float()
    torch.testing.assert_close(shared, by_node, atol=2e-2, rtol=2e-2)
    assert ((shared - by_node).norm() / by_node.norm()).item() < 5e-3


@pytest.mark.parametrize(("heads", "groups", "dim"), [(8, 4, 128), (4, 6, 256)])
@pytest.mark.parametrize("by_descriptor", [True, False])
@torch.inference_mode()
def test_a_prompt_chunk_reads_only_its_causal_keys(heads, groups, dim, by_descriptor, monkeypatch):
    """A 1024-token prompt chunk after nothing (causal: each block of rows stops at its last node) and
    after 1000 tokens, each K/V form, against SDPA over exactly the visible keys."""
    from workers.models import attention_triton

    monkeypatch.setattr(attention_triton, "BY_DESCRIPTOR", by_descriptor)
    for length in (0, 1000):
        query, key, value, mask, slots, ends = pass_inputs(heads, groups, 1024, 2048 + 64, length, dim,
                                                           torch.bfloat16, length, causal=True, ends=True)
        end = length + 1024
        want = attend_folded(query, key[:, :end], value[:, :end], mask[:, :end], dim**-0.5).float()
        want = want.reshape(heads * groups, 1024, dim).transpose(0, 1).reshape(1024, -1)
        got = attend_folded(query, key, value, mask, dim**-0.5, slots=slots, nodes=1024, ends=ends).float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert ((got - want).norm() / want.norm()).item() < 5e-3


@torch.inference_mode()
def test_tiles_too_large_for_the_gpu_fall_back_to_sdpa(monkeypatch):
    """A GPU without the shared memory for any of the tiles (the kernel fails to compile with each):
    attend_folded gives SDPA's result and stops trying the kernel on that device and head size."""
    from workers.models import attention_triton

    query, key, value, mask, slots = pass_inputs(4, 6, 100, 700, 50, 128, torch.bfloat16, 0)
    want = attend_folded(query, key[:, :150], value[:, :150], mask[:, :150], 128**-0.5)
    too_large = ((64, 2048, 8, 2), (64, 1024, 8, 2))  # K/V tiles over any GPU's limit
    monkeypatch.setattr(attention_triton, "TILES", {128: too_large, 256: too_large})
    monkeypatch.setattr(attention_triton, "_CHOSEN", {})
    got = attend_folded(query, torch.nan_to_num(key), torch.nan_to_num(value), mask, 128**-0.5, slots=slots)
    torch.testing.assert_close(got, want)
    assert not attention_triton.supports(query, key)


@torch.inference_mode()
def test_tiles_too_large_for_the_gpu_fall_back_to_the_next_tiles(monkeypatch):
    """Tiles over the GPU's shared memory, then tiles that fit: the kernel runs with the second (as an
    RTX A6000 does with the default tiles at D = 256) and keeps them for the device and head size."""
    from workers.models import attention_triton

    query, key, value, mask, slots = pass_inputs(4, 6, 100, 700, 50, 128, torch.bfloat16, 0)
    want = attend_folded(query, key[:, :150], value[:, :150], mask[:, :150], 128**-0.5)
    monkeypatch.setattr(attention_triton, "TILES", {128: ((64, 1024, 8, 2), (64, 32, 4, 2)), 256: ()})
    monkeypatch.setattr(attention_triton, "_CHOSEN", {})
    got = attention_triton.attend_until(query, key, value, mask, slots, 128**-0.5)
    assert got is not None and attention_triton._CHOSEN == {(str(query.device), 128, 128): (64, 32, 4, 2)}
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("heads", "groups", "dim"), [(8, 4, 128), (4, 6, 256)])
@torch.inference_mode()
def test_the_shared_work_replays_at_another_length(heads, groups, dim):
    """The work shared among resident programs, captured in a CUDA graph after 300 committed tokens and
    replayed after 1100 (the slots, ends, mask and K/V moved on in place; keys after the pass NaN): the
    shares are worked out on the device, so the replay gives the bits of an eager call at the new length
    (Qwen3-8B's and Qwen3.6-27B's head layouts, 257 nodes)."""
    from workers.models import attention_triton

    q, capacity = 257, 2048
    first, later = (pass_inputs(heads, groups, q, capacity, length, dim, torch.bfloat16, length, ends=True)
                    for length in (300, 1100))
    static = [tensor.clone() for tensor in first]

    def call():
        query, key, value, mask, slots, ends = static
        return attention_triton.attend_until(query, key, value, mask, slots, dim**-0.5, nodes=q, ends=ends)

    with attention_triton.sharing(True):
        call()  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for tensor, value in zip(static, later):
            tensor.copy_(value)
        graph.replay()
        eager = call()
    assert torch.equal(out, eager)
    end = 1100 + q
    query, key, value, mask = later[:4]
    want = attend_folded(query, key[:, :end], value[:, :end], mask[:, :end], dim**-0.5).float()
    want = want.reshape(heads * groups, q, dim).transpose(0, 1).reshape(q, -1)
    assert ((out.float() - want).norm() / want.norm()).item() < 5e-3


@pytest.mark.parametrize(("heads", "groups", "dim"), [(8, 4, 128), (4, 6, 256)])
@torch.inference_mode()
def test_the_form_chosen_on_trial_is_the_one_a_graph_replays(heads, groups, dim, monkeypatch):
    """``SHARED`` None: a 257-node pass captured by ``graph_cache.capture`` (its warm-ups inside
    ``lt_product.choosing()``) has its form chosen on trial there, kept (``report``), and the replay after
    1100 committed tokens gives the bits of an eager call of that form at the new length, and SDPA's values."""
    from workers.models import attention_triton, graph_cache

    monkeypatch.setattr(attention_triton, "SHARED", None)
    monkeypatch.setattr(attention_triton, "_FORMS", {})
    monkeypatch.setattr(attention_triton, "_TRIALS", {})
    q, capacity = 257, 2048
    first, later = (pass_inputs(heads, groups, q, capacity, length, dim, torch.bfloat16, length, ends=True)
                    for length in (300, 1100))
    static = [tensor.clone() for tensor in first]

    def call(shared=None):
        query, key, value, mask, slots, ends = static
        return attention_triton.attend_until(query, key, value, mask, slots, dim**-0.5, nodes=q, ends=ends,
                                             shared=shared)

    graph, out = graph_cache.capture(call)
    [line] = attention_triton.report()
    shared = line.endswith("-> shared")
    for tensor, value in zip(static, later):
        tensor.copy_(value)
    graph.replay()
    assert torch.equal(out, call()) and torch.equal(out, call(shared))
    end = 1100 + q
    query, key, value, mask = later[:4]
    want = attend_folded(query, key[:, :end], value[:, :end], mask[:, :end], dim**-0.5).float()
    want = want.reshape(heads * groups, q, dim).transpose(0, 1).reshape(q, -1)
    assert ((out.float() - want).norm() / want.norm()).item() < 5e-3
