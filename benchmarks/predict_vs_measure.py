"""Predicted against measured tokens/s for every setting of a grid, and the error's distribution.

Predicted: one replay (AR run + drafter passes, ``workers.decoding.replay``) and one cost table
(``workers.costs``) on the worker, then every setting's tokens/s without running it. Measured: the
real trial of each setting (stage timing off, as in a sweep; ``--repeats`` times, the median run per
prompt). Prints one row per setting, then the distribution of |predicted - measured| / measured
(median, 90th percentile, worst), the best setting each way, and the time each route took.

    python benchmarks/predict_vs_measure.py                          # a tiny random pair on CPU
    python benchmarks/predict_vs_measure.py --pair data/demo_pair --device cuda --dtype float32 \\
        --method ddtree,dflash --max-new-tokens 64 --limit 8 --out benchmarks/results/predict_demo_pair.md
    python benchmarks/predict_vs_measure.py --target random:qwen3.6-27b --drafter random:qwen3.6-27b \\
        --device cuda --dtype bfloat16 --prompt-length 512 --max-new-tokens 128

``--pair DIR`` reads DIR/target, DIR/drafter and DIR/prompts.jsonl (the demo pair's layout); ``--prompts
FILE`` takes any prompt file (without a chat template unless ``--chat-template``). Imports only torch,
transformers and the workers package (no Ray, Optuna, MLflow or pydantic).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tools.tiny import TinyShape, write_tiny_pair
from workers.costs import CostTable, predict
from workers.decoding.methods import entry
from workers.decoding.params import ReplayPlan
from workers.decoding.replay import ReplayTable
from workers.metrics import quantile
from workers.prompts import Prompt, PromptSource, load_source
from workers.wire import TrialSpec, WorkerConfig
from workers.worker import Worker

DEFAULT_BUDGETS = (4, 8, 16, 32, 64)
DEFAULT_DEPTHS = (3, None)
DEFAULT_BRANCHINGS = (2, None)


def grid(method: str, values: dict[str, list], block: int) -> list[dict]:
    """Every combination of the method's knobs over ``values`` (knob name -> values to try; a knob not
    given keeps its default)."""
    names = [name for name in entry(method).params.knob_names() if name in values]
    settings = [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(values[n] for n in names))]
    return [s for s in settings if s.get("max_depth") is None or s["max_depth"] <= block - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, help="a folder with target/, drafter/ and prompts.jsonl")
    parser.add_argument("--target", help="model folder or random:<shape> (default: a tiny random pair, written here)")
    parser.add_argument("--drafter")
    parser.add_argument("--prompts", type=Path, help="a JSONL prompt file (default: the pair's, or random ids)")
    parser.add_argument("--chat-template", action="store_true", help="format text prompts with the chat template")
    parser.add_argument("--limit", type=int, default=4, help="prompts used")
    parser.add_argument("--method", default="ddtree", help="ddtree, dflash, or both: ddtree,dflash")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-length", type=int, default=24, help="random prompts' tokens (no prompt file)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1, help="each prompt measured this many times (median)")
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    parser.add_argument("--depths", default=",".join("None" if d is None else str(d) for d in DEFAULT_DEPTHS))
    parser.add_argument("--branchings", default=",".join("None" if k is None else str(k) for k in DEFAULT_BRANCHINGS))
    parser.add_argument("--out", type=Path, help="also write the table and the summary to this markdown file")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny matrices: one thread is as fast and does not fight other processes

    if args.pair is not None:
        args.target, args.drafter = str(args.pair / "target"), str(args.pair / "drafter")
        args.prompts = args.prompts or args.pair / "prompts.jsonl"
    if args.target is None:
        folder = Path(tempfile.mkdtemp())
        target_dir, drafter_dir = write_tiny_pair(folder, TinyShape(vocab_size=6, block_size=6))
        args.target, args.drafter = str(target_dir), str(drafter_dir)
    worker = Worker(WorkerConfig(target=args.target, drafter=args.drafter, dtype=args.dtype, device=args.device,
                                 local_files_only=True, drafter_local_files_only=True,
                                 chat_template=args.chat_template)).load()
    block = worker.block_size
    if args.prompts is not None:
        prompts = load_source(PromptSource(str(args.prompts), limit=args.limit))
    else:
        vocab = worker.model.get_input_embeddings().weight.shape[0] - 1
        generator = torch.Generator().manual_seed(0)
        prompts = [Prompt(input_ids=tuple(torch.randint(1, vocab, (args.prompt_length,), generator=generator)
                                          .tolist())) for _ in range(args.limit)]

    def ints(text: str) -> list[int | None]:
        return [None if part == "None" else int(part) for part in text.split(",")]

    values = {"tree_budget": ints(args.budgets), "max_depth": ints(args.depths), "branching": ints(args.branchings),
              "num_draft_tokens": list(range(1, block))}
    settings, plan = [], ReplayPlan()
    for method in args.method.split(","):
        ours = [entry(method).params_from(s, block) for s in grid(method, values, block)]
        settings += ours
        plan = plan.merge(entry(method).replay_plan(ours, block))

    def spec(params, **kwargs) -> TrialSpec:
        return TrialSpec(params, tuple(prompts), max_new_tokens=args.max_new_tokens, **kwargs)

    begin = time.perf_counter()
    tables = [ReplayTable.from_dict(t) for t in worker.replay_tables(spec(settings[0]), top_k=plan.top_k)]
    replay_s = time.perf_counter() - begin
    begin = time.perf_counter()
    costs = CostTable.from_dict(worker.measure_costs(spec(settings[0]), settings))
    costs_s = time.perf_counter() - begin
    predicted = [predict(tables, costs, p, block, plan.ceiling) for p in settings]
    lines = [f"{args.target} on {args.device} ({args.dtype}), {len(prompts)} prompts x {args.max_new_tokens} new "
             f"tokens, {args.repeats} repeat(s); replay {replay_s:.1f} s, cost table {costs_s:.1f} s",
             "", f"| {'setting':<52} | pred tok/s | meas tok/s |   error | pred tau | meas tau |",
             f"|{'-' * 54}|-----------:|-----------:|--------:|---------:|---------:|"]
    print("\n".join(lines))
    errors, measured, trial_s = [], {}, 0.0
    for index, (params, guess) in enumerate(zip(settings, predicted, strict=True)):
        result = worker.run_trial(spec(params, baseline=False, repeats=args.repeats))
        trial_s += result.wall_s
        if result.status != "ok":
            print(f"{params}: {result.status} {result.error}")
            continue
        m = result.metrics
        measured[index] = m["tokens_per_s"]
        error = (guess.tokens_per_s - m["tokens_per_s"]) / m["tokens_per_s"]
        errors.append(error)
        name = f"{params.METHOD} {params.as_dict()}"
        row = (f"| {name:<52} | {guess.tokens_per_s:>10.1f} | {m['tokens_per_s']:>10.1f} | {error:>+7.1%} | "
               f"{guess.tau:>8.3f} | {m['tau']:>8.3f} |")
        print(row)
        lines.append(row)
    absolute = [abs(e) for e in errors]
    best_predicted = max(range(len(settings)), key=lambda i: predicted[i].tokens_per_s)
    best_measured = max(measured, key=measured.get)
    summary = [
        "",
        f"|predicted - measured| / measured over {len(errors)} settings: median {statistics.median(absolute):.1%}, "
        f"90th percentile {quantile(absolute, 0.9):.1%}, worst {max(absolute):.1%}; "
        f"mean signed {sum(errors) / len(errors):+.1%}",
        f"predicted best: {settings[best_predicted].METHOD} {settings[best_predicted].as_dict()} "
        f"(measured {measured.get(best_predicted, float('nan')):.1f} tok/s); measured best: "
        f"{settings[best_measured].METHOD} {settings[best_measured].as_dict()} ({measured[best_measured]:.1f} tok/s)",
        f"time: predicting every setting {replay_s + costs_s:.1f} s; measuring every setting {trial_s:.1f} s",
    ]
    print("\n".join(summary))
    if args.out is not None:
        args.out.write_text("\n".join(lines + summary) + "\n")


if __name__ == "__main__":
    main()
