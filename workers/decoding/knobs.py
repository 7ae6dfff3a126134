"""What a method's parameter object knows about its knobs: names, help, defaults, block limits;
and ``RoundShape``, what one round of a setting runs (the words the cost model prices).

Each engine owns one frozen dataclass of parameters (``TreeParams`` for DDTree, ``DFlashParams``,
``ARParams``) that derives from ``MethodParams`` and lists its ``KNOBS``. Everything that names or
checks a method parameter (the sweep file, the bench flags, the Worker, the report's columns,
MLflow's params) reads these, so a knob is declared once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self


@dataclass(frozen=True)
class Knob:
    """One tunable parameter as the user sees it."""

    name: str  # the name in sweep files, MLflow params and reports ("tree_budget")
    help: str
    field: str = ""  # the dataclass field when it differs from ``name``
    required: bool = False  # must be given (a number, never null)
    below_block: bool = False  # 1..block_size-1; None means block_size-1

    @property
    def attribute(self) -> str:
        return self.field or self.name

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, values: Iterable[int | None], block_size: int | None = None) -> None:
        """Every value this knob may take must be valid; ValueError names the knob (not the field)."""
        values = list(values)
        if self.required and None in values:
            raise ValueError(f"{self.name} must be a number (null is not allowed)")
        numbers = [v for v in values if v is not None]
        if any(v < 1 for v in numbers):
            raise ValueError(f"{self.name} values must be >= 1 (got {min(numbers)})")
        if self.below_block and block_size is not None and any(v > block_size - 1 for v in numbers):
            raise ValueError(f"{self.name} {max(numbers)} exceeds the drafter's block_size-1 = {block_size - 1}")


class MethodParams:
    """Mixin for a method's frozen parameter dataclass (see the module docstring)."""

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

    def as_dict(self) -> dict[str, int | None]:
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


@dataclass(frozen=True)
class ARParams(MethodParams):
    """Autoregressive decoding has no knobs."""


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
    tree: Any = None  # a TreeParams (decoding.tree), named loosely: knobs sits below tree
