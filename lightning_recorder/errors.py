"""The exceptions raised by lightning_recorder.

Every error derives from :class:`RecorderError`. Configuration mistakes (a bad name, a bad option)
are also :class:`ValueError`\\ s, state mistakes (reading before ``initialize``, a record changed in
place) are also :class:`RuntimeError`\\ s, so code that already catches the built-in types keeps
working.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DuplicateNameError",
    "InvalidSourceError",
    "NoRecordError",
    "NonFiniteError",
    "NotInitializedError",
    "RecordModifiedError",
    "RecorderConfigError",
    "RecorderError",
    "RecorderStateError",
    "UnknownRecorderTypeError",
    "UnknownSourceError",
]


class RecorderError(Exception):
    """Base class of every error raised by lightning_recorder."""


class RecorderConfigError(RecorderError, ValueError):
    """A configuration value is wrong: an option, a name, a type."""


class UnknownSourceError(RecorderConfigError):
    """A module, parameter or label named as a source does not exist in the model."""


class InvalidSourceError(RecorderConfigError):
    """A function or method path does not import or does not name a callable."""


class UnknownRecorderTypeError(RecorderConfigError):
    """A config's ``type`` names no registered recorder."""


class DuplicateNameError(RecorderConfigError):
    """A name is used twice where names must be unique."""


class RecorderStateError(RecorderError, RuntimeError):
    """An operation does not fit the recorder's current state."""


class NotInitializedError(RecorderStateError):
    """A recorder was used before ``initialize`` (or after ``release``)."""


class RecordModifiedError(RecorderStateError):
    """A recorded tensor was modified in place after it was captured."""


class NoRecordError(RecorderStateError, IndexError):
    """A record was requested that does not exist (out of range, or nothing was recorded)."""


class NonFiniteError(RecorderError, RuntimeError):
    """Training produced non-finite values (NaN, +inf, -inf) and the policy was to stop.

    Raised by :class:`~lightning_recorder.HealthMonitor` with ``on_nonfinite="raise"``, or after
    ``max_consecutive_skips`` skipped steps in a row with ``"skip"``, once the evidence is
    written. ``event`` is the :class:`~lightning_recorder.HealthEvent` that says where the values
    first appeared (``None`` when raised without one).

    Examples:
        >>> err = NonFiniteError("step 3 was non-finite")
        >>> isinstance(err, RuntimeError), err.event is None
        (True, True)
    """

    def __init__(self, message: str, event: Any = None) -> None:
        super().__init__(message)
        self.event = event

    def __reduce__(self) -> tuple[Any, ...]:  # picklable with its event (e.g. across processes)
        return (type(self), (str(self), self.event))
