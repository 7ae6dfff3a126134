"""DFlash2 rounds against DFlash v1 rounds on one target (issue 27's goal table).

    python benchmarks/dflash2_rounds.py [--shape qwen3.8-27b] [--context 1024] [--new-tokens 48] [--repeats 5]
    python benchmarks/dflash2_rounds.py --shape qwen3.8-mini --v1-shape qwen3.6-mini --device cpu  # smoke

Random weights of a named shape in bf16 on one GPU: the target, its DFlash2 drafter (block 8, the
candidate selector) and a DFlash v1 drafter of the same target family (``qwen3.6-27b``'s: block 16),
each target runner replaying CUDA graphs. Per case, the time of one round (decode time / rounds) over
``--repeats`` generations of one random prompt: median, and min..max. Random weights accept about
nothing, so every round commits about one token; what is compared is the cost of a round.

Cases: DFlash v1 chains of 7 (DFlash2's block, for the goal) and 15 guesses; the DFlash2 chain (the
selector's path, 7 guesses); DDTree over each drafter at budgets 16 and 64 (DFlash2: best-first walks
through the selector's lattice); the AR step. Also each drafter's graph pass alone, and a check that the
graph rounds give the eager rounds' tokens (greedy). Last, issue 27's goals against this run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from workers.decoding import ar, ddtree, dflash
from workers.decoding.drafting import open_drafting
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams
from workers.models.runner.target import StaticTarget
from workers.models.shapes import build_random_drafter, build_random_target

GOALS = (
    ("DFlash2 chain / v1 chain of the same length", "v2 dflash", "v1 dflash n=7", 1.10),
    ("DFlash2 tree B=64 / v1 chain of the same length", "v2 ddtree B=64", "v1 dflash n=7", 1.15),
)


def round_ms(engine, runner, drafter, prompt, config, params, repeats: int) -> tuple[list[float], list[int]]:
    """Per-round milliseconds of each of ``repeats`` generations (after a warm-up), and the last tokens."""
    engine(runner, drafter, prompt, GenerationConfig(max_new_tokens=8), params)  # warm-up: captures graphs
    samples, tokens = [], []
    for _ in range(repeats):
        out = engine(runner, drafter, prompt, config, params)
        samples.append(out.decode_s / max(out.num_rounds, 1) * 1e3)
        tokens = out.token_ids
    return samples, tokens


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.8-27b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--v1-shape", default="qwen3.6-27b",
                        help="whose DFlash v1 drafter (the same target architecture: FIELD_NOTES 13)")
    parser.add_argument("--device", default="cuda", help="cpu: a float32 smoke run of the script (no graphs)")
    args = parser.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)

    model = build_random_target(args.shape, torch.bfloat16 if on_cuda else torch.float32, device)
    drafters = {"v1": build_random_drafter(args.v1_shape, model), "v2": build_random_drafter(args.shape, model)}
    prompt = torch.randint(1, model.config.vocab_size - 1, (1, args.context), device=device)
    capacity = args.context + args.new_tokens + 1100
    runners = {}  # (drafter, graphs) -> a target runner with that drafter's taps
    for name, drafter in drafters.items():
        for graphs in (False, True):
            runners[name, graphs] = StaticTarget(model, drafter.spec.target_layer_ids, graphs=graphs and on_cuda)
    lines = [f"{args.shape}, {model.dtype}, context {args.context}, "
             f"{args.new_tokens} new tokens x {args.repeats} repeats; "
             f"v1 drafter: {args.v1_shape}'s (block {drafters['v1'].block_size}), "
             f"v2: DFlash2 (block {drafters['v2'].block_size}, top-k {drafters['v2'].spec.selector.selector_top_k})"]

    # each drafter's graph pass alone: one block after a prefilled prompt
    for name, drafter in drafters.items():
        runner = runners[name, True]
        runner.start(capacity=capacity, max_verify=65)
        opening = runner.prefill(prompt)
        drafting = open_drafting(drafter, runner, capacity)
        bonus, depth = prompt[0, -1:].clone(), drafter.block_size - 1
        drafting.draft(bonus, opening.taps, depth)
        samples = []
        for _ in range(20):
            sync()
            begin = time.perf_counter()
            drafting.draft(bonus, opening.taps[:, -1:], depth)
            sync()
            samples.append((time.perf_counter() - begin) * 1e3)
        lines.append(f"{name} drafter pass (graph, {depth} positions): {statistics.median(samples):.2f} ms")

    config = GenerationConfig(max_new_tokens=args.new_tokens)
    cases = [("ar", ar.generate, "v1", None),
             ("v1 dflash n=7", dflash.generate, "v1", DFlashParams(7)),
             ("v1 dflash n=15", dflash.generate, "v1", DFlashParams(15)),
             ("v2 dflash", dflash.generate, "v2", DFlashParams()),
             ("v1 ddtree B=16", ddtree.generate, "v1", TreeParams(16)),
             ("v1 ddtree B=64", ddtree.generate, "v1", TreeParams(64)),
             ("v2 ddtree B=16", ddtree.generate, "v2", TreeParams(16)),
             ("v2 ddtree B=64", ddtree.generate, "v2", TreeParams(64))]
    lines.append(f"{'case':>16} {'graph ms/round':>15} {'min..max':>14} {'eager ms/round':>15} {'same tokens':>12}")
    medians = {}
    for name, engine, which, params in cases:
        drafter = drafters[which] if params is not None else None
        graph, graph_tokens = round_ms(engine, runners[which, True], drafter, prompt, config, params, args.repeats)
        eager, eager_tokens = round_ms(engine, runners[which, False], drafter, prompt, config, params, 1)
        medians[name] = statistics.median(graph)
        lines.append(f"{name:>16} {medians[name]:>15.2f} {min(graph):>6.2f}..{max(graph):<6.2f} "
                     f"{eager[0]:>15.2f} {str(graph_tokens == eager_tokens):>12}")

    lines.append(f"{'goal':>48} {'this run':>9} {'bound':>6}")
    for label, case, against, bound in GOALS:
        ratio = medians[case] / medians[against]
        lines.append(f"{label:>48} {ratio:>8.3f}x {bound:>5.2f}x  {'met' if ratio <= bound else 'missed'}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
