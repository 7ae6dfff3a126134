"""Autoregressive decoding: the baseline every speculative method is measured against.

Each round feeds the last token (``advance``: kept as it is verified, so no separate commit) and
samples one more; ``acceptance_lengths`` is all ones. The next pass is queued before the host waits
for a token: it feeds on the sampled token where it lies on the device, so the GPU never idles
while the host reads a token and launches the next step (a serving engine's AR loop does the same;
a baseline that idled would flatter every speculative speedup). A stop token found that way leaves
one queued pass, whose result is dropped; the decode time ends when the last token reached the host.
"""

from __future__ import annotations

import time

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
    out, generator = start.out, start.generator

    def step(token: torch.Tensor) -> torch.Tensor:  # [1] on the device -> the next token [1], queued
        with timer.stage("verify"):  # the token is kept whatever comes next: one pass that also commits it
            return sample_tokens(target.advance(token).logits, config.temperature, generator)

    rounds: list[int] = []
    ahead = None if out.done else step(start.bonus)
    ended_at = None
    while ahead is not None:
        token = ahead
        ahead = None if len(out.tokens) + 1 >= out.max_new_tokens else step(token)  # the limit ends it here
        with timer.stage("commit"):
            out.extend([int(token.item())])  # sync: this token's pass; the next one is queued behind it
        ended_at = time.perf_counter()
        rounds.append(1)
        if out.done:
            break

    ttft, decode = start.clock.finish(ended_at)
    return GenerationOutput(out.tokens, rounds, dict(timer.totals), ttft, decode)


# -- its rounds replayed from one AR run (``methods.MethodEntry.replay_lengths``) -----------------------


def replay_lengths(table: ReplayTable, params: ARParams, block_size: int | None,
                   ceiling: int | None = None) -> list[int]:
    return ar_lengths(table)
