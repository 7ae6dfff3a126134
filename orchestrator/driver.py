"""The driver loop of a sweep: ask, submit to an idle actor, ``ray.wait``, log, tell.

Order of writes per trial, chosen so a crash at any point loses nothing and counts nothing twice:
  1. Optuna ``ask`` (trial RUNNING), MLflow child run created (RUNNING), trial sent to an actor;
  2. result back: MLflow child gets metrics and artifacts and is FINISHED;
  3. Optuna ``tell`` (COMPLETE).
On resume, a RUNNING Optuna trial whose child run is FINISHED is recovered from MLflow (step 3
redone); otherwise its child run is marked KILLED and the trial is failed and queued again.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import ray
from optuna.trial import TrialState

from orchestrator import study as studies
from orchestrator.config import SweepConfig, check_against_block
from orchestrator.pool import ACTOR_DEATH, Slot, replace_actor, start_pool
from orchestrator.predictor import Predictor
from orchestrator.progress import Progress
from orchestrator.tracking import STATUS_TAG, TRIAL_TAG, Tracker
from workers.prompts import load_source
from workers.worker import Method, TrialSpec

EXIT_OK, EXIT_INTERRUPTED = 0, 130
MAX_ATTEMPTS = 2  # a trial whose actor died is re-run once on the restarted actor, then failed


@dataclass
class InFlight:
    slot: Slot
    trial_number: int
    params: dict[str, Any]
    run_id: str
    attempt: int
    started_ms: int
    predicted: dict[str, float] | None = None  # predicted_tokens_per_s etc. (sweeps that predict)
    pruning: bool = False  # the pruner said stop: the final result is told PRUNED
    last_step: int = 0


class Driver:
    def __init__(self, config: SweepConfig, config_path: Path, new_study: bool = False) -> None:
        self.config = config
        self.config_path = config_path
        self.new_study = new_study
        self.prompts = tuple(load_source(config.prompts.source()))  # before Ray: a bad source creates nothing
        self.inflight: dict[Any, InFlight] = {}
        self.progress = Progress(config)
        self.predictor: Predictor | None = None

    # -- set-up --------------------------------------------------------------------------------------
    def _start_ray(self) -> None:
        ray_cfg = self.config.ray
        if ray_cfg.address is None:
            # address="local": never join a cluster some other `ray start` left on this machine.
            ray.init(address="local", num_cpus=ray_cfg.num_cpus, num_gpus=ray_cfg.num_gpus, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=ray_cfg.address, log_to_driver=False, configure_logging=False)

    def run(self) -> int:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        self._start_ray()
        try:
            self.progress.note("starting actors and loading models ...")
            self.slots = start_pool(self.config)
            block = self.slots[0].info.get("block_size")
            check_against_block(self.config, block, str(self.config_path))  # nothing created yet
            storage = studies.make_storage(self.config.storage)
            handle = studies.open_study(self.config, storage, self.new_study)
            self.study, self.study_name = handle.study, handle.name
            self.tracker = Tracker(self.config.mlflow.tracking_uri, self.config.mlflow.experiment)
            self.parent_id = self.tracker.parent_run(
                self.study_name, self.config.fingerprint(), self.config_path, self.config.model_dump(mode="json")
            )
            self._recover()
            if self.config.sampler.predicts:
                self._start_predictions(block)
            return self._loop()
        finally:
            self.progress.stop()
            ray.shutdown()

    def _recover(self) -> None:
        """Close what a crashed or killed driver left open (see the module docstring)."""
        finished = {r.data.tags.get(TRIAL_TAG): r for r in self.tracker.children(self.study_name, "FINISHED")}
        for run in self.tracker.children(self.study_name, "RUNNING"):
            self.tracker.kill(run.info.run_id, "the driver stopped before the trial finished")
        for trial in studies.stale_running(self.study):
            done = finished.get(str(trial.number))
            if done is not None and done.data.tags.get(STATUS_TAG) == "pruned":
                self.study.tell(trial.number, state=TrialState.PRUNED, skip_if_finished=True)
                self.progress.note(f"trial {trial.number}: recovered as pruned from MLflow")
            elif done is not None:
                metrics = dict(done.data.metrics)
                studies.tell_result(self.study, trial.number, self.config, metrics, done.data.tags.get(STATUS_TAG) == "oom")
                self.progress.note(f"trial {trial.number}: recovered its finished result from MLflow")
            else:
                studies.fail_and_requeue(self.study, trial.number, trial.params)
                self.progress.note(f"trial {trial.number}: interrupted earlier; queued to run again")

    # -- the loop ------------------------------------------------------------------------------------
    def _request_stop(self, signum, frame) -> None:
        """First Ctrl-C / SIGTERM: stop at the next safe point; a second one: stop now."""
        if self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True
        self.progress.note("stopping: in-flight trials will be marked KILLED and queued again (Ctrl-C again to force)")

    def _loop(self) -> int:
        wanted = studies.target_complete(self.config)
        self.stop_requested = False
        signal.signal(signal.SIGINT, self._request_stop)
        signal.signal(signal.SIGTERM, self._request_stop)
        try:
            while not self.stop_requested:
                complete = studies.count_complete(self.study)
                for slot in self.slots:
                    if slot.state == "idle" and complete + len(self.inflight) < wanted and self._has_work():
                        self._submit_new(slot)
                self.progress.update(self.study, self.slots, complete, wanted)
                if not self.inflight:
                    break
                ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=0.5)
                for ref in ready:
                    if not self.stop_requested:
                        self._collect(ref)
            if self.stop_requested:
                self._interrupt()
                return EXIT_INTERRUPTED
            self.tracker.finish_parent(self.parent_id, "FINISHED", self._summary())
            self.progress.note(f"done: {studies.count_complete(self.study)} complete trials in '{self.study_name}'")
            return EXIT_OK
        except KeyboardInterrupt:
            self._interrupt()
            return EXIT_INTERRUPTED

    def _has_work(self) -> bool:
        if self.config.sampler.type not in ("grid", "predicted"):
            return True
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _spec(self, params: dict[str, Any], fault: str | None) -> TrialSpec:
        gen = self.config.generation
        return TrialSpec(
            method=Method(self.config.method),
            prompts=self.prompts,
            max_new_tokens=self.config.prompts.max_new_tokens,
            temperature=gen.temperature,
            seed=gen.seed,
            stop_token_ids=tuple(gen.stop_token_ids) if gen.stop_token_ids is not None else None,
            fault=fault,
            **params,
        )

    def _submit_new(self, slot: Slot) -> None:
        trial = self.study.ask()
        params = studies.suggest(trial, self.config)
        fault = trial.user_attrs.get("fault")  # fault injection for tests: set via enqueue user_attrs
        self._submit(slot, trial.number, params, attempt=1, fault=fault)

    def _submit(self, slot: Slot, number: int, params: dict[str, Any], attempt: int, fault: str | None = None) -> None:
        run_id = self.tracker.start_child(self.parent_id, self.study_name, number, params, attempt)
        if self.config.pruner.type != "none":  # per-prompt reports: a streaming generator (see _step)
            ref = slot.handle.run_trial_steps.options(num_returns="streaming").remote(self._spec(params, fault))
        else:
            ref = slot.handle.run_trial.remote(self._spec(params, fault))
        predicted = self.predictor.predict(params, slot.index) if self.predictor else None
        self.inflight[ref] = InFlight(slot, number, params, run_id, attempt, int(time.time() * 1000), predicted)
        slot.state, slot.trial_number = "running", number

    def _collect(self, ref) -> None:
        job = self.inflight.pop(ref)
        job.slot.state, job.slot.trial_number = "idle", None
        try:
            if isinstance(ref, ray.ObjectRefGenerator):
                result = self._step(ref, job)
                if result is None:  # an intermediate report: the trial goes on
                    return
            else:
                result = ray.get(ref)
        except ACTOR_DEATH as exc:
            self._actor_died(job, exc)
            return
        except Exception as exc:  # a bug inside the actor call: fail this trial, keep sweeping
            self.tracker.fail(job.run_id, f"{type(exc).__name__}: {exc}")
            self.study.tell(job.trial_number, state=TrialState.FAIL, skip_if_finished=True)
            return
        status = result["status"]
        if status == "error":
            self.tracker.fail(job.run_id, result["error"] or "unknown error")
            self.study.tell(job.trial_number, state=TrialState.FAIL, skip_if_finished=True)
            self.progress.note(f"trial {job.trial_number} failed: {str(result['error']).splitlines()[0]}")
            return
        if job.predicted is not None:
            result["metrics"] |= job.predicted
        if job.pruning or status == "pruned":
            self._pruned(job, result)
            return
        self.tracker.finish_child(job.run_id, result, job.started_ms)  # MLflow first: see the module docstring
        studies.tell_result(self.study, job.trial_number, self.config, result["metrics"], oom=status == "oom")
        if status == "oom":
            self.progress.note(f"trial {job.trial_number}: out of memory, recorded as infeasible")

    # -- predictions and early stopping ------------------------------------------------------------
    def _start_predictions(self, block: int | None) -> None:
        """Replay + cost tables from the actors, logged on the parent run; the predicted plan enqueued."""
        self.progress.note("recording the acceptance replay and measuring each actor's costs ...")
        self.predictor = Predictor.gather(self.config, self.slots, self._spec({}, None), block)
        self.tracker.log_costs(self.parent_id, {slot.index: self.predictor.costs[slot.index].to_dict()
                                                for slot in self.slots}, [s.info for s in self.slots])
        if self.config.sampler.type == "predicted":
            plan = None if studies.PLAN_ATTR in self.study.user_attrs else self.predictor.plan()
            studies.enqueue_plan(self.study, plan)
            self.tracker.log_plan(self.parent_id, self.study.user_attrs[studies.PLAN_ATTR])

    def _step(self, generator, job: InFlight) -> dict[str, Any] | None:
        """One item of a trial's stream: report an intermediate value (and maybe stop the trial), or
        return the final result."""
        item = ray.get(next(generator))
        if "result" in item:
            return item["result"]
        self.inflight[generator] = job
        job.slot.state, job.slot.trial_number = "running", job.trial_number
        job.last_step = item["step"]
        metric = self.config.objectives[0].metric
        value = item["metrics"].get(metric)
        if value is not None and not job.pruning:
            self.tracker.log_step(job.run_id, f"intermediate_{metric}", float(value), item["step"])
            trial = studies.running_trial(self.study, job.trial_number)
            trial.report(float(value), item["step"])
            if trial.should_prune():
                job.pruning = True
                job.slot.handle.stop_trial.remote()
                self.progress.note(f"trial {job.trial_number}: pruned after {item['step']} prompts")
        return None

    def _pruned(self, job: InFlight, result: dict[str, Any]) -> None:
        """MLflow run FINISHED with trial_status=pruned (and the prompts it ran), then Optuna PRUNED."""
        self.tracker.finish_pruned(job.run_id, result, job.started_ms, job.last_step)
        self.study.tell(job.trial_number, state=TrialState.PRUNED, skip_if_finished=True)

    def _actor_died(self, job: InFlight, exc: Exception) -> None:
        slot = job.slot
        self.progress.note(f"actor {slot.index} died during trial {job.trial_number}: {type(exc).__name__}")
        self.tracker.kill(job.run_id, f"actor died: {type(exc).__name__}")
        self._revive(slot)
        if job.attempt < MAX_ATTEMPTS:
            self._submit(slot, job.trial_number, job.params, attempt=job.attempt + 1)
        else:
            self.study.tell(job.trial_number, state=TrialState.FAIL, skip_if_finished=True)

    def _revive(self, slot: Slot) -> None:
        """Wait for Ray's restart of the actor (models reload); a fresh actor when restarts are spent."""
        slot.state = "restarting"
        self.progress.update(self.study, self.slots, studies.count_complete(self.study), studies.target_complete(self.config))
        try:
            slot.info = ray.get(slot.handle.info.remote())
            slot.state = "idle"
        except ACTOR_DEATH:
            replace_actor(self.config, slot)

    def _interrupt(self) -> None:
        """Ctrl-C / SIGTERM: in-flight child runs KILLED, their trials queued to run again."""
        for job in self.inflight.values():
            self.tracker.kill(job.run_id, "sweep interrupted")
            studies.fail_and_requeue(self.study, job.trial_number, job.params)
            job.slot.state, job.slot.trial_number = "stopped", None
        self.inflight.clear()
        self.progress.update(self.study, self.slots, studies.count_complete(self.study),
                             studies.target_complete(self.config))
        self.tracker.finish_parent(self.parent_id, "KILLED", self._summary())
        print("orchestrator.sweep: interrupted; run the same command again to resume", file=sys.stderr)

    def _summary(self) -> dict[str, Any]:
        return studies.summary(self.study, self.config)
