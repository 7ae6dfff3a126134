"""The report CLI and the analysis notebook (executed headless) on a real finished sweep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

from tests.orchestrator.conftest import ROOT, run_sweep, sweep_dict, sweep_env, write_sweep

pytestmark = pytest.mark.sweep


@pytest.fixture(scope="module")
def finished_sweep(tiny_dir, tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("report")
    runs = folder / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=4,
                        objectives=[{"metric": "tokens_per_s", "direction": "maximize"},
                                    {"metric": "tau", "direction": "maximize"}])
    sweep = write_sweep(folder / "sweep.yaml", config)
    proc = run_sweep(sweep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep, runs


def test_report_cli_writes_table_and_plots(finished_sweep, tmp_path):
    sweep, _ = finished_sweep
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "orchestrator.report", str(sweep), "--out", str(out)],
                          capture_output=True, text=True, env=sweep_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Pareto front" in proc.stdout and "tree_budget" in proc.stdout
    trials = pd.read_csv(out / "trials.csv")
    assert len(trials) == 4 and {"tokens_per_s", "tau", "peak_memory_gib", "tree_budget"} <= set(trials.columns)
    for name in ("tokens_per_s_vs_budget.png", "tau_vs_budget.png", "peak_memory_vs_budget.png", "pareto_front.png",
                 "optuna_param_importances.png", "optuna_parallel_coordinate.png"):
        assert (out / name).stat().st_size > 1000, name
    assert "baseline: AR" in proc.stdout
    assert proc.stdout.count("against AR at") == proc.stdout.count("Pareto front: trial")  # AR beside each best


def test_report_before_any_sweep_is_a_clear_error(tiny_dir, tmp_path):
    sweep = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, tmp_path / "runs"))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.report", str(sweep)], capture_output=True, text=True,
                          env=sweep_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "run the sweep first" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_notebook_runs_headless_and_leaves_the_report_folder_alone(finished_sweep, tmp_path):
    """Run from a folder of its own (as from a fresh checkout's root) with the default figure folder:
    the figures land in notebooks/figures/<study>, and reports/ (the report's folder) is not touched."""
    _, runs = finished_sweep
    notebook = nbformat.read(ROOT / "notebooks" / "sweep_analysis.ipynb", as_version=4)
    env = {
        "SWEEP_TRACKING_URI": f"sqlite:///{runs}/mlflow.db",
        "SWEEP_STORAGE": f"sqlite:///{runs}/optuna.db",
        "SWEEP_EXPERIMENT": "test",
        "SWEEP_STUDY": "test-sweep",
        "SWEEP_OBJECTIVES": "tokens_per_s:maximize,tau:maximize",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(notebook, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    text = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []))
    assert "4 finished trials in study test-sweep" in text
    images = [o for c in notebook.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 6
    figures = tmp_path / "notebooks" / "figures" / "test-sweep"
    assert {"tokens_per_s_vs_budget.png", "optuna_param_importances.png"} <= {p.name for p in figures.iterdir()}
    assert not (tmp_path / "reports").exists()
