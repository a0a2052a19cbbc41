"""Hook callables that stay small: weakly bound to their recorder, inert when copied.

A model that carries hooks must still pickle and deep-copy. A hook that is a closure or a bound
method drags its recorder (and every recorded tensor) into the copy, or fails to pickle; these
objects instead turn into an inert no-op in a copy.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import BaseRecorder, RecordStream


def _inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a recorder hook becomes in a pickled or deep-copied model: nothing."""
    return None


class InertWhenCopied:
    """Mixin for hook objects: a pickled or deep-copied model gets a no-op in their place."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_copy_inert, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _inert_hook

    def __copy__(self) -> Any:
        return _inert_hook


class RecorderHook(InertWhenCopied):
    """Base class of the hooks that recorders install.

    Args:
        recorder: the owning recorder (held weakly).
        stream: the stream this hook writes to.
    """

    __slots__ = ("__weakref__", "_ref", "_stream")

    def __init__(self, recorder: BaseRecorder, stream: RecordStream) -> None:
        self._ref = weakref.ref(recorder)
        self._stream = stream


def _copy_inert() -> Any:
    return _inert_hook
