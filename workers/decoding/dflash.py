"""DFlash: chain drafting with a block-diffusion drafter, verified in one target pass per round.

Round: the drafter fills [bonus, MASK...] in one pass and its greedy guesses form a chain (a DFlash2
drafter's: its selector's greedy walk over each position's candidates); the target scores [bonus,
guesses] causally; the longest prefix where each guess equals the target's own sample is accepted,
then the target's sample after it becomes the next bonus. Lossless at any temperature: every
committed token is a target sample.
"""

from __future__ import annotations

import time

import torch

from workers.decoding.drafting import open_drafting
from workers.decoding.generation import NULL_TIMER, GenerationConfig, GenerationOutput, ReadLater, open_generation
from workers.decoding.params import DFlashParams
from workers.decoding.replay import ReplayTable, dflash_lengths
from workers.decoding.sampling import sample_tokens
from workers.models.drafter import DFlashDrafter
from workers.seam import Target, Timer


@torch.inference_mode()
def generate(
    target: Target,
    drafter: DFlashDrafter,
    prompt_ids: torch.Tensor,  # [1, T]
    config: GenerationConfig,
    params: DFlashParams = DFlashParams(),
    timer: Timer = NULL_TIMER,
) -> GenerationOutput:
    num_draft = params.resolved(drafter.block_size).num_draft_tokens
    start = open_generation(target, prompt_ids, config, max_verify=params.round_shape(drafter.block_size).verify_width)
    out, generator, bonus = start.out, start.generator, start.bonus
    new_context = start.context  # [1, T, k*H]: features of committed tokens the drafter has not seen
    drafting = open_drafting(drafter, target, start.capacity)

    steps = torch.arange(num_draft + 1, device=bonus.device)  # a commit keeps steps[:accepted+1]

    rounds: list[int] = []
    ended_at = None  # when the last round's tokens reached the host
    if not out.done:
        with timer.stage("draft"):
            draft = drafting.draft(bonus, new_context, num_draft)  # logits [n, V] (DFlash2: a Lattice)
    while not out.done:
        with timer.stage("draft"):
            guesses = drafting.chain(draft)  # [n] greedy chain, also at T > 0
        with timer.stage("verify"):
            chain = torch.cat((bonus, guesses.to(bonus.device)))  # [n+1]
            verified = target.verify_chain(chain)
        with timer.stage("commit"):
            choices = sample_tokens(verified.logits, config.temperature, generator)  # [n+1]
            guesses = guesses.to(choices.device)
            matched = (guesses == choices[:-1]).int().cumprod(dim=0).sum()  # accepted guesses, on the device
            bonus = choices.gather(0, matched.view(1))  # [1] the target's choice after them
            read = ReadLater(torch.cat((guesses, choices, matched.view(1))))
        with timer.stage("draft"):  # the next round's, queued before the host reads this one's outcome
            draft = drafting.draft_counted(bonus, verified.taps, matched + 1, num_draft)
        with timer.stage("commit"):
            walk = read()  # sync: the round's one host read (the next draft keeps the GPU busy meanwhile)
            ended_at = time.perf_counter()
            drafted, chosen, accepted = walk[:num_draft], walk[num_draft:-1], int(walk[-1])
            drafting.advance(accepted + 1)
            with read.beside(target.device):  # in line unless COMMIT_BESIDE_DRAFT: then beside the next draft
                target.commit(steps[: accepted + 1])
            out.extend(drafted[:accepted].tolist() + [int(chosen[accepted])])
        rounds.append(accepted + 1)
    # a draft queued for a round that did not come is dropped; the decode time ends at the last read

    ttft, decode = start.clock.finish(ended_at)
    return GenerationOutput(out.tokens, rounds, dict(timer.totals), ttft, decode)


# -- its rounds replayed from one AR run (``methods.MethodEntry.replay_lengths``) -----------------------


def replay_lengths(table: ReplayTable, params: DFlashParams, block_size: int, ceiling: int | None = None) -> list[int]:
    return dflash_lengths(table, params.resolved(block_size).num_draft_tokens)
