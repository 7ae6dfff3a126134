"""DDTree: the drafter's one block pass spread into a best-first tree, verified in one target pass.

Round: the drafter's per-position log-probs give the ``budget`` most probable prefixes (capped in
depth and branching; a DFlash2 drafter's: the most probable walks through its selector's lattice);
the target scores root + all nodes at once under a tree mask; the walk from the root follows the
target's own sample at each node; the accepted path is committed and the target's sample after it
becomes the next bonus. Lossless at any temperature, as for DFlash.
"""

from __future__ import annotations

import time

import torch

from workers.decoding.drafting import open_drafting
from workers.decoding.generation import NULL_TIMER, GenerationConfig, GenerationOutput, ReadLater, open_generation
from workers.decoding.params import TreeParams
from workers.decoding.replay import ReplayTable, ddtree_lengths
from workers.decoding.sampling import sample_tokens
from workers.decoding.tree import accepted_nodes
from workers.models.drafter import DFlashDrafter
from workers.seam import Target, Timer


@torch.inference_mode()
def generate(
    target: Target,
    drafter: DFlashDrafter,
    prompt_ids: torch.Tensor,  # [1, T]
    config: GenerationConfig,
    params: TreeParams,
    timer: Timer = NULL_TIMER,
) -> GenerationOutput:
    params = params.resolved(drafter.block_size)  # the default depth is block_size-1
    start = open_generation(target, prompt_ids, config, max_verify=params.round_shape(drafter.block_size).verify_width)
    out, generator, bonus = start.out, start.generator, start.bonus
    new_context = start.context  # [1, T, k*H]: features of committed tokens the drafter has not seen
    drafting = open_drafting(drafter, target, start.capacity)

    rounds: list[int] = []
    ended_at = None  # when the last round's tokens reached the host
    if not out.done:
        with timer.stage("draft"):
            draft = drafting.draft(bonus, new_context, params.max_depth)  # logits [max_depth, V] or a Lattice
    while not out.done:
        with timer.stage("tree"):
            tree = drafting.build_tree(draft, params)  # on the drafter's device
        with timer.stage("verify"):
            verified = target.verify_tree(bonus[0], tree)
        with timer.stage("commit"):
            choices = sample_tokens(verified.logits, config.temperature, generator)  # [n+1]
            tree = tree.to(choices.device)  # a no-op unless the lm_head sits on another GPU
            accepted = accepted_nodes(tree.tokens, tree.parents, tree.visibility, choices)  # [n+1]
            # accepted nodes form one chain (ascending index = depth order): sorted to the front on
            # the device, so the commit and the drafter's next context need no host-to-device copy
            nodes = torch.arange(accepted.shape[0], device=accepted.device)
            path_padded = torch.where(accepted, nodes, accepted.shape[0]).sort().values  # [n+1]
            reached = accepted.sum()  # the path's length, on the device
            bonus = choices.gather(0, path_padded.gather(0, reached.view(1) - 1))  # [1] the choice after its last node
            read = ReadLater(torch.stack((path_padded, choices)))
        with timer.stage("draft"):  # the next round's, queued before the host reads this one's outcome
            rows = path_padded[: drafter.block_size].clamp(max=accepted.shape[0] - 1)  # the path's first
            context = verified.taps.index_select(1, rows.to(verified.taps.device))
            draft = drafting.draft_counted(bonus, context, reached, params.max_depth)
        with timer.stage("commit"):
            walk = read()  # sync: the round's one host read (the next draft keeps the GPU busy meanwhile)
            ended_at = time.perf_counter()
            count = int((walk[0] < accepted.shape[0]).sum())
            path = walk[0, :count]  # root first
            drafting.advance(count)
            with read.beside(target.device):  # in line unless COMMIT_BESIDE_DRAFT: then beside the next draft
                target.commit(path_padded[:count])
            # an accepted node's token is the target's choice at its parent: the choices along the
            # path are the accepted tokens, then the next bonus
            out.extend(walk[1, path].tolist())
        rounds.append(count)
    # a draft queued for a round that did not come is dropped; the decode time ends at the last read

    ttft, decode = start.clock.finish(ended_at)
    return GenerationOutput(out.tokens, rounds, dict(timer.totals), ttft, decode)


# -- its rounds replayed from one AR run (``methods.MethodEntry.replay_lengths``) -----------------------


def replay_lengths(table: ReplayTable, params: TreeParams, block_size: int, ceiling: int | None = None) -> list[int]:
    return ddtree_lengths(table, params.resolved(block_size), block_size, ceiling)
