"""The project's exception types for the worker side.

Each error carries one message that says what was wrong and where (field, file), so the CLI can
print it on one line and exit with status 2.
"""

from __future__ import annotations


class SpecDecError(Exception):
    """Base class of every error this project raises on purpose."""


class BadInputError(SpecDecError):
    """A flag, file or setting given by the user is invalid."""


class CheckpointMismatchError(BadInputError):
    """A drafter checkpoint does not fit the target it is paired with (or is malformed)."""


class UnsupportedModelError(BadInputError):
    """The target architecture is not one the engines can run exactly."""


class TrialStopped(SpecDecError):
    """The driver stopped a trial early (an Optuna pruner): raised between prompts, reported as "pruned"."""
