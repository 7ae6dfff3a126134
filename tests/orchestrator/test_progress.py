"""The live display's numbers: how trials ended (from a real SQLite study), time spent and left."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from orchestrator import study as studies
from orchestrator.config import SweepConfig
from orchestrator.pool import Slot
from orchestrator.progress import Progress, clock, time_left
from tests.orchestrator.conftest import sweep_dict

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_clock_and_time_left():
    assert clock(None) == "-" and clock(0) == "0:00:00" and clock(3725.4) == "1:02:05"
    assert time_left(0, None, 1) == 0.0  # nothing left to do is known even without a duration
    assert time_left(3, None, 1) is None  # no trial finished yet: unknown, not zero
    assert time_left(4, 10.0, 2) == 20.0  # four trials of ten seconds on two actors


def _config(tiny_dir, tmp_path) -> SweepConfig:
    return SweepConfig.model_validate(sweep_dict(tiny_dir, tmp_path / "runs", n_trials=10))


def test_counts_and_line_from_a_real_study(tiny_dir, tmp_path, capsys):
    config = _config(tiny_dir, tmp_path)
    storage = studies.make_storage(f"sqlite:///{tmp_path}/optuna.db")
    study = studies.open_study(config, storage).study
    ok = study.ask({"tree_budget": optuna.distributions.IntDistribution(2, 32)})
    studies.tell_result(study, ok.number, config, {"tokens_per_s": 5.0}, oom=False)
    oom = study.ask()
    studies.tell_result(study, oom.number, config, {"tokens_per_s": 0.0}, oom=True)  # infeasible
    crashed = study.ask()
    study.tell(crashed.number, state=TrialState.FAIL)  # an error inside the trial
    interrupted = study.ask()
    studies.fail_and_requeue(study, interrupted.number, {})  # Ctrl-C: failed and queued again
    assert studies.trial_counts(study) == {"complete": 2, "failed": 1, "killed": 1, "infeasible": 1, "running": 0}
    assert studies.median_trial_seconds(study) is not None

    progress = Progress(config)  # not a terminal under pytest: plain lines on stderr
    slots = [Slot(0, None, state="idle")]
    progress.update(study, slots, complete=2, wanted=10)
    progress.update(study, slots, complete=2, wanted=10)  # nothing changed but the clock: no new line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("[2/10] complete 2 (infeasible 1), failed 1, killed 1 |")
    assert "elapsed 0:00:0" in line and "left ~" in line
