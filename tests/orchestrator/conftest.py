"""Fixtures for the orchestrator tests: tiny models on disk, sweep files, a shared local Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tools.tiny import TinyShape, write_prompts, write_tiny_pair

ROOT = Path(__file__).resolve().parents[2]
TINY = TinyShape()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """models: <dir>/target, <dir>/drafter (random, block 8), <dir>/prompts.jsonl (token ids)."""
    folder = tmp_path_factory.mktemp("orch_tiny")
    write_tiny_pair(folder, TINY)
    write_prompts(folder / "prompts.jsonl", TINY, count=4, length=8)
    return folder


def sweep_dict(tiny_dir: Path, runs: Path, **overrides) -> dict:
    """A small valid DDTree sweep on the tiny models; ``overrides`` replace top-level sections."""
    config = {
        "name": "test-sweep",
        "method": "ddtree",
        "target": {"model": str(tiny_dir / "target"), "dtype": "float32"},
        "drafter": {"model": str(tiny_dir / "drafter")},
        "workers": {"count": 1, "gpus_per_worker": 0},
        "prompts": {"path": str(tiny_dir / "prompts.jsonl"), "limit": 2, "max_new_tokens": 8},
        "generation": {"temperature": 0.0, "seed": 0},
        "search_space": {
            "tree_budget": {"type": "int", "low": 2, "high": 32, "log": True},
            "max_depth": {"type": "int", "low": 1, "high": 7},
            "branching": {"type": "categorical", "choices": [1, 2, 4, None]},
        },
        "objectives": [{"metric": "tokens_per_s", "direction": "maximize"}],
        "sampler": {"type": "random", "seed": 0},
        "n_trials": 4,
        "storage": f"sqlite:///{runs}/optuna.db",
        "mlflow": {"tracking_uri": f"sqlite:///{runs}/mlflow.db", "experiment": "test"},
        "ray": {"address": None, "num_cpus": 2},
        "memory_trace": {"interval_ms": 20},
    }
    config.update(overrides)
    return config


def write_sweep(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def sweep_env(offline: bool = True) -> dict[str, str]:
    """The environment of a sweep subprocess; ``offline``: HF_HUB_OFFLINE=1 (models from this machine only)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HF_HUB_OFFLINE")}
    offline_env = {"HF_HUB_OFFLINE": "1"} if offline else {}
    return env | {"TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"} | offline_env


def run_sweep(sweep: Path, *args: str, cwd: Path | None = None, timeout: float = 600,
              offline: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.sweep", str(sweep), *args],
        capture_output=True, text=True, env=sweep_env(offline), cwd=cwd or ROOT, timeout=timeout,
    )


def start_sweep(sweep: Path, *args: str, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.sweep", str(sweep), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=sweep_env(), cwd=cwd or ROOT,
        start_new_session=True,  # its own process group, as in a terminal: Ctrl-C reaches Ray's processes too
    )
