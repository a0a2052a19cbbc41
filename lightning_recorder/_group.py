"""Groups of named things (recorders, deliveries): names, lookups, all-or-nothing actions."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from ._names import suggestion
from .errors import DuplicateNameError, RecorderConfigError

T = TypeVar("T")


def named_items(items: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> Iterable[Any]:
    """``(name, value)`` pairs from a mapping, an iterable of pairs, or ``None``."""
    return items.items() if isinstance(items, Mapping) else (items or ())


def add_named(group: dict[str, T], name: object, build: Callable[[], T], what: str) -> T:
    """Add ``build()`` to ``group`` under ``name``, a new non-empty str.

    Raises:
        RecorderConfigError: ``name`` is not a non-empty str.
        DuplicateNameError: ``name`` is taken.
    """
    if not isinstance(name, str) or not name:
        raise RecorderConfigError(f"Expected a non-empty str {what} name but got {name!r}.")
    if name in group:
        raise DuplicateNameError(
            f"A {what} named {name!r} already exists in this manager; names must be unique."
        )
    group[name] = value = build()
    return value


def get_named(group: Mapping[str, T], name: str, what: str) -> T:
    """``group[name]``, or an error that lists the closest names."""
    try:
        return group[name]
    except KeyError:
        near = suggestion(name, group, f"{what} names")
        raise RecorderConfigError(f"No {what} named {name!r}. {near}") from None


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
