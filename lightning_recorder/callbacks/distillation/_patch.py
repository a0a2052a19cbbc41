"""The two hooks :class:`~lightning_recorder.FeatureDistillation` puts on the student.

* :class:`StepPatch` replaces ``training_step`` on the *instance* (never the class) for the
  duration of a fit, so the distillation term can be added to the loss the user's
  ``training_step`` returns. Patches by several callbacks chain and can be removed in any order.
* :class:`StudentInputHook` is a forward pre-hook on the LightningModule: it hands the inputs of
  the student's forward to the teacher, just before the student runs.

Both hold their callback weakly and turn into plain pass-throughs in a pickled or deep-copied
model, so the model can still be copied while they are installed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from ..._core.hooks import WeakHook

_MISSING: Any = object()


class _StepOwner(Protocol):
    def _training_step(
        self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...


class _InputOwner(Protocol):
    def _on_student_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None: ...


class StudentInputHook(WeakHook[_InputOwner]):
    """Forward pre-hook (``with_kwargs=True``) that reports the student's inputs to its owner."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        owner = self.live()
        if owner is not None:
            owner._on_student_forward(args, kwargs)


class StepPatch:
    """The instance attribute that stands in for ``module.training_step`` while installed.

    Args:
        owner: the callback whose ``_training_step(inner, args, kwargs)`` runs the step.
        module: the LightningModule to patch.
    """

    __slots__ = ("__weakref__", "_module", "_original", "_owner")

    def __init__(self, owner: _StepOwner, module: nn.Module) -> None:
        self._owner: Callable[[], _StepOwner | None] = weakref.ref(owner)
        self._module = weakref.ref(module)
        self._original: Any = module.__dict__.get("training_step", _MISSING)
        object.__setattr__(module, "training_step", self)

    def _inner(self, module: nn.Module) -> Callable[..., Any]:
        original = self._original
        if original is _MISSING:
            cls: Any = type(module)
            return cls.training_step.__get__(module)
        return original

    @property
    def __wrapped__(self) -> Callable[..., Any] | None:
        # Lightning's `is_overridden` and `inspect.signature` look through the patch.
        module = self._module()
        if module is None:
            return None
        inner = self._inner(module)
        while isinstance(inner, StepPatch):  # patches stacked by several callbacks
            inner = inner._inner(module)
        return inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:  # pragma: no cover - the module is gone, nothing can call this
            raise RuntimeError("training_step called on a collected module")
        inner = self._inner(module)
        owner = self._owner()
        if owner is None:
            return inner(*args, **kwargs)
        return owner._training_step(inner, args, kwargs)

    def remove(self) -> None:
        """Restore what was there before, even when other patches were stacked on top."""
        module = self._module()
        self._owner = _dead
        if module is None:
            return
        current = module.__dict__.get("training_step", _MISSING)
        if current is self:
            if self._original is _MISSING:
                del module.__dict__["training_step"]
            else:
                object.__setattr__(module, "training_step", self._original)
            return
        node = current
        while isinstance(node, StepPatch):  # another patch sits on top: unlink this one
            if node._original is self:
                node._original = self._original
                return
            node = node._original

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy of the module gets the class's training_step back, not this patch.
        return (getattr, (self._module(), "training_step"))


def _dead() -> None:
    return None


def is_patched(module: nn.Module) -> bool:
    """Whether ``module.training_step`` is currently patched by a FeatureDistillation."""
    return isinstance(module.__dict__.get("training_step"), StepPatch)
