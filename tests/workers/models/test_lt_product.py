"""cuBLASLt products with a timed choice of algorithm (``workers.models.lt_product``) against torch's
own. On a GPU with nvmath-python (GPU-marked, skipped elsewhere): every algorithm the heuristic offers
computes the product, and so does torch's call split along N; the layers' calls take the chosen one, a
choice stays for the process (the same bits eagerly and in a replayed graph), shapes are timed only
inside ``choosing()`` (a graph capture's warm-ups), and a shape first met elsewhere or inside a capture
keeps torch's call. On any machine: the CPU path never reaches it, and where a split may cut N.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workers.models import lt_product

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def fresh(monkeypatch):
    """lt_product with no choices made yet (restored after the test)."""
    monkeypatch.setattr(lt_product, "_CHOSEN", {})
    monkeypatch.setattr(lt_product, "_TIMES", {})
    return lt_product


@pytest.fixture
def lt(fresh):
    if not fresh.available():
        pytest.skip("needs nvmath-python (the gpu extra)")
    return fresh


def test_the_cpu_path_never_reaches_it(fresh):
    """Products of many rows on the CPU are torch's, whether or not shapes are being chosen."""
    from workers.models.fused_layer import add_projection_, product

    x, weight = torch.randn(40, 24), torch.randn(32, 24)
    with fresh.choosing():
        assert torch.equal(product(x, weight), F.linear(x, weight))
        residual = torch.randn(40, 32)
        down = nn.Linear(24, 32, bias=False)
        assert torch.allclose(add_projection_(residual.clone(), x, down), residual + F.linear(x, down.weight))
    assert not fresh.takes(x, weight) and fresh.linear(x, weight) is None
    assert fresh._CHOSEN == {}


def test_choosing_nests():
    assert lt_product._choosing == 0
    with lt_product.choosing():
        with lt_product.choosing():
            assert lt_product._choosing == 2
        assert lt_product._choosing == 1
    assert lt_product._choosing == 0


def test_split_points_fill_whole_waves_of_the_sms():
    """A split's first part is whole waves of some tile (SPLIT_SIDES wide, in 1-3 blocks of rows) on this
    many SMs, a third of N or more, leaving SPLIT_LEAST or more; the H200's (132 SMs) fastest cuts of
    the 27B gate/up (N = 34816 at 257 rows: 66 tiles 192 wide, two blocks of rows) and the 8B gate/up (N =
    24576: 132 x 128) are among them, and narrow products have none."""
    assert 12672 in lt_product.split_points(34816, 132) and 16896 in lt_product.split_points(24576, 132)
    for width, sms in ((34816, 132), (14336, 132), (248320, 132), (34816, 84)):
        points = lt_product.split_points(width, sms)
        assert points and all(width / 3 <= at <= width - lt_product.SPLIT_LEAST for at in points)
        assert all(any(at % ((sms // blocks) * side) == 0 for side in lt_product.SPLIT_SIDES
                       for blocks in lt_product.SPLIT_ROW_BLOCKS) for at in points)
    assert lt_product.split_points(5120, 132) == [] and lt_product.split_points(4096, 84) == []


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def operands(rows: int, width: int, inner: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, inner, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(width, inner, device="cuda", generator=g) * inner**-0.5).bfloat16()
    residual = torch.randn(rows, width, device="cuda", generator=g).bfloat16()
    return x, weight, residual


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [17, 257])
@pytest.mark.parametrize(("width", "inner"), [(4096, 12288), (6144, 4096), (1000, 4096)])
@pytest.mark.parametrize("add", [False, True])
@torch.inference_mode()
def test_every_offered_algorithm_computes_the_product(lt, rows, width, inner, add):
    """The descriptors' layouts are torch's: each algorithm of the heuristic's list and each fitted one,
    run through them, gives F.linear's product (or the residual plus it) within bfloat16's rounding."""
    x, weight, residual = operands(rows, width, inner, rows + width)
    want = residual.clone().addmm_(x, weight.t()) if add else F.linear(x, weight)
    plan = lt.LtProduct(rows, width, inner, torch.bfloat16, add)
    offered = plan.heuristic(lt.CANDIDATES)
    assert offered
    made = lt.fitted(plan, offered[0], rows)
    assert made and all(algo.config()["splitk_num"] == 1 for algo in made)
    for algo in offered + made:
        out = residual.clone() if add else torch.full_like(residual, float("nan"))  # beta = 0 ignores it
        assert relative(plan.run(x, weight, out, algo), want) < 1e-2, algo.describe()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("at", [1024, 4096, 7168])
@pytest.mark.parametrize("add", [False, True])
@torch.inference_mode()
def test_a_split_computes_the_product(at, add):
    """torch's call in two, into column slices of one output: F.linear's product (or the residual plus
    it), every column written once."""
    x, weight, residual = operands(257, 8192, 1024, at)
    want = residual.clone().addmm_(x, weight.t()) if add else F.linear(x, weight)
    out = residual.clone() if add else torch.full_like(residual, float("nan"))
    got = lt_product.Split(at, add).run(x, weight, out)
    assert got is out and relative(got, want) < 1e-2


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_a_chosen_split_keeps_its_bits_in_a_graph(lt, monkeypatch):
    """With no cuBLASLt algorithm offered and every candidate counted faster, the chooser keeps a split;
    the layers' product runs it, and a replayed graph gives the eager bits."""
    from workers.models.fused_layer import product

    monkeypatch.setattr(lt, "MARGIN", -1.0)
    monkeypatch.setattr(lt.LtProduct, "heuristic", lambda self, count: [])
    x, weight, _ = operands(257, 34816, 256)
    with lt.choosing():
        got = product(x, weight)
    ((key, chosen),) = lt._CHOSEN.items()
    assert isinstance(chosen, lt.Split) and lt._TIMES[key][2] == chosen.source
    assert relative(got, F.linear(x, weight)) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = product(x, weight)
    graph.replay()
    assert torch.equal(out, got)


@pytest.mark.gpu
@needs_cuda
def test_fitted_tiles_pad_the_rows_least(lt):
    """At a verify's 257 rows the tiles 136 and 88 rows wide (two and three blocks, 15 and 7 rows of
    padding) are among the fitted; 128 and 256 (a third or second block for one row) and the narrow
    ones are not; at 17 rows a 24-wide tile is."""
    sides = {tile: (side, width) for tile, side, width in lt._tiles()}
    at_257 = {sides[tile] for tile in lt.fitted_tiles(257)}
    assert {(64, 136), (128, 88), (128, 264)} <= at_257
    assert not at_257 & {(128, 128), (128, 256), (64, 8)} and min(width for _, width in at_257) >= 64
    assert {side for side, _ in at_257} <= set(lt.FIT_SIDES)
    assert (128, 24) in {sides[tile] for tile in lt.fitted_tiles(17)}


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_the_layers_calls_take_the_chosen_algorithm_and_keep_it(lt, monkeypatch):
    """With every algorithm counted faster (MARGIN below -1), ``product`` and ``add_projection_`` at 257
    rows, met first inside ``choosing()``, run cuBLASLt's: right results, one choice per shape, and the
    same bits on later calls (outside it) and in a replayed CUDA graph."""
    from workers.models.fused_layer import add_projection_, product

    monkeypatch.setattr(lt, "MARGIN", -1.0)
    x, weight, residual = operands(257, 4096, 4096)
    down = nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    start = residual.clone()
    with lt.choosing():
        got = product(x, weight)
        summed = add_projection_(residual, x, down)
    assert relative(got, F.linear(x, weight)) < 1e-2
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


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_a_graph_captures_warm_ups_choose_and_its_replays_use_the_choice(lt, monkeypatch):
    """``graph_cache.capture``: the warm-up calls time a shape not met before; the replayed graph then
    gives what an eager call of the same shape gives, bit for bit."""
    from workers.models.fused_layer import product
    from workers.models.graph_cache import capture

    monkeypatch.setattr(lt, "MARGIN", -1.0)
    x, weight, _ = operands(129, 2048, 1024)
    graph, out = capture(lambda: product(x, weight))
    ((key, chosen),) = lt._CHOSEN.items()
    assert key[1:4] == (129, 2048, 1024) and chosen is not None and key in lt._TIMES
    graph.replay()
    assert torch.equal(out, product(x, weight)) and relative(out, F.linear(x, weight)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_a_shape_first_met_outside_choosing_or_in_a_capture_keeps_torchs_call(lt, monkeypatch):
    """A prompt's last chunk (any length, eagerly) must not be timed inside timed runs; nothing can be
    timed inside a capture; and either decision stays, inside ``choosing()`` later too."""
    monkeypatch.setattr(lt, "MARGIN", -1.0)
    x, weight, _ = operands(33, 1024, 1024)
    assert lt.linear(x, weight) is None
    with lt.choosing():
        assert lt.linear(x, weight) is None
    assert lt._CHOSEN == {(x.device.index, 33, 1024, 1024, False, torch.bfloat16): None} and not lt._TIMES

    y, other, _ = operands(34, 1024, 1024)
    graph = torch.cuda.CUDAGraph()
    with lt.choosing(), torch.cuda.graph(graph):
        assert lt.linear(y, other) is None
    assert lt._CHOSEN[(y.device.index, 34, 1024, 1024, False, torch.bfloat16)] is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("timing", ["eager", "graph"])
@torch.inference_mode()
def test_the_choice_beats_torch_by_the_margin_or_is_torchs(lt, timing, monkeypatch):
    """An honest timing (the module's own margin): whatever it keeps, it timed faster than torch's call by
    MARGIN; what it does not keep runs torch's call. Timed eagerly and as graph replays (``TIMING``: the
    whole candidate list captured and replayed, splits and workspace algorithms among them)."""
    monkeypatch.setattr(lt, "TIMING", timing)
    x, weight, _ = operands(257, 4096, 12288)
    with lt.choosing():
        result = lt.linear(x, weight)
    ((key, chosen),) = lt._CHOSEN.items()
    torch_ms, best_ms, _ = lt._TIMES[key]
    if chosen is None:
        assert result is None and best_ms >= (1 - lt.MARGIN) * torch_ms
    else:
        assert best_ms < (1 - lt.MARGIN) * torch_ms and relative(result, F.linear(x, weight)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_operands_it_cannot_take_go_to_torch(lt, monkeypatch):
    x, weight, _ = operands(64, 512, 512)
    assert lt.takes(x, weight)
    assert not lt.takes(x.float(), weight.float())
    assert not lt.takes(x.t().contiguous().t(), weight)  # columns contiguous
    assert not lt.takes(x[:, 1:-7], weight[:, 1:-7])  # rows not contiguous
    assert not lt.takes(x.cpu(), weight.cpu())
    with lt.choosing():
        assert lt.linear(x.float(), weight.float()) is None and not lt._CHOSEN
    monkeypatch.setattr(lt, "ENABLED", False)
    assert not lt.takes(x, weight)


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_candidates_timed_as_graph_replays(lt):
    """``time_graphs``: a product of four times the work times longer than one of the work, and each call's
    time is positive once the graph of the L2 reads alone is taken off."""
    x, weight, _ = operands(257, 4096, 4096)
    wide = torch.cat([weight] * 4)
    out, out_wide = x.new_empty(257, 4096), x.new_empty(257, 4 * 4096)
    small, large = lt.time_graphs([lambda: torch.mm(x, weight.t(), out=out),
                                   lambda: torch.mm(x, wide.t(), out=out_wide)], x.device)
    assert 0 < small < large


def test_off_cuda_the_graph_timing_is_the_host_clocks():
    calls = [lambda: torch.ones(8).sum(), lambda: torch.ones(8).sum()]
    assert len(lt_product.time_graphs(calls, torch.device("cpu"), rounds=3)) == 2
