"""The final re-measurement: the best few settings of the search measured again, and the winner.

After the search, the best ``measurement.final_top_k`` settings are measured again on one actor,
each pass interleaving them with the AR baseline (AR, A, AR, B, ...), so a setting that won on a
lucky sample or on a quiet moment of the machine is not named the winner; each setting's speedup in
a pass is against the AR run just before it. The medians over passes go to one ``remeasure`` run per
setting, and the winner's values to the parent run (``best_*``). A finished study run again finds
its re-measurement already recorded and does not repeat it.
"""

from __future__ import annotations

from typing import Any

import optuna
import ray

from orchestrator import study as studies
from orchestrator.config import METRICS, SweepConfig
from orchestrator.pool import Slot, SlotState, replace_actor
from orchestrator.progress import Progress
from orchestrator.signals import StopSignals
from orchestrator.tracking import ROUND_TAG, Tracker
from orchestrator.trials import TrialSpecs, run_params
from workers.wire import TrialResult, TrialSpec, TrialStatus


def is_ranked(config: SweepConfig) -> bool:
    """Whether the sweep has settings to re-rank (one method without knobs has one setting)."""
    return config.measurement.final_top_k > 0 and config.has_knobs


def pending(config: SweepConfig, tracker: Tracker, study: optuna.Study) -> bool:
    """A finished search whose final re-measurement has not completed (interrupted, or never run)."""
    if not is_ranked(config):
        return False
    parent = tracker.find_parent(studies.study_uid(study))
    return parent is None or parent.data.tags.get("final_state") != "done"


class FinalRemeasure:
    def __init__(self, config: SweepConfig, study: optuna.Study, tracker: Tracker, parent_id: str, slot: Slot,
                 specs: TrialSpecs, progress: Progress, signals: StopSignals, all_slots: list[Slot]) -> None:
        self.config, self.study, self.tracker, self.parent_id = config, study, tracker, parent_id
        self.slot, self.specs, self.progress, self.signals, self.all_slots = slot, specs, progress, signals, all_slots

    def run(self) -> dict[str, Any] | None:
        """Re-measure the top settings interleaved with AR; None when off, nothing to re-measure, or
        interrupted (the next run then does the whole re-measurement again).

        Skipped when the parent run already holds a re-measurement of exactly these trials (a
        finished study run again); a study extended since then is re-measured in a new round.
        """
        measurement = self.config.measurement
        if not is_ranked(self.config):
            return None
        picks = studies.top_trials(self.study, self.config, measurement.final_top_k)
        if not picks:
            return None
        numbers = ",".join(str(t.number) for t in picks)
        uid = studies.study_uid(self.study)
        tags = self.tracker.parent_tags(self.parent_id)
        if tags.get("final_trials") == numbers and tags.get("final_state") == "done":
            round_id = int(tags[ROUND_TAG])
            self.progress.note(f"the best settings (trials {numbers}) were already re-measured (round {round_id})")
            return {"round": round_id, "trials": self.tracker.remeasured(uid, round_id)}
        round_id = int(tags.get(ROUND_TAG, "0")) + 1
        passes = measurement.final_repeats
        self.progress.note(f"re-measuring the best {len(picks)} settings (trials {numbers}), {passes} passes, "
                           "each interleaved with the AR baseline ...")
        samples: dict[int, dict[int, tuple[dict, dict]]] = {t.number: {} for t in picks}  # pass -> (AR, setting)
        for index in range(passes):
            for trial in picks:
                pair = []
                for spec in (self.specs.baseline(), self.specs.remeasure(self.config.params_of(trial.params))):
                    self.progress.stage = f"re-measuring: pass {index + 1}/{passes}"
                    result = self._measure(spec)
                    if result is None:
                        return None
                    pair.append(result)
                if all(r.status is TrialStatus.OK for r in pair):
                    samples[trial.number][index] = (pair[0].metrics, pair[1].metrics)
        self.progress.stage = ""
        final: dict[str, Any] = {"round": round_id, "trials": {}}
        for trial in picks:
            metrics = remeasured_metrics(list(samples[trial.number].values()))
            if metrics is None:
                self.progress.note(f"trial {trial.number}: its re-measurement failed; not a candidate")
                continue
            params = run_params(self.config, self.study.study_name, trial.number, self.config.setting(trial.params))
            self.tracker.log_remeasure(self.parent_id, self.study.study_name, uid, trial.number,
                                       params | {"passes": passes}, metrics, round_id)
            final["trials"][trial.number] = metrics
        final["separation"] = separation(samples, final["trials"], self.config)
        tags = {ROUND_TAG: round_id, "final_trials": numbers, "final_state": "done"}
        if final["separation"] is not None:
            tags["winner_separated"] = separation_text(final["separation"])
        self.tracker.set_parent_tags(self.parent_id, tags)
        self._note(final)
        return final

    def _measure(self, spec: TrialSpec) -> TrialResult | None:
        """One measurement on the slot's actor, waiting in short steps so Ctrl-C stays responsive."""
        self.slot.state = SlotState.REMEASURING
        self.progress.update(self.study, self.all_slots, studies.count_complete(self.study),
                             studies.target_complete(self.config))
        ref = self.slot.handle.run_trial.remote(spec)
        try:
            while not self.signals.requested:
                ready, _ = ray.wait([ref], num_returns=1, timeout=0.5)
                if ready:
                    result = ray.get(ref)
                    if result.restart_worker:  # a rank failed and its tensor-parallel group was aborted
                        self.progress.note(f"actor {self.slot.index}: a tensor-parallel rank failed "
                                           f"({result.error}); a new worker takes its slot")
                        replace_actor(self.config, self.slot)
                    return result
            return None
        finally:
            self.slot.state = SlotState.IDLE

    def _note(self, final: dict[str, Any]) -> None:
        if final.get("separation") is not None:
            self.progress.note(f"winner: {separation_text(final['separation'])}")
        objective = self.config.objectives[0]
        for number, metrics in final["trials"].items():
            self.progress.note(
                f"  trial {number}: {objective.metric} {metrics.get(objective.metric, float('nan')):.4g} "
                f"(median of {metrics['passes']:.0f} passes; tokens/s {metrics['tokens_per_s_min']:.4g}.."
                f"{metrics['tokens_per_s_max']:.4g}), speedup {metrics.get('speedup') or float('nan'):.3g} "
                f"against AR at {metrics.get('baseline_tokens_per_s') or float('nan'):.4g} tokens/s"
            )


def best_metrics(config: SweepConfig, study: optuna.Study, tracker: Tracker, parent_id: str,
                 final: dict[str, Any] | None, summary: dict[str, Any]) -> dict[str, float]:
    """Parent metrics: ``search_best_*`` (the best trial as measured in the search) and ``best_*``
    (the winner: the best re-measured setting when there was a re-measurement). ``summary``
    (the parent's summary.json and best.<param> tags) is updated to name the same winner."""
    out: dict[str, float] = {}
    names = (*METRICS, "tokens_per_s_median", "tokens_per_s_iqr", "baseline_tokens_per_s")
    if "best_trial" in summary:
        searched = tracker.trial_metrics(studies.study_uid(study), summary["best_trial"])
        out |= {f"search_best_{k}": v for k, v in searched.items() if k in names}
        out["search_best_trial"] = float(summary["best_trial"])
    winner = final_winner(final, config) if final else None
    found = final.get("separation") if final else None
    if found is not None:
        out |= {"winner_margin": found["margin_median"], "winner_margin_min": found["margin_min"],
                "winner_margin_max": found["margin_max"], "winner_separated": float(found["separated"])}
        summary["winner_separation"] = found
    if winner is not None:
        number, metrics = winner
        out |= {f"best_{k}": v for k, v in metrics.items() if k in names or k.startswith("tokens_per_s_")}
        out["best_trial"] = float(number)
        tracker.set_parent_tags(parent_id, {"best_trial": number, "best_source": "re-measured"})
        summary["search_best_trial"] = summary.get("best_trial")
        summary |= {"best_trial": number, "best_params": config.setting(study.trials[number].params),
                    "best_source": "re-measured", "remeasured": {str(k): v for k, v in final["trials"].items()}}
    elif "best_trial" in summary:
        out |= {k.replace("search_best_", "best_", 1): v for k, v in out.items()}
        tracker.set_parent_tags(parent_id, {"best_trial": summary["best_trial"], "best_source": "search"})
    return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def remeasured_metrics(pairs: list[tuple[dict, dict]]) -> dict[str, float] | None:
    """Medians over passes of every numeric metric; speedup per pass against the AR run just before."""
    if not pairs:
        return None
    keys = set.intersection(*(set(k for k, v in method.items() if isinstance(v, (int, float))) for _, method in pairs))
    out = {key: _median([float(method[key]) for _, method in pairs]) for key in keys if not key.startswith("baseline_")}
    speeds = [float(method["tokens_per_s"]) for _, method in pairs]
    out["tokens_per_s_min"], out["tokens_per_s_max"] = min(speeds), max(speeds)
    ratios = [ar["tpot_s"] / method["tpot_s"] for ar, method in pairs if method.get("tpot_s") and ar.get("tpot_s")]
    out["speedup"] = _median(ratios) if ratios else float("nan")
    out["baseline_tokens_per_s"] = _median([float(ar["tokens_per_s"]) for ar, _ in pairs])
    out["passes"] = float(len(pairs))
    return out


def separation(samples: dict[int, dict[int, tuple[dict, dict]]], trials: dict[int, dict[str, float]],
               config: SweepConfig) -> dict[str, Any] | None:
    """Is the re-measured winner separated from the runner-up, and by how much? Pass by pass, the
    winner's objective over the runner-up's; for a speed, each divided by the AR run just before it in
    that pass, so drift between passes cancels. Separated when the winner is better in every pass (two
    passes at least); the margins' median and range say by how much. None without a runner-up."""
    if len(config.objectives) != 1 or len(trials) < 2:
        return None
    name, direction = config.objectives[0].metric, config.objectives[0].direction
    ranked = sorted((n for n in trials if trials[n].get(name) is not None),
                    key=lambda n: trials[n][name], reverse=direction == "maximize")
    if len(ranked) < 2:
        return None
    winner, runner_up = ranked[:2]

    def value(ar: dict, metrics: dict) -> float:
        if name == "tokens_per_s":
            return metrics["tokens_per_s"] / ar["tokens_per_s"]
        return float(metrics[name])

    passes = sorted(set(samples[winner]) & set(samples[runner_up]))
    margins = []
    for index in passes:
        mine, theirs = value(*samples[winner][index]), value(*samples[runner_up][index])
        ratio = mine / theirs if theirs else float("inf")
        margins.append(ratio - 1 if direction == "maximize" else 1 - ratio)
    if not margins:
        return None
    wins = sum(margin > 0 for margin in margins)
    return {"winner": winner, "runner_up": runner_up, "passes": len(margins), "wins": wins,
            "margin_median": _median(margins), "margin_min": min(margins), "margin_max": max(margins),
            "separated": wins == len(margins) and len(margins) >= 2}


def separation_text(found: dict[str, Any]) -> str:
    verdict = "separated" if found["separated"] else "NOT separated"
    return (f"trial {found['winner']} {verdict} from trial {found['runner_up']}: better in {found['wins']} of "
            f"{found['passes']} passes, by {found['margin_median']:+.1%} ({found['margin_min']:+.1%}.."
            f"{found['margin_max']:+.1%})")


def final_winner(final: dict[str, Any], config: SweepConfig) -> tuple[int, dict[str, float]] | None:
    """The best re-measured setting by the first objective (single-objective sweeps only)."""
    if len(config.objectives) != 1 or not final["trials"]:
        return None
    objective = config.objectives[0]
    sign = 1 if objective.direction == "maximize" else -1
    scored = [(n, m) for n, m in final["trials"].items() if m.get(objective.metric) is not None]
    if not scored:
        return None
    return max(scored, key=lambda item: (sign * item[1][objective.metric], -item[0]))
