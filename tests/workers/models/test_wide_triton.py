"""The wide verify's product kernel (``workers.models.wide_triton``) on a GPU against cuBLAS, the plain
product and the in-place residual sum (GPU only; skipped on CPU machines): in bfloat16 at the real
models' widths, directly and through the layers' own calls, the split sums the same bits on every
call and graph replay.
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


@pytest.mark.parametrize("rows", [256, 257, 272])
@pytest.mark.parametrize(("width", "inner"), [(4096, 12288), (6144, 5120), (1000, 4096)])
@torch.inference_mode()
def test_the_kernel_equals_cublas_through_the_layers_calls(rows, width, inner, monkeypatch):
    """``fused_layer.product`` and ``add_projection_`` with the kernel on (as ``gpu_speed.py --wide-triton``
    runs them) against cuBLAS's product and in-place sum, and the kernel itself with 1 split and with its
    own count."""
    from workers.models import wide_triton
    from workers.models.fused_layer import add_projection_, product

    monkeypatch.setattr(wide_triton, "FASTER_ON", frozenset({torch.cuda.get_device_capability()}))
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    x = torch.randn(rows, inner, device="cuda", generator=g).bfloat16() * 2
    weight = (torch.randn(width, inner, device="cuda", generator=g) * inner**-0.5).bfloat16()
    assert wide_triton.takes(x, weight)
    want = F.linear(x, weight)
    assert relative(product(x, weight), want) < 1e-2
    for splits in (1, None):
        assert relative(wide_triton.wide_linear(x, weight, splits=splits), want) < 1e-2
    down = nn.Linear(inner, width, bias=False, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
    want = residual.clone().addmm_(x, down.weight.t())
    got = add_projection_(residual, x, down)
    assert got is residual and relative(got, want) < 1e-2


@torch.inference_mode()
def test_the_split_sum_is_the_same_bits_on_every_call_and_replay():
    """K split in 4 (each split's sums aside, the last to arrive adding them in order): six calls and three
    graph replays of the in-place sum at 257 rows give the same bits, whichever split finished last."""
    from workers.models.wide_triton import wide_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(257, 4096, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(4096, 4096, device="cuda", generator=g) * 4096**-0.5).bfloat16()
    start = torch.randn(257, 4096, device="cuda", generator=g).bfloat16()
    results = []
    out = start.clone()
    for _ in range(6):
        out.copy_(start)
        results.append(wide_linear(x, weight, out=out, splits=4).clone())
    graph = torch.cuda.CUDAGraph()
    out.copy_(start)
    wide_linear(x, weight, out=out, splits=4)  # compiled before the capture
    with torch.cuda.graph(graph):
        wide_linear(x, weight, out=out, splits=4)
    for _ in range(3):
        out.copy_(start)
        graph.replay()
        results.append(out.clone())
    assert all(torch.equal(r, results[0]) for r in results)
    assert relative(results[0], start.clone().addmm_(x, weight.t())) < 1e-2


@torch.inference_mode()
def test_the_kernel_declines_what_it_cannot_run(monkeypatch):
    from workers.models import wide_triton

    monkeypatch.setattr(wide_triton, "FASTER_ON", frozenset({torch.cuda.get_device_capability()}))
    weight = torch.zeros(64, 512, device="cuda", dtype=torch.bfloat16)
    rows = torch.zeros(257, 512, device="cuda", dtype=torch.bfloat16)
    assert wide_triton.takes(rows, weight)
    assert not wide_triton.takes(rows[:255], weight) and not wide_triton.takes(torch.cat((rows, rows)), weight)
    assert not wide_triton.takes(rows.float(), weight.float())  # float32
    assert not wide_triton.takes(torch.zeros(257, 352, device="cuda", dtype=torch.bfloat16),
                                 torch.zeros(64, 352, device="cuda", dtype=torch.bfloat16))  # K
    assert not wide_triton.takes(rows.cpu(), weight.cpu())  # the CPU
    shifted = torch.zeros(257 * 512 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(257, 512)
    assert not wide_triton.takes(shifted, weight)  # x not 16-byte aligned (TMA)
    monkeypatch.setattr(wide_triton, "FASTER_ON", frozenset())  # a GPU it was not timed on
    assert not wide_triton.takes(rows, weight)
