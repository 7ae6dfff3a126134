"""End-to-end sweeps in real subprocesses: completion, SIGKILL and SIGINT then resume, injected OOM,
an actor that dies mid-trial. Every check reads the real SQLite stores back (Optuna and MLflow)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from orchestrator.study import read_only_storage
from tests.orchestrator.conftest import run_sweep, start_sweep, sweep_dict, write_sweep

pytestmark = pytest.mark.sweep

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _stores(runs: Path):
    storage = f"sqlite:///{runs}/optuna.db"
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    return storage, client


def _children(client: MlflowClient, study: str = "test-sweep"):
    experiment = client.get_experiment_by_name("test")
    return client.search_runs([experiment.experiment_id], f"tags.sweep_study = '{study}' and tags.sweep_role = 'trial'",
                              max_results=1000)


def _parents(client: MlflowClient):
    experiment = client.get_experiment_by_name("test")
    return client.search_runs([experiment.experiment_id], "tags.sweep_role = 'parent'", max_results=100)


def assert_consistent(runs: Path, n_trials: int, study_name: str = "test-sweep") -> optuna.Study:
    """The invariants a finished sweep must hold, however often it was interrupted."""
    storage, client = _stores(runs)
    study = optuna.load_study(study_name=study_name, storage=storage)
    states = Counter(t.state for t in study.trials)
    assert states[TrialState.COMPLETE] == n_trials, states
    assert states[TrialState.RUNNING] == 0 and states[TrialState.WAITING] == 0, states
    children = _children(client, study_name)
    finished = Counter(r.data.tags["optuna_trial"] for r in children if r.info.status == "FINISHED")
    complete = {str(t.number) for t in study.trials if t.state == TrialState.COMPLETE}
    assert set(finished) == complete, (finished, complete)  # one FINISHED child per COMPLETE trial ...
    assert all(count == 1 for count in finished.values()), finished  # ... and only one
    assert all(r.info.status in ("FINISHED", "KILLED", "FAILED") for r in children)  # nothing left RUNNING
    parents = _parents(client)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert all(r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for r in children)
    return study


def test_sweep_completes_and_logs_everything(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    sweep = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, runs, n_trials=3))
    proc = run_sweep(sweep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = assert_consistent(runs, 3)
    _, client = _stores(runs)
    run = next(r for r in _children(client) if r.info.status == "FINISHED")
    for metric in ("tokens_per_s", "tau", "speedup", "ttft_s", "tpot_s", "lossless_match", "peak_memory_gib"):
        assert metric in run.data.metrics, metric
    assert run.data.metrics["lossless_match"] == 1.0
    assert {"trial", "method", "tree_budget", "max_depth", "branching", "repeats"} <= set(run.data.params)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"memory_trace.csv", "memory_trace.png", "acceptance_histogram.json", "result.json"} <= artifacts
    parent = _parents(client)[0]
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"config", "summary.json"}
    assert any(k.startswith("best.") for k in parent.data.tags)

    again = run_sweep(sweep)  # the same command once more: nothing left to do, nothing duplicated
    assert again.returncode == 0, again.stderr[-3000:]
    assert (len(optuna.load_study(study_name="test-sweep", storage=f"sqlite:///{runs}/optuna.db").trials)
            == len(study.trials))
    assert_consistent(runs, 3)


def _wait_for_complete(runs: Path, count: int, proc, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return
        try:  # read-only: a plain storage would create the tables, racing the driver doing the same
            storage = read_only_storage(f"sqlite:///{runs}/optuna.db")
            study = optuna.load_study(study_name="test-sweep", storage=storage) if storage else None
            if study is not None and len([t for t in study.trials if t.state == TrialState.COMPLETE]) >= count:
                return
        except Exception:  # the study does not exist yet
            pass
        time.sleep(0.3)
    raise AssertionError("the sweep made no progress")


def test_sigkill_at_random_points_then_resume(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    sweep = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, runs, n_trials=6))
    rng = random.Random(1234)
    kills = 0
    for attempt in range(12):
        proc = start_sweep(sweep)
        if attempt < 4:  # kill at a random moment: during start-up, mid-trial, between trials
            _wait_for_complete(runs, rng.randint(0, 3 + attempt), proc)
            time.sleep(rng.uniform(0.0, 2.0))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        _, err = proc.communicate(timeout=600)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
    assert proc.returncode == 0 and kills >= 2
    study = assert_consistent(runs, 6)
    _, client = _stores(runs)
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    retried = {t.user_attrs.get("retry_of") for t in study.trials if "retry_of" in t.user_attrs}
    assert {t.number for t in failed} <= retried  # every interrupted trial was queued again
    killed = [r for r in _children(client) if r.info.status == "KILLED"]
    assert len(killed) == len({r.data.tags["optuna_trial"] for r in killed})


def test_sigint_stops_cleanly_then_resumes(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=4)
    config["prompts"]["max_new_tokens"] = 32  # trials long enough to be caught mid-flight
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    proc = start_sweep(sweep)
    _wait_for_complete(runs, 1, proc)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    storage, client = _stores(runs)
    study = optuna.load_study(study_name="test-sweep", storage=storage)
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    assert all(r.info.status != "RUNNING" for r in _children(client))
    assert _parents(client)[0].info.status == "KILLED"

    proc = run_sweep(sweep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_consistent(runs, 4)


def _seed_study(tiny_dir: Path, tmp_path: Path, **overrides) -> tuple[Path, Path]:
    """Run a 1-trial sweep so the study exists, then return (sweep file for more trials, runs)."""
    runs = tmp_path / "runs"
    first = write_sweep(tmp_path / "first.yaml", sweep_dict(tiny_dir, runs, n_trials=1))
    assert run_sweep(first).returncode == 0
    sweep = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, runs, **overrides))
    return sweep, runs


def test_injected_oom_is_infeasible_and_the_sweep_goes_on(tiny_dir, tmp_path):
    sweep, runs = _seed_study(tiny_dir, tmp_path, n_trials=3)
    storage, client = _stores(runs)
    study = optuna.load_study(study_name="test-sweep", storage=storage)
    study.enqueue_trial({"tree_budget": 8, "max_depth": 3, "branching": 2}, user_attrs={"fault": "oom"})
    proc = run_sweep(sweep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = assert_consistent(runs, 3)
    oom = [t for t in study.trials if t.user_attrs.get("fault") == "oom"]
    assert len(oom) == 1 and oom[0].state == TrialState.COMPLETE
    assert oom[0].user_attrs["feasible"] is False and oom[0].user_attrs["status"] == "oom"
    assert oom[0].values == [0.0]  # worst value for a maximised objective
    assert oom[0].system_attrs["constraints:oom"] > 0
    run = next(r for r in _children(client) if r.data.tags["optuna_trial"] == str(oom[0].number))
    assert run.info.status == "FINISHED" and run.data.tags["trial_status"] == "oom"
    assert "peak_memory_gib" in run.data.metrics


def test_actor_that_dies_mid_trial_is_restarted_and_the_trial_rerun(tiny_dir, tmp_path):
    sweep, runs = _seed_study(tiny_dir, tmp_path, n_trials=3)
    storage, client = _stores(runs)
    study = optuna.load_study(study_name="test-sweep", storage=storage)
    study.enqueue_trial({"tree_budget": 4, "max_depth": 2, "branching": 1}, user_attrs={"fault": "crash"})
    proc = run_sweep(sweep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "died" in proc.stderr
    study = assert_consistent(runs, 3)
    crashed = next(t for t in study.trials if t.user_attrs.get("fault") == "crash")
    assert crashed.state == TrialState.COMPLETE  # re-run once on the restarted actor
    attempts = {r.data.tags["attempt"]: r.info.status for r in _children(client)
                if r.data.tags["optuna_trial"] == str(crashed.number)}
    assert attempts == {"1": "KILLED", "2": "FINISHED"}


def test_changed_definition_is_refused_unless_new_study(tiny_dir, tmp_path):
    sweep, runs = _seed_study(tiny_dir, tmp_path, n_trials=1)
    changed = sweep_dict(tiny_dir, runs, n_trials=1)
    changed["search_space"]["tree_budget"]["high"] = 16
    path = write_sweep(tmp_path / "changed.yaml", changed)
    refused = run_sweep(path)
    assert refused.returncode == 2 and "different definition" in refused.stderr
    assert "--new-study" in refused.stderr
    fresh = run_sweep(path, "--new-study")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    names = {s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{runs}/optuna.db")}
    assert names == {"test-sweep", "test-sweep@2"}
    again = run_sweep(path)  # the same changed file now resumes test-sweep@2 without the flag
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.parametrize("sampler", ["grid"])
def test_grid_runs_every_point_once(tiny_dir, tmp_path, sampler):
    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=100, sampler={"type": sampler})
    config["search_space"] = {"tree_budget": {"type": "categorical", "choices": [2, 8]},
                              "branching": {"type": "categorical", "choices": [1, None]}}
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    proc = run_sweep(sweep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = assert_consistent(runs, 4)
    points = sorted((t.params["tree_budget"], str(t.params["branching"])) for t in study.trials)
    assert points == sorted([(2, "1"), (2, "None"), (8, "1"), (8, "None")])


@pytest.mark.parametrize(
    ("config_json", "message"),
    [
        ('{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}', "'mamba' is not supported"),
        # a supported (hybrid) architecture whose folder has no weights: named, not a traceback
        ('{"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}', "cannot load the target weights"),
    ],
    ids=["unsupported-architecture", "no-weights"],
)
def test_target_the_engine_refuses_exits_2_and_creates_nothing(tiny_dir, tmp_path, config_json, message):
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text(config_json)
    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=1)
    config["target"] = {"model": str(folder), "dtype": "float32"}
    proc = run_sweep(write_sweep(tmp_path / "sweep.yaml", config))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and str(folder) in proc.stderr and "Traceback" not in proc.stderr
    assert not runs.exists()


def test_two_objectives_nsga2_with_a_memory_constraint(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=3, sampler={"type": "nsga2", "seed": 1},
                        objectives=[{"metric": "tokens_per_s", "direction": "maximize"},
                                    {"metric": "tau", "direction": "maximize"}],
                        constraints={"peak_memory_gib": {"max": 40}})
    proc = run_sweep(write_sweep(tmp_path / "sweep.yaml", config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = assert_consistent(runs, 3)
    assert all(len(t.values) == 2 and t.user_attrs["feasible"] for t in study.trials)
    assert all(t.system_attrs["constraints:peak_memory_gib"] <= 0 for t in study.trials)  # CPU: peak 0 GiB
    _, client = _stores(runs)
    parent = _parents(client)[0]
    summary = client.download_artifacts(parent.info.run_id, "summary.json", str(tmp_path))
    import json

    front = json.loads(Path(summary).read_text())["pareto_front"]
    assert front and all({"trial", "params", "values"} <= set(point) for point in front)
