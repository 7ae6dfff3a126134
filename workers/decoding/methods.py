"""The registry of decoding methods: each method's engine, its parameters and its rules, in one place.

A method is a parameter type (``workers.decoding.params``: its knobs, what one round of a setting
runs, what the acceptance replay must keep) and an engine module (``ar``, ``dflash``, ``ddtree``:
``generate`` and ``replay_lengths``, its rounds replayed from one AR run). ``METHODS[method]`` binds
the two; the sweep config, the bench CLI, the Worker, the cost model, the predictor and the report
ask the entry, so no code outside ``workers.decoding`` compares method names.

The engine module is imported when first asked for: this registry, and so the sweep's config and
driver, load without torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import Any

from workers.decoding.params import ARParams, DFlashParams, Knob, MethodParams, ReplayPlan, RoundShape, TreeParams


class Method(str, Enum):
    AR = "ar"
    DFLASH = "dflash"
    DDTREE = "ddtree"


@dataclass(frozen=True)
class MethodEntry:
    method: Method
    params: type[MethodParams]
    engine: str  # the engine module: generate(...) and replay_lengths(...)
    needs_drafter: bool

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(self.engine)

    @property
    def generate(self) -> Callable:
        """generate(target, drafter, prompt_ids, config, params, timer=...)"""
        return self.module.generate

    def params_from(self, setting: Mapping[str, Any], block_size: int | None = None) -> MethodParams:
        """The parameter object of a flat setting (knob name -> value: a trial's sampled parameters
        merged with the fixed ones), every value checked; with ``block_size``, defaults filled."""
        params = self.params.from_mapping(setting)
        return params.resolved(block_size) if block_size is not None else params

    def round_shape(self, params: MethodParams, block_size: int) -> RoundShape:
        return params.round_shape(block_size)

    def verify_width(self, params: MethodParams, block_size: int) -> int:
        """Positions one verify pass of this setting holds, the root included."""
        return params.round_shape(block_size).verify_width

    def replay_plan(self, settings: Sequence[MethodParams], block_size: int) -> ReplayPlan:
        return self.params.replay_plan(settings, block_size)

    def replay_lengths(self, table, params: MethodParams, block_size: int, ceiling: int | None = None) -> list[int]:
        """Per-round acceptance lengths (bonus included) this setting's engine reports on the prompt
        of ``table`` (a ``replay.ReplayTable``; greedy: exactly, sampled: in distribution)."""
        return self.module.replay_lengths(table, params, block_size, ceiling)


METHODS: dict[Method, MethodEntry] = {
    Method.AR: MethodEntry(Method.AR, ARParams, "workers.decoding.ar", needs_drafter=False),
    Method.DFLASH: MethodEntry(Method.DFLASH, DFlashParams, "workers.decoding.dflash", needs_drafter=True),
    Method.DDTREE: MethodEntry(Method.DDTREE, TreeParams, "workers.decoding.ddtree", needs_drafter=True),
}


def entry(method: Method | str) -> MethodEntry:
    """The entry of a method given by its enum or its name ('ddtree')."""
    return METHODS[Method(method)]


def entry_of(params: MethodParams) -> MethodEntry:
    """The entry whose parameter type ``params`` is (a parameter object names its method)."""
    return entry(params.METHOD)


def method_of(params: MethodParams) -> Method:
    return entry_of(params).method


def all_knobs() -> list[Knob]:
    """Every method's knobs, each name once (report columns, bench flags)."""
    seen: dict[str, Knob] = {}
    for method_entry in METHODS.values():
        for knob in method_entry.params.KNOBS:
            seen.setdefault(knob.name, knob)
    return list(seen.values())
