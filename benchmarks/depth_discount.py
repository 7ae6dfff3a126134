"""Does DDTree's ``depth_discount`` pay on a drafter? Acceptance by replay (prints numbers; asserts nothing).

    python benchmarks/depth_discount.py [--folder data/demo_pair] [--limit 16] [--max-new-tokens 64]

Greedy AR on the pair's held-out prompts, recorded once (``workers.decoding.replay``), gives every
round of every setting exactly: tau (tokens a round, bonus included) for DDTree at each budget (default
depth and branching) and each discount gamma, a node scoring sum_d gamma^(d-1) log p_d. The verify
width of a setting does not depend on gamma, so at a fixed budget a higher tau is a faster round.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from demo_pair import load_pair  # a sibling script: benchmarks/ is on sys.path
from rich.console import Console
from rich.table import Table

from tools.demo_pair import SHIPPED
from workers.decoding.params import TreeParams
from workers.decoding.replay import ddtree_lengths, dflash_lengths, record


def tau(lengths: list[int]) -> float:
    return sum(lengths) / len(lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=SHIPPED)
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="4,8,16,32,64")
    parser.add_argument("--gammas", default="1.0,0.9,0.8,0.7,0.6,0.5")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    _, _, drafter, target, prompts, config = load_pair(args.folder, args.limit, args.max_new_tokens)
    budgets = [int(b) for b in args.budgets.split(",")]
    tables = [record(target, drafter, prompt, config, top_k=max(budgets)) for prompt in prompts]

    table = Table(title=f"DDTree tau by budget and depth_discount, {args.folder}: {len(prompts)} prompts x "
                        f"{args.max_new_tokens} tokens (greedy, replayed)")
    table.add_column("gamma", justify="right")
    for budget in budgets:
        table.add_column(f"B={budget}", justify="right")
    for gamma in (float(g) for g in args.gammas.split(",")):
        row = [tau([n for t in tables for n in ddtree_lengths(t, TreeParams(b, depth_discount=gamma),
                                                               drafter.block_size)]) for b in budgets]
        table.add_row(f"{gamma:g}", *(f"{v:.3f}" for v in row))
    Console().print(table)
    chain = tau([n for t in tables for n in dflash_lengths(t, drafter.block_size - 1)])
    print(f"DFlash chain of {drafter.block_size - 1}: tau {chain:.3f}")


if __name__ == "__main__":
    main()
