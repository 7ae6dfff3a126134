"""The Optuna side of a sweep: storage checks, the study (created or resumed), asking and telling.

The driver is the only writer. Resume is ours to do (Optuna heartbeats are inert under ask/tell):
trials a crash left RUNNING are failed and their parameters re-enqueued. A study remembers the
fingerprint of the sweep fields that define it; a file whose fingerprint differs is refused unless
the user asks for a new study, which gets the next free name ``<name>@2``, ``<name>@3``...
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from orchestrator.config import CategoricalParam, IntParam, SweepConfig
from workers.errors import BadInputError

FINGERPRINT_ATTR = "sweep_fingerprint"
RETRY_ATTR = "retry_of"
RUN_ID_ATTR, RUN_URL_ATTR = "mlflow_run_id", "mlflow_run_url"  # each trial's link to its MLflow run
OOM_CONSTRAINT = "oom"
# Objective values an OOM trial gets: the worst a maximised metric can be, a huge minimised one
# (peak memory is the real peak). Together with a violated constraint the sampler steers away.
WORST_MINIMISED = 1e9


def check_storage(url: str, field: str = "storage") -> None:
    """Fail early, creating nothing, when the storage URL cannot work."""
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        existing = next((p for p in [path.parent, *path.parent.parents] if p.exists()), None)
        if existing is None or not existing.is_dir() or not _writable(existing):
            raise BadInputError(f"{field}: cannot create the SQLite file {path} (no writable folder)")
        return
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(url)
        with engine.connect():
            pass
    except Exception as exc:  # drivers raise many types; the user needs the URL and the reason
        shown = _hide_password(url)
        reason = str(exc).splitlines()[0].replace(url, shown)
        raise BadInputError(f"{field}: cannot connect to {shown} ({reason})") from exc


def _hide_password(url: str) -> str:
    """Never echo a database password into a terminal or a log."""
    import sqlalchemy

    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # not parseable as a database URL: show no credentials at all
        return url.split("@")[-1]


def _writable(folder: Path) -> bool:
    import os

    return os.access(folder, os.W_OK)


def make_storage(url: str) -> optuna.storages.RDBStorage:
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.RDBStorage(url)


def make_sampler(config: SweepConfig) -> optuna.samplers.BaseSampler:
    seed = config.sampler.seed
    kind = config.sampler.type
    if kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if kind == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)  # random, and grid (whose points are all enqueued)


@dataclass
class StudyHandle:
    study: optuna.Study
    name: str
    created: bool


def find_study_name(config: SweepConfig, storage, new_study: bool) -> tuple[str, bool]:
    """(name, create): the study this file resumes (same fingerprint), or the name a new one takes."""
    existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    family = [config.name] + [f"{config.name}@{k}" for k in range(2, 1000)]
    for name in family:
        summary = existing.get(name)
        if summary is not None and summary.user_attrs.get(FINGERPRINT_ATTR) == config.fingerprint():
            return name, False
    if config.name in existing and not new_study:
        stored = existing[config.name].user_attrs.get("sweep_definition", {})
        raise BadInputError(
            f"study '{config.name}' in {config.storage} was made by a sweep with a different definition "
            f"(method, models, search space or objectives changed; stored: {stored}). "
            "Rename the sweep, or pass --new-study to start a new study beside it"
        )
    return next(name for name in family if name not in existing), True


def open_study(config: SweepConfig, storage, new_study: bool = False) -> StudyHandle:
    name, create = find_study_name(config, storage, new_study)
    directions = [objective.direction for objective in config.objectives]
    sampler = make_sampler(config)
    if create:
        study = optuna.create_study(storage=storage, study_name=name, directions=directions, sampler=sampler)
        study.set_user_attr(FINGERPRINT_ATTR, config.fingerprint())
        study.set_user_attr("sweep_definition", config.defining_summary())
    else:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    if study.metric_names is None:  # optuna-dashboard and plots then say tokens_per_s, not "Objective 0"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([objective.metric for objective in config.objectives])
    if config.sampler.type == "grid":
        enqueue_grid(study, config)
    return StudyHandle(study, name, create)


def grid_points(config: SweepConfig) -> list[dict[str, Any]]:
    names = sorted(config.search_space)
    axes = [config.search_space[n].values() for n in names]
    return [dict(zip(names, point, strict=True)) for point in itertools.product(*axes)]


def enqueue_grid(study: optuna.Study, config: SweepConfig) -> None:
    """Every grid point once: skip_if_exists also matches finished and failed trials."""
    for point in grid_points(config):
        study.enqueue_trial(point, skip_if_exists=True)


def target_complete(config: SweepConfig) -> int:
    """COMPLETE trials the sweep stops at (a grid has no more points than its size)."""
    if config.sampler.type == "grid":
        return min(config.n_trials, len(grid_points(config)))
    return config.n_trials


def count_complete(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))


def stale_running(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))


def fail_and_requeue(study: optuna.Study, trial_number: int, params: dict[str, Any]) -> None:
    """A trial interrupted by a crash or Ctrl-C: FAIL it and queue the same point to run again."""
    study.tell(trial_number, state=TrialState.FAIL, skip_if_finished=True)
    study.enqueue_trial(params, user_attrs={RETRY_ATTR: trial_number})


def link_run(study: optuna.Study, trial_number: int, run_id: str, url: str | None) -> None:
    """Record the trial's MLflow run (the latest attempt's) as user attributes, while it is RUNNING."""
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, trial_number)
    study._storage.set_trial_user_attr(trial_id, RUN_ID_ATTR, run_id)
    if url:
        study._storage.set_trial_user_attr(trial_id, RUN_URL_ATTR, url)


def top_trials(study: optuna.Study, config: SweepConfig, k: int) -> list[FrozenTrial]:
    """Up to ``k`` feasible COMPLETE trials with distinct settings, best first by the first objective
    (two objectives: the Pareto front first). The candidates the final re-measurement checks."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if feasible(t)]
    sign = 1 if config.objectives[0].direction == "maximize" else -1
    ranked = sorted(done, key=lambda t: (-sign * t.values[0], t.number))
    if len(config.objectives) > 1:
        front = {t.number for t in study.best_trials}
        ranked = [t for t in ranked if t.number in front] + [t for t in ranked if t.number not in front]
    picked, seen = [], set()
    for trial in ranked:
        key = tuple(sorted(trial.params.items(), key=lambda item: item[0]))
        if key not in seen:
            seen.add(key)
            picked.append(trial)
    return picked[:k]


def trial_counts(study: optuna.Study) -> dict[str, int]:
    """complete / failed / killed / infeasible / running, for the progress display.

    killed: FAIL trials that were interrupted (Ctrl-C, a crash, a dead actor) and queued again,
    i.e. some later trial is their retry; failed: every other FAIL (an error inside the trial);
    infeasible: COMPLETE trials that violate a constraint (out of memory included).
    """
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get(RETRY_ATTR) for t in trials}
    counts = {"complete": 0, "failed": 0, "killed": 0, "infeasible": 0, "running": 0}
    for trial in trials:
        if trial.state == TrialState.COMPLETE:
            counts["complete"] += 1
            counts["infeasible"] += 0 if feasible(trial) else 1
        elif trial.state == TrialState.FAIL:
            counts["killed" if trial.number in retried else "failed"] += 1
        elif trial.state == TrialState.RUNNING:
            counts["running"] += 1
    return counts


def median_trial_seconds(study: optuna.Study) -> float | None:
    """Median wall time of COMPLETE trials (start to finish), the basis of the time-left estimate."""
    spans = sorted((t.datetime_complete - t.datetime_start).total_seconds()
                   for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                   if t.datetime_start and t.datetime_complete)
    return spans[len(spans) // 2] if spans else None


def suggest(trial: Trial, config: SweepConfig) -> dict[str, Any]:
    """The trial's method parameters: swept ones from the sampler, fixed ones from the file."""
    params: dict[str, Any] = {}
    for name, space in config.search_space.items():
        if isinstance(space, IntParam):
            params[name] = trial.suggest_int(name, space.low, space.high, step=space.step, log=space.log)
        elif isinstance(space, CategoricalParam):
            params[name] = trial.suggest_categorical(name, space.choices)
    return params | dict(config.fixed_params)


def constraint_values(config: SweepConfig, metrics: dict[str, Any], oom: bool) -> dict[str, float]:
    """Optuna constraints (feasible when <= 0): one per configured bound, plus 'oom'."""
    values = {OOM_CONSTRAINT: 1.0 if oom else 0.0}
    for metric, bound in config.constraints.items():
        value = metrics.get(metric)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            values[metric] = 1.0 if oom else 0.0
            continue
        violation = -math.inf
        if bound.max is not None:
            violation = max(violation, value - bound.max)
        if bound.min is not None:
            violation = max(violation, bound.min - value)
        values[metric] = max(violation, 1e-6) if oom else violation
    return values


def objective_values(config: SweepConfig, metrics: dict[str, Any], oom: bool) -> list[float]:
    values = []
    for objective in config.objectives:
        value = metrics.get(objective.metric)
        if value is None or oom and objective.metric != "peak_memory_gib":
            value = 0.0 if objective.direction == "maximize" else WORST_MINIMISED
        values.append(float(value))
    return values


def tell_result(study: optuna.Study, trial_number: int, config: SweepConfig, metrics: dict[str, Any], oom: bool) -> None:
    """COMPLETE with objective values and constraints (an OOM is an infeasible result, not a FAIL)."""
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, trial_number)
    trial = Trial(study, trial_id)
    constraints = constraint_values(config, metrics, oom)
    for key, value in constraints.items():
        trial.set_constraint(key, value)
    trial.set_user_attr("feasible", all(value <= 0 for value in constraints.values()))
    trial.set_user_attr("status", "oom" if oom else "ok")
    study.tell(trial_number, objective_values(config, metrics, oom), skip_if_finished=True)


def feasible(trial: FrozenTrial) -> bool:
    return bool(trial.user_attrs.get("feasible", True))


def summary(study: optuna.Study, config: SweepConfig) -> dict[str, Any]:
    """Best feasible trial (one objective) or the feasible Pareto front (two), for the parent run."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if feasible(t)]
    out: dict[str, Any] = {
        "study": study.study_name,
        "complete": len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))),
        "feasible": len(done),
        "objectives": [f"{o.direction} {o.metric}" for o in config.objectives],
    }
    if not done:
        return out
    if len(config.objectives) == 1:
        sign = 1 if config.objectives[0].direction == "maximize" else -1
        best = max(done, key=lambda t: sign * t.values[0])
        out |= {"best_trial": best.number, "best_params": best.params, "best_values": best.values}
    else:
        front = study.best_trials
        out["pareto_front"] = [{"trial": t.number, "params": t.params, "values": t.values} for t in front]
        if front:
            out["best_params"] = front[0].params
    return out
