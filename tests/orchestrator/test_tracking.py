"""orchestrator.tracking against a real SQLite MLflow store, read back through MlflowClient: the
experiment's kind, parent params on create and on resume, re-measurement runs."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from orchestrator.config import SweepConfig
from orchestrator.tracking import (
    EXPERIMENT_KIND_TAG,
    MODEL_DEVELOPMENT,
    Tracker,
    environment_params,
    sweep_params,
)
from tests.orchestrator.conftest import sweep_dict


def test_an_existing_experiment_without_a_kind_gets_one(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    made = client.create_experiment("old", artifact_location=(tmp_path / "art").as_uri())
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(made).tags
    Tracker(uri, "old")
    assert client.get_experiment(made).tags[EXPERIMENT_KIND_TAG] == MODEL_DEVELOPMENT
    Tracker(uri, "new")
    assert client.get_experiment_by_name("new").tags[EXPERIMENT_KIND_TAG] == MODEL_DEVELOPMENT


def test_parent_params_on_create_and_on_resume(tiny_dir, tmp_path):
    config = SweepConfig.model_validate(sweep_dict(tiny_dir, tmp_path / "runs"))
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "test")
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text("name: x\n")
    env = environment_params([{"devices": ["cpu (x86_64, 2 cores)"], "host": "h1"}])
    params = sweep_params(config) | env
    assert "n_trials" not in params  # extending a study must not collide with a logged param
    run_id = tracker.parent_run("s", "uid-1", "sqlite:///x", 1, "fp", sweep_file, {}, params)
    logged = tracker.client.get_run(run_id).data.params
    assert logged["method"] == "ddtree" and logged["env.devices"] == "cpu (x86_64, 2 cores)"
    assert logged["env.hosts"] == "h1" and logged["stop_token_ids"] == "None"
    # Resume after a package upgrade and with a new key: the old value stays, the new one is a tag.
    changed = params | {"env.torch": "99.0", "extra": 1}
    again = tracker.parent_run("s", "uid-1", "sqlite:///x", 1, "fp", sweep_file, {}, changed)
    assert again == run_id
    data = tracker.client.get_run(run_id).data
    assert data.params["env.torch"] == logged["env.torch"] and data.tags["resumed.env.torch"] == "99.0"
    assert data.params["extra"] == "1"
    assert tracker.client.get_run(run_id).info.status == "RUNNING"


def test_remeasure_runs_hang_under_the_parent(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "test")
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text("name: x\n")
    parent = tracker.parent_run("s", "uid-1", "sqlite:///x", 1, "fp", sweep_file, {}, {})
    run_id = tracker.log_remeasure(parent, "s", "uid-1", 3, {"trial": 3, "tree_budget": 8},
                                   {"tokens_per_s": 10.0, "speedup": float("nan"), "passes": 2.0}, round_id=1)
    run = tracker.client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["sweep_role"] == "remeasure" and run.data.tags["final_round"] == "1"
    assert run.data.metrics == {"tokens_per_s": 10.0, "passes": 2.0}  # NaN is not logged
    assert tracker.children("uid-1") == []  # a re-measurement is not a trial run (resume never sees it)
    assert tracker.run_url(run_id) is None  # a local store has no UI address
