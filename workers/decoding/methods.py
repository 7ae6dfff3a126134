"""The registry of decoding methods: each method's engine, its parameters and its rules, in one place.

A method is one module (``ar``, ``dflash``, ``ddtree``) with the same names: ``generate`` (the
engine), ``round_shape`` (what one round of a setting runs: its verify width, whether it drafts,
its tree), ``replay_lengths`` (its rounds replayed from one AR run) and ``replay_plan`` (what the
replay tables must keep for a set of settings). ``METHODS[method]`` binds a module to its parameter
type; the sweep config, the bench CLI, the Worker, the cost model, the predictor and the report ask
the entry, so no code outside ``workers.decoding`` compares method names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any

from workers.decoding import ar, ddtree, dflash
from workers.decoding.dflash import DFlashParams
from workers.decoding.knobs import ARParams, Knob, MethodParams, RoundShape
from workers.decoding.replay import ReplayPlan, ReplayTable
from workers.decoding.tree import TreeParams


class Method(str, Enum):
    AR = "ar"
    DFLASH = "dflash"
    DDTREE = "ddtree"


@dataclass(frozen=True)
class MethodEntry:
    method: Method
    module: ModuleType  # generate, round_shape, replay_lengths, replay_plan
    params: type[MethodParams]
    needs_drafter: bool

    @property
    def generate(self) -> Callable:
        """generate(target, drafter, prompt_ids, config, params, timer=..., draft_graphs=...)"""
        return self.module.generate

    def params_from(self, setting: Mapping[str, Any], block_size: int | None = None) -> MethodParams:
        """The parameter object of a flat setting (knob name -> value: a trial's sampled parameters
        merged with the fixed ones), every value checked; with ``block_size``, defaults filled."""
        params = self.params.from_mapping(setting)
        return params.resolved(block_size) if block_size is not None else params

    def round_shape(self, params: MethodParams, block_size: int) -> RoundShape:
        return self.module.round_shape(params, block_size)

    def verify_width(self, params: MethodParams, block_size: int) -> int:
        """Positions one verify pass of this setting holds, the root included."""
        return self.round_shape(params, block_size).verify_width

    def replay_lengths(self, table: ReplayTable, params: MethodParams, block_size: int,
                       ceiling: int | None = None) -> list[int]:
        """Per-round acceptance lengths (bonus included) this setting's engine reports on the prompt
        of ``table`` (greedy: exactly; sampled: in distribution)."""
        return self.module.replay_lengths(table, params, block_size, ceiling)

    def replay_plan(self, settings: list[MethodParams], block_size: int) -> ReplayPlan:
        return self.module.replay_plan(settings, block_size)


METHODS: dict[Method, MethodEntry] = {
    Method.AR: MethodEntry(Method.AR, ar, ARParams, needs_drafter=False),
    Method.DFLASH: MethodEntry(Method.DFLASH, dflash, DFlashParams, needs_drafter=True),
    Method.DDTREE: MethodEntry(Method.DDTREE, ddtree, TreeParams, needs_drafter=True),
}


def entry(method: Method | str) -> MethodEntry:
    """The entry of a method given by its enum or its name ('ddtree')."""
    return METHODS[Method(method)]


def all_knobs() -> list[Knob]:
    """Every method's knobs, each name once (report columns, bench flags)."""
    seen: dict[str, Knob] = {}
    for method_entry in METHODS.values():
        for knob in method_entry.params.KNOBS:
            seen.setdefault(knob.name, knob)
    return list(seen.values())


def entry_of(params: MethodParams) -> MethodEntry:
    """The entry whose parameter type ``params`` is (a parameter object names its method)."""
    for method_entry in METHODS.values():
        if type(params) is method_entry.params:
            return method_entry
    raise TypeError(f"{type(params).__name__} is not a registered method's parameters")


def method_of(params: MethodParams) -> Method:
    return entry_of(params).method
