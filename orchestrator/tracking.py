"""The MLflow side of a sweep: one parent run per study, one nested child run per trial.

Everything goes through ``MlflowClient`` with explicit run ids (no global active-run stack), and the
driver is the only writer. Runs are found again on resume by tags: the parent by ``sweep_study``,
children by ``sweep_study`` + ``optuna_trial``. Artifacts go next to a SQLite store (never into a
cwd-relative ``mlruns``).
"""

from __future__ import annotations

import csv
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient

from workers.errors import BadInputError
from workers.memory import MemoryTrace

STUDY_TAG = "sweep_study"
FINGERPRINT_TAG = "sweep_fingerprint"
TRIAL_TAG = "optuna_trial"
STATUS_TAG = "trial_status"
ROLE_TAG = "sweep_role"
BATCH = 1000  # MLflow's log_batch cap on metrics per call


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


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str) -> None:
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        self.experiment_id = self._experiment(experiment)

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None
        if self.tracking_uri.startswith("sqlite:///"):  # artifacts beside the database, absolute
            location = (Path(self.tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    # -- parent --------------------------------------------------------------------------------------
    def parent_run(self, study_name: str, fingerprint: str, config_path: Path, resolved: dict[str, Any]) -> str:
        """Reuse the study's parent run (RUNNING again) or create it with the config as an artifact."""
        runs = self.client.search_runs(
            [self.experiment_id], f"tags.{STUDY_TAG} = '{study_name}' and tags.{ROLE_TAG} = 'parent'", max_results=1
        )
        if runs:
            run_id = runs[0].info.run_id
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        run = self.client.create_run(
            self.experiment_id,
            run_name=study_name,
            tags={STUDY_TAG: study_name, FINGERPRINT_TAG: fingerprint, ROLE_TAG: "parent"},
        )
        run_id = run.info.run_id
        self.client.log_artifact(run_id, str(config_path), artifact_path="config")
        self.client.log_dict(run_id, resolved, "config/resolved.json")
        return run_id

    def log_costs(self, run_id: str, costs: dict[int, dict[str, Any]], infos: list[dict[str, Any]]) -> None:
        """Each actor's measured cost table as an artifact (re-measured, so overwritten, on resume)."""
        for index, table in costs.items():
            self.client.log_dict(run_id, table | {"actor": infos[index] if index < len(infos) else {}},
                                 f"costs/actor-{index}.json")
        tags = [RunTag(f"costs.actor{index}.device", table["device"]) for index, table in costs.items()]
        self.client.log_batch(run_id, tags=tags)

    def log_plan(self, run_id: str, plan: list[dict[str, Any]]) -> None:
        self.client.log_dict(run_id, {"plan": plan}, "predicted_plan.json")

    def log_step(self, run_id: str, key: str, value: float, step: int) -> None:
        self.client.log_batch(run_id, metrics=[Metric(key, value, int(time.time() * 1000), step)])

    def finish_pruned(self, run_id: str, result: dict[str, Any], started_ms: int, prompts_done: int) -> None:
        """A pruned trial: what it measured, tagged trial_status=pruned, FINISHED (so a resumed
        driver finds it and tells Optuna PRUNED again instead of re-running it)."""
        result = dict(result, status="pruned")
        self.client.set_tag(run_id, "pruned_after_prompts", str(prompts_done))
        self.finish_child(run_id, result, started_ms)

    def finish_parent(self, run_id: str, status: str, summary: dict[str, Any]) -> None:
        best = summary.get("best_params") or {}  # tags, not params: a resumed sweep may find a better one
        self.client.log_batch(run_id, tags=[RunTag(f"best.{k}", str(v)) for k, v in best.items()])
        self.client.log_dict(run_id, summary, "summary.json")
        self.client.set_terminated(run_id, status)

    # -- children ------------------------------------------------------------------------------------
    def start_child(self, parent_id: str, study_name: str, trial_number: int, params: dict[str, Any], attempt: int) -> str:
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"trial-{trial_number}",
            tags={
                "mlflow.parentRunId": parent_id,
                STUDY_TAG: study_name,
                TRIAL_TAG: str(trial_number),
                ROLE_TAG: "trial",
                STATUS_TAG: "running",
                "attempt": str(attempt),
            },
        )
        self.client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()])
        return run.info.run_id

    def children(self, study_name: str, status: str | None = None) -> list:
        query = f"tags.{STUDY_TAG} = '{study_name}' and tags.{ROLE_TAG} = 'trial'"
        if status:
            query += f" and attributes.status = '{status}'"
        return self.client.search_runs([self.experiment_id], query, max_results=50_000)

    def kill(self, run_id: str, reason: str) -> None:
        self.client.set_tag(run_id, STATUS_TAG, "killed")
        self.client.set_tag(run_id, "killed_reason", reason)
        self.client.set_terminated(run_id, "KILLED")

    def fail(self, run_id: str, error: str) -> None:
        self.client.set_tag(run_id, STATUS_TAG, "error")
        self.client.log_text(run_id, error, "error.txt")
        self.client.set_terminated(run_id, "FAILED")

    def finish_child(self, run_id: str, result: dict[str, Any], started_ms: int) -> None:
        """Metrics, memory trace (step metrics + CSV + PNG), histogram and the raw result; FINISHED."""
        metrics = {k: v for k, v in result["metrics"].items() if isinstance(v, (int, float)) and v is not None}
        now = int(time.time() * 1000)
        entries = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
        trace = MemoryTrace.from_dict(result["memory_trace"])
        entries += _trace_metrics(trace, started_ms)
        for length, count in result["acceptance_histogram"].items():
            entries.append(Metric("acceptance_hist", float(count), now, int(length)))
        tags = [RunTag(STATUS_TAG, result["status"])]
        for start in range(0, max(len(entries), 1), BATCH):
            self.client.log_batch(run_id, metrics=entries[start : start + BATCH], tags=tags if start == 0 else [])
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            _write_trace_csv(trace, folder / "memory_trace.csv")
            _plot_trace(trace, folder / "memory_trace.png")
            (folder / "acceptance_histogram.json").write_text(json.dumps(result["acceptance_histogram"]))
            (folder / "result.json").write_text(json.dumps({k: v for k, v in result.items() if k != "outputs"}))
            self.client.log_artifacts(run_id, str(folder))
        self.client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))


def _trace_metrics(trace: MemoryTrace, started_ms: int) -> list[Metric]:
    """One step metric per sample and device: gpu{d}_allocated_gib, gpu{d}_reserved_gib, gpu{d}_nvml_used_gib."""
    entries = []
    steps: dict[int, int] = {}
    for sample in trace.samples:
        step = steps.get(sample.device, 0)
        steps[sample.device] = step + 1
        stamp = started_ms + int(sample.t_s * 1000)
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
    for device in trace.devices:
        points = [s for s in trace.samples if s.device == device]
        ax.plot([s.t_s for s in points], [s.reserved_bytes / 2**30 for s in points], label=f"gpu{device} reserved")
        ax.plot([s.t_s for s in points], [s.allocated_bytes / 2**30 for s in points], "--", label=f"gpu{device} allocated")
    if not trace.devices:
        ax.text(0.5, 0.5, trace.note or "no GPU samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds into the trial")
    ax.set_ylabel("GiB")
    ax.set_title("GPU memory during the trial")
    if trace.devices:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
