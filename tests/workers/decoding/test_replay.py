"""The acceptance replay predicts the engines' per-round acceptance exactly (greedy, float32).

The full proof rides on the exactness suite: ``test_exactness.run`` checks every greedy DFlash and
DDTree run there (all its settings, stop tokens and limits, attention and hybrid targets) against
the replay, round for round. Here: a quick standalone check per target kind, the budget nesting one
table relies on, the width guard, and temperature > 0, where the replay of a sampled continuation
must match the engines' tau on average (not round for round).
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.decoding.test_exactness import (
    BLOCK,
    BUDGETS,
    FIXTURES,
    ar_reference,
    models,
    prompts,
)
from workers.decoding import ddtree, dflash, replay
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import DFlashParams, TreeParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CEILING = max(BUDGETS)
SAMPLED_PROMPTS = 16


def _predicted(table, engine: str, params, block: int) -> list[int]:
    if engine == "dflash":
        return replay.dflash_lengths(table, params.resolved(block).num_draft_tokens)
    return replay.ddtree_lengths(table, params, block, ceiling=CEILING)


def _engine_lengths(tiny, engine: str, prompt, config, params) -> list[int]:
    generate = dflash.generate if engine == "dflash" else ddtree.generate
    return generate(tiny.target, tiny.drafter, prompt, config, params).acceptance_lengths


QUICK_SETTINGS = (("dflash", DFlashParams()), ("dflash", DFlashParams(2)), ("ddtree", TreeParams(8)),
                  ("ddtree", TreeParams(32, 3, 2)), ("ddtree", TreeParams(64, None, None)),
                  ("ddtree", TreeParams(16, depth_discount=0.6)))


@pytest.mark.parametrize("name", FIXTURES)
def test_replay_predicts_the_engines_rounds(request, name):
    """A few settings per target kind, stop tokens included (the exactness suite checks every one of
    its runs the same way: ``test_exactness.run``)."""
    tiny = models(request, name)
    multi = 0
    for index in (0, 5):
        prompt, reference = prompts(name)[index], ar_reference(tiny, name, index)
        for config in (GenerationConfig(20), GenerationConfig(30, stop_token_ids=(reference[9],))):
            table = replay.record(tiny.target, tiny.drafter, prompt, config, top_k=CEILING)
            assert table.tokens == reference[: len(table.tokens)]
            for engine, params in QUICK_SETTINGS:
                measured = _engine_lengths(tiny, engine, prompt, config, params)
                assert _predicted(table, engine, params, BLOCK[name]) == measured, (engine, params, index)
                multi += any(length > 1 for length in measured)
    if name in ("tiny_small_vocab", "tiny_hybrid", "tiny_dflash2", "tiny_hybrid_dflash2"):  # vocab 6: drafts
        # are accepted, the check is not vacuous
        assert multi >= 4, multi


@pytest.mark.parametrize("name", ["tiny_small_vocab", "tiny_dflash2"])
def test_budget_nesting_equals_trees_of_their_own_budget(request, name):
    """A ceiling-budget tree's first B nodes are the budget-B tree (what lets one build serve all),
    DFlash2's lattice trees too."""
    tiny = models(request, name)
    table = replay.record(tiny.target, tiny.drafter, prompts(name)[3], GenerationConfig(24), top_k=64)
    for budget in (1, 2, 5, 16, 63):
        for params in (TreeParams(budget), TreeParams(budget, 3, 2), TreeParams(budget, depth_discount=0.5)):
            own = replay.ddtree_lengths(table, params, BLOCK[name])
            assert replay.ddtree_lengths(table, params, BLOCK[name], ceiling=64) == own


def test_a_table_too_narrow_for_the_setting_is_refused(tiny):
    table = replay.record(tiny.target, tiny.drafter, prompts("tiny")[0], GenerationConfig(8), top_k=4)
    assert table.top_k == 4 and table.vocab_size > 4
    replay.ddtree_lengths(table, TreeParams(32, branching=4), BLOCK["tiny"])  # reads top-4: fine
    with pytest.raises(ValueError, match="top-4"):
        replay.ddtree_lengths(table, TreeParams(32, branching=8), BLOCK["tiny"])


def test_sampled_replay_matches_the_engines_tau_on_average(tiny_small_vocab):
    """T > 0: lossless engines output an AR sample, so replaying sampled continuations gives their
    acceptance in distribution: mean tau over many prompts and seeds agrees (not round for round)."""
    tiny = tiny_small_vocab
    generator = torch.Generator().manual_seed(99)
    settings = [("ddtree", TreeParams(16)), ("dflash", DFlashParams())]
    predicted = {i: [0, 0] for i in range(len(settings))}
    measured = {i: [0, 0] for i in range(len(settings))}
    for seed in range(SAMPLED_PROMPTS):
        prompt = torch.randint(1, 6, (1, 6), generator=generator)
        config = GenerationConfig(max_new_tokens=24, temperature=1.0, seed=seed)
        table = replay.record(tiny.target, tiny.drafter, prompt, GenerationConfig(24, 1.0, (), seed + 1000), top_k=64)
        for i, (engine, params) in enumerate(settings):
            for store, lengths in ((predicted, _predicted(table, engine, params, 6)),
                                   (measured, _engine_lengths(tiny, engine, prompt, config, params))):
                store[i][0] += sum(lengths)
                store[i][1] += len(lengths)
    for i in predicted:
        tau_predicted, tau_measured = predicted[i][0] / predicted[i][1], measured[i][0] / measured[i][1]
        assert tau_measured > 1.05  # drafts really are accepted at T = 1 on this pair
        assert tau_predicted == pytest.approx(tau_measured, rel=0.08), (settings[i], tau_predicted, tau_measured)
