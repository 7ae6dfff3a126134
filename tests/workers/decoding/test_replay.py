"""The acceptance replay predicts the engines' per-round acceptance exactly (greedy, float32).

Every setting the exactness suite uses (DFlash lengths, the DDTree budget x depth x branching cases,
the stop-token and token-limit settings), on the attention and the hybrid tiny targets: the real
engine runs, and its ``acceptance_lengths`` must equal the replay's, round for round. One replay
table per prompt and config serves every setting (budgets nested under one ceiling, as a sweep uses
it). At temperature > 0 the replay of a sampled continuation must match the engines' tau on average.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.decoding.test_exactness import (
    BLOCK,
    BUDGETS,
    DFLASH_CASES,
    FIXTURES,
    LIMIT_ENGINES,
    LIMITS,
    PROMPT_LENGTHS,
    STOP_ENGINES,
    _ddtree_cases,
    ar_reference,
    models,
    prompts,
)
from workers.decoding import ddtree, dflash, replay
from workers.decoding.dflash import DFlashParams
from workers.decoding.generation import GenerationConfig
from workers.decoding.tree import TreeParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CEILING = max(BUDGETS)


def _predicted(table, engine: str, params, block: int) -> list[int]:
    if engine == "dflash":
        return replay.dflash_lengths(table, params.resolve(block))
    return replay.ddtree_lengths(table, params, block, ceiling=CEILING)


def _engine_lengths(tiny, engine: str, prompt, config, params) -> list[int]:
    generate = dflash.generate if engine == "dflash" else ddtree.generate
    return generate(tiny.target, tiny.drafter, prompt, config, params).acceptance_lengths


def _settings(name: str) -> list[tuple[str, object]]:
    """The exactness suite's settings for this fixture (DFlash cases, DDTree cases, reference shape)."""
    settings = [("dflash", DFlashParams(n)) for fixture, n in DFLASH_CASES if fixture == name]
    for case in _ddtree_cases():
        fixture, budget, depth, branching = case.values
        if fixture == name:
            settings.append(("ddtree", TreeParams(budget, depth, branching)))
    for budget in (16, 64):
        settings += [("ddtree", TreeParams(budget)), ("ddtree", TreeParams(budget, BLOCK[name] - 1, budget))]
    return settings


@pytest.mark.parametrize("name", FIXTURES)
def test_replay_predicts_every_exactness_setting(request, name):
    tiny = models(request, name)
    config = GenerationConfig(max_new_tokens=20)
    tables = {}
    multi = 0
    for count, (engine, params) in enumerate(_settings(name)):
        index = count % len(PROMPT_LENGTHS)
        if index not in tables:
            tables[index] = replay.record(tiny.target, tiny.drafter, prompts(name)[index], config, top_k=CEILING)
            assert tables[index].tokens[:20] == ar_reference(tiny, name, index)[:20]
        measured = _engine_lengths(tiny, engine, prompts(name)[index], config, params)
        assert _predicted(tables[index], engine, params, BLOCK[name]) == measured, (engine, params, index)
        multi += any(length > 1 for length in measured)
    assert multi >= 5, f"only {multi} runs accepted a drafted token: the comparison is vacuous"


@pytest.mark.parametrize("name", FIXTURES)
def test_replay_follows_stop_tokens_and_limits(request, name):
    tiny = models(request, name)
    checked = 0
    for index in (1, 6, 8):
        prompt, reference = prompts(name)[index], ar_reference(tiny, name, index)
        stop_configs = [GenerationConfig(max_new_tokens=40, stop_token_ids=(reference[0],))]  # no rounds at all
        later = [token for position, token in enumerate(reference[:40]) if position >= 3 and token not in reference[:position]]
        if later:
            stop_configs.append(GenerationConfig(max_new_tokens=40, stop_token_ids=(later[0],)))
        for config in stop_configs:
            table = replay.record(tiny.target, tiny.drafter, prompt, config, top_k=CEILING)
            for engine, params in STOP_ENGINES:
                assert _predicted(table, engine, params, BLOCK[name]) == _engine_lengths(tiny, engine, prompt, config, params)
                checked += 1
        for limit in LIMITS:
            config = GenerationConfig(max_new_tokens=limit)
            table = replay.record(tiny.target, tiny.drafter, prompt, config, top_k=CEILING)
            for engine, params in LIMIT_ENGINES:
                if engine == "ar":
                    continue
                assert _predicted(table, engine, params, BLOCK[name]) == _engine_lengths(tiny, engine, prompt, config, params)
                checked += 1
    assert checked >= 3 * (len(LIMITS) * 5 + len(STOP_ENGINES))


def test_budget_nesting_equals_trees_of_their_own_budget(tiny_small_vocab):
    """A ceiling-budget tree's first B nodes are the budget-B tree (what lets one build serve all)."""
    tiny = tiny_small_vocab
    table = replay.record(tiny.target, tiny.drafter, prompts("tiny_small_vocab")[3], GenerationConfig(24), top_k=64)
    for budget in (1, 2, 5, 16, 63):
        for params in (TreeParams(budget), TreeParams(budget, 3, 2)):
            own = replay.ddtree_lengths(table, params, BLOCK["tiny_small_vocab"])
            assert replay.ddtree_lengths(table, params, BLOCK["tiny_small_vocab"], ceiling=64) == own


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
    settings = [("ddtree", TreeParams(8)), ("ddtree", TreeParams(32, 3, 2)), ("dflash", DFlashParams())]
    predicted = {i: [0, 0] for i in range(len(settings))}
    measured = {i: [0, 0] for i in range(len(settings))}
    for seed in range(24):
        prompt = torch.randint(1, 6, (1, 6), generator=generator)
        config = GenerationConfig(max_new_tokens=32, temperature=1.0, seed=seed)
        table = replay.record(tiny.target, tiny.drafter, prompt, GenerationConfig(32, 1.0, (), seed + 1000), top_k=64)
        for i, (engine, params) in enumerate(settings):
            for store, lengths in ((predicted, _predicted(table, engine, params, 6)),
                                   (measured, _engine_lengths(tiny, engine, prompt, config, params))):
                store[i][0] += sum(lengths)
                store[i][1] += len(lengths)
    for i in predicted:
        tau_predicted, tau_measured = predicted[i][0] / predicted[i][1], measured[i][0] / measured[i][1]
        assert tau_measured > 1.2  # drafts really are accepted at T = 1 on this pair
        assert tau_predicted == pytest.approx(tau_measured, rel=0.12), (settings[i], tau_predicted, tau_measured)
