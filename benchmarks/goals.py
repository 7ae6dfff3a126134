"""Issues 12 and 28's goals as ``gpu_speed.py`` prints them: each a ratio of this run's measurements against a
bound, with its spread.

A measurement is a number or a ``Spread``: a pass's or round's repeated timings (their median, least and
most), or a floor measured at the run's start and again at its end (the start's value, and the two's least
and most; a burst's matmul rate moved 737-789 TFLOP/s between H200s, and with it every ratio against the
compute floor: ``benchmarks/results/wide_passes_h200.md``, thirtieth session). A goal's ratio is its
numerator over its denominator at the middle values; its spread runs from the least numerator over the
largest denominator to the most over the least. The verdict reads the middle value.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    middle: float  # a timing's median, or a floor's first measurement
    low: float
    high: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        """Repeated timings: their median, least and most."""
        return cls(statistics.median(samples), min(samples), max(samples))

    @classmethod
    def first_of(cls, values: Sequence[float]) -> Spread:
        """One quantity measured more than once over a run (a floor at its start, then its end): the first."""
        return cls(values[0], min(values), max(values))

    def __mul__(self, factor: float) -> Spread:
        return Spread(self.middle * factor, self.low * factor, self.high * factor)

    def __str__(self) -> str:
        return f"{self.middle:.2f} ({self.low:.2f}-{self.high:.2f})"


class View:
    """The measurements with each ``Spread`` read at one end: "middle", "low" or "high"."""

    def __init__(self, measured: dict, end: str) -> None:
        self.measured, self.end = measured, end

    def __getitem__(self, key: str):
        value = self.measured[key]
        return getattr(value, self.end) if isinstance(value, Spread) else value


Of = Callable[[View], float]


def least_round(budget: int) -> Of:
    """The least a DDTree round of ``budget`` nodes can cost against this run's DFlash round: this run's
    drafter pass, then a verify pass of budget + 1 rows at its floor (the larger of the weight read and
    the products' arithmetic); the tree build, the walk and the commit counted as free."""
    return lambda m: (m["drafter graph"] + max(m["floor W"], m["floor C per row"] * (budget + 1))) / m["round dflash"]


def one(_: View) -> float:
    return 1.0


# (label, the ratio's numerator and denominator from this run's measurements, the bound: a number, or hybrid
# shape -> number, and for the rounds the least ratio this GPU allows: a bound below it is out of reach with
# any kernels)
GOALS: tuple[tuple[str, Of, Of, float | dict, Of | None], ...] = (
    ("AR decode step / weight floor", lambda m: m["round ar"], lambda m: m["floor W"], {True: 1.2, False: 1.25},
     None),
    ("verify q=257 tree / max(floors)", lambda m: m["verify 257 tree"],
     lambda m: max(m["floor W"], m["floor C per row"] * 257), 1.4, None),
    ("verify q=1025 tree / compute floor", lambda m: m["verify 1025 tree"], lambda m: m["floor C per row"] * 1025,
     1.5, None),
    ("DDTree B=64 round / DFlash round", lambda m: m["round ddtree B=64"], lambda m: m["round dflash"], 1.15,
     least_round(64)),
    ("DDTree B=256 round / DFlash round", lambda m: m["round ddtree B=256"], lambda m: m["round dflash"], 1.3,
     least_round(256)),
    # one node fewer, so the pass has 256 rows, not 257 (``--budgets 255``: cheaper than B = 256 itself)
    ("DDTree B=255 round / DFlash round", lambda m: m["round ddtree B=255"], lambda m: m["round dflash"], 1.3,
     least_round(255)),
    ("DDTree B=1024 round / DFlash round", lambda m: m["round ddtree B=1024"], lambda m: m["round dflash"], 3.0,
     least_round(1024)),
    ("prefill / compute floor", lambda m: m["prefill graph"], lambda m: m["floor C per row"] * m["context"], 2.0,
     None),
    ("split / unsplit, worst pass or round", lambda m: max(m["split ratios"]), one, 1.05, None),
)


def ratio(measured: dict, numerator: Of, denominator: Of) -> Spread:
    """numerator / denominator at the middle values, and at the ends that make it least and most."""
    middle, low, high = (View(measured, end) for end in ("middle", "low", "high"))
    return Spread(numerator(middle) / denominator(middle), numerator(low) / denominator(high),
                  numerator(high) / denominator(low))


def goal_lines(measured: dict) -> list[str]:
    """This run's ratio against each bound, with its spread (goals whose numbers it lacks left out) and, for
    the rounds, the least ratio this GPU allows ("out of reach" where that exceeds the bound)."""
    lines = [f"{'goal':>38} {'this run':>9} {'spread':>15} {'bound':>6} {'least':>7}"]
    for label, numerator, denominator, bound, least_of in GOALS:
        try:
            found = ratio(measured, numerator, denominator)
        except (KeyError, ValueError):  # not measured in this run (other --qs, --only-forwards, no --split)
            continue
        bound = bound[measured["hybrid"]] if isinstance(bound, dict) else bound
        least = least_of(View(measured, "middle")) if least_of is not None else None
        verdict = "met" if found.middle <= bound else "missed" + ("; out of reach" if least and least > bound else "")
        if found.low <= bound < found.high:
            verdict += ", the bound within the spread"
        spread = f"{found.low:.3f}-{found.high:.3f}x"
        lines.append(f"{label:>38} {found.middle:>8.3f}x {spread:>15} {bound:>5.2f}x "
                     f"{f'{least:.3f}x' if least else '':>7}  {verdict}")
    return lines
