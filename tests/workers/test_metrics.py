"""Metrics from per-prompt outputs: the per-prompt spread beside the pooled figure, the median of
repeated measurements, the acceptance histogram's scalar columns."""

from __future__ import annotations

import pytest

from workers.decoding.generation import GenerationOutput
from workers.metrics import acceptance_columns, median_run, pooled_interval, quantile, spread, summarize


def _out(tokens: int, decode_s: float, lengths: list[int] | None = None) -> GenerationOutput:
    return GenerationOutput(list(range(tokens)), lengths or [1] * tokens, {}, 0.01, decode_s)


def test_spread_sits_beside_the_pooled_figure():
    # Two fast prompts and a slow one: the pooled figure is pulled down by the slow one.
    outputs = [_out(10, 0.25), _out(10, 0.25), _out(10, 1.0)]  # 40, 40 and 10 tokens/s per prompt
    m = summarize(outputs)
    assert m["tokens_per_s"] == pytest.approx(30 / 1.5)
    assert m["tokens_per_s_median"] == pytest.approx(40.0)
    assert m["tokens_per_s_iqr"] == pytest.approx(40.0 - 25.0)  # p75 = 40, p25 = 25 (linear)
    assert m["baseline_tokens_per_s"] is None
    with_base = summarize(outputs, baseline=[_out(10, 0.5)] * 3)
    assert with_base["baseline_tokens_per_s"] == pytest.approx(20.0)
    assert with_base["speedup"] == pytest.approx(0.05 / with_base["tpot_s"])


def test_quantile_matches_linear_interpolation():
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.25) == 2.0
    assert quantile([7.0], 0.9) == 7.0
    assert spread([]) == {"tokens_per_s_median": None, "tokens_per_s_iqr": None}


def test_median_run_is_a_run_that_happened():
    runs = [_out(8, 0.3), _out(8, 0.1), _out(8, 0.9)]
    assert median_run(runs) is runs[0]
    even = [_out(8, 0.4), _out(8, 0.2)]
    assert median_run(even) is even[1]  # the lower median


def test_acceptance_columns_give_the_table_something_to_show():
    columns = acceptance_columns({1: 2, 3: 6, 4: 2})
    assert columns["accept_share_len1"] == 0.2 and columns["accept_share_len2"] == 0.0
    assert columns["accept_share_len3"] == 0.6 and columns["accept_share_len4"] == 0.2
    assert columns["accept_len_median"] == 3.0
    assert columns["accept_len_p90"] == pytest.approx(4.0)
    assert sum(v for k, v in columns.items() if k.startswith("accept_share")) == pytest.approx(1.0)
    assert acceptance_columns({}) == {}


def test_the_bootstrap_interval_holds_the_pooled_speed_and_is_seeded():
    outputs = [GenerationOutput(list(range(n)), [1] * n, {}, 0.01, n / speed)
               for n, speed in ((40, 100.0), (40, 120.0), (40, 80.0), (40, 110.0))]
    interval = pooled_interval(outputs)
    pooled = summarize(outputs)["tokens_per_s"]
    assert interval["tokens_per_s_ci_low"] <= pooled <= interval["tokens_per_s_ci_high"]
    assert 80.0 <= interval["tokens_per_s_ci_low"] < interval["tokens_per_s_ci_high"] <= 120.0
    assert pooled_interval(outputs) == interval  # the same resamples every time
    assert pooled_interval(outputs[:1]) == {"tokens_per_s_ci_low": None, "tokens_per_s_ci_high": None}
