"""The sweep's predictions: replay tables and cost tables from the actors, tokens/s for any setting.

At the start of a sweep that predicts (``sampler: {type: predicted}`` or ``predict: true``), the
first actor records the acceptance replay of the sweep's prompts (``Worker.replay_tables``) and
every actor measures its own cost table (``Worker.measure_costs``: hardware may differ between
actors). A trial's ``predicted_tokens_per_s`` uses the cost table of the actor that runs it.

Greedy: the predicted rounds are exact (float32) or match to noise (bf16). Temperature > 0: the
replay runs on a sampled AR continuation, which gives the engines' acceptance in distribution
(their output is an AR sample), so the prediction is a one-sample Monte-Carlo estimate of tau; the
predicted strategy uses it the same way, and the report's predicted-vs-measured columns show how
well it held.

The predicted strategy: predict every point of the space (or ``max_points`` of them), run the
``n_trials - explore`` best and ``explore`` random others (to check the model away from its
optimum); the plan is stored on the Optuna study, so a resumed sweep runs the same points.
"""

from __future__ import annotations

import random
from typing import Any

import ray

from orchestrator import study as studies
from orchestrator.config import SweepConfig
from workers.costs import CostTable, predict
from workers.decoding.params import ReplayPlan
from workers.decoding.replay import ReplayTable


def replay_plan(config: SweepConfig, block_size: int) -> ReplayPlan:
    """What the replay tables must keep for every trial of the sweep: the plans of each method's widest
    setting merged (the largest budget is the ceiling, the widest branching the top-K)."""
    plan = ReplayPlan()
    for method in config.methods:
        entry = config.entry_for(method)
        plan = plan.merge(entry.replay_plan([entry.params_from(config.widest_setting(method), block_size)],
                                            block_size))
    return plan


class Predictor:
    def __init__(self, config: SweepConfig, tables: list[ReplayTable], costs: dict[int, CostTable], block_size: int,
                 plan: ReplayPlan) -> None:
        self.config, self.tables, self.costs, self.block_size = config, tables, costs, block_size
        self.replay_plan = plan
        self.points: list[dict[str, Any]] = []
        self._cache: dict[tuple, dict[str, float]] = {}

    @classmethod
    def gather(cls, config: SweepConfig, slots, make_spec, block_size: int) -> Predictor:
        """Replay on the first actor and a cost table on every actor, in parallel (models stay loaded).

        ``make_spec(setting)``: the sweep's TrialSpec for one setting (its prompts and generation
        settings are what the replay and the cost table use)."""
        points = studies.space_points(config, config.sampler.max_points, config.sampler.seed)
        settings = [config.params_of(point, block_size) for point in points]
        spec = make_spec(points[0])
        plan = replay_plan(config, block_size)
        replay_ref = slots[0].handle.replay_tables.remote(spec, plan.top_k)
        cost_refs = [slot.handle.measure_costs.remote(spec, settings) for slot in slots]
        tables = [ReplayTable.from_dict(t) for t in ray.get(replay_ref)]
        costs = {slot.index: CostTable.from_dict(c) for slot, c in zip(slots, ray.get(cost_refs), strict=True)}
        predictor = cls(config, tables, costs, block_size, plan)
        predictor.points = points
        return predictor

    def predict(self, params: dict[str, Any], actor: int = 0) -> dict[str, float]:
        setting = self.config.setting(params)
        actor = actor if actor in self.costs else min(self.costs)
        key = (actor, tuple(sorted(setting.items(), key=lambda item: item[0])))
        if key not in self._cache:
            p = predict(self.tables, self.costs[actor], self.config.params_of(params, self.block_size),
                        self.block_size, self.replay_plan.ceiling)
            self._cache[key] = {"predicted_tokens_per_s": p.tokens_per_s, "predicted_tau": p.tau,
                                "predicted_rounds": float(p.rounds)}
        return self._cache[key]

    def plan(self) -> list[dict[str, Any]]:
        """The predicted strategy's points: the best by predicted tokens/s, then random others."""
        scored = sorted(self.points, key=lambda point: -self.predict(point)["predicted_tokens_per_s"])
        wanted = studies.target_complete(self.config)
        explore = min(self.config.sampler.explore, max(wanted - 1, 0))
        top = scored[: wanted - explore]
        others = random.Random(self.config.sampler.seed).sample(scored[len(top) :],
                                                                min(explore, len(scored) - len(top)))
        return [{"params": p, "role": "top", **self.predict(p)} for p in top] + [
            {"params": p, "role": "explore", **self.predict(p)} for p in others
        ]
