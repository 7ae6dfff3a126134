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
