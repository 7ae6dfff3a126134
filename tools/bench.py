"""Benchmark one method and setting on a prompt file: ``python -m tools.bench --help``.

Example (the tiny offline models; see ``python -m tools.tiny``)::

    python -m tools.bench --target models/tiny/target --drafter models/tiny/drafter \\
        --method ddtree --tree-budget 32 --prompts models/tiny/prompts.jsonl --dtype float32 --json

Random weights of a real shape, built on the GPU (no download; prompts are random token ids of
``--prompt-length`` unless ``--prompts`` is given)::

    python -m tools.bench --target random:qwen3-8b --drafter random:qwen3-8b --method ddtree --tree-budget 256

With ``--json`` stdout holds exactly one JSON object: method, params, status, metrics,
acceptance_histogram, memory (peaks per device) and outputs (token_ids and acceptance_lengths per
prompt). Bad flags or checkpoints that do not fit exit with status 2 and a one-line message; a trial
that fails (out of memory, error) prints its result and exits with status 1.

``--tensor-parallel N`` shards the target over N local processes (one GPU each with NCCL, or gloo on
the CPU), every rank running the trial in lockstep; rank 0's result is printed::

    python -m tools.bench --target models/tiny/target --drafter models/tiny/drafter --method ddtree \
        --tree-budget 32 --prompts models/tiny/prompts.jsonl --dtype float32 --device cpu --tensor-parallel 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import NoReturn

from workers.decoding.methods import METHODS, Method, all_knobs
from workers.decoding.params import MethodParams
from workers.errors import BadInputError
from workers.models.loading import DTYPES
from workers.models.sources import ModelSource
from workers.prompts import BENCHMARKS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2, as for every bad input
        self.exit(2, f"tools.bench: error: {message}\n")


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


def _knob_value(knob):
    """An argparse type for a method knob: a whole number >= 1, or for a fraction knob a number in (0, 1]."""
    if not knob.fraction:
        return _positive(knob.flag)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{knob.flag} must be a number, got '{text}'") from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"{knob.flag} must be in (0, 1], got {value}")
        return value

    return parse


def _id_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stop-token-ids must be comma-separated integers, got '{text}'") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m tools.bench", description="Time AR, DFlash or DDTree decoding on a prompt file.")
    p.add_argument("--target", required=True,
                   help="target model: hub id, local folder, or random:<shape> (shapes: qwen3-8b, qwen3.6-27b)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint: hub id, local folder or random:<shape> "
                   "(needed for dflash/ddtree)")
    p.add_argument("--method", required=True, choices=[m.value for m in METHODS])
    for knob in all_knobs():  # every method's parameters, from the registry
        p.add_argument(knob.flag, type=_knob_value(knob), help=knob.help)
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
    p.add_argument("--stage-timing", action="store_true",
                   help="time each round stage (share_* metrics); synchronises the device, so it slows decoding")
    p.add_argument("--tensor-parallel", dest="world_size", metavar="N", type=_positive("--tensor-parallel"), default=1,
                   help="shard the target over N local processes (one GPU each; gloo on the CPU)")
    p.add_argument("--local-files-only", action="store_true",
                   help="models from this machine only (a folder or the local Hugging Face cache), never the network; "
                   "a model not here is refused at once (HF_HUB_OFFLINE=1 does the same)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


def _method_params(args: argparse.Namespace, parser: argparse.ArgumentParser) -> MethodParams:
    """The method's parameter object from its flags; another method's flags are refused."""
    if args.prompts is None and args.dataset is None and not ModelSource.parse(args.target).is_random:
        parser.error("give --prompts FILE, --dataset NAME, or both")
    entry = METHODS[Method(args.method)]
    if entry.needs_drafter and not args.drafter:
        parser.error(f"--method {args.method} needs --drafter")
    own = set(entry.params.knob_names())
    for method, other in METHODS.items():  # another method's flags: name that method
        flags = [knob.flag for knob in other.params.KNOBS]
        if other is not entry and any(getattr(args, knob.name) is not None for knob in other.params.KNOBS):
            verb = "applies" if len(flags) == 1 else "apply"
            parser.error(f"{'/'.join(flags)} {verb} to --method {method.value}, not {args.method}")
    for knob in entry.params.KNOBS:
        if knob.required and getattr(args, knob.name) is None:
            parser.error(f"--method {args.method} needs {knob.flag}")
    return entry.params.from_mapping({name: getattr(args, name) for name in own})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    params = _method_params(args, parser)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from workers.wire import TrialStatus

    if args.world_size > 1:
        from tools.local_group import run_local_group

        outcomes = run_local_group(args.world_size, _bench_rank, (args, params))
        failed = [o for o in outcomes if not o.ok]
        if failed:
            print(f"tools.bench: tensor-parallel rank {failed[0].rank} failed: {failed[0].error}", file=sys.stderr)
            return 1
        kind, payload = outcomes[0].value
    else:
        kind, payload = _bench(args, params)
    if kind == "bad_input":
        print(f"tools.bench: error: {payload}", file=sys.stderr)
        return 2
    result = payload
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        _print_table(result)
    for warning in result.warnings:
        print(f"tools.bench: {warning}", file=sys.stderr)
    if result.status is not TrialStatus.OK:
        print(f"tools.bench: trial {result.status.value}: {result.error}", file=sys.stderr)
        return 1
    return 0


def _bench_rank(tp, args: argparse.Namespace, params: MethodParams):
    """One rank of ``--tensor-parallel N`` (``tools.local_group``): the same trial on every rank."""
    return _bench(args, params, tp)


def _bench(args: argparse.Namespace, params: MethodParams, tp=None):
    """Load and run the trial: ("result", TrialResult) or ("bad_input", message). ``tp``: this rank."""
    from workers.models.facts import thinking_warning
    from workers.models.sources import check_model_available
    from workers.prompts import PromptSource, load_source
    from workers.wire import TrialSpec, WorkerConfig
    from workers.worker import Worker

    try:
        check_model_available(args.target, "--target", args.local_files_only)
        if args.drafter:
            check_model_available(args.drafter, "--drafter", args.local_files_only)
        random_prompts = args.prompts is None and args.dataset is None  # a random:<shape> target
        if not random_prompts:
            prompts = load_source(PromptSource(args.prompts, args.dataset, args.split, args.limit, args.sample_seed))
        config = WorkerConfig(target=args.target, drafter=args.drafter, dtype=args.dtype, device=args.device,
                              chat_template=not args.no_chat_template, enable_thinking=args.enable_thinking,
                              cuda_graphs=not args.no_cuda_graphs, compile_layers=args.compile_layers,
                              world_size=args.world_size, local_files_only=args.local_files_only,
                              drafter_local_files_only=args.local_files_only)
        warning = thinking_warning(args.drafter, args.enable_thinking)
        if warning and (tp is None or tp.rank == 0):
            print(warning, file=sys.stderr)
        worker = Worker(config)
        worker.load(tp)
        if random_prompts:
            rows = worker.model.get_input_embeddings().weight.shape[0]
            prompts = _random_prompts(args.limit or 4, args.prompt_length, rows - 1, args.seed)
        for knob in params.KNOBS:  # depth / chain length must fit the drafter's block
            try:
                knob.check([getattr(params, knob.attribute)], worker.block_size)
            except ValueError as exc:
                raise BadInputError(f"{knob.flag}: {exc}") from None
    except BadInputError as exc:
        return "bad_input", str(exc)

    spec = TrialSpec(
        params=params,
        prompts=tuple(prompts),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        stop_token_ids=args.stop_token_ids,
        stage_timing=args.stage_timing,
        baseline=not args.no_baseline,
    )
    return "result", worker.run_trial(spec)


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list:
    import torch

    from workers.prompts import Prompt

    generator = torch.Generator().manual_seed(seed)
    return [Prompt(input_ids=tuple(torch.randint(1, vocab, (length,), generator=generator).tolist()))
            for _ in range(count)]


def _print_table(result) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result.method.value} {result.params}  status={result.status.value}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in result.metrics.items():
        table.add_row(name, "-" if value is None else f"{value:.4g}")
    table.add_row("acceptance histogram", " ".join(f"{k}:{v}" for k, v in result.acceptance_histogram.items()))
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
