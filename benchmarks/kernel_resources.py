"""What every Triton kernel of the project needs from a GPU it has not run on: compiled ahead of time,
on this machine, with no GPU, for the architectures people run on.

    python benchmarks/kernel_resources.py [--shape qwen3.6-27b] [--arch 80,86,89,90]

Each kernel is compiled exactly as its wrapper launches it for the named model shape (a hybrid's GDN
kernels with the rest where the shape has them; the wrapper runs
on CPU tensors of the real layouts and its launch is recorded instead of run), for each architecture
(86: the RTX A6000 the project's users run; 90: the H200 its benchmarks run on). Printed per kernel
and architecture: shared memory against the architecture's per-block limit (more than that and the
launch fails with OutOfResources), registers per thread, local-memory stack bytes (non-zero when
ptxas spilled registers, which slows the kernel), and how many blocks one SM holds at once (its
occupancy, from those and the architecture's limits; ``resident_blocks``). Needs ``triton`` with its
bundled ``ptxas`` and ``cuobjdump``; no CUDA device or driver.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from workers.decoding import tree_triton
from workers.decoding.params import TreeParams
from workers.decoding.tree import build_tree
from workers.models import attention_triton, fused_hybrid_triton, gdn, gdn_triton, skinny_triton, tree_shape_triton
from workers.models.shapes import TARGETS

# the most shared memory one block may use (opt-in), per compute capability (CUDA programming guide)
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}


@dataclass(frozen=True)
class Multiprocessor:
    """What one SM of a compute capability holds at once (CUDA programming guide, "Technical
    Specifications per Compute Capability"; CCCL's ``cuda::arch`` traits give the same for 80, 86, 89
    and 90)."""

    shared: int  # bytes of shared memory, with 1 KB of each resident block reserved by the driver
    blocks: int  # resident blocks
    warps: int  # resident warps
    registers: int = 65536  # 32-bit registers, given out a warp at a time in units of 256


MULTIPROCESSOR = {80: Multiprocessor(167936, 32, 64), 86: Multiprocessor(102400, 16, 48),
                  87: Multiprocessor(167936, 16, 48), 89: Multiprocessor(102400, 24, 48),
                  90: Multiprocessor(233472, 32, 64)}


def resident_blocks(used: dict, warps: int, arch: int) -> tuple[int, str]:
    """How many blocks of a kernel an SM of sm_``arch`` holds at once, by its registers a thread, shared
    bytes and warps a block (``used`` as ``resources`` gives it), and which limit binds first."""
    sm = MULTIPROCESSOR[arch]
    per_warp = -(-used["regs"] * 32 // 256) * 256
    limits = {"blocks": sm.blocks, "warps": sm.warps // warps, "shared": sm.shared // (used["shared"] + 1024),
              "registers": sm.registers // (per_warp * warps) if per_warp else sm.blocks}
    binding = min(limits, key=limits.get)  # on a tie, the architecture's own cap: fewer registers would not help
    return limits[binding], binding


@dataclass
class Launch:
    """One recorded launch: the kernel, its arguments and launch options."""

    label: str
    kernel: triton.runtime.JITFunction
    args: tuple
    kwargs: dict = field(default_factory=dict)
    family: str = ""  # launches that stand in for each other (tiles tried in order): one of them must fit
    min_arch: int = 0  # the first architecture that runs it (TMA: Hopper, 90)

    def source(self) -> tuple[ASTSource, dict]:
        """The kernel specialised as Triton's launcher would for these arguments: 16-byte aligned
        pointers and integers divisible by 16 marked so (without that, loads are not vectorised and
        the software pipeline never starts, so shared memory and registers would be misreported),
        integers equal to 1 made constants."""
        values = dict(zip(self.kernel.arg_names, self.args)) | {
            k: v for k, v in self.kwargs.items() if k in self.kernel.arg_names}
        signature, constants, attrs = {}, {}, {}
        for index, param in enumerate(self.kernel.params):
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name], constants[param.name] = "constexpr", value
                continue
            kind, spec = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                                not param.do_not_specialize_on_alignment)
            signature[param.name] = kind
            if kind == "constexpr":
                constants[param.name] = spec
            elif spec:
                attrs[(index,)] = BaseBackend.parse_attr(spec)
        options = {"num_warps": self.kwargs.get("num_warps", 4), "num_stages": self.kwargs.get("num_stages", 3)}
        return ASTSource(self.kernel, signature, constexprs=constants, attrs=attrs), options


@contextmanager
def recording(module, name: str, label: str, into: list[Launch]):
    """``module.name`` (a Triton kernel) records its launches into ``into`` instead of running."""
    kernel = getattr(module, name)

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: into.append(Launch(label, kernel, args, kwargs))

    setattr(module, name, Recorder())
    try:
        yield
    finally:
        setattr(module, name, kernel)


def gdn_launches(shape: dict, parents: torch.Tensor) -> list[Launch]:
    """A hybrid's GDN kernels in one verify pass of the tree ``parents`` (and AR's step and a commit)."""
    out: list[Launch] = []
    q = len(parents)
    hk, h = shape["linear_num_key_heads"], shape["linear_num_value_heads"]
    d, taps = shape["linear_key_head_dim"], shape["linear_conv_kernel_dim"]
    channels = (2 * hk + h) * d
    bf16, f32 = torch.bfloat16, torch.float32
    ancestors = gdn.ancestor_table(parents)
    lag = gdn.conv_lag_index(parents, taps - 1)
    inputs = torch.zeros(q, channels, dtype=bf16)
    gates = (torch.zeros(q, h, dtype=bf16), torch.zeros(q, h, dtype=bf16), torch.zeros(h), torch.zeros(h))
    with recording(gdn_triton, "_prologue_kernel", "GDN prologue (conv, norms, gates)", out):
        gdn_triton.prologue(torch.zeros(taps - 1, channels, dtype=bf16), inputs, lag,
                            torch.zeros(channels, taps, dtype=bf16), None, hk, h, d,
                            torch.empty(taps - 1 + q, channels, dtype=bf16), gates)
    kq, v_ = torch.zeros(hk, 2, q, d), torch.zeros(h, q, d)
    g, beta, state = torch.zeros(q, h), torch.zeros(q, h, dtype=bf16), torch.zeros(h, d, d)
    # as a bfloat16 model runs them in every form, paired blocks too (``gdn_triton.TREE_FORM``), and a float32 model
    runs = ([(bf16, "tf32", form) for form in gdn_triton.FORM_CHOICES + gdn_triton.PAIRED_FORMS]
            + [(f32, "tf32x3", gdn_triton.FORM_CHOICES[0])])
    for dtype, precision, form in runs:
        norm = (torch.zeros(q, h * d, dtype=dtype), torch.zeros(d, dtype=dtype), 1e-6)
        label = f"GDN tree blocks + gated norm ({precision}, {gdn_triton.form_name(form)})"
        with recording(gdn_triton, "_tree_block_kernel", label, out):
            gdn_triton.tree_outputs(kq, v_, g, beta, state, ancestors, model_dtype=dtype, norm=norm, form=form)
    with recording(gdn_triton, "_gated_norm_kernel", "GDN gated norm (chains)", out):
        gdn_triton.gated_norm(torch.zeros(q, h, d), torch.zeros(q, h * d, dtype=bf16), torch.zeros(d, dtype=bf16),
                              1e-6, bf16)
    with recording(gdn_triton, "_chain_state_kernel", "GDN AR step (1 token)", out):
        gdn_triton.advance_state(torch.zeros(hk, 1, d), torch.zeros(hk, 1, d), torch.zeros(h, 1, d),
                                 torch.zeros(1, h), torch.zeros(1, h, dtype=bf16), state)
    for count, form in ((1, "replay"), (16, "replay"), (16, "chunk")):
        with (recording(gdn_triton, "_commit_kernel", f"GDN commit ({count} nodes)", out),
              recording(gdn_triton, "_commit_chunk_kernel", "GDN commit, regrouped (any length)", out)):
            gdn_triton.commit_path(torch.zeros(taps - 1 + q, channels, dtype=bf16), torch.arange(count),
                                   torch.zeros(channels, taps, dtype=bf16), None, g, beta, state,
                                   torch.zeros(taps - 1, channels, dtype=bf16), hk, form=form)
    return out


def launches(shape: dict, q: int = 257) -> list[Launch]:
    """The launches of one verify pass's kernels (and AR's step and a commit) at ``shape``'s sizes: a
    hybrid's (GDN, its attention heads' kernels) or an attention-only target's."""
    hybrid = "linear_num_key_heads" in shape
    parents = torch.cat((torch.tensor([-1]), torch.arange(q - 1) // 2))  # a binary tree, depth < 15 for q = 257
    out = gdn_launches(shape, parents) if hybrid else []
    bf16 = torch.bfloat16
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    rotary = int(head_dim * shape.get("rope_parameters", {}).get("partial_rotary_factor", 1.0))
    capacity, rows = 2048, (heads // kv_heads) * q
    kv = torch.zeros(2, 1, kv_heads, capacity, head_dim, dtype=bf16)
    slots = torch.arange(q) + 1024
    for splits, tma in ((1, False), (4, False), (1, True), (4, True)):  # K/V by block pointers, or by TMA (sm_90)
        family = f"verify attention{' by TMA' if tma else ''} ({splits} key splits)"
        for choice, tiles in enumerate(attention_triton.tiles_for(head_dim)):  # tried in turn until one fits
            attention: list[Launch] = []
            with (attention_triton.only_tiles(tiles), attention_triton.by_descriptor(tma),
                  recording(attention_triton, "_attention_kernel", f"{family[:-1]}, {'x'.join(map(str, tiles))})",
                            attention),
                  recording(attention_triton, "_merge_kernel", f"verify attention's merge ({splits} key splits)",
                            attention)):
                attention_triton.attend_until(torch.zeros(kv_heads, rows, head_dim, dtype=bf16), kv[0, 0], kv[1, 0],
                                              torch.zeros(rows, capacity, dtype=bf16), slots, head_dim**-0.5, splits,
                                              nodes=q, ends=(slots + 1).to(torch.int32))  # a target pass's form
            attention[0].family, attention[0].min_arch = family, 90 if tma else 0
            out += attention if choice == 0 and not tma else attention[:1]  # the merge once: the same kernel
    for tma in (False, True):  # the work shared among one round of programs (stream-K), not yet on by default
        family = f"verify attention, shared work{' by TMA' if tma else ''}"
        for tiles in attention_triton.tiles_for(head_dim):
            with (attention_triton.only_tiles(tiles), attention_triton.by_descriptor(tma),
                  recording(attention_triton, "_shared_kernel", f"{family} ({'x'.join(map(str, tiles))})", out),
                  recording(attention_triton, "_merge_kernel", "", [])):
                attention_triton.attend_until(torch.zeros(kv_heads, rows, head_dim, dtype=bf16), kv[0, 0], kv[1, 0],
                                              torch.zeros(rows, capacity, dtype=bf16), slots, head_dim**-0.5,
                                              nodes=q, ends=(slots + 1).to(torch.int32), programs=132)
            out[-1].family, out[-1].min_arch = family, 90 if tma else 0
    if hybrid:  # a hybrid's attention heads carry an output gate
        with recording(fused_hybrid_triton, "_heads_kernel", "attention heads (norm, rotary, K/V write)", out):
            fused_hybrid_triton.norm_rotate_heads(torch.zeros(q, 2 * heads + 2 * kv_heads, head_dim, dtype=bf16),
                                                  torch.zeros(head_dim, dtype=bf16), torch.zeros(head_dim, dtype=bf16),
                                                  1e-6, torch.zeros(q, rotary, dtype=bf16),
                                                  torch.zeros(q, rotary, dtype=bf16), slots, kv, heads, kv_heads)
        with recording(fused_hybrid_triton, "_output_gate_kernel", "attention output gate", out):
            fused_hybrid_triton.output_gate(torch.zeros(heads, q, head_dim, dtype=bf16),
                                            torch.zeros(q, 2 * heads + 2 * kv_heads, head_dim, dtype=bf16), heads)
    # the plain layers' heads (an attention-only target's, a drafter's), and a drafter's context written
    # ahead: K and V alone, no query heads
    for query_heads, what in ((heads, "queries folded"), (0, "K and V alone")):
        with recording(fused_hybrid_triton, "_heads_kernel", f"plain attention heads ({what})", out):
            fused_hybrid_triton.norm_rotate_heads(torch.zeros(q, query_heads + 2 * kv_heads, head_dim, dtype=bf16),
                                                  torch.zeros(head_dim, dtype=bf16), torch.zeros(head_dim, dtype=bf16),
                                                  1e-6, torch.zeros(q, head_dim, dtype=bf16),
                                                  torch.zeros(q, head_dim, dtype=bf16), slots, kv, query_heads,
                                                  kv_heads, gated=False, norm=fused_hybrid_triton.PLAIN_NORM)
    with recording(fused_hybrid_triton, "_rms_norm_kernel", "(1 + w) RMS norm (hidden)", out):
        fused_hybrid_triton.one_plus_rms_norm(torch.zeros(q, shape["hidden_size"], dtype=bf16),
                                              torch.zeros(shape["hidden_size"], dtype=bf16), 1e-6)
    with recording(fused_hybrid_triton, "_silu_mul_kernel", "MLP silu(gate) * up", out):
        fused_hybrid_triton.silu_mul(torch.zeros(q, 2 * shape["intermediate_size"], dtype=bf16))
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    for rows, (width, depth), add, what in ((1, (2 * inner, hidden), False, "gate/up, 1 row"),
                                            (1, (hidden, inner), True, "down + sum, 1 row, K split"),
                                            (16, (hidden, inner), True, "down + sum, 16 rows")):
        family = f"skinny product ({what})"
        for tiles in skinny_triton.TILES[skinny_triton.tile_class(rows, depth, width, add)]:  # tried in turn
            with recording(skinny_triton, "_skinny_kernel", f"{family[:-1]}, {'x'.join(map(str, tiles))})", out):
                skinny_triton.skinny_linear(torch.empty(rows, depth, dtype=bf16), torch.empty(width, depth, dtype=bf16),
                                            out=torch.empty(rows, width, dtype=bf16) if add else None, tiles=tiles,
                                            splits=2 if "split" in what else None)
            out[-1].family = family
    if hybrid:  # the GDN layers' tree shape
        with (recording(tree_shape_triton, "_tree_count_places_kernel", "tree shape: paths, places", out),
              recording(tree_shape_triton, "_tree_block_slots_kernel", "tree shape: blocks", out)):
            tree_shape_triton.tree_shape(parents, shape["linear_conv_kernel_dim"] - 1, gdn.MAX_PATH)
    tree: list[Launch] = []  # DDTree's build at B = q - 1 and B = 1024: two launches per depth, the merge, the outputs
    with (recording(tree_triton, "_tree_count_kernel", "tree build: a depth's count", tree),
          recording(tree_triton, "_tree_wide_count_kernel", "tree build: a wide depth's count", tree),
          recording(tree_triton, "_tree_depth_kernel", "tree build: a depth", tree),
          recording(tree_triton, "_tree_merge_kernel", "tree build: the merge", tree),
          recording(tree_triton, "_tree_finish_kernel", "tree build: nodes, ancestors", tree)):
        for budget in (q - 1, 1024):  # at 1024 the widest depths take the wide count
            build_tree(torch.log_softmax(torch.randn(15, shape["vocab_size"]), dim=-1), TreeParams(budget),
                       kernels=True)
    return out + list({launch.label: launch for launch in tree}.values())


def resources(launch: Launch, arch: int) -> dict:
    """Compile ``launch`` for sm_``arch``: shared bytes, registers per thread, stack bytes (spills)."""
    source, options = launch.source()
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    return {"shared": compiled.metadata.shared, "regs": int(found.get("REG", 0)), "stack": int(found.get("STACK", 0))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b", choices=sorted(TARGETS))
    parser.add_argument("--arch", default="80,86,89,90", help="compute capabilities, e.g. 86 for an RTX A6000")
    args = parser.parse_args()
    arches = [int(a) for a in args.arch.split(",")]
    shape = TARGETS[args.shape]
    print(f"{args.shape}: Triton {triton.__version__}; per architecture: shared = bytes per block / the "
          "most a block may have, regs = registers per thread, stack = bytes spilled per thread, an SM = "
          "blocks resident at once on one SM and the limit that binds (registers, shared, warps, blocks)")
    print(f"{'kernel':<52}{'warps':>6}"
          + "".join(f"{f'sm_{a} shared':>20}{'regs':>6}{'stack':>7}{'an SM':>15}" for a in arches))
    problems, fitting = [], {}  # fitting: (family, arch) -> whether some launch of the family fits
    for launch in launches(shape):
        row = f"{launch.label:<52}{launch.kwargs.get('num_warps', 4):>6}"
        for arch in arches:
            if arch < launch.min_arch:
                row += f"{'-':>20}{'-':>6}{'-':>7}{'-':>15}"
                continue
            used = resources(launch, arch)
            limit = SHARED_LIMIT.get(arch)
            fits = limit is None or used["shared"] <= limit
            blocks = "-"
            if fits and arch in MULTIPROCESSOR:
                blocks = "{} ({})".format(*resident_blocks(used, launch.kwargs.get("num_warps", 4), arch))
            row += f"{used['shared']:>13}/{limit or '?':<6}{used['regs']:>6}{used['stack']:>7}{blocks:>15}"
            if launch.family:
                fitting[launch.family, arch] = fitting.get((launch.family, arch), False) or fits
            elif not fits:
                problems.append(f"{launch.label} needs {used['shared']} B of shared memory; sm_{arch} has {limit}")
            if used["stack"] and fits:
                problems.append(f"{launch.label} spills on sm_{arch} ({used['stack']} B of stack per thread)")
        print(row)
    problems += [f"no tiles of {family} fit sm_{arch}'s shared memory" for (family, arch), fits in fitting.items()
                 if not fits]
    print("\n".join(problems) if problems else "every kernel fits every architecture, with no spills")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
