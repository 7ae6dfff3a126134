"""Programmatic dependent launch of the Triton kernels (``workers.models.pdl_triton``).

Without a GPU (needs triton; ``make test-kernels`` runs it): every kernel of the project takes the
``PDL`` switch and waits for its inputs before its first memory access, so launching any of them
early is safe; the switch is off outside ``kernels.dependent_launches``, on the CPU and under
``WORKERS_PDL=0``. GPU-marked: on Hopper the compiled kernel carries both grid-dependency
instructions and the launch flag, and a CUDA graph of kernels that each read the one before's
output, launched early, gives the bits of the same kernels run eagerly without PDL. (The target's
AR step, captured with PDL, gives the eager tokens in ``test_graphs``.)
"""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

from workers.decoding import tree_triton  # noqa: E402
from workers.models import (  # noqa: E402
    attention_triton,
    fused_hybrid_triton,
    gdn_triton,
    pdl_triton,
    skinny_triton,
    tree_shape_triton,
    wide_triton,
)
from workers.models.kernels import dependent_launches  # noqa: E402

MODULES = (tree_triton, attention_triton, fused_hybrid_triton, gdn_triton, skinny_triton, tree_shape_triton,
           wide_triton)


def _kernels():
    """Every launched kernel of the project: the @triton.jit functions whose names end in _kernel."""
    for module in MODULES:
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.JITFunction) and name.endswith("_kernel"):
                yield f"{module.__name__}.{name}", value


def test_every_kernel_waits_for_its_inputs_first():
    kernels = dict(_kernels())
    assert len(kernels) >= 17
    for name, kernel in kernels.items():
        assert "PDL" in kernel.arg_names, name
        body = ast.parse(inspect.getsource(kernel.fn).lstrip()).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
            body = body[1:]
        first = ast.unparse(body[0])
        assert first == "wait_for_inputs(PDL)", f"{name} begins with {first!r}"


def test_the_switch(monkeypatch):
    """Off outside ``dependent_launches`` and on the CPU (decided before asking any device)."""
    assert pdl_triton.launch_options(torch.device("cuda")) == {"PDL": 0}
    with dependent_launches():
        assert pdl_triton.launch_options(torch.device("cpu")) == {"PDL": 0}
        with dependent_launches(False):
            assert pdl_triton.launch_options(torch.device("cuda")) == {"PDL": 0}
    monkeypatch.setenv(pdl_triton.SWITCH, "0")
    pdl_triton._enabled.cache_clear()
    try:
        assert pdl_triton._enabled(0) is False  # decided before asking any device
    finally:
        pdl_triton._enabled.cache_clear()


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA device of compute capability 9 or more")
def test_the_compiled_kernel_waits_and_releases(tmp_path, monkeypatch):
    # compiled here, not loaded: a Triton cache carried between machines may hold the cubin without its PTX
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    with dependent_launches():
        options = pdl_triton.launch_options(x.device)
    assert options == {"PDL": pdl_triton.WAIT_AND_RELEASE, "launch_pdl": True}
    view, out = x.view(1, 64, 1024), torch.empty_like(x)
    compiled = fused_hybrid_triton._rms_norm_kernel.warmup(
        view, weight, out, view.stride(0), view.stride(1), 64, 1024, 1e-6, ONE_PLUS=True, BLOCK=1024, num_warps=2,
        grid=(64,), **options)
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert compiled.metadata.launch_pdl


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA device of compute capability 9 or more")
def test_a_graph_of_dependent_kernels_launched_early_gives_the_eager_bits():
    """Each norm reads the rows the kernel before it is still writing when it launches early. The input
    changes before every replay, so a missing or late wait would read the last replay's rows (or the
    pool's leftovers), not this one's."""
    x = torch.empty(512, 5120, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(5120, device="cuda", dtype=torch.bfloat16) * 0.3 for _ in range(40)]

    def chain():
        out = x
        for weight in weights:
            out = fused_hybrid_triton.one_plus_rms_norm(out, weight, 1e-6)
            out = fused_hybrid_triton.one_plus_rms_norm(out, weight, 1e-6)
            out = fused_hybrid_triton.silu_mul(torch.cat((out, out), dim=1))
        return out

    torch.manual_seed(0)
    x.normal_()
    with dependent_launches():
        assert pdl_triton.launch_options(x.device)["PDL"]
        chain()  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = chain()
    for seed in range(1, 4):
        torch.manual_seed(seed)
        x.normal_()
        eager = chain()  # outside dependent_launches: without PDL
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)
