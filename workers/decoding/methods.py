"""The registry of decoding methods: each method's engine and its parameter object, in one place.

``METHODS[method]`` gives the engine's ``generate`` and its ``params`` type (a ``MethodParams``
with its ``KNOBS``); the sweep config, the bench CLI, the Worker and the report derive every
method-specific name and check from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from workers.decoding import ar, ddtree, dflash
from workers.decoding.dflash import DFlashParams
from workers.decoding.knobs import ARParams, Knob, MethodParams
from workers.decoding.tree import TreeParams


class Method(str, Enum):
    AR = "ar"
    DFLASH = "dflash"
    DDTREE = "ddtree"


@dataclass(frozen=True)
class MethodEntry:
    generate: Callable  # generate(target, drafter, prompt_ids, config, params, timer=..., draft_graphs=...)
    params: type[MethodParams]
    needs_drafter: bool


METHODS: dict[Method, MethodEntry] = {
    Method.AR: MethodEntry(ar.generate, ARParams, needs_drafter=False),
    Method.DFLASH: MethodEntry(dflash.generate, DFlashParams, needs_drafter=True),
    Method.DDTREE: MethodEntry(ddtree.generate, TreeParams, needs_drafter=True),
}


def all_knobs() -> list[Knob]:
    """Every method's knobs, each name once (report columns, bench flags)."""
    seen: dict[str, Knob] = {}
    for entry in METHODS.values():
        for knob in entry.params.KNOBS:
            seen.setdefault(knob.name, knob)
    return list(seen.values())


def method_of(params: MethodParams) -> Method:
    for method, entry in METHODS.items():
        if type(params) is entry.params:
            return method
    raise TypeError(f"{type(params).__name__} is not a registered method's parameters")
