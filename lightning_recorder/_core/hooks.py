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

**Never displace a hook.** PyTorch keys every hook dict by a handle id drawn from a process-wide
counter (``RemovableHandle.next_id``) that restarts in every process. A model unpickled in a new
process (``ddp_spawn``, a model sent to a worker) keeps the hooks its owner registered, under
their old ids, while the counter starts again at 0: the next registration takes an id already in
the dict and silently replaces that hook. :func:`register` (which :meth:`HookSet.install` and
:meth:`HookSet.add` use for makers) first advances the counter past every id in the hook dicts of
the module or tensor it registers on, and checks afterwards that the new id was new.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import RecorderStateError
from .compat import current_autograd_node, reentrant_rerun

_LIVE: dict[int, tuple[str, RemovableHandle]] = {}

Maker = Callable[[], RemovableHandle]
"""A zero-argument callable that registers one hook and returns its handle, e.g.
``functools.partial(module.register_forward_hook, hook)``."""


def _hook_dicts(target: object) -> list[dict[Any, Any]]:
    """The hook dicts of a module or tensor (``_forward_hooks``, ``_backward_hooks`` …)."""
    if isinstance(target, torch.Tensor):
        found = [
            getattr(target, n, None) for n in ("_backward_hooks", "_post_accumulate_grad_hooks")
        ]
        return [hooks for hooks in found if isinstance(hooks, dict)]
    return [
        value for name, value in vars(target).items() if "hooks" in name and isinstance(value, dict)
    ]


def reserve_hook_ids(*targets: object) -> None:
    """Advance PyTorch's hook-handle counter past every id in the hook dicts of ``targets``
    (modules or tensors; a module's submodules are not visited), so that a new registration
    on them cannot take the id of a hook already there."""
    _reserve([hooks for target in targets for hooks in _hook_dicts(target)])


def _reserve(dicts: list[dict[Any, Any]]) -> None:
    top = RemovableHandle.next_id
    for hooks in dicts:
        for key in hooks:
            if isinstance(key, int) and key >= top:
                top = key + 1
    RemovableHandle.next_id = top


def _target_of(make: Maker) -> object | None:
    """The module or tensor a maker registers on: ``partial(obj.register_…, …)`` or
    ``obj.register_…``; ``None`` when it cannot be told."""
    func: Any = make
    while isinstance(func, functools.partial):
        func = func.func
    target = getattr(func, "__self__", None)
    return target if isinstance(target, (torch.nn.Module, torch.Tensor)) else None


def register(make: Maker) -> RemovableHandle:
    """Register a hook by calling ``make`` without displacing any hook already registered.

    Raises:
        RecorderStateError: the new handle's id was already in use although the counter was
            advanced (the maker registers on an object that could not be told from it); the
            hook is removed again.
    """
    target = _target_of(make)
    dicts = _hook_dicts(target) if target is not None else []
    _reserve(dicts)
    # A registration under an id already in use replaces that hook: its dict does not grow.
    sizes = [len(hooks) for hooks in dicts]
    handle = make()
    into = handle.hooks_dict_ref()
    if any(hooks is into and len(hooks) == size for hooks, size in zip(dicts, sizes, strict=True)):
        handle.remove()
        raise RecorderStateError(
            f"Registering a hook on {type(target).__name__} took the id {handle.id} of a hook "
            "already there; it was removed again. Please report this."
        )
    return handle


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
        self._makers: list[Maker] = []  # how to reinstall
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

    def add(self, handle: RemovableHandle | Maker) -> RemovableHandle:
        """Take ownership of a hook (kept installed until :meth:`remove_all`).

        Pass a maker (``partial(module.register_forward_hook, hook)``) rather than a handle:
        a maker registers through :func:`register`, which never displaces a hook already there.
        """
        if not isinstance(handle, RemovableHandle):
            handle = register(handle)
        self._handles.append(self._own(handle))
        return handle

    def install(self, make: Maker) -> RemovableHandle:
        """Install a hook by calling ``make``, and keep ``make`` to reinstall it after a suspend.

        ``make`` registers the hook and returns its handle, e.g.
        ``partial(module.register_forward_hook, hook)``; it runs through :func:`register`.
        """
        handle = self._own(register(make))
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
                self._made.append(self._own(register(make)))

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

    def live_for_grads(self) -> OwnerT | None:
        """:meth:`live`, also in the forward a reentrant checkpoint re-runs during backward: a
        hook that registers :class:`GradSink` s registers them there, since the tensors of the
        first run (made without autograd) receive no gradient. A non-reentrant re-run stays
        out: its tensors are not back-propagated, the first run's are."""
        owner = self._ref()
        if owner is None or (current_autograd_node() is not None and not reentrant_rerun()):
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
