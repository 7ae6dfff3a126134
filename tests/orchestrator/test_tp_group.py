"""Tensor-parallel workers (orchestrator.tp_group) on a real Ray, on CPU: real actors with 0 GPUs,
real gloo process groups, the tiny float32 models.

Three sections: pure functions (no Ray); one local Ray where a TP=2 worker and a one-actor worker
run the same trials (same tokens, pruning in lockstep); whole sweeps in subprocesses (a rank killed
with SIGKILL mid-trial, an interruption and resume, a group the cluster cannot place).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import ray
import torch
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from orchestrator.config import SweepConfig
from orchestrator.pool import check_resources, release_pool, start_pool, worker_needs
from orchestrator.study import read_only_storage
from orchestrator.tp_group import merge_ranks
from tests.orchestrator.conftest import run_sweep, start_sweep, sweep_dict, write_sweep
from tests.orchestrator.test_pool import two_nodes  # noqa: F401 (a fixture)
from tests.orchestrator.test_resume import assert_consistent
from workers.decoding.methods import Method
from workers.decoding.params import ARParams, DFlashParams, TreeParams
from workers.errors import BadInputError
from workers.prompts import load_prompts
from workers.wire import KIND_RSS, MemorySample, MemoryTrace, PromptResult, TrialResult, TrialSpec, TrialStatus

pytestmark = pytest.mark.slow  # real Ray actors and process groups

GET_TIMEOUT = 180.0  # seconds for any single ray.get: actors load models on 2 shared cores
TP2 = {"count": 1, "gpus_per_worker": 0, "parallel": "tensor", "ranks": 2, "join_timeout_s": 60}


def tp_config(tiny_dir: Path, runs: Path, **workers) -> SweepConfig:
    return SweepConfig.model_validate(sweep_dict(tiny_dir, runs, workers=TP2 | workers))


# -- pure functions (no Ray needed) ------------------------------------------------------------------


def _result(status: TrialStatus, rss: int, tokens: list[int], error: str | None = None) -> TrialResult:
    trace = MemoryTrace(samples=(MemorySample(0.0, 0, rss, rss),), devices=(0,), peak_allocated_bytes={0: rss},
                        peak_reserved_bytes={0: rss}, kind=KIND_RSS)
    return TrialResult(status, Method.AR, {}, {"tokens_per_s": 1.0, "peak_memory_gib": rss / 2**30},
                       outputs=[PromptResult(tokens, [1] * len(tokens))], memory_trace=trace, error=error)


def test_merge_ranks_keeps_rank_0s_result_with_every_ranks_memory():
    merged = merge_ranks([_result(TrialStatus.OK, 2**30, [1, 2]), _result(TrialStatus.OK, 3 * 2**30, [1, 2])])
    assert merged.status is TrialStatus.OK and merged.error is None
    assert merged.metrics["peak_memory_gib_dev0"] == 1.0 and merged.metrics["peak_memory_gib_dev1"] == 3.0
    assert merged.metrics["peak_memory_gib"] == 3.0 and merged.metrics["tokens_per_s"] == 1.0
    assert merged.memory_trace.devices == (0, 1)
    assert sorted(s.device for s in merged.memory_trace.samples) == [0, 1]


def test_merge_ranks_names_the_rank_that_failed_or_left_lockstep():
    failed = merge_ranks([_result(TrialStatus.ERROR, 1, [1], "RuntimeError: gloo timed out"),
                          _result(TrialStatus.ERROR, 1, [1], "RuntimeError: boom")])
    assert failed.status is TrialStatus.ERROR and failed.error == "tensor-parallel rank 1: RuntimeError: boom"
    other_tokens = merge_ranks([_result(TrialStatus.OK, 1, [1, 2]), _result(TrialStatus.OK, 1, [1, 3])])
    assert other_tokens.status is TrialStatus.ERROR and "rank 1 left lockstep" in other_tokens.error
    other_end = merge_ranks([_result(TrialStatus.PRUNED, 1, [1]), _result(TrialStatus.OK, 1, [1])])
    assert other_end.status is TrialStatus.ERROR and "'ok'" in other_end.error


def test_a_tp_worker_needs_all_its_ranks_on_one_node(tiny_dir, tmp_path):
    assert worker_needs(tp_config(tiny_dir, tmp_path, resources={"host_b": 0.01})) == {"CPU": 2.0, "host_b": 0.02}
    data = sweep_dict(tiny_dir, tmp_path, workers={"gpus_per_worker": 4, "parallel": "tensor"})
    assert worker_needs(SweepConfig.model_validate(data)) == {"CPU": 4.0, "GPU": 4.0}


# -- a local Ray: a TP=2 worker against a one-actor worker ---------------------------------------------


@pytest.fixture(scope="module")
def two_workers(tiny_dir, tmp_path_factory):
    """(TP=2 worker's slot, one-actor worker's slot) on a local Ray with 3 CPUs and no GPUs."""
    if ray.is_initialized():
        ray.shutdown()
    saved = os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", num_cpus=3, num_gpus=0, include_dashboard=False, log_to_driver=False)
    runs = tmp_path_factory.mktemp("tp_runs")
    slots = []
    try:
        single = SweepConfig.model_validate(sweep_dict(tiny_dir, runs, workers={"count": 1, "gpus_per_worker": 0}))
        check_resources(tp_config(tiny_dir, runs))
        slots += start_pool(tp_config(tiny_dir, runs)) + start_pool(single)
        yield slots
    finally:
        if ray.is_initialized():  # the two-node section may have taken over already
            release_pool(slots)
            ray.shutdown()
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


def _spec(tiny_dir: Path, params, prompts: int = 2, max_new_tokens: int = 8) -> TrialSpec:
    return TrialSpec(params, prompts=tuple(load_prompts(tiny_dir / "prompts.jsonl", limit=prompts)),
                     max_new_tokens=max_new_tokens)


def test_the_group_is_one_worker_of_two_ranks(two_workers):
    tp, _ = two_workers
    assert tp.info["parallel"] == "tensor" and tp.info["ranks"] == 2 and tp.info["load_error"] is None
    assert len(set(tp.info["rank_pids"])) == 2 and tp.info["cuda_visible_devices"] == ""
    assert tp.placement_group is not None


@pytest.mark.parametrize("params", [ARParams(), DFlashParams(num_draft_tokens=5),
                                    TreeParams(8, max_depth=4, branching=2)], ids=["ar", "dflash", "ddtree"])
def test_tp_worker_generates_what_one_actor_does(tiny_dir, two_workers, params):
    tp, single = two_workers
    spec = _spec(tiny_dir, params)
    grouped, alone = ray.get([tp.handle.run_trial.remote(spec), single.handle.run_trial.remote(spec)],
                             timeout=GET_TIMEOUT)
    assert grouped.status is TrialStatus.OK, grouped.error
    assert alone.status is TrialStatus.OK, alone.error
    assert [o.token_ids for o in grouped.outputs] == [o.token_ids for o in alone.outputs]
    assert all(o.token_ids for o in grouped.outputs)
    assert {"peak_memory_gib_dev0", "peak_memory_gib_dev1"} <= set(grouped.metrics)  # both ranks' memory
    assert grouped.metrics["lossless_match"] == 1.0


def test_pruning_stops_every_rank_after_the_same_prompt(tiny_dir, two_workers):
    tp, _ = two_workers
    spec = _spec(tiny_dir, TreeParams(8, max_depth=4, branching=2), prompts=4, max_new_tokens=32)
    stream = tp.handle.run_trial_steps.options(num_returns="streaming").remote(spec)
    first = ray.get(next(stream), timeout=GET_TIMEOUT)
    assert first["step"] == 1
    ray.get(tp.handle.stop_trial.remote(), timeout=GET_TIMEOUT)
    items = [ray.get(ref, timeout=GET_TIMEOUT) for ref in stream]
    result = items[-1]["result"]
    # PRUNED, not an error: rank 1 ended PRUNED after as many prompts as rank 0 (see merge_ranks)
    assert result.status is TrialStatus.PRUNED, result.error
    assert len(items) < 4
    after = ray.get(tp.handle.run_trial.remote(_spec(tiny_dir, ARParams())), timeout=GET_TIMEOUT)
    assert after.status is TrialStatus.OK, after.error  # the ranks are still in step


def test_predictions_run_on_every_rank_and_replay_what_one_actor_does(tiny_dir, two_workers):
    """The predicted sampler's calls (acceptance replay, the cost table) go to every rank in lockstep:
    a TP=2 worker's tables equal a one-actor worker's (the same tokens and top-k ids; log-probabilities
    to rounding); its cost table covers the same pieces."""
    tp, single = two_workers
    spec = _spec(tiny_dir, TreeParams(8, max_depth=4, branching=2), prompts=2, max_new_tokens=12)
    grouped, alone = ray.get([tp.handle.replay_tables.remote(spec, 8), single.handle.replay_tables.remote(spec, 8)],
                             timeout=GET_TIMEOUT)
    assert len(grouped) == 2 and _same(grouped, alone)
    settings = [TreeParams(b, max_depth=4, branching=2) for b in (2, 8)]
    costs = ray.get([tp.handle.measure_costs.remote(spec, settings),
                     single.handle.measure_costs.remote(spec, settings)], timeout=GET_TIMEOUT)
    grouped_verify, alone_verify = (_leaves(c["verify_s"]) for c in costs)  # (context, kind, depth, budget): s
    assert grouped_verify.keys() == alone_verify.keys() and all(s > 0 for s in grouped_verify.values())
    assert {str(key[-1]) for key in grouped_verify} == {"2", "8"}  # both budgets timed, on the settings' own trees
    after = ray.get(tp.handle.run_trial.remote(_spec(tiny_dir, ARParams())), timeout=GET_TIMEOUT)
    assert after.status is TrialStatus.OK, after.error  # the ranks are still in step


def _leaves(table, path=()) -> dict[tuple, float]:
    """A nested table's numbers keyed by their path of keys."""
    if not isinstance(table, dict):
        return {path: table}
    return {key: value for k, sub in table.items() for key, value in _leaves(sub, (*path, k)).items()}


def _same(a, b) -> bool:
    """Equal nested dicts / lists whose leaves may be tensors: integer tensors (token ids, matches)
    exactly, float ones (log-probabilities, summed in another order across ranks) to float32 rounding."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
            return False
        return torch.allclose(a, b, atol=1e-5, rtol=1e-5) if a.is_floating_point() else torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# -- two nodes (the cluster of tests/orchestrator/test_pool.py) -----------------------------------


@pytest.mark.usefixtures("two_nodes")
def test_check_resources_counts_a_group_on_one_node(tiny_dir, tmp_path):
    """Two nodes of 2 CPUs: 4 CPUs in all, but a 3-rank group fits on neither."""
    check_resources(tp_config(tiny_dir, tmp_path))  # 2 ranks fit on one node
    with pytest.raises(BadInputError, match=r"need 3 CPU each \(3 tensor-parallel ranks, all on one node\), but the "
                                            r"Ray cluster \(2 node\(s\)\) has 4 CPU in all .*: 0 worker\(s\) fit"):
        check_resources(tp_config(tiny_dir, tmp_path, ranks=3))


# -- whole sweeps in subprocesses -------------------------------------------------------------------


def _session_processes(session: int, title: str) -> list[int]:
    """Pids of this sweep's processes (its session) whose title starts with ``title``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == session and cmdline.startswith(title):
            found.append(int(entry.name))
    return found


def _complete(runs: Path) -> int:
    storage = read_only_storage(f"sqlite:///{runs}/optuna.db")  # read-only: never races the driver's writes
    try:
        study = optuna.load_study(study_name="test-sweep", storage=storage) if storage else None
    except KeyError:  # not created yet
        return 0
    return 0 if study is None else sum(t.state == TrialState.COMPLETE for t in study.trials)


def _mid_trial(proc, runs: Path) -> list[int]:
    """Rank 1's pid if it is in a trial's call now and was 0.2 s ago with no trial completed since: a
    process seen once in ``call`` may have just finished it (under load its title can lag), and a rank
    killed between trials cuts no trial, where this test wants the cut one re-run."""
    complete = _complete(runs)
    busy = _session_processes(proc.pid, "ray::RankActor.call")
    if not busy:
        return []
    time.sleep(0.2)
    still = _session_processes(proc.pid, "ray::RankActor.call")
    return busy if still == busy and _complete(runs) == complete else []


def _finished_reruns(runs: Path) -> int:
    """MLflow's trial runs FINISHED at a second attempt: a trial re-run after its group was recreated. Read
    from the store in SQLite's read-only mode, so the test never takes a write lock from the driver."""
    try:
        with sqlite3.connect(f"file:{runs / 'mlflow.db'}?mode=ro", uri=True, timeout=5) as db:
            [(count,)] = db.execute(
                "SELECT count(*) FROM runs JOIN tags ON tags.run_uuid = runs.run_uuid"
                " WHERE tags.key = 'attempt' AND tags.value = '2' AND runs.status = 'FINISHED'").fetchall()
    except sqlite3.OperationalError:  # not created yet, or locked this moment
        return 0
    return count


def _wait(condition, proc, timeout: float = 240.0, what: str = ""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.sweep
def test_sweep_with_a_tp_worker_survives_a_killed_rank_and_resumes(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    # 4 trials: if the death cuts the third, its re-run is not the sweep's last (the sweep must still run)
    config = sweep_dict(tiny_dir, runs, n_trials=4, workers=TP2, measurement={"final_top_k": 0})
    config["prompts"]["max_new_tokens"] = 32  # trials long enough to be caught mid-flight
    config["ray"] = {"address": None, "num_cpus": 2}
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    proc = start_sweep(sweep)
    _wait(lambda: _complete(runs) >= 1, proc, what="a first complete trial")
    # rank 1 while it runs a trial (Ray titles a busy actor process ray::Class.method)
    [rank_1] = _wait(lambda: _mid_trial(proc, runs), proc, what="rank 1 mid-trial")
    os.kill(rank_1, signal.SIGKILL)
    # not "one more trial complete": the one rank 1 was in may still finish (its title lags its work), and
    # the death then cuts the next trial instead, noted only once that trial is sent
    _wait(lambda: _finished_reruns(runs) >= 1, proc, what="a trial re-run after the group was recreated")
    os.killpg(proc.pid, signal.SIGINT)  # an interruption, as Ctrl-C in a terminal
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "died during trial" in err

    again = run_sweep(sweep)  # the same command: resumes and finishes
    assert again.returncode == 0, again.stderr[-3000:]
    study = assert_consistent(runs, 4)
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    experiment = client.get_experiment_by_name("test")
    children = client.search_runs([experiment.experiment_id], "tags.sweep_role = 'trial'", max_results=100)
    killed = Counter(r.data.tags["optuna_trial"] for r in children if r.info.status == "KILLED")
    reruns = [r for r in children if r.data.tags["attempt"] == "2" and r.info.status == "FINISHED"]
    assert reruns and reruns[0].data.tags["optuna_trial"] in killed  # the trial the rank's death cut was re-run
    assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in study.trials)
    parent = client.search_runs([experiment.experiment_id], "tags.sweep_role = 'parent'")[0]
    assert parent.data.params["parallel"] == "tensor" and parent.data.params["tp_ranks"] == "2"
    finished = next(r for r in children if r.info.status == "FINISHED")
    assert {"peak_memory_gib_dev0", "peak_memory_gib_dev1"} <= set(finished.data.metrics)


@pytest.mark.sweep
def test_a_rank_out_of_memory_mid_trial_is_infeasible_and_a_new_group_runs_on(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    slow_timeout = TP2 | {"join_timeout_s": 600}  # the collectives' timeout: the trial must end long before
    config = sweep_dict(tiny_dir, runs, n_trials=1, workers=slow_timeout, measurement={"final_top_k": 0})
    config["ray"] = {"address": None, "num_cpus": 2}
    assert run_sweep(write_sweep(tmp_path / "first.yaml", config)).returncode == 0  # the study exists
    study = optuna.load_study(study_name="test-sweep", storage=f"sqlite:///{runs}/optuna.db")
    study.enqueue_trial({"tree_budget": 8, "max_depth": 3, "branching": 2}, user_attrs={"fault": "oom_on_last_rank"})
    config["n_trials"] = 3
    proc = run_sweep(write_sweep(tmp_path / "sweep.yaml", config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a tensor-parallel rank failed (oom)" in proc.stderr
    study = assert_consistent(runs, 3)
    [oom] = [t for t in study.trials if t.user_attrs.get("fault") == "oom_on_last_rank"]
    assert oom.state == TrialState.COMPLETE and oom.user_attrs["status"] == "oom"  # infeasible, as on one GPU
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    experiment = client.get_experiment_by_name("test")
    children = client.search_runs([experiment.experiment_id], "tags.sweep_role = 'trial'", max_results=100)
    run = next(r for r in children if r.data.tags["optuna_trial"] == str(oom.number))
    assert run.info.status == "FINISHED" and run.data.tags["trial_status"] == "oom"
    assert (run.info.end_time - run.info.start_time) / 1000 < 120  # seconds, not the 600 s timeout
    after = [t for t in study.trials if t.number > oom.number]
    assert after and all(t.state == TrialState.COMPLETE and t.user_attrs["status"] == "ok" for t in after)


@pytest.mark.sweep
def test_a_group_no_node_can_hold_is_refused_and_creates_nothing(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=1, workers=TP2 | {"ranks": 3})
    config["ray"] = {"address": None, "num_cpus": 2}
    proc = run_sweep(write_sweep(tmp_path / "sweep.yaml", config), timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("orchestrator.sweep:")]
    assert "1 worker(s) need 3 CPU each (3 tensor-parallel ranks, all on one node)" in line, line
    assert "0 worker(s) fit" in line and "workers.ranks" in line and "starting actors" not in proc.stderr
    storage = read_only_storage(f"sqlite:///{runs}/optuna.db")
    assert storage is None or optuna.get_all_study_summaries(storage) == []  # the stores' tables only
