"""SIGTERM and Ctrl-C at several moments of a sweep's start-up, in real subprocesses with real signals:
during the imports, inside ``ray.init``, while the actors load their models. Each ends with the clean
stop: exit 130, one line, no traceback, and stores a resume can go on from."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from tests.orchestrator.conftest import run_sweep, start_sweep, sweep_dict, write_sweep
from tests.orchestrator.test_resume import assert_consistent

pytestmark = pytest.mark.sweep  # whole sweeps in subprocesses, stopped by signals

optuna.logging.set_verbosity(optuna.logging.WARNING)


class Reader:
    """stderr of a running sweep, line by line, read on a thread so the test can wait for a marker."""

    def __init__(self, proc) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc) -> None:
        for line in proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, marker: str, proc, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while not any(marker in line for line in self.lines):
            assert proc.poll() is None, "\n".join(self.lines[-30:])
            assert time.time() < deadline, f"no {marker!r} in time"
            time.sleep(0.05)


# (moment, marker to wait for, delay after it, how the signal is sent)
MOMENTS = [
    ("imports", None, 0.4, "sigint-group"),
    ("ray-init", "starting Ray ...", 1.0, "sigterm-pid"),
    ("ray-init-early", "starting Ray ...", 0.1, "sigint-group"),
    ("actors-loading", "starting actors and loading models ...", 0.5, "sigterm-pid"),
]


@pytest.mark.parametrize(("moment", "marker", "delay", "how"), MOMENTS, ids=[m[0] for m in MOMENTS])
def test_a_signal_during_start_up_is_the_clean_stop(tiny_dir, tmp_path, moment, marker, delay, how):
    runs = tmp_path / "runs"
    sweep = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, runs, n_trials=2))
    proc = start_sweep(sweep)
    reader = Reader(proc)
    if marker is not None:
        reader.wait_for(marker, proc)
    time.sleep(delay)
    assert proc.poll() is None, "\n".join(reader.lines)
    if how == "sigint-group":
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
    else:
        proc.send_signal(signal.SIGTERM)  # `kill PID`
    proc.wait(timeout=300)
    reader.thread.join(timeout=30)
    err = "\n".join(reader.lines)
    assert proc.returncode == 130, err[-3000:]
    ours = [line for line in reader.lines if line.startswith("orchestrator.sweep:")]
    assert ours == ["orchestrator.sweep: interrupted during start-up; run the same command again to start"], err
    assert "Traceback" not in err and "SIGTERM received" not in err and "KeyboardInterrupt" not in err, err
    _assert_nothing_half_written(runs)
    if moment == "actors-loading":  # and the same command then runs the sweep as if nothing happened
        again = run_sweep(sweep)
        assert again.returncode == 0, again.stderr[-3000:]
        assert_consistent(runs, 2)


def _assert_nothing_half_written(runs: Path) -> None:
    """No study exists yet at these moments (it is created after the models load); no run either."""
    if (runs / "optuna.db").exists():
        assert optuna.get_all_study_summaries(f"sqlite:///{runs}/optuna.db") == []
    if (runs / "mlflow.db").exists():
        client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
        experiment = client.get_experiment_by_name("test")
        assert experiment is None or client.search_runs([experiment.experiment_id]) == []


def test_sigterm_mid_sweep_stops_cleanly_then_resumes(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=3)
    config["prompts"]["max_new_tokens"] = 32
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    proc = start_sweep(sweep)
    reader = Reader(proc)
    reader.wait_for("[1/3]", proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    reader.thread.join(timeout=30)
    err = "\n".join(reader.lines)
    assert proc.returncode == 130, err[-3000:]
    assert [line for line in reader.lines if line.startswith("orchestrator.sweep:")] == [
        "orchestrator.sweep: interrupted; run the same command again to resume"], err
    assert "Traceback" not in err
    study = optuna.load_study(study_name="test-sweep", storage=f"sqlite:///{runs}/optuna.db")
    assert TrialState.RUNNING not in [t.state for t in study.trials]
    again = run_sweep(sweep)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_consistent(runs, 3)
