"""A verify pass's attention at a real model's head layout, one layer, on CUDA: the Triton kernel
(``attention_triton.attend_until``) with its tiles and with others, against SDPA.

    python benchmarks/attention_kernels.py [--shape qwen3.6-27b] [--length 1024] [--capacity 4096]

Per pass width q (folded rows = query heads per K/V head x q): time per call (20 calls replayed in
one CUDA graph, timed by events; the median of 7 replays) of what a pass without the kernel runs over
the whole K/V buffer ("no kernel": batched products below 512 rows, else SDPA), the same over exactly
the committed past and the pass (its best case), and the kernel with each choice of rows per program,
keys per step, warps, stages and key splits ("auto": the kernel's own choice; the first line is the
default), each with its relative error against SDPA; and the K/V read floor (bytes / measured copy
bandwidth). ``--descriptors`` times each choice twice, its whole K/V tiles by TMA and by block pointers
(``attention_triton.BY_DESCRIPTOR``; without it, as ``uses_descriptors`` picks on Hopper).
``--libraries`` adds two references over exactly the visible keys: SDPA's flash kernel without the
mask (not the pass's attention: what a fused kernel does at this shape) and cuDNN's with it.
``--ends`` also times each choice as the target passes run it: in o_proj's layout with each node's
``ends``, each block of rows stopping at its last node's end ("ends"). ``--causal`` makes the pass a
prompt chunk (every node sees every earlier one; with ``--length 0`` a prompt's first chunk) instead
of a random tree. ``--shared`` also times each choice without given splits with its work shared among
one round of the programs the GPU holds at once (``attention_triton.SHARED``, stream-K: "shared"), and
``--programs`` among each of these counts ("shared N").
"""

from __future__ import annotations

import argparse

import torch
from forward_anatomy import replay_us
from gpu_speed import copy_bandwidth
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.helpers.kernel_inputs import attention_pass_inputs
from workers.models import attention_triton
from workers.models.attention import attend_folded
from workers.models.shapes import TARGETS

# (rows per program, keys per step, warps, stages, key splits); None: the kernel's own choice (rows:
# ``kernels.row_block`` up to TILES' first choice's; tiles: TILES' first choice; splits: its rule). The
# first line is the kernel's own choices, the next the kernel's earlier default; then more keys per step
# for the wide passes' rows, and the last two, deeper pipelines (what loads by TMA can feed).
CHOICES = [(None, None, None, None, None), (64, 64, 8, 2, None), (None, 32, 4, 2, None), (128, 32, 8, 2, None),
           (64, 32, 8, 2, None), (32, 32, 4, 3, None), (None, 64, 4, 2, 16), (64, 64, 4, 2, 1),
           (128, 64, 8, 3, None), (128, 64, 8, 2, None), (64, 64, 4, 3, None), (128, 128, 8, 2, None),
           (None, 32, 4, 4, None), (None, 64, 4, 4, 2)]

# --grid: (rows per program, warps) pairs (one warp group of 4 per 64 rows, or two), keys per step,
# stages, key splits
GRID_ROWS_WARPS = ((32, 4), (64, 4), (64, 8), (128, 8))
GRID_KEYS, GRID_STAGES, GRID_SPLITS = (32, 64), (2, 3), (1, 2, 3, 4)


def numbers(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def label(choice, tma: bool | None = None) -> str:
    text = "x".join(str(part or "auto") for part in choice[:4]) + f" splits {choice[4] or 'auto'}"
    return text if tma is None else text + (" tma" if tma else " ptr")


def library_lines(q, rows, query, key, value, mask, end, groups, dim) -> None:
    """SDPA's flash kernel without the mask and cuDNN's with it, over the visible keys [1, H, L, D]."""
    heads = key.shape[0]
    by_head = query.reshape(heads * groups, q, dim)[None]  # [1, Hq, q, D]: row i * q + t of K/V head h
    keys, values = key[None, :, :end], value[None, :, :end]
    wide = (keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1))  # cuDNN: no GQA flag here
    visible = mask[:q, :end][None, None] == 0
    for name, backend, kv, attn_mask in (("flash, no mask", SDPBackend.FLASH_ATTENTION, (keys, values), None),
                                         ("cuDNN, mask", SDPBackend.CUDNN_ATTENTION, wide, visible)):
        def call(backend=backend, kv=kv, attn_mask=attn_mask):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(
                    by_head, *kv, attn_mask=attn_mask, scale=dim**-0.5, enable_gqa=kv[0].shape[1] != by_head.shape[1])
        try:
            call()
            print(f"{q:>5} {rows:>5} {name:>46} {replay_us(call):7.1f}")
        except Exception as error:  # noqa: BLE001 - a backend that refuses the shape, the mask or the capture
            print(f"{q:>5} {rows:>5} {name:>46} {'fails':>7}  {str(error).splitlines()[0][:80]}")


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b", choices=sorted(TARGETS))
    parser.add_argument("--length", type=int, default=1024, help="committed tokens before the pass")
    parser.add_argument("--capacity", type=int, default=4096, help="K/V buffer slots (a graph reads them all)")
    parser.add_argument("--qs", default="257,1025")
    parser.add_argument("--choices", type=int, default=len(CHOICES), help="time only the first N of CHOICES")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--grid", action="store_true",
                        help="instead of CHOICES, each pair of GRID_ROWS_WARPS with each of GRID_KEYS keys "
                             "per step, GRID_STAGES stages and GRID_SPLITS key splits")
    parser.add_argument("--grid-rows-warps", type=lambda text: tuple(numbers(pair.replace("x", ","))
                                                                     for pair in text.split("/")),
                        default=GRID_ROWS_WARPS, help="the grid's rows x warps pairs, e.g. 64x4/128x8")
    parser.add_argument("--grid-stages", type=numbers, default=GRID_STAGES, help="e.g. 2,3")
    parser.add_argument("--grid-splits", type=numbers, default=GRID_SPLITS, help="e.g. 1,2,4")
    parser.add_argument("--descriptors", action="store_true",
                        help="each choice with its whole K/V tiles by TMA and by block pointers")
    parser.add_argument("--libraries", action="store_true",
                        help="SDPA's flash kernel (no mask) and cuDNN's (mask) over exactly the visible keys")
    parser.add_argument("--ends", action="store_true",
                        help="each choice also with each node's ends, in o_proj's layout (the target passes' form)")
    parser.add_argument("--causal", action="store_true", help="a prompt chunk's visibility instead of a tree's")
    parser.add_argument("--shared", action="store_true",
                        help="each choice without given splits also with its work shared among one round of programs")
    parser.add_argument("--programs", type=numbers, default=(),
                        help="and shared among each of these counts, e.g. 264,528")
    args = parser.parse_args()
    shape = TARGETS[args.shape]
    kv_heads, dim = shape["num_key_value_heads"], shape["head_dim"]
    groups = shape["num_attention_heads"] // kv_heads
    bandwidth = copy_bandwidth()
    print(f"{args.shape}: {kv_heads} K/V heads x {groups} query heads of {dim}, {args.length} committed tokens, "
          f"{args.capacity} slots; {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'q':>5} {'rows':>5} {'choice':>46} {'us':>7} {'error':>7}")
    for q in (int(x) for x in args.qs.split(",")):
        query, key, value, mask, slots, ends = attention_pass_inputs(
            kv_heads, groups, q, args.capacity, args.length, dim, getattr(torch, args.dtype), q, causal=args.causal,
            ends=True)
        key, value = torch.nan_to_num(key), torch.nan_to_num(value)  # SDPA over all slots reads them
        end = args.length + q
        want = attend_folded(query, key[:, :end], value[:, :end], mask[:, :end], dim**-0.5).float()
        rows = groups * q
        floor_us = 2 * key[:, :end].nbytes / bandwidth * 1e6  # K and V read once (bandwidth: bytes moved)
        print(f"{q:>5} {rows:>5} {'K/V read floor':>46} {floor_us:7.1f}")
        print(f"{q:>5} {rows:>5} {'no kernel, whole buffer':>46} "
              f"{replay_us(lambda: attend_folded(query, key, value, mask, dim**-0.5)):7.1f}")
        print(f"{q:>5} {rows:>5} {'no kernel, exact keys':>46} "
              f"{replay_us(lambda: attend_folded(query, key[:, :end], value[:, :end], mask[:, :end], dim**-0.5)):7.1f}")
        if args.libraries:
            library_lines(q, rows, query, key, value, mask, end, groups, dim)
        choices = CHOICES[: args.choices]
        if args.grid:
            choices = [(rows_, keys_, warps_, stages_, splits_) for rows_, warps_ in args.grid_rows_warps
                       for keys_ in GRID_KEYS for stages_ in args.grid_stages for splits_ in args.grid_splits]
        forms = (True, False) if args.descriptors else (None,)
        by_node = want.reshape(kv_heads * groups, q, dim).transpose(0, 1).reshape(q, -1)
        # how the work is divided: key splits (None), shared among one round of programs (0), or among N
        divisions = (None,) + ((0,) if args.shared else ()) + tuple(args.programs)
        bounded_forms = (False, True) if args.ends else (False,)
        for choice, tma, bounded, programs in ((choice, tma, bounded, programs) for choice in choices
                                               for tma in forms for bounded in bounded_forms
                                               for programs in divisions if programs is None or choice[4] is None):
            block, keys, warps, stages, splits = choice

            def call():
                return attention_triton.attend_until(query, key, value, mask, slots, dim**-0.5, splits=splits,
                                                     rows_per_program=block, programs=programs or None,
                                                     **({"nodes": q, "ends": ends} if bounded else {}))

            first = attention_triton.tiles_for(dim)[0]
            tiles = first if keys is None else (block or first[0], keys, warps, stages)
            name = label(choice, tma) + ("" if programs is None else f" shared {programs or ''}".rstrip())
            with (attention_triton.only_tiles(tiles), attention_triton.by_descriptor(tma),
                  attention_triton.sharing(programs == 0)):
                try:
                    got = call()
                except Exception as error:  # noqa: BLE001 - a choice that fails to compile here: the next
                    print(f"{q:>5} {rows:>5} {name:>46} {'fails':>7}  {str(error).splitlines()[0][:80]}")
                    continue
                if got is None:
                    print(f"{q:>5} {rows:>5} {name:>46} {'no room':>7}")
                    continue
                reference = by_node if bounded else want
                error = ((got.float() - reference).norm() / reference.norm()).item()
                name += " ends" if bounded else ""
                print(f"{q:>5} {rows:>5} {name:>46} {replay_us(call):7.1f} {error:7.0e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
