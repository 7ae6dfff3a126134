"""Every Triton kernel, compiled ahead of time for an RTX A6000 (sm_86, the project's users' GPU) at
Qwen3.6-27B's sizes, fits that GPU's shared memory per block (more and its launch fails with
OutOfResources). Needs only ``triton`` and its bundled ptxas, no GPU; skipped where triton is absent
(the CPU-only CI). ``benchmarks/kernel_resources.py`` prints the full table for several architectures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from workers.models.shapes import TARGETS  # noqa: E402

TOOL = Path(__file__).resolve().parents[3] / "benchmarks" / "kernel_resources.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("kernel_resources", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_resources"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_every_kernel_fits_an_a6000s_shared_memory():
    tool = load_tool()
    launches = tool.launches(TARGETS["qwen3.6-27b"])
    assert {launch.label.split(" (")[0] for launch in launches} >= {
        "GDN prologue", "GDN tree blocks + gated norm", "verify attention", "GDN commit"}
    for launch in launches:
        used = tool.resources(launch, 86)
        assert used["shared"] <= tool.SHARED_LIMIT[86], (launch.label, used)
