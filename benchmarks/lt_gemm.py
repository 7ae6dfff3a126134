"""The products of a wide verify pass through cuBLASLt's other algorithms: is any faster than what
torch's cuBLAS call runs? (``workers.models.lt_product``, which the layers use; needs ``nvmath-python``.)

    python benchmarks/lt_gemm.py [--shape qwen3-8b] [--rows 257] [--count 8] [--splits] [--only o,down]

Per projection of the named shape (``skinny_gemm.projections``; the residual sums in place): cuBLAS
(``torch.mm`` / ``addmm_``, what the layers run), then every algorithm cuBLASLt's heuristic lists (up
to ``--count``) and, with ``--splits``, each of them with K split 2-8 ways in each reduction scheme
that cuBLASLt's check accepts. Each time is the median of CUDA
graph replays of 20 back-to-back calls cycling through ``--copies`` copies of the weight (so that it
comes from memory, not the L2), against the larger of the weight-read and compute floors measured in
the same run. Prints the three fastest with their configuration and the fastest's relative difference
to cuBLAS's output.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import sys

import numpy as np
import torch
import torch.nn.functional as F
from forward_anatomy import replay_us  # a sibling script: benchmarks/ is on sys.path
from gpu_speed import copy_bandwidth, matmul_rate
from wide_gemm import cases

from workers.models import lt_product
from workers.models.lt_product import Algorithm, LtProduct

SPLITS = (2, 3, 4, 6, 8)
SCHEMES = (1, 2, 4)  # cublasLtReductionScheme_t: in place, in the compute type, in the output type


def split_variants(plan: LtProduct, offered: list[Algorithm]) -> list[Algorithm]:
    """Each offered algorithm with K split in each of SPLITS ways and each reduction scheme, where
    ``cublasLtMatmulAlgoCheck`` accepts it within the workspace."""
    lt = lt_product._lt()
    check = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
    out = []
    for base, split, scheme in itertools.product(offered, SPLITS, SCHEMES):
        algo = lt.MatmulAlgo()
        ctypes.memmove(algo.ptr, base.data.ptr, lt.matmul_algo_dtype.itemsize)
        for name, value in (("SPLITK_NUM", split), ("REDUCTION_SCHEME", scheme)):
            lt_product._set(lt.matmul_algo_config_set_attribute, algo.ptr, lt.MatmulAlgoConfigAttribute[name],
                            np.array([value], np.uint32))
        try:
            lt.matmul_algo_check(lt_product._handle(torch.cuda.current_device()), plan.desc, plan.a, plan.b,
                                 plan.c, plan.c, algo.ptr, check.ctypes.data)
        except lt.cuBLASLtError:
            continue
        if int(check[0]["workspace_size"]) <= lt_product.WORKSPACE_BYTES:
            out.append(Algorithm(algo, int(check[0]["workspace_size"]), f"{base.source} split"))
    return out


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--rows", default="257")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--count", type=int, default=lt_product.CANDIDATES, help="heuristic candidates asked for")
    parser.add_argument("--splits", action="store_true", help="also each offered algorithm with K split")
    parser.add_argument("--only", default="", help="projection names, comma-separated (default: all)")
    args = parser.parse_args()
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    print(f"{args.shape}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 8192^3 product {rate / 1e12:.0f} TFLOP/s",
          flush=True)
    for case in cases(args.shape, args.rows, args.copies, args.only, bandwidth, rate):
        name, width, inner, add, rows, x, out, floor = (case.name, case.width, case.inner, case.add, case.rows,
                                                        case.x, case.out, case.floor_us)
        weights, turn = case.weights, case.turn()
        plan = LtProduct(rows, width, inner, torch.bfloat16, add)

        def cublas(weight):
            return out.addmm_(x, weight.t()) if add else torch.mm(x, weight.t(), out=out)

        baseline = replay_us(lambda: cublas(next(turn)))
        offered = plan.heuristic(args.count)
        candidates = offered + (split_variants(plan, offered) if args.splits else [])
        timed = []
        for algo in candidates:
            try:
                us = replay_us(lambda a=algo: plan.run(x, next(turn), out, a), reps=5)
            except Exception as error:  # noqa: BLE001 - a refused launch is one candidate fewer
                print(f"   {algo.source}: {type(error).__name__}: {error}", flush=True)
                continue
            timed.append((us, algo))
        timed.sort(key=lambda entry: entry[0])
        if not timed:
            print(f"{name:>8} M {rows}: cuBLAS {baseline:.1f} us; no cuBLASLt candidate ran "
                  f"({len(candidates)} offered)", flush=True)
            continue
        kept = out.clone()
        want = (out.addmm_(x, weights[0].t()) if add else F.linear(x, weights[0])).float()
        out.copy_(kept)
        got = plan.run(x, weights[0], out, timed[0][1]).float()
        out.copy_(kept)
        diff = ((got - want).norm() / want.norm()).item()
        chooser = lt_product._choose(x, weights[0], add)  # what the layers would run
        heuristic_first = next((us for us, a in timed if a.source == "heuristic #0"), float("nan"))
        print(f"{name:>8} N {width} K {inner} M {rows}: floor {floor:.1f} us; cuBLAS {baseline:.1f} "
              f"({baseline / floor:.2f}x); heuristic #0 {heuristic_first:.1f}; "
              f"{len(timed)} timed, rel diff of the best {diff:.1e}; lt_product chooses "
              f"{chooser[1].source if chooser else 'torch'}", flush=True)
        for us, algo in timed[:3]:
            print(f"         {us:7.1f} us {us / floor:5.2f}x  {algo.source:>13}  ws {algo.workspace >> 10} KB  "
                  f"{algo.describe()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
