"""Ray actors that keep a target and a drafter resident and run trials, one in flight per actor.

The actor is a thin shell over ``workers.worker.Worker``: the models load in ``__init__`` (so a
Ray restart reloads them), ``run_trial`` returns the result as a plain dict. Ray gives an actor
``num_gpus=k`` GPUs by setting CUDA_VISIBLE_DEVICES before its code runs; a 0-GPU actor would
inherit every GPU under Ray 2.60, so it gets CUDA_VISIBLE_DEVICES="" explicitly.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from orchestrator.config import SweepConfig
from workers.errors import BadInputError, TrialStopped
from workers.metrics import summarize
from workers.worker import TrialSpec, Worker, WorkerConfig

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
        }

    def run_trial(self, spec: TrialSpec) -> dict[str, Any]:
        return self.worker.run_trial(spec).to_dict()

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

        thread = threading.Thread(target=lambda: events.put({"result": self.worker.run_trial(spec, on_prompt).to_dict()}),
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


def start_pool(config: SweepConfig) -> list[Slot]:
    """Start every actor, wait until all have loaded their models, and read where they landed."""
    slots = [Slot(index, start_actor(config)) for index in range(config.workers.count)]
    try:
        infos = ray.get([slot.handle.info.remote() for slot in slots])
    except Exception:
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
