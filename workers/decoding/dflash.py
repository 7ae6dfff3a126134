"""DFlash: chain drafting with a block-diffusion drafter, verified in one target pass per round.

Round: the drafter fills [bonus, MASK...] in one pass and its greedy guesses form a chain; the
target scores [bonus, guesses] causally; the longest prefix where each guess equals the target's own
sample is accepted, then the target's sample after it becomes the next bonus. Lossless at any
temperature: every committed token is a target sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.decoding.generation import NULL_TIMER, GenerationConfig, GenerationOutput, open_generation
from workers.decoding.sampling import sample_tokens
from workers.models.drafter import DFlashDrafter


@dataclass(frozen=True)
class DFlashParams:
    num_draft_tokens: int | None = None  # 1..block_size-1; None = block_size-1

    def resolve(self, block_size: int) -> int:
        n = block_size - 1 if self.num_draft_tokens is None else self.num_draft_tokens
        if not 1 <= n <= block_size - 1:
            raise ValueError(f"num_draft_tokens must be in 1..{block_size - 1} (block_size-1), got {n}")
        return n


def new_draft_cache(drafter: DFlashDrafter, target, capacity: int):
    """The drafter's context cache for one generation: with CUDA graphs (when the target replays
    graphs) a ``DraftGraphs`` kept across generations, else a fresh ``DrafterCache``."""
    if getattr(target, "graphs", False):
        from workers.decoding.draft_graphs import DraftGraphs

        return DraftGraphs.for_run(drafter, capacity)
    return drafter.new_cache(capacity)


def draft_block(
    drafter: DFlashDrafter, target, cache, bonus: torch.Tensor, new_context: torch.Tensor, rows: int
) -> torch.Tensor:
    """One drafter pass -> draft logits [rows, V] for the positions after the bonus.

    The block is the target's embedding of [bonus, MASK x (block_size-1)]; the whole block is always
    run (the drafter was trained on full blocks) and only the first ``rows`` predictions are used.
    """
    if hasattr(cache, "graphs"):  # DraftGraphs: replay for a round's few new tokens, eager for the prompt
        if new_context.shape[1] <= drafter.block_size:
            return cache.draft(drafter, target, bonus, new_context, rows)
        cache = cache.cache
    block_ids = torch.full((1, drafter.block_size), drafter.spec.mask_token_id, dtype=torch.long, device=bonus.device)
    block_ids[0, 0] = bonus[0]
    embed = target.model.get_input_embeddings()
    block_embeds = embed(block_ids.to(embed.weight.device)).to(drafter.fc.weight.device)
    hidden = drafter(block_embeds, new_context, cache)  # [1, block, H]
    lm_head = target.model.get_output_embeddings()
    return lm_head(hidden[0, 1 : 1 + rows].to(lm_head.weight.device))


@torch.inference_mode()
def generate(
    target,
    drafter: DFlashDrafter,
    prompt_ids: torch.Tensor,  # [1, T]
    config: GenerationConfig,
    params: DFlashParams = DFlashParams(),
    timer=NULL_TIMER,
) -> GenerationOutput:
    num_draft = params.resolve(drafter.block_size)
    start = open_generation(target, prompt_ids, config, max_verify=num_draft + 1)
    out, generator, bonus = start.out, start.generator, start.bonus
    new_context = start.context  # [1, T, k*H]: features of committed tokens the drafter has not seen
    draft_cache = new_draft_cache(drafter, target, start.capacity)

    steps = torch.arange(num_draft + 1, device=bonus.device)  # a commit keeps steps[:accepted+1]

    rounds: list[int] = []
    while not out.done:
        with timer.stage("draft"):
            draft_logits = draft_block(drafter, target, draft_cache, bonus, new_context, num_draft)
            guesses = draft_logits.argmax(dim=-1)  # [n] greedy chain, also at T > 0
        with timer.stage("verify"):
            chain = torch.cat((bonus, guesses.to(bonus.device)))  # [n+1]
            verified = target.verify_chain(chain)
        with timer.stage("commit"):
            choices = sample_tokens(verified.logits, config.temperature, generator)  # [n+1]
            guesses = guesses.to(choices.device)
            walk = torch.cat((guesses, choices)).cpu()  # sync: the round's one host read
            drafted, chosen = walk[:num_draft], walk[num_draft:]
            accepted = int((drafted == chosen[:-1]).int().cumprod(dim=0).sum())
            target.commit(steps[: accepted + 1])
            new_context = verified.taps[:, : accepted + 1]
            bonus = choices[accepted : accepted + 1]
            out.extend(drafted[:accepted].tolist() + [int(chosen[accepted])])
        rounds.append(accepted + 1)

    ttft, decode = start.clock.finish()
    return GenerationOutput(out.tokens, rounds, dict(timer.totals), ttft, decode)
