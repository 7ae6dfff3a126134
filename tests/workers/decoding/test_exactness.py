"""Greedy exactness: DFlash and DDTree must reproduce greedy autoregressive output token for token.

Float32 on CPU with the tiny random checkpoints from ``conftest``: Qwen3 targets (vocab 32 / block 8,
and vocab 6 / block 6 where drafts are accepted often) and the hybrids (Qwen3.5 at vocab 6 / block 6,
Qwen3-Next with MoE at vocab 32 / block 8), whose GDN state must fork per tree node; and
DFlash2 drafters on a Qwen3 target and a Qwen3.5 hybrid (vocab 6 / block 6). Every run also goes
through ``check_run``, which checks
the bookkeeping every engine shares (round lengths within their bound, the bonus counted, only the
last round cut short by a stop or the token limit). Runs are logged in ``RUN_LOG`` so the last
test can show the sweep was not vacuous (multi-token rounds really were accepted). Every greedy
speculative run is also checked against the acceptance replay (``workers.decoding.replay``): its
per-round acceptance lengths must be the ones the replay predicts without running the engine.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers.reference import AttentionTarget
from workers.decoding import ar, ddtree, dflash, replay
from workers.decoding.generation import GenerationConfig, GenerationOutput, StageTimer
from workers.decoding.params import DFlashParams, TreeParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# attention-only Qwen3 targets, then hybrids (Qwen3.5 and Qwen3-Next: GDN + attention)
# and DFlash2 drafters (selector chains and lattice trees) on a Qwen3 target and a Qwen3.5 hybrid
FIXTURES = ("tiny", "tiny_small_vocab", "tiny_hybrid", "tiny_next", "tiny_dflash2", "tiny_hybrid_dflash2")
# must match conftest (checked in models())
BLOCK = {"tiny": 8, "tiny_small_vocab": 6, "tiny_hybrid": 6, "tiny_next": 8, "tiny_dflash2": 6,
         "tiny_hybrid_dflash2": 6}
VOCAB = {"tiny": 32, "tiny_small_vocab": 6, "tiny_hybrid": 6, "tiny_next": 32, "tiny_dflash2": 6,
         "tiny_hybrid_dflash2": 6}
ATTENTION_FIXTURES = ("tiny", "tiny_small_vocab")

PROMPT_LENGTHS = (1, 20, 7, 13, 3, 16, 10, 5, 2, 18, 9, 12)  # random prompts of lengths 1..20
REF_TOKENS = 64  # greedy AR reference length per prompt (>= every max_new_tokens used below)
BUDGETS = (1, 2, 3, 5, 8, 16, 32, 64)
BRANCHINGS = (1, 2, 4, None)

RUN_LOG: list[dict] = []  # one entry per speculative run: engine, fixture, tokens, rounds, committed
_PROMPTS: dict[str, list[torch.Tensor]] = {}
_AR_REF: dict[tuple[str, int], list[int]] = {}
_REPLAY: dict[tuple, replay.ReplayTable] = {}
REPLAY_CEILING = max(BUDGETS)  # one tree build per position serves every budget up to this


# --- helpers ---------------------------------------------------------------------------------------




def models(request: pytest.FixtureRequest, name: str):
    tiny = request.getfixturevalue(name)
    assert tiny.shape.block_size == BLOCK[name] and tiny.shape.vocab_size == VOCAB[name]
    return tiny


def prompts(name: str) -> list[torch.Tensor]:
    """Deterministic random token-id prompts [1, T], tokens in 1..vocab-1."""
    if name not in _PROMPTS:
        generator = torch.Generator().manual_seed(1234 + VOCAB[name])
        _PROMPTS[name] = [
            torch.randint(1, VOCAB[name], (1, length), generator=generator, dtype=torch.long)
            for length in PROMPT_LENGTHS
        ]
    return _PROMPTS[name]


def ar_reference(tiny, name: str, index: int) -> list[int]:
    """Greedy AR output of REF_TOKENS tokens for prompt ``index`` (no stops); shorter runs are prefixes."""
    key = (name, index)
    if key not in _AR_REF:
        config = GenerationConfig(max_new_tokens=REF_TOKENS)
        out = ar.generate(tiny.target, None, prompts(name)[index], config)
        check_run(out, "ar", config, max_round=1)
        _AR_REF[key] = out.token_ids
    return _AR_REF[key]


def expected_tokens(reference: list[int], config: GenerationConfig) -> list[int]:
    """What any exact engine must output: the reference cut at the first stop (kept) or the limit."""
    out: list[int] = []
    for token in reference:
        out.append(token)
        if token in config.stop_token_ids or len(out) >= config.max_new_tokens:
            return out
    raise AssertionError("reference too short for this config")


def round_bound(engine: str, params, block_size: int) -> int:
    """Largest tokens one round may commit (bonus included)."""
    if engine == "ar":
        return 1
    if engine == "dflash":
        return params.resolved(block_size).num_draft_tokens + 1
    depth = block_size - 1 if params.max_depth is None else params.max_depth
    return min(depth, params.budget) + 1


ENGINES = {"ar": ar.generate, "dflash": dflash.generate, "ddtree": ddtree.generate}


def run(
    engine: str,
    tiny,
    prompt: torch.Tensor,
    config: GenerationConfig,
    params=None,
    target: AttentionTarget | None = None,
    fixture: str = "",
    timer=None,
) -> GenerationOutput:
    drafter = None if engine == "ar" else tiny.drafter
    kwargs = {} if timer is None else {"timer": timer}
    out = ENGINES[engine](target or tiny.target, drafter, prompt, config, params, **kwargs)
    bound = round_bound(engine, params, tiny.shape.block_size)
    check_run(out, engine, config, bound, timed=timer is not None)
    if engine != "ar" and target is None and config.temperature == 0:
        assert out.acceptance_lengths == replayed_lengths(tiny, fixture, prompt, config, engine, params)
    if engine != "ar":
        RUN_LOG.append(
            {
                "engine": engine,
                "fixture": fixture,
                "tokens": len(out.token_ids),
                "rounds": out.num_rounds,
                "committed": sum(out.acceptance_lengths),
            }
        )
    return out


def replayed_lengths(tiny, fixture: str, prompt: torch.Tensor, config: GenerationConfig, engine: str,
                     params) -> list[int]:
    """The acceptance lengths the replay predicts for this run (one table per prompt and config)."""
    key = (fixture, tuple(prompt[0].tolist()), config.max_new_tokens, config.stop_token_ids)
    if key not in _REPLAY:
        greedy = GenerationConfig(config.max_new_tokens, 0.0, config.stop_token_ids)
        _REPLAY[key] = replay.record(tiny.target, tiny.drafter, prompt, greedy, top_k=REPLAY_CEILING)
    if engine == "dflash":
        return replay.dflash_lengths(_REPLAY[key], params.resolved(tiny.shape.block_size).num_draft_tokens)
    return replay.ddtree_lengths(_REPLAY[key], params, tiny.shape.block_size,
                                 ceiling=max(REPLAY_CEILING, params.budget))


def check_run(
    out: GenerationOutput, engine: str, config: GenerationConfig, max_round: int, timed: bool = False
) -> None:
    tokens, lengths = out.token_ids, out.acceptance_lengths
    stops = set(config.stop_token_ids)
    assert 1 <= len(tokens) <= config.max_new_tokens
    assert len(tokens) == config.max_new_tokens or tokens[-1] in stops, "ended without a reason"
    assert not stops.intersection(tokens[:-1]), "ran past a stop token"
    assert all(1 <= a <= max_round for a in lengths), f"round length outside 1..{max_round}: {lengths}"
    committed = sum(lengths)
    # the first token comes from the prefill; every later token was committed by some round
    assert committed >= len(tokens) - 1, (committed, len(tokens))
    if lengths:
        # only the last round may be cut short (by a stop or the token limit), and never to nothing
        assert committed - (len(tokens) - 1) <= lengths[-1] - 1, (lengths, len(tokens))
    else:
        assert len(tokens) == 1
    if engine == "ar":
        assert lengths == [1] * (len(tokens) - 1)
    assert out.ttft_s >= 0.0 and out.decode_s >= 0.0
    if not timed:
        assert out.stage_times == {}


def ended_mid_round(out: GenerationOutput) -> bool:
    """The last round committed more tokens than the output kept (a stop or the limit cut it)."""
    return sum(out.acceptance_lengths) > len(out.token_ids) - 1


def round_spans(out: GenerationOutput) -> list[tuple[int, int]]:
    """(first, last) output index of the tokens each round committed; index 0 is the prefill token."""
    spans, start = [], 1
    for length in out.acceptance_lengths:
        spans.append((start, start + length - 1))
        start += length
    return spans


# --- AR itself -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURES)
def test_ar_prefixes_and_unit_rounds(request, name):
    tiny = models(request, name)
    for index in (0, 1, 4):
        reference = ar_reference(tiny, name, index)
        for max_new, seed in ((1, 3), (5, 11), (17, 0)):
            config = GenerationConfig(max_new_tokens=max_new, seed=seed)
            out = run("ar", tiny, prompts(name)[index], config)
            assert out.token_ids == reference[:max_new]
            assert out.acceptance_lengths == [1] * (max_new - 1)


# --- DFlash ----------------------------------------------------------------------------------------

# The fast slice (``make test-fast``): every fixture at the default chain and at one and three draft
# tokens; the full matrix (every chain length) runs with the slow tests.
DFLASH_FAST = (None, 1, 3)
DFLASH_CASES = [pytest.param(name, n, marks=() if n in DFLASH_FAST else pytest.mark.slow)
                for name in FIXTURES for n in (None, *range(1, BLOCK[name]))]


@pytest.mark.parametrize(("name", "num_draft"), DFLASH_CASES)
def test_dflash_greedy_equals_ar(request, name, num_draft):
    tiny = models(request, name)
    params = DFlashParams(num_draft)
    start = (num_draft or 0) % len(PROMPT_LENGTHS)
    for k in range(4):
        index = (start + 3 * k) % len(PROMPT_LENGTHS)
        config = GenerationConfig(max_new_tokens=24, seed=100 * k + 7)
        out = run("dflash", tiny, prompts(name)[index], config, params, fixture=name)
        expected = expected_tokens(ar_reference(tiny, name, index), config)
        assert out.token_ids == expected, (index, out.acceptance_lengths)


# --- DDTree ----------------------------------------------------------------------------------------


# The fast slice: per fixture, budgets 1, 5 and 64 at the default depth and at depth 2 (every branching
# comes round with them); the full matrix (every budget at every depth) runs with the slow tests.
DDTREE_FAST = ({1, 5, 64}, {None, 2})


def _ddtree_cases():
    """budget x max_depth per fixture; branching cycles so every (budget, branching) and
    (max_depth, branching) pair also occurs."""
    cases = []
    for name in FIXTURES:
        depths = (None, *range(1, BLOCK[name]))
        for i, budget in enumerate(BUDGETS):
            for j, depth in enumerate(depths):
                branching = BRANCHINGS[(i + j) % len(BRANCHINGS)]
                case_id = f"{name}-B{budget}-D{depth}-K{branching}"
                fast = budget in DDTREE_FAST[0] and depth in DDTREE_FAST[1]
                cases.append(pytest.param(name, budget, depth, branching, id=case_id,
                                          marks=() if fast else pytest.mark.slow))
    return cases


@pytest.mark.parametrize(("name", "budget", "max_depth", "branching"), _ddtree_cases())
def test_ddtree_greedy_equals_ar(request, name, budget, max_depth, branching):
    tiny = models(request, name)
    params = TreeParams(budget=budget, max_depth=max_depth, branching=branching)
    first = (BUDGETS.index(budget) * 5 + (max_depth or 0)) % len(PROMPT_LENGTHS)
    for k, index in enumerate((first, (first + 6) % len(PROMPT_LENGTHS))):
        config = GenerationConfig(max_new_tokens=20, seed=budget * 31 + k)
        out = run("ddtree", tiny, prompts(name)[index], config, params, fixture=name)
        expected = expected_tokens(ar_reference(tiny, name, index), config)
        assert out.token_ids == expected, (index, out.acceptance_lengths)


def test_ddtree_reference_tree_shape_equals_ar(request):
    """The reference algorithm's setting: depth block_size-1, branching >= budget (top-K = min(B, V))."""
    for name in FIXTURES:
        tiny = models(request, name)
        for budget in (16, 64):
            for params in (TreeParams(budget), TreeParams(budget, BLOCK[name] - 1, budget)):
                for index in (2, 9):
                    config = GenerationConfig(max_new_tokens=20)
                    out = run("ddtree", tiny, prompts(name)[index], config, params, fixture=name)
                    assert out.token_ids == expected_tokens(ar_reference(tiny, name, index), config)


# --- stop tokens -----------------------------------------------------------------------------------

STOP_ENGINES = [
    ("dflash", DFlashParams()),
    ("dflash", DFlashParams(3)),
    ("ddtree", TreeParams(8)),
    ("ddtree", TreeParams(32, branching=2)),
    ("ddtree", TreeParams(64, max_depth=4)),
    ("ddtree", TreeParams(24, depth_discount=0.7)),
]


@pytest.mark.parametrize("name", FIXTURES)
def test_stop_tokens_end_every_engine_at_the_same_place(request, name):
    tiny = models(request, name)
    mid_round_stops, used = 0, 0
    for index in range(len(PROMPT_LENGTHS)):
        if used == 4:
            break
        prompt, reference = prompts(name)[index], ar_reference(tiny, name, index)[:40]
        first_seen: dict[int, int] = {}
        for position, token in enumerate(reference):
            first_seen.setdefault(token, position)
        # stop tokens whose first occurrence is mid-output (not the prefill token)
        candidates = sorted(pos for pos in first_seen.values() if pos >= 1)
        if len(candidates) < 2:
            continue  # (the vocab-6 model often settles on one token: nothing to stop on)
        used += 1
        middle = candidates[len(candidates) // 2]

        # AR itself honours the stop (and a set of two stops ends at the earlier one)
        for stops in ((reference[middle],), (reference[middle], reference[candidates[-1]])):
            config = GenerationConfig(max_new_tokens=40, stop_token_ids=stops)
            out = run("ar", tiny, prompt, config)
            assert out.token_ids == reference[: middle + 1]

        for engine, params in STOP_ENGINES:
            free = run(engine, tiny, prompt, GenerationConfig(max_new_tokens=40), params, fixture=name)
            assert free.token_ids == reference
            # search: stops at a first occurrence strictly inside a multi-token round of the free run
            inside = [
                pos
                for first, last in round_spans(free)
                for pos in range(first, min(last, len(reference)))
                if first_seen[reference[pos]] == pos
            ]
            for position in sorted({middle, *inside[:2]}):
                stop = (reference[position],)
                config = GenerationConfig(max_new_tokens=40, stop_token_ids=stop, seed=position)
                out = run(engine, tiny, prompt, config, params, fixture=name)
                assert out.token_ids == reference[: position + 1], (engine, params, position)
                assert out.token_ids[-1] == reference[position]
                if position in inside:
                    # the stop cut a round that accepted more tokens than were kept
                    assert ended_mid_round(out), (out.acceptance_lengths, position)
                    mid_round_stops += 1

        # a stop on the very first token ends right after the prefill, with no rounds
        config = GenerationConfig(max_new_tokens=40, stop_token_ids=(reference[0],))
        for engine, params in [("ar", None), *STOP_ENGINES[::2]]:
            out = run(engine, tiny, prompt, config, params, fixture=name)
            assert out.token_ids == reference[:1] and out.acceptance_lengths == []
    assert used >= 2, "too few prompts with distinct tokens to stop on"
    assert mid_round_stops >= 3, "no stop landed inside a multi-token round: the check is vacuous"


# --- max_new_tokens landing mid-round --------------------------------------------------------------

LIMIT_ENGINES = [
    ("ar", None),
    ("dflash", DFlashParams()),
    ("dflash", DFlashParams(2)),
    ("ddtree", TreeParams(8)),
    ("ddtree", TreeParams(32, max_depth=3, branching=2)),
    ("ddtree", TreeParams(64)),
]
LIMITS = (1, 2, 3, 7, 13, 50)


@pytest.mark.parametrize("name", FIXTURES)
def test_max_new_tokens_cuts_exactly(request, name):
    tiny = models(request, name)
    mid_round = dict.fromkeys(LIMITS, 0)  # runs whose last round accepted more than was still needed
    for max_new in LIMITS:
        for engine, params in LIMIT_ENGINES:
            for index in (1, 6, 8):
                config = GenerationConfig(max_new_tokens=max_new, seed=index)
                out = run(engine, tiny, prompts(name)[index], config, params, fixture=name)
                expected = ar_reference(tiny, name, index)[:max_new]
                assert out.token_ids == expected, (max_new, engine, params, index)
                assert len(out.token_ids) == max_new
                mid_round[max_new] += ended_mid_round(out)
    assert mid_round[1] == 0  # the prefill token alone: no round at all
    assert sum(mid_round.values()) >= 5, f"too few runs ended inside a round: {mid_round}"
    if name == "tiny_small_vocab":  # drafts are accepted often here: every limit >= 2 was cut mid-round
        assert all(mid_round[n] > 0 for n in LIMITS[1:]), mid_round


# --- stage timer -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "params", "stages"),
    [
        ("ar", None, {"verify", "commit"}),
        ("dflash", DFlashParams(), {"draft", "verify", "commit"}),
        ("ddtree", TreeParams(16, branching=4), {"draft", "tree", "verify", "commit"}),
    ],
)
def test_stage_timer_records_stages(tiny, engine, params, stages):
    timer = StageTimer()
    config = GenerationConfig(max_new_tokens=12)
    out = run(engine, tiny, prompts("tiny")[1], config, params, timer=timer, fixture="tiny")
    assert out.num_rounds >= 1
    assert set(out.stage_times) == stages
    assert all(seconds > 0.0 for seconds in out.stage_times.values()), out.stage_times
    assert out.stage_times == timer.totals
    assert out.token_ids == expected_tokens(ar_reference(tiny, "tiny", 1), config)


# --- settings outside the drafter's block are refused ---------------------------------------------


def test_out_of_range_settings_are_refused(tiny):
    prompt, config = prompts("tiny")[2], GenerationConfig(max_new_tokens=4)
    block = tiny.shape.block_size
    for bad in (0, block):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            dflash.generate(tiny.target, tiny.drafter, prompt, config, DFlashParams(bad))
    with pytest.raises(ValueError, match="max_depth"):
        ddtree.generate(tiny.target, tiny.drafter, prompt, config, TreeParams(8, max_depth=block))
    for kwargs in ({"budget": 0}, {"budget": 4, "max_depth": 0}, {"budget": 4, "branching": 0}):
        with pytest.raises(ValueError):
            TreeParams(**kwargs)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(max_new_tokens=4, temperature=-0.5)


# --- the sweep was not vacuous (keep last: it reads RUN_LOG) -------------------------------------


def test_speculative_runs_accepted_multi_token_rounds(request):
    # After the whole module RUN_LOG holds 600+ runs. Selected alone (e.g. under -k), run a sweep of
    # default settings first so the assertions below still mean something.
    standalone = len(RUN_LOG) < 100
    defaults = (("dflash", DFlashParams()), ("ddtree", TreeParams(16)))
    for name, (engine, params) in itertools.product(FIXTURES, defaults):
        tiny = models(request, name)
        for index in range(len(PROMPT_LENGTHS)) if standalone else (0, 2):
            config = GenerationConfig(max_new_tokens=24)
            out = run(engine, tiny, prompts(name)[index], config, params, fixture=name)
            assert out.token_ids == expected_tokens(ar_reference(tiny, name, index), config)

    for engine in ("dflash", "ddtree"):
        runs = [r for r in RUN_LOG if r["engine"] == engine and r["rounds"] > 0]
        multi = [r for r in runs if r["committed"] > r["rounds"]]
        assert all(r["committed"] >= r["tokens"] - 1 for r in runs)
        assert len(multi) >= 8, f"{engine}: only {len(multi)} of {len(runs)} runs accepted a drafted token"
        # accepting drafts must also save rounds: fewer rounds than tokens after the first
        assert sum(r["rounds"] for r in multi) < sum(r["tokens"] - 1 for r in multi)
    spec = [r for r in RUN_LOG if r["rounds"] > 0]
    assert sum(r["committed"] > r["rounds"] for r in spec) >= 0.3 * len(spec)
    for name in FIXTURES:  # every target kind (hybrids included) really accepted drafted tokens
        for engine in ("dflash", "ddtree"):
            runs = [r for r in spec if r["fixture"] == name and r["engine"] == engine]
            multi = sum(r["committed"] > r["rounds"] for r in runs)
            if len(runs) < 10:  # only a -k selection leaves a fixture this few runs
                continue
            assert multi >= 3, f"{name} / {engine}: only {multi} of {len(runs)} runs accepted a drafted token"
