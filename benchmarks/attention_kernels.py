"""A verify pass's attention at a real model's head layout, one layer, on CUDA: the Triton kernel
(``attention_triton.attend_until``) with its tiles and with others, against SDPA.

    python benchmarks/attention_kernels.py [--shape qwen3.6-27b] [--length 1024] [--capacity 4096]

Per pass width q (folded rows = query heads per K/V head x q): median time of one call replayed in a
CUDA graph for SDPA over the whole K/V buffer (what a graph replays without the kernel), SDPA over
exactly the committed past and the pass (its best case), and the kernel with each tile choice
(rows per program, keys per step, warps, stages; the first is the default), each with its relative
error against SDPA; and the K/V read floor (bytes / measured copy bandwidth).
"""

from __future__ import annotations

import argparse

import torch
from forward_anatomy import graphed
from gpu_speed import copy_bandwidth, median_ms

from tests.helpers.kernel_inputs import attention_pass_inputs
from workers.models import attention_triton
from workers.models.attention import attend_folded
from workers.models.shapes import TARGETS

TILES = [(64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (128, 32, 8, 2), (64, 32, 8, 3)]


def with_tiles(tiles: tuple[int, int, int, int], fn):
    """fn() with the kernel's tiles set to ``tiles`` (rows, keys, warps, stages) alone."""
    saved = attention_triton.ROW_BLOCK
    attention_triton.ROW_BLOCK = tiles[0]
    try:
        with attention_triton.only_tiles(tiles[1:]):
            return fn()
    finally:
        attention_triton.ROW_BLOCK = saved


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b", choices=sorted(TARGETS))
    parser.add_argument("--length", type=int, default=1024, help="committed tokens before the pass")
    parser.add_argument("--capacity", type=int, default=4096, help="K/V buffer slots (a graph reads them all)")
    parser.add_argument("--qs", default="257,1025")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    shape = TARGETS[args.shape]
    kv_heads, dim = shape["num_key_value_heads"], shape["head_dim"]
    groups = shape["num_attention_heads"] // kv_heads
    bandwidth = copy_bandwidth()
    print(f"{args.shape}: {kv_heads} K/V heads x {groups} query heads of {dim}, {args.length} committed tokens, "
          f"{args.capacity} slots; {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    header = f"{'q':>5} {'K/V floor':>10} {'SDPA all':>9} {'SDPA exact':>11} " + " ".join(
        f"{'x'.join(map(str, t)):>12}" for t in TILES)
    print(header + "   (us per call; kernel tiles: rows x keys x warps x stages; error vs SDPA)")
    for q in (int(x) for x in args.qs.split(",")):
        query, key, value, mask, slots = attention_pass_inputs(kv_heads, groups, q, args.capacity, args.length, dim,
                                                     getattr(torch, args.dtype), q)
        key, value = torch.nan_to_num(key), torch.nan_to_num(value)  # SDPA over all slots reads them
        end = args.length + q
        want = attend_folded(query, key[:, :end], value[:, :end], mask[:, :end], dim**-0.5).float()
        floor_us = 2 * key[:, :end].nbytes / bandwidth * 1e6  # K and V read once (bandwidth: bytes moved)
        sdpa_all = median_ms(graphed(lambda: attend_folded(query, key, value, mask, dim**-0.5))) * 1e3
        sdpa_exact = median_ms(graphed(lambda: attend_folded(query, key[:, :end], value[:, :end], mask[:, :end],
                                                             dim**-0.5))) * 1e3
        cells = []
        for tiles in TILES:
            def call():
                return attention_triton.attend_until(query, key, value, mask, slots, dim**-0.5)

            got = with_tiles(tiles, call)
            if got is None:
                cells.append(f"{'no room':>12}")
                continue
            error = ((got.float() - want).norm() / want.norm()).item()
            us = with_tiles(tiles, lambda: median_ms(graphed(call))) * 1e3
            cells.append(f"{us:>5.0f} {error:>6.0e}")
        print(f"{q:>5} {floor_us:>10.1f} {sdpa_all:>9.0f} {sdpa_exact:>11.0f} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
