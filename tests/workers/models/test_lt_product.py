"""cuBLASLt products with a timed choice of algorithm (``workers.models.lt_product``) on a GPU against
torch's own (GPU only, with nvmath-python; skipped elsewhere): every algorithm the heuristic offers
computes the product, the layers' calls take the chosen one, a choice stays for the process (the same
bits eagerly and in a replayed graph), and a shape first met inside a capture keeps torch's call.
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


@pytest.fixture
def lt(monkeypatch):
    from workers.models import lt_product

    if not lt_product.available():
        pytest.skip("needs nvmath-python (the gpu extra)")
    monkeypatch.setattr(lt_product, "_CHOSEN", {})
    monkeypatch.setattr(lt_product, "_TIMES", {})
    return lt_product


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def operands(rows: int, width: int, inner: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, inner, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(width, inner, device="cuda", generator=g) * inner**-0.5).bfloat16()
    residual = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
    return x, weight, residual


@pytest.mark.parametrize("rows", [17, 257])
@pytest.mark.parametrize(("width", "inner"), [(4096, 12288), (6144, 4096), (1000, 4096)])
@pytest.mark.parametrize("add", [False, True])
@torch.inference_mode()
def test_every_offered_algorithm_computes_the_product(lt, rows, width, inner, add):
    """The descriptors' layouts are torch's: each algorithm of the heuristic's list, run through them, gives
    F.linear's product (or the residual plus it) within bfloat16's rounding."""
    x, weight, residual = operands(rows, width, inner, rows + width)
    want = residual.clone().addmm_(x, weight.t()) if add else F.linear(x, weight)
    plan = lt.LtProduct(rows, width, inner, torch.bfloat16, add)
    offered = plan.heuristic(lt.CANDIDATES)
    assert offered
    for algo in offered:
        out = residual.clone() if add else torch.full_like(residual, float("nan"))  # beta = 0 ignores it
        assert relative(plan.run(x, weight, out, algo), want) < 1e-2, algo.describe()


@torch.inference_mode()
def test_the_layers_calls_take_the_chosen_algorithm_and_keep_it(lt, monkeypatch):
    """With every algorithm counted faster (MARGIN below -1), ``product`` and ``add_projection_`` at 257
    rows run cuBLASLt's: right results, one choice per shape, and the same bits on later calls and in a
    replayed CUDA graph."""
    from workers.models.fused_layer import add_projection_, product

    monkeypatch.setattr(lt, "MARGIN", -1.0)
    x, weight, residual = operands(257, 4096, 4096)
    got = product(x, weight)
    assert relative(got, F.linear(x, weight)) < 1e-2
    down = nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    start = residual.clone()
    summed = add_projection_(residual, x, down)
    assert summed is residual and relative(summed, start.clone().addmm_(x, down.weight.t())) < 1e-2
    assert len(lt._CHOSEN) == 2 and all(chosen is not None for chosen in lt._CHOSEN.values())
    assert len(lt.report()) == 2
    kept = dict(lt._CHOSEN)
    assert torch.equal(product(x, weight), got)
    residual.copy_(start)
    assert torch.equal(add_projection_(residual, x, down), summed)
    assert lt._CHOSEN == kept  # no second timing

    outputs = {}
    graph = torch.cuda.CUDAGraph()
    residual.copy_(start)
    with torch.cuda.graph(graph):
        outputs["product"] = product(x, weight)
        outputs["sum"] = add_projection_(residual, x, down)
    for _ in range(2):
        residual.copy_(start)
        graph.replay()
        assert torch.equal(outputs["product"], got) and torch.equal(outputs["sum"], summed)


@torch.inference_mode()
def test_a_shape_first_met_in_a_capture_keeps_torchs_call(lt):
    x, weight, _ = operands(33, 1024, 1024)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert lt.linear(x, weight) is None
    assert lt._CHOSEN == {(x.device.index, 33, 1024, 1024, False, torch.bfloat16): None}
    assert lt.linear(x, weight) is None  # and stays so outside it: graphs and eager passes agree


@torch.inference_mode()
def test_the_choice_beats_torch_by_the_margin_or_is_torchs(lt):
    """An honest timing (the module's own margin): whatever it keeps, it timed faster than torch's call by
    MARGIN; what it does not keep runs torch's call."""
    x, weight, _ = operands(257, 4096, 12288)
    result = lt.linear(x, weight)
    ((key, chosen),) = lt._CHOSEN.items()
    torch_ms, best_ms, _ = lt._TIMES[key]
    if chosen is None:
        assert result is None and best_ms >= (1 - lt.MARGIN) * torch_ms
    else:
        assert best_ms < (1 - lt.MARGIN) * torch_ms and relative(result, F.linear(x, weight)) < 1e-2


@torch.inference_mode()
def test_operands_it_cannot_take_go_to_torch(lt, monkeypatch):
    x, weight, _ = operands(64, 512, 512)
    assert lt.takes(x, weight)
    assert not lt.takes(x.float(), weight.float())
    assert not lt.takes(x.t().contiguous().t(), weight)  # columns contiguous
    assert not lt.takes(x[:, 1:-7], weight[:, 1:-7])  # rows not contiguous
    assert not lt.takes(x.cpu(), weight.cpu())
    assert lt.linear(x.float(), weight.float()) is None and not lt._CHOSEN
    monkeypatch.setattr(lt, "ENABLED", False)
    assert not lt.takes(x, weight)
