"""The driver loop of a sweep: ask, submit to an idle actor, ``ray.wait``, log, tell.

Start-up, in this order, so that whatever fails fails early and leaves nothing half-made:
  1. the study's lock (one driver per study; a second one is refused, see ``orchestrator.locks``);
  2. the stores opened (tables made if new), an existing study read and what a dead driver left
     open closed (below); a study with nothing left to run ends here, without Ray or models;
  3. Ray, the cluster's resources checked against the pool, the actors and their models;
  4. a new study created and the parent run found or created; then the loop.
Ctrl-C / SIGTERM at any point stops at the next safe point (``orchestrator.signals``).

Order of writes per trial, chosen so a crash at any point loses nothing and counts nothing twice:
  1. Optuna ``ask`` (trial RUNNING), MLflow child run created (RUNNING), trial sent to an actor;
  2. result back: MLflow child gets metrics and artifacts and is FINISHED;
  3. Optuna ``tell`` (COMPLETE).
Both writes happen only while the trial and the run are still RUNNING: one closed by someone else is
left alone. On resume, a RUNNING Optuna trial whose child run is FINISHED is recovered from MLflow
(step 3 redone); otherwise its child run is marked KILLED and the trial is failed and queued again.

After the search, the best few settings are measured again (``measurement.final_top_k``), each pass
interleaving them with the AR baseline on one actor (AR, A, AR, B, ...), so a setting that won on a
lucky sample or on a quiet moment of the machine is not named the winner; each setting's speedup in
a pass is against the AR run just before it. The medians over passes go to one ``remeasure`` run
per setting and the winner's values to the parent run (``best_*``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import ray
import sqlalchemy
from optuna.exceptions import StorageInternalError, UpdateFinishedTrialError
from optuna.trial import TrialState

from orchestrator import locks
from orchestrator import study as studies
from orchestrator.config import METRICS, SweepConfig, check_against_block
from orchestrator.pool import ACTOR_DEATH, Slot, check_resources, release_pool, replace_actor, start_pool
from orchestrator.progress import Progress
from orchestrator.signals import RAY_ENV, Interrupted, StopSignals, ray_init_keeps_ours
from orchestrator.tracking import (
    ROUND_TAG,
    STATUS_TAG,
    TRIAL_TAG,
    UID_TAG,
    StoreError,
    Tracker,
    environment_params,
    root_reason,
    sweep_params,
)
from workers.decoding.params import ARParams, MethodParams
from workers.prompts import load_source
from workers.wire import TrialResult, TrialSpec, TrialStatus

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
MAX_ATTEMPTS = 2  # a trial whose actor died is re-run once on the restarted actor, then failed
# Trials that FAIL one after another before the sweep stops: a setting-independent error (a bad
# prompt, a broken model) fails every trial, and the sampler would ask for new ones forever.
MAX_FAILURES_IN_A_ROW = 3
OPTUNA_STORE_ERRORS = (StorageInternalError, sqlalchemy.exc.SQLAlchemyError)


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


class SweepFailed(Exception):
    """The sweep stopped on an error it cannot go past; the message is the one line to print."""


class Driver:
    def __init__(self, config: SweepConfig, config_path: Path, new_study: bool = False,
                 signals: StopSignals | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.new_study = new_study
        self.signals = signals or StopSignals().install()
        self.prompts = tuple(load_source(config.prompts.source()))  # before Ray: a bad source creates nothing
        self.inflight: dict[Any, InFlight] = {}
        self.progress = Progress(config)
        self.signals.on_request = lambda: self.progress.note(
            "stopping at the next safe point: in-flight trials are marked KILLED and queued again (again to force)")
        self.slots: list[Slot] = []
        self.study: optuna.Study | None = None
        self.parent_id: str | None = None
        self.ray_started = False
        self.failures_in_a_row, self.last_error = 0, ""
        self.predictor = None  # an orchestrator.predictor.Predictor, when the sweep predicts

    # -- set-up --------------------------------------------------------------------------------------
    def run(self) -> int:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        # MLflow's database layer logs a failed write with its full traceback before raising it; the
        # driver reports that failure itself, in one line (orchestrator.tracking.StoreError).
        logging.getLogger("mlflow.store").setLevel(logging.CRITICAL)
        lock = self._lock()
        try:
            return self._run()
        except StoreError as exc:
            return self._stopped(f"{exc}; the study is kept: fix the store and run the same command again to resume")
        except OPTUNA_STORE_ERRORS as exc:
            return self._stopped(f"the Optuna store {studies.hide_password(self.config.storage)} failed: "
                                 f"{root_reason(exc)}; the study is kept: fix the store and run the same command "
                                 "again to resume")
        except SweepFailed as exc:
            return self._stopped(str(exc))
        except (Interrupted, KeyboardInterrupt):
            print("orchestrator.sweep: interrupted during start-up; run the same command again to start",
                  file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception:
            if self.signals.requested:  # an error the stop itself caused (Ray's processes got the signal too)
                print("orchestrator.sweep: interrupted during start-up; run the same command again to start",
                      file=sys.stderr)
                return EXIT_INTERRUPTED
            raise
        finally:
            self.progress.stop()
            if self.ray_started:
                if ray.is_initialized():
                    release_pool(self.slots)  # tensor-parallel workers' placement groups
                ray.shutdown()
            locks.release(lock)

    def _stopped(self, message: str) -> int:
        self.progress.stop()
        print(f"orchestrator.sweep: error: {message}", file=sys.stderr)
        return EXIT_FAILED

    def _lock(self):
        """One driver per study: the lock is held until this process ends, however it ends."""
        storage = self.config.storage
        try:
            return locks.acquire(storage, f"study:{self.config.name}")
        except locks.StoreBusyError as exc:
            raise locks.StoreBusyError(
                f"study '{self.config.name}' in {studies.hide_password(storage)} is being run by another driver "
                f"({exc}); wait for it to end or stop it, then run this again") from None

    def _run(self) -> int:
        self._open_stores()
        if self.study is not None and studies.is_done(self.study, self.config) and not self._remeasure_pending():
            return self._already_done()
        self.signals.check()
        self._start_ray()
        check_resources(self.config)
        self.progress.note("starting actors and loading models ...")
        self.slots = start_pool(self.config, self.signals.check)
        block = self.slots[0].info.get("block_size")
        check_against_block(self.config, block, str(self.config_path))  # nothing created yet
        self.signals.check()
        with self.signals.critical():  # a study without its identifying attributes would be half-made
            if self.study is None:
                self.study = studies.create_study(self.config, self.storage, self.study_name)
            self._attach_parent()
        if self.config.sampler.predicts:
            self._start_predictions(block)
        return self._loop()

    def _open_stores(self) -> None:
        """Both stores opened before Ray and the models, so a broken store costs seconds, not a model load."""
        config = self.config
        self.storage = studies.make_storage(config.storage)
        self.tracker = Tracker(config.mlflow.tracking_uri, config.mlflow.experiment)
        self.study_name, create = studies.find_study_name(config, self.storage, self.new_study)
        note = studies.grid_note(config)
        if note:
            self.progress.note(note)
        wanted = studies.target_complete(config)
        if create:
            self.progress.note(f"new study '{self.study_name}' ({wanted} complete trials to run)")
            return
        with self.signals.critical():
            self.study = studies.load_study(config, self.storage, self.study_name)
            self._recover()
        self.progress.note(f"resuming study '{self.study_name}': "
                           f"{studies.count_complete(self.study)} of {wanted} complete")

    def _attach_parent(self, with_params: bool = True) -> None:
        """The study's parent run; with the resolved sweep and the actors' environment as params once
        the actors are up (a finished study says done without them)."""
        params = sweep_params(self.config) | environment_params([s.info for s in self.slots]) if with_params else None
        self.parent_id = self.tracker.parent_run(
            self.study_name, studies.study_uid(self.study), studies.storage_identity(self.config.storage),
            self.study._study_id, self.config.fingerprint(), self.config_path, self.config.model_dump(mode="json"),
            params,
        )
        self.tracker.set_parent_tags(self.parent_id, {"n_trials": self.config.n_trials})

    def _remeasure_pending(self) -> bool:
        """A finished search whose final re-measurement has not completed (interrupted, or never run)."""
        if self.config.measurement.final_top_k == 0 or not self.config.method_params.KNOBS:  # one setting: no ranking
            return False
        parent = self.tracker.find_parent(studies.study_uid(self.study))
        return parent is None or parent.data.tags.get("final_state") != "done"

    def _already_done(self) -> int:
        """Nothing left to run: say so without starting Ray or loading a model."""
        parent = self.tracker.find_parent(studies.study_uid(self.study))
        if parent is None or parent.info.status != "FINISHED":  # the last driver stopped before closing it
            with self.signals.critical():
                self._attach_parent(with_params=False)
                self.tracker.finish_parent(self.parent_id, "FINISHED", self._summary())
        remeasured = parent is not None and parent.data.tags.get("final_state") == "done"
        self.progress.note(f"done: {studies.count_complete(self.study)} complete trials in '{self.study_name}' "
                           f"({studies.target_complete(self.config)} wanted); nothing left to run"
                           + ("; its best settings were already re-measured" if remeasured else ""))
        return EXIT_OK

    def _start_ray(self) -> None:
        ray_cfg = self.config.ray
        saved = {name: os.environ.get(name) for name in RAY_ENV}
        os.environ.update(RAY_ENV)  # no C++ failure-signal handler on SIGTERM (see orchestrator.signals)
        self.ray_started = True  # before init: a half-started Ray is shut down too
        self.progress.note("starting Ray ...")
        try:
            with ray_init_keeps_ours():  # a SIGTERM inside ray.init only sets our flag
                if ray_cfg.address is None:
                    # address="local": never join a cluster some other `ray start` left on this machine.
                    ray.init(address="local", num_cpus=ray_cfg.num_cpus, num_gpus=ray_cfg.num_gpus,
                             include_dashboard=False, log_to_driver=False, configure_logging=False)
                else:
                    ray.init(address=ray_cfg.address, log_to_driver=False, configure_logging=False)
        except SystemExit as exc:  # a Ray whose handler got installed anyway (see orchestrator.signals)
            if exc.code != signal.SIGTERM:
                raise
            self.signals.requested = True
        finally:
            self.signals.ray_started()  # our handlers back in place of Ray's
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        self.signals.check()

    def _recover(self) -> None:
        """Close what a crashed or killed driver left open (see the module docstring)."""
        uid = studies.study_uid(self.study)
        finished = {r.data.tags.get(TRIAL_TAG): r for r in self.tracker.children(uid, "FINISHED")}
        for run in self.tracker.children(uid, "RUNNING"):
            self.tracker.kill(run.info.run_id, "the driver stopped before the trial finished")
        for trial in studies.stale_running(self.study):
            done = finished.get(str(trial.number))
            if done is not None and done.data.tags.get(STATUS_TAG) == "pruned":
                self.study.tell(trial.number, state=TrialState.PRUNED, skip_if_finished=True)
                self.progress.note(f"trial {trial.number}: recovered as pruned from MLflow")
            elif done is not None:
                metrics = dict(done.data.metrics)
                studies.tell_result(self.study, trial.number, self.config, metrics,
                                    done.data.tags.get(STATUS_TAG) == "oom")
                self.progress.note(f"trial {trial.number}: recovered its finished result from MLflow")
            else:
                studies.fail_and_requeue(self.study, trial.number, trial.params)
                self.progress.note(f"trial {trial.number}: interrupted earlier; queued to run again")

    # -- the loop ------------------------------------------------------------------------------------
    def _loop(self) -> int:
        wanted = studies.target_complete(self.config)
        try:
            while not self.signals.requested:
                complete = studies.count_complete(self.study)
                for slot in self.slots:
                    if slot.state == "idle" and complete + len(self.inflight) < wanted and self._has_work():
                        with self.signals.critical():
                            self._submit_new(slot)
                self.progress.update(self.study, self.slots, complete, wanted)
                if not self.inflight:
                    break
                ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=0.5)
                for ref in ready:
                    if not self.signals.requested:
                        with self.signals.critical():
                            self._collect(ref)
                if self.failures_in_a_row >= MAX_FAILURES_IN_A_ROW:
                    self._close_inflight("sweep stopped: trials keep failing")
                    self.tracker.finish_parent(self.parent_id, "FAILED", self._summary())
                    raise SweepFailed(
                        f"{self.failures_in_a_row} trials in a row failed, stopping the sweep "
                        f"(last error: {self.last_error}); fix the cause and run the same command again")
            if self.signals.requested:
                self._interrupt()
                return EXIT_INTERRUPTED
            final = self._final_remeasure()
            if self.signals.requested:
                self._interrupt()
                return EXIT_INTERRUPTED
            summary = self._summary()
            best = self._best_metrics(final, summary)
            self.tracker.finish_parent(self.parent_id, "FINISHED", summary, best)
            self.progress.note(f"done: {studies.count_complete(self.study)} complete trials in '{self.study_name}'")
            return EXIT_OK
        except KeyboardInterrupt:
            self._interrupt()
            return EXIT_INTERRUPTED

    def _has_work(self) -> bool:
        if self.config.sampler.type not in ("grid", "predicted"):
            return True
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _spec(self, params: MethodParams, fault: str | None, repeats: int | None = None,
              baseline: bool = True) -> TrialSpec:
        gen = self.config.generation
        return TrialSpec(
            params=params,
            prompts=self.prompts,
            max_new_tokens=self.config.prompts.max_new_tokens,
            temperature=gen.temperature,
            seed=gen.seed,
            stop_token_ids=tuple(gen.stop_token_ids) if gen.stop_token_ids is not None else None,
            stage_timing=self.config.measurement.stage_timing,
            fault=fault,
            repeats=self.config.measurement.repeats if repeats is None else repeats,
            baseline=baseline,
        )

    def _run_params(self, number: int, params: dict[str, Any]) -> dict[str, Any]:
        """What identifies a trial, as child-run params: number, method, every method parameter
        (None where the engine's default applies), and how it was measured."""
        method_params = {name: params.get(name) for name in self.config.method_params.knob_names()}
        return {"trial": number, "method": self.config.method, **method_params,
                "repeats": self.config.measurement.repeats, "max_new_tokens": self.config.prompts.max_new_tokens,
                "temperature": self.config.generation.temperature, "study": self.study_name}

    def _submit_new(self, slot: Slot) -> None:
        trial = self.study.ask()
        params = studies.suggest(trial, self.config)
        fault = trial.user_attrs.get("fault")  # fault injection for tests: set via enqueue user_attrs
        self._submit(slot, trial.number, params, attempt=1, fault=fault)

    def _submit(self, slot: Slot, number: int, params: dict[str, Any], attempt: int, fault: str | None = None) -> None:
        run_id = self.tracker.start_child(self.parent_id, self.study_name, studies.study_uid(self.study), number,
                                          self._run_params(number, params), attempt)
        studies.link_run(self.study, number, run_id, self.tracker.run_url(run_id))
        if self.config.pruner.type != "none":  # per-prompt reports: a streaming generator (see _step)
            ref = slot.handle.run_trial_steps.options(num_returns="streaming").remote(
                self._spec(self.config.params_of(params), fault))
        else:
            ref = slot.handle.run_trial.remote(self._spec(self.config.params_of(params), fault))
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
            self._failed(job, f"{type(exc).__name__}: {exc}")
            return
        if result.status is TrialStatus.ERROR:
            self._failed(job, result.error or "unknown error")
            return
        if not self._still_ours(job):
            return
        if job.predicted is not None:
            result.metrics.update(job.predicted)
        if job.pruning or result.status is TrialStatus.PRUNED:
            self._pruned(job, result)
            return
        if not self.tracker.finish_child(job.run_id, result, job.started_ms):  # MLflow first: see the module docstring
            self._not_ours(job)
            return
        oom = result.status is TrialStatus.OOM
        try:
            studies.tell_result(self.study, job.trial_number, self.config, result.metrics, oom=oom)
        except UpdateFinishedTrialError:
            # closed between the run's status check and our FINISHED (MLflow has no compare-and-set):
            # the run goes back to KILLED, so a FINISHED child run still means a COMPLETE trial
            self.tracker.unfinish(job.run_id, "the trial was closed by someone else while this driver logged it")
            self._not_ours(job)
            return
        self.failures_in_a_row = 0
        if oom:
            self.progress.note(f"trial {job.trial_number}: out of memory, recorded as infeasible")

    def _still_ours(self, job: InFlight) -> bool:
        """The trial and its run are still RUNNING: nobody else closed them (e.g. a resume elsewhere)."""
        if studies.is_running(self.study, job.trial_number) and self.tracker.status(job.run_id) == "RUNNING":
            return True
        self._not_ours(job)
        return False

    def _not_ours(self, job: InFlight) -> None:
        self.progress.note(f"trial {job.trial_number}: closed by someone else meanwhile; its result is not recorded")

    def _failed(self, job: InFlight, error: str) -> None:
        first_line = str(error).splitlines()[0] if str(error) else "unknown error"
        self.failures_in_a_row += 1
        self.last_error = first_line
        self.tracker.fail(job.run_id, error)
        self.study.tell(job.trial_number, state=TrialState.FAIL, skip_if_finished=True)
        self.progress.note(f"trial {job.trial_number} failed: {first_line}")

    # -- predictions and early stopping ------------------------------------------------------------
    def _start_predictions(self, block: int | None) -> None:
        """Replay + cost tables from the actors, logged on the parent run; the predicted plan enqueued."""
        from orchestrator.predictor import Predictor  # the cost model loads torch: only sweeps that predict

        self.progress.note("recording the acceptance replay and measuring each actor's costs ...")
        self.predictor = Predictor.gather(self.config, self.slots,
                                          lambda sampled: self._spec(self.config.params_of(sampled), None), block)
        self.tracker.log_costs(self.parent_id, {slot.index: self.predictor.costs[slot.index].to_dict()
                                                for slot in self.slots}, [s.info for s in self.slots])
        if self.config.sampler.type == "predicted":
            plan = None if studies.PLAN_ATTR in self.study.user_attrs else self.predictor.plan()
            studies.enqueue_plan(self.study, plan)
            self.tracker.log_plan(self.parent_id, self.study.user_attrs[studies.PLAN_ATTR])

    def _step(self, generator, job: InFlight) -> TrialResult | None:
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

    def _pruned(self, job: InFlight, result: TrialResult) -> None:
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
            self.failures_in_a_row += 1
            self.last_error = f"the actor died twice during trial {job.trial_number} ({type(exc).__name__})"
            self.study.tell(job.trial_number, state=TrialState.FAIL, skip_if_finished=True)

    def _revive(self, slot: Slot) -> None:
        """Wait for Ray's restart of the actor (models reload); a fresh actor when restarts are spent."""
        slot.state = "restarting"
        self.progress.update(self.study, self.slots, studies.count_complete(self.study),
                             studies.target_complete(self.config))
        try:
            slot.info = ray.get(slot.handle.info.remote())
            slot.state = "idle"
        except ACTOR_DEATH:
            replace_actor(self.config, slot)
            return
        if slot.info["load_error"]:  # e.g. a tensor-parallel group that did not form again: start afresh
            replace_actor(self.config, slot)

    def _close_inflight(self, reason: str) -> None:
        """In-flight child runs KILLED, their trials queued to run again."""
        with self.signals.critical():
            for job in self.inflight.values():
                self.tracker.kill(job.run_id, reason)
                if studies.is_running(self.study, job.trial_number):
                    studies.fail_and_requeue(self.study, job.trial_number, job.params)
                job.slot.state, job.slot.trial_number = "stopped", None
            self.inflight.clear()

    def _interrupt(self) -> None:
        """Ctrl-C / SIGTERM: in-flight child runs KILLED, their trials queued to run again."""
        self._close_inflight("sweep interrupted")
        with self.signals.critical():
            self.progress.update(self.study, self.slots, studies.count_complete(self.study),
                                 studies.target_complete(self.config))
            self.tracker.finish_parent(self.parent_id, "KILLED", self._summary())
        self.progress.stop()
        print("orchestrator.sweep: interrupted; run the same command again to resume", file=sys.stderr)

    def _summary(self) -> dict[str, Any]:
        return studies.summary(self.study, self.config)

    # -- the final re-measurement ----------------------------------------------------------------------
    def _final_remeasure(self) -> dict[str, Any] | None:
        """Re-measure the top settings interleaved with AR; None when off or nothing to re-measure.

        Skipped when the parent run already holds a re-measurement of exactly these trials (a
        finished study run again); a study extended since then is re-measured in a new round.
        """
        measurement = self.config.measurement
        if measurement.final_top_k == 0 or not self.config.method_params.KNOBS:  # one setting: no ranking
            return None
        picks = studies.top_trials(self.study, self.config, measurement.final_top_k)
        if not picks:
            return None
        numbers = ",".join(str(t.number) for t in picks)
        parent = self.tracker.client.get_run(self.parent_id).data
        if parent.tags.get("final_trials") == numbers and parent.tags.get("final_state") == "done":
            return self._recorded_final(int(parent.tags[ROUND_TAG]), numbers)
        round_id = int(parent.tags.get(ROUND_TAG, "0")) + 1
        passes = measurement.final_repeats
        self.progress.note(f"re-measuring the best {len(picks)} settings (trials {numbers}), {passes} passes, "
                           "each interleaved with the AR baseline ...")
        slot = self.slots[0]
        samples: dict[int, list[tuple[dict, dict]]] = {t.number: [] for t in picks}
        for index in range(passes):
            for trial in picks:
                pair = []
                for spec in (self._spec(ARParams(), None, repeats=1, baseline=False),
                             self._spec(self.config.params_of(trial.params), None, repeats=1, baseline=False)):
                    slot.state = "re-measuring"
                    self.progress.stage = f"re-measuring: pass {index + 1}/{passes}"
                    self.progress.update(self.study, self.slots, studies.count_complete(self.study),
                                         studies.target_complete(self.config))
                    result = self._measure(slot, spec)
                    if result is None:  # interrupted: the next run does the whole re-measurement again
                        return None
                    pair.append(result)
                if all(r.status is TrialStatus.OK for r in pair):
                    samples[trial.number].append((pair[0].metrics, pair[1].metrics))
        self.progress.stage = ""
        final: dict[str, Any] = {"round": round_id, "trials": {}}
        for trial in picks:
            metrics = _remeasured_metrics(samples[trial.number])
            if metrics is None:
                self.progress.note(f"trial {trial.number}: its re-measurement failed; not a candidate")
                continue
            params = self._run_params(trial.number, self.config.setting(trial.params))
            self.tracker.log_remeasure(self.parent_id, self.study_name, studies.study_uid(self.study), trial.number,
                                       params | {"passes": passes}, metrics, round_id)
            final["trials"][trial.number] = metrics
        self.tracker.set_parent_tags(self.parent_id, {ROUND_TAG: round_id, "final_trials": numbers,
                                                      "final_state": "done"})
        self._note_final(final)
        return final

    def _recorded_final(self, round_id: int, numbers: str) -> dict[str, Any]:
        runs = self.tracker.client.search_runs(
            [self.tracker.experiment_id],
            f"tags.{UID_TAG} = '{studies.study_uid(self.study)}' and tags.sweep_role = 'remeasure' "
            f"and tags.{ROUND_TAG} = '{round_id}'",
            max_results=1000,
        )
        self.progress.note(f"the best settings (trials {numbers}) were already re-measured (round {round_id})")
        return {"round": round_id, "trials": {int(r.data.tags[TRIAL_TAG]): dict(r.data.metrics) for r in runs}}

    def _measure(self, slot: Slot, spec: TrialSpec) -> TrialResult | None:
        """One measurement on ``slot``'s actor, waiting in short steps so Ctrl-C stays responsive."""
        ref = slot.handle.run_trial.remote(spec)
        try:
            while not self.signals.requested:
                ready, _ = ray.wait([ref], num_returns=1, timeout=0.5)
                if ready:
                    return ray.get(ref)
            return None
        finally:
            slot.state = "idle"

    def _note_final(self, final: dict[str, Any]) -> None:
        objective = self.config.objectives[0]
        for number, metrics in final["trials"].items():
            self.progress.note(
                f"  trial {number}: {objective.metric} {metrics.get(objective.metric, float('nan')):.4g} "
                f"(median of {metrics['passes']:.0f} passes; tokens/s {metrics['tokens_per_s_min']:.4g}.."
                f"{metrics['tokens_per_s_max']:.4g}), speedup {metrics.get('speedup') or float('nan'):.3g} "
                f"against AR at {metrics.get('baseline_tokens_per_s') or float('nan'):.4g} tokens/s"
            )

    def _best_metrics(self, final: dict[str, Any] | None, summary: dict[str, Any]) -> dict[str, float]:
        """Parent metrics: ``search_best_*`` (the best trial as measured in the search) and ``best_*``
        (the winner: the best re-measured setting when there was a re-measurement). ``summary``
        (the parent's summary.json and best.<param> tags) is updated to name the same winner."""
        out: dict[str, float] = {}
        names = (*METRICS, "tokens_per_s_median", "tokens_per_s_iqr", "baseline_tokens_per_s")
        if "best_trial" in summary:
            searched = self.tracker.trial_metrics(studies.study_uid(self.study), summary["best_trial"])
            out |= {f"search_best_{k}": v for k, v in searched.items() if k in names}
            out["search_best_trial"] = float(summary["best_trial"])
        winner = _final_winner(final, self.config) if final else None
        if winner is not None:
            number, metrics = winner
            out |= {f"best_{k}": v for k, v in metrics.items() if k in names or k.startswith("tokens_per_s_")}
            out["best_trial"] = float(number)
            self.tracker.set_parent_tags(self.parent_id, {"best_trial": number, "best_source": "re-measured"})
            trial = self.study.trials[number]
            summary["search_best_trial"] = summary.get("best_trial")
            summary |= {"best_trial": number, "best_params": self.config.setting(trial.params),
                        "best_source": "re-measured", "remeasured": {str(k): v for k, v in final["trials"].items()}}
        elif "best_trial" in summary:
            out |= {k.replace("search_best_", "best_", 1): v for k, v in out.items()}
            self.tracker.set_parent_tags(self.parent_id, {"best_trial": summary["best_trial"], "best_source": "search"})
        return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _remeasured_metrics(pairs: list[tuple[dict, dict]]) -> dict[str, float] | None:
    """Medians over passes of every numeric metric; speedup per pass against the AR run just before."""
    if not pairs:
        return None
    keys = set.intersection(*(set(k for k, v in method.items() if isinstance(v, (int, float))) for _, method in pairs))
    out = {key: _median([float(method[key]) for _, method in pairs]) for key in keys if not key.startswith("baseline_")}
    speeds = [float(method["tokens_per_s"]) for _, method in pairs]
    out["tokens_per_s_min"], out["tokens_per_s_max"] = min(speeds), max(speeds)
    ratios = [ar["tpot_s"] / method["tpot_s"] for ar, method in pairs if method.get("tpot_s") and ar.get("tpot_s")]
    out["speedup"] = _median(ratios) if ratios else float("nan")
    out["baseline_tokens_per_s"] = _median([float(ar["tokens_per_s"]) for ar, _ in pairs])
    out["passes"] = float(len(pairs))
    return out


def _final_winner(final: dict[str, Any], config: SweepConfig) -> tuple[int, dict[str, float]] | None:
    """The best re-measured setting by the first objective (single-objective sweeps only)."""
    if len(config.objectives) != 1 or not final["trials"]:
        return None
    objective = config.objectives[0]
    sign = 1 if objective.direction == "maximize" else -1
    scored = [(n, m) for n, m in final["trials"].items() if m.get(objective.metric) is not None]
    if not scored:
        return None
    return max(scored, key=lambda item: (sign * item[1][objective.metric], -item[0]))
