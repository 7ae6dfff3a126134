"""A real sweep on one GPU: writes a small random target + drafter, runs `orchestrator.sweep` with one
1-GPU actor, then prints what MLflow holds (memory-trace samples, peaks) and the report.

    python benchmarks/gpu_sweep.py [--trials 6]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from tools.tiny import TinyShape, write_prompts, write_tiny_pair

SHAPE = TinyShape(vocab_size=32000, hidden_size=1024, num_layers=12, num_heads=8, num_kv_heads=4,
                  intermediate_size=3072, drafter_layers=2, block_size=16, init_std=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=6)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    write_tiny_pair(folder, SHAPE)
    write_prompts(folder / "prompts.jsonl", SHAPE, count=4, length=256)
    runs = folder / "runs"
    sweep = {
        "name": "gpu-smoke", "method": "ddtree",
        "target": {"model": str(folder / "target"), "dtype": "bfloat16"},
        "drafter": {"model": str(folder / "drafter")},
        "workers": {"count": 1, "gpus_per_worker": 1, "max_memory_per_gpu": "40GiB"},
        "prompts": {"path": str(folder / "prompts.jsonl"), "limit": 4, "max_new_tokens": 96},
        "search_space": {"tree_budget": {"type": "int", "low": 16, "high": 1024, "log": True},
                         "max_depth": {"type": "int", "low": 4, "high": 15},
                         "branching": {"type": "categorical", "choices": [2, 8, None]}},
        "objectives": [{"metric": "tokens_per_s", "direction": "maximize"},
                       {"metric": "peak_memory_gib", "direction": "minimize"}],
        "constraints": {"peak_memory_gib": {"max": 30}},
        "sampler": {"type": "nsga2", "seed": 0}, "n_trials": args.trials,
        "storage": f"sqlite:///{runs}/optuna.db",
        "mlflow": {"tracking_uri": f"sqlite:///{runs}/mlflow.db", "experiment": "gpu"},
        "memory_trace": {"interval_ms": 20},
    }
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    code = subprocess.call([sys.executable, "-m", "orchestrator.sweep", str(path)])
    print(f"sweep exit status {code}")

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    experiment = client.get_experiment_by_name("gpu")
    for run in client.search_runs([experiment.experiment_id], "tags.sweep_role = 'trial'", max_results=50):
        samples = client.get_metric_history(run.info.run_id, "gpu0_reserved_gib")
        m = run.data.metrics
        print(f"{run.info.run_name:>9} {run.info.status:>8} {dict(run.data.params)} "
              f"tok/s={m.get('tokens_per_s', 0):.1f} "
              f"tau={m.get('tau', 0):.2f} peak={m.get('peak_memory_gib', 0):.2f}GiB trace_samples={len(samples)} "
              f"match={m.get('lossless_match')}")
    subprocess.call([sys.executable, "-m", "orchestrator.report", str(path), "--out", str(folder / "report")])


if __name__ == "__main__":
    main()
