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
from rich.console import Console
from rich.table import Table

from tools.demo_pair import SHIPPED
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import TreeParams
from workers.decoding.replay import ddtree_lengths, dflash_lengths, record
from workers.models.facts import load_tokenizer
from workers.models.loading import Placement, load_drafter, load_target
from workers.models.runner.target import make_target
from workers.prompts import ChatFormat, encode, load_prompts, stop_token_ids


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

    target_dir = str(args.folder / "target")
    model = load_target(target_dir, dtype="float32", placement=Placement(device="cpu"))
    tokenizer = load_tokenizer(target_dir)
    drafter = load_drafter(str(args.folder / "drafter"), model)
    target = make_target(model, drafter.spec.target_layer_ids)
    rows = model.get_input_embeddings().weight.shape[0]
    prompts = [torch.tensor([encode(p, tokenizer, rows, ChatFormat(chat_template=False))])
               for p in load_prompts(args.folder / "prompts.jsonl", args.limit)]
    config = GenerationConfig(args.max_new_tokens, stop_token_ids=stop_token_ids(tokenizer, model.config))
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
