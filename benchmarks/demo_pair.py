"""Acceptance and CPU speed of the demo pair on its held-out prompts (prints numbers; asserts nothing).

    python benchmarks/demo_pair.py [--folder data/demo_pair] [--limit 8] [--max-new-tokens 64] [--budgets 16,64,256]

The default folder is the pair the repository ships (``tools.demo_pair`` rebuilds it).

Loads the pair through the project's own loading code (load_target, load_tokenizer, load_drafter),
encodes the prompts without a chat template, and runs greedy AR, DFlash (full chain) and DDTree at
each budget (default depth and branching) in float32 on the CPU: tau, tokens/s, speedup over AR and
whether every output equals AR's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tools.demo_pair import SHIPPED
from workers.decoding import ar, ddtree, dflash
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams
from workers.metrics import summarize
from workers.models.facts import load_tokenizer
from workers.models.loading import Placement, load_drafter, load_target
from workers.models.runner.target import make_target
from workers.prompts import ChatFormat, encode, load_prompts, stop_token_ids


def load_pair(folder: Path, limit: int, max_new_tokens: int):
    """The pair in ``folder`` through the project's loading code, float32 on the CPU: (model, tokenizer,
    drafter, target runner, its held-out prompts as ids without a chat template, greedy config)."""
    target_dir = str(folder / "target")
    model = load_target(target_dir, dtype="float32", placement=Placement(device="cpu"))
    tokenizer = load_tokenizer(target_dir)
    drafter = load_drafter(str(folder / "drafter"), model)
    target = make_target(model, drafter.spec.target_layer_ids)
    rows = model.get_input_embeddings().weight.shape[0]
    prompts = [torch.tensor([encode(p, tokenizer, rows, ChatFormat(chat_template=False))])
               for p in load_prompts(folder / "prompts.jsonl", limit)]
    config = GenerationConfig(max_new_tokens, stop_token_ids=stop_token_ids(tokenizer, model.config))
    return model, tokenizer, drafter, target, prompts, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=SHIPPED)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="16,64,256")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer, drafter, target, prompts, config = load_pair(args.folder, args.limit, args.max_new_tokens)

    settings = [("ar", ar.generate, None, None), ("dflash", dflash.generate, drafter, DFlashParams())]
    settings += [(f"ddtree B={b}", ddtree.generate, drafter, TreeParams(int(b))) for b in args.budgets.split(",")]
    table = Table(title=f"demo pair {args.folder}: {len(prompts)} held-out prompts x {args.max_new_tokens} tokens, "
                        f"CPU float32, {args.threads} threads")
    for column in ("setting", "tau", "tokens/s", "speedup", "lossless"):
        table.add_column(column, justify="right")
    baseline = None
    for name, generate, draft_model, params in settings:
        generate(target, draft_model, prompts[0], GenerationConfig(8), params)  # warm-up
        outputs = [generate(target, draft_model, p, config, params) for p in prompts]
        baseline = baseline or outputs
        m = summarize(outputs, baseline)
        table.add_row(name, f"{m['tau']:.2f}", f"{m['tokens_per_s']:.1f}", f"{m['speedup']:.2f}",
                      f"{m['lossless_match']:.2f}")
    Console().print(table)
    print("sample continuation:", repr(tokenizer.decode(baseline[0].token_ids)[:300]))


if __name__ == "__main__":
    main()
