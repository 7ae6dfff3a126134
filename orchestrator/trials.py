"""The trial loop: ask, submit to an idle actor, ``ray.wait``, log, tell.

Order of writes per trial, chosen so a crash at any point loses nothing and counts nothing twice:
  1. Optuna ``ask`` (trial RUNNING), MLflow child run created (RUNNING), trial sent to an actor;
  2. result back: MLflow child gets metrics and artifacts and is FINISHED;
  3. Optuna ``tell`` (COMPLETE).
Both writes happen only while the trial and the run are still RUNNING: one closed by someone else is
left alone. An out-of-memory trial is a result (infeasible); an actor that died is restarted and the
trial run once more (``MAX_ATTEMPTS``); any other error fails the trial, and ``MAX_FAILURES_IN_A_ROW``
failures stop the sweep. With a pruner, results stream prompt by prompt and Optuna may stop a trial.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import optuna
import ray
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from orchestrator import recovery
from orchestrator import study as studies
from orchestrator.config import SweepConfig
from orchestrator.pool import ACTOR_DEATH, Slot, SlotState, replace_actor
from orchestrator.progress import Progress
from orchestrator.signals import StopSignals
from orchestrator.tracking import Tracker
from workers.decoding.params import ARParams, MethodParams
from workers.prompts import Prompt
from workers.wire import TrialResult, TrialSpec, TrialStatus

MAX_ATTEMPTS = 2  # a trial whose actor died is re-run once on the restarted actor, then failed
# Trials that FAIL one after another before the sweep stops: a setting-independent error (a bad
# prompt, a broken model) fails every trial, and the sampler would ask for new ones forever.
MAX_FAILURES_IN_A_ROW = 3
# trial_timeout_s unset: a trial may run this many times the median finished trial (and at least the
# floor); before any has finished, the first-trial limit (it also pays for loading and captures)
TIMEOUT_MEDIANS, TIMEOUT_FLOOR_S, FIRST_TRIAL_TIMEOUT_S = 10, 600.0, 3600.0


class SweepFailed(Exception):
    """The sweep stopped on an error it cannot go past; the message is the one line to print."""


class TrialSpecs:
    """Every ``TrialSpec`` of a sweep, built in one place: its prompts and generation settings with a
    setting's parameters."""

    def __init__(self, config: SweepConfig, prompts: tuple[Prompt, ...]) -> None:
        self.config, self.prompts = config, prompts

    def trial(self, params: MethodParams, fault: str | None = None) -> TrialSpec:
        """A search trial: the sweep's repeats, with its AR baseline."""
        return self._spec(params, fault, self.config.measurement.repeats, baseline=True)

    def remeasure(self, params: MethodParams) -> TrialSpec:
        """One pass of the final re-measurement (the AR baseline is measured beside it)."""
        return self._spec(params, None, repeats=1, baseline=False)

    def baseline(self) -> TrialSpec:
        """The AR run a re-measured setting is compared with."""
        return self._spec(ARParams(), None, repeats=1, baseline=False)

    def _spec(self, params: MethodParams, fault: str | None, repeats: int, baseline: bool) -> TrialSpec:
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
            repeats=repeats,
            baseline=baseline,
        )


def run_params(config: SweepConfig, study_name: str, number: int, setting: dict[str, Any]) -> dict[str, Any]:
    """What identifies a trial, as child-run params: number, method, every method parameter (None
    where the engine's default applies), and how it was measured."""
    method = config.method_of(setting)
    method_params = {name: setting.get(name) for name in config.entry_for(method).params.knob_names()}
    return {"trial": number, "method": method, **method_params,
            "repeats": config.measurement.repeats, "max_new_tokens": config.prompts.max_new_tokens,
            "temperature": config.generation.temperature, "study": study_name}


@dataclass
class InFlight:
    slot: Slot
    trial_number: int
    params: dict[str, Any]  # the trial's flat setting
    run_id: str
    attempt: int
    started_ms: int
    predicted: dict[str, float] | None = None  # predicted_tokens_per_s etc. (sweeps that predict)
    pruning: bool = False  # the pruner said stop: the final result is told PRUNED
    last_step: int = 0
    started: float = field(default_factory=time.monotonic)  # for trial_timeout_s


class TrialLoop:
    """Runs trials until the study has ``n_trials`` COMPLETE ones (or the grid / plan is spent)."""

    def __init__(self, config: SweepConfig, study: optuna.Study, tracker: Tracker, parent_id: str,
                 slots: list[Slot], specs: TrialSpecs, progress: Progress, signals: StopSignals,
                 predictor=None) -> None:
        self.config, self.study, self.tracker, self.parent_id = config, study, tracker, parent_id
        self.slots, self.specs, self.progress, self.signals, self.predictor = slots, specs, progress, signals, predictor
        self.inflight: dict[Any, InFlight] = {}
        self.failures_in_a_row, self.last_error = 0, ""

    def run(self) -> None:
        """Until done, or a stop was requested (then the in-flight trials are left to ``close``)."""
        wanted = studies.target_complete(self.config)
        while not self.signals.requested:
            complete = studies.count_complete(self.study)
            for slot in self.slots:
                if slot.state is SlotState.IDLE and complete + len(self.inflight) < wanted and self._has_work():
                    with self.signals.critical():
                        self._submit_new(slot)
            self.progress.update(self.study, self.slots, complete, wanted)
            if not self.inflight:
                return
            ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=0.5)
            for ref in ready:
                if not self.signals.requested:
                    with self.signals.critical():
                        self._collect(ref)
            if not self.signals.requested:
                with self.signals.critical():
                    self._stop_overdue()
            if self.failures_in_a_row >= MAX_FAILURES_IN_A_ROW:
                self.close("sweep stopped: trials keep failing")
                self.tracker.finish_parent(self.parent_id, "FAILED", studies.summary(self.study, self.config))
                raise SweepFailed(
                    f"{self.failures_in_a_row} trials in a row failed, stopping the sweep "
                    f"(last error: {self.last_error}); fix the cause and run the same command again")

    def close(self, reason: str) -> None:
        """In-flight child runs KILLED, their trials queued to run again."""
        with self.signals.critical():
            recovery.close_inflight(self.inflight.values(), self.study, self.tracker, reason)
            self.inflight.clear()

    def timeout_s(self) -> float:
        """How long a trial may run: ``trial_timeout_s``, else ``TIMEOUT_MEDIANS`` x the median finished
        trial (at least ``TIMEOUT_FLOOR_S``), or ``FIRST_TRIAL_TIMEOUT_S`` before any has finished."""
        if self.config.trial_timeout_s is not None:
            return self.config.trial_timeout_s
        median = studies.median_trial_seconds(self.study)
        return FIRST_TRIAL_TIMEOUT_S if median is None else max(TIMEOUT_FLOOR_S, TIMEOUT_MEDIANS * median)

    def _stop_overdue(self) -> None:
        """A trial past its time hangs (a stopped process, a collective waiting forever): its actor (a
        tensor-parallel worker's whole group) is replaced, and the trial runs once more, then fails."""
        limit, now = self.timeout_s(), time.monotonic()
        for ref, job in list(self.inflight.items()):
            if now - job.started < limit:
                continue
            del self.inflight[ref]
            self.progress.note(f"trial {job.trial_number}: still running after {limit:.0f} s (trial_timeout_s); "
                               f"its actor is stopped and replaced")
            self.tracker.kill(job.run_id, f"ran past trial_timeout_s ({limit:.0f} s)")
            self._replace_worker(job.slot)
            if job.attempt < MAX_ATTEMPTS:
                self._submit(job.slot, job.trial_number, job.params, attempt=job.attempt + 1)
            else:
                self.failures_in_a_row += 1
                self.last_error = f"trial {job.trial_number} ran past trial_timeout_s twice"
                self.study.tell(job.trial_number, state=TrialState.FAIL, skip_if_finished=True)

    def _replace_worker(self, slot: Slot) -> None:
        slot.state = SlotState.RESTARTING
        self.progress.update(self.study, self.slots, studies.count_complete(self.study),
                             studies.target_complete(self.config))
        replace_actor(self.config, slot)

    def _has_work(self) -> bool:
        if self.config.sampler.type not in ("grid", "predicted"):
            return True
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _submit_new(self, slot: Slot) -> None:
        trial = self.study.ask()
        params = studies.suggest(trial, self.config)
        fault = trial.user_attrs.get("fault")  # fault injection for tests: set via enqueue user_attrs
        self._submit(slot, trial.number, params, attempt=1, fault=fault)

    def _submit(self, slot: Slot, number: int, params: dict[str, Any], attempt: int, fault: str | None = None) -> None:
        uid = studies.study_uid(self.study)
        run_id = self.tracker.start_child(self.parent_id, self.study.study_name, uid, number,
                                          run_params(self.config, self.study.study_name, number, params), attempt)
        studies.link_run(self.study, number, run_id, self.tracker.run_url(run_id))
        spec = self.specs.trial(self.config.params_of(params), fault)
        if self.config.pruner.type != "none":  # per-prompt reports: a streaming generator (see _step)
            ref = slot.handle.run_trial_steps.options(num_returns="streaming").remote(spec)
        else:
            ref = slot.handle.run_trial.remote(spec)
        predicted = self.predictor.predict(params, slot.index) if self.predictor else None
        self.inflight[ref] = InFlight(slot, number, params, run_id, attempt, int(time.time() * 1000), predicted)
        slot.state, slot.trial_number = SlotState.RUNNING, number

    def _collect(self, ref) -> None:
        job = self.inflight.pop(ref)
        job.slot.state, job.slot.trial_number = SlotState.IDLE, None
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
        if result.restart_worker:  # its tensor-parallel group was aborted when a rank failed
            self.progress.note(f"trial {job.trial_number}: a tensor-parallel rank failed ({result.status.value}); "
                               "the group is gone, a new worker takes its slot")
            self._replace_worker(job.slot)
        if result.status is TrialStatus.ERROR:
            self._failed(job, result.error or "unknown error")
            return
        if not self._still_ours(job):
            return
        if job.predicted is not None:
            result.metrics.update(job.predicted)
        for warning in result.warnings:
            self.progress.note(f"trial {job.trial_number}: {warning}")
        if job.pruning or result.status is TrialStatus.PRUNED:
            self._pruned(job, result)
            return
        if not self.tracker.finish_child(job.run_id, result, job.started_ms):  # MLflow first (module docstring)
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

    def _step(self, generator, job: InFlight) -> TrialResult | None:
        """One item of a trial's stream: report an intermediate value (and maybe stop the trial), or
        return the final result."""
        item = ray.get(next(generator))
        if "result" in item:
            return item["result"]
        self.inflight[generator] = job
        job.slot.state, job.slot.trial_number = SlotState.RUNNING, job.trial_number
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

    def _pruned(self, job: InFlight, result: TrialResult) -> None:
        """MLflow run FINISHED with trial_status=pruned (and the prompts it ran), then Optuna PRUNED."""
        self.tracker.finish_pruned(job.run_id, result, job.started_ms, job.last_step)
        self.study.tell(job.trial_number, state=TrialState.PRUNED, skip_if_finished=True)

    def _actor_died(self, job: InFlight, exc: Exception) -> None:
        slot = job.slot
        self.progress.note(f"actor {slot.index} died during trial {job.trial_number}: {type(exc).__name__}")
        self.tracker.kill(job.run_id, f"actor died: {type(exc).__name__}")
        slot.state = SlotState.RESTARTING
        self.progress.update(self.study, self.slots, studies.count_complete(self.study),
                             studies.target_complete(self.config))
        recovery.revive(slot, self.config)
        if job.attempt < MAX_ATTEMPTS:
            self._submit(slot, job.trial_number, job.params, attempt=job.attempt + 1)
        else:
            self.failures_in_a_row += 1
            self.last_error = f"the actor died twice during trial {job.trial_number} ({type(exc).__name__})"
            self.study.tell(job.trial_number, state=TrialState.FAIL, skip_if_finished=True)
