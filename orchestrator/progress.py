"""Live progress of a sweep: trials done / wanted, what ended how, time spent and left, best so far,
what each actor is doing.

On a terminal it is a rich live table; otherwise (logs, CI, tests) one line per change (the clock
alone changing does not print a line).
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from orchestrator.config import SweepConfig


def clock(seconds: float | None) -> str:
    """h:mm:ss (or '-' when unknown)."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def time_left(remaining: int, median_trial_s: float | None, actors: int) -> float | None:
    """Trials still wanted times the median trial's wall time, shared among the actors."""
    if remaining <= 0:
        return 0.0
    if median_trial_s is None:
        return None
    return remaining * median_trial_s / max(actors, 1)


class Progress:
    def __init__(self, config: SweepConfig) -> None:
        self.config = config
        self.started = time.monotonic()
        self.console = Console(file=sys.stderr)
        if not self.console.is_terminal:  # plain log lines: no wrapping at 80 columns
            self.console = Console(file=sys.stderr, width=200, soft_wrap=True)
        self.live: Live | None = None
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=4, transient=False)
            self.live.start()
        self._last = ""
        self._best = ("-", -1)  # (text, complete count it was computed at): the study is re-read only on change
        self._counts: tuple[int, dict[str, int], float | None] | None = None  # same: re-read on change
        self.stage = ""  # e.g. "re-measuring 2/6" after the search

    def note(self, message: str) -> None:
        self.console.print(message)

    def update(self, study, slots, complete: int, wanted: int) -> None:
        from orchestrator.study import median_trial_seconds, trial_counts

        if self._best[1] != complete:
            self._best = (_best_text(study, self.config), complete)
        # A trial ends (complete, failed, killed) only where an actor's state or trial changes.
        key = hash((complete, tuple((s.state, s.trial_number) for s in slots)))
        if self._counts is None or self._counts[0] != key:
            self._counts = (key, trial_counts(study), median_trial_seconds(study))
        _, counts, median_s = self._counts
        best = self._best[0]
        elapsed = clock(time.monotonic() - self.started)
        left = time_left(wanted - complete, median_s, len(slots))
        left_text = ("~" + clock(left)) if left else ("-" if left is None else "0:00:00")
        ended = (f"complete {counts['complete']} (infeasible {counts['infeasible']}), failed {counts['failed']}, "
                 f"killed {counts['killed']}")
        actors = ", ".join(
            f"#{s.index}:{s.state}" + (f"(trial {s.trial_number})" if s.trial_number is not None else "")
            for s in slots
        )
        if self.live is not None:
            table = Table(title=f"sweep {study.study_name}" + (f" - {self.stage}" if self.stage else ""))
            for column in ("complete", "trials", "elapsed", "left", "best so far", "actors"):
                table.add_column(column)
            table.add_row(f"{complete}/{wanted}", ended, elapsed, left_text, best, actors)
            self.live.update(table)
            return
        stage = f" | {self.stage}" if self.stage else ""
        line = f"[{complete}/{wanted}] {ended} | best {best} | actors {actors}{stage}"
        if line != self._last:  # the clock is printed with the line but does not trigger one
            self.console.print(f"{line} | elapsed {elapsed}, left {left_text}", highlight=False)
            self._last = line

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def _best_text(study, config: SweepConfig) -> str:
    from orchestrator.study import summary

    info = summary(study, config)
    if "best_values" in info:
        return f"{config.objectives[0].metric}={info['best_values'][0]:.4g} at {info['best_params']}"
    if "pareto_front" in info:
        return f"Pareto front of {len(info['pareto_front'])}"
    return "-"
