"""The predicted strategy and early stopping, end to end in real sweeps (Ray, Optuna SQLite, MLflow).

Greedy float32 on the tiny models: the replay is exact, so every trial's predicted_tau must equal
its measured tau; the plan must be the best predicted points plus the explored ones, kept across a
resume. The pruner: a grid whose second point is worse at the first prompt (checked with the
replay first) must be PRUNED in Optuna, its MLflow run FINISHED and tagged pruned, and a resume
must neither re-run nor re-count it.
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import torch
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from orchestrator.config import load_sweep
from orchestrator.report import main as report_main
from tests.orchestrator.conftest import run_sweep, sweep_dict, write_sweep
from tools.tiny import TinyShape, write_prompts, write_tiny_pair
from workers.decoding import ddtree
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import TreeParams
from workers.decoding.replay import record
from workers.errors import BadInputError
from workers.models.loading import Placement, load_drafter, load_target
from workers.models.runner.target import make_target
from workers.prompts import PromptSource, load_source

optuna.logging.set_verbosity(optuna.logging.WARNING)
# drafts are often accepted (tau differs by setting); the drafter mixes sliding and full layers, as the real one
SMALL_VOCAB = TinyShape(vocab_size=6, block_size=6, drafter_layer_types=("sliding_attention", "full_attention"),
                        drafter_window=8)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("small_vocab_pair")
    write_tiny_pair(folder, SMALL_VOCAB)
    write_prompts(folder / "prompts.jsonl", SMALL_VOCAB, count=3, length=8)
    return folder


def _children(client: MlflowClient):
    experiment = client.get_experiment_by_name("test")
    return client.search_runs([experiment.experiment_id], "tags.sweep_role = 'trial'", max_results=100)


def _parent(client: MlflowClient):
    experiment = client.get_experiment_by_name("test")
    return client.search_runs([experiment.experiment_id], "tags.sweep_role = 'parent'", max_results=10)[0]


@pytest.mark.sweep
def test_predicted_sweep_runs_the_predicted_best_and_logs_predicted_vs_measured(small_dir, tmp_path, capsys):
    runs = tmp_path / "runs"
    config = sweep_dict(
        small_dir, runs, n_trials=4,
        prompts={"path": str(small_dir / "prompts.jsonl"), "limit": 3, "max_new_tokens": 16},
        search_space={"tree_budget": {"type": "categorical", "choices": [1, 2, 4, 8, 16]},
                      "max_depth": {"type": "int", "low": 1, "high": 5},
                      "branching": {"type": "categorical", "choices": [1, None]}},
        sampler={"type": "predicted", "seed": 0, "explore": 1},
    )
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    proc = run_sweep(sweep)
    assert proc.returncode == 0, proc.stderr[-3000:]

    study = optuna.load_study(study_name="test-sweep", storage=f"sqlite:///{runs}/optuna.db")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    plan = study.user_attrs["predicted_plan"]
    assert [entry["role"] for entry in plan] == ["top", "top", "top", "explore"]
    assert sorted(t.user_attrs["plan_role"] for t in study.trials) == ["explore", "top", "top", "top"]
    top_predicted = [entry["predicted_tokens_per_s"] for entry in plan[:3]]
    assert (top_predicted == sorted(top_predicted, reverse=True)
            and plan[3]["predicted_tokens_per_s"] <= top_predicted[-1])

    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    children = _children(client)
    assert len(children) == 4
    for run in children:
        metrics = run.data.metrics
        assert metrics["predicted_tokens_per_s"] > 0
        assert metrics["predicted_tau"] == pytest.approx(metrics["tau"], abs=1e-12)  # exact replay (greedy, f32)
        assert metrics["predicted_rounds"] == metrics["rounds"]
    parent = _parent(client)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)} | {
        a.path for a in client.list_artifacts(parent.info.run_id, "costs")}
    assert {"costs/actor-0.json", "predicted_plan.json"} <= artifacts
    costs = json.loads(Path(client.download_artifacts(parent.info.run_id, "costs/actor-0.json",
                                                      str(tmp_path))).read_text())
    # verify passes timed per context (where the trials' generations start and end), per branching, depth
    # and budget of the space: the trees the settings build, not one width standing for all
    assert len(costs["verify_s"]) >= 2 and set(costs["overhead_s"]) == {"ddtree"}
    for by_branching in costs["verify_s"].values():
        assert set(by_branching) == {"chain", "1", "None"} and not by_branching["chain"]  # no chains here
        assert {budget for branching in ("1", "None") for budgets in by_branching[branching].values()
                for budget in budgets} == {"1", "2", "4", "8", "16"}
    assert parent.data.tags["costs.actor0.device"] == "cpu"

    again = run_sweep(sweep)  # resume: the stored plan is done, nothing runs again
    assert again.returncode == 0, again.stderr[-3000:]
    study = optuna.load_study(study_name="test-sweep", storage=f"sqlite:///{runs}/optuna.db")
    assert len(study.trials) == 4 and study.user_attrs["predicted_plan"] == plan

    assert report_main([str(sweep), "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert ("predicted vs measured tokens/s over 4 trials" in out
            and "predicted vs measured tau: mean error 0.00%" in out)


def _first_prompt_tau(small_dir: Path, budget: int) -> float:
    """tau of DDTree(budget, depth 5) on the sweep's first prompt, from the exact replay."""
    model = load_target(str(small_dir / "target"), dtype="float32", placement=Placement(device="cpu"))
    drafter = load_drafter(str(small_dir / "drafter"), model)
    target = make_target(model, drafter.spec.target_layer_ids)
    prompt = load_source(PromptSource(str(small_dir / "prompts.jsonl"), limit=1))[0]
    table = record(target, drafter, torch.tensor([prompt.input_ids]), GenerationConfig(16, 0.0, (0,)), top_k=16)
    lengths = ddtree.replay_lengths(table, TreeParams(budget, 5), 6)
    return sum(lengths) / len(lengths)


@pytest.mark.sweep
def test_pruned_trials_end_pruned_and_survive_resume(small_dir, tmp_path):
    good, bad = 16, 1
    assert _first_prompt_tau(small_dir, bad) < _first_prompt_tau(small_dir, good)  # so the median pruner must fire
    runs = tmp_path / "runs"
    config = sweep_dict(
        small_dir, runs, n_trials=2,
        prompts={"path": str(small_dir / "prompts.jsonl"), "limit": 3, "max_new_tokens": 16},
        generation={"temperature": 0.0, "seed": 0, "stop_token_ids": [0]},
        search_space={"tree_budget": {"type": "categorical", "choices": [good, bad]}},
        fixed_params={"max_depth": 5},
        objectives=[{"metric": "tau", "direction": "maximize"}],
        sampler={"type": "grid"},
        pruner={"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0},
    )
    sweep = write_sweep(tmp_path / "sweep.yaml", config)
    proc = run_sweep(sweep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = optuna.load_study(study_name="test-sweep", storage=f"sqlite:///{runs}/optuna.db")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert study.trials[0].params == {"tree_budget": good}
    assert study.trials[0].intermediate_values.keys() == {1, 2, 3}  # one report per prompt
    assert 1 in study.trials[1].intermediate_values and 3 not in study.trials[1].intermediate_values

    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    by_trial = {r.data.tags["optuna_trial"]: r for r in _children(client)}
    pruned = by_trial["1"]
    assert pruned.info.status == "FINISHED" and pruned.data.tags["trial_status"] == "pruned"
    assert int(pruned.data.tags["pruned_after_prompts"]) >= 1
    assert [m.step for m in client.get_metric_history(pruned.info.run_id, "intermediate_tau")][0] == 1
    assert by_trial["0"].data.tags["trial_status"] == "ok"

    again = run_sweep(sweep)  # resume: the pruned point is not re-run, nothing counted twice
    assert again.returncode == 0, again.stderr[-3000:]
    study = optuna.load_study(study_name="test-sweep", storage=f"sqlite:///{runs}/optuna.db")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert len(_children(client)) == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"objectives": [{"metric": "tokens_per_s", "direction": "maximize"},
                         {"metric": "peak_memory_gib", "direction": "minimize"}],
          "pruner": {"type": "median"}}, "pruner.type: pruning needs a single objective"),
        ({"sampler": {"type": "predicted"}, "objectives": [{"metric": "tau", "direction": "maximize"}]},
         "sampler.type: 'predicted' ranks settings by predicted tokens_per_s"),
        ({"method": "ar", "search_space": {}, "sampler": {"type": "random", "predict": True}},
         "sampler.predict: predictions are for speculative methods"),
        ({"pruner": {"type": "hyperband"}}, "pruner.type"),
    ],
)
def test_bad_strategy_settings_name_the_field(tiny_dir, tmp_path, overrides, message):
    sweep = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, tmp_path / "runs", **overrides))
    with pytest.raises(BadInputError, match=message.replace("(", r"\(")):
        load_sweep(sweep)
    assert not (tmp_path / "runs").exists()


def test_a_crash_after_the_pruned_run_was_logged_recovers_as_pruned(tiny_dir, tmp_path):
    """Driver killed between marking the MLflow run pruned and telling Optuna: resume tells PRUNED."""
    from orchestrator import study as studies
    from orchestrator.recovery import recover_stale
    from orchestrator.tracking import Tracker
    from workers.decoding.methods import Method
    from workers.wire import TrialResult, TrialStatus

    sweep = write_sweep(tmp_path / "sweep.yaml", sweep_dict(tiny_dir, tmp_path / "runs", pruner={"type": "median"}))
    config = load_sweep(sweep)
    storage = studies.make_storage(config.storage)
    study = studies.open_study(config, storage).study
    tracker = Tracker(config.mlflow.tracking_uri, config.mlflow.experiment)
    uid = studies.study_uid(study)
    parent_id = tracker.parent_run(study.study_name, uid, config.storage, study._study_id, config.fingerprint(),
                                   sweep, {})
    trial = study.ask()
    params = studies.suggest(trial, config)
    trial.report(1.5, 1)
    run_id = tracker.start_child(parent_id, study.study_name, uid, trial.number, params, 1)
    result = TrialResult(TrialStatus.PRUNED, Method.DDTREE, params, metrics={"peak_memory_gib": 0.0})
    tracker.finish_pruned(run_id, result, 0, prompts_done=1)  # ... and the driver dies here

    recover_stale(study, tracker, config, lambda line: None)
    assert study.trials[0].state == TrialState.PRUNED
    assert not study.get_trials(states=(TrialState.WAITING,))  # not queued to run again
