"""Acceptance replay: every round of any DDTree / DFlash setting from one AR run, without running it.

Greedy speculative decoding outputs the AR tokens, and the drafter's context at a round start is the
target's taps of the committed tokens, the same whatever the setting. So one AR generation of the
target (with its taps) and one drafter pass per position ``g`` of that output (context: taps of the
prompt and of tokens 0..g-1, bonus: token g) fix what every round starting at ``g`` does: it
accepts the longest prefix of the AR continuation after ``g`` that is a path in the tree built
from the drafter's distributions there, and the next round starts at ``g + accepted + 1``.

``record`` makes the per-prompt ``ReplayTable``; ``ddtree_lengths`` / ``dflash_lengths`` give the
per-round acceptance lengths (bonus included) that the engines would report, with the same stop
rules (``OutputBuffer``). Trees are built with ``tree.build_tree``, the engine's own function, so
ties break the same way.

Temperature > 0: ``record`` samples the AR continuation (seeded) instead. The engines are lossless,
so their output is an AR sample and their round boundaries are a function of that sample and the
trees along it: replaying one sampled continuation gives acceptance lengths distributed as the
engine's (a Monte-Carlo estimate of tau, not the trial's exact rounds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.decoding.generation import GenerationConfig
from workers.decoding.params import TreeParams
from workers.decoding.sampling import make_generator, sample_tokens
from workers.decoding.tree import accepted_nodes, build_lattice_tree, build_tree
from workers.seam import Lattice


@dataclass
class ReplayTable:
    """One prompt's AR continuation and the drafter's view at every position a round can start from.

    tokens:        AR output, ``tokens[0]`` = the prefill's token; long enough that a round starting
                   at any recorded position can be checked at every drafted depth.
    top_log_probs: [P, D, K] float32, best first: top-K of log_softmax(draft logits) per depth, for
                   the round starting at position g < P (bonus = tokens[g]); D = block_size - 1.
                   None for a DFlash2 drafter (its distributions are ``transitions``).
    top_ids:       [P, D, K] int32, the token ids of those entries (DFlash2: each depth's candidates).
    chain_matches: [P] long, how many leading greedy drafter guesses (argmax of the raw logits, as
                   DFlash drafts; DFlash2: the selector's greedy walk) equal the continuation.
    transitions:   DFlash2 only: [P, D, K, K] float32, the selector's log-probs of each depth's
                   candidates after each candidate of the depth before (``workers.seam.Lattice``).
    """

    tokens: list[int]
    top_log_probs: torch.Tensor | None
    top_ids: torch.Tensor
    chain_matches: torch.Tensor
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    vocab_size: int
    prompt_length: int = 0  # the prompt's tokens (the cost model prices a round at its context length)
    transitions: torch.Tensor | None = None
    # (g, max_depth, branching, ceiling, depth_discount) -> node indices of the AR path in the ceiling-budget tree
    _paths: dict[tuple, list[int]] = field(default_factory=dict, repr=False)

    @property
    def positions(self) -> int:
        return int(self.top_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.top_ids.shape[2])

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "top_log_probs": self.top_log_probs, "top_ids": self.top_ids,
                "chain_matches": self.chain_matches, "max_new_tokens": self.max_new_tokens,
                "stop_token_ids": list(self.stop_token_ids), "vocab_size": self.vocab_size,
                "prompt_length": self.prompt_length, "transitions": self.transitions}

    @classmethod
    def from_dict(cls, data: dict) -> ReplayTable:
        return cls(data["tokens"], data["top_log_probs"], data["top_ids"], data["chain_matches"],
                   int(data["max_new_tokens"]), tuple(data["stop_token_ids"]), int(data["vocab_size"]),
                   int(data.get("prompt_length", 0)), data.get("transitions"))


@torch.inference_mode()
def record(target, drafter, prompt_ids: torch.Tensor, config: GenerationConfig, top_k: int) -> ReplayTable:
    """One AR generation of ``prompt_ids`` [1, T] with taps, then one drafter pass per round start.

    The AR run ignores stop tokens until block_size - 1 tokens past the end, since a round may
    accept (and count) drafted tokens beyond a stop or the token limit before the output is cut.
    ``top_k`` entries are kept per depth (the most any tree setting of the sweep reads; a DFlash2
    drafter's lattice keeps its own candidates).
    """
    block = drafter.block_size
    depth = block - 1
    total = config.max_new_tokens + block  # enough for a round at the last start to look depth ahead
    target.start(capacity=prompt_ids.shape[1] + total + 1, max_verify=1)
    prefill = target.prefill(prompt_ids)
    generator = make_generator(config.seed, prefill.logits.device)
    token = sample_tokens(prefill.logits[-1:], config.temperature, generator)  # [1]
    tokens, taps = [int(token.item())], []  # sync: host-side bookkeeping, not a timed path
    stops = set(config.stop_token_ids)
    ended_at = None  # output index where the engines' output would end
    while True:
        if ended_at is None and (tokens[-1] in stops or len(tokens) >= config.max_new_tokens):
            ended_at = len(tokens) - 1
        if ended_at is not None and len(tokens) > ended_at + block:
            break
        verified = target.advance(token)
        taps.append(verified.taps)  # [1, 1, k*H]: taps of ``token``, known once it is fed
        token = sample_tokens(verified.logits, config.temperature, generator)
        tokens.append(int(token.item()))
    starts = ended_at  # a round starts at g only while the output is open: g = 0..ended_at-1

    # the drafter, fed as the engines feed it: the prompt's taps first, then one committed token at a time
    cache = drafter.new_cache(prompt_ids.shape[1] + starts + block)
    embed = target.model.get_input_embeddings()
    lm_head = target.model.get_output_embeddings()
    mask_id = drafter.spec.mask_token_id
    vocab = lm_head.out_features  # (a tensor-parallel lm_head holds fewer rows but gives all V logits)
    k = min(top_k, vocab)
    lattice = drafter.spec.selector is not None  # a DFlash2 drafter: candidates and transitions
    if lattice:
        k = drafter.spec.selector.selector_top_k
    top_vals, top_ids, transitions, matches = [], [], [], []
    continuation = torch.tensor(tokens, dtype=torch.long)
    new_context = prefill.taps  # [1, T, k*H]
    for g in range(starts):
        block_ids = torch.full((1, block), mask_id, dtype=torch.long, device=embed.weight.device)
        block_ids[0, 0] = tokens[g]
        hidden = drafter(embed(block_ids).to(drafter.fc.weight.device), new_context, cache)  # [1, block, H]
        draft = drafter.propose(hidden[0, 1:], lm_head, block_ids[0, :1])  # logits [D, V] or a Lattice
        if lattice:
            top_ids.append(draft.tokens.to(torch.int32).cpu())  # int32: the table crosses Ray to the driver
            transitions.append(draft.log_probs.float().cpu())
            guesses = draft.greedy.cpu()  # DFlash2's chain: the selector's greedy walk
        else:
            values, ids = torch.topk(torch.log_softmax(draft.float(), dim=-1), k=k, dim=-1)  # [D, K]
            top_vals.append(values.cpu())
            top_ids.append(ids.to(torch.int32).cpu())
            guesses = draft.argmax(dim=-1).cpu()  # DFlash's chain: argmax of the raw logits
        matches.append(int((guesses == continuation[g + 1 : g + 1 + depth]).int().cumprod(0).sum()))
        new_context = taps[g]
    return ReplayTable(
        tokens=tokens,
        top_log_probs=None if lattice else (torch.stack(top_vals) if top_vals else torch.empty(0, depth, k)),
        top_ids=torch.stack(top_ids) if top_ids else torch.empty(0, depth, k, dtype=torch.int32),
        chain_matches=torch.tensor(matches, dtype=torch.long),
        max_new_tokens=config.max_new_tokens,
        stop_token_ids=tuple(config.stop_token_ids),
        vocab_size=int(vocab),
        prompt_length=int(prompt_ids.shape[1]),
        transitions=(torch.stack(transitions) if transitions else torch.empty(0, depth, k, k)) if lattice else None,
    )


# -- simulation -------------------------------------------------------------------------------------


def _simulate(table: ReplayTable, accepted_at) -> list[int]:
    """Round lengths (bonus included) the engines report, given ``accepted_at(g)`` drafted tokens
    accepted by a round whose bonus is output token g; stop rules as ``OutputBuffer``."""
    stops = set(table.stop_token_ids)
    tokens, limit = table.tokens, table.max_new_tokens
    if tokens[0] in stops or limit <= 1:
        return []
    rounds, g = [], 0
    while True:
        accepted = accepted_at(g)
        rounds.append(accepted + 1)
        committed = tokens[g + 1 : g + accepted + 2]
        for offset, token in enumerate(committed, start=g + 1):
            if token in stops or offset + 1 >= limit:
                return rounds
        g += accepted + 1


def output_length(table: ReplayTable) -> int:
    """Tokens the engines output for this prompt (the same for every setting: the AR output, cut)."""
    stops = set(table.stop_token_ids)
    for index, token in enumerate(table.tokens[: table.max_new_tokens]):
        if token in stops:
            return index + 1
    return table.max_new_tokens


def ar_lengths(table: ReplayTable) -> list[int]:
    """AR's rounds: one token each, after the prefill's."""
    return [1] * (output_length(table) - 1)


def tree_path(table: ReplayTable, g: int, max_depth: int, branching: int | None, ceiling: int,
              depth_discount: float | None = None) -> list[int]:
    """Node indices (1-based, increasing) of the AR path from position g in the tree of ``ceiling``
    nodes: the tree of any budget B <= ceiling is its first B nodes, so a round of budget B accepts
    the path nodes numbered <= B."""
    key = (g, max_depth, branching, ceiling, depth_discount)
    if key not in table._paths:
        params = TreeParams(budget=ceiling, max_depth=max_depth, branching=branching, depth_discount=depth_discount)
        if table.transitions is not None:  # DFlash2: the engine's own lattice tree
            candidates = table.top_ids[g, :max_depth].long()  # (greedy is not read by the tree)
            tree = build_lattice_tree(Lattice(candidates, table.transitions[g, :max_depth], candidates[:, 0]), params)
            real_tokens = tree.tokens  # a lattice tree's nodes carry vocab ids
        else:
            log_probs = table.top_log_probs[g, :max_depth]  # [D, K]: topk of this keeps the engine's order
            tree = build_tree(log_probs, params)
            real_tokens = table.top_ids[g, tree.depths - 1, tree.tokens].long()  # table column -> vocab id
        depths = torch.cat((torch.zeros(1, dtype=torch.long), tree.depths))
        continuation = torch.tensor(table.tokens[g + 1 : g + 2 + max_depth], dtype=torch.long)
        # the target's choice after a node at depth d on the AR path is continuation[d]; off the path
        # the value is wrong, but nodes below an unaccepted node are never accepted anyway
        choices = continuation[depths.clamp(max=continuation.numel() - 1)]
        mask = accepted_nodes(real_tokens, tree.parents, tree.visibility, choices)
        table._paths[key] = mask.nonzero().squeeze(1)[1:].tolist()
    return table._paths[key]


def ddtree_lengths(table: ReplayTable, params: TreeParams, block_size: int, ceiling: int | None = None) -> list[int]:
    """Per-round acceptance lengths of DDTree(params) on this prompt. ``ceiling`` (>= budget): the
    budget whose trees are built and shared by every smaller budget (default: the budget itself)."""
    depth = block_size - 1 if params.max_depth is None else params.max_depth
    ceiling = max(ceiling or params.budget, params.budget)
    width = min(ceiling, params.branching or ceiling)
    if table.transitions is None and width > table.top_k and table.top_k < table.vocab_size:
        raise ValueError(f"replay table keeps top-{table.top_k} per depth; this setting reads top-{width}")
    return _simulate(table, lambda g: sum(1 for node in tree_path(table, g, depth, params.branching, ceiling,
                                                                  params.depth_discount)
                                          if node <= params.budget))


def dflash_lengths(table: ReplayTable, num_draft: int) -> list[int]:
    """Per-round acceptance lengths of DFlash with a chain of ``num_draft`` guesses."""
    return _simulate(table, lambda g: min(int(table.chain_matches[g]), num_draft))
