"""Benchmark one method and setting on a prompt file: ``python -m workers.bench --help``.

Example (the tiny offline models; see ``python -m workers.tiny``)::

    python -m workers.bench --target models/tiny/target --drafter models/tiny/drafter \\
        --method ddtree --tree-budget 32 --prompts models/tiny/prompts.jsonl --dtype float32 --json

Random weights of a real shape, built on the GPU (no download; prompts are random token ids of
``--prompt-length`` unless ``--prompts`` is given)::

    python -m workers.bench --target random:qwen3-8b --drafter random:qwen3-8b --method ddtree --tree-budget 256

With ``--json`` stdout holds exactly one JSON object: method, params, status, metrics,
acceptance_histogram, memory (peaks per device) and outputs (token_ids and acceptance_lengths per
prompt). Bad flags or checkpoints that do not fit exit with status 2 and a one-line message; a trial
that fails (out of memory, error) prints its result and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import NoReturn

from workers.errors import BadInputError
from workers.models.loading import DTYPES
from workers.prompts import BENCHMARKS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2, as for every bad input
        self.exit(2, f"workers.bench: error: {message}\n")


def _at_least(kind: str, cast: type, minimum: float):
    """An argparse type: ``cast(text)`` that must be >= minimum, with a message naming the flag."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            noun = "an integer" if cast is int else "a number"
            raise argparse.ArgumentTypeError(f"{kind} must be {noun}, got '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{kind} must be >= {minimum}, got {value}")
        return value

    return parse


def _positive(kind: str):
    return _at_least(kind, int, 1)


def _id_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stop-token-ids must be comma-separated integers, got '{text}'") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m workers.bench", description="Time AR, DFlash or DDTree decoding on a prompt file.")
    p.add_argument("--target", required=True,
                   help="target model: hub id, local folder, or random:<shape> (shapes: qwen3-8b, qwen3.6-27b)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint: hub id, local folder or random:<shape> "
                   "(needed for dflash/ddtree)")
    p.add_argument("--method", required=True, choices=["ar", "dflash", "ddtree"])
    p.add_argument("--tree-budget", type=_positive("--tree-budget"), help="DDTree nodes besides the root")
    p.add_argument("--max-depth", type=_positive("--max-depth"), help="DDTree depth cap (default block_size-1)")
    p.add_argument("--branching", type=_positive("--branching"), help="DDTree children per node (default unlimited)")
    p.add_argument("--num-draft-tokens", type=_positive("--num-draft-tokens"), help="DFlash chain length")
    p.add_argument("--prompts", help='JSONL: {"prompt": "..."} or {"input_ids": [...]} per line; with --dataset, '
                   "a local copy of that dataset (.jsonl/.json/.parquet)")
    p.add_argument("--dataset", choices=sorted(BENCHMARKS), help="a named benchmark (hub, or --prompts offline)")
    p.add_argument("--split", help="dataset split (default: the benchmark's evaluation split)")
    p.add_argument("--limit", type=_positive("--limit"), help="use N prompts")
    p.add_argument("--sample-seed", type=int, help="sample the N prompts at random with this seed (default: first N)")
    p.add_argument("--no-chat-template", action="store_true", help="raw prompt text, no chat template")
    p.add_argument("--enable-thinking", action="store_true", help="thinking mode, for templates that have it")
    p.add_argument("--stop-token-ids", type=_id_list, help="comma-separated stop ids (default: eos + end-of-turn)")
    p.add_argument("--prompt-length", type=_positive("--prompt-length"), default=1024,
                   help="random:<shape> targets without --prompts: random prompts of this many tokens")
    p.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=256)
    p.add_argument("--temperature", type=_at_least("temperature", float, 0), default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run verify passes eagerly (debugging)")
    p.add_argument("--compile-layers", action="store_true", help="torch.compile the target's layers (GPU)")
    p.add_argument("--no-baseline", action="store_true", help="skip the AR baseline (no speedup / lossless_match)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


def _check_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.prompts is None and args.dataset is None and not args.target.startswith("random:"):
        parser.error("give --prompts FILE, --dataset NAME, or both")
    if args.method in ("dflash", "ddtree") and not args.drafter:
        parser.error(f"--method {args.method} needs --drafter")
    if args.method == "ddtree" and args.tree_budget is None:
        parser.error("--method ddtree needs --tree-budget")
    if args.method != "ddtree" and any(v is not None for v in (args.tree_budget, args.max_depth, args.branching)):
        parser.error(f"--tree-budget/--max-depth/--branching apply to --method ddtree, not {args.method}")
    if args.method != "dflash" and args.num_draft_tokens is not None:
        parser.error(f"--num-draft-tokens applies to --method dflash, not {args.method}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_flags(args, parser)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    from workers.models.drafter import thinking_warning
    from workers.prompts import PromptSource, load_source
    from workers.worker import Method, TrialSpec, Worker, WorkerConfig

    try:
        random_prompts = args.prompts is None and args.dataset is None  # a random:<shape> target
        if not random_prompts:
            prompts = load_source(PromptSource(args.prompts, args.dataset, args.split, args.limit, args.sample_seed))
        config = WorkerConfig(target=args.target, drafter=args.drafter, dtype=args.dtype, device=args.device,
                              chat_template=not args.no_chat_template, enable_thinking=args.enable_thinking,
                              cuda_graphs=not args.no_cuda_graphs, compile_layers=args.compile_layers)
        warning = thinking_warning(args.drafter, args.enable_thinking)
        if warning:
            print(warning, file=sys.stderr)
        worker = Worker(config)
        worker.load()
        if random_prompts:
            rows = worker.model.get_input_embeddings().weight.shape[0]
            prompts = _random_prompts(args.limit or 4, args.prompt_length, rows - 1, args.seed)
        block = worker.block_size
        for flag, value in (("--max-depth", args.max_depth), ("--num-draft-tokens", args.num_draft_tokens)):
            if value is not None and block is not None and value > block - 1:
                raise BadInputError(f"{flag} {value} exceeds the drafter's block_size-1 = {block - 1}")
    except BadInputError as exc:
        print(f"workers.bench: error: {exc}", file=sys.stderr)
        return 2

    spec = TrialSpec(
        method=Method(args.method),
        prompts=tuple(prompts),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        tree_budget=args.tree_budget,
        max_depth=args.max_depth,
        branching=args.branching,
        num_draft_tokens=args.num_draft_tokens,
        stop_token_ids=args.stop_token_ids,
        baseline=not args.no_baseline,
    )
    result = worker.run_trial(spec)
    if args.json:
        print(json.dumps(_json_payload(result)))
    else:
        _print_table(result)
    if result.status != "ok":
        print(f"workers.bench: trial {result.status}: {result.error}", file=sys.stderr)
        return 1
    return 0


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list:
    import torch

    from workers.prompts import Prompt

    generator = torch.Generator().manual_seed(seed)
    return [Prompt(input_ids=tuple(torch.randint(1, vocab, (length,), generator=generator).tolist()))
            for _ in range(count)]


def _json_payload(result) -> dict:
    trace = result.memory_trace
    return {
        "method": result.method,
        "params": result.params,
        "status": result.status,
        "error": result.error,
        "metrics": result.metrics,
        "acceptance_histogram": {str(k): v for k, v in result.acceptance_histogram.items()},
        "memory": {
            "kind": trace.kind,  # "cuda": reserved bytes per GPU; "process_rss": the process's peak RSS as device 0
            "peak_reserved_bytes": {str(k): v for k, v in trace.peak_reserved_bytes.items()},
            "note": trace.note,
        },
        "outputs": [{"token_ids": o.token_ids, "acceptance_lengths": o.acceptance_lengths} for o in result.outputs],
    }


def _print_table(result) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result.method} {result.params}  status={result.status}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in result.metrics.items():
        table.add_row(name, "-" if value is None else f"{value:.4g}")
    table.add_row("acceptance histogram", " ".join(f"{k}:{v}" for k, v in result.acceptance_histogram.items()))
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
