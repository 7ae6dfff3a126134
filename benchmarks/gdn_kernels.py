"""GDN tree pass pieces at a real model's head sizes, one layer, on CUDA.

    python benchmarks/gdn_kernels.py [--shape qwen3.6-27b] [--configs 32/3/4,32/2/4,64/2/4 [--qs 17,257]]

Times (median, CUDA graph replay of one call) the Triton tree pass (the blocked path solve and the
products with the committed state, one kernel) for tree widths q = 17..1025 of depth 15, with its products
in float32 ("ieee", CUDA cores), three-pass tf32 (the default but for bfloat16 models) and tf32 (for
bfloat16 models), 4 warps per program (and 8 in tf32), against the torch form; and checks each
against it (relative error of all outputs), all in the first of ``gdn_triton.FORM_CHOICES``.

``--configs 32/3/4,64/2/4,32/3/4/2,...`` times instead the kernel as a bfloat16 model's pass runs it (tf32,
the gated norm in its epilogue, bfloat16 rows out) at each (step along dk, pipeline stages, warps[, blocks a
program, 1 unless given]), the first being the base: us a call, and how far each one's float32 outputs
(the same pass without the norm) lie from the base's (max abs; 0 = the same bits; the bfloat16 rows after the
norm hide most last-place differences). The forms (``gdn_triton.TREE_FORM``) are (step, stages, blocks):
on an RTX A6000 (32, 2, 1) lets 3 programs share an SM instead of 2, and (64, 2, 1) only one.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from forward_anatomy import graphed, replay_us
from gpu_speed import median_ms

from workers.models.gdn import ancestor_table, tree_delta_rule_normalized
from workers.models.gdn_triton import FORM_CHOICES, tree_outputs
from workers.models.shapes import TARGETS
from workers.models.tree_blocks import tree_blocks


def random_parents(q: int, depth: int) -> torch.Tensor:
    parents, depths = [-1], [0]
    for t in range(1, q):
        parent = int(torch.randint(0, t, (1,)))
        while depths[parent] >= depth:
            parent = parents[parent]
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return torch.tensor(parents)


ROUNDS = 5  # --configs: rounds over the configs, each a median of 7 replays of 20 calls


def layer_inputs(q: int, hk: int, h: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    """A random tree of q nodes (depth <= 15) and one GDN layer's inputs for it; kq in the prologue's layout."""
    torch.manual_seed(q)
    ancestors = ancestor_table(random_parents(q, 15)).cuda()
    q_ = torch.nn.functional.normalize(torch.randn(hk, q, dk, device="cuda"), dim=-1) * dk**-0.5
    k_ = torch.nn.functional.normalize(torch.randn(hk, q, dk, device="cuda"), dim=-1)
    kq = torch.stack((k_, q_), dim=1)  # [Hk, 2, q, dk]
    v_ = torch.randn(h, q, dv, device="cuda")
    g, beta = -torch.rand(q, h, device="cuda"), torch.rand(q, h, device="cuda")
    state = torch.randn(h, dk, dv, device="cuda") * 0.3
    return ancestors, kq, v_, g, beta, state


def time_configs(args: argparse.Namespace) -> int:
    shape = TARGETS[args.shape]
    hk, h, dk, dv = (shape["linear_num_key_heads"], shape["linear_num_value_heads"], shape["linear_key_head_dim"],
                     shape["linear_value_head_dim"])
    configs = [(tuple(int(n) for n in c.split("/")) + (1,))[:4] for c in args.configs.split(",")]
    print(f"{args.shape}: one GDN layer's tree kernel, bfloat16 form (tf32, gated norm); us a call, median of "
          f"{ROUNDS} rounds in turn; vs base = max abs difference from {configs[0]}'s float32 outputs (no norm)")
    print(f"{'q':>5} " + " ".join(f"{'/'.join(map(str, c)):>10} {'vs base':>8}" for c in configs))
    for q in (int(n) for n in args.qs.split(",")):
        ancestors, kq, v_, g, beta, state = layer_inputs(q, hk, h, dk, dv)
        blocks = tree_blocks(ancestors)
        z = torch.randn(q, h * dv, device="cuda", dtype=torch.bfloat16)
        norm = (z, torch.rand(dv, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-6)
        calls, outputs = {}, {}
        for config in configs:
            step, stages, warps, blocks_each = config
            call = (lambda form=(step, stages, blocks_each), warps=warps: tree_outputs(
                kq, v_, g, beta, state, ancestors, blocks, model_dtype=torch.bfloat16, num_warps=warps, norm=norm,
                form=form))
            try:
                call()
                outputs[config] = tree_outputs(kq, v_, g, beta, state, ancestors, blocks, model_dtype=torch.bfloat16,
                                               num_warps=warps, form=(step, stages, blocks_each))
                replay_us(call, calls=2, reps=1)
                calls[config] = call
            except Exception as error:  # a config that does not fit this GPU (shared memory, registers)
                outputs[config] = type(error).__name__
        # rounds over the configs in turn, so that a drift of the clock falls on all of them
        times = {config: [] for config in calls}
        for _ in range(ROUNDS):
            for config, call in calls.items():
                times[config].append(replay_us(call))
        base = outputs[configs[0]]
        cells = []
        for config in configs:
            if config not in calls:
                cells.append(f"{outputs[config][:10]:>10} {'':>8}")
                continue
            spread = (outputs[config].float() - base.float()).abs().max().item()
            cells.append(f"{statistics.median(times[config]):>10.1f} {spread:>8.1e}")
        print(f"{q:>5} " + " ".join(cells))
    return 0


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--configs", default="",
                        help="step/stages/warps[/blocks],... of the bfloat16 form, the first the base")
    parser.add_argument("--qs", default="17,65,257,1025")
    args = parser.parse_args()
    if args.configs:
        return time_configs(args)
    shape = TARGETS[args.shape]
    hk, h, dk, dv = (shape["linear_num_key_heads"], shape["linear_num_value_heads"], shape["linear_key_head_dim"],
                     shape["linear_value_head_dim"])
    lines = [f"{args.shape}: one GDN layer, {hk} key heads, {h} value heads of {dk}x{dv}"]
    precisions = ("ieee", "tf32x3", "tf32")
    lines.append(f"{'q':>5} {'whole ms':>9} {'blocks':>7} {'ieee':>7} {'tf32x3':>7} {'tf32':>7} {'tf32 w=8':>9} "
                 + f"{'torch solve':>12} " + " ".join(f"{p + ' err':>11}" for p in precisions))
    for q in (17, 65, 257, 1025):
        ancestors, kq, v_, g, beta, state = layer_inputs(q, hk, h, dk, dv)
        k_, q_ = kq[:, 0].contiguous(), kq[:, 1].contiguous()
        whole = median_ms(graphed(lambda: tree_delta_rule_normalized(q_, k_, v_, g, beta, state, ancestors, True)))
        blocks = tree_blocks(ancestors)
        blocks_ms = median_ms(graphed(lambda: tree_blocks(ancestors)))
        form = FORM_CHOICES[0]  # the form a tree pass takes unless a trial picks another
        runs = [(4, p) for p in precisions] + [(8, "tf32")]
        solves = [median_ms(graphed(lambda w=w, p=p: tree_outputs(kq, v_, g, beta, state, ancestors, blocks,
                                                                   num_warps=w, precision=p, form=form)))
                  for w, p in runs]
        want = tree_delta_rule_normalized(q_, k_, v_, g, beta, state, ancestors, False)
        errors = []
        for precision in precisions:
            got = tree_outputs(kq, v_, g, beta, state, ancestors, blocks, precision=precision)
            errors.append(((got - want).norm() / want.norm()).item())
        torch_ms = median_ms(lambda: tree_delta_rule_normalized(q_, k_, v_, g, beta, state, ancestors, False), 5)
        lines.append(f"{q:>5} {whole:>9.3f} {blocks_ms:>7.3f} {solves[0]:>7.3f} {solves[1]:>7.3f} {solves[2]:>7.3f} "
                     f"{solves[3]:>9.3f} {torch_ms:>12.3f} " + " ".join(f"{e:>11.1e}" for e in errors))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
