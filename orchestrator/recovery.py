"""Recovery: what a dead driver left open, an actor that died, trials cut short by a stop.

- At start-up (``recover_stale``): every MLflow child run still RUNNING is marked KILLED; a RUNNING
  Optuna trial whose child run FINISHED is recovered from MLflow (told COMPLETE or PRUNED, as the
  run says); any other RUNNING trial is failed and queued to run again.
- An actor that died (``revive``): Ray restarts it (models reload); when its restarts are spent or
  it did not come back whole, a fresh actor takes its place.
- A stop (``close_inflight``): the in-flight child runs KILLED, their trials queued to run again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import optuna
import ray
from optuna.trial import TrialState

from orchestrator import study as studies
from orchestrator.config import SweepConfig
from orchestrator.pool import ACTOR_DEATH, Slot, SlotState, replace_actor
from orchestrator.tracking import STATUS_TAG, TRIAL_TAG, Tracker


def recover_stale(study: optuna.Study, tracker: Tracker, config: SweepConfig, note: Callable[[str], None]) -> None:
    """Close what a crashed or killed driver left open (see the module docstring)."""
    uid = studies.study_uid(study)
    finished = {r.data.tags.get(TRIAL_TAG): r for r in tracker.children(uid, "FINISHED")}
    for run in tracker.children(uid, "RUNNING"):
        tracker.kill(run.info.run_id, "the driver stopped before the trial finished")
    for trial in studies.stale_running(study):
        done = finished.get(str(trial.number))
        if done is not None and done.data.tags.get(STATUS_TAG) == "pruned":
            study.tell(trial.number, state=TrialState.PRUNED, skip_if_finished=True)
            note(f"trial {trial.number}: recovered as pruned from MLflow")
        elif done is not None:
            studies.tell_result(study, trial.number, config, dict(done.data.metrics),
                                done.data.tags.get(STATUS_TAG) == "oom")
            note(f"trial {trial.number}: recovered its finished result from MLflow")
        else:
            studies.fail_and_requeue(study, trial.number, trial.params)
            note(f"trial {trial.number}: interrupted earlier; queued to run again")


def revive(slot: Slot, config: SweepConfig) -> None:
    """Wait for Ray's restart of the actor (models reload); a fresh actor when restarts are spent."""
    slot.state = SlotState.RESTARTING
    try:
        slot.info = ray.get(slot.handle.info.remote())
        slot.state = SlotState.IDLE
    except ACTOR_DEATH:
        replace_actor(config, slot)
        return
    if slot.info["load_error"]:  # e.g. a tensor-parallel group that did not form again: start afresh
        replace_actor(config, slot)


def close_inflight(jobs: Iterable, study: optuna.Study, tracker: Tracker, reason: str) -> None:
    """In-flight child runs KILLED, their trials queued to run again (``jobs``: ``trials.InFlight``)."""
    for job in jobs:
        tracker.kill(job.run_id, reason)
        if studies.is_running(study, job.trial_number):
            studies.fail_and_requeue(study, job.trial_number, job.params)
        job.slot.state, job.slot.trial_number = SlotState.STOPPED, None
