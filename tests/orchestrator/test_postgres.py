"""Optuna storage on a real PostgreSQL server (started by the test on 127.0.0.1), resumed once."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.orchestrator.conftest import run_sweep, sweep_dict, write_sweep

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
    url = f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
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
    study = optuna.load_study(study_name="test-sweep", storage=postgres_url)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert not (runs / "optuna.db").exists()
