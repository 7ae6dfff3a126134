"""Several methods in one study: the sweep file of issue 25, its checks (each error names the method's
own mapping), the conditional space Optuna samples, and a one-method file that still means what it did."""

from __future__ import annotations

import optuna
import pytest
import yaml

from orchestrator import study as studies
from orchestrator.config import SweepConfig, load_sweep
from orchestrator.sweep import plan_text
from tests.orchestrator.conftest import sweep_dict, write_sweep
from tests.orchestrator.test_config import ISSUE_SAMPLE
from workers.decoding.params import DFlashParams, TreeParams
from workers.errors import BadInputError

# issue 25's sample, verbatim, around the rest of a sweep file
SEVERAL = """\
method: [ddtree, dflash]          # one method, or several compared in one study
search_space:                     # with several methods: one space per method
  ddtree: {tree_budget: {type: int, low: 16, high: 1024, log: true}, max_depth: {type: int, low: 4, high: 15}}
  dflash: {num_draft_tokens: {type: int, low: 4, high: 15}}
trial_timeout_s: 900              # a trial running longer is stopped: actor restarted, trial re-run once, then failed
baselines:                        # what the user already has, beside the study's best in the report and plots
  - {name: "SGLang + MTP (TP=2)", tokens_per_s: 73.5}
"""


def several(**overrides) -> dict:
    raw = yaml.safe_load(ISSUE_SAMPLE)
    raw.pop("search_space")
    return raw | yaml.safe_load(SEVERAL) | overrides


def test_the_issue_sample_validates():
    config = SweepConfig.model_validate(several())
    assert config.several and config.methods == ("ddtree", "dflash")
    assert set(config.space("ddtree")) == {"tree_budget", "max_depth"} and set(config.space("dflash")) == {
        "num_draft_tokens"}
    assert config.trial_timeout_s == 900 and config.baselines[0].tokens_per_s == 73.5
    assert config.params_of({"method": "ddtree", "tree_budget": 64, "max_depth": 5}) == TreeParams(64, 5)
    assert config.params_of({"method": "dflash", "num_draft_tokens": 7}) == DFlashParams(7)
    assert config.widest_setting("ddtree") == {"tree_budget": 1024, "max_depth": 15}
    plan = plan_text(config, __import__("pathlib").Path("sweep.yaml"))
    assert "\n  ddtree\n    tree_budget" in plan and "\n  dflash\n    num_draft_tokens" in plan


def test_a_one_method_file_keeps_its_fingerprint():
    """A study of a one-method file resumes after this change: its fingerprint is the one it had."""
    assert SweepConfig.model_validate(yaml.safe_load(ISSUE_SAMPLE)).fingerprint() == "6f72b5ecbd522473"


@pytest.mark.parametrize("change, words", [
    ({"search_space": {"ddtree": {"tree_budget": {"type": "int", "low": 16, "high": 8}}}},
     ["search_space.ddtree.tree_budget", "greater than high"]),
    ({"search_space": {"ddtree": {"tree_budget": {"type": "int", "low": 8, "high": 16}},
                       "dflash": {"tree_budget": {"type": "int", "low": 8, "high": 16}}}},
     ["search_space.dflash.tree_budget", "not a parameter of method 'dflash'"]),
    ({"search_space": {"ddtree": {"max_depth": {"type": "int", "low": 1, "high": 3}}}},
     ["search_space.ddtree.tree_budget", "needs a tree budget"]),
    ({"search_space": {"medusa": {}}}, ["search_space.medusa", "not one of this study's methods"]),
    ({"fixed_params": {"dflash": {"num_draft_tokens": 0}}, "search_space": {
        "ddtree": {"tree_budget": {"type": "int", "low": 8, "high": 16}}}},
     ["fixed_params.dflash.num_draft_tokens", ">= 1"]),
    ({"method": ["ddtree", "ddtree"]}, ["method", "each method once"]),
    ({"method": ["ddtree", "medusa"]}, ["method", "'medusa' is not a method"]),
    ({"method_spaces": {}}, ["method_spaces", "unknown field"]),
    ({"baselines": [{"name": "x", "tokens_per_s": 0}]}, ["baselines.0.tokens_per_s"]),
    ({"search_space": {"ddtree": {"tree_budget": {"type": "int", "low": 8, "high": 16},
                                  "depth_discount": {"type": "categorical", "choices": [0.8, 1.5]}}}},
     ["search_space.ddtree.depth_discount", "(0, 1]"]),
    ({"search_space": {"ddtree": {"tree_budget": {"type": "float", "low": 8, "high": 16, "step": 0.5}}}},
     ["search_space.ddtree.tree_budget", "whole numbers"]),
])
def test_a_bad_several_method_file_names_the_place(tmp_path, change, words):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(several(**change)))
    with pytest.raises(BadInputError) as info:
        load_sweep(path)
    message = str(info.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_optuna_samples_each_methods_knobs_only_in_its_trials(tiny_dir, tmp_path):
    raw = sweep_dict(tiny_dir, tmp_path / "runs", method=["ddtree", "dflash"], search_space={
        "ddtree": {"tree_budget": {"type": "int", "low": 2, "high": 16}, "branching": {
            "type": "categorical", "choices": [1, 2, None]}},
        "dflash": {"num_draft_tokens": {"type": "int", "low": 1, "high": 7}}},
        fixed_params={"ddtree": {"max_depth": 3}}, sampler={"type": "tpe", "seed": 0})
    config = load_sweep(write_sweep(tmp_path / "sweep.yaml", raw))
    study = optuna.create_study(sampler=studies.make_sampler(config), direction="maximize")
    seen = set()
    for _ in range(20):
        trial = study.ask()
        setting = studies.suggest(trial, config)
        method = setting["method"]
        seen.add(method)
        knobs = set(setting) - {"method"}
        if method == "ddtree":
            assert knobs == {"tree_budget", "branching", "max_depth"} and setting["max_depth"] == 3
        else:
            assert knobs == {"num_draft_tokens"}
        config.params_of(setting)  # a valid engine parameter object
        study.tell(trial, float(len(knobs)))
    assert seen == {"ddtree", "dflash"}
    points = studies.grid_points(config)
    assert len(points) == studies.space_size(config) == 15 * 3 + 7
    assert {p["method"] for p in points} == {"ddtree", "dflash"}


def test_the_depth_discount_is_swept_on_a_grid_of_its_step(tiny_dir, tmp_path):
    """A real-valued knob: Optuna's suggest_float on the file's grid; grid and predicted samplers
    enumerate the same values; every one makes a valid parameter object."""
    raw = sweep_dict(tiny_dir, tmp_path / "runs", method="ddtree", search_space={
        "tree_budget": {"type": "int", "low": 2, "high": 16},
        "depth_discount": {"type": "float", "low": 0.6, "high": 1.0, "step": 0.1}}, sampler={"type": "tpe", "seed": 0})
    config = load_sweep(write_sweep(tmp_path / "sweep.yaml", raw))
    assert config.space("ddtree")["depth_discount"].values() == [0.6, 0.7, 0.8, 0.9, 1.0]
    study = optuna.create_study(sampler=studies.make_sampler(config), direction="maximize")
    for _ in range(10):
        trial = study.ask()
        setting = studies.suggest(trial, config)
        assert setting["depth_discount"] in (0.6, 0.7, 0.8, 0.9, 1.0) or abs(
            setting["depth_discount"] * 10 - round(setting["depth_discount"] * 10)) < 1e-9
        assert config.params_of(setting).depth_discount == setting["depth_discount"]
        study.tell(trial, setting["depth_discount"])
