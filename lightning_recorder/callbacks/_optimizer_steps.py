"""Which optimizers are inside a step: one optimizer step seen as one, however many backwards.

An optimizer that calls its closure several times in one step (``torch.optim.LBFGS``) makes
Lightning call ``on_before_optimizer_step`` after each of those backwards. A callback that
counts, copies or reports per optimizer step tells the calls of one step apart from a new step
with :class:`StepsInProgress`: the first call of a step enters it, a step post-hook on the
optimizer (registered at that first call, held until :meth:`StepsInProgress.release`) says when
the step is over. A step the optimizer never finishes (a step the AMP grad scaler skips calls no
``optimizer.step``) ends at :meth:`StepsInProgress.reset`, which the callbacks call where no
step can be in progress (a batch's start or end).
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["StepsInProgress"]


class StepsInProgress:
    """The optimizers inside an unfinished step, and their step post-hooks."""

    def __init__(self) -> None:
        self._inside: set[int] = set()  # ids of the optimizers inside a step
        self._handles: dict[int, RemovableHandle] = {}

    def enter(self, optimizer: torch.optim.Optimizer) -> bool:
        """Note that ``optimizer`` is inside a step; return whether it already was (its closure
        called again within the same step)."""
        key = id(optimizer)
        if key in self._inside:
            return True
        self._inside.add(key)
        register = getattr(optimizer, "register_step_post_hook", None)
        if callable(register) and key not in self._handles:
            self._handles[key] = register(partial(_step_done, weakref.ref(self)))
        return False

    def inside(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is inside a step entered with :meth:`enter`."""
        return id(optimizer) in self._inside

    def reset(self) -> None:
        """Every step is over (its post-hooks stay)."""
        self._inside = set()

    def release(self) -> None:
        """Every step is over, and the post-hooks are removed from the optimizers (idempotent)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}
        self.reset()


def _step_done(
    steps: weakref.ref[StepsInProgress], optimizer: torch.optim.Optimizer, *_: Any
) -> None:
    """A step post-hook: the optimizer's step is over, its next call starts a new one."""
    found = steps()
    if found is not None:
        found._inside.discard(id(optimizer))
