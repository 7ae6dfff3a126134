"""Trial metrics from per-prompt generation outputs (names as in DESIGN.md, used everywhere)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from workers.decoding.generation import STAGES, GenerationOutput


def summarize(
    outputs: Sequence[GenerationOutput],
    baseline: Sequence[GenerationOutput] | None = None,
    greedy: bool = True,
) -> dict[str, float | None]:
    """tokens_per_s, tau, tpot_s, ttft_s, speedup, lossless_match, and stage shares of round time.

    tokens_per_s: generated tokens / decode wall time (prefill excluded), summed over prompts.
    tau:          committed tokens per round, bonus included, pooled over all rounds.
    tpot_s:       mean over prompts of decode time / generated tokens; speedup = AR tpot_s / tpot_s.
    lossless_match: share of prompts whose output equals the AR baseline (greedy only, else None).
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
    }
    if baseline is not None:
        base_tpot = mean_tpot(baseline)
        metrics["speedup"] = base_tpot / metrics["tpot_s"] if metrics["tpot_s"] else None
        if greedy:
            same = sum(o.token_ids == b.token_ids for o, b in zip(outputs, baseline, strict=True))
            metrics["lossless_match"] = same / len(outputs)
    staged = sum(sum(o.stage_times.values()) for o in outputs)
    if staged > 0:
        for stage in STAGES:
            metrics[f"share_{stage}"] = sum(o.stage_times.get(stage, 0.0) for o in outputs) / staged
    return metrics


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
