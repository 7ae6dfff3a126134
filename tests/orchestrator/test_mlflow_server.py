"""A sweep logging to a real ``mlflow server`` on 127.0.0.1, read back through its REST API."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.orchestrator.conftest import run_sweep, sweep_dict, write_sweep

pytestmark = pytest.mark.sweep


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _call(base: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"},
                                     method="POST" if body is not None else "GET")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow_bin) if mlflow_bin.exists() else shutil.which("mlflow"), "server",
               "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
               "--artifacts-destination", str(tmp_path / "artifacts"),
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(base + "/health", timeout=2).read()
            break
        except OSError:
            if server.poll() is not None:
                raise AssertionError(f"mlflow server exited: {server.stderr.read()[-2000:]}")
            time.sleep(0.5)
    else:
        server.kill()
        raise AssertionError("mlflow server did not come up")
    yield base
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def test_sweep_logs_to_a_tracking_server(tiny_dir, tmp_path, mlflow_server):
    config = sweep_dict(tiny_dir, tmp_path / "runs", n_trials=2)
    config["mlflow"] = {"tracking_uri": mlflow_server, "experiment": "served"}
    proc = run_sweep(write_sweep(tmp_path / "sweep.yaml", config))
    assert proc.returncode == 0, proc.stderr[-3000:]

    experiment = _call(mlflow_server, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=served")["experiment"]
    found = _call(mlflow_server, "/api/2.0/mlflow/runs/search",
                  {"experiment_ids": [experiment["experiment_id"]], "max_results": 100})["runs"]
    tags = [{t["key"]: t["value"] for t in run["data"].get("tags", [])} for run in found]
    parents = [run for run, tag in zip(found, tags) if tag.get("sweep_role") == "parent"]
    children = [(run, tag) for run, tag in zip(found, tags) if tag.get("sweep_role") == "trial"]
    assert len(parents) == 1 and parents[0]["info"]["status"] == "FINISHED"
    assert len(children) == 2
    for run, tag in children:
        assert run["info"]["status"] == "FINISHED"
        assert tag["mlflow.parentRunId"] == parents[0]["info"]["run_id"]
        metrics = {m["key"] for m in run["data"]["metrics"]}
        assert {"tokens_per_s", "tau", "peak_memory_gib", "lossless_match"} <= metrics
        listed = _call(mlflow_server, f"/api/2.0/mlflow/artifacts/list?run_id={run['info']['run_id']}")
        assert {"memory_trace.csv", "memory_trace.png", "result.json"} <= {f["path"] for f in listed.get("files", [])}
