"""`HealthRule`: the extension point for rules a :class:`~lightning_recorder.HealthMonitor` checks.

A rule looks at the model after an optimizer step and says what is wrong as
:class:`~lightning_recorder.HealthEvent` s whose ``kind`` is the rule's ``name`` (dead,
saturated or exploding layers, for instance). The monitor calls :meth:`HealthRule.check` on
every rank after every optimizer step (on the batch that stepped, in ``on_train_batch_end``)
and reports what it returns like its own events (Python logging, loggers, alert, ``events``).
No rule ships yet: this interface is provisional and may grow with the first rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ._health_event import HealthEvent

__all__ = ["HealthRule"]


class HealthRule:
    """Base class of a health rule: a ``name`` and a :meth:`check`.

    Examples:
        >>> class Never(HealthRule):
        ...     name = "never"
        >>> list(Never().check(None, None, step=0))
        []
    """

    name: str = "rule"
    """The rule's name: the ``kind`` of its events; unique among a monitor's rules."""

    def check(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int
    ) -> Iterable[HealthEvent]:
        """The events this rule finds after optimizer step ``step`` (none by default)."""
        return ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
