"""Ownership of hook handles: every hook the package installs is held here and removed here.

Each recorder (and every other component that installs hooks) owns one :class:`HookSet`.
A process-wide count of live handles lets tests prove that nothing was left behind.

A hook costs something on every call of its module even while it records nothing: PyTorch
takes its slow call path for a module with hooks. Hooks installed with :meth:`HookSet.install`
can therefore be *suspended* (removed, with what is needed to reinstall them kept) between the
steps that record, and resumed when recording starts again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.hooks import RemovableHandle

_LIVE: dict[int, tuple[str, RemovableHandle]] = {}


class HookSet:
    """A list of removable handles, removed in reverse order, idempotently.

    Args:
        owner: a short description used by :func:`live_hooks`, such as
            ``"ModuleOutputsRecorder(conv1)"``.
    """

    __slots__ = ("_handles", "_made", "_makers", "owner")

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._handles: list[RemovableHandle] = []  # kept until remove_all
        self._makers: list[Callable[[], RemovableHandle]] = []  # how to reinstall
        self._made: list[RemovableHandle] = []  # the live handles the makers returned

    def _own(self, handle: RemovableHandle) -> RemovableHandle:
        _LIVE[id(handle)] = (self.owner, handle)
        return handle

    @staticmethod
    def _remove(handles: list[RemovableHandle]) -> None:
        """Remove and forget ``handles``, newest first (the list is emptied)."""
        while handles:
            handle = handles.pop()
            handle.remove()
            _LIVE.pop(id(handle), None)

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        """Take ownership of ``handle`` (kept installed until :meth:`remove_all`)."""
        self._handles.append(self._own(handle))
        return handle

    def install(self, make: Callable[[], RemovableHandle]) -> RemovableHandle:
        """Install a hook by calling ``make``, and keep ``make`` to reinstall it after a suspend.

        ``make`` registers the hook and returns its handle, e.g.
        ``partial(module.register_forward_hook, hook)``.
        """
        handle = self._own(make())
        self._makers.append(make)
        self._made.append(handle)
        return handle

    @property
    def suspended(self) -> bool:
        """Whether the hooks given to :meth:`install` are removed until :meth:`resume`."""
        return bool(self._makers) and not self._made

    def suspend(self) -> None:
        """Remove the hooks given to :meth:`install` until :meth:`resume` (idempotent)."""
        self._remove(self._made)

    def resume(self) -> None:
        """Reinstall the suspended hooks, in their original order (idempotent)."""
        if self.suspended:
            for make in self._makers:
                self._made.append(self._own(make()))

    def remove_all(self) -> None:
        """Remove every handle (newest first within reinstallable and kept ones); idempotent."""
        self._remove(self._made)
        self._remove(self._handles)
        self._makers = []

    def __len__(self) -> int:
        return len(self._handles) + len(self._made)

    def __bool__(self) -> bool:
        return bool(self._handles or self._made)

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
