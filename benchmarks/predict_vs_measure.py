"""Predicted against measured tokens/s for several settings, and the predicted strategy against a grid.

Predicted: one replay (AR run + drafter passes, ``workers.decoding.replay``) and one cost table
(``workers.costs``) on the worker, then every setting's tokens/s without running it. Measured: the
real trial of each setting (stage timing off, as in a sweep). The second table compares the best
measured setting of an exhaustive grid with the predicted strategy's (replay + costs + real trials
of the predicted top ``--top`` and ``--explore`` others), with the time each spent.

    python benchmarks/predict_vs_measure.py                        # tiny random pair on CPU
    python benchmarks/predict_vs_measure.py --target random:qwen3-8b --drafter random:qwen3-8b \\
        --device cuda --dtype bfloat16 --prompt-length 512 --max-new-tokens 128

Imports only torch/transformers and the workers package (no Ray, Optuna, MLflow or pydantic).
"""

from __future__ import annotations

import argparse
import itertools
import random
import tempfile
import time
from pathlib import Path

import torch

from workers.costs import CostTable, predict
from workers.decoding.methods import entry
from workers.decoding.replay import ReplayTable
from workers.prompts import Prompt
from workers.tiny import TinyShape, write_tiny_pair
from workers.wire import TrialSpec, WorkerConfig
from workers.worker import Worker

DEFAULT_BUDGETS = (4, 8, 16, 32, 64)
DEFAULT_DEPTHS = (3, None)
DEFAULT_BRANCHINGS = (2, None)


def spec(params, prompts, max_new: int, **kwargs) -> TrialSpec:
    return TrialSpec(params, tuple(prompts), max_new_tokens=max_new, stop_token_ids=(), **kwargs)


def grid(method: str, values: dict[str, list], block: int) -> list[dict]:
    """Every combination of the method's knobs over ``values`` (knob name -> values to try)."""
    names = entry(method).params.knob_names()
    settings = [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(values[n] for n in names))]
    return [s for s in settings if s.get("max_depth") is None or s["max_depth"] <= block - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model folder or random:<shape> (default: a tiny random pair, written here)")
    parser.add_argument("--drafter")
    parser.add_argument("--method", choices=("ddtree", "dflash"), default="ddtree")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    parser.add_argument("--depths", default=",".join("None" if d is None else str(d) for d in DEFAULT_DEPTHS))
    parser.add_argument("--branchings", default=",".join("None" if k is None else str(k) for k in DEFAULT_BRANCHINGS))
    parser.add_argument("--top", type=int, default=3, help="predicted strategy: real trials of the predicted best")
    parser.add_argument("--explore", type=int, default=1, help="predicted strategy: real trials of random others")
    parser.add_argument("--no-grid", action="store_true", help="skip the exhaustive grid comparison")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny matrices: one thread is as fast and does not fight other processes

    if args.target is None:
        folder = Path(tempfile.mkdtemp())
        target_dir, drafter_dir = write_tiny_pair(folder, TinyShape(vocab_size=6, block_size=6))
        args.target, args.drafter = str(target_dir), str(drafter_dir)
    worker = Worker(WorkerConfig(target=args.target, drafter=args.drafter, dtype=args.dtype, device=args.device,
                                 local_files_only=True)).load()
    block = worker.block_size
    vocab = worker.model.get_input_embeddings().weight.shape[0] - 1
    generator = torch.Generator().manual_seed(0)
    prompts = [Prompt(input_ids=tuple(torch.randint(1, vocab, (args.prompt_length,), generator=generator).tolist()))
               for _ in range(args.prompts)]

    def ints(text: str) -> list[int | None]:
        return [None if part == "None" else int(part) for part in text.split(",")]

    method = entry(args.method)
    values = {"tree_budget": ints(args.budgets), "max_depth": ints(args.depths), "branching": ints(args.branchings),
              "num_draft_tokens": list(range(1, block))}
    settings = grid(args.method, values, block)
    params = [method.params_from(s, block) for s in settings]
    plan = method.replay_plan(params, block)

    begin = time.perf_counter()
    base = spec(params[0], prompts, args.max_new_tokens)
    tables = [ReplayTable.from_dict(t) for t in worker.replay_tables(base, top_k=plan.top_k)]
    replay_s = time.perf_counter() - begin
    begin = time.perf_counter()
    costs = CostTable.from_dict(worker.measure_costs(base, params))
    costs_s = time.perf_counter() - begin
    begin = time.perf_counter()
    predicted = {i: predict(tables, costs, p, block, plan.ceiling) for i, p in enumerate(params)}
    predict_s = time.perf_counter() - begin
    print(f"{args.target} on {args.device} ({args.dtype}), {args.prompts} prompts x {args.max_new_tokens} new tokens; "
          f"replay {replay_s:.1f} s, cost table {costs_s:.1f} s, {len(settings)} predictions {predict_s:.2f} s")
    print(f"cost table: verify {_fmt(costs.verify_s)}  draft {_fmt(costs.draft_s)}  commit {_fmt(costs.commit_s)}  "
          f"overhead {costs.overhead_s}")

    measured, trial_s = {}, {}
    order = sorted(predicted, key=lambda i: -predicted[i].tokens_per_s)
    chosen = order[: args.top] + random.Random(0).sample(order[args.top :], min(args.explore, len(order) - args.top))
    to_measure = range(len(settings)) if not args.no_grid else chosen
    print(f"{'setting':<44} {'pred tok/s':>10} {'meas tok/s':>10} {'err':>7} {'pred tau':>8} {'meas tau':>8} "
          f"{'rounds':>11}")
    for i in to_measure:
        result = worker.run_trial(spec(params[i], prompts, args.max_new_tokens, baseline=False))
        if result.status != "ok":
            print(f"{settings[i]}: {result.status} {result.error}")
            continue
        m = result.metrics
        measured[i], trial_s[i] = m["tokens_per_s"], result.wall_s
        p = predicted[i]
        error = (p.tokens_per_s - m["tokens_per_s"]) / m["tokens_per_s"]
        print(f"{str(settings[i]):<44} {p.tokens_per_s:>10.1f} {m['tokens_per_s']:>10.1f} {error:>+7.1%} "
              f"{p.tau:>8.3f} {m['tau']:>8.3f} {p.rounds:>5}/{int(m['rounds']):<5}")
    if args.no_grid:
        return
    grid_best = max(measured, key=measured.get)
    strategy = [i for i in chosen if i in measured]
    strategy_best = max(strategy, key=measured.get)
    grid_time = sum(trial_s.values())
    strategy_time = replay_s + costs_s + predict_s + sum(trial_s[i] for i in strategy)
    print(f"\nexhaustive grid : {len(measured)} trials, {grid_time:.1f} s; best {settings[grid_best]} "
          f"{measured[grid_best]:.1f} tok/s")
    print(f"predicted       : {len(strategy)} trials + replay/costs, {strategy_time:.1f} s "
          f"({strategy_time / grid_time:.0%} of the grid); best {settings[strategy_best]} "
          f"{measured[strategy_best]:.1f} tok/s "
          f"({measured[strategy_best] / measured[grid_best]:.1%} of the grid's best)")


def _fmt(points: dict[int, float]) -> str:
    return "{" + ", ".join(f"{k}: {v * 1e3:.2f}ms" for k, v in sorted(points.items())[:6]) + (
        ", ..." if len(points) > 6 else "") + "}"


if __name__ == "__main__":
    main()
