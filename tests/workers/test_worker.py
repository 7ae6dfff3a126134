"""The worker class: metrics of a trial, the AR baseline measured beside it, OOM and error results."""

from __future__ import annotations

import pytest
import torch

from workers.decoding.methods import METHODS, Method
from workers.decoding.params import TreeParams
from workers.prompts import Prompt
from workers.wire import TrialSpec, WorkerConfig
from workers.worker import WARMUP_TOKENS, Worker


@pytest.fixture(scope="module")
def worker(tiny) -> Worker:
    config = WorkerConfig(target=str(tiny.target_dir), drafter=str(tiny.drafter_dir), dtype="float32", device="cpu")
    return Worker(config).load()


def _prompts(count: int = 3, seed: int = 0) -> tuple[Prompt, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(Prompt(input_ids=tuple(torch.randint(1, 32, (9,), generator=generator).tolist()))
                 for _ in range(count))


def _spec(method: Method, fault: str | None = None, stage_timing: bool = False, repeats: int = 1,
          baseline: bool = True, **knobs) -> TrialSpec:
    params = METHODS[method].params.from_mapping(knobs)
    return TrialSpec(params=params, prompts=_prompts(), max_new_tokens=24, stop_token_ids=(), fault=fault,
                     stage_timing=stage_timing, repeats=repeats, baseline=baseline)


@pytest.mark.parametrize(
    "method, params",
    [(Method.AR, {}), (Method.DFLASH, {"num_draft_tokens": 4}), (Method.DDTREE, {"tree_budget": 16, "branching": 4})],
)
def test_trial_reports_the_design_metrics(worker, method, params):
    result = worker.run_trial(_spec(method, stage_timing=True, **params))
    assert result.status == "ok", result.error
    m = result.metrics
    for name in ("tokens_per_s", "tau", "speedup", "ttft_s", "tpot_s", "lossless_match", "peak_memory_gib"):
        assert name in m, name
    assert m["lossless_match"] == 1.0  # greedy, float32: identical to AR
    assert m["tokens_per_s"] > 0 and m["ttft_s"] > 0 and m["tpot_s"] > 0
    assert len(result.outputs) == 3 and all(len(o.token_ids) == 24 for o in result.outputs)
    rounds = sum(result.acceptance_histogram.values())
    committed = sum(length * count for length, count in result.acceptance_histogram.items())
    assert m["tau"] == pytest.approx(committed / rounds)
    # CPU: the trace is the actor process's resident memory, and the peak is a real number.
    assert result.memory_trace.kind == "process_rss" and len(result.memory_trace.samples) >= 2
    assert m["peak_memory_gib"] > 0.01 and not any(k.startswith("peak_memory_gib_dev") for k in m)
    assert m["tokens_per_s_median"] > 0 and m["tokens_per_s_iqr"] >= 0
    assert m["baseline_tokens_per_s"] > 0 and m["baseline_tpot_s"] > 0
    if method is Method.AR:
        assert m["tau"] == 1.0 and set(result.acceptance_histogram) == {1}
    else:
        assert m["share_draft"] > 0 and m["share_verify"] > 0
    payload = result.to_json()
    assert payload["method"] == method.value
    assert {k: v for k, v in payload["params"].items() if v is not None} == params


def test_stage_timing_is_off_unless_asked(worker):
    result = worker.run_trial(_spec(Method.DDTREE, tree_budget=8))
    assert result.status == "ok" and not any(name.startswith("share_") for name in result.metrics)


def test_the_baseline_runs_warm_beside_each_prompt(worker, monkeypatch):
    """Warm-ups of AR and of the method first, then AR just before the method on every prompt: the
    speedup compares runs of the same moment, never a cold first AR."""
    from workers.decoding import ar, ddtree

    calls = []

    def recording(name, engine):
        def run(target, drafter, prompt_ids, config, params, **kwargs):
            calls.append((name, config.max_new_tokens))
            return engine(target, drafter, prompt_ids, config, params, **kwargs)
        return run

    monkeypatch.setattr(ar, "generate", recording("ar", ar.generate))
    monkeypatch.setattr(ddtree, "generate", recording("ddtree", ddtree.generate))
    result = worker.run_trial(_spec(Method.DDTREE, tree_budget=8))
    assert result.status == "ok", result.error
    prompts = len(_prompts())
    warm = min(WARMUP_TOKENS, 24)
    assert calls == [("ar", warm), ("ddtree", warm)] + [("ar", 24), ("ddtree", 24)] * prompts
    assert result.metrics["baseline_tokens_per_s"] > 0 and result.metrics["lossless_match"] == 1.0
    calls.clear()
    assert worker.run_trial(_spec(Method.DDTREE, tree_budget=8, baseline=False)).status == "ok"
    assert calls == [("ddtree", warm)] + [("ddtree", 24)] * prompts  # no AR at all without a baseline


def test_oom_is_a_result_and_the_worker_stays_usable(worker):
    result = worker.run_trial(_spec(Method.DDTREE, tree_budget=8, fault="oom"))
    assert result.status == "oom" and "out of memory" in result.error
    assert "peak_memory_gib" in result.metrics
    after = worker.run_trial(_spec(Method.DDTREE, tree_budget=8))
    assert after.status == "ok"


def test_errors_are_results_with_the_message(worker):
    crashed = worker.run_trial(_spec(Method.DFLASH, fault="error"))
    assert crashed.status == "error" and "injected failure" in crashed.error
    too_deep = worker.run_trial(_spec(Method.DDTREE, tree_budget=8, max_depth=99))
    assert too_deep.status == "error" and "max_depth" in too_deep.error
    with pytest.raises(ValueError, match="tree_budget is required"):  # a DDTree trial cannot exist without one
        _spec(Method.DDTREE)
    with pytest.raises(ValueError, match="not a parameter of this method: num_draft_tokens"):
        _spec(Method.DDTREE, tree_budget=8, num_draft_tokens=3)
    assert TreeParams(8).resolved(8).max_depth == 7  # the default depth: block_size-1
    assert worker.run_trial(_spec(Method.AR)).status == "ok"


def test_method_needing_a_drafter_without_one(tiny):
    bare = Worker(WorkerConfig(target=str(tiny.target_dir), dtype="float32", device="cpu")).load()
    result = bare.run_trial(_spec(Method.DFLASH))
    assert result.status == "error" and "needs a drafter" in result.error
    assert bare.run_trial(_spec(Method.AR)).status == "ok"


def test_stop_tokens_default_to_the_target_eos(worker):
    spec = TrialSpec(METHODS[Method.AR].params(), prompts=_prompts(), max_new_tokens=8)
    prompts, gen = worker._prepare(spec)
    assert gen.stop_token_ids == (0,)  # tiny models declare eos_token_id 0


def test_repeats_measure_each_prompt_again_and_keep_its_tokens(worker):
    once = worker.run_trial(_spec(Method.DDTREE, tree_budget=8))
    thrice = worker.run_trial(_spec(Method.DDTREE, tree_budget=8, repeats=3))
    assert thrice.status == "ok", thrice.error
    assert [o.token_ids for o in thrice.outputs] == [o.token_ids for o in once.outputs]
    assert thrice.metrics["lossless_match"] == 1.0
    assert thrice.metrics["baseline_tokens_per_s"] > 0  # the AR baseline is measured with the same repeats
