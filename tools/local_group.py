"""A tensor-parallel group of local processes: one per rank, joined over a localhost TCP port.

``run_local_group(world_size, fn, args)`` spawns ``world_size`` processes (torch.multiprocessing, spawn start
method), each joins the group (gloo on CPU, nccl on CUDA with one GPU per rank, seen as cuda:0) and
calls ``fn(tp, *args)``; it returns every rank's outcome (its return value or its error) once all
have ended. ``tools.bench --tensor-parallel N`` and the tensor-parallel tests use it; a Ray actor
group does the same job across actors (``orchestrator``).

    outcomes = run_local_group(2, my_function, ("arg",))
    value = outcomes[0].value      # rank 0's return value
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.models.tensor_parallel import TPGroup, join_group
from workers.net import free_port


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    exitcode: int | None  # None: still running when the wait ended (then killed)
    value: Any = None  # what ``fn`` returned
    error: str | None = None  # the exception ``fn`` raised, with its traceback

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


def run_local_group(world_size: int, fn: Callable[..., Any], args: tuple = (), backend: str | None = None,
                    timeout_s: float = 300.0, wait_s: float | None = None) -> list[RankOutcome]:
    """Run ``fn(tp, *args)`` on ``world_size`` local ranks; ``fn`` must be importable (a module-level function).

    ``timeout_s`` bounds each collective inside the group; ``wait_s`` (default: ``timeout_s`` + 120 s
    to load models) bounds the whole run, after which ranks still alive are killed.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    gpus = _visible_gpus() if backend == "nccl" else []
    if backend == "nccl" and len(gpus) < world_size:
        from workers.errors import BadInputError

        raise BadInputError(f"tensor_parallel={world_size} needs {world_size} GPUs, {len(gpus)} visible")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tp-group-") as folder:
        processes = []
        for rank in range(world_size):
            gpu = gpus[rank] if gpus else None
            process = context.Process(target=_rank_main, daemon=False,
                                      args=(rank, world_size, init_method, backend, timeout_s, gpu, fn, args, folder))
            process.start()
            processes.append(process)
        deadline = timeout_s + 120.0 if wait_s is None else wait_s
        outcomes = []
        for rank, process in enumerate(processes):
            process.join(deadline)  # later ranks have had at least as long
            if process.is_alive():
                process.kill()
                process.join()
                outcomes.append(RankOutcome(rank, None, error="killed: still running when the wait ended"))
                continue
            outcomes.append(_read_outcome(Path(folder), rank, process.exitcode))
    return outcomes


def _visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [part for part in visible.split(",") if part.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def _rank_main(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float, gpu: str | None,
               fn: Callable[..., Any], args: tuple, folder: str) -> None:
    """One rank: its own GPU as cuda:0 (before CUDA starts), join the group, run ``fn``, save the outcome."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    outcome: dict[str, Any] = {}
    tp: TPGroup | None = None
    try:
        tp = join_group(rank, world_size, init_method, backend=backend, timeout_s=timeout_s)
        outcome["value"] = fn(tp, *args)
    except BaseException as exc:  # reported to the caller, not lost with the process
        outcome["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
    torch.save(outcome, Path(folder) / f"rank{rank}.pt")
    if tp is not None:  # the alarm's watcher stopped before the process ends; the group left if it ran
        if "error" in outcome and tp.alarm is not None:
            tp.alarm.close()
        elif "error" not in outcome:
            tp.close()


def _read_outcome(folder: Path, rank: int, exitcode: int | None) -> RankOutcome:
    path = folder / f"rank{rank}.pt"
    if not path.exists():
        return RankOutcome(rank, exitcode, error=f"rank {rank} exited with status {exitcode} and left no result")
    saved = torch.load(path, weights_only=False)
    return RankOutcome(rank, exitcode, saved.get("value"), saved.get("error"))
