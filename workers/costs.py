"""A measured cost table per actor, and the predicted speed of a setting from it and the replay.

The field's identity (CaDDTree, BASTION, Sequoia): tokens/s = committed tokens / sum over rounds of
(draft + tree build + verify(q) + commit; AR: one advance). A setting is its method's parameter
object; what one of its rounds runs is its ``RoundShape`` (``workers.decoding.params``), which this
module prices without knowing the method. ``measure_costs`` times each piece on this actor's target
and drafter, once: the verify pass per width q (root + nodes), the drafter's pass per new-context
length, the tree build per (budget, branching, depth), the commit per path length, and a per-round
remainder (sampling, the walk, the host read) calibrated from one real engine run per method, whose
rounds are known. ``predict`` combines the table with the method's replayed round lengths.

Each piece is timed with a synchronise after every call (a round reads the host once, so its pieces
do not overlap much); the fastest of a few repeats, since other load on the machine only adds time.
Widths and budgets between measured anchors are interpolated linearly.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.decoding.drafting import open_drafting
from workers.decoding.generation import GenerationConfig, device_sync
from workers.decoding.methods import entry_of
from workers.decoding.params import MethodParams, RoundShape, TreeParams
from workers.decoding.replay import ReplayTable, output_length
from workers.decoding.tree import build_tree

MAX_ANCHORS = 16  # verify widths measured when the space has more (the rest interpolated)
TREE_BUDGET_ANCHORS = 6


# -- the table -----------------------------------------------------------------------------------------


def _interp(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through the measured points (flat beyond the ends)."""
    keys = sorted(points)
    if x <= keys[0]:
        return points[keys[0]]
    if x >= keys[-1]:
        return points[keys[-1]]
    i = bisect.bisect_left(keys, x)
    lo, hi = keys[i - 1], keys[i]
    if hi == x:
        return points[hi]
    w = (x - lo) / (hi - lo)
    return points[lo] * (1 - w) + points[hi] * w


@dataclass
class CostTable:
    """Seconds per piece of a round on one actor (see the module docstring)."""

    device: str
    context_length: int
    verify_s: dict[int, float]  # pass width q (root + nodes) -> seconds; q = 1: AR's advance (commits too)
    draft_s: dict[int, float]  # new-context tokens fed with the block -> seconds
    tree_s: dict[str, dict[int, dict[int, float]]]  # branching ("None" = unlimited) -> depth -> budget -> s
    commit_s: dict[int, float]  # committed path length (bonus included) -> seconds
    overhead_s: dict[str, float] = field(default_factory=dict)  # method -> per-round remainder

    def verify(self, width: int) -> float:
        return _interp(self.verify_s, width)

    def draft(self, new_tokens: int) -> float:
        return _interp(self.draft_s, new_tokens)

    def tree(self, params: TreeParams) -> float:
        by_depth = self.tree_s.get(str(params.branching))
        if by_depth is None:  # a branching never measured: the nearest one that was (None = widest)
            def width(key: str) -> float:
                return 1e9 if key == "None" else float(key)

            wanted = 1e9 if params.branching is None else float(params.branching)
            by_depth = self.tree_s[min(self.tree_s, key=lambda key: abs(math.log(width(key)) - math.log(wanted)))]
        depth_points = {d: _interp(budgets, params.budget) for d, budgets in by_depth.items()}
        return _interp(depth_points, params.max_depth or max(depth_points))

    def commit(self, length: int) -> float:
        return _interp(self.commit_s, length)

    def round_s(self, shape: RoundShape, committed: int, previous: int) -> float:
        """One round of ``shape`` that commits ``committed`` tokens after a round that committed ``previous``."""
        seconds = self.overhead_s.get(shape.method, 0.0)
        if not shape.drafts:  # AR: one advance, the pass commits its token as it goes
            return seconds + self.verify(1)
        seconds += self.draft(previous) + self.verify(shape.verify_width) + self.commit(committed)
        if shape.tree is not None:
            seconds += self.tree(shape.tree)
        return seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "context_length": self.context_length,
            "verify_s": {str(k): v for k, v in self.verify_s.items()},
            "draft_s": {str(k): v for k, v in self.draft_s.items()},
            "tree_s": {b: {str(d): {str(n): s for n, s in budgets.items()} for d, budgets in depths.items()}
                       for b, depths in self.tree_s.items()},
            "commit_s": {str(k): v for k, v in self.commit_s.items()},
            "overhead_s": dict(self.overhead_s),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostTable:
        def ints(d):
            return {int(k): float(v) for k, v in d.items()}

        return cls(
            data["device"], int(data["context_length"]), ints(data["verify_s"]), ints(data["draft_s"]),
            {b: {int(d): ints(budgets) for d, budgets in depths.items()} for b, depths in data["tree_s"].items()},
            ints(data["commit_s"]), {k: float(v) for k, v in data.get("overhead_s", {}).items()},
        )


# -- prediction ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    tokens_per_s: float
    tau: float
    rounds: int
    tokens: int
    decode_s: float


def predict(tables: list[ReplayTable], costs: CostTable, params: MethodParams, block_size: int,
            ceiling: int | None = None) -> Prediction:
    """Predicted tokens/s (generated tokens / decode time, as the trial metric), tau and rounds of the
    setting ``params``; ``ceiling``: the tree budget the replay's trees are cut from (``ReplayPlan``)."""
    entry = entry_of(params)
    shape = entry.round_shape(params, block_size)
    tokens = rounds = committed = 0
    seconds = 0.0
    for table in tables:
        lengths = entry.replay_lengths(table, params, block_size, ceiling)
        tokens += output_length(table)
        rounds += len(lengths)
        committed += sum(lengths)
        previous = block_size  # the first drafter pass reads the prompt: priced as the longest new context
        for length in lengths:
            seconds += costs.round_s(shape, length, previous)
            previous = length
    return Prediction(tokens / seconds if seconds > 0 else 0.0, committed / rounds if rounds else 0.0, rounds, tokens,
                      seconds)


# -- measurement ---------------------------------------------------------------------------------------


def _anchors(values: set[int], limit: int) -> list[int]:
    """All values when few, else ``limit`` log-spaced ones including both ends."""
    ordered = sorted(values)
    if len(ordered) <= limit:
        return ordered
    lo, hi = math.log(ordered[0]), math.log(ordered[-1])
    picked = {min(ordered, key=lambda v: abs(math.log(v) - (lo + (hi - lo) * i / (limit - 1)))) for i in range(limit)}
    return sorted(picked | {ordered[0], ordered[-1]})


def _time(call, sync, repeats: int) -> float:
    """Fastest seconds of ``call`` over ``repeats`` (after one untimed warm-up, which also captures graphs)."""
    call()
    sync()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - begin)
    return min(times)


def _tree_call(drafting, logits: torch.Tensor, params: TreeParams):
    """The tree build exactly as ``ddtree.generate`` calls it (a captured graph or the eager function)."""
    return lambda: drafting.build_tree(logits, params)


@torch.inference_mode()
def measure_costs(target, drafter, settings: list[MethodParams], context_length: int,
                  calibration_prompt: torch.Tensor | None = None, calibration: GenerationConfig | None = None,
                  repeats: int = 5) -> CostTable:
    """Time every piece the rounds of ``settings`` (parameter objects, of one method or several) use
    on this target and drafter (see the module docstring).

    ``context_length``: committed tokens in the target cache while timing (a typical mid-generation
    length: the verify pass attends to them). ``calibration_prompt`` / ``calibration``: one real run
    per method that drafts, whose rounds calibrate its per-round remainder (skipped when None).
    """
    sync = device_sync(target.device)
    block = drafter.block_size if drafter is not None else 1
    shapes = [entry_of(params).round_shape(params, block) for params in settings]
    widths = set(_anchors({shape.verify_width for shape in shapes} | {1}, MAX_ANCHORS))
    max_width = max(widths)
    context_length = max(context_length, block)  # the drafter's timed passes read the context's last block
    # every commit timing adds its path to the cache: sum over lengths 1..block of (repeats + 1) passes
    capacity = context_length + (repeats + 1) * block * (block + 1) // 2 + max_width + 64
    target.start(capacity=capacity, max_verify=max(max_width, block))
    generator = torch.Generator().manual_seed(0)
    vocab = target.model.get_input_embeddings().weight.shape[0] - 1
    context = torch.randint(1, vocab, (1, context_length), generator=generator)
    prefill = target.prefill(context)
    root = torch.ones(1, dtype=torch.long, device=target.device)

    verify_s = {}
    fake_logits = torch.randn(block - 1 if block > 1 else 1, vocab + 1, generator=generator)
    for q in sorted(widths):
        if q == 1:  # only AR's rounds are one token wide, and they advance (see ``ar.generate``)
            verify_s[q] = _time(lambda: target.advance(root), sync, repeats)
            continue
        tree = build_tree(torch.log_softmax(fake_logits, dim=-1), TreeParams(q - 1)).to(target.device)
        verify_s[q] = _time(lambda tree=tree: target.verify_tree(root[0], tree), sync, repeats)

    commit_s = {}
    for length in range(1, block + 1):
        chain = torch.ones(max(length, 1), dtype=torch.long, device=target.device)
        kept = torch.arange(length, device=target.device)
        samples = []
        for _ in range(repeats + 1):
            target.verify_chain(chain)
            sync()
            begin = time.perf_counter()
            target.commit(kept)
            sync()
            samples.append(time.perf_counter() - begin)
        commit_s[length] = min(samples[1:])

    draft_s: dict[int, float] = {}
    tree_s: dict[str, dict[int, dict[int, float]]] = {}
    if drafter is not None and any(shape.drafts for shape in shapes):
        # the drafting the engines get (graph replays when the target replays its own)
        drafting = open_drafting(drafter, target, context_length + (repeats + 2) * 2 * block + 2 * block)
        drafting.draft(root, prefill.taps, block - 1)  # the prompt, once, as an engine does
        taps = prefill.taps[:, -block:]
        for new in sorted({1, block}):
            draft_s[new] = _time(lambda new=new: drafting.draft(root, taps[:, :new], block - 1), sync, repeats)
        trees = [shape.tree for shape in shapes if shape.tree is not None]
        if trees:
            logits = drafting.draft(root, taps[:, :1], block - 1).clone()
            for branching in sorted({t.branching for t in trees}, key=lambda b: b or 1 << 30):
                chosen = [t for t in trees if t.branching == branching]
                depths = _anchors({t.max_depth for t in chosen}, 3)
                budgets = _anchors({t.budget for t in chosen}, TREE_BUDGET_ANCHORS)
                tree_s[str(branching)] = {
                    # the engine drafts max_depth rows, and the build's graph is keyed by that shape
                    d: {b: _time(_tree_call(drafting, logits[:d].contiguous(), TreeParams(b, d, branching)), sync,
                                 repeats)
                        for b in budgets}
                    for d in depths
                }
    costs = CostTable(str(target.device), context_length, verify_s, draft_s, tree_s, commit_s)
    if calibration_prompt is not None and calibration is not None:
        for method in {shape.method: None for shape in shapes if shape.drafts}:  # in order of appearance
            ours = [params for params, shape in zip(settings, shapes, strict=True) if shape.method == method]
            costs.overhead_s[method] = _calibrate(target, drafter, ours[len(ours) // 2], costs, calibration_prompt,
                                                  calibration)
    return costs


def _calibrate(target, drafter, params: MethodParams, costs: CostTable, prompt, config: GenerationConfig) -> float:
    """Per-round time a real run of ``params`` spends beyond the timed pieces: (decode_s - sum of
    pieces) / rounds, from its own (known) rounds; the faster of two runs after a warm-up. Never
    below half the pieces' negative (a noisy piece must not make rounds free)."""
    block = drafter.block_size
    entry = entry_of(params)
    shape = entry.round_shape(params, block)
    warm = GenerationConfig(min(16, config.max_new_tokens), config.temperature)
    entry.generate(target, drafter, prompt, warm, params)
    runs = [entry.generate(target, drafter, prompt, config, params) for _ in range(2)]
    out = min(runs, key=lambda run: run.decode_s / max(run.num_rounds, 1))
    if not out.acceptance_lengths:
        return 0.0
    pieces, previous = 0.0, block
    for length in out.acceptance_lengths:
        pieces += costs.round_s(shape, length, previous) - costs.overhead_s.get(shape.method, 0.0)
        previous = length
    rounds = len(out.acceptance_lengths)
    return max((out.decode_s - pieces) / rounds, -0.5 * pieces / rounds)
