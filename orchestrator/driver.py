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
from orchestrator.config import SweepConfig, check_against_block
from orchestrator.pool import ACTOR_DEATH, Slot, check_resources, replace_actor, start_pool
from orchestrator.progress import Progress
from orchestrator.signals import RAY_ENV, Interrupted, StopSignals
from orchestrator.tracking import STATUS_TAG, TRIAL_TAG, StoreError, Tracker, root_reason
from workers.prompts import load_source
from workers.worker import Method, TrialSpec

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
        if self.study is not None and studies.is_done(self.study, self.config):
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
        self.progress.note(f"resuming study '{self.study_name}': {studies.count_complete(self.study)} of {wanted} complete")

    def _attach_parent(self) -> None:
        self.parent_id = self.tracker.parent_run(
            self.study_name, studies.study_uid(self.study), studies.storage_identity(self.config.storage),
            self.study._study_id, self.config.fingerprint(), self.config_path, self.config.model_dump(mode="json"),
        )

    def _already_done(self) -> int:
        """Nothing left to run: say so without starting Ray or loading a model."""
        parent = self.tracker.find_parent(studies.study_uid(self.study))
        if parent is None or parent.info.status != "FINISHED":  # the last driver stopped before closing it
            with self.signals.critical():
                self._attach_parent()
                self.tracker.finish_parent(self.parent_id, "FINISHED", self._summary())
        self.progress.note(f"done: {studies.count_complete(self.study)} complete trials in '{self.study_name}' "
                           f"({studies.target_complete(self.config)} wanted); nothing left to run")
        return EXIT_OK

    def _start_ray(self) -> None:
        ray_cfg = self.config.ray
        saved = {name: os.environ.get(name) for name in RAY_ENV}
        os.environ.update(RAY_ENV)  # no C++ failure-signal handler on SIGTERM (see orchestrator.signals)
        self.ray_started = True  # before init: a half-started Ray is shut down too
        self.progress.note("starting Ray ...")
        try:
            if ray_cfg.address is None:
                # address="local": never join a cluster some other `ray start` left on this machine.
                ray.init(address="local", num_cpus=ray_cfg.num_cpus, num_gpus=ray_cfg.num_gpus,
                         include_dashboard=False, log_to_driver=False, configure_logging=False)
            else:
                ray.init(address=ray_cfg.address, log_to_driver=False, configure_logging=False)
        except SystemExit as exc:  # Ray's own SIGTERM handler, installed for the duration of ray.init
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
            if done is not None:
                metrics = dict(done.data.metrics)
                studies.tell_result(self.study, trial.number, self.config, metrics, done.data.tags.get(STATUS_TAG) == "oom")
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
            self.tracker.finish_parent(self.parent_id, "FINISHED", self._summary())
            self.progress.note(f"done: {studies.count_complete(self.study)} complete trials in '{self.study_name}'")
            return EXIT_OK
        except KeyboardInterrupt:
            self._interrupt()
            return EXIT_INTERRUPTED

    def _has_work(self) -> bool:
        if self.config.sampler.type != "grid":
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
        run_id = self.tracker.start_child(self.parent_id, self.study_name, studies.study_uid(self.study), number,
                                          params, attempt)
        ref = slot.handle.run_trial.remote(self._spec(params, fault))
        self.inflight[ref] = InFlight(slot, number, params, run_id, attempt, int(time.time() * 1000))
        slot.state, slot.trial_number = "running", number

    def _collect(self, ref) -> None:
        job = self.inflight.pop(ref)
        job.slot.state, job.slot.trial_number = "idle", None
        try:
            result = ray.get(ref)
        except ACTOR_DEATH as exc:
            self._actor_died(job, exc)
            return
        except Exception as exc:  # a bug inside the actor call: fail this trial, keep sweeping
            self._failed(job, f"{type(exc).__name__}: {exc}")
            return
        status = result["status"]
        if status == "error":
            self._failed(job, result["error"] or "unknown error")
            return
        if not self._still_ours(job):
            return
        if not self.tracker.finish_child(job.run_id, result, job.started_ms):  # MLflow first: see the module docstring
            self._not_ours(job)
            return
        try:
            studies.tell_result(self.study, job.trial_number, self.config, result["metrics"], oom=status == "oom")
        except UpdateFinishedTrialError:
            self._not_ours(job)
            return
        self.failures_in_a_row = 0
        if status == "oom":
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
        self.progress.update(self.study, self.slots, studies.count_complete(self.study), studies.target_complete(self.config))
        try:
            slot.info = ray.get(slot.handle.info.remote())
            slot.state = "idle"
        except ACTOR_DEATH:
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
