"""The final re-measurement's verdict on its winner: separated from the runner-up or not, pass by pass."""

from __future__ import annotations

import pytest

from orchestrator.config import SweepConfig
from orchestrator.remeasure import separation, separation_text
from tests.orchestrator.conftest import sweep_dict


def _config(tmp_path, tiny_dir, metric="tokens_per_s", direction="maximize") -> SweepConfig:
    raw = sweep_dict(tiny_dir, tmp_path, objectives=[{"metric": metric, "direction": direction}])
    return SweepConfig.model_validate(raw)


def _pass(ar_speed: float, speed: float) -> tuple[dict, dict]:
    return {"tokens_per_s": ar_speed}, {"tokens_per_s": speed, "tau": 3.0}


def test_a_winner_better_in_every_pass_against_its_ar_is_separated(tmp_path, tiny_dir):
    # the machine slows down in pass 2: raw speeds would cross, against each pass's AR they do not
    samples = {4: {0: _pass(100, 210), 1: _pass(80, 170), 2: _pass(100, 212)},
               9: {0: _pass(100, 200), 1: _pass(80, 165), 2: _pass(100, 205)}}
    trials = {4: {"tokens_per_s": 210.0}, 9: {"tokens_per_s": 200.0}}
    found = separation(samples, trials, _config(tmp_path, tiny_dir))
    assert (found["winner"], found["runner_up"], found["wins"], found["passes"]) == (4, 9, 3, 3)
    assert found["separated"] and found["margin_min"] > 0
    assert found["margin_median"] == pytest.approx(212 / 205 - 1)  # the median of 5.0%, 3.0%, 3.4%
    assert separation_text(found) == ("trial 4 separated from trial 9: better in 3 of 3 passes, by +3.4% "
                                      "(+3.0%..+5.0%)")


def test_a_winner_worse_in_one_pass_is_not_separated(tmp_path, tiny_dir):
    samples = {1: {0: _pass(100, 210), 1: _pass(100, 190), 2: _pass(100, 215)},
               2: {0: _pass(100, 200), 1: _pass(100, 200), 2: _pass(100, 200)}}
    found = separation(samples, {1: {"tokens_per_s": 210.0}, 2: {"tokens_per_s": 200.0}}, _config(tmp_path, tiny_dir))
    assert not found["separated"] and found["wins"] == 2 and found["margin_min"] < 0
    assert "NOT separated" in separation_text(found)


def test_no_runner_up_no_verdict(tmp_path, tiny_dir):
    assert separation({1: {0: _pass(100, 200)}}, {1: {"tokens_per_s": 200.0}}, _config(tmp_path, tiny_dir)) is None
