"""Run a sweep: ``python -m orchestrator.sweep SWEEP.yaml [--dry-run] [--new-study]``.

The driver validates the file, starts (or joins) Ray, places one generation actor per GPU group,
then loops: ask Optuna for a setting, hand it to an idle actor, wait for any result, log it to
MLflow, tell Optuna. Running the same command again resumes the study. Exit status: 0 when the
sweep is done; 1 when it stopped on an error it cannot go past (a store failed, trials keep
failing; the study is kept and resumes); 2 on bad input (nothing created); 3 when another driver is
running the same study; 130 when interrupted (in-flight trials KILLED and queued to run again).

Only the standard library is imported before Ctrl-C / SIGTERM handling is in place, so a stop in
the first second is the same clean stop as one later.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_BUSY, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.sweep",
        description="Sweep DDTree / DFlash settings with Ray actors, Optuna and MLflow; re-run to resume.",
    )
    parser.add_argument("sweep", type=Path, help="the sweep YAML file")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan; start nothing")
    parser.add_argument("--new-study", action="store_true",
                        help="when the file's definition changed, start a new study <name>@k instead of refusing")
    return parser


def validate(path: Path):
    """Everything that can be checked without starting anything; raises BadInputError.

    The sweep file, the models (a folder that is not there; the drafter's config field by field and
    against the target's), the stores (a real write where they are files), and every prompt encoded
    against the target (when its config and tokenizer are here).
    """
    from orchestrator.config import (
        check_against_block,
        check_models,
        check_models_available,
        check_prompts,
        drafter_spec,
        load_sweep,
        thinking_warning,
    )
    from orchestrator.study import check_storage
    from orchestrator.tracking import check_tracking_uri
    from workers.errors import BadInputError

    config = load_sweep(path)
    check_models_available(config, str(path))
    spec = drafter_spec(config, str(path))
    block = spec.block_size if spec is not None else None
    check_against_block(config, block, str(path))
    try:
        check_storage(config.storage)
        check_tracking_uri(config.mlflow.tracking_uri)
    except BadInputError as exc:
        raise BadInputError(f"{path}: {exc}") from exc
    facts = check_models(config, spec, str(path))
    check_prompts(config, block, str(path), facts)
    warning = thinking_warning(config)
    if warning:
        print(warning, file=sys.stderr)
    return config


def plan_text(config, path: Path, new_study: bool = False) -> str:
    from orchestrator.study import grid_note, grid_points, status_text, target_complete

    w = config.workers
    lines = [
        f"sweep      {config.name} ({path})  fingerprint {config.fingerprint()}",
        f"method     {config.method}: target {config.target.model} ({config.target.dtype})"
        + (f", drafter {config.drafter.model}" if config.drafter else ""),
        f"ray        {'local cluster' if config.ray.address is None else 'join ' + config.ray.address}",
        f"actors     {w.count} x {w.gpus_per_worker} GPU(s)"
        + (f", tensor-parallel: {w.world_size} ranks per worker" if w.parallel == "tensor" else "")
        + (f", max {w.max_memory_per_gpu} per GPU" if w.max_memory_per_gpu else "")
        + (f", resources {w.resources}" if w.resources else ""),
        "prompts    " + " ".join(str(part) for part in (config.prompts.dataset, config.prompts.path) if part)
        + f" (limit {config.prompts.limit}, seed {config.prompts.seed}, {config.prompts.max_new_tokens} new tokens, "
        + ("chat template" if config.prompts.chat_template else "raw text")
        + (", thinking on)" if config.prompts.enable_thinking else ")"),
        f"sampler    {config.sampler.type} (seed {config.sampler.seed}); "
        f"{target_complete(config)} complete trials wanted"
        + (f"; the predicted best and {config.sampler.explore} explored" if config.sampler.type == "predicted" else "")
        + ("; predictions logged" if config.sampler.predict else ""),
    ]
    if config.pruner.type != "none":
        p = config.pruner
        lines.append(f"pruner     {p.type} (startup {p.n_startup_trials} trials, warm-up {p.n_warmup_steps} prompts)")
    for method in config.methods:
        if config.several:
            lines.append(f"  {method}")
        indent = "    " if config.several else "  "
        for name, space in config.space(method).items():
            lines.append(f"{indent}{name:<17} {space.model_dump(exclude={'type'})}")
        for name, value in config.fixed(method).items():
            lines.append(f"{indent}{name:<17} fixed {value}")
    if config.sampler.type == "grid":
        lines.append(f"  grid points       {len(grid_points(config))}")
        if grid_note(config):
            lines.append(f"  note              {grid_note(config)}")
    objectives = ", ".join(f"{o.direction} {o.metric}" for o in config.objectives)
    constraints = ", ".join(f"{k} {v.model_dump(exclude_none=True)}" for k, v in config.constraints.items())
    lines += [
        f"objectives {objectives}" + (f"; constraints {constraints}" if constraints else ""),
        f"optuna     {config.storage}",
        f"mlflow     {config.mlflow.tracking_uri} experiment '{config.mlflow.experiment}'",
        f"study      {status_text(config, new_study)}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import signal

    from orchestrator.signals import SIGNALS, Interrupted, StopSignals

    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    signals = StopSignals().install()  # first of all: Ctrl-C / SIGTERM now stop cleanly, at a safe point
    try:
        return _main(argv, signals)
    except (Interrupted, KeyboardInterrupt):
        print("orchestrator.sweep: interrupted during start-up; run the same command again to start", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:  # main() called in-process (tests, notebooks): give the caller its handlers back
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _main(argv: list[str] | None, signals) -> int:
    args = build_parser().parse_args(argv)
    from orchestrator.locks import StoreBusyError
    from workers.errors import BadInputError

    try:
        config = validate(args.sweep)
        if args.dry_run:
            plan = plan_text(config, args.sweep, args.new_study)
    except BadInputError as exc:
        print(f"orchestrator.sweep: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    signals.check()
    if args.dry_run:
        print(plan)
        return EXIT_OK
    from orchestrator.driver import Driver

    try:
        return Driver(config, args.sweep, new_study=args.new_study, signals=signals).run()
    except BadInputError as exc:
        print(f"orchestrator.sweep: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StoreBusyError as exc:
        print(f"orchestrator.sweep: error: {exc}", file=sys.stderr)
        return EXIT_BUSY


def exit_now(code: int) -> None:
    """End the process with ``code`` once the output is flushed, skipping the interpreter's teardown.

    By the time ``main`` returns every store is written and closed (trials committed, runs ended, Ray
    shut down); what is left is freeing the modules of torch, transformers, MLflow and SQLAlchemy,
    which took seconds of every run on a 2-core machine (measured in commit 2a10af0's message) and does
    nothing a later run can see."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
