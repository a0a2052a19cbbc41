"""Ownership of hook handles: every hook the package installs is held here and removed here.

Each recorder (and every other component that installs hooks) owns one :class:`HookSet`.
A process-wide count of live handles lets tests prove that nothing was left behind.
"""

from __future__ import annotations

from typing import Any

from torch.utils.hooks import RemovableHandle

_LIVE: dict[int, tuple[str, RemovableHandle]] = {}


class HookSet:
    """A list of removable handles, removed in reverse order, idempotently.

    Args:
        owner: a short description used by :func:`live_hooks`, such as
            ``"ModuleOutputsRecorder(conv1)"``.
    """

    __slots__ = ("_handles", "owner")

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._handles: list[RemovableHandle] = []

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        """Take ownership of ``handle``."""
        self._handles.append(handle)
        _LIVE[id(handle)] = (self.owner, handle)
        return handle

    def remove_all(self) -> None:
        """Remove every handle, newest first. Safe to call any number of times."""
        while self._handles:
            handle = self._handles.pop()
            handle.remove()
            _LIVE.pop(id(handle), None)

    def __len__(self) -> int:
        return len(self._handles)

    def __bool__(self) -> bool:
        return bool(self._handles)

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove_all()


def live_hooks() -> list[str]:
    """Owners of the hooks installed by this package and not yet removed (one entry per hook)."""
    return sorted(owner for owner, _ in _LIVE.values())


def remove_live_hooks() -> None:
    """Remove every hook still installed by this package (a test helper after a leak)."""
    for _, handle in list(_LIVE.values()):
        handle.remove()
    _LIVE.clear()
