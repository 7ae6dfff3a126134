"""CPU benchmark of the decoding engines on small random models (prints numbers; asserts nothing).

    python benchmarks/engines.py [--shape tiny|small] [--prompts 4] [--max-new-tokens 64]

Per method and setting: tokens/s, tau, and the share of round time spent drafting, building the
tree, verifying and committing (stage timer on). Random weights mean tau says little about real
drafters; the point is the cost structure of a round and that nothing outside the two forwards
dominates it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tools.tiny import TinyShape, write_tiny_pair
from workers.decoding import ar, ddtree, dflash
from workers.decoding.generation import GenerationConfig, StageTimer
from workers.decoding.params import DFlashParams, TreeParams
from workers.metrics import summarize
from workers.models.loading import Placement, load_drafter, load_target
from workers.models.runner.target import make_target

SHAPES = {
    "tiny": TinyShape(),
    "small": TinyShape(vocab_size=2048, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                       intermediate_size=768, drafter_layers=2, block_size=16, init_std=0.05),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="small")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = SHAPES[args.shape]

    with tempfile.TemporaryDirectory() as tmp:
        target_dir, drafter_dir = write_tiny_pair(Path(tmp), shape)
        model = load_target(str(target_dir), dtype="float32", placement=Placement(device="cpu"))
        drafter = load_drafter(str(drafter_dir), model)
    target = make_target(model, drafter.spec.target_layer_ids)
    prompts = [torch.randint(1, shape.vocab_size, (1, args.prompt_length)) for _ in range(args.prompts)]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    depth = shape.block_size - 1

    settings = [("ar", ar.generate, None, None)]
    settings += [(f"dflash n={n}", dflash.generate, drafter, DFlashParams(n)) for n in (3, depth)]
    settings += [
        (f"ddtree B={b}", ddtree.generate, drafter, TreeParams(b)) for b in (4, 16, 64, 256)
    ] + [(f"ddtree B=64 K=2 L={depth // 2}", ddtree.generate, drafter, TreeParams(64, depth // 2, 2))]

    table = Table(title=f"engines on the '{args.shape}' random model, CPU float32, "
                        f"{args.prompts} prompts x {args.max_new_tokens} tokens")
    for column in ("setting", "tokens/s", "tau", "draft", "tree", "verify", "commit", "lossless"):
        table.add_column(column, justify="right")
    baseline = None
    for name, generate, draft_model, params in settings:
        generate(target, draft_model, prompts[0], GenerationConfig(8), params)  # warm-up
        outputs = [generate(target, draft_model, p, config, params, StageTimer()) for p in prompts]
        baseline = baseline or outputs
        m = summarize(outputs, baseline)
        shares = [f"{100 * m.get(f'share_{s}', 0.0):.0f}%" for s in ("draft", "tree", "verify", "commit")]
        table.add_row(name, f"{m['tokens_per_s']:.1f}", f"{m['tau']:.2f}", *shares, f"{m['lossless_match']:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
