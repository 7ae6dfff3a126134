"""Autoregressive decoding: the baseline every speculative method is measured against.

Each round feeds the last token and samples one more; ``acceptance_lengths`` is all ones.
"""

from __future__ import annotations

import torch

from workers.generation import NULL_TIMER, Clock, GenerationConfig, GenerationOutput, OutputBuffer
from workers.sampling import make_generator, sample_tokens
from workers.target import AttentionTarget


@torch.inference_mode()
def generate(
    target: AttentionTarget,
    drafter: None,
    prompt_ids: torch.Tensor,  # [1, T]
    config: GenerationConfig,
    params: None = None,
    timer=NULL_TIMER,
) -> GenerationOutput:
    clock = Clock(target.device)
    target.start(capacity=prompt_ids.shape[1] + config.max_new_tokens + 1, max_verify=1)
    prefill = target.prefill(prompt_ids)
    generator = make_generator(config.seed, prefill.logits.device)
    bonus = sample_tokens(prefill.logits[-1:], config.temperature, generator)  # [1]
    out = OutputBuffer(config)
    out.extend([int(bonus.item())])  # sync: the token must reach the host to check stop tokens
    clock.first_token()

    rounds: list[int] = []
    while not out.done:
        with timer.stage("verify"):
            logits = target.verify_chain(bonus).logits  # [1, V]
        with timer.stage("commit"):
            bonus = sample_tokens(logits, config.temperature, generator)
            target.commit(torch.zeros(1, dtype=torch.long))
            out.extend([int(bonus.item())])  # sync: one token per round reaches the host
        rounds.append(1)

    ttft, decode = clock.finish()
    return GenerationOutput(out.tokens, rounds, dict(timer.totals), ttft, decode)
