"""The stores stay right whatever happens around the driver, in real subprocesses on real stores:
two drivers on one study, a changed storage with the same study name, bad prompts and trials that
keep failing, too few resources, an unwritable folder, a full disk (a small tmpfs), finished studies
and what --dry-run says about the study."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from orchestrator.study import read_only_storage
from tests.orchestrator.conftest import ROOT, run_sweep, start_sweep, sweep_dict, sweep_env, write_sweep
from tests.orchestrator.test_resume import _children, _parents, assert_consistent

pytestmark = pytest.mark.sweep  # whole sweeps (and dry runs) in subprocesses

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("orchestrator.sweep:")]


def _study(runs: Path, name: str = "test-sweep") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{runs}/optuna.db")


def _studies(runs: Path) -> list[str]:
    """Study names, read without writing (a plain client would create tables, racing the driver)."""
    storage = read_only_storage(f"sqlite:///{runs}/optuna.db")
    return [] if storage is None else [s.study_name for s in optuna.get_all_study_summaries(storage)]


# -- two drivers ---------------------------------------------------------------------------------------


def test_two_drivers_at_the_same_instant_one_is_refused_and_schemas_do_not_race(tiny_dir, tmp_path):
    """Three drivers at once on fresh stores: two on one study (one is refused before it touches a
    store), one on another study in the same SQLite files (the schema is created once, in turn)."""
    runs = tmp_path / "runs"
    same = write_sweep(tmp_path / "same.yaml", sweep_dict(tiny_dir, runs, n_trials=2))
    other = write_sweep(tmp_path / "other.yaml", sweep_dict(  # the same two SQLite files, its own experiment
        tiny_dir, runs, n_trials=2, name="other-sweep",
        mlflow={"tracking_uri": f"sqlite:///{runs}/mlflow.db", "experiment": "other"}))
    procs = [start_sweep(same), start_sweep(same), start_sweep(other)]
    results = [(proc.returncode, err) for proc in procs for _, err in [proc.communicate(timeout=600)]]
    codes = sorted(code for code, _ in results[:2])
    assert codes == [0, 3], [err[-2000:] for _, err in results]
    refused = next(err for code, err in results[:2] if code == 3)
    [line] = _lines(refused)
    assert "study 'test-sweep'" in line and "another driver" in line and "pid " in line, refused
    assert "Traceback" not in refused and "starting Ray" not in refused  # refused before anything started
    assert results[2][0] == 0, results[2][1][-3000:]
    assert_consistent(runs, 2)
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    other_study = _study(runs, "other-sweep")
    assert len([t for t in other_study.trials if t.state == TrialState.COMPLETE]) == 2
    experiment = client.get_experiment_by_name("other")
    finished = client.search_runs([experiment.experiment_id], "tags.sweep_role = 'trial'")
    assert len([r for r in finished if r.info.status == "FINISHED"]) == 2


def test_a_killed_driver_leaves_no_lock_behind(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=2)
    config["prompts"]["max_new_tokens"] = 32
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    proc = start_sweep(sweep)
    deadline = time.time() + 300
    while not _studies(runs) or not _study(runs).trials:  # it holds the lock and runs a trial
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.kill()
    proc.communicate()
    again = run_sweep(sweep)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_consistent(runs, 2)


# -- one parent run per (storage, study) --------------------------------------------------------------


def test_a_new_storage_with_the_same_study_name_gets_its_own_parent_run(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    first = write_sweep(tmp_path / "first.yaml", sweep_dict(tiny_dir, runs, n_trials=2))
    assert run_sweep(first).returncode == 0
    moved = sweep_dict(tiny_dir, runs, n_trials=3, storage=f"sqlite:///{tmp_path}/elsewhere/optuna.db")
    second = write_sweep(tmp_path / "second.yaml", moved)
    proc = run_sweep(second)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    parents = _parents(client)
    assert len(parents) == 2 and {p.data.tags["sweep_storage"] for p in parents} == {
        f"sqlite:///{runs}/optuna.db", f"sqlite:///{tmp_path}/elsewhere/optuna.db"}
    for parent in parents:
        children = [r for r in _children(client) if r.data.tags["mlflow.parentRunId"] == parent.info.run_id]
        wanted = 2 if parent.data.tags["sweep_storage"].startswith(f"sqlite:///{runs}") else 3
        assert len([r for r in children if r.info.status == "FINISHED"]) == wanted
        assert {r.data.tags["sweep_study_uid"] for r in children} == {parent.data.tags["sweep_study_uid"]}
    report = subprocess.run([sys.executable, "-m", "orchestrator.report", str(second), "--out", str(tmp_path / "r")],
                            capture_output=True, text=True, env=sweep_env(), cwd=ROOT, timeout=300)
    assert report.returncode == 0, report.stderr
    assert "3 finished trials" in report.stdout


# -- bad prompts, failing trials ----------------------------------------------------------------------


def _prompts_file(path: Path, rows: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    return path


@pytest.mark.parametrize("problem", ["outside-vocabulary", "too-long"])
def test_a_bad_prompt_is_refused_naming_file_and_line(tiny_dir, tmp_path, problem):
    runs = tmp_path / "runs"
    bad = [40, 2, 3] if problem == "outside-vocabulary" else list(range(1, 30)) * 141  # 4089 tokens of 4096
    prompts = _prompts_file(tmp_path / "prompts.jsonl", [[1, 2, 3], [4, 5, 6], bad])
    config = sweep_dict(tiny_dir, runs, n_trials=1)
    config["prompts"] = {"path": str(prompts), "max_new_tokens": 8}
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    for args in (("--dry-run",), ()):
        proc = run_sweep(sweep, *args)
        assert proc.returncode == 2, proc.stderr[-3000:]
        [line] = _lines(proc.stderr)
        assert f"{prompts}:3:" in line, line
        assert ("outside the target's 33-row vocabulary" if problem == "outside-vocabulary"
                else "exceed the target's 4096 positions") in line
        assert "Traceback" not in proc.stderr and not runs.exists()


def test_trials_that_keep_failing_stop_the_sweep_with_the_last_error(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    first = write_sweep(tmp_path / "first.yaml", sweep_dict(tiny_dir, runs, n_trials=1))
    assert run_sweep(first).returncode == 0
    study = _study(runs)
    for budget in (2, 4, 8, 16, 32):  # every trial fails inside the actor, whatever its setting
        study.enqueue_trial({"tree_budget": budget, "max_depth": 2, "branching": 1}, user_attrs={"fault": "error"})
    started = time.time()
    proc = run_sweep(write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, runs, n_trials=20)))
    assert proc.returncode == 1, proc.stderr[-3000:]
    [line] = _lines(proc.stderr)
    assert "3 trials in a row failed" in line and "injected failure" in line, line
    assert "Traceback" not in proc.stderr and time.time() - started < 300
    states = [t.state for t in _study(runs).trials]
    assert states.count(TrialState.FAIL) == 3 and TrialState.RUNNING not in states
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    assert _parents(client)[0].info.status == "FAILED"
    assert all(r.info.status != "RUNNING" for r in _children(client))


# -- resources ----------------------------------------------------------------------------------------


def test_a_pool_the_cluster_cannot_place_is_refused_in_seconds(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=1, workers={"count": 1, "gpus_per_worker": 2, "device": "cpu"})
    config["ray"] = {"address": None, "num_cpus": 2, "num_gpus": 1}  # a local Ray with one logical GPU
    started = time.time()
    proc = run_sweep(write_sweep(tmp_path / "sweep.yaml", config), timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = _lines(proc.stderr)
    assert "1 worker(s) need 1 CPU, 2 GPU each" in line and "has 2 CPU, 1 GPU in all" in line, line
    assert "0 worker(s) fit" in line and "starting actors" not in proc.stderr
    assert time.time() - started < 120
    assert _studies(runs) == []  # nothing created (the stores' tables only)


# -- storage ------------------------------------------------------------------------------------------


def _mount_tmpfs(folder: Path, options: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount is not permitted here: {done.stderr.decode().strip()}")


@pytest.fixture
def mounts():
    mounted: list[Path] = []
    yield mounted
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_an_unwritable_sqlite_folder_is_caught_by_dry_run_and_before_the_run(tiny_dir, tmp_path, mounts):
    """A read-only mount: root passes every permission check, so only a real write finds it."""
    runs = tmp_path / "runs"
    _mount_tmpfs(runs, "ro,size=1m")
    mounts.append(runs)
    sweep = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, runs, n_trials=1))
    for args in (("--dry-run",), ()):
        started = time.time()
        proc = run_sweep(sweep, *args, timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        [line] = _lines(proc.stderr)
        assert f"storage: cannot write the SQLite file {runs}/optuna.db" in line and "Read-only" in line, line
        assert "Traceback" not in proc.stderr and time.time() - started < 60


def test_a_full_disk_mid_run_is_one_line_and_resume_loses_nothing(tiny_dir, tmp_path, mounts):
    runs = tmp_path / "runs"
    _mount_tmpfs(runs, "size=24m")
    mounts.append(runs)
    sweep = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, runs, n_trials=6))
    proc = start_sweep(sweep)
    deadline = time.time() + 300
    while not _studies(runs) or len([t for t in _study(runs).trials if t.state == TrialState.COMPLETE]) < 1:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    filler = os.open(runs / "filler", os.O_WRONLY | os.O_CREAT)  # fill the disk to the last byte
    try:
        while os.write(filler, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(filler)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    [line] = _lines(err)
    assert "store" in line and "failed" in line and ("disk is full" in line or "No space left" in line), line
    assert "resume" in line and "Traceback" not in err
    (runs / "filler").unlink()
    again = run_sweep(sweep)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_consistent(runs, 6)


# -- finished studies and --dry-run -------------------------------------------------------------------


def _dry_run_study_line(sweep: Path) -> str:
    proc = run_sweep(sweep, "--dry-run", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(line for line in proc.stdout.splitlines() if line.startswith("study "))


def test_dry_run_says_new_resuming_or_complete_and_a_finished_study_is_done_without_ray(tiny_dir, tmp_path):
    runs = tmp_path / "runs"
    two = write_sweep(tmp_path / "two.yaml", sweep_dict(tiny_dir, runs, n_trials=2))
    assert "new study 'test-sweep' (2 complete trials to run)" in _dry_run_study_line(two)
    assert not runs.exists()
    one = write_sweep(tmp_path / "one.yaml", sweep_dict(tiny_dir, runs, n_trials=1))
    assert run_sweep(one).returncode == 0
    stamps = {p: p.stat().st_mtime_ns for p in runs.glob("*.db")}
    assert "resuming study 'test-sweep': 1 of 2 complete" in _dry_run_study_line(two)
    assert "complete: study 'test-sweep' has 1 of 1 complete trials" in _dry_run_study_line(one)
    assert stamps == {p: p.stat().st_mtime_ns for p in runs.glob("*.db")}  # read, never written

    started = time.time()
    done = run_sweep(one)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: 1 complete trials" in done.stderr and "starting Ray" not in done.stderr
    assert time.time() - started < 60  # no Ray start, no model load
    assert_consistent(runs, 1)


def test_dry_run_says_when_the_grid_is_smaller_than_n_trials(tiny_dir, tmp_path):
    config = sweep_dict(tiny_dir, tmp_path / "runs", n_trials=10, sampler={"type": "grid"})
    config["search_space"] = {"tree_budget": {"type": "categorical", "choices": [2, 8]}}
    proc = run_sweep(write_sweep(tmp_path / "sweep.yaml", config), "--dry-run", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "the grid has 2 points, fewer than n_trials = 10: the sweep stops after 2" in proc.stdout
    assert "new study 'test-sweep' (2 complete trials to run)" in proc.stdout


def test_report_only_reads(tiny_dir, tmp_path):
    """A store without the experiment: the report says there is nothing to report and creates nothing."""
    runs = tmp_path / "runs"
    sweep = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, runs, n_trials=1))
    assert run_sweep(sweep).returncode == 0
    other = write_sweep(tmp_path / "other.yaml", sweep_dict(tiny_dir, runs, n_trials=1,
                                                          mlflow={"tracking_uri": f"sqlite:///{runs}/mlflow.db",
                                                                  "experiment": "not-there"}))
    before = {p.name: p.read_bytes() for p in runs.glob("*.db")}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.report", str(other), "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, env=sweep_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 1 and "nothing to report" in proc.stderr, proc.stderr
    assert before == {p.name: p.read_bytes() for p in runs.glob("*.db")}
    assert MlflowClient(f"sqlite:///{runs}/mlflow.db").get_experiment_by_name("not-there") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(runs / "optuna.db", empty / "optuna.db")
    (empty / "mlflow.db").touch()  # a store whose tables a driver has not made yet
    moved = write_sweep(tmp_path / "moved.yaml", sweep_dict(tiny_dir, empty, n_trials=1))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.report", str(moved), "--out", str(tmp_path / "r2")],
                          capture_output=True, text=True, env=sweep_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 1 and "nothing to report" in proc.stderr, proc.stderr
    assert (empty / "mlflow.db").stat().st_size == 0


def test_a_trial_closed_by_someone_else_is_left_as_they_left_it(tiny_dir, tmp_path):
    """Someone (a dashboard, a script) fails a RUNNING trial and kills its run while the actor works
    on it: the driver writes nothing more to either (no FINISHED run, no crash) and sweeps on."""
    runs = tmp_path / "runs"
    config = sweep_dict(tiny_dir, runs, n_trials=3)
    config["prompts"]["max_new_tokens"] = 64  # trials long enough to be closed mid-flight
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    proc = start_sweep(sweep)
    closed, deadline = None, time.time() + 300
    while closed is None:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
        if not _studies(runs):  # once the study exists, both stores have their tables and experiment
            continue
        client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
        study = _study(runs)
        running = [t for t in study.trials if t.state == TrialState.RUNNING]
        runs_now = {r.data.tags["optuna_trial"]: r for r in _children(client) if r.info.status == "RUNNING"}
        for trial in running:
            if str(trial.number) in runs_now:
                try:
                    study.tell(trial.number, state=TrialState.FAIL)
                except optuna.exceptions.UpdateFinishedTrialError:
                    break  # it finished first: try the next one
                client.set_terminated(runs_now[str(trial.number)].info.run_id, "KILLED")
                closed = trial.number
                break
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and f"trial {closed}: closed by someone else meanwhile" in err, err[-3000:]
    study = _study(runs)
    assert study.trials[closed].state == TrialState.FAIL
    statuses = [r.info.status for r in _children(client) if r.data.tags["optuna_trial"] == str(closed)]
    assert statuses == ["KILLED"], statuses
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 3
