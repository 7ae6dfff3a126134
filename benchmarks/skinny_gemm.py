"""The products of a decode step and a short verify (1-16 rows) against their weight-read floor, with
what surrounds them in a layer (the norm kernel before, the SiLU kernel after, or the residual sum in
place): cuBLAS (``F.linear`` / ``addmm_``) against the project's Triton kernel
(``workers.models.skinny_triton``), with its own tiles or (``--grid``) every choice of them. At one
row the kernel takes the norm inside its product (what ``fused_layer.norm_linear`` runs), so its
column has one kernel fewer than cuBLAS's; a one-row residual sum splits K (``--grid``: every count of
splits with every choice of tiles).

    python benchmarks/skinny_gemm.py [--shape qwen3-8b] [--rows 1,16] [--copies 8] [--grid]

Random bf16 weights of the named shape's projections; each time is the median of CUDA graph replays
of 20 back-to-back calls (``forward_anatomy.replay_us``) that cycle through ``--copies`` copies of the
weight, so that the weight comes from memory, not from the 50 MB L2, as in a forward. The floor is the
weight's bytes over the copy bandwidth measured in the same run (read + write counted, as
``gpu_speed.py``'s weight floor). Prints per projection and row count: the kernels with cuBLAS, the
Triton kernel's best tiles and time, and the relative difference of their outputs.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from forward_anatomy import replay_us  # a sibling script: benchmarks/ is on sys.path
from gpu_speed import copy_bandwidth
from triton.runtime.errors import OutOfResources

from workers.models import fused_hybrid_triton as kernels
from workers.models.shapes import target_config
from workers.models.skinny_triton import skinny_linear

GRID = [tiles for tiles in itertools.product((16, 32, 64), (256, 512), (4, 8), (2, 4))
        if tiles[0] * tiles[1] <= 16384]


def projections(shape: str) -> dict[str, tuple[int, int, str]]:
    """name -> (N, K, what surrounds the product: "norm", "norm+silu" or "residual") of one layer of each kind."""
    config = target_config(shape)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    hybrid = bool(getattr(config, "linear_num_value_heads", None))  # its attention: a gate per query head
    q_rows = config.num_attention_heads * head_dim * (2 if hybrid else 1)
    kv_rows = 2 * config.num_key_value_heads * head_dim
    shapes = {"qkv": (q_rows + kv_rows, hidden, "norm"),
              "o": (hidden, config.num_attention_heads * head_dim, "residual"),
              "gate_up": (2 * inter, hidden, "norm+silu"), "down": (hidden, inter, "residual")}
    if hybrid:
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        heads = config.linear_num_value_heads
        shapes["gdn in"] = (2 * key_dim + 2 * value_dim + 2 * heads, hidden, "norm")
        shapes["gdn out"] = (hidden, value_dim, "residual")
    return shapes


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--only", default="", help="projection names, comma-separated (default: all)")
    parser.add_argument("--grid", action="store_true", help="time every tile choice (else the kernel's own)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    hybrid = bool(getattr(target_config(args.shape), "linear_num_value_heads", None))
    print(f"{args.shape}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          + (f"{len(GRID)} tile choices (rows of the weight per program, K per step, warps, stages)" if args.grid
             else "the kernel's own tiles"))
    print(f"{'projection':>10} {'N':>6} {'K':>6} {'M':>3} {'around':>10} {'floor us':>9} {'cuBLAS':>15} "
          f"{'Triton':>14} {'tiles':>18} {'rel diff':>9}  next best")
    chosen = [name for name in args.only.split(",") if name]
    for name, (width, inner, around) in projections(args.shape).items():
        if chosen and name not in chosen:
            continue
        weights = [torch.randn(width, inner, device="cuda", dtype=torch.bfloat16) * inner**-0.5
                   for _ in range(args.copies)]
        norm_weight = torch.randn(inner, device="cuda", dtype=torch.bfloat16) * 0.1
        floor = width * inner * 2 / bandwidth * 1e6
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, inner, device="cuda", dtype=torch.bfloat16)
            out = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
            silu = around == "norm+silu"

            def unfused(weight):
                if around == "residual":
                    return out.addmm_(x, weight.t())
                normed = kernels.one_plus_rms_norm(x, norm_weight, 1e-6) if hybrid else kernels.rms_norm(
                    x, norm_weight, 1e-6)
                product = F.linear(normed, weight)
                return kernels.silu_mul(product) if silu else product

            def fused(weight, tiles=None, splits=None):  # one row: the norm inside the product; more: the norm kernel
                if around == "residual":
                    return skinny_linear(x, weight, out=out, tiles=tiles, splits=splits)
                if rows == 1:
                    product = skinny_linear(x, weight, tiles=tiles, norm=(norm_weight, 1e-6, hybrid))
                    return kernels.silu_mul(product) if silu else product
                normed = kernels.one_plus_rms_norm(x, norm_weight, 1e-6) if hybrid else kernels.rms_norm(
                    x, norm_weight, 1e-6)
                product = skinny_linear(normed, weight, tiles=tiles)
                return kernels.silu_mul(product) if silu else product

            turn = itertools.cycle(weights)
            baseline = replay_us(lambda: unfused(next(turn)))
            timed = []
            split_counts = (1, 2, 4, 8) if args.grid and around == "residual" and rows == 1 else (None,)
            for tiles, splits in itertools.product(GRID if args.grid else (None,), split_counts):
                try:
                    us = replay_us(lambda t=tiles, c=splits: fused(next(turn), t, c), reps=5)
                except (OutOfResources, ValueError):  # ValueError: the splits do not divide K into whole steps
                    continue
                timed.append((us, tiles if splits is None else (*tiles, f"{splits} splits")))
            timed.sort(key=lambda pair: pair[0])
            best_us, best = timed[0]
            best_tiles, best_splits = (best, None) if best is None or len(best) == 4 else (best[:4], int(best[4][0]))
            kept = out.clone()
            want = unfused(weights[0]).float()
            out.copy_(kept)
            got = fused(weights[0], best_tiles, best_splits).float()
            diff = ((got - want).norm() / want.norm()).item()
            others = ", ".join(f"{us:.1f} {t}" for us, t in timed[1:3])
            print(f"{name:>10} {width:>6} {inner:>6} {rows:>3} {around:>10} {floor:>9.1f} {baseline:>8.1f} "
                  f"{baseline / floor:>5.2f}x {best_us:>7.1f} {best_us / floor:>5.2f}x {str(best):>18} {diff:>9.1e}  "
                  f"{others}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
