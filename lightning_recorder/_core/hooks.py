"""Hooks: who owns their handles, and the one base class every hook of the package derives from.

**Ownership.** Every hook the package installs is held by a :class:`HookSet` and removed there.

Each recorder (and every other component that installs hooks) owns one :class:`HookSet`.
A process-wide count of live handles lets tests prove that nothing was left behind.

A hook costs something on every call of its module even while it records nothing: PyTorch
takes its slow call path for a module with hooks. Hooks installed with :meth:`HookSet.install`
can therefore be *suspended* (removed, with what is needed to reinstall them kept) between the
steps that record, and resumed when recording starts again.

**One hook family.** Every module or tensor hook of the package (recorders, bulk collectors, the
inspector, distillation) is a :class:`WeakHook`:

* it holds its owner *weakly*, so a hook left on a model never keeps a recorder (and every tensor
  it recorded) alive;
* it is *inert when copied*: a deep-copied or pickled model gets a no-op in its place (EMA copies,
  teacher copies and ``ddp_spawn`` all copy models that carry hooks);
* :meth:`WeakHook.live` returns ``None`` inside a forward that activation checkpointing re-runs
  during backward, so a checkpointed call is seen once, not twice.

A gradient arriving at a recorded tensor goes through one :class:`GradSink`, which hands it back
to the hook that registered it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

from .compat import current_autograd_node

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


# ---------------------------------------------------------------------- the hook base
def _inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a package hook becomes in a pickled or deep-copied model: nothing."""
    return None


def _copy_inert() -> Any:
    return _inert_hook


class InertWhenCopied:
    """Mixin for hook objects: a pickled or deep-copied model gets a no-op in their place."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_copy_inert, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _inert_hook

    def __copy__(self) -> Any:
        return _inert_hook


OwnerT = TypeVar("OwnerT")


class WeakHook(InertWhenCopied, Generic[OwnerT]):
    """Base class of every hook the package installs: weakly bound, inert when copied.

    A subclass implements ``__call__`` with the signature PyTorch expects of the hook kind and
    starts it with ``owner = self.live()``; ``None`` means "do nothing". A subclass that records
    gradients registers :class:`GradSink` ``(self, key)`` on a tensor and implements
    :meth:`on_grad`.

    Args:
        owner: the object the hook reports to (a recorder, a subrecorder, an inspector, a
            distillation step); held weakly.
    """

    __slots__ = ("__weakref__", "_ref")

    def __init__(self, owner: OwnerT) -> None:
        self._ref = weakref.ref(owner)

    def live(self) -> OwnerT | None:
        """The owner, or ``None`` when it is gone or a checkpointed forward is being re-run."""
        owner = self._ref()
        if owner is None or current_autograd_node() is not None:
            return None
        return owner

    def on_grad(self, owner: OwnerT, grad: torch.Tensor, key: Any) -> None:
        """Receive the gradient of a tensor this hook registered a :class:`GradSink` on."""
        raise NotImplementedError


class GradSink:
    """A tensor hook: hands the gradient of one recorded tensor back to the hook that asked.

    Args:
        hook: the :class:`WeakHook` whose :meth:`~WeakHook.on_grad` receives the gradient.
        key: anything the hook needs to file the gradient (a session number, say).
    """

    __slots__ = ("_hook", "_key")

    def __init__(self, hook: WeakHook[Any], key: Any = None) -> None:
        self._hook = hook
        self._key = key

    def __call__(self, grad: torch.Tensor) -> None:
        owner = self._hook._ref()
        if owner is not None:
            self._hook.on_grad(owner, grad, self._key)
