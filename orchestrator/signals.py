"""Ctrl-C and SIGTERM for the driver: a stop request that takes effect at the next safe point.

The handler never raises on the first signal: it sets a flag, and the driver checks it where
stopping leaves nothing half-written (between store writes, while waiting for Ray). A second signal
raises ``KeyboardInterrupt`` at once ("stop now"), except inside a ``critical()`` section (a study or
run being created or closed), where it only counts as a request.

Ray replaces the process's SIGTERM handler during ``ray.init``: with Python handlers (the driver's
``sys.exit(15)``, the head node's kill-everything-and-``sys.exit(1)``) and, when the driver's core
worker starts, with the C++ failure-signal handler that aborts the process. A Python handler's
``SystemExit`` is not even reliable: raised inside a fork hook or a ``__del__`` it is printed and
dropped, and the signal is lost. So ``ray_init_keeps_ours()`` keeps Ray from installing its Python
handlers for the duration of ``ray.init`` (a SIGTERM then only sets our flag, checked once it
returns), ``RAY_ENV`` keeps the C++ one from being installed, and ``ray_started()`` puts ours back
in case a Ray version installs one some other way.
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


@contextmanager
def ray_init_keeps_ours():
    """During ``ray.init``: Ray's calls to install a SIGTERM handler do nothing, so ours stays."""
    import ray._private.utils as ray_utils  # here: this module is imported before anything heavy

    install = getattr(ray_utils, "set_sigterm_handler", None)
    if install is None:  # a Ray without it: ``ray_started()`` and the driver's SystemExit guard remain
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = install
