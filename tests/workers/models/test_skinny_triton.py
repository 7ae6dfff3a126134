"""The few-rows product kernel (``workers.models.skinny_triton``) on a GPU against cuBLAS, the plain
product and the in-place residual sum (GPU only; skipped on CPU machines): in bfloat16 at the real
models' widths, directly and through the layers' own calls.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize(("width", "inner"), [(6144, 4096), (1000, 5120)])
@torch.inference_mode()
def test_the_kernel_equals_cublas_through_the_layers_calls(rows, width, inner):
    """``fused_layer.product`` (the kernel at one row) and ``add_projection_`` (the kernel from 2 rows on)
    against cuBLAS's product and in-place sum, and the kernel itself at every row count with every
    tile choice."""
    from workers.models import skinny_triton
    from workers.models.fused_layer import add_projection_, product

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, inner, device="cuda", generator=g).bfloat16() * 2
    weight = (torch.randn(width, inner, device="cuda", generator=g) * inner**-0.5).bfloat16()
    assert skinny_triton.takes(x, weight) == (torch.cuda.get_device_capability() in skinny_triton.FASTER_ON)
    want = F.linear(x, weight)
    assert relative(product(x, weight), want) < 1e-2
    for tiles in skinny_triton.TILES[skinny_triton.tile_class(rows, inner)]:
        assert relative(skinny_triton.skinny_linear(x, weight, tiles=tiles), want) < 1e-2
    down = nn.Linear(width, inner, bias=False, device="cuda", dtype=torch.bfloat16)
    activated = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
    residual = torch.randn(rows, inner, device="cuda", generator=g).bfloat16()
    want = residual.clone().addmm_(activated, down.weight.t())
    got = add_projection_(residual, activated, down)
    assert got is residual and relative(got, want) < 1e-2


@torch.inference_mode()
def test_the_kernel_declines_what_it_cannot_run(monkeypatch):
    from workers.models import skinny_triton

    monkeypatch.setattr(skinny_triton, "FASTER_ON", frozenset({torch.cuda.get_device_capability()}))
    weight = torch.zeros(64, 512, device="cuda", dtype=torch.bfloat16)
    assert not skinny_triton.takes(torch.zeros(17, 512, device="cuda", dtype=torch.bfloat16), weight)  # rows
    assert not skinny_triton.takes(torch.zeros(2, 512, device="cuda"), weight.float())  # float32
    narrow = torch.zeros(64, 320, device="cuda", dtype=torch.bfloat16)
    assert not skinny_triton.takes(torch.zeros(2, 320, device="cuda", dtype=torch.bfloat16), narrow)  # K
    assert not skinny_triton.takes(torch.zeros(2, 512, dtype=torch.bfloat16), weight.cpu())  # the CPU
    assert skinny_triton.takes(torch.zeros(2, 512, device="cuda", dtype=torch.bfloat16), weight)
    monkeypatch.setattr(skinny_triton, "FASTER_ON", frozenset())  # a GPU it was not timed on
    assert not skinny_triton.takes(torch.zeros(2, 512, device="cuda", dtype=torch.bfloat16), weight)


@pytest.mark.parametrize("one_plus", [False, True])
@pytest.mark.parametrize(("width", "inner"), [(6144, 4096), (34816, 5120)])
@torch.inference_mode()
def test_the_norm_inside_the_one_row_product_equals_norm_then_product(one_plus, width, inner):
    """``fused_layer.norm_linear`` at one row (the norm inside the kernel's product where it takes it)
    against transformers' norm module, then cuBLAS, for Qwen3's plain norm and Qwen3.5's (1 + w) one,
    with the SiLU product after it too; at two rows (the norm kernel, then cuBLAS) as before."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from workers.models.fused_layer import norm_linear

    g = torch.Generator(device="cuda").manual_seed(width)
    norm = (Qwen3_5RMSNorm if one_plus else Qwen3RMSNorm)(inner, eps=1e-6).to("cuda", torch.bfloat16)
    norm.weight.copy_(torch.randn(inner, device="cuda", generator=g) * 0.1 + (0.0 if one_plus else 1.0))
    weight = (torch.randn(width, inner, device="cuda", generator=g) * inner**-0.5).bfloat16()
    for rows in (1, 2):
        x = torch.randn(rows, inner, device="cuda", generator=g).bfloat16() * 3
        want = F.linear(norm(x), weight)
        assert relative(norm_linear(x, norm, weight, one_plus=one_plus), want) < 1e-2
        inner_half = width // 2
        activated = F.silu(want[:, :inner_half].float()) * want[:, inner_half:].float()
        assert relative(norm_linear(x, norm, weight, silu=True, one_plus=one_plus), activated) < 2e-2


@pytest.mark.parametrize(("width", "inner"), [(4096, 12288), (5120, 6144)])
@torch.inference_mode()
def test_the_split_one_row_sum_is_exact_run_to_run_and_replays_in_a_graph(width, inner):
    """The one-row residual sum split along K (a decode step's o_proj / down_proj): against cuBLAS's
    addmm_ at every split count, bit for bit the same on every call (the splits are added in their
    order, whichever arrives last), and the same again replayed from a CUDA graph."""
    from workers.models import skinny_triton
    from workers.models.fused_layer import add_projection_

    g = torch.Generator(device="cuda").manual_seed(width)
    down = nn.Linear(inner, width, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, inner, device="cuda", generator=g).bfloat16()
    start = torch.randn(1, width, device="cuda", generator=g).bfloat16()
    want = start.clone().addmm_(x, down.weight.t())
    for splits in (1, 2, 4, 8):
        got = skinny_triton.skinny_linear(x, down.weight, out=start.clone(), splits=splits)
        assert relative(got, want) < 1e-2, splits
    first = add_projection_(start.clone(), x, down)
    assert relative(first, want) < 1e-2
    for _ in range(5):
        assert torch.equal(add_projection_(start.clone(), x, down), first)
    residual = start.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_projection_(residual, x, down)
    for _ in range(3):
        residual.copy_(start)
        graph.replay()
        assert torch.equal(residual, first)
