"""Ray actors that keep a target and a drafter resident and run trials, one in flight per actor.

The actor is a thin shell over ``workers.worker.Worker``: the models load in ``__init__`` (so a
Ray restart reloads them), ``run_trial`` returns the typed ``TrialResult`` (pickled by Ray). Ray gives an actor
``num_gpus=k`` GPUs by setting CUDA_VISIBLE_DEVICES before its code runs; a 0-GPU actor would
inherit every GPU under Ray 2.60, so it gets CUDA_VISIBLE_DEVICES="" explicitly.
"""

from __future__ import annotations

import os
import platform
import queue
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from orchestrator.config import SweepConfig
from workers.errors import BadInputError, TrialStopped
from workers.metrics import summarize
from workers.worker import TrialResult, TrialSpec, Worker, WorkerConfig

ACTOR_DEATH = (ActorDiedError, ActorUnavailableError, RayActorError)


class GenerationActor:
    """Runs inside Ray. Never touches Optuna or MLflow."""

    def __init__(self, worker_config: dict[str, Any]) -> None:
        self.worker, self.load_error = None, None
        try:
            self.worker = Worker(WorkerConfig(**worker_config)).load()
        except BadInputError as exc:  # reported through info(), so the driver can exit 2 with the message
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
        }

    def run_trial(self, spec: TrialSpec) -> TrialResult:
        return self.worker.run_trial(spec)

    # -- predictions (orchestrator.predictor) --------------------------------------------------------
    def replay_tables(self, spec: TrialSpec, top_k: int) -> list[dict[str, Any]]:
        return self.worker.replay_tables(spec, top_k)

    def measure_costs(self, spec: TrialSpec, settings: list[dict[str, Any]]) -> dict[str, Any]:
        return self.worker.measure_costs(spec, settings)

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

        thread = threading.Thread(target=lambda: events.put({"result": self.worker.run_trial(spec, on_prompt)}),
                                  daemon=True)
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


def worker_config(config: SweepConfig) -> dict[str, Any]:
    gpus = config.workers.gpus_per_worker
    return asdict(
        WorkerConfig(
            target=config.target.model,
            drafter=config.drafter.model if config.drafter else None,
            dtype=config.target.dtype,
            device=config.workers.device if config.workers.device != "auto" else ("cuda" if gpus > 0 else "cpu"),
            gpus=max(gpus, 1),
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
    gpus = config.workers.gpus_per_worker
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


@dataclass
class Slot:
    """One actor and what it is doing, for the driver loop and the progress display."""

    index: int
    handle: Any
    state: str = "loading"
    trial_number: int | None = None
    info: dict[str, Any] = field(default_factory=dict)


def start_actor(config: SweepConfig):
    # trials run in the default group (one at a time); stop_trial answers while one runs
    remote = ray.remote(concurrency_groups={"control": 1})(GenerationActor)
    return remote.options(**actor_options(config)).remote(worker_config(config))


def worker_needs(config: SweepConfig) -> dict[str, float]:
    """Ray resources one actor asks for (as in ``actor_options``)."""
    options = actor_options(config)
    needs = {"CPU": float(options["num_cpus"]), "GPU": float(options["num_gpus"])}
    needs |= {name: float(amount) for name, amount in options["resources"].items()}
    return {name: amount for name, amount in needs.items() if amount > 0}


def check_resources(config: SweepConfig) -> None:
    """Refuse, with the numbers, a pool the cluster can never place (Ray would wait for it forever).

    Counts how many actors fit node by node in the cluster's total resources (an actor lives on one
    node); what other jobs hold right now is shown but not counted against the sweep.
    """
    needs = worker_needs(config)
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    fit = 0
    for node in nodes:
        have = node.get("Resources", {})
        fit += min(int(have.get(name, 0.0) / amount + 1e-9) for name, amount in needs.items())
    wanted = config.workers.count
    if fit >= wanted:
        return
    total, free = ray.cluster_resources(), ray.available_resources()
    names = sorted(needs)
    raise BadInputError(
        f"workers: {wanted} worker(s) need {_amounts(needs, names)} each, but the Ray cluster "
        f"({len(nodes)} node(s)) has {_amounts(total, names)} in all ({_amounts(free, names)} free now): "
        f"{fit} worker(s) fit. Lower workers.count or workers.gpus_per_worker, or give a local Ray more "
        "with ray.num_gpus / ray.num_cpus"
    )


def _amounts(values: dict[str, float], names: list[str]) -> str:
    return ", ".join(f"{values.get(name, 0.0):g} {name}" for name in names)


def start_pool(config: SweepConfig, checkpoint=None) -> list[Slot]:
    """Start every actor, wait until all have loaded their models, and read where they landed.

    ``checkpoint()`` runs every half second while the models load (the driver's stop check); what it
    raises stops the load and kills the actors.
    """
    slots = [Slot(index, start_actor(config)) for index in range(config.workers.count)]
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
        slot.info, slot.state = info, "idle"
    errors = {info["load_error"] for info in infos if info["load_error"]}
    if errors:
        _kill_all(slots)
        raise BadInputError("; ".join(sorted(errors)))
    return slots


def _kill_all(slots: list[Slot]) -> None:
    for slot in slots:
        ray.kill(slot.handle, no_restart=True)


def replace_actor(config: SweepConfig, slot: Slot) -> None:
    """A dead actor whose restarts are spent: a fresh one in its slot (models loaded again)."""
    ray.kill(slot.handle, no_restart=True)  # a no-op for an actor that is already dead
    slot.handle = start_actor(config)
    slot.info = ray.get(slot.handle.info.remote())
    if slot.info["load_error"]:
        raise BadInputError(slot.info["load_error"])
    slot.state = "idle"
