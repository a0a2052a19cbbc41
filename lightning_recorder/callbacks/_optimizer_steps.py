"""Which optimizers are inside a step: one optimizer step seen as one, however many backwards.

An optimizer that calls its closure several times in one step (``torch.optim.LBFGS``) makes
Lightning call ``on_before_optimizer_step`` after each of those backwards. A callback that
counts, copies or reports per optimizer step tells the calls of one step apart from a new step
with :class:`StepsInProgress`: the first call of a step enters it, a step post-hook on the
optimizer (registered at that first call, held until :meth:`StepsInProgress.release`) says when
the step is over. A step the optimizer never finishes (a step the AMP grad scaler skips calls no
``optimizer.step``) ends at :meth:`StepsInProgress.reset`, which the callbacks call where no
step can be in progress (a batch's start or end).

Whether a step updated anything: a step the AMP grad scaler skips never reaches the optimizer's
``step`` (:meth:`StepsInProgress.unfinished` until the reset), except for an optimizer that
unscales the gradients in its own step (``fused=True``), which the scaler always steps with its
``found_inf`` flag (nonzero: nothing updated), kept by the post-hook
(:meth:`StepsInProgress.found_inf`), on its device.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

__all__ = ["StepsInProgress"]


class StepsInProgress:
    """The optimizers inside an unfinished step, and their step post-hooks."""

    def __init__(self) -> None:
        self._inside: set[int] = set()  # ids of the optimizers inside a step
        self._handles: dict[int, RemovableHandle] = {}
        # ids of optimizers whose last step the grad scaler ran with its found_inf flag -> it
        self._found_inf: dict[int, Tensor] = {}

    def enter(self, optimizer: torch.optim.Optimizer) -> bool:
        """Note that ``optimizer`` is inside a step; return whether it already was (its closure
        called again within the same step)."""
        key = id(optimizer)
        if key in self._inside:
            return True
        self._inside.add(key)
        self._found_inf.pop(key, None)  # of an earlier step
        register = getattr(optimizer, "register_step_post_hook", None)
        if callable(register) and key not in self._handles:
            self._handles[key] = register(partial(_step_done, weakref.ref(self)))
        return False

    def inside(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is inside a step entered with :meth:`enter`."""
        return id(optimizer) in self._inside

    def unfinished(self, optimizer_id: int) -> bool:
        """Whether the optimizer of ``id(optimizer) == optimizer_id`` was entered and never
        stepped, though its step post-hook would have said so: nothing was updated (the AMP
        grad scaler skipped its step). ``False`` for an optimizer without post-hooks."""
        return optimizer_id in self._inside and optimizer_id in self._handles

    def found_inf(self, optimizer_id: int) -> Tensor | None:
        """The grad scaler's ``found_inf`` flag of the last step of the optimizer of
        ``id(optimizer) == optimizer_id`` (nonzero: the step updated nothing), where the scaler
        handed it to the optimizer's own step (``fused=True``); else ``None``."""
        return self._found_inf.get(optimizer_id)

    def reset(self) -> None:
        """Every step is over (its post-hooks stay)."""
        self._inside = set()
        self._found_inf = {}

    def release(self) -> None:
        """Every step is over, and the post-hooks are removed from the optimizers (idempotent)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}
        self.reset()


def _step_done(
    steps: weakref.ref[StepsInProgress], optimizer: torch.optim.Optimizer, *_: Any
) -> None:
    """A step post-hook: the optimizer's step is over, its next call starts a new one. A grad
    scaler that leaves the skipping to the optimizer (``fused=True``) sets ``found_inf`` on it
    for the step's duration: kept, without reading it."""
    found = steps()
    if found is not None:
        found._inside.discard(id(optimizer))
        flag = getattr(optimizer, "found_inf", None)
        if isinstance(flag, Tensor):
            found._found_inf[id(optimizer)] = flag
