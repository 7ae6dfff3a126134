"""Ctrl-C and SIGTERM for the driver: a stop request that takes effect at the next safe point.

The handler never raises on the first signal: it sets a flag, and the driver checks it where
stopping leaves nothing half-written (between store writes, while waiting for Ray). A second signal
raises ``KeyboardInterrupt`` at once ("stop now"), except inside a ``critical()`` section (a study or
run being created or closed), where it only counts as a request.

Ray replaces the process's SIGTERM handler twice during ``ray.init``: its Python handler
(``sys.exit(15)``, silent) and, when the driver's core worker starts, the C++ failure-signal handler
that aborts the process. ``ray_started()`` puts ours back afterwards; ``RAY_ENV`` keeps the C++ one
from being installed in the first place, so a SIGTERM in the middle of ``ray.init`` is at worst
Ray's ``SystemExit``, which the driver turns into the same clean stop.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
RAY_ENV = {"RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1"}


class Interrupted(Exception):
    """A stop request (Ctrl-C / SIGTERM) reached a safe point."""


class StopSignals:
    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._critical = 0
        self.on_request = None  # called once, on the first signal (e.g. a progress note)

    def install(self) -> StopSignals:
        for signum in SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested and not self._critical:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        first = not self.requested
        self.requested, self.signum = True, self.signum or signum
        if first and self.on_request is not None:
            self.on_request()

    def check(self) -> None:
        """Raise ``Interrupted`` when a stop was requested (call at safe points)."""
        if self.requested:
            raise Interrupted

    @contextmanager
    def critical(self):
        """A section a second signal must not cut in half (it is remembered as a request instead)."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1

    def ray_started(self) -> None:
        """Put our handlers back after ``ray.init`` replaced them."""
        self.install()
