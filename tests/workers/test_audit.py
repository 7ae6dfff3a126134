"""The lossless audit (``workers.audit``): a greedy output that left AR's is a near-tie of the dtype's
rounding or a real mismatch. Planted on the tiny float32 target: the first output token made a near-tie
by moving the runner-up's lm_head row, and a mismatch by picking the least likely token."""

from __future__ import annotations

import copy

import pytest
import torch

from workers.audit import audit, audit_metrics, classify, first_difference, near_tie_tolerance, unexplained_warning
from workers.decoding import ar
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import TreeParams
from workers.models.runner.target import make_target
from workers.prompts import Prompt
from workers.wire import TrialSpec, WorkerConfig
from workers.worker import Worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_tolerance_is_a_few_units_in_the_last_place_of_the_dtype():
    assert near_tie_tolerance(20.0, torch.bfloat16) == 0.5  # 4 ulps of bf16 between 16 and 32 (the largest logit)
    assert near_tie_tolerance(0.3, torch.bfloat16) == 4 * 2.0**-7
    assert near_tie_tolerance(20.0, torch.float16) == 4 * 2.0**-6
    assert near_tie_tolerance(20.0, torch.float32) == 0.0  # float32 runs allow no divergence


def test_classify_and_first_difference():
    logits = torch.tensor([20.0, 19.8, 3.0, -5.0])
    assert classify(logits, [], 0, 1, torch.bfloat16) == (pytest.approx(0.2, abs=1e-5), 0.0, True)
    assert classify(logits, [], 0, 2, torch.bfloat16) == (17.0, 0.0, False)
    assert classify(logits, [], 0, 1, torch.float32)[2] is False
    assert classify(logits, [], 0, None, torch.bfloat16)[2] is False
    # small logits, far below the ulp rule's scale: the gap is a near-tie when another evaluation of the
    # same logits moves it by a quarter of it or more, and not when the two evaluations agree
    small = torch.tensor([1.2, 1.05, -0.3])
    moved = torch.tensor([1.17, 1.06, -0.3])  # the gap moved by 0.04 between the two paths
    gap, noise, near = classify(small, [moved], 0, 1, torch.bfloat16)
    assert gap == pytest.approx(0.15) and noise == pytest.approx(0.04, abs=1e-6) and near
    assert not classify(small, [small.clone()], 0, 1, torch.bfloat16)[2]
    # a path that puts the method's token ahead makes it a near-tie ...
    flipped = torch.tensor([1.11, 1.13, -0.3])
    assert classify(small, [small.clone()], 0, 1, torch.bfloat16, verified=flipped)[2]
    # ... unless the evaluations disagree beyond rounding over the row: then a path is broken, not rounding
    broken = torch.tensor([1.0, 1.1, 2.7])
    assert not classify(small, [small.clone()], 0, 1, torch.bfloat16, verified=broken)[2]
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


@torch.inference_mode()
def test_a_planted_near_tie_is_explained_and_a_planted_mismatch_is_not(tiny):
    model = copy.deepcopy(tiny.model)
    target = make_target(model, tiny.drafter.spec.target_layer_ids)
    prompt = torch.randint(1, tiny.shape.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    head = model.get_output_embeddings()
    seen = {}
    hook = head.register_forward_pre_hook(lambda module, args: seen.__setitem__("hidden", args[0][0, -1].clone()))
    target.start(capacity=16, max_verify=1)
    logits = target.prefill(prompt).logits[-1]
    hook.remove()
    best, runner_up = torch.topk(logits, 2).indices.tolist()
    worst = int(logits.argmin())
    # move the runner-up's row so its logit sits 0.05 below the best one's after this prompt
    hidden = seen["hidden"]
    head.weight[runner_up] += ((logits[best] - 0.05) - logits[runner_up]) * hidden / hidden.dot(hidden)
    config = GenerationConfig(12, stop_token_ids=())
    reference = ar.generate(target, None, prompt, config).token_ids
    assert reference[0] == best
    near = [runner_up] + reference[1:]
    wrong = [worst] + reference[1:]
    found = audit(target, [prompt, prompt, prompt], [near, wrong, reference], [reference] * 3, torch.bfloat16)
    assert [(d.prompt, d.position, d.near_tie) for d in found] == [(0, 0, True), (1, 0, False)]
    assert found[0].gap == pytest.approx(0.05, abs=1e-4)
    assert audit_metrics(found) == {"divergences_near_tie": 1.0, "divergences_unexplained": 1.0}
    assert "LOSSLESS AUDIT: 1 output" in unexplained_warning(found) and unexplained_warning(found[:1]) is None
    # the same near-tie in a float32 run is not rounding: float32 runs allow no divergence
    assert not audit(target, [prompt], [near], [reference], torch.float32)[0].near_tie


def test_a_float32_trial_on_the_cpu_has_no_divergence(tiny):
    worker = Worker(WorkerConfig(target=str(tiny.target_dir), drafter=str(tiny.drafter_dir), dtype="float32",
                                 device="cpu")).load()
    prompts = tuple(Prompt(input_ids=tuple(range(1 + k, 8 + k))) for k in range(3))
    result = worker.run_trial(TrialSpec(TreeParams(8), prompts, max_new_tokens=16, stop_token_ids=()))
    assert result.status == "ok" and result.metrics["lossless_match"] == 1.0
    assert result.metrics["divergences_near_tie"] == 0 and result.metrics["divergences_unexplained"] == 0
    assert result.warnings == []
