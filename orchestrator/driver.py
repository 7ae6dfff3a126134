"""A sweep from start to end: the stores, Ray and the actors, the trial loop, the final re-measurement.

Start-up, in this order, so that whatever fails fails early and leaves nothing half-made:
  1. the study's lock (one driver per study; a second one is refused, see ``orchestrator.locks``);
  2. the stores opened (tables made if new), an existing study read and what a dead driver left
     open closed (``orchestrator.recovery``); a study with nothing left to run ends here, without
     Ray or models;
  3. Ray, the cluster's resources checked against the pool, the actors and their models;
  4. a new study created and the parent run found or created; the predictions, when the sweep
     predicts; then the trial loop (``orchestrator.trials``) and the final re-measurement
     (``orchestrator.remeasure``).
Ctrl-C / SIGTERM at any point stops at the next safe point (``orchestrator.signals``): the in-flight
trials' runs are marked KILLED and the trials queued to run again.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import optuna
import ray
import sqlalchemy
from optuna.exceptions import StorageInternalError

from orchestrator import locks, recovery, remeasure, trials
from orchestrator import study as studies
from orchestrator.config import SweepConfig, check_against_block
from orchestrator.pool import Slot, check_resources, release_pool, start_pool
from orchestrator.progress import Progress
from orchestrator.signals import RAY_ENV, Interrupted, StopSignals, ray_init_keeps_ours
from orchestrator.tracking import (
    StoreError,
    Tracker,
    environment_params,
    root_reason,
    sweep_params,
)
from orchestrator.trials import TrialSpecs
from workers.prompts import load_source

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
OPTUNA_STORE_ERRORS = (StorageInternalError, sqlalchemy.exc.SQLAlchemyError)


class Driver:
    def __init__(self, config: SweepConfig, config_path: Path, new_study: bool = False,
                 signals: StopSignals | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.new_study = new_study
        self.signals = signals or StopSignals().install()
        # before Ray: a bad prompt source creates nothing
        self.specs = TrialSpecs(config, tuple(load_source(config.prompts.source())))
        self.progress = Progress(config)
        self.signals.on_request = lambda: self.progress.note(
            "stopping at the next safe point: in-flight trials are marked KILLED and queued again (again to force)")
        self.slots: list[Slot] = []
        self.study: optuna.Study | None = None
        self.parent_id: str | None = None
        self.ray_started = False
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
        except trials.SweepFailed as exc:
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
        if (self.study is not None and studies.is_done(self.study, self.config)
                and not remeasure.pending(self.config, self.tracker, self.study)):
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
        return self._search_and_finish()

    def _search_and_finish(self) -> int:
        """The trial loop, then the final re-measurement and the parent run's summary."""
        loop = trials.TrialLoop(self.config, self.study, self.tracker, self.parent_id, self.slots, self.specs,
                                self.progress, self.signals, self.predictor)
        try:
            loop.run()
            final = None
            if not self.signals.requested:
                final = remeasure.FinalRemeasure(self.config, self.study, self.tracker, self.parent_id, self.slots[0],
                                                 self.specs, self.progress, self.signals, self.slots).run()
        except KeyboardInterrupt:
            self.signals.requested = True
        if self.signals.requested:
            loop.close("sweep interrupted")
            with self.signals.critical():
                self.progress.update(self.study, self.slots, studies.count_complete(self.study),
                                     studies.target_complete(self.config))
                self.tracker.finish_parent(self.parent_id, "KILLED", self._summary())
            self.progress.stop()
            print("orchestrator.sweep: interrupted; run the same command again to resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        summary = self._summary()
        best = remeasure.best_metrics(self.config, self.study, self.tracker, self.parent_id, final, summary)
        self.tracker.finish_parent(self.parent_id, "FINISHED", summary, best)
        self.progress.note(f"done: {studies.count_complete(self.study)} complete trials in '{self.study_name}'")
        return EXIT_OK

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
            recovery.recover_stale(self.study, self.tracker, config, self.progress.note)
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

    def _start_predictions(self, block: int | None) -> None:
        """Replay + cost tables from the actors, logged on the parent run; the predicted plan enqueued."""
        from orchestrator.predictor import Predictor  # the cost model loads torch: only sweeps that predict

        self.progress.note("recording the acceptance replay and measuring each actor's costs ...")
        self.predictor = Predictor.gather(self.config, self.slots,
                                          lambda sampled: self.specs.trial(self.config.params_of(sampled)), block)
        self.tracker.log_costs(self.parent_id, {slot.index: self.predictor.costs[slot.index].to_dict()
                                                for slot in self.slots}, [s.info for s in self.slots])
        if self.config.sampler.type == "predicted":
            plan = None if studies.PLAN_ATTR in self.study.user_attrs else self.predictor.plan()
            studies.enqueue_plan(self.study, plan)
            self.tracker.log_plan(self.parent_id, self.study.user_attrs[studies.PLAN_ATTR])

    def _summary(self) -> dict[str, Any]:
        return studies.summary(self.study, self.config)
