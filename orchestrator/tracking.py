"""The MLflow side of a sweep: one parent run per study, one nested child run per trial.

Everything goes through ``MlflowClient`` with explicit run ids (no global active-run stack), and the
driver is the only writer. Runs are found again on resume by tags: the parent and the children by
``sweep_study_uid``, the id the Optuna study got when it was created (a study name alone is not
enough: the same name in another storage, or in a storage made anew, is another study). Artifacts
go next to a SQLite store (never into a cwd-relative ``mlruns``). A write goes only to a run that is
still RUNNING: a run someone else closed is left as it is. Store failures (a full disk, a server
gone) surface as one ``StoreError`` naming the store.

What lands where (so the runs table can filter and compare):
  * experiment: tag ``mlflow.experimentKind = custom_model_development`` (MLflow 3 opens untagged
    experiments in its GenAI view, which has no runs table);
  * parent run: params = the resolved sweep (method, models, prompts, generation, sampler, ...) and
    the environment (``env.*``: package versions, git commit, devices); metrics = the named winner
    (``best_*``, re-measured when the sweep re-measured its top settings) and the search's best
    trial as it was measured once (``search_best_*``);
  * child run per trial: params = what identifies the trial (number, method, every method
    parameter, repeats, ...); metrics = the trial's results, the memory trace as step metrics, the
    acceptance histogram as a step metric plus scalar columns;
  * child run per re-measured setting (role ``remeasure``): medians over the interleaved passes.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient

from workers.errors import BadInputError, SpecDecError
from workers.metrics import acceptance_columns
from workers.wire import KIND_RSS, MemoryTrace

if TYPE_CHECKING:
    from workers.wire import TrialResult

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # read by the MLflow 3 UI to pick the experiment's view
MODEL_DEVELOPMENT = "custom_model_development"
STUDY_TAG = "sweep_study"
UID_TAG = "sweep_study_uid"
STORAGE_TAG = "sweep_storage"
OPTUNA_ID_TAG = "optuna_study_id"
FINGERPRINT_TAG = "sweep_fingerprint"
TRIAL_TAG = "optuna_trial"
STATUS_TAG = "trial_status"
ROLE_TAG = "sweep_role"
MEMORY_KIND_TAG = "memory_kind"
WARNINGS_TAG = "warnings"
BASELINE_TAG = "baseline"
BASELINE_HOW = "AR on each prompt just before the method, both warmed up, on the same actor"
ROUND_TAG = "final_round"  # on the parent and on each re-measurement run: which re-measurement is current
# One step metric per committed length (step = length, value = rounds): the chart is the histogram.
ACCEPTANCE_STEP_METRIC = "acceptance_rounds_by_length"
BATCH = 1000  # MLflow's log_batch cap on metrics per call


class StoreError(SpecDecError):
    """A store (MLflow or Optuna) failed mid-run: full disk, server gone, database locked."""


def root_reason(exc: BaseException) -> str:
    """The first line of the innermost cause: '(sqlite3.OperationalError) database or disk is full'."""
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _store_call(method):
    """Any failure of the MLflow store inside ``method`` becomes one StoreError naming the store."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except SpecDecError:
            raise
        except Exception as exc:  # MlflowException, OSError (artifacts), SQLAlchemy errors
            raise StoreError(f"the MLflow store {self.shown_uri} failed: {root_reason(exc)}") from exc

    return wrapper


def check_tracking_uri(uri: str) -> None:
    """Fail early, creating nothing, on a tracking URI the driver cannot write to."""
    if uri.startswith("sqlite:///"):
        from orchestrator.study import check_storage

        check_storage(uri, "mlflow.tracking_uri")  # same rules: a writable folder for the SQLite file
        return
    if uri.startswith(("http://", "https://")):
        import urllib.request

        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5).read()
        except Exception as exc:  # connection refused, DNS, HTTP error: one line for the user
            raise BadInputError(f"mlflow.tracking_uri: cannot reach the tracking server {uri} ({exc})") from exc
        return
    if uri.startswith(("postgresql", "mysql")):
        from orchestrator.study import check_storage

        check_storage(uri, "mlflow.tracking_uri")
        return
    raise BadInputError(
        f"mlflow.tracking_uri: {uri!r} is not supported (use sqlite:///..., http(s)://... or a database URL; "
        "the plain file store is refused by MLflow 3)"
    )


def read_only_client(uri: str) -> MlflowClient | None:
    """A client that cannot create anything (report, dry-run), or None when there is no store yet.

    Opening a SQLite or database store with a plain client creates its tables when they are missing
    (and races a driver doing the same); a read-only SQLite connection and a table check prevent it.
    """
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        if not path.is_file():
            return None
        uri = f"sqlite:///file:{path}?mode=ro&uri=true"
    if uri.startswith(("sqlite", "postgresql", "mysql")):
        import sqlalchemy

        engine = sqlalchemy.create_engine(uri)
        try:
            if not sqlalchemy.inspect(engine).has_table("alembic_version"):  # tables not made (yet)
                return None
        finally:
            engine.dispose()
    return MlflowClient(tracking_uri=uri)


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str) -> None:
        from orchestrator import locks
        from orchestrator.study import hide_password

        self.tracking_uri = tracking_uri
        self.shown_uri = (hide_password(tracking_uri) if not tracking_uri.startswith(("sqlite", "http"))
                          else tracking_uri)
        self.experiment_name = experiment
        # Opening a new SQLite / database store creates its tables, and two processes doing it at
        # once fail ('table ... already exists'): one at a time, and the experiment under the same lock.
        lock = locks.acquire(tracking_uri, "schema", wait=True)
        try:
            self._open()
        finally:
            locks.release(lock)

    @_store_call
    def _open(self) -> None:
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment_name)
        if found is not None:
            if EXPERIMENT_KIND_TAG not in found.tags:  # made before this tag was set, or by hand
                self.client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT)
            self.experiment_id = found.experiment_id
            return
        location = None
        if self.tracking_uri.startswith("sqlite:///"):  # artifacts beside the database, absolute
            location = (Path(self.tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
        self.experiment_id = self.client.create_experiment(self.experiment_name, artifact_location=location,
                                                           tags={EXPERIMENT_KIND_TAG: MODEL_DEVELOPMENT})

    def run_url(self, run_id: str) -> str | None:
        """The run's page in the MLflow UI when the tracking URI is a server (None for a local store)."""
        if not self.tracking_uri.startswith(("http://", "https://")):
            return None
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}"

    @_store_call
    def status(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.status

    # -- parent --------------------------------------------------------------------------------------
    @_store_call
    def find_parent(self, uid: str):
        runs = self.client.search_runs(
            [self.experiment_id], f"tags.{UID_TAG} = '{uid}' and tags.{ROLE_TAG} = 'parent'", max_results=1
        )
        return runs[0] if runs else None

    @_store_call
    def parent_run(self, study_name: str, uid: str, storage: str, optuna_id: int, fingerprint: str,
                   config_path: Path, resolved: dict[str, Any], params: dict[str, Any] | None = None) -> str:
        """Reuse this study's parent run (RUNNING again) or create it with the config as an artifact.

        The parent belongs to one study: the uid Optuna's study got at creation; the storage and the
        study's id there are tagged too, for people reading the runs table. ``params`` (the resolved
        sweep and the environment) are logged on a new run; on a resumed one, keys it lacks are added
        and a value that changed (a package upgrade, a new commit) goes in a ``resumed.<key>`` tag,
        since MLflow refuses to re-log a param with another value.
        """
        found = self.find_parent(uid)
        if found is not None:
            run_id = found.info.run_id
            self.client.update_run(run_id, status="RUNNING")
            self._reconcile_params(run_id, found.data.params, params or {})
            return run_id
        run = self.client.create_run(
            self.experiment_id,
            run_name=study_name,
            tags={STUDY_TAG: study_name, UID_TAG: uid, STORAGE_TAG: storage, OPTUNA_ID_TAG: str(optuna_id),
                  FINGERPRINT_TAG: fingerprint, ROLE_TAG: "parent"},
        )
        run_id = run.info.run_id
        self._log_params(run_id, params or {})
        self.client.log_artifact(run_id, str(config_path), artifact_path="config")
        self.client.log_dict(run_id, resolved, "config/resolved.json")
        return run_id

    @_store_call
    def log_costs(self, run_id: str, costs: dict[int, dict[str, Any]], infos: list[dict[str, Any]]) -> None:
        """Each actor's measured cost table as an artifact (re-measured, so overwritten, on resume)."""
        for index, table in costs.items():
            self.client.log_dict(run_id, table | {"actor": infos[index] if index < len(infos) else {}},
                                 f"costs/actor-{index}.json")
        tags = [RunTag(f"costs.actor{index}.device", table["device"]) for index, table in costs.items()]
        self.client.log_batch(run_id, tags=tags)

    @_store_call
    def log_plan(self, run_id: str, plan: list[dict[str, Any]]) -> None:
        self.client.log_dict(run_id, {"plan": plan}, "predicted_plan.json")

    @_store_call
    def log_step(self, run_id: str, key: str, value: float, step: int) -> None:
        self.client.log_batch(run_id, metrics=[Metric(key, value, int(time.time() * 1000), step)])

    def finish_pruned(self, run_id: str, result: TrialResult, started_ms: int, prompts_done: int) -> bool:
        """A pruned trial: what it measured, tagged trial_status=pruned, FINISHED (so a resumed
        driver finds it and tells Optuna PRUNED again instead of re-running it)."""
        from workers.wire import TrialStatus

        if self.status(run_id) != "RUNNING":
            return False
        self.client.set_tag(run_id, "pruned_after_prompts", str(prompts_done))
        return self.finish_child(run_id, dataclasses.replace(result, status=TrialStatus.PRUNED), started_ms)

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        items = [Param(k, _param_text(v)) for k, v in params.items()]
        for start in range(0, len(items), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(run_id, params=items[start : start + 100])

    def _reconcile_params(self, run_id: str, logged: dict[str, str], params: dict[str, Any]) -> None:
        new = {k: v for k, v in params.items() if k not in logged}
        changed = [RunTag(f"resumed.{k}", _param_text(v)) for k, v in params.items()
                   if k in logged and logged[k] != _param_text(v)]
        self._log_params(run_id, new)
        if changed:
            self.client.log_batch(run_id, tags=changed)

    @_store_call
    def set_parent_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    @_store_call
    def finish_parent(self, run_id: str, status: str, summary: dict[str, Any],
                      best_metrics: dict[str, float] | None = None) -> None:
        """Best setting as tags (a resumed sweep may find a better one, so not params), best values as metrics."""
        best = summary.get("best_params") or {}
        self.client.log_batch(run_id, tags=[RunTag(f"best.{k}", str(v)) for k, v in best.items()])
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, 0) for k, v in (best_metrics or {}).items() if _number(v)]
        for start in range(0, len(metrics), BATCH):
            self.client.log_batch(run_id, metrics=metrics[start : start + BATCH])
        self.client.log_dict(run_id, summary, "summary.json")
        self.client.set_terminated(run_id, status)

    # -- children ------------------------------------------------------------------------------------
    @_store_call
    def start_child(self, parent_id: str, study_name: str, uid: str, trial_number: int, params: dict[str, Any],
                    attempt: int) -> str:
        """A RUNNING run for one attempt at a trial; ``params`` is what identifies the trial."""
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"trial-{trial_number}",
            tags={
                "mlflow.parentRunId": parent_id,
                STUDY_TAG: study_name,
                UID_TAG: uid,
                TRIAL_TAG: str(trial_number),
                ROLE_TAG: "trial",
                STATUS_TAG: "running",
                "attempt": str(attempt),
            },
        )
        self._log_params(run.info.run_id, params)
        return run.info.run_id

    @_store_call
    def trial_metrics(self, uid: str, trial_number: int) -> dict[str, float]:
        """The metrics of a trial's FINISHED run ({} when it has none)."""
        runs = self.client.search_runs(
            [self.experiment_id],
            f"tags.{UID_TAG} = '{uid}' and tags.{ROLE_TAG} = 'trial' and tags.{TRIAL_TAG} = '{trial_number}'"
            " and attributes.status = 'FINISHED'",
            max_results=1,
        )
        return dict(runs[0].data.metrics) if runs else {}

    @_store_call
    def log_remeasure(self, parent_id: str, study_name: str, uid: str, trial_number: int, params: dict[str, Any],
                      metrics: dict[str, float], round_id: int) -> str:
        """A FINISHED run for one setting's final re-measurement (role ``remeasure``, under the parent)."""
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"remeasure-trial-{trial_number}",
            tags={
                "mlflow.parentRunId": parent_id,
                STUDY_TAG: study_name,
                UID_TAG: uid,
                TRIAL_TAG: str(trial_number),
                ROLE_TAG: "remeasure",
                ROUND_TAG: str(round_id),
            },
        )
        run_id = run.info.run_id
        self._log_params(run_id, params)
        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items() if _number(v)])
        self.client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
        return run_id

    @_store_call
    def remeasured(self, uid: str, round_id: int) -> dict[int, dict[str, float]]:
        """Trial number -> metrics of one round of the final re-measurement of study ``uid``."""
        runs = self.client.search_runs(
            [self.experiment_id],
            f"tags.{UID_TAG} = '{uid}' and tags.{ROLE_TAG} = 'remeasure' and tags.{ROUND_TAG} = '{round_id}'",
            max_results=1000,
        )
        return {int(r.data.tags[TRIAL_TAG]): dict(r.data.metrics) for r in runs}

    @_store_call
    def parent_tags(self, run_id: str) -> dict[str, str]:
        return dict(self.client.get_run(run_id).data.tags)

    @_store_call
    def children(self, uid: str, status: str | None = None) -> list:
        query = f"tags.{UID_TAG} = '{uid}' and tags.{ROLE_TAG} = 'trial'"
        if status:
            query += f" and attributes.status = '{status}'"
        return self.client.search_runs([self.experiment_id], query, max_results=50_000)

    @_store_call
    def kill(self, run_id: str, reason: str) -> bool:
        if self.status(run_id) != "RUNNING":  # closed by someone else: not ours to write
            return False
        self.client.set_tag(run_id, STATUS_TAG, "killed")
        self.client.set_tag(run_id, "killed_reason", reason)
        self.client.set_terminated(run_id, "KILLED")
        return True

    @_store_call
    def unfinish(self, run_id: str, reason: str) -> None:
        """A run this driver just FINISHED whose trial turned out to be closed by someone else: KILLED."""
        self.client.set_tag(run_id, STATUS_TAG, "killed")
        self.client.set_tag(run_id, "killed_reason", reason)
        self.client.set_terminated(run_id, "KILLED")

    @_store_call
    def fail(self, run_id: str, error: str) -> bool:
        if self.status(run_id) != "RUNNING":
            return False
        self.client.set_tag(run_id, STATUS_TAG, "error")
        self.client.log_text(run_id, error, "error.txt")
        self.client.set_terminated(run_id, "FAILED")
        return True

    @_store_call
    def finish_child(self, run_id: str, result: TrialResult, started_ms: int) -> bool:
        """Metrics, memory trace (step metrics + CSV + PNG), histogram and the result's JSON; FINISHED.

        False, writing nothing, when the run is no longer RUNNING (closed by someone else)."""
        if self.status(run_id) != "RUNNING":
            return False
        metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float)) and v is not None}
        now = int(time.time() * 1000)
        entries = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
        trace = result.memory_trace
        entries += _trace_metrics(trace, started_ms)
        histogram = {int(length): int(count) for length, count in result.acceptance_histogram.items()}
        for length, count in histogram.items():  # the chart: rounds against committed length
            entries.append(Metric(ACCEPTANCE_STEP_METRIC, float(count), now, length))
        # The table shows a step metric's last value only, so the histogram also gets scalar columns.
        entries += [Metric(k, float(v), now, 0) for k, v in acceptance_columns(histogram).items()]
        tags = [RunTag(STATUS_TAG, result.status.value), RunTag(MEMORY_KIND_TAG, trace.kind)]
        if "baseline_tokens_per_s" in metrics:  # how the speedup's AR figure was measured
            tags.append(RunTag(BASELINE_TAG, BASELINE_HOW))
        if result.warnings:
            tags.append(RunTag(WARNINGS_TAG, " | ".join(result.warnings)[:5000]))
        for start in range(0, max(len(entries), 1), BATCH):
            self.client.log_batch(run_id, metrics=entries[start : start + BATCH], tags=tags if start == 0 else [])
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            _write_trace_csv(trace, folder / "memory_trace.csv")
            _plot_trace(trace, folder / "memory_trace.png")
            payload = result.to_json()  # the same shape as `python -m tools.bench --json`
            (folder / "acceptance_histogram.json").write_text(json.dumps(payload["acceptance_histogram"]))
            (folder / "result.json").write_text(json.dumps(payload))
            self.client.log_artifacts(run_id, str(folder))
        self.client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
        return True


def _param_text(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list, tuple)) else str(value)
    return text[:6000]  # MLflow's limit on a param value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _trace_metrics(trace: MemoryTrace, started_ms: int) -> list[Metric]:
    """One step metric per sample and device: gpu{d}_allocated_gib, gpu{d}_reserved_gib, gpu{d}_nvml_used_gib;
    on a CPU actor (trace kind process_rss) one: cpu_rss_gib."""
    entries = []
    steps: dict[int, int] = {}
    for sample in trace.samples:
        step = steps.get(sample.device, 0)
        steps[sample.device] = step + 1
        stamp = started_ms + int(sample.t_s * 1000)
        if trace.kind == KIND_RSS:
            entries.append(Metric("cpu_rss_gib", sample.reserved_bytes / 2**30, stamp, step))
            continue
        entries.append(Metric(f"gpu{sample.device}_allocated_gib", sample.allocated_bytes / 2**30, stamp, step))
        entries.append(Metric(f"gpu{sample.device}_reserved_gib", sample.reserved_bytes / 2**30, stamp, step))
        if sample.nvml_used_bytes is not None:
            entries.append(Metric(f"gpu{sample.device}_nvml_used_gib", sample.nvml_used_bytes / 2**30, stamp, step))
    return entries


def _write_trace_csv(trace: MemoryTrace, path: Path) -> None:
    rows = trace.to_rows()
    fields = ["t_s", "device", "allocated_bytes", "reserved_bytes", "nvml_used_bytes"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in fields})


def _plot_trace(trace: MemoryTrace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    if trace.kind == KIND_RSS:
        ax.plot([s.t_s for s in trace.samples], [s.reserved_bytes / 2**30 for s in trace.samples], label="process RSS")
        ax.set_title("process memory (resident set size) during the trial")
    for device in trace.devices if trace.kind != KIND_RSS else ():
        points = [s for s in trace.samples if s.device == device]
        ax.plot([s.t_s for s in points], [s.reserved_bytes / 2**30 for s in points], label=f"gpu{device} reserved")
        ax.plot([s.t_s for s in points], [s.allocated_bytes / 2**30 for s in points], "--",
                label=f"gpu{device} allocated")
    if not trace.devices:
        ax.text(0.5, 0.5, trace.note or "no GPU samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds into the trial")
    ax.set_ylabel("GiB")
    if trace.kind != KIND_RSS:
        ax.set_title("GPU memory during the trial (CUDA caching allocator)")
    if trace.devices:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def sweep_params(config) -> dict[str, Any]:
    """The resolved sweep as flat parent-run params (filterable in the runs table).

    ``n_trials`` is left out on purpose: extending a finished study is a normal resume, and a param
    cannot change value; it is a tag instead (``n_trials``), set by the driver.
    """
    prompts, gen, workers = config.prompts, config.generation, config.workers
    device = workers.device if workers.device != "auto" else ("cuda" if workers.gpus_per_worker > 0 else "cpu")
    return {
        "method": config.method,
        "target": config.target.model,
        "dtype": config.target.dtype,
        "attn_implementation": config.target.attn_implementation,
        "drafter": config.drafter.model if config.drafter else None,
        "prompts_path": prompts.path,
        "prompts_dataset": prompts.dataset,
        "prompts_split": prompts.split,
        "prompts_limit": prompts.limit,
        "prompts_seed": prompts.seed,
        "max_new_tokens": prompts.max_new_tokens,
        "chat_template": prompts.chat_template,
        "enable_thinking": prompts.enable_thinking,
        "temperature": gen.temperature,
        "generation_seed": gen.seed,
        "stop_token_ids": gen.stop_token_ids,
        "device": device,
        "workers": workers.count,
        "gpus_per_worker": workers.gpus_per_worker,
        "parallel": workers.parallel,  # layers | tensor
        "tp_ranks": workers.world_size,  # processes per worker (1 for a layer split); the key runs have recorded
        "max_memory_per_gpu": workers.max_memory_per_gpu,
        "cuda_graphs": workers.cuda_graphs,
        "sampler": config.sampler.type,
        "sampler_seed": config.sampler.seed,
        "objectives": [f"{o.direction} {o.metric}" for o in config.objectives],
        "constraints": {k: v.model_dump(exclude_none=True) for k, v in config.constraints.items()},
        "search_space": config.defining_summary()["search_space"],
        "fixed_params": config.defining_summary()["fixed_params"],
        "baselines": [b.model_dump() for b in config.baselines] or None,
        "repeats": config.measurement.repeats,
        "final_top_k": config.measurement.final_top_k,
        "final_repeats": config.measurement.final_repeats,
        "storage": _safe_url(config.storage),
    }


def environment_params(actor_infos: list[dict[str, Any]]) -> dict[str, Any]:
    """``env.*`` params: package versions, the project's git commit, and the actors' devices and hosts."""
    import platform
    import subprocess
    from importlib import metadata

    env: dict[str, Any] = {"env.python": platform.python_version()}
    for package in ("torch", "transformers", "ray", "optuna", "mlflow", "pydantic", "safetensors"):
        try:
            env[f"env.{package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[f"env.{package}"] = "not installed"
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        env["env.git_commit"] = commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):  # not a checkout (an installed wheel): say so
        env["env.git_commit"] = "unknown"
    devices = sorted({name for info in actor_infos for name in info.get("devices") or []})
    env["env.devices"] = ", ".join(devices) or "unknown"
    env["env.hosts"] = (", ".join(sorted({str(info.get("host")) for info in actor_infos if info.get("host")}))
                        or "unknown")
    return env


def _safe_url(url: str) -> str:
    from orchestrator.study import hide_password

    return url if url.startswith("sqlite:") else hide_password(url)
