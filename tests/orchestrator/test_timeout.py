"""A hung trial does not hang the sweep: past ``trial_timeout_s`` its actor is replaced and the trial
run once more (a real sweep in a subprocess; the actor frozen with SIGSTOP mid-trial)."""

from __future__ import annotations

import os
import signal

import pytest
from mlflow.tracking import MlflowClient

from tests.orchestrator.conftest import start_sweep, sweep_dict, write_sweep
from tests.orchestrator.test_resume import assert_consistent
from tests.orchestrator.test_tp_group import _complete, _session_processes, _wait

pytestmark = pytest.mark.sweep


def test_a_frozen_actor_is_replaced_and_its_trial_run_again(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    # trials long enough, and enough of them after the first, to be caught mid-flight by a /proc scan
    # on a loaded 2-core machine (3 trials of 32 tokens once all finished in 3 s, before the scan saw one)
    config = sweep_dict(tiny_dir, runs, n_trials=5, trial_timeout_s=30, measurement={"final_top_k": 0})
    config["prompts"]["max_new_tokens"] = 96
    proc = start_sweep(write_sweep(tmp_path / "sweep.yaml", config))
    _wait(lambda: _complete(runs) >= 1, proc, what="a first complete trial")
    [actor] = _wait(lambda: _session_processes(proc.pid, "ray::GenerationActor.run_trial"), proc,
                    what="the actor in a trial")
    os.kill(actor, signal.SIGSTOP)  # hung: alive, answering nothing
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "(trial_timeout_s); its actor is stopped and replaced" in err
    assert_consistent(runs, 5)
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    experiment = client.get_experiment_by_name("test")
    children = client.search_runs([experiment.experiment_id], "tags.sweep_role = 'trial'", max_results=100)
    stopped = [r for r in children if r.info.status == "KILLED"]
    assert len(stopped) == 1 and "trial_timeout_s" in stopped[0].data.tags["killed_reason"]
    rerun = [r for r in children if r.data.tags["optuna_trial"] == stopped[0].data.tags["optuna_trial"]
             and r.info.status == "FINISHED"]
    assert rerun and rerun[0].data.tags["attempt"] == "2"
