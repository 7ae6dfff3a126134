"""Trial metrics from per-prompt generation outputs (names as in DESIGN.md, used everywhere)."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from workers.decoding.params import STAGES

if TYPE_CHECKING:
    from workers.decoding.generation import GenerationOutput


def summarize(
    outputs: Sequence[GenerationOutput],
    baseline: Sequence[GenerationOutput] | None = None,
    greedy: bool = True,
) -> dict[str, float | None]:
    """tokens_per_s (and its per-prompt spread), tau, tpot_s, ttft_s, speedup, lossless_match, stage shares.

    tokens_per_s: generated tokens / decode wall time (prefill excluded), summed over prompts.
    tokens_per_s_median, tokens_per_s_iqr: median and interquartile range (p75 - p25) of the
                  per-prompt tokens/s, the spread a pooled figure hides.
    tau:          committed tokens per round, bonus included, pooled over all rounds.
    tpot_s:       mean over prompts of decode time / generated tokens; speedup = AR tpot_s / tpot_s.
    lossless_match: share of prompts whose output equals the AR baseline (greedy only, else None).
    baseline_tokens_per_s, baseline_tpot_s: the AR baseline's own figures (None without a baseline).
    """
    tokens = sum(len(o.token_ids) for o in outputs)
    decode_s = sum(o.decode_s for o in outputs)
    rounds = sum(o.num_rounds for o in outputs)
    metrics: dict[str, float | None] = {
        "tokens_per_s": tokens / decode_s if decode_s > 0 else 0.0,
        "tau": sum(sum(o.acceptance_lengths) for o in outputs) / rounds if rounds else 0.0,
        "tpot_s": mean_tpot(outputs),
        "ttft_s": sum(o.ttft_s for o in outputs) / len(outputs),
        "generated_tokens": float(tokens),
        "rounds": float(rounds),
        "speedup": None,
        "lossless_match": None,
        "baseline_tokens_per_s": None,
        "baseline_tpot_s": None,
    }
    metrics |= spread(per_prompt_tokens_per_s(outputs))
    metrics |= pooled_interval(outputs)
    if baseline is not None:
        base_tpot = mean_tpot(baseline)
        base_tokens, base_s = sum(len(b.token_ids) for b in baseline), sum(b.decode_s for b in baseline)
        metrics["baseline_tokens_per_s"] = base_tokens / base_s if base_s > 0 else 0.0
        metrics["baseline_tpot_s"] = base_tpot
        metrics["speedup"] = base_tpot / metrics["tpot_s"] if metrics["tpot_s"] else None
        if greedy:
            same = sum(o.token_ids == b.token_ids for o, b in zip(outputs, baseline, strict=True))
            metrics["lossless_match"] = same / len(outputs)
    staged = sum(sum(o.stage_times.values()) for o in outputs)
    if staged > 0:
        for stage in STAGES:
            metrics[f"share_{stage}"] = sum(o.stage_times.get(stage, 0.0) for o in outputs) / staged
    return metrics


def per_prompt_tokens_per_s(outputs: Sequence[GenerationOutput]) -> list[float]:
    return [len(o.token_ids) / o.decode_s for o in outputs if o.token_ids and o.decode_s > 0]


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty sequence."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float], name: str = "tokens_per_s") -> dict[str, float | None]:
    """``<name>_median`` and ``<name>_iqr`` (p75 - p25) of per-prompt (or per-repeat) values."""
    if not values:
        return {f"{name}_median": None, f"{name}_iqr": None}
    return {f"{name}_median": quantile(values, 0.5), f"{name}_iqr": quantile(values, 0.75) - quantile(values, 0.25)}


BOOTSTRAP_SAMPLES = 400


def pooled_interval(outputs: Sequence[GenerationOutput], level: float = 0.95,
                    seed: int = 0) -> dict[str, float | None]:
    """``tokens_per_s_ci_low`` / ``_high``: a bootstrap interval of the pooled tokens/s over the prompts
    (the prompts resampled with replacement, ``BOOTSTRAP_SAMPLES`` times, seeded): how much the figure
    rests on which prompts were drawn. None with fewer than two prompts."""
    pairs = [(len(o.token_ids), o.decode_s) for o in outputs if o.decode_s > 0]
    if len(pairs) < 2:
        return {"tokens_per_s_ci_low": None, "tokens_per_s_ci_high": None}
    rng = random.Random(seed)
    pooled = []
    for _ in range(BOOTSTRAP_SAMPLES):
        sample = rng.choices(pairs, k=len(pairs))
        pooled.append(sum(t for t, _ in sample) / sum(s for _, s in sample))
    tail = (1 - level) / 2
    return {"tokens_per_s_ci_low": quantile(pooled, tail), "tokens_per_s_ci_high": quantile(pooled, 1 - tail)}


def median_run(runs: Sequence[GenerationOutput]) -> GenerationOutput:
    """Of several measurements of one prompt, the one with the median decode time (the lower median
    for an even count, so the result is always a run that happened)."""
    chosen = statistics.median_low([run.decode_s for run in runs])
    return next(run for run in runs if run.decode_s == chosen)


def mean_tpot(outputs: Sequence[GenerationOutput]) -> float:
    per_prompt = [o.decode_s / len(o.token_ids) for o in outputs if o.token_ids]
    return sum(per_prompt) / len(per_prompt) if per_prompt else 0.0


def acceptance_histogram(outputs: Sequence[GenerationOutput]) -> dict[int, int]:
    """Rounds per committed length (1 = only the bonus)."""
    counts = Counter(length for o in outputs for length in o.acceptance_lengths)
    return dict(sorted(counts.items()))


CATEGORY_METRICS = ("tokens_per_s", "tau", "speedup")


def per_category(
    prompts: Sequence, outputs: Sequence[GenerationOutput], baseline: Sequence[GenerationOutput] | None
) -> dict[str, float | None]:
    """``tau.<category>``, ``tokens_per_s.<category>``, ``speedup.<category>`` when prompts carry categories."""
    categories = sorted({p.category for p in prompts if p.category})
    metrics: dict[str, float | None] = {}
    for category in categories:
        chosen = [i for i, p in enumerate(prompts) if p.category == category]
        subset_base = [baseline[i] for i in chosen] if baseline is not None else None
        subset = summarize([outputs[i] for i in chosen], subset_base)
        for name in CATEGORY_METRICS:
            metrics[f"{name}.{category}"] = subset[name]
    return metrics


def acceptance_columns(histogram: dict[int, int]) -> dict[str, float]:
    """Scalars that summarise the acceptance histogram in one row of a runs table.

    ``accept_len_median`` and ``accept_len_p90``: committed tokens per round (bonus included) at the
    median and 90th percentile round; ``accept_share_len{k}``: share of rounds that committed k
    tokens, for every k from 1 to the longest seen (zeros kept, so columns line up across runs).
    """
    rounds = sum(histogram.values())
    if rounds == 0:
        return {}
    lengths = [length for length, count in sorted(histogram.items()) for _ in range(count)]
    out = {"accept_len_median": quantile(lengths, 0.5), "accept_len_p90": quantile(lengths, 0.9)}
    for length in range(1, max(histogram) + 1):
        out[f"accept_share_len{length}"] = histogram.get(length, 0) / rounds
    return out
