"""The Optuna side of a sweep: storage checks, the study (created or resumed), asking and telling.

The driver is the only writer. Resume is ours to do (Optuna heartbeats are inert under ask/tell):
trials a crash left RUNNING are failed and their parameters re-enqueued. A study remembers the
fingerprint of the sweep fields that define it; a file whose fingerprint differs is refused unless
the user asks for a new study, which gets the next free name ``<name>@2``, ``<name>@3``...
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from orchestrator.config import CategoricalParam, FloatParam, IntParam, SweepConfig
from workers.errors import BadInputError

FINGERPRINT_ATTR = "sweep_fingerprint"
UID_ATTR = "sweep_uid"  # one id per study ever created: its MLflow runs carry it (a name can be reused)
RETRY_ATTR = "retry_of"
RUN_ID_ATTR, RUN_URL_ATTR = "mlflow_run_id", "mlflow_run_url"  # each trial's link to its MLflow run
OOM_CONSTRAINT = "oom"
# Objective values an OOM trial gets: the worst a maximised metric can be, a huge minimised one
# (peak memory is the real peak). Together with a violated constraint the sampler steers away.
WORST_MINIMISED = 1e9


def check_storage(url: str, field: str = "storage") -> None:
    """Fail early, creating nothing, when the storage URL cannot work."""
    if url.startswith("sqlite:///"):
        path = sqlite_path(url)
        existing = next((p for p in [path.parent, *path.parent.parents] if p.exists()), None)
        if existing is None or not existing.is_dir():
            raise BadInputError(f"{field}: cannot create the SQLite file {path} (no writable folder)")
        problem = _write_probe(existing, path if path.exists() else None)
        if problem:
            raise BadInputError(f"{field}: cannot write the SQLite file {path} ({problem})")
        return
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(url)
        with engine.connect():
            pass
    except Exception as exc:  # drivers raise many types; the user needs the URL and the reason
        shown = hide_password(url)
        reason = str(exc).splitlines()[0].replace(url, shown)
        raise BadInputError(f"{field}: cannot connect to {shown} ({reason})") from exc


def _write_probe(folder: Path, database: Path | None) -> str | None:
    """Why SQLite could not write here (read-only folder or file, full disk), or None.

    A real write, not ``os.access``: root passes every permission check, yet a read-only mount or a
    full disk still refuses. SQLite writes its journal beside the database, so the folder counts too.
    """
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-") as handle:
            handle.write(b"\0" * 4096)
            handle.flush()
            os.fsync(handle.fileno())
        if database is not None:
            with database.open("r+b"):
                pass
    except OSError as exc:
        return f"{exc.strerror or exc} in {folder if database is None else database}"
    return None


def sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def storage_identity(url: str) -> str:
    """The storage as a stable name: no password, no driver (psycopg vs psycopg2 is the same database)."""
    if url.startswith("sqlite:///"):
        return url
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
        return parsed.set(drivername=parsed.get_backend_name()).render_as_string(hide_password=True)
    except Exception:  # not parseable as a database URL: show no credentials at all
        return url.split("@")[-1]


def hide_password(url: str) -> str:
    """Never echo a database password into a terminal or a log."""
    import sqlalchemy

    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # not parseable as a database URL: show no credentials at all
        return url.split("@")[-1]


def make_storage(url: str) -> optuna.storages.RDBStorage:
    """The storage, its tables created if new (one process at a time: concurrent creation races)."""
    from orchestrator import locks

    if url.startswith("sqlite:///"):
        sqlite_path(url).parent.mkdir(parents=True, exist_ok=True)
    lock = locks.acquire(url, "schema", wait=True)
    try:
        return optuna.storages.RDBStorage(url)
    finally:
        locks.release(lock)


def read_only_storage(url: str) -> optuna.storages.RDBStorage | None:
    """The storage opened only to read (dry-run, report), or None when it has no Optuna tables yet."""
    import sqlalchemy

    if url.startswith("sqlite:///"):
        path = sqlite_path(url)
        if not path.is_file():
            return None
        url = f"sqlite:///file:{path}?mode=ro&uri=true"  # SQLite itself refuses every write
    engine = sqlalchemy.create_engine(url)
    try:
        # Optuna makes its tables, then the version tables; until the last exists the store is not ready
        inspector = sqlalchemy.inspect(engine)
        if not all(inspector.has_table(t) for t in ("studies", "version_info", "alembic_version")):
            return None
    finally:
        engine.dispose()
    try:
        return optuna.storages.RDBStorage(url, skip_table_creation=True)
    except sqlalchemy.exc.OperationalError:  # it wanted to write: a driver is making the store right now
        return None


def make_sampler(config: SweepConfig) -> optuna.samplers.BaseSampler:
    seed = config.sampler.seed
    kind = config.sampler.type
    if kind == "tpe" and config.several:  # a conditional space (each method its knobs): TPE's grouped model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True)
    if kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if kind == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)  # random; grid and predicted (whose points are all enqueued)


def make_pruner(config: SweepConfig) -> optuna.pruners.BasePruner:
    pruner = config.pruner
    if pruner.type == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=pruner.n_startup_trials,
                                           n_warmup_steps=pruner.n_warmup_steps)
    if pruner.type == "percentile":
        return optuna.pruners.PercentilePruner(pruner.percentile, n_startup_trials=pruner.n_startup_trials,
                                               n_warmup_steps=pruner.n_warmup_steps)
    if pruner.type == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.NopPruner()


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
    study = create_study(config, storage, name) if create else load_study(config, storage, name)
    return StudyHandle(study, name, create)


def create_study(config: SweepConfig, storage, name: str) -> optuna.Study:
    """A new study with the attributes that identify it (call inside a critical section)."""
    directions = [objective.direction for objective in config.objectives]
    study = optuna.create_study(storage=storage, study_name=name, directions=directions, sampler=make_sampler(config),
                                pruner=make_pruner(config))
    study.set_user_attr(FINGERPRINT_ATTR, config.fingerprint())
    study.set_user_attr("sweep_definition", config.defining_summary())
    study.set_user_attr(UID_ATTR, uuid.uuid4().hex)
    name_objectives(study, config)
    if config.sampler.type == "grid":
        enqueue_grid(study, config)
    return study


def load_study(config: SweepConfig, storage, name: str) -> optuna.Study:
    study = optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(config),
                              pruner=make_pruner(config))
    if UID_ATTR not in study.user_attrs:  # made by an older version of the driver
        study.set_user_attr(UID_ATTR, uuid.uuid4().hex)
    name_objectives(study, config)
    if config.sampler.type == "grid":
        enqueue_grid(study, config)
    return study


def name_objectives(study: optuna.Study, config: SweepConfig) -> None:
    """optuna-dashboard and Optuna's plots then say tokens_per_s, not "Objective 0"."""
    if study.metric_names is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([objective.metric for objective in config.objectives])


def study_uid(study: optuna.Study) -> str:
    return study.user_attrs[UID_ATTR]


def is_done(study: optuna.Study, config: SweepConfig) -> bool:
    """Nothing left to run: enough COMPLETE trials, or a grid with no point left to try."""
    if count_complete(study) >= target_complete(config):
        return True
    return config.sampler.type == "grid" and not study.get_trials(
        deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))


def status_text(config: SweepConfig, new_study: bool = False) -> str:
    """What running this file would do to the store, read without writing anything (``--dry-run``)."""
    storage = read_only_storage(config.storage)
    wanted = target_complete(config)
    if storage is None:
        return f"new study '{config.name}' ({wanted} complete trials to run)"
    name, create = find_study_name(config, storage, new_study)  # a changed definition raises as a run would
    if create:
        beside = f" beside '{config.name}'" if name != config.name else ""
        return f"new study '{name}'{beside} ({wanted} complete trials to run)"
    study = optuna.load_study(study_name=name, storage=storage)
    complete = count_complete(study)
    interrupted = len(stale_running(study))
    if is_done(study, config) and not interrupted:
        return f"complete: study '{name}' has {complete} of {wanted} complete trials; running it says done"
    extra = f"; {interrupted} interrupted trial(s) will be re-run" if interrupted else ""
    return f"resuming study '{name}': {complete} of {wanted} complete{extra}"


def grid_note(config: SweepConfig) -> str | None:
    if config.sampler.type != "grid":
        return None
    points = len(grid_points(config))
    if points >= config.n_trials:
        return None
    return f"the grid has {points} points, fewer than n_trials = {config.n_trials}: the sweep stops after {points}"


def grid_points(config: SweepConfig) -> list[dict[str, Any]]:
    """Every point of the space as a trial's sampled parameters (with several methods, each method's
    points, named by ``method``)."""
    points = []
    for method in config.methods:
        space = config.space(method)
        names = sorted(space)
        named = {"method": method} if config.several else {}
        points += [named | dict(zip(names, point, strict=True))
                   for point in itertools.product(*(space[n].values() for n in names))]
    return points


def enqueue_grid(study: optuna.Study, config: SweepConfig) -> None:
    """Every grid point once: skip_if_exists also matches finished and failed trials."""
    for point in grid_points(config):
        study.enqueue_trial(point, skip_if_exists=True)


def target_complete(config: SweepConfig) -> int:
    """COMPLETE trials the sweep stops at (a grid has no more points than its size)."""
    if config.sampler.type in ("grid", "predicted"):
        return min(config.n_trials, space_size(config))
    return config.n_trials


def space_size(config: SweepConfig) -> int:
    return sum(math.prod(len(param.values()) for param in config.space(m).values()) for m in config.methods)


def space_points(config: SweepConfig, limit: int, seed: int | None) -> list[dict[str, Any]]:
    """Every point of the search space, or ``limit`` distinct random ones when it has more (seeded)."""
    if space_size(config) <= limit:
        return grid_points(config)
    import random

    rng = random.Random(seed)
    sizes = [math.prod(len(p.values()) for p in config.space(m).values()) for m in config.methods]
    seen: dict[tuple, dict[str, Any]] = {}
    while len(seen) < limit:  # a method drawn in proportion to its points, then a point of its space
        method = rng.choices(config.methods, weights=sizes)[0]
        space = config.space(method)
        names = sorted(space)
        point = tuple(rng.choice(space[n].values()) for n in names)
        named = {"method": method} if config.several else {}
        seen.setdefault((method, point), named | dict(zip(names, point, strict=True)))
    return list(seen.values())


PLAN_ATTR = "predicted_plan"


def enqueue_plan(study: optuna.Study, plan: list[dict[str, Any]]) -> None:
    """The predicted strategy's points, once each (as the grid's): stored on the study so a resumed
    sweep runs the same plan even though its cost table is measured again."""
    if PLAN_ATTR not in study.user_attrs:
        study.set_user_attr(PLAN_ATTR, plan)
    for entry in study.user_attrs[PLAN_ATTR]:
        study.enqueue_trial(entry["params"], user_attrs={"plan_role": entry["role"]}, skip_if_exists=True)


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
    """The trial's method parameters: swept ones from the sampler, fixed ones from the file. With
    several methods the method is a parameter too, and each method's knobs are sampled only in its
    trials (Optuna's define-by-run conditional space)."""
    params: dict[str, Any] = {}
    if config.several:
        params["method"] = trial.suggest_categorical("method", list(config.methods))
    for name, space in config.space(config.method_of(params)).items():
        if isinstance(space, IntParam):
            params[name] = trial.suggest_int(name, space.low, space.high, step=space.step, log=space.log)
        elif isinstance(space, FloatParam):
            params[name] = trial.suggest_float(name, space.low, space.high, step=space.step)
        elif isinstance(space, CategoricalParam):
            params[name] = trial.suggest_categorical(name, space.choices)
    return config.setting(params)


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


def is_running(study: optuna.Study, trial_number: int) -> bool:
    """True while the trial is still open (only then may this driver write to it)."""
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, trial_number)
    return study._storage.get_trial(trial_id).state == TrialState.RUNNING


def running_trial(study: optuna.Study, trial_number: int) -> Trial:
    """A handle on a RUNNING trial by number (for report / should_prune / attributes under ask/tell)."""
    return Trial(study, study._storage.get_trial_id_from_study_id_trial_number(study._study_id, trial_number))


def tell_result(study: optuna.Study, trial_number: int, config: SweepConfig, metrics: dict[str, Any],
                oom: bool) -> None:
    """COMPLETE with objective values and constraints (an OOM is an infeasible result, not a FAIL).

    Raises ``optuna.exceptions.UpdateFinishedTrialError`` when the trial is no longer RUNNING.
    """
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
