"""Autoregressive decoding: the baseline every speculative method is measured against.

Each round feeds the last token (``advance``: kept as it is verified, so no separate commit) and
samples one more; ``acceptance_lengths`` is all ones.
"""

from __future__ import annotations

import torch

from workers.decoding.generation import NULL_TIMER, GenerationConfig, GenerationOutput, open_generation
from workers.decoding.params import ARParams
from workers.decoding.replay import ReplayTable, ar_lengths
from workers.decoding.sampling import sample_tokens
from workers.seam import Target, Timer


@torch.inference_mode()
def generate(
    target: Target,
    drafter: None,
    prompt_ids: torch.Tensor,  # [1, T]
    config: GenerationConfig,
    params: ARParams | None = None,
    timer: Timer = NULL_TIMER,
) -> GenerationOutput:
    start = open_generation(target, prompt_ids, config, max_verify=1)
    out, generator, bonus = start.out, start.generator, start.bonus

    rounds: list[int] = []
    while not out.done:
        with timer.stage("verify"):  # the token is kept whatever comes next: one pass that also commits it
            logits = target.advance(bonus).logits  # [1, V]
        with timer.stage("commit"):
            bonus = sample_tokens(logits, config.temperature, generator)
            out.extend([int(bonus.item())])  # sync: one token per round reaches the host
        rounds.append(1)

    ttft, decode = start.clock.finish()
    return GenerationOutput(out.tokens, rounds, dict(timer.totals), ttft, decode)


# -- its rounds replayed from one AR run (``methods.MethodEntry.replay_lengths``) -----------------------


def replay_lengths(table: ReplayTable, params: ARParams, block_size: int | None,
                   ceiling: int | None = None) -> list[int]:
    return ar_lengths(table)
