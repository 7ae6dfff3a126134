"""Issues 12 and 28's goals as ``gpu_speed.py`` prints them: each a ratio of this run's measurements against a
bound, with its spread.

A measurement is a number or a ``Spread``: a pass's or round's repeated timings (their median, least and
most), or a floor measured at the run's start and again at its end (the start's value, and the two's least
and most; a burst's matmul rate moved 737-789 TFLOP/s between H200s, and with it every ratio against the
compute floor: ``benchmarks/results/wide_passes_h200.md``, thirtieth session). A goal's ratio is its
numerator over its denominator at the middle values; its spread runs from the least numerator over the
largest denominator to the most over the least. The verdict reads the middle value.

Two lower bounds say whether a missed goal is within reach. "least": the floors alone (for a round, its
drafter pass and a verify pass at its floor): above the bound, no kernels could meet it on this GPU.
"products": the matrix products of the verify pass as this run's profile of it timed them (``--profile``
at that width; cuBLAS's and cuBLASLt's, as ``lt_product`` chose), every other kernel free: above the bound,
the goal needs faster products than these, whatever else gets faster.
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


def verify_floor(q: int) -> Of:
    """A pass of q rows: the larger of the weight read and the products' arithmetic."""
    return lambda m: max(m["floor W"], m["floor C per row"] * q)


def compute_floor(q: int) -> Of:
    return lambda m: m["floor C per row"] * q


def least_round(budget: int) -> Of:
    """The least a DDTree round of ``budget`` nodes can cost (ms): this run's drafter pass, then a verify pass
    of budget + 1 rows at its floor; the tree build, the walk and the commit counted as free."""
    return lambda m: m["drafter graph"] + verify_floor(budget + 1)(m)


def round_with_products(budget: int) -> Of:
    """The least a DDTree round of ``budget`` nodes can cost (ms) with this run's products: the drafter pass,
    then the verify pass's matrix products as the profile of its graph timed them (``--profile budget + 1``),
    every other kernel of the pass, the tree build, the walk and the commit counted as free."""
    return lambda m: m["drafter graph"] + m[f"products {budget + 1}"]


def products(q: int) -> Of:
    """The least a verify pass of q rows can cost (ms) with this run's products (``--profile q``): its products
    alone, every other kernel counted as free."""
    return lambda m: m[f"products {q}"]


def one(_: View) -> float:
    return 1.0


@dataclass(frozen=True)
class Goal:
    label: str
    numerator: Of  # from this run's measurements
    denominator: Of
    bound: float | dict  # a number, or hybrid shape -> number
    # the least numerator this GPU allows (over the denominator: a bound below it is out of reach with any
    # kernels), and the least with this run's products, every other kernel free
    least: Of | None = None
    with_products: Of | None = None


def ddtree_round(budget: int, bound: float) -> Goal:
    return Goal(f"DDTree B={budget} round / DFlash round", lambda m: m[f"round ddtree B={budget}"],
                lambda m: m["round dflash"], bound, least_round(budget), round_with_products(budget))


GOALS: tuple[Goal, ...] = (
    Goal("AR decode step / weight floor", lambda m: m["round ar"], lambda m: m["floor W"], {True: 1.2, False: 1.25}),
    Goal("verify q=257 tree / max(floors)", lambda m: m["verify 257 tree"], verify_floor(257), 1.4,
         with_products=products(257)),
    Goal("verify q=1025 tree / compute floor", lambda m: m["verify 1025 tree"], compute_floor(1025), 1.5,
         with_products=products(1025)),
    ddtree_round(64, 1.15),
    ddtree_round(256, 1.3),
    ddtree_round(255, 1.3),  # one node fewer, so the pass has 256 rows, not 257 (cheaper than B = 256 itself)
    ddtree_round(1024, 3.0),
    Goal("prefill / compute floor", lambda m: m["prefill graph"], lambda m: compute_floor(m["context"])(m), 2.0),
    Goal("split / unsplit, worst pass or round", lambda m: max(m["split ratios"]), one, 1.05),
)


def ratio(measured: dict, numerator: Of, denominator: Of) -> Spread:
    """numerator / denominator at the middle values, and at the ends that make it least and most."""
    middle, low, high = (View(measured, end) for end in ("middle", "low", "high"))
    return Spread(numerator(middle) / denominator(middle), numerator(low) / denominator(high),
                  numerator(high) / denominator(low))


def least_ratio(of: Of | None, goal: Goal, measured: dict) -> float | None:
    """A least numerator over the goal's denominator at the middle values, or None where the goal has no such
    bound or this run lacks its numbers."""
    middle = View(measured, "middle")
    try:
        return of(middle) / goal.denominator(middle) if of is not None else None
    except KeyError:  # not profiled at that width (``--profile``)
        return None


def goal_lines(measured: dict) -> list[str]:
    """This run's ratio against each bound, with its spread (goals whose numbers it lacks left out), the least
    ratio this GPU allows (the rounds: "out of reach" where it exceeds the bound) and the least with this
    run's products where their width was profiled ("out of reach with these products")."""
    lines = [f"{'goal':>38} {'this run':>9} {'spread':>15} {'bound':>6} {'least':>7} {'products':>8}"]
    for goal in GOALS:
        try:
            found = ratio(measured, goal.numerator, goal.denominator)
        except (KeyError, ValueError):  # not measured in this run (other --qs, --only-forwards, no --split)
            continue
        bound = goal.bound[measured["hybrid"]] if isinstance(goal.bound, dict) else goal.bound
        least, with_products = (least_ratio(goal.least, goal, measured),
                                least_ratio(goal.with_products, goal, measured))
        verdict = "met"
        if found.middle > bound:
            verdict = "missed"
            if least is not None and least > bound:
                verdict += "; out of reach"
            elif with_products is not None and with_products > bound:
                verdict += "; out of reach with these products"
        if found.low <= bound < found.high:
            verdict += ", the bound within the spread"
        spread = f"{found.low:.3f}-{found.high:.3f}x"
        lines.append(f"{goal.label:>38} {found.middle:>8.3f}x {spread:>15} {bound:>5.2f}x "
                     f"{f'{least:.3f}x' if least else '':>7} {f'{with_products:.3f}x' if with_products else '':>8}"
                     f"  {verdict}")
    return lines
