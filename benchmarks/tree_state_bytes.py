"""Per-round extra memory of hybrid tree verification against tree budget, for a real hybrid shape.

    python benchmarks/tree_state_bytes.py [--shape qwen3.6-27b] [--dtype bfloat16]

``tree_state_bytes`` is what ``StaticTarget`` keeps between a verify pass and its commit (the
per-node vectors of every GDN layer); "full state per node" is the naive fork that keeps
a float32 recurrent state for every node. Computed from the config (tests check the formula against
the bytes a real small hybrid model holds).
"""

from __future__ import annotations

import argparse

from workers.models.gdn import GATHER_BYTES, full_state_bytes, tree_state_bytes
from workers.models.loading import parse_dtype
from workers.models.shapes import target_config

BUDGETS = (16, 32, 64, 128, 256, 512, 1024)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.6-27b")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    config, dtype = target_config(args.shape), parse_dtype(args.dtype)
    print(f"{args.shape}: {sum(t == 'linear_attention' for t in config.layer_types)} GDN layers, "
          f"{config.linear_num_value_heads} value heads of "
          f"{config.linear_key_head_dim}x{config.linear_value_head_dim}, "
          f"model dtype {args.dtype}; the torch tree form gathers at most "
          f"{GATHER_BYTES / 2**20:.0f} MiB per head group")
    print(f"{'budget':>7} {'nodes':>6} {'tree_state_bytes':>17} {'full state/node':>16} {'ratio':>7}")
    for budget in BUDGETS:
        nodes = budget + 1
        lean, full = tree_state_bytes(config, nodes, dtype), full_state_bytes(config, nodes)
        print(f"{budget:>7} {nodes:>6} {lean / 2**20:>13.1f} MiB {full / 2**30:>12.2f} GiB {full / lean:>6.0f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
