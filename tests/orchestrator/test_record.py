"""The record a finished sweep leaves, read back through MlflowClient and Optuna: the experiment's
kind, parent params and metrics, what identifies each child run, the acceptance and memory
columns, the final interleaved re-measurement, Optuna's metric names and run links, the progress
lines; then the report on the same sweep (units, AR line, Optuna's plots, re-measured best)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from tests.orchestrator.conftest import ROOT, run_sweep, sweep_dict, sweep_env, write_sweep

pytestmark = pytest.mark.sweep  # one recorded sweep in a subprocess, read back

optuna.logging.set_verbosity(optuna.logging.WARNING)
N_TRIALS, TOP_K, PASSES = 4, 2, 2


@pytest.fixture(scope="module")
def recorded(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("record")
    runs = folder / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=N_TRIALS,
                        measurement={"repeats": 2, "final_top_k": TOP_K, "final_repeats": PASSES})
    sweep = write_sweep(folder / "sweep.yaml", config)
    proc = run_sweep(sweep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    experiment = client.get_experiment_by_name("test")
    return {"sweep": sweep, "runs": runs, "proc": proc, "client": client, "experiment": experiment}


def _runs(client, experiment, role):
    return client.search_runs([experiment.experiment_id], f"tags.sweep_role = '{role}'", max_results=1000)


def test_experiment_opens_as_model_development(recorded):
    assert recorded["experiment"].tags["mlflow.experimentKind"] == "custom_model_development"


def test_parent_run_has_the_resolved_sweep_environment_and_best_values(recorded, tiny_dir):
    client, experiment = recorded["client"], recorded["experiment"]
    (parent,) = _runs(client, experiment, "parent")
    params = parent.data.params
    assert params["method"] == "ddtree" and params["target"] == str(tiny_dir / "target")
    assert params["drafter"] == str(tiny_dir / "drafter") and params["prompts_path"] == str(tiny_dir / "prompts.jsonl")
    assert params["max_new_tokens"] == "8" and params["dtype"] == "float32" and params["device"] == "cpu"
    assert params["sampler"] == "random" and params["temperature"] == "0.0" and params["repeats"] == "2"
    assert json.loads(params["search_space"])["tree_budget"]["high"] == 32
    import torch

    assert params["env.torch"] == torch.__version__ and params["env.optuna"] == optuna.__version__
    assert len(params["env.git_commit"].split("-")[0]) == 40 and params["env.devices"].startswith("cpu")
    assert parent.data.tags["n_trials"] == str(N_TRIALS)
    metrics = parent.data.metrics
    assert {"best_tokens_per_s", "best_speedup", "best_tau", "search_best_tokens_per_s", "best_trial"} <= set(metrics)
    assert parent.data.tags["best_source"] == "re-measured"
    assert parent.data.tags["best_trial"] == str(int(metrics["best_trial"]))


def test_child_runs_carry_identity_and_meaningful_columns(recorded):
    client, experiment = recorded["client"], recorded["experiment"]
    children = [r for r in _runs(client, experiment, "trial") if r.info.status == "FINISHED"]
    assert len(children) == N_TRIALS
    for run in children:
        params = run.data.params
        assert params["trial"] == run.data.tags["optuna_trial"] and params["method"] == "ddtree"
        assert {"tree_budget", "max_depth", "branching"} <= set(params) and params["repeats"] == "2"
        m = run.data.metrics
        assert m["tokens_per_s_median"] > 0 and m["tokens_per_s_iqr"] >= 0 and m["baseline_tokens_per_s"] > 0
        # The acceptance histogram: the step metric is the chart, the scalar columns sum to one.
        histogram = json.loads(Path(client.download_artifacts(run.info.run_id,
                                                              "acceptance_histogram.json")).read_text())
        history = client.get_metric_history(run.info.run_id, "acceptance_rounds_by_length")
        assert {str(h.step): int(h.value) for h in history} == histogram
        shares = {k: v for k, v in m.items() if k.startswith("accept_share_len")}
        assert sum(shares.values()) == pytest.approx(1.0) and 1 <= m["accept_len_median"] <= 8
        rounds = sum(histogram.values())
        assert shares["accept_share_len1"] == pytest.approx(histogram.get("1", 0) / rounds)
        # CPU: the memory trace is the actor's RSS, named as such, and the peak is not zero.
        assert run.data.tags["memory_kind"] == "process_rss" and m["peak_memory_gib"] > 0.01
        rss = client.get_metric_history(run.info.run_id, "cpu_rss_gib")
        assert len(rss) >= 2 and max(h.value for h in rss) <= m["peak_memory_gib"] + 1e-9


def test_final_remeasurement_is_interleaved_and_names_the_winner(recorded):
    client, experiment = recorded["client"], recorded["experiment"]
    storage = f"sqlite:///{recorded['runs']}/optuna.db"
    study = optuna.load_study(study_name="test-sweep", storage=storage)
    remeasured = _runs(client, experiment, "remeasure")
    assert len(remeasured) == TOP_K
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    top = sorted(complete, key=lambda t: -t.values[0])[:TOP_K]
    assert {r.data.tags["optuna_trial"] for r in remeasured} == {str(t.number) for t in top}
    (parent,) = _runs(client, experiment, "parent")
    for run in remeasured:
        m = run.data.metrics
        assert m["passes"] == PASSES and m["tokens_per_s_min"] <= m["tokens_per_s"] <= m["tokens_per_s_max"]
        assert m["baseline_tokens_per_s"] > 0 and m["speedup"] > 0
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id and run.data.params["passes"] == str(PASSES)
    winner = max(remeasured, key=lambda r: r.data.metrics["tokens_per_s"])
    assert parent.data.metrics["best_tokens_per_s"] == pytest.approx(winner.data.metrics["tokens_per_s"])
    assert parent.data.tags["best_trial"] == winner.data.tags["optuna_trial"]
    for name in ("tree_budget", "max_depth", "branching"):  # the best.<param> tags name the same winner
        assert parent.data.tags[f"best.{name}"] == winner.data.params[name], name
    summary = json.loads(Path(client.download_artifacts(parent.info.run_id, "summary.json")).read_text())
    assert summary["best_trial"] == int(winner.data.tags["optuna_trial"]) and summary["best_source"] == "re-measured"
    assert f"re-measuring the best {TOP_K} settings" in recorded["proc"].stderr


def test_optuna_names_its_objectives_and_links_trials_to_runs(recorded):
    client, experiment = recorded["client"], recorded["experiment"]
    study = optuna.load_study(study_name="test-sweep", storage=f"sqlite:///{recorded['runs']}/optuna.db")
    assert study.metric_names == ["tokens_per_s"]
    finished = {r.data.tags["optuna_trial"]: r.info.run_id for r in _runs(client, experiment, "trial")
                if r.info.status == "FINISHED"}
    for trial in study.trials:
        if trial.state == TrialState.COMPLETE:
            assert trial.user_attrs["mlflow_run_id"] == finished[str(trial.number)]


def test_progress_lines_show_time_and_how_trials_ended(recorded):
    lines = [line for line in recorded["proc"].stderr.splitlines() if line.startswith(f"[{N_TRIALS}/{N_TRIALS}]")]
    assert lines, recorded["proc"].stderr[-2000:]
    last = lines[-1]
    assert f"complete {N_TRIALS} (infeasible 0), failed 0, killed 0" in last
    assert "elapsed 0:" in last and "left " in last


def test_running_a_finished_sweep_again_does_not_remeasure_again(recorded):
    again = run_sweep(recorded["sweep"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already re-measured" in again.stderr
    assert len(_runs(recorded["client"], recorded["experiment"], "remeasure")) == TOP_K


def test_report_uses_the_remeasurement_and_explains_the_baseline(recorded, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "orchestrator.report", str(recorded["sweep"]), "--out", str(out)],
                          capture_output=True, text=True, env=sweep_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # rich wraps long lines
    (parent,) = _runs(recorded["client"], recorded["experiment"], "parent")
    assert f"best (re-measured, {PASSES} passes interleaved with AR): trial {parent.data.tags['best_trial']}" in text
    assert "baseline: AR" in text and "on CPU" in text
    trials = pd.read_csv(out / "trials.csv")
    assert {"tokens_per_s_median", "tokens_per_s_iqr", "baseline_tokens_per_s"} <= set(trials.columns)
    assert len(pd.read_csv(out / "remeasured.csv")) == TOP_K
    for name in ("tokens_per_s_vs_budget.png", "tau_vs_budget.png", "peak_memory_vs_budget.png",
                 "optuna_param_importances.png", "optuna_parallel_coordinate.png"):
        assert (out / name).stat().st_size > 1000, name


def test_ctrl_c_during_the_remeasurement_stops_cleanly_and_resume_redoes_it(tiny_dir, tmp_path):
    """SIGINT while the top settings are re-measured: exit 130, the parent KILLED, no half-logged
    re-measurement; the same command again re-measures and finishes the parent."""
    import signal

    from tests.orchestrator.conftest import start_sweep

    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=2, measurement={"final_top_k": 1, "final_repeats": 40})
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    proc = start_sweep(sweep)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "re-measuring the best" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=300)
    assert proc.returncode == 130, "".join(seen) + rest
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    experiment = client.get_experiment_by_name("test")
    (parent,) = _runs(client, experiment, "parent")
    assert parent.info.status == "KILLED" and _runs(client, experiment, "remeasure") == []
    assert "final_state" not in parent.data.tags

    write_sweep(sweep, config | {"measurement": {"final_top_k": 1, "final_repeats": 2}})
    again = run_sweep(sweep)
    assert again.returncode == 0, again.stderr[-3000:]
    (parent,) = _runs(client, experiment, "parent")
    assert parent.info.status == "FINISHED" and parent.data.tags["best_source"] == "re-measured"
    (remeasured,) = _runs(client, experiment, "remeasure")
    assert remeasured.data.metrics["passes"] == 2 and remeasured.data.tags["final_round"] == "1"
