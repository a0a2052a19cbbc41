"""All-or-nothing application of an action to a group (recorders, deliveries)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def apply_all(items: Iterable[T], do: Callable[[T], object], undo: Callable[[T], object]) -> None:
    """Call ``do`` on every item; if one raises, ``undo`` the ones done (newest first) and re-raise.

    Example:
        >>> done = []
        >>> apply_all([1, 2], done.append, done.remove)
        >>> done
        [1, 2]
    """
    done: list[T] = []
    try:
        for item in items:
            do(item)
            done.append(item)
    except BaseException:
        for item in reversed(done):
            undo(item)
        raise
