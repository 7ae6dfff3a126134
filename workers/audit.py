"""The lossless audit: why a greedy method's output left the AR baseline's, when it did.

Greedy speculative decoding commits only the target's own argmax, so its output equals AR's token for
token in exact arithmetic. In bf16 on a GPU a verify pass and AR's one-token pass compute the same
logits by different kernels, and round differently: where AR's two best tokens are nearly tied the two
passes may pick different ones, and from there the outputs part. That is a near-tie of the dtype's
rounding, not a bug; anything else is.

For each prompt whose output differs, the audit finds the first position where it leaves AR's and
evaluates the logits there three ways: a prefill over the prompt and AR's tokens up to there; the same
less the last token, then that token advanced alone (AR's own path); and the last few tokens verified
as a chain after a prefill of the rest (the speculative methods' verify path). The three must agree
over the whole vocabulary to within ``ROW_ULPS`` units in the last place of the dtype at the logits'
scale, or one of the paths computes something else and nothing is explained. Agreeing, it is a near-tie
when one of them puts the method's token level with or above AR's, when AR's margin is within
``NOISE_FACTOR`` times how far the evaluations move it, or within ``NEAR_TIE_ULPS`` units in the last
place (bf16: 0.5 at a largest logit of 20). Float32 runs, whose paths agree to float32 rounding, leave
no room for a divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEAR_TIE_ULPS = 4
NOISE_FACTOR = 4  # the method's own passes (its earlier rounds' K/V and state) round further than these
VERIFY_CHAIN = 8  # tokens of the verify pass that re-evaluates the divergence's logits
ROW_ULPS = 32  # how far (in ulps at the logits' scale) three evaluations of one row may drift apart
# explicit mantissa bits of the dtypes a target runs in (float32: divergence is never a near-tie)
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


@dataclass(frozen=True)
class Divergence:
    prompt: int  # index of the prompt in the trial
    position: int  # first output position where the method's token is not AR's
    ar_token: int
    method_token: int | None  # None: the method's output ended before AR's
    gap: float  # AR's logit minus the method token's, at that position (float32)
    noise: float  # how much that gap moved between two evaluations of the same logits
    near_tie: bool


def near_tie_tolerance(scale: float, dtype: torch.dtype) -> float:
    """``NEAR_TIE_ULPS`` units in the last place of ``dtype`` at a logit of size ``scale`` (0: float32)."""
    bits = MANTISSA_BITS.get(dtype)
    if bits is None:
        return 0.0
    exponent = math.floor(math.log2(max(abs(scale), 1.0)))
    return NEAR_TIE_ULPS * 2.0 ** (exponent - bits)


def classify(logits: torch.Tensor, others: list[torch.Tensor], ar_token: int, method_token: int | None,
             dtype: torch.dtype, verified: torch.Tensor | None = None) -> tuple[float, float, bool]:
    """(gap, noise, near tie) of the method's token against AR's in a row of logits [V]: ``others`` are
    the same logits by other paths (the noise is how far they move the gap), ``verified`` by the
    methods' verify path (a gap it closes is a near-tie whatever its size)."""
    if method_token is None:  # the output stopped early: not a rounding question
        return math.inf, 0.0, False

    def margin(row: torch.Tensor) -> float:
        return float(row.float()[ar_token] - row.float()[method_token])

    gap = margin(logits)
    rows = [logits, *others, *([verified] if verified is not None else [])]
    scale = float(logits.float().abs().max())
    spread = max((float((a.float() - b.float()).abs().max()) for a in rows for b in rows), default=0.0)
    if spread > ROW_ULPS / NEAR_TIE_ULPS * near_tie_tolerance(scale, dtype):  # a path computes something else
        return gap, spread, False
    noise = max(abs(gap - margin(row)) for row in rows)
    allowed = max(NOISE_FACTOR * noise, near_tie_tolerance(scale, dtype))
    return gap, noise, gap <= allowed or min(margin(row) for row in rows) <= 0


def first_difference(ar: list[int], method: list[int]) -> int | None:
    """The first position where the two outputs differ (None: equal)."""
    for position, (a, m) in enumerate(zip(ar, method)):
        if a != m:
            return position
    return None if len(ar) == len(method) else min(len(ar), len(method))


@torch.inference_mode()
def audit(target, prompts: list[torch.Tensor], outputs: list[list[int]], baseline: list[list[int]],
          dtype: torch.dtype) -> list[Divergence]:
    """One ``Divergence`` per prompt whose greedy output left AR's (see the module docstring)."""
    found = []
    for index, (prompt_ids, method, ar) in enumerate(zip(prompts, outputs, baseline, strict=True)):
        position = first_difference(ar, method)
        if position is None or position >= len(ar):
            continue
        # AR's token at ``position`` came from the logits after the prompt and AR's first ``position`` tokens
        prefix = torch.cat((prompt_ids[0], torch.tensor(ar[:position], dtype=torch.long)))[None]
        chain = min(VERIFY_CHAIN, prefix.shape[1] - 1)
        target.start(capacity=prefix.shape[1] + 1, max_verify=max(chain, 1))
        logits = target.prefill(prefix).logits[-1].clone()  # [V]
        others, verified = [], None
        if chain > 0:  # the same logits by AR's path (the last token advanced alone) and by a verify pass
            target.start(capacity=prefix.shape[1] + 1, max_verify=chain)
            target.prefill(prefix[:, :-1])
            others.append(target.advance(prefix[0, -1:]).logits[-1].clone())
            target.start(capacity=prefix.shape[1] + 1, max_verify=chain)
            target.prefill(prefix[:, :-chain])
            verified = target.verify_chain(prefix[0, -chain:]).logits[-1]
        method_token = method[position] if position < len(method) else None
        gap, noise, near = classify(logits, others, ar[position], method_token, dtype, verified)
        found.append(Divergence(index, position, ar[position], method_token, gap, noise, near))
    return found


def audit_metrics(divergences: list[Divergence]) -> dict[str, float]:
    """``divergences_near_tie`` and ``divergences_unexplained``: prompts whose output left AR's, by cause."""
    near = sum(d.near_tie for d in divergences)
    return {"divergences_near_tie": float(near), "divergences_unexplained": float(len(divergences) - near)}


def unexplained_warning(divergences: list[Divergence]) -> str | None:
    """The loud line a trial carries when an output left AR's where no near-tie explains it."""
    bad = [d for d in divergences if not d.near_tie]
    if not bad:
        return None
    first = bad[0]
    where = f"prompt {first.prompt}, output position {first.position}"
    what = (f"AR chose {first.ar_token}, the method {first.method_token}, {first.gap:.4g} logits apart where "
            f"three evaluations of them move it by up to {first.noise:.2g}"
            if first.method_token is not None else "the method's output ended first")
    return (f"LOSSLESS AUDIT: {len(bad)} output(s) left the AR baseline's where no near-tie explains it "
            f"(first: {where}: {what}); this is a real mismatch, not rounding")
