"""The exceptions raised by lightning_recorder.

Every error derives from :class:`RecorderError`. Configuration mistakes (a bad name, a bad option)
are also :class:`ValueError`\\ s, state mistakes (reading before ``initialize``, a record changed in
place) are also :class:`RuntimeError`\\ s, so code that already catches the built-in types keeps
working.
"""

from __future__ import annotations

__all__ = [
    "DuplicateNameError",
    "InvalidSourceError",
    "NoRecordError",
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
