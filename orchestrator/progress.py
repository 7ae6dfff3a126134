"""Live progress of a sweep: trials done / wanted, best so far, what each actor is doing.

On a terminal it is a rich live table; otherwise (logs, CI, tests) one line per change.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.live import Live
from rich.table import Table

from orchestrator.config import SweepConfig


class Progress:
    def __init__(self, config: SweepConfig) -> None:
        self.config = config
        self.console = Console(file=sys.stderr)
        if not self.console.is_terminal:  # plain log lines: no wrapping at 80 columns
            self.console = Console(file=sys.stderr, width=200, soft_wrap=True)
        self.live: Live | None = None
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=4, transient=False)
            self.live.start()
        self._last = ""
        self._best = ("-", -1)  # (text, complete count it was computed at): the study is re-read only on change

    def note(self, message: str) -> None:
        self.console.print(message)

    def update(self, study, slots, complete: int, wanted: int) -> None:
        if self._best[1] != complete:
            self._best = (_best_text(study, self.config), complete)
        best = self._best[0]
        actors = ", ".join(
            f"#{s.index}:{s.state}" + (f"(trial {s.trial_number})" if s.trial_number is not None else "")
            for s in slots
        )
        if self.live is not None:
            table = Table(title=f"sweep {study.study_name}")
            table.add_column("complete")
            table.add_column("best so far")
            table.add_column("actors")
            table.add_row(f"{complete}/{wanted}", best, actors)
            self.live.update(table)
            return
        line = f"[{complete}/{wanted}] best {best} | actors {actors}"
        if line != self._last:
            self.console.print(line, highlight=False)
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
