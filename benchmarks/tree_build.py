"""DDTree's tree build on the GPU, replayed from a CUDA graph, per budget and per spread of its count.

    python benchmarks/tree_build.py [--budgets 16,64,256,1024] [--wide-from 1,32,9999] [--base OTHER.py ...] [--profile]

The build a round runs (``tree.build_tree`` on a drafter's log-probs: the top-K per position, then
``tree_triton``'s kernels) on random log-probs of 15 positions over a Qwen3 vocabulary, captured once
per setting and replayed; CUDA events around each replay, median and quartiles. Settings:
``tree_triton.WIDE_COUNT_BLOCKS`` (from how many blocks of candidates a depth's count takes the wide
kernel), and with ``--base`` other copies of ``tree_triton.py`` (say the last commit's) timed beside this
one, each at its own setting. Every setting's tree is checked against the torch build, field for
field. ``--profile`` lists the kernels of one replay of this module's default at each budget.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from contextlib import contextmanager

import torch

from workers.decoding import tree_triton
from workers.decoding.params import TreeParams
from workers.decoding.tree import build_tree
from workers.models.graph_cache import capture

FIELDS = ("tokens", "depths", "parents", "visibility", "log_probs")


@contextmanager
def module_as_tree_triton(module):
    """``build_tree`` imports ``best_prefixes`` from ``workers.decoding.tree_triton`` at each call: the
    given module stands in for it meanwhile."""
    name = "workers.decoding.tree_triton"
    own = sys.modules[name]
    sys.modules[name] = module
    try:
        yield
    finally:
        sys.modules[name] = own


def replay_us(graph, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3)
    return samples


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="16,64,256,1024")
    parser.add_argument("--wide-from", default="1,32,9999", help="WIDE_COUNT_BLOCKS settings, comma-separated")
    parser.add_argument("--base", action="append", default=[],
                        help="another tree_triton.py to time beside this one (repeatable)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--positions", type=int, default=15)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    log_probs = torch.log_softmax(torch.randn(args.positions, args.vocab, device=device) * 2, dim=-1)
    settings = [(f"wide from {n}", tree_triton, n) for n in (int(v) for v in args.wide_from.split(","))]
    for number, path in enumerate(args.base):
        spec = importlib.util.spec_from_file_location(f"tree_triton_base{number}", path)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
        settings.insert(number, (f"base {number}", base, None))
    default = tree_triton.WIDE_COUNT_BLOCKS
    print(f"{torch.cuda.get_device_name()}; {args.positions} positions x {args.vocab} tokens; us a replayed build, "
          "median (quartiles)")
    print(f"{'B':>5} {'setting':>15} {'us':>22}  same tree as torch")
    for budget in (int(b) for b in args.budgets.split(",")):
        params = TreeParams(budget)
        want = build_tree(log_probs, params, kernels=False)
        for label, module, wide_from in settings:
            if wide_from is not None:
                module.WIDE_COUNT_BLOCKS = wide_from
            with module_as_tree_triton(module):
                graph, got = capture(lambda: build_tree(log_probs, params))
            graph.replay()
            same = all(torch.equal(getattr(got, f), getattr(want, f)) for f in FIELDS)
            samples = replay_us(graph, args.reps)
            low, median, high = statistics.quantiles(samples, n=4)
            print(f"{budget:>5} {label:>15} {median:>9.1f} ({low:.1f}-{high:.1f})  {same}")
        tree_triton.WIDE_COUNT_BLOCKS = default
        if args.profile:
            from forward_anatomy import kernel_breakdown  # a sibling script: benchmarks/ is on sys.path

            lines: list[str] = []
            graph, _ = capture(lambda: build_tree(log_probs, params))
            kernel_breakdown(graph.replay, f"tree build B={budget}, graph, wide from {default}", lines, top=12)
            print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
