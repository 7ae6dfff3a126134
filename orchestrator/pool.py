"""Ray actors that keep a target and a drafter resident and run trials, one in flight per actor.

The actor is a thin shell over ``workers.worker.Worker``: the models load in ``__init__`` (so a
Ray restart reloads them), ``run_trial`` returns the typed ``TrialResult`` (pickled by Ray). Ray gives an actor
``num_gpus=k`` GPUs by setting CUDA_VISIBLE_DEVICES before its code runs; a 0-GPU actor would
inherit every GPU under Ray 2.60, so it gets CUDA_VISIBLE_DEVICES="" explicitly.

A tensor-parallel worker (``workers.parallel: tensor``) is a group of such actors, one GPU each, in
one placement group; the driver talks to its rank 0 only, through the same methods
(``orchestrator.tp_group``).
"""

from __future__ import annotations

import os
import platform
import queue
import threading
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.util.placement_group import PlacementGroup

from orchestrator import tp_group
from orchestrator.config import SweepConfig
from orchestrator.tp_group import GroupError, GroupPlan, RankGroup
from workers.decoding.params import MethodParams
from workers.errors import BadInputError, TrialStopped
from workers.metrics import summarize
from workers.models.sources import local_only
from workers.wire import TrialResult, TrialSpec, WorkerConfig

ACTOR_DEATH = (ActorDiedError, ActorUnavailableError, RayActorError)


class GenerationActor:
    """Runs inside Ray. Never touches Optuna or MLflow."""

    def __init__(self, worker_config: dict[str, Any], group: GroupPlan | None = None) -> None:
        from workers.worker import Worker  # here, in the actor's process: the driver never loads torch

        self.worker, self.load_error, self.group = None, None, None
        try:
            tp = None
            if group is not None:  # rank 0 of a tensor-parallel worker: start the other ranks, join them
                self.group = RankGroup(worker_config, group)
                tp = self.group.join()
            self.worker = Worker(WorkerConfig(**worker_config)).load(tp)
            if self.group is not None:
                self.group.wait_ready()
        except (BadInputError, GroupError) as exc:  # reported through info(): the driver exits 2 with it
            self.load_error = str(exc)

    def info(self) -> dict[str, Any]:
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in context.get_accelerator_ids().get("GPU", [])],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "block_size": self.worker.block_size if self.worker else None,
            "load_error": self.load_error,
            "devices": _device_names(),  # for the parent run's env.devices
            "host": platform.node(),
            "parallel": "tensor" if self.group else "layers",
            "ranks": self.group.plan.world_size if self.group else 1,
            "rank_pids": [os.getpid(), *(info["pid"] for info in self.group.infos)] if self.group else [os.getpid()],
        }

    def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``self.worker.<method>(...)``; on every rank at once for a tensor-parallel worker."""
        if self.group is None:
            return getattr(self.worker, method)(*args, **kwargs)
        return self.group.run(self.worker, method, args, kwargs)

    def run_trial(self, spec: TrialSpec) -> TrialResult:
        return self._run("run_trial", spec)

    # -- predictions (orchestrator.predictor) --------------------------------------------------------
    def replay_tables(self, spec: TrialSpec, top_k: int) -> list[dict[str, Any]]:
        return self._run("replay_tables", spec, top_k)

    def measure_costs(self, spec: TrialSpec, settings: list[MethodParams]) -> dict[str, Any]:
        return self._run("measure_costs", spec, settings)

    # -- early stopping: per-prompt reports, streamed ----------------------------------------------
    def run_trial_steps(self, spec: TrialSpec):
        """A Ray streaming generator: ``{"step": k, "metrics": ...}`` after each of the k prompts
        (metrics over the prompts so far), then ``{"result": ...}``. The trial runs in a thread so
        ``stop_trial`` (its own concurrency group) can reach it between prompts."""
        self._stop = threading.Event()
        events: queue.Queue = queue.Queue()

        def on_prompt(outputs, baseline) -> None:
            if self._stop.is_set():
                raise TrialStopped(f"pruned after {len(outputs) - 1} prompts")
            events.put({"step": len(outputs), "metrics": summarize(outputs, baseline, greedy=spec.temperature < 1e-5)})

        def run() -> None:
            events.put({"result": self._run("run_trial", spec, on_prompt=on_prompt)})

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while True:
            event = events.get()
            yield event
            if "result" in event:
                break
        thread.join()

    @ray.method(concurrency_group="control")
    def stop_trial(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()


def _device_names() -> list[str]:
    """What this actor computes on: its visible GPUs by name, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"]


def actor_gpus(config: SweepConfig) -> int:
    """GPUs of one actor: the worker's (a layer split), or one per rank (tensor parallel)."""
    gpus = config.workers.gpus_per_worker
    return gpus if config.workers.parallel == "layers" else min(gpus, 1)


def worker_config(config: SweepConfig) -> dict[str, Any]:
    gpus = config.workers.gpus_per_worker
    return asdict(
        WorkerConfig(
            target=config.target.model,
            drafter=config.drafter.model if config.drafter else None,
            # the driver's HF_HUB_OFFLINE too: actors of a cluster joined elsewhere do not share its environment
            local_files_only=local_only(config.target.local_files_only),
            drafter_local_files_only=local_only(bool(config.drafter and config.drafter.local_files_only)),
            dtype=config.target.dtype,
            device=config.workers.device if config.workers.device != "auto" else ("cuda" if gpus > 0 else "cpu"),
            gpus=max(actor_gpus(config), 1),
            world_size=config.workers.world_size,
            max_memory_per_gpu=config.workers.max_memory_per_gpu,
            cuda_graphs=config.workers.cuda_graphs,
            compile_layers=config.workers.compile_layers,
            attn_implementation=config.target.attn_implementation,
            memory_interval_ms=config.memory_trace.interval_ms,
            chat_template=config.prompts.chat_template,
            enable_thinking=config.prompts.enable_thinking,
        )
    )


def actor_options(config: SweepConfig) -> dict[str, Any]:
    gpus = actor_gpus(config)
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    if gpus == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""  # Ray 2.60 no longer hides GPUs from 0-GPU actors
    return {
        "num_gpus": gpus,
        "num_cpus": 1,
        "resources": dict(config.workers.resources),
        "max_restarts": config.workers.max_restarts,
        "max_task_retries": 0,  # the driver decides about retries (trial attempts)
        "runtime_env": {"env_vars": env},
    }


class SlotState(StrEnum):
    """What an actor is doing (the progress line shows the value)."""

    LOADING = "loading"  # models loading
    IDLE = "idle"
    RUNNING = "running"  # a search trial
    REMEASURING = "re-measuring"  # the final re-measurement
    RESTARTING = "restarting"  # Ray restarts it after its process died (models reload)
    STOPPED = "stopped"  # the sweep stopped while it ran a trial


@dataclass
class Slot:
    """One actor and what it is doing, for the driver loop and the progress display."""

    index: int
    handle: Any
    state: SlotState = SlotState.LOADING
    trial_number: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    placement_group: PlacementGroup | None = None  # a tensor-parallel worker's (removed with the worker)


def start_actor(config: SweepConfig, group: GroupPlan | None = None):
    # trials run in the default group (one at a time); stop_trial answers while one runs
    remote = ray.remote(concurrency_groups={"control": 1})(GenerationActor)
    options = actor_options(config)
    if group is not None:  # rank 0 of a tensor-parallel worker lives in bundle 0 of the group's reservation
        options["scheduling_strategy"] = tp_group.in_bundle(group.placement_group, 0)
    return remote.options(**options).remote(worker_config(config), group)


def start_worker(config: SweepConfig) -> tuple[Any, PlacementGroup | None]:
    """One worker: its (rank-0) actor, and the placement group that a tensor-parallel one lives in."""
    workers = config.workers
    if workers.parallel == "layers":
        return start_actor(config), None
    reservation = tp_group.reserve(actor_needs(config), workers.world_size)
    backend = "nccl" if worker_config(config)["device"] == "cuda" else "gloo"
    # the other ranks are never restarted on their own: a rank's death restarts the whole worker
    plan = GroupPlan(reservation, workers.world_size, backend, workers.join_timeout_s,
                     actor_options(config) | {"max_restarts": 0})
    return start_actor(config, plan), reservation


def actor_needs(config: SweepConfig) -> dict[str, float]:
    """Ray resources one actor asks for (as in ``actor_options``)."""
    options = actor_options(config)
    needs = {"CPU": float(options["num_cpus"]), "GPU": float(options["num_gpus"])}
    needs |= {name: float(amount) for name, amount in options["resources"].items()}
    return {name: amount for name, amount in needs.items() if amount > 0}


def worker_needs(config: SweepConfig) -> dict[str, float]:
    """Ray resources one worker needs on ONE node: its actor's, times its ranks when tensor-parallel."""
    world_size = config.workers.world_size
    return {name: amount * world_size for name, amount in actor_needs(config).items()}


def check_resources(config: SweepConfig) -> None:
    """Refuse, with the numbers, a pool the cluster can never place (Ray would wait for it forever).

    Counts how many workers fit node by node in the cluster's total resources (a worker, all its
    ranks included, lives on one node); what other jobs hold right now is shown but not counted.
    """
    needs = worker_needs(config)
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    fit = 0
    for node in nodes:
        have = node.get("Resources", {})
        fit += min(int(have.get(name, 0.0) / amount + 1e-9) for name, amount in needs.items())
    wanted, world_size = config.workers.count, config.workers.world_size
    if fit >= wanted:
        return
    total, free = ray.cluster_resources(), ray.available_resources()
    names = sorted(needs)
    each = "each" if world_size == 1 else f"each ({world_size} tensor-parallel ranks, all on one node)"
    raise BadInputError(
        f"workers: {wanted} worker(s) need {_amounts(needs, names)} {each}, but the Ray cluster "
        f"({len(nodes)} node(s)) has {_amounts(total, names)} in all ({_amounts(free, names)} free now): "
        f"{fit} worker(s) fit. Lower workers.count or workers.gpus_per_worker"
        + (" / workers.ranks" if world_size > 1 else "") + ", or give a local Ray more with ray.num_gpus / ray.num_cpus"
    )


def _amounts(values: dict[str, float], names: list[str]) -> str:
    return ", ".join(f"{values.get(name, 0.0):g} {name}" for name in names)


def start_pool(config: SweepConfig, checkpoint=None) -> list[Slot]:
    """Start every actor, wait until all have loaded their models, and read where they landed.

    ``checkpoint()`` runs every half second while the models load (the driver's stop check); what it
    raises stops the load and kills the actors.
    """
    slots = []
    for index in range(config.workers.count):
        handle, reservation = start_worker(config)
        slots.append(Slot(index, handle, placement_group=reservation))
    try:
        refs = [slot.handle.info.remote() for slot in slots]
        pending = refs
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            if checkpoint is not None:
                checkpoint()
        infos = ray.get(refs)
    except BaseException:
        _kill_all(slots)
        raise
    for slot, info in zip(slots, infos, strict=True):
        slot.info, slot.state = info, SlotState.IDLE
    errors = {info["load_error"] for info in infos if info["load_error"]}
    if errors:
        _kill_all(slots)
        raise BadInputError("; ".join(sorted(errors)))
    return slots


def _kill_all(slots: list[Slot]) -> None:
    for slot in slots:
        ray.kill(slot.handle, no_restart=True)
    release_pool(slots)


def release_pool(slots: list[Slot]) -> None:
    """The tensor-parallel workers' placement groups removed (their actors die with them)."""
    for slot in slots:
        tp_group.release(slot.placement_group)
        slot.placement_group = None


def replace_actor(config: SweepConfig, slot: Slot) -> None:
    """A dead worker whose restarts are spent: a fresh one in its slot (models loaded again)."""
    ray.kill(slot.handle, no_restart=True)  # a no-op for an actor that is already dead
    release_pool([slot])
    slot.handle, slot.placement_group = start_worker(config)
    slot.info = ray.get(slot.handle.info.remote())
    if slot.info["load_error"]:
        raise BadInputError(slot.info["load_error"])
    slot.state = SlotState.IDLE
