"""A measured cost table per actor, and the predicted speed of a setting from it and the replay.

The field's identity (CaDDTree, BASTION, Sequoia): tokens/s = committed tokens / sum over rounds of
(draft + tree build + verify + commit; AR: one advance). A setting is its method's parameter object;
what one of its rounds runs is its ``RoundShape`` (``workers.decoding.params``). ``measure_costs``
times each piece on this actor's target and drafter:

- the verify pass as each setting's rounds run it: a chain of width q (DFlash), or a tree built from
  the drafter's own distributions with the setting's budget, depth and branching (DDTree; on a hybrid
  target a deep tree costs more than a shallow one of the same width); AR's one-token advance;
- each of those at two context lengths, the start and the end of the trials' generations, so a round
  is priced at its own position;
- the drafter's pass per new-context length, the tree build per (budget, branching, depth), the
  commit per path length;
- a per-round remainder (sampling, the walk, the host read) per method, calibrated from real engine
  runs of up to three of its settings (the narrowest, the middle, the widest), whose rounds are
  known, as a line in the verify width.

``predict`` prices every replayed round (``workers.decoding.methods``: each method's own rounds) with
the table. Each piece is timed with a synchronise after every call (a round's pieces run one after
another on the GPU; only the host's one read overlaps the next draft, and with
``generation.COMMIT_BESIDE_DRAFT`` the commit does too, which the calibrated remainder absorbs); the
fastest of a few repeats, since other load on the machine only adds time. Values between measured
anchors are interpolated linearly.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.decoding.drafting import open_drafting
from workers.decoding.generation import GenerationConfig, device_sync
from workers.decoding.methods import entry_of
from workers.decoding.params import MethodParams, RoundShape, TreeParams
from workers.decoding.replay import ReplayTable, output_length
from workers.decoding.tree import build_draft_tree

MAX_ANCHORS = 12  # chain widths measured when the space has more (the rest interpolated)
TREE_BUDGET_ANCHORS = 6
TREE_DEPTH_ANCHORS = 3
CALIBRATION_SETTINGS = 3
CHAIN = "chain"  # the verify table's key for chains; trees are keyed by their branching ("None": unlimited)


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


def _nearest_branching(table: dict[str, Any], branching: int | None) -> Any:
    """The entry of ``branching``, or of the nearest measured one (None = unlimited = widest)."""
    if str(branching) in table:
        return table[str(branching)]

    def width(key: str) -> float:
        return 1e9 if key == "None" else float(key)

    wanted = 1e9 if branching is None else float(branching)
    return table[min((k for k in table if k != CHAIN), key=lambda k: abs(math.log(width(k)) - math.log(wanted)))]


@dataclass
class CostTable:
    """Seconds per piece of a round on one actor (see the module docstring)."""

    device: str
    advance_s: dict[int, float]  # context length -> AR's one-token advance (commits as it goes)
    # context length -> "chain" -> width -> s, or branching -> depth -> budget -> s (the tree's own width)
    verify_s: dict[int, dict[str, Any]]
    draft_s: dict[int, float]  # new-context tokens fed with the block -> seconds
    tree_s: dict[str, dict[int, dict[int, float]]]  # branching ("None" = unlimited) -> depth -> budget -> s
    commit_s: dict[int, float]  # committed path length (bonus included) -> seconds
    overhead_s: dict[str, tuple[float, float]] = field(default_factory=dict)  # method -> (a, b): a + b x width

    def verify(self, shape: RoundShape, context: int) -> float:
        """The target pass of a round of ``shape`` after ``context`` committed tokens."""
        if not shape.drafts:
            return _interp(self.advance_s, context)
        return _interp({c: self._verify_at(table, shape) for c, table in self.verify_s.items()}, context)

    def _verify_at(self, table: dict[str, Any], shape: RoundShape) -> float:
        if shape.tree is None:
            return _interp(table[CHAIN], shape.verify_width)
        by_depth = _nearest_branching(table, shape.tree.branching)
        return _interp({d: _interp(budgets, shape.tree.budget) for d, budgets in by_depth.items()},
                       shape.tree.max_depth)

    def draft(self, new_tokens: int) -> float:
        return _interp(self.draft_s, new_tokens)

    def tree(self, params: TreeParams) -> float:
        by_depth = _nearest_branching(self.tree_s, params.branching)
        depth_points = {d: _interp(budgets, params.budget) for d, budgets in by_depth.items()}
        return _interp(depth_points, params.max_depth or max(depth_points))

    def commit(self, length: int) -> float:
        return _interp(self.commit_s, length)

    def overhead(self, shape: RoundShape) -> float:
        a, b = self.overhead_s.get(shape.method, (0.0, 0.0))
        return a + b * shape.verify_width

    def pieces_s(self, shape: RoundShape, committed: int, previous: int, context: int) -> float:
        """The timed pieces of one round (no remainder): it commits ``committed`` tokens after a round
        that committed ``previous``, at ``context`` committed tokens."""
        seconds = self.verify(shape, context)
        if shape.drafts:
            seconds += self.draft(previous) + self.commit(committed)
        if shape.tree is not None:
            seconds += self.tree(shape.tree)
        return seconds

    def round_s(self, shape: RoundShape, committed: int, previous: int, context: int) -> float:
        return self.pieces_s(shape, committed, previous, context) + self.overhead(shape)

    def to_dict(self) -> dict[str, Any]:
        def keyed(value):
            return {str(k): keyed(v) for k, v in value.items()} if isinstance(value, dict) else value

        return {"device": self.device, "advance_s": keyed(self.advance_s), "verify_s": keyed(self.verify_s),
                "draft_s": keyed(self.draft_s), "tree_s": keyed(self.tree_s), "commit_s": keyed(self.commit_s),
                "overhead_s": {k: list(v) for k, v in self.overhead_s.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostTable:
        def ints(value):  # the JSON's string keys back to ints, below the chain / branching keys
            return {int(k): ints(v) for k, v in value.items()} if isinstance(value, dict) else float(value)

        verify = {int(c): {kind: ints(entries) for kind, entries in table.items()}
                  for c, table in data["verify_s"].items()}
        return cls(data["device"], ints(data["advance_s"]), verify, ints(data["draft_s"]),
                   {b: ints(depths) for b, depths in data["tree_s"].items()}, ints(data["commit_s"]),
                   {k: (float(v[0]), float(v[1])) for k, v in data.get("overhead_s", {}).items()})


# -- prediction ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    tokens_per_s: float
    tau: float
    rounds: int
    tokens: int
    decode_s: float


def priced_rounds(prompt_length: int, lengths: list[int], block_size: int) -> list[tuple[int, int, int]]:
    """(committed, previous, context) of each round: what it commits, what the round before committed
    (the first drafter pass reads the prompt: priced as a full block), and the committed tokens it
    starts from (the prompt, the prefill's token, and every earlier round's)."""
    out, previous, context = [], block_size, prompt_length + 1
    for length in lengths:
        out.append((length, previous, context))
        previous, context = length, context + length
    return out


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
        seconds += sum(costs.round_s(shape, *round_)
                       for round_ in priced_rounds(table.prompt_length, lengths, block_size))
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


def _time(call: Callable[[], Any], sync, repeats: int) -> float:
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


def _tree_groups(trees: list[TreeParams]) -> dict[str, tuple[list[int], list[int]]]:
    """Per branching: the depths and budgets to time (anchors of the settings' own)."""
    groups = {}
    for branching in sorted({t.branching for t in trees}, key=lambda b: b or 1 << 30):
        chosen = [t for t in trees if t.branching == branching]
        groups[str(branching)] = (_anchors({t.max_depth for t in chosen}, TREE_DEPTH_ANCHORS),
                                  _anchors({t.budget for t in chosen}, TREE_BUDGET_ANCHORS))
    return groups


@torch.inference_mode()
def measure_costs(target, drafter, settings: list[MethodParams], contexts: tuple[int, ...],
                  calibration_prompt: torch.Tensor | None = None, calibration: GenerationConfig | None = None,
                  repeats: int = 5) -> CostTable:
    """Time every piece the rounds of ``settings`` (parameter objects, of one method or several) use
    on this target and drafter (see the module docstring), the passes at each of ``contexts`` (committed
    tokens: typically where the trials' generations start and end). ``calibration_prompt`` /
    ``calibration``: real runs per method that drafts, whose rounds calibrate its per-round remainder
    (skipped when None)."""
    sync = device_sync(target.device)
    block = drafter.block_size if drafter is not None else 1
    shapes = [entry_of(params).round_shape(params, block) for params in settings]
    chains = _anchors({s.verify_width for s in shapes if s.drafts and s.tree is None}, MAX_ANCHORS)
    trees = [s.tree for s in shapes if s.tree is not None]
    groups = _tree_groups(trees)
    widest = max([*chains, *(max(budgets) + 1 for _, budgets in groups.values()), block, 1])
    contexts = tuple(sorted({max(c, block) for c in contexts}))
    # commits add their paths to the cache: sum over lengths 1..block of (repeats + 1) passes
    capacity = contexts[-1] + (repeats + 1) * block * (block + 1) // 2 + widest + 64
    target.start(capacity=capacity, max_verify=widest)
    generator = torch.Generator().manual_seed(0)
    vocab = target.model.get_input_embeddings().weight.shape[0] - 1
    text = torch.randint(1, vocab, (1, contexts[-1]), generator=generator)
    root = torch.ones(1, dtype=torch.long, device=target.device)
    drafting = None
    if drafter is not None and any(shape.drafts for shape in shapes):
        # the drafting the engines get (graph replays when the target replays its own)
        drafting = open_drafting(drafter, target, contexts[-1] + (repeats + 2) * 2 * block + 2 * block)

    advance_s, verify_s = {}, {}
    fed, tree_logits = 0, None  # the drafter's proposal the trees are built from (logits, or a Lattice)
    for context in contexts:
        # the cache holds ``context`` committed tokens: the prompt's text fed up to here
        taps = target.prefill(text[:, fed:context]).taps if fed == 0 else target.advance(text[0, fed:context]).taps
        fed = context
        if drafting is not None and tree_logits is None:  # the trees are built from the drafter's own view
            drafting.draft(root, taps, block - 1)
            tree_logits = drafting.draft(root, taps[:, -1:], block - 1).clone()
        advance_s[context] = _time(lambda: target.advance(root), sync, repeats)  # AR's round, as it runs
        table: dict[str, Any] = {CHAIN: {}}
        for width in chains:
            chain = torch.ones(width, dtype=torch.long, device=target.device)
            table[CHAIN][width] = _time(lambda chain=chain: target.verify_chain(chain), sync, repeats)
        for branching, (depths, budgets) in groups.items():
            table[branching] = {}
            for depth in depths:
                table[branching][depth] = {}
                for budget in budgets:
                    params = TreeParams(budget, depth, None if branching == "None" else int(branching))
                    tree = build_draft_tree(tree_logits[:depth], params).to(target.device)
                    table[branching][depth][budget] = _time(lambda tree=tree: target.verify_tree(root[0], tree),
                                                            sync, repeats)
        verify_s[context] = table

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
    if drafting is not None:  # any committed tokens' taps serve: the pass's cost is its shape
        new_taps = target.verify_chain(text[0, :block].to(target.device)).taps
        for new in sorted({1, block}):
            draft_s[new] = _time(lambda new=new: drafting.draft(root, new_taps[:, :new], block - 1), sync, repeats)
        for branching, (depths, budgets) in groups.items():
            tree_s[branching] = {
                # the engine drafts max_depth rows, and the build's graph is keyed by that shape
                d: {b: _time(lambda d=d, b=b: drafting.build_tree(tree_logits[:d].contiguous(), TreeParams(
                    b, d, None if branching == "None" else int(branching))), sync, repeats) for b in budgets}
                for d in depths
            }
    costs = CostTable(str(target.device), advance_s, verify_s, draft_s, tree_s, commit_s)
    if calibration_prompt is not None and calibration is not None:
        for method in {shape.method: None for shape in shapes if shape.drafts}:  # in order of appearance
            ours = sorted((p for p, s in zip(settings, shapes, strict=True) if s.method == method),
                          key=lambda p: entry_of(p).round_shape(p, block).verify_width)
            picks = [ours[0], ours[len(ours) // 2], ours[-1]][:min(CALIBRATION_SETTINGS, len(ours))]
            costs.overhead_s[method] = _calibrate(target, drafter, list(dict.fromkeys(picks)), costs,
                                                  calibration_prompt, calibration)
    return costs


def _calibrate(target, drafter, settings: list[MethodParams], costs: CostTable, prompt: torch.Tensor,
               config: GenerationConfig) -> tuple[float, float]:
    """The per-round remainder of a method as a line a + b x width: for each setting, (decode_s - its
    rounds' timed pieces) / rounds from a real run (the faster of two after a warm-up), fitted over
    the settings' verify widths (one setting: a constant). Never below half the pieces' negative (a
    noisy piece must not make rounds free)."""
    block = drafter.block_size
    points = []
    for params in settings:
        entry = entry_of(params)
        shape = entry.round_shape(params, block)
        warm = GenerationConfig(min(16, config.max_new_tokens), config.temperature)
        entry.generate(target, drafter, prompt, warm, params)
        runs = [entry.generate(target, drafter, prompt, config, params) for _ in range(2)]
        out = min(runs, key=lambda run: run.decode_s / max(run.num_rounds, 1))
        if not out.acceptance_lengths:
            continue
        rounds = len(out.acceptance_lengths)
        pieces = sum(costs.pieces_s(shape, *round_)
                     for round_ in priced_rounds(prompt.shape[1], out.acceptance_lengths, block))
        points.append((shape.verify_width, max((out.decode_s - pieces) / rounds, -0.5 * pieces / rounds)))
    if not points:
        return 0.0, 0.0
    widths = {w for w, _ in points}
    if len(widths) == 1:
        return sum(r for _, r in points) / len(points), 0.0
    mean_w = sum(w for w, _ in points) / len(points)
    mean_r = sum(r for _, r in points) / len(points)
    slope = (sum((w - mean_w) * (r - mean_r) for w, r in points) / sum((w - mean_w) ** 2 for w, _ in points))
    return mean_r - slope * mean_w, slope
