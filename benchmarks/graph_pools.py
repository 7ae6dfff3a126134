"""How much memory a captured verify graph keeps (its private pool), by pass width, against the
reserve ``workers/models/placement.py`` counts for it.

    python benchmarks/graph_pools.py [--shape qwen3.6-27b] [--widths 1,17,257,1025] [--capacity 4096]

Random weights of the named shape in bf16 on one GPU, no taps. For each width the first verify pass
captures a graph; the memory still reserved after it (the allocator's cache emptied before and
after) is that graph's pool: its outputs (logits, the GDN layers' pending data) and its activations.
"""

from __future__ import annotations

import argparse

import torch

from workers.models.gdn import tree_state_bytes
from workers.models.placement import RunBudget, graph_activation_bytes
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_target
from workers.seam import is_hybrid

MiB = 2**20


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--widths", default="1,17,257,1025")
    parser.add_argument("--capacity", type=int, default=4096)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = build_random_target(args.shape, torch.bfloat16, torch.device("cuda"))
    config, vocab = model.config, model.config.vocab_size
    target = StaticTarget(model, graphs=True)
    target.start(capacity=args.capacity, max_verify=max(widths))
    print(f"{args.shape}, K/V capacity {target.capacity}: pool = measured; outputs = logits + GDN pending; "
          "activations = pool - outputs; estimate = placement.graph_activation_bytes")
    print(f"{'width':>6} {'pool MiB':>9} {'outputs MiB':>12} {'activations MiB':>16} {'estimate MiB':>13}")
    for width in widths:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        tokens = torch.randint(1, vocab - 1, (width,), device="cuda")
        if width <= 16:
            target.verify_chain(tokens)
        else:
            from workers.decoding.params import TreeParams
            from workers.decoding.tree import build_tree

            log_probs = torch.log_softmax(torch.randn(15, vocab, device="cuda") * 4, dim=-1)
            target.verify_tree(tokens[0], build_tree(log_probs, TreeParams(width - 1, max_depth=15)).to("cuda"))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        pool = torch.cuda.memory_reserved() - before
        outputs = width * vocab * 2 + (tree_state_bytes(config, width) if is_hybrid(config) else 0)
        estimate = graph_activation_bytes(config, RunBudget(max_tokens=target.capacity, max_verify=width),
                                          torch.bfloat16)
        print(f"{width:>6} {pool / MiB:>9.1f} {outputs / MiB:>12.1f} {(pool - outputs) / MiB:>16.1f} "
              f"{estimate / MiB:>13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
