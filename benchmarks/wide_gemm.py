"""The products of a wide verify pass (a DDTree tree of 255 or 256 nodes and its root: 256 or 257 rows)
against their floors: cuBLAS (``F.linear`` / ``addmm_`` into the residual, what the layers ran before)
and cuBLASLt (``torch.backends.cuda.preferred_blas_library``) against the project's Triton kernel
(``workers.models.wide_triton``) with its own tiles and splits, and (``--grid``) every choice of them.

    python benchmarks/wide_gemm.py [--shape qwen3-8b] [--rows 256,257] [--copies 4] [--grid] [--only o,down]

Random bf16 operands at the named shape's projections (``skinny_gemm.projections``); each time is the
median of CUDA graph replays of 20 back-to-back calls cycling through ``--copies`` copies of the
weight (so that it comes from memory, not from the 50 MB L2). The floor is the larger of the weight's
bytes over the copy bandwidth and 2 x rows x N x K over the rate of an 8192^3 product, both measured in
the same run. Prints per projection and row count: cuBLAS, the kernel as the layers run it, the best
of the grid with the next two, and the relative difference of the kernel's output to cuBLAS's.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from forward_anatomy import replay_us  # a sibling script: benchmarks/ is on sys.path
from gpu_speed import copy_bandwidth, matmul_rate
from skinny_gemm import projections
from triton.runtime.errors import OutOfResources, PTXASError

from workers.models.wide_triton import TILES, blocks_of, split_count, wide_linear

# (BN, BM, BK, warps, stages) timed by ``--grid``: the weight tile as the left operand of 64-256 rows (one
# or two warp groups), x's rows in one block of 256 or two of 128 (257 rows: plus the tail), K in steps
# of 64 or 128, within an H200's 227 KB of shared memory. (Each program re-reads its rows of x, so x's
# reads are N / BN times its bytes; a 256 x 256 tile in 16 warps would halve them, but 512 threads get
# 128 registers each, and ptxas asks 154 for its tensor-core product.)
GRID = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 256, 128, 8, 2), (64, 256, 64, 4, 3),
        (64, 256, 64, 4, 4), (64, 256, 64, 8, 4), (64, 256, 128, 4, 2), (128, 128, 64, 4, 4),
        (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4)]


@dataclass
class Case:
    """One projection of a shape at one row count, with random bf16 operands."""

    name: str
    width: int  # N
    inner: int  # K
    add: bool  # summed into its output (the residual), else written
    rows: int
    x: torch.Tensor  # [rows, K]
    out: torch.Tensor  # [rows, N]
    weights: list[torch.Tensor]  # copies of the [N, K] weight, cycled through so that each call reads memory
    floor_us: float  # the larger of the weight read and the arithmetic, at this run's rates

    def turn(self) -> Iterator[torch.Tensor]:
        return itertools.cycle(self.weights)


def cases(shape: str, rows: str, copies: int, only: str, bandwidth: float, rate: float,
          device: str = "cuda") -> Iterator[Case]:
    """Each projection of ``shape`` (``skinny_gemm.projections``; ``only``: these comma-separated names)
    at each of the comma-separated ``rows``; a projection's weight copies are dropped after its last case."""
    chosen = [name for name in only.split(",") if name]
    for name, (width, inner, around) in projections(shape).items():
        if chosen and name not in chosen:
            continue
        weights = [torch.randn(width, inner, device=device, dtype=torch.bfloat16) * inner**-0.5
                   for _ in range(copies)]
        for count in (int(r) for r in rows.split(",")):
            yield Case(name, width, inner, around == "residual", count,
                       torch.randn(count, inner, device=device, dtype=torch.bfloat16),
                       torch.randn(count, width, device=device, dtype=torch.bfloat16), weights,
                       max(width * inner * 2 / bandwidth, 2 * count * width * inner / rate) * 1e6)
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--rows", default="256,257")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--only", default="", help="projection names, comma-separated (default: all)")
    parser.add_argument("--grid", action="store_true", help="time every tile choice and split count")
    args = parser.parse_args()
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    choices = GRID if args.grid else [None]
    print(f"{args.shape}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 8192^3 product {rate / 1e12:.0f} TFLOP/s; "
          + (f"{len(choices)} tile choices (BN, BM, BK, warps, stages) x split counts" if args.grid
             else "the kernel's own tiles"))
    print(f"{'projection':>10} {'N':>6} {'K':>6} {'M':>4} {'floor us':>9} {'cuBLAS':>14} {'Lt':>7} {'Triton':>14} "
          f"{'splits':>6} {'best':>14} {'tiles, splits':>26} {'rel diff':>9}  next best", flush=True)
    for case in cases(args.shape, args.rows, args.copies, args.only, bandwidth, rate):
        name, width, inner, add, rows, x, out, floor = (case.name, case.width, case.inner, case.add, case.rows,
                                                        case.x, case.out, case.floor_us)
        weights, turn = case.weights, case.turn()

        def cublas(weight):
            return out.addmm_(x, weight.t()) if add else F.linear(x, weight)

        def kernel(weight, tiles=None, splits=None):
            return wide_linear(x, weight, out=out if add else None, tiles=tiles, splits=splits)

        baseline = replay_us(lambda: cublas(next(turn)))
        torch.backends.cuda.preferred_blas_library("cublaslt")  # its heuristics, not cuBLAS's
        lt = replay_us(lambda: cublas(next(turn)))
        torch.backends.cuda.preferred_blas_library("cublas")
        own = replay_us(lambda: kernel(next(turn)))
        own_splits = split_count(-(-width // TILES[0]) * blocks_of(rows, TILES[1])[0], inner // TILES[2], x.device)
        timed = []
        for tiles in choices:
            counts = sorted({1, 2, 3, 4, 6, 8} if tiles else {None}, key=lambda c: c or 0)
            for splits in counts:
                if splits and splits > inner // tiles[2] // 4:
                    continue
                try:
                    us = replay_us(lambda t=tiles, c=splits: kernel(next(turn), t, c), reps=5)
                except (OutOfResources, PTXASError):  # too much shared memory, or registers
                    continue
                timed.append((us, tiles, splits))
        timed.sort(key=lambda entry: entry[0])
        best_us, best_tiles, best_splits = timed[0]
        kept = out.clone()
        want = cublas(weights[0]).float()
        out.copy_(kept)
        got = kernel(weights[0], best_tiles, best_splits).float()
        diff = ((got - want).norm() / want.norm()).item()
        others = ", ".join(f"{us:.1f} {t} {c}" for us, t, c in timed[1:3])
        print(f"{name:>10} {width:>6} {inner:>6} {rows:>4} {floor:>9.1f} "
              f"{baseline:>7.1f} {baseline / floor:>5.2f}x {lt:>7.1f} "
              f"{own:>7.1f} {own / floor:>5.2f}x {own_splits:>6} {best_us:>7.1f} {best_us / floor:>5.2f}x "
              f"{str((best_tiles, best_splits)):>26} {diff:>9.1e}  {others}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
