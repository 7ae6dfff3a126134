"""Each method's parameters and the rules that follow from them alone, without torch.

A method's parameter object is a frozen dataclass deriving from ``MethodParams`` (``ARParams``,
``DFlashParams``, ``TreeParams`` for DDTree) that lists its ``KNOBS``: everything that names or
checks a method parameter (the sweep file, the bench flags, the Worker, the report's columns,
MLflow's params) reads these, so a knob is declared once. It also answers, for any setting, what
one of its rounds runs (``round_shape``: the words the cost model prices) and what the acceptance
replay must keep to predict it (``replay_plan``). Nothing here imports torch, so the sweep's driver
can check and plan settings without loading a model's libraries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self

# The stages of a round, as the engines time them (``share_<stage>`` metrics with stage timing on).
STAGES = ("draft", "tree", "verify", "commit")


@dataclass(frozen=True)
class Knob:
    """One tunable parameter as the user sees it."""

    name: str  # the name in sweep files, MLflow params and reports ("tree_budget")
    help: str
    field: str = ""  # the dataclass field when it differs from ``name``
    required: bool = False  # must be given (a number, never null)
    below_block: bool = False  # 1..block_size-1; None means block_size-1
    fraction: bool = False  # a real number in (0, 1] rather than a whole number >= 1

    @property
    def attribute(self) -> str:
        return self.field or self.name

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def read(self, value: Any) -> int | float | None:
        """A value read back from a store (MLflow's strings, a table's floats) as this knob's kind."""
        if value is None or value == "None" or (isinstance(value, float) and math.isnan(value)):
            return None
        return float(value) if self.fraction else int(float(value))

    def check(self, values: Iterable[int | None], block_size: int | None = None) -> None:
        """Every value this knob may take must be valid; ValueError names the knob (not the field)."""
        values = list(values)
        if self.required and None in values:
            raise ValueError(f"{self.name} must be a number (null is not allowed)")
        numbers = [v for v in values if v is not None]
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in numbers):
            raise ValueError(f"{self.name} values must be numbers (got {numbers})")
        if self.fraction:
            if any(not 0 < v <= 1 for v in numbers):
                raise ValueError(f"{self.name} values must be in (0, 1] (got {numbers})")
            return
        if any(v != int(v) for v in numbers):
            raise ValueError(f"{self.name} values must be whole numbers (got {numbers})")
        if any(v < 1 for v in numbers):
            raise ValueError(f"{self.name} values must be >= 1 (got {min(numbers)})")
        if self.below_block and block_size is not None and any(v > block_size - 1 for v in numbers):
            raise ValueError(f"{self.name} {max(numbers)} exceeds the drafter's block_size-1 = {block_size - 1}")


class MethodParams:
    """Mixin for a method's frozen parameter dataclass (see the module docstring)."""

    METHOD: ClassVar[str] = ""  # the method's name ("ddtree")
    KNOBS: ClassVar[tuple[Knob, ...]] = ()

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        return tuple(knob.name for knob in cls.KNOBS)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Self:
        """Build from knob names (a sweep trial's params, the bench flags); unknown names refused."""
        unknown = sorted(set(values) - set(cls.knob_names()))
        if unknown:
            raise ValueError(f"not a parameter of this method: {', '.join(unknown)} "
                             f"(its parameters: {', '.join(cls.knob_names()) or 'none'})")
        for knob in cls.KNOBS:
            if knob.required and values.get(knob.name) is None:
                raise ValueError(f"{knob.name} is required")
            knob.check([values.get(knob.name)])
        return cls(**{knob.attribute: values.get(knob.name) for knob in cls.KNOBS})

    def as_dict(self) -> dict[str, int | float | None]:
        """Knob name -> value (what MLflow logs and reports show)."""
        return {knob.name: getattr(self, knob.attribute) for knob in self.KNOBS}

    def resolved(self, block_size: int | None) -> Self:
        """Defaults filled (block-limited knobs: block_size-1) and every value checked against the block."""
        updates: dict[str, Any] = {}
        for knob in self.KNOBS:
            value = getattr(self, knob.attribute)
            if knob.below_block and value is None and block_size is not None:
                value = updates[knob.attribute] = block_size - 1
            knob.check([value], block_size)
        return replace(self, **updates) if updates else self

    def round_shape(self, block_size: int) -> RoundShape:
        """What one round of this setting runs (the words the cost model prices)."""
        raise NotImplementedError

    @classmethod
    def replay_plan(cls, settings: Sequence[Self], block_size: int) -> ReplayPlan:
        """What the acceptance replay must keep to replay every one of ``settings``."""
        return ReplayPlan()


@dataclass(frozen=True)
class RoundShape:
    """What one round of a setting runs, as the cost model prices it (``workers.costs``).

    method:       the method's name (the cost table calibrates a per-round remainder per method);
    verify_width: positions of the round's target pass, the root (bonus) included;
    drafts:       one drafter pass per round, and a commit of the accepted path after the verify;
                  False: AR's round, one ``advance`` that commits its token as it goes;
    tree:         the DDTree parameters whose tree is built every round (None: no tree).
    """

    method: str
    verify_width: int
    drafts: bool
    tree: TreeParams | None = None


@dataclass(frozen=True)
class ReplayPlan:
    """What the replay tables must hold for a set of settings: ``top_k`` entries per depth (the widest
    tree any setting builds) and, for trees, the ``ceiling`` budget whose trees every smaller budget
    shares (None: no trees)."""

    top_k: int = 1
    ceiling: int | None = None

    def merge(self, other: ReplayPlan) -> ReplayPlan:
        ceilings = [c for c in (self.ceiling, other.ceiling) if c is not None]
        return ReplayPlan(max(self.top_k, other.top_k), max(ceilings) if ceilings else None)


@dataclass(frozen=True)
class ARParams(MethodParams):
    """Autoregressive decoding has no knobs: one token a round, by an advance that commits it."""

    METHOD: ClassVar[str] = "ar"

    def round_shape(self, block_size: int | None) -> RoundShape:
        return RoundShape(self.METHOD, verify_width=1, drafts=False)


@dataclass(frozen=True)
class DFlashParams(MethodParams):
    """DFlash: a chain of ``num_draft_tokens`` guesses after the bonus, verified in one pass."""

    METHOD: ClassVar[str] = "dflash"
    KNOBS: ClassVar[tuple[Knob, ...]] = (
        Knob("num_draft_tokens", "DFlash chain length (default block_size-1)", below_block=True),
    )

    num_draft_tokens: int | None = None  # 1..block_size-1; None = block_size-1

    def round_shape(self, block_size: int) -> RoundShape:
        return RoundShape(self.METHOD, verify_width=self.resolved(block_size).num_draft_tokens + 1, drafts=True)


@dataclass(frozen=True)
class TreeParams(MethodParams):
    """DDTree's parameters: the tree knobs a sweep tunes.

    budget:    drafted nodes besides the root (>= 1).
    max_depth: deepest level drafted (1..block_size-1); None = every drafter position.
    branching: most children per node, i.e. top-K per depth; None = unlimited (K = min(budget, V)).
    depth_discount: gamma in (0, 1]: a node's score sums gamma^(d-1) x the log-prob of its token at
               depth d, so gamma < 1 trusts deep positions more than the drafter says (for drafters
               underconfident at depth). Scores still fall along every path, so the tree stays the
               best-first tree of those scores. None = 1: the plain path log-prob.
    """

    METHOD: ClassVar[str] = "ddtree"
    KNOBS: ClassVar[tuple[Knob, ...]] = (
        Knob("tree_budget", "DDTree nodes besides the root", field="budget", required=True),
        Knob("max_depth", "DDTree depth cap (default block_size-1)", below_block=True),
        Knob("branching", "DDTree children per node, i.e. top-K per depth (default unlimited)"),
        Knob("depth_discount", "DDTree: weight gamma^(d-1) of depth d's log-prob in a node's score, "
             "in (0, 1] (default 1)", fraction=True),
    )

    budget: int
    max_depth: int | None = None
    branching: int | None = None
    depth_discount: float | None = None

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"tree budget must be >= 1, got {self.budget}")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        if self.branching is not None and self.branching < 1:
            raise ValueError(f"branching must be >= 1, got {self.branching}")
        if self.depth_discount is not None and not 0 < self.depth_discount <= 1:
            raise ValueError(f"depth_discount must be in (0, 1], got {self.depth_discount}")

    def depth_weights(self, depths: int) -> list[float] | None:
        """gamma^(d-1) for depths 1..``depths`` (the factor of each depth's log-probs), or None for none."""
        if self.depth_discount is None or self.depth_discount == 1:
            return None
        return [self.depth_discount**d for d in range(depths)]

    def round_shape(self, block_size: int) -> RoundShape:
        """The root and every node the tree can hold (the budget, or fewer when depth and branching cap it)."""
        params = self.resolved(block_size)
        return RoundShape(self.METHOD, verify_width=tree_size(params, params.max_depth) + 1, drafts=True, tree=params)

    @classmethod
    def replay_plan(cls, settings: Sequence[TreeParams], block_size: int) -> ReplayPlan:
        """Trees of every budget are cut from the largest budget's (the ceiling); each depth keeps the
        widest top-K any setting reads from those trees."""
        ceiling = max(p.budget for p in settings)
        return ReplayPlan(top_k=max(min(ceiling, p.branching or ceiling) for p in settings), ceiling=ceiling)


def tree_size(params: TreeParams, depth_limit: int, vocab_size: int | None = None) -> int:
    """Nodes besides the root of the tree ``tree.build_tree`` makes from ``depth_limit`` rows of a
    ``vocab_size`` vocabulary (None: larger than any top-K): the budget, unless depth and branching
    cap it lower (each depth keeps at most ``budget`` prefixes, each with at most top-K children;
    depth 4 and branching 2 hold 2 + 4 + 8 + 16 = 30 nodes whatever the budget)."""
    top_k = params.budget if params.branching is None else min(params.budget, params.branching)
    if vocab_size is not None:
        top_k = min(top_k, vocab_size)
    total, level = 0, 1
    for _ in range(depth_limit):
        level = min(params.budget, level * top_k)
        total += level
        if total >= params.budget:
            return params.budget
    return total
