"""Optuna storage on a real PostgreSQL server (started by the test on 127.0.0.1): a plain
``postgresql://`` URL (SQLAlchemy 2.1 reads it as psycopg 3; the driver picks the installed one),
a resume, and the advisory lock that refuses a second driver on the same study."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.orchestrator.conftest import run_sweep, start_sweep, sweep_dict, write_sweep

pytestmark = pytest.mark.sweep

INITDB = shutil.which("initdb") or "/usr/lib/postgresql/15/bin/initdb"
PG_CTL = shutil.which("pg_ctl") or "/usr/lib/postgresql/15/bin/pg_ctl"


def _as_server_user(command: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as the 'postgres' user when we are root."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *command]
    return command


@pytest.fixture
def postgres_url():
    if not Path(INITDB).exists():
        pytest.skip("no PostgreSQL server binaries on this machine (initdb)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    home = Path(tempfile.mkdtemp(prefix="pg"))  # not under pytest's private (0700, root) temp folder
    data = home / "data"
    data.mkdir()
    if os.geteuid() == 0:
        shutil.chown(home, "postgres")
        shutil.chown(data, "postgres")
    subprocess.run(_as_server_user([INITDB, "-D", str(data), "-A", "trust", "-U", "postgres"]),
                   check=True, capture_output=True)
    options = f"-p {port} -c listen_addresses=127.0.0.1 -k {data}"
    subprocess.run(_as_server_user([PG_CTL, "-D", str(data), "-o", options, "-l", str(data / "log"), "-w", "start"]),
                   check=True, capture_output=True)
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"  # as users write it: no driver named
    try:
        yield url
    finally:
        subprocess.run(_as_server_user([PG_CTL, "-D", str(data), "-m", "immediate", "stop"]), capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def test_sweep_on_postgresql_storage_resumes(tiny_dir, tmp_path, postgres_url):
    runs = tmp_path / "runs"
    first = write_sweep(tmp_path / "first.yaml", sweep_dict(tiny_dir, runs, n_trials=1, storage=postgres_url))
    proc = run_sweep(first)
    assert proc.returncode == 0, proc.stderr[-3000:]
    more = write_sweep(tmp_path / "more.yaml", sweep_dict(tiny_dir, runs, n_trials=2, storage=postgres_url))
    proc = run_sweep(more)  # the same study, resumed from PostgreSQL
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = optuna.load_study(study_name="test-sweep",
                              storage=postgres_url.replace("postgresql:", "postgresql+psycopg2:"))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert not (runs / "optuna.db").exists()


def test_a_second_driver_on_a_postgresql_study_is_refused(tiny_dir, tmp_path, postgres_url):
    from orchestrator.config import database_url

    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=5000, storage=postgres_url)  # still running when the second starts
    config["prompts"]["max_new_tokens"] = 32
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    first = start_sweep(sweep)
    storage = database_url(postgres_url)
    deadline = time.time() + 300
    while not optuna.get_all_study_summaries(storage) or not optuna.load_study(
            study_name="test-sweep", storage=storage).trials:  # it holds the lock and runs a trial
        assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
        time.sleep(0.3)
    second = run_sweep(sweep, timeout=120)
    assert second.returncode == 3, second.stderr[-3000:]
    [line] = [ln for ln in second.stderr.splitlines() if ln.startswith("orchestrator.sweep:")]
    assert "being run by another driver" in line and f"pid {first.pid} on " in line, line
    assert "postgres@127.0.0.1" in line and "Traceback" not in second.stderr
    assert first.poll() is None  # the refusal wrote nothing the first driver trips over
    os.killpg(first.pid, signal.SIGINT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 130, err[-3000:]
    states = {t.state for t in optuna.load_study(study_name="test-sweep", storage=storage).trials}
    assert TrialState.RUNNING not in states and TrialState.COMPLETE in states
