"""The products of a wide verify pass through cuBLASLt's other algorithms: is any faster than what
torch's cuBLAS call runs? (``workers.models.lt_product``, which the layers use; needs ``nvmath-python``.)

    python benchmarks/lt_gemm.py [--shape qwen3-8b] [--rows 257] [--count 8] [--splits] [--grid] [--only o,down]

Per projection of the named shape (``skinny_gemm.projections``; the residual sums in place): cuBLAS
(``torch.mm`` / ``addmm_``, what the layers run), then every algorithm cuBLASLt's heuristic lists (up
to ``--count``), the first one's fitted tiles (``lt_product.fitted``) and, with ``--splits``, each
offered one with K split 2-8 ways in each reduction scheme that cuBLASLt's check accepts. ``--grid``
goes past these: every algorithm id cuBLASLt has for bf16 (and each offered one) with every tile its
capabilities list (all where it lists none), in each of CLUSTERS, that cuBLASLt's check accepts; then
the ten fastest of those (at a quick look: 8 calls, 3 replays), timed as the rest and with K split as
``--splits`` does. Each time is the median of CUDA graph replays of 20 back-to-back calls cycling
through ``--copies`` copies of the weight (so that it comes from memory, not the L2), against the
larger of the weight-read and compute floors measured in the same run. Prints the three (``--grid``:
eight) fastest with their configuration and the fastest's relative difference to cuBLAS's output.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np
import torch
import torch.nn.functional as F
from forward_anatomy import replay_us  # a sibling script: benchmarks/ is on sys.path
from gpu_speed import copy_bandwidth, matmul_rate
from wide_gemm import cases

from workers.models import lt_product
from workers.models.lt_product import Algorithm, LtProduct, fitted, variant

SPLITS = (2, 3, 4, 6, 8)
SCHEMES = (1, 2, 4)  # cublasLtReductionScheme_t: in place, in the compute type, in the output type
CLUSTERS = ("AUTO", "1x1x1", "2x1x1", "1x2x1", "4x1x1", "1x4x1", "2x2x1")  # D's rows (the weight's) x x's rows


def split_variants(plan: LtProduct, offered: list[Algorithm]) -> list[Algorithm]:
    """Each offered algorithm with K split in each of SPLITS ways and each reduction scheme, where
    ``cublasLtMatmulAlgoCheck`` accepts it within the workspace."""
    found = (variant(plan, base, {"SPLITK_NUM": split, "REDUCTION_SCHEME": scheme}, f"{base.source} split")
             for base, split, scheme in itertools.product(offered, SPLITS, SCHEMES))
    return [algo for algo in found if algo is not None]


def _cap_ids(algo: Algorithm, name: str) -> list[int]:
    """A capability of ``algo`` that is a list of ids (TILE_IDS, STAGES_IDS)."""
    lt = lt_product._lt()
    attribute, written = int(lt.MatmulAlgoCapAttribute[name]), np.zeros(1, np.uint64)
    lt.matmul_algo_cap_get_attribute(algo.data.ptr, attribute, 0, 0, written.ctypes.data)  # its size
    ids = np.zeros(max(int(written[0]) // 4, 1), np.uint32)
    lt.matmul_algo_cap_get_attribute(algo.data.ptr, attribute, ids.ctypes.data, ids.nbytes, written.ctypes.data)
    return ids[: int(written[0]) // 4].tolist()


def config_grid(plan: LtProduct, offered: list[Algorithm]) -> list[Algorithm]:
    """Every algorithm id cuBLASLt has for these types (bare) and the offered algorithms (one per kernel
    id and stage count: they differ in what the grid sets), with each tile (those its capabilities list;
    all tiles where it lists none) in each of CLUSTERS with its own stages, and in each automatic stage
    count with the automatic cluster; K unsplit; where cuBLASLt's check accepts it."""
    from nvmath import CudaDataType
    from nvmath.bindings.cublas import ComputeType

    lt = lt_product._lt()
    handle = lt_product._handle(torch.cuda.current_device())
    bf16, f32 = int(CudaDataType.CUDA_R_16BF), int(CudaDataType.CUDA_R_32F)
    compute = int(ComputeType.COMPUTE_32F)
    bases, kinds = [], set()
    for algo in offered:  # those of one kernel and stage count would repeat each other's checks
        kind = (algo.config()["id"], algo.config()["stages_id"])
        if kind not in kinds:
            kinds.add(kind)
            bases.append(algo)
    for algo_id in lt.matmul_algo_get_ids(handle, compute, f32, bf16, bf16, bf16, bf16, 64):
        algo = lt.MatmulAlgo()
        lt.matmul_algo_init(handle, compute, f32, bf16, bf16, bf16, bf16, int(algo_id), algo.ptr)
        bases.append(Algorithm(algo, 0, f"id {algo_id}"))
    every_tile = [tile for tile, _, _ in lt_product._tiles()]
    auto_stages = [int(v) for name, v in lt.MatmulStages.__members__.items() if name.endswith("AUTO")]
    clusters = [int(lt.ClusterShape[f"SHAPE_{c}"]) for c in CLUSTERS]
    found, seen, checked = [], set(), 0
    for base in bases:
        stages = base.config()["stages_id"]
        settings = [{"TILE_ID": tile, "CLUSTER_SHAPE_ID": cluster, "STAGES_ID": stage, "SPLITK_NUM": 1}
                    for tile in (_cap_ids(base, "TILE_IDS") or every_tile)
                    for cluster, stage in [(c, stages) for c in clusters] + [(clusters[0], a) for a in auto_stages]]
        for setting in settings:
            checked += 1
            algo = variant(plan, base, setting, f"{base.source} grid")
            if algo is not None and algo.describe() not in seen:
                seen.add(algo.describe())
                found.append(algo)
    print(f"   grid: {len(bases)} bases, {checked} configurations checked, {len(found)} accepted", flush=True)
    return found


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--rows", default="257")
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--count", type=int, default=lt_product.CANDIDATES, help="heuristic candidates asked for")
    parser.add_argument("--splits", action="store_true", help="also each offered algorithm with K split")
    parser.add_argument("--grid", action="store_true", help="every algorithm id's tiles and cluster shapes")
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

        def time_each(candidates: list[Algorithm], calls: int = 20, reps: int = 5) -> list[tuple[float, Algorithm]]:
            timed = []
            for algo in candidates:
                try:
                    us = replay_us(lambda a=algo: plan.run(x, next(turn), out, a), calls=calls, reps=reps)
                except Exception as error:  # noqa: BLE001 - a refused launch is one candidate fewer
                    print(f"   {algo.source}: {type(error).__name__}: {error}", flush=True)
                    continue
                timed.append((us, algo))
            return sorted(timed, key=lambda entry: entry[0])

        timed = time_each(offered + fitted(plan, offered[0], rows)
                          + (split_variants(plan, offered) if args.splits else []))
        if args.grid:  # a quick look at each (8 calls, 3 replays), then the ten fastest as above, split too
            grid = config_grid(plan, offered)
            glance = time_each(grid, calls=8, reps=3)
            print(f"{name:>8} M {rows}: {len(glance)} of the grid's {len(grid)} unsplit configurations ran",
                  flush=True)
            best = [algo for _, algo in glance[:10]]
            timed = sorted(timed + time_each(best) + time_each(split_variants(plan, best)), key=lambda entry: entry[0])
        if not timed:
            print(f"{name:>8} M {rows}: cuBLAS {baseline:.1f} us; no cuBLASLt candidate ran "
                  f"({len(offered)} offered)", flush=True)
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
              f"{chooser.source if chooser else 'torch'}", flush=True)
        for us, algo in timed[: 8 if args.grid else 3]:
            print(f"         {us:7.1f} us {us / floor:5.2f}x  {algo.source:>13}  ws {algo.workspace >> 10} KB  "
                  f"{algo.describe()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
