"""GDN tree pass pieces at a real model's head sizes, one layer, on CUDA.

    python benchmarks/gdn_kernels.py [--shape qwen3.6-27b] [--stages 2,3]

Times (median, CUDA graph replay of one call) the Triton tree pass (the blocked path solve and the
products with the committed state, one kernel) for tree widths q = 17..1025 of depth 15, with its products
in float32 ("ieee", CUDA cores), three-pass tf32 (the default but for bfloat16 models) and tf32 (for
bfloat16 models), 4 warps per program (and 8 in tf32), against the torch form; and checks each
against it (relative error of all outputs). ``--stages`` adds tf32 columns at those software-pipeline
depths (``gdn_triton.TREE_STAGES``: on an RTX A6000, 2 stages let 3 programs share an SM instead of 2).
"""

from __future__ import annotations

import argparse

import torch
from forward_anatomy import graphed
from gpu_speed import median_ms

from workers.models.gdn import ancestor_table, tree_delta_rule_normalized
from workers.models.gdn_triton import STAGE_CHOICES, tree_outputs
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


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--stages", default="", help="pipeline depths for extra tf32 columns, e.g. 2,3")
    args = parser.parse_args()
    stages = [int(n) for n in args.stages.split(",") if n]
    shape = TARGETS[args.shape]
    hk, h, dk, dv = (shape["linear_num_key_heads"], shape["linear_num_value_heads"], shape["linear_key_head_dim"],
                     shape["linear_value_head_dim"])
    lines = [f"{args.shape}: one GDN layer, {hk} key heads, {h} value heads of {dk}x{dv}"]
    precisions = ("ieee", "tf32x3", "tf32")
    lines.append(f"{'q':>5} {'whole ms':>9} {'blocks':>7} {'ieee':>7} {'tf32x3':>7} {'tf32':>7} {'tf32 w=8':>9} "
                 + "".join(f"{f'tf32 s={n}':>9} " for n in stages)
                 + f"{'torch solve':>12} " + " ".join(f"{p + ' err':>11}" for p in precisions))
    for q in (17, 65, 257, 1025):
        torch.manual_seed(q)
        ancestors = ancestor_table(random_parents(q, 15)).cuda()
        q_ = torch.nn.functional.normalize(torch.randn(hk, q, dk, device="cuda"), dim=-1) * dk**-0.5
        k_ = torch.nn.functional.normalize(torch.randn(hk, q, dk, device="cuda"), dim=-1)
        v_ = torch.randn(h, q, dv, device="cuda")
        g, beta = -torch.rand(q, h, device="cuda"), torch.rand(q, h, device="cuda")
        state = torch.randn(h, dk, dv, device="cuda") * 0.3
        whole = median_ms(graphed(lambda: tree_delta_rule_normalized(q_, k_, v_, g, beta, state, ancestors, True)))
        kq = torch.stack((k_, q_), dim=1)  # the prologue's layout: [Hk, 2, q, dk]
        blocks = tree_blocks(ancestors)
        blocks_ms = median_ms(graphed(lambda: tree_blocks(ancestors)))
        default = STAGE_CHOICES[0]  # the depth a tree pass takes unless a trial picks another
        runs = [(4, p, default) for p in precisions] + [(8, "tf32", default)] + [(4, "tf32", n) for n in stages]
        solves = [median_ms(graphed(lambda w=w, p=p, n=n: tree_outputs(kq, v_, g, beta, state, ancestors, blocks,
                                                                       num_warps=w, precision=p, num_stages=n)))
                  for w, p, n in runs]
        want = tree_delta_rule_normalized(q_, k_, v_, g, beta, state, ancestors, False)
        errors = []
        for precision in precisions:
            got = tree_outputs(kq, v_, g, beta, state, ancestors, blocks, precision=precision)
            errors.append(((got - want).norm() / want.norm()).item())
        torch_ms = median_ms(lambda: tree_delta_rule_normalized(q_, k_, v_, g, beta, state, ancestors, False), 5)
        lines.append(f"{q:>5} {whole:>9.3f} {blocks_ms:>7.3f} {solves[0]:>7.3f} {solves[1]:>7.3f} {solves[2]:>7.3f} "
                     f"{solves[3]:>9.3f} " + "".join(f"{ms:>9.3f} " for ms in solves[4:])
                     + f"{torch_ms:>12.3f} " + " ".join(f"{e:>11.1e}" for e in errors))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
