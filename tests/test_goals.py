"""``benchmarks/goals.py``: issue 28's goals as ``gpu_speed.py`` prints them, each ratio with its spread over the
passes' and rounds' repeated timings and the floors measured at the run's start and end."""

from __future__ import annotations

import pytest

from tests.helpers.benchmarks import load_benchmark

goals = load_benchmark("goals")
Spread = goals.Spread


def test_a_spread_of_timings_and_of_a_floor_measured_twice():
    assert goals.Spread.of([3.0, 1.0, 2.0, 10.0]) == Spread(2.5, 1.0, 10.0)
    assert goals.Spread.first_of([5.0, 4.0]) == Spread(5.0, 4.0, 5.0)  # the run's first measurement, as before
    assert Spread(2.0, 1.0, 3.0) * 2 == Spread(4.0, 2.0, 6.0)


def test_a_ratio_runs_from_the_least_numerator_over_the_largest_denominator_to_the_reverse():
    measured = {"round ddtree B=256": Spread(10.0, 9.5, 11.0), "round dflash": Spread(6.0, 5.8, 6.4)}
    found = goals.ratio(measured, lambda m: m["round ddtree B=256"], lambda m: m["round dflash"])
    assert found == Spread(10.0 / 6.0, 9.5 / 6.4, 11.0 / 5.8)
    plain = goals.ratio({"a": 3.0, "b": 2.0}, lambda m: m["a"], lambda m: m["b"])  # numbers: no spread
    assert plain == Spread(1.5, 1.5, 1.5)


def measured_run(verify_257: Spread, rate_scale: float = 1.0) -> dict:
    """A hybrid run's numbers: the compute floor per row from two burst rates (the end's ``rate_scale`` times
    the start's), the weight floor from two copies."""
    per_row = 0.068
    return {"hybrid": True, "context": 1024, "split ratios": [],
            "floor W": Spread.first_of([12.8, 12.9]),
            "floor C per row": Spread.first_of([per_row, per_row / rate_scale]),
            "verify 257 tree": verify_257, "round ar": Spread(13.7, 13.6, 13.8),
            "round dflash": Spread(16.8, 16.7, 17.0), "round ddtree B=256": Spread(30.1, 29.9, 30.5),
            "drafter graph": 1.8, "prefill graph": Spread(95.0, 94.0, 97.0)}


def line_of(lines: list[str], label: str) -> str:
    [line] = [line for line in lines if line.lstrip().startswith(label)]
    return line


def test_the_goal_lines_give_each_ratio_its_spread_and_a_verdict_on_the_middle():
    lines = goals.goal_lines(measured_run(Spread(26.4, 26.0, 27.0), rate_scale=0.95))
    floor_257 = 0.068 * 257  # the larger floor at 257 rows: the products' arithmetic
    verify = line_of(lines, "verify q=257")
    assert f"{26.4 / floor_257:.3f}x" in verify
    # least: the fastest pass over the larger floor (the end's slower burst rate); most: the slowest over the start's
    assert f"{26.0 / (floor_257 / 0.95):.3f}-{27.0 / floor_257:.3f}x" in verify
    assert verify.endswith("missed")
    assert line_of(lines, "AR decode step").endswith("met")  # 13.7 / 12.8 = 1.07 <= 1.2 for a hybrid
    assert "out of reach" not in line_of(lines, "DDTree B=256")  # least (1.8 + 17.5) / 16.8 = 1.15 < 1.3
    assert f"{(1.8 + 0.068 * 257) / 16.8:.3f}x" in line_of(lines, "DDTree B=256")
    assert not any(line.lstrip().startswith(("verify q=1025", "DDTree B=64", "split")) for line in lines)  # not run


@pytest.mark.parametrize(("middle", "verdict"), [(0.068 * 257 * 1.39, "met, the bound within the spread"),
                                                 (0.068 * 257 * 1.41, "missed, the bound within the spread")])
def test_a_bound_inside_the_spread_is_said_either_way(middle, verdict):
    lines = goals.goal_lines(measured_run(Spread(middle, middle * 0.98, middle * 1.02)))
    assert line_of(lines, "verify q=257").endswith(verdict)


def test_the_products_bound_says_a_goal_is_out_of_reach_with_the_products_this_run_timed():
    """With the 257-row pass's products profiled (22.5 ms): the verify pass could still be 22.5 / 17.48 = 1.29x
    its floor with every other kernel free (reachable by them), but a B = 256 round at least (1.8 + 22.5) / 16.8
    = 1.45x a DFlash round: out of reach with these products, though the floors alone allow 1.15x."""
    run = measured_run(Spread(26.4, 26.0, 27.0)) | {"products 257": 22.5}
    lines = goals.goal_lines(run)
    verify = line_of(lines, "verify q=257")
    assert f"{22.5 / (0.068 * 257):.3f}x" in verify
    assert verify.endswith("missed")
    ddtree = line_of(lines, "DDTree B=256")
    assert f"{(1.8 + 22.5) / 16.8:.3f}x" in ddtree
    assert ddtree.endswith("missed; out of reach with these products")
    # the same products under a round that meets its bound: met, whatever the bound says of the products
    met = run | {"round ddtree B=256": Spread(20.0, 19.9, 20.1)}
    assert line_of(goals.goal_lines(met), "DDTree B=256").endswith("met")
    # B = 255's pass has 256 rows: not profiled here, so no products bound on its line
    assert "products" not in line_of(goals.goal_lines(run | {"round ddtree B=255": Spread(29.0, 28.9, 29.1)}),
                                     "DDTree B=255")
