"""Tensor-parallel workers: a group of Ray actors, one GPU each, that the driver sees as one actor.

The driver reserves a group's resources on one node with a placement group (``reserve``:
STRICT_PACK, one bundle per rank) and starts the rank-0 ``GenerationActor`` in bundle 0 with a
``GroupPlan``. That actor builds a ``RankGroup``: it starts the other ranks (``RankActor``, bundles
1..N-1) itself, so Ray's owner fate-sharing kills them when rank 0 dies, and every rank joins one
torch.distributed group (NCCL on CUDA, gloo on CPU) and loads its models at the same time.

Every call the driver makes on rank 0 runs on every rank with the same arguments, because the
ranks' collectives must run in lockstep; rank 0's result is the worker's, carrying every rank's
memory (``merge_ranks``). A rank that dies takes rank 0 down with it (``RankGroup._watch``), so the
driver sees one actor death and restarts the worker as it restarts any actor: models reloaded, the
group made anew. Collectives time out after ``workers.join_timeout_s``, so nothing waits forever.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.errors import SpecDecError
from workers.net import free_port
from workers.wire import MemoryTrace, TrialResult, TrialStatus, WorkerConfig

if TYPE_CHECKING:
    from workers.worker import Worker


class GroupError(SpecDecError):
    """A tensor-parallel group did not form (a rank failed to start, join or load)."""


@dataclass(frozen=True)
class GroupPlan:
    """What rank 0 needs to start and join its group (made by the driver, sent to rank 0)."""

    placement_group: PlacementGroup
    world_size: int
    backend: str  # "nccl" | "gloo"
    timeout_s: float  # joining, and every collective
    rank_options: dict[str, Any]  # Ray options of one rank (resources, env), without its placement


def bundles(rank_needs: dict[str, float], world_size: int) -> list[dict[str, float]]:
    """One bundle per rank: its CPU, its GPU (none on CPU) and the worker's custom resources."""
    return [dict(rank_needs) for _ in range(world_size)]


def reserve(rank_needs: dict[str, float], world_size: int) -> PlacementGroup:
    # STRICT_PACK: every rank on one node (the group's collectives stay on the host's links)
    return placement_group(bundles(rank_needs, world_size), strategy="STRICT_PACK")


def release(group: PlacementGroup | None) -> None:
    if group is not None:
        ray.util.remove_placement_group(group)


def in_bundle(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)


class RankActor:
    """Ranks 1..N-1: join the group, load, then run whatever rank 0 forwards, in the same order."""

    def __init__(self, worker_config: dict[str, Any], rank: int, world_size: int, init_method: str, backend: str,
                 timeout_s: float) -> None:
        from workers.models.tensor_parallel import join_group  # the rank's process loads torch, not the driver
        from workers.worker import Worker

        tp = join_group(rank, world_size, init_method, backend, timeout_s)
        self.worker = Worker(WorkerConfig(**worker_config)).load(tp)

    def info(self) -> dict[str, Any]:
        context = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": context.get_node_id(),
                "gpu_ids": [str(g) for g in context.get_accelerator_ids().get("GPU", [])]}

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    @ray.method(concurrency_group="lifeline")
    def lifeline(self) -> None:
        """Never returns: its ref fails when this process dies, which is how rank 0 learns of it."""
        threading.Event().wait()


class RankGroup:
    """Rank 0's side of a group: the other ranks' handles, the forwarding, the death watch."""

    def __init__(self, worker_config: dict[str, Any], plan: GroupPlan) -> None:
        """Start ranks 1..N-1 and open the group's rendezvous on this host (rank 0 serves it)."""
        self.plan = plan
        self.init_method = f"tcp://{ray.util.get_node_ip_address()}:{free_port('')}"
        remote = ray.remote(concurrency_groups={"lifeline": 1})(RankActor)
        self.others = [
            remote.options(**plan.rank_options, scheduling_strategy=in_bundle(plan.placement_group, rank)).remote(
                worker_config, rank, plan.world_size, self.init_method, plan.backend, plan.timeout_s)
            for rank in range(1, plan.world_size)
        ]
        self.infos: list[dict[str, Any]] = []

    def join(self):
        """Rank 0 joins (returns its TPGroup); blocks until every rank has, or the timeout."""
        try:
            from workers.models.tensor_parallel import join_group  # in rank 0's actor, never in the driver

            return join_group(0, self.plan.world_size, self.init_method, self.plan.backend, self.plan.timeout_s)
        except RuntimeError as exc:  # torch's store / process-group errors (timeouts included)
            raise GroupError(f"tensor-parallel group of {self.plan.world_size} ranks did not form within "
                             f"{self.plan.timeout_s:g}s (workers.join_timeout_s): {self._problems() or exc}") from exc

    def wait_ready(self) -> None:
        """Every other rank loaded; from now on a rank's death ends this process (``_watch``)."""
        try:
            self.infos = ray.get([other.info.remote() for other in self.others], timeout=self.plan.timeout_s)
        except Exception as exc:  # a rank whose __init__ failed, or one still loading after the timeout
            raise GroupError(f"tensor-parallel group: {self._problems() or exc}") from exc
        lifelines = {other.lifeline.remote(): rank for rank, other in enumerate(self.others, start=1)}
        threading.Thread(target=self._watch, args=(lifelines,), daemon=True).start()

    def _problems(self) -> str:
        """Which ranks failed or do not answer, for the error message."""
        refs = {other.info.remote(): rank for rank, other in enumerate(self.others, start=1)}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=2.0)
        problems = [f"rank {refs[ref]} does not answer" for ref in pending]
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:
                problems.append(f"rank {refs[ref]} failed: {str(exc).strip().splitlines()[-1]}")
        return "; ".join(sorted(problems))

    def _watch(self, lifelines: dict[Any, int]) -> None:
        ready, _ = ray.wait(list(lifelines), num_returns=1)
        _exit(f"tensor-parallel rank {lifelines[ready[0]]} died")

    def run(self, worker: Worker, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``worker.<method>(*args, **kwargs)`` on rank 0 and ``<method>(*args)`` on every other rank,
        at once (their collectives meet); rank 0's result, with every rank's memory for a trial."""
        refs = [other.call.remote(method, *args) for other in self.others]
        mine = getattr(worker, method)(*args, **kwargs)
        try:
            theirs = ray.get(refs, timeout=self.plan.timeout_s)
        except GetTimeoutError:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = [rank for rank, ref in enumerate(refs, start=1) if ref in pending]
            _exit(f"tensor-parallel rank(s) {late} did not finish {method} within {self.plan.timeout_s:g}s "
                  "of rank 0 (the group is stuck)")
        except RayActorError as exc:
            _exit(f"a tensor-parallel rank died during {method}: {type(exc).__name__}")
        return merge_ranks([mine, *theirs]) if isinstance(mine, TrialResult) else mine


def merge_ranks(results: list[TrialResult]) -> TrialResult:
    """Rank 0's result with every rank's memory trace (device index = rank), or an error naming the
    first rank that failed or left lockstep (ended otherwise, or generated other tokens, than rank 0)."""
    first = results[0]
    trace = _merged_trace([result.memory_trace for result in results])
    metrics = {k: v for k, v in first.metrics.items() if not k.startswith("peak_memory_gib_dev")}
    per_rank = trace.peak_gib_per_device()
    metrics["peak_memory_gib"] = max(per_rank.values(), default=0.0)
    metrics |= {f"peak_memory_gib_dev{rank}": gib for rank, gib in sorted(per_rank.items())}
    status, error = first.status, first.error
    for rank, result in enumerate(results[1:], start=1):
        if result.status is TrialStatus.ERROR:  # before rank 0's own error: that is usually the consequence
            status, error = TrialStatus.ERROR, f"tensor-parallel rank {rank}: {result.error}"
            break
        if result.status is not first.status or [o.token_ids for o in result.outputs] != [
                o.token_ids for o in first.outputs]:
            status = TrialStatus.ERROR
            error = (f"tensor-parallel rank {rank} left lockstep: it ended '{result.status.value}' with "
                     f"{len(result.outputs)} outputs, rank 0 '{first.status.value}' with {len(first.outputs)}, "
                     "or their tokens differ")
            break
    restart = any(result.restart_worker for result in results)
    return dataclasses.replace(first, status=status, error=error, metrics=metrics, memory_trace=trace,
                               restart_worker=restart)


def _merged_trace(traces: list[MemoryTrace]) -> MemoryTrace:
    """One trace over the ranks: each rank is one device (its own GPU, or its process on CPU)."""
    def by_rank(key: str) -> dict[int, int]:
        return {rank: max(getattr(t, key).values()) for rank, t in enumerate(traces) if getattr(t, key)}

    samples = sorted((dataclasses.replace(s, device=rank) for rank, t in enumerate(traces) for s in t.samples),
                     key=lambda s: (s.t_s, s.device))
    notes = dict.fromkeys(t.note for t in traces if t.note)
    return dataclasses.replace(
        traces[0], samples=tuple(samples), devices=tuple(range(len(traces))),
        interval_ms=max(t.interval_ms for t in traces), peak_allocated_bytes=by_rank("peak_allocated_bytes"),
        peak_reserved_bytes=by_rank("peak_reserved_bytes"), peak_nvml_used_bytes=by_rank("peak_nvml_used_bytes"),
        note="; ".join(notes),
    )


def _exit(reason: str) -> None:
    """End rank 0's process: the driver sees one actor death and restarts the whole worker."""
    print(f"orchestrator.tp_group: {reason}; ending rank 0 so the worker restarts as a whole", file=sys.stderr,
          flush=True)
    os._exit(1)
