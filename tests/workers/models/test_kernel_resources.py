"""Every Triton kernel, compiled ahead of time for an RTX A6000 (sm_86, the project's users' GPU) at
Qwen3.6-27B's sizes, fits that GPU's shared memory per block (more and its launch fails with
OutOfResources). Needs only ``triton`` and its bundled ptxas, no GPU; skipped where triton is absent
(the CPU-only CI). ``benchmarks/kernel_resources.py`` prints the full table for several architectures."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from tests.helpers.benchmarks import load_benchmark  # noqa: E402
from workers.models.shapes import TARGETS  # noqa: E402


def test_every_kernel_fits_an_a6000s_shared_memory():
    """Compiled as Triton's launcher specialises them (aligned pointers: vectorised, software-pipelined
    loads, whose stages take shared memory). A kernel with tiles tried in turn (the verify attention)
    needs one choice that fits."""
    tool = load_benchmark("kernel_resources")
    launches = tool.launches(TARGETS["qwen3.6-27b"])
    assert {launch.label.split(" (")[0] for launch in launches} >= {
        "GDN prologue", "GDN tree blocks + gated norm", "verify attention", "GDN commit", "GDN commit, regrouped",
        "tree build: a depth", "tree build: a wide depth's count", "plain attention heads"}
    families: dict[str, list[bool]] = {}
    for launch in launches:
        if launch.min_arch > 86:  # TMA's form runs from Hopper on
            continue
        fits = tool.resources(launch, 86)["shared"] <= tool.SHARED_LIMIT[86]
        if launch.family:
            families.setdefault(launch.family, []).append(fits)
        else:
            assert fits, launch.label
    assert families and all(any(fits) for fits in families.values()), families


def test_the_launch_specialisation_is_triton_s():
    """The tool compiles what a launch would run: the verify attention's default tiles pipeline their
    K/V loads (asynchronous copies into shared memory), which an unspecialised compile does not."""
    import re

    from triton.backends.compiler import GPUTarget

    tool = load_benchmark("kernel_resources")
    launches = tool.launches(TARGETS["qwen3.6-27b"])
    launch = next(launch for launch in launches if launch.label.startswith("verify attention"))
    source, options = launch.source()
    ttgir = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ttgir"]
    assert re.search(r"ttg\.async_copy_global_to_local", ttgir)


@pytest.mark.parametrize(("regs", "shared", "warps", "arch", "blocks", "binding"), [
    (168, 18432, 4, 90, 3, "registers"),  # 168 x 32 = 21 units of 256 a warp: 65536 // (4 x 5376) = 3
    (206, 512, 4, 90, 2, "registers"),  # 206 x 32 rounds up to 6656 a warp
    (164, 49152, 4, 86, 2, "shared"),  # (48 + 1) KB a block of 100 KB; by registers 3
    (164, 49152, 4, 90, 3, "registers"),  # 228 KB: 4 by shared
    (40, 0, 1, 86, 16, "blocks"),  # an RTX A6000 holds at most 16 blocks an SM
    (32, 0, 16, 86, 3, "warps"),  # and 48 warps (by registers 4)
])
def test_resident_blocks_follow_the_architectures_limits(regs, shared, warps, arch, blocks, binding):
    tool = load_benchmark("kernel_resources")
    assert tool.resident_blocks({"regs": regs, "shared": shared, "stack": 0}, warps, arch) == (blocks, binding)


def test_how_many_gdn_tree_programs_share_an_a6000_sm_in_each_form():
    """What ``gdn_triton.TREE_FORM`` says: a bfloat16 model's tree kernel at 3 stages takes 48 KB of
    shared memory, so 2 programs fit an sm_86 SM; at 2 stages 3 fit; with steps of 64 along dk, one; with
    blocks in pairs, 1 at 3 stages and 2 at 2."""
    tool = load_benchmark("kernel_resources")
    tree = {launch.label: launch for launch in tool.launches(TARGETS["qwen3.6-27b"])
            if launch.label.startswith("GDN tree blocks + gated norm (tf32,")}
    resident = {label: tool.resident_blocks(tool.resources(launch, 86), launch.kwargs.get("num_warps", 4), 86)[0]
                for label, launch in tree.items()}
    label = "GDN tree blocks + gated norm (tf32, step {}, {} stages, {} a program)"
    assert resident == {label.format(32, 3, "1 block"): 2, label.format(32, 2, "1 block"): 3,
                        label.format(64, 2, "1 block"): 1, label.format(32, 3, "2 blocks"): 1,
                        label.format(32, 2, "2 blocks"): 2}
