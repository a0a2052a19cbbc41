"""Small Lightning helpers shared by the callbacks: stages, Lightning's step axis, step gating.

What the callbacks need to know about Lightning's loops and loggers is read here, so that a
change in Lightning touches one file. Two values have no public accessor (Lightning 2.6) and are
read from private attributes behind a fallback, as Lightning's own ``LearningRateMonitor`` and
``DeviceStatsMonitor`` read the first: the step axis of ``self.log`` (:func:`step_axis`) and a
logger's key prefix (:func:`logger_prefix`); a third, the mark Lightning leaves on a model it
unwrapped from ``torch.compile``, is read by :func:`is_compiled`. Everything else goes through
public properties.

* **Step axis.** Lightning logs ``self.log`` metrics of training step ``k`` (0-based, counted in
  optimizer steps) at ``step=k``, and validation metrics at the number of optimizer steps done so
  far. :func:`step_axis` returns that number, so callbacks log on the same x axis. (During
  ``on_train_batch_end`` ``trainer.global_step`` is already ``k + 1``, and it counts one step per
  optimizer, so it is not that axis.)
* **Loggers.** :func:`logger_prefix` reads the prefix a Lightning logger puts before its keys
  (the writing itself is in :mod:`._tensorboard`).
* **Gating.** "Every N steps" counts optimizer steps, not micro-batches: with gradient
  accumulation every micro-batch of a due optimizer step is recorded (:func:`is_due`), and the
  step is complete on the micro-batch that steps (:func:`completes_step`). Due steps are those
  where ``(k + 1) % N == 0`` — the rule of ``Trainer(log_every_n_steps=N)``, so that statistics
  land on the same steps as the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import CombinedLoader
from torch import nn

from .._core.compat import is_compiled as compiled_by_torch
from ..errors import RecorderConfigError

Stage = Literal["train", "val", "test", "predict"]
"""A loop of the Trainer, as it appears in tags: ``train``, ``val``, ``test`` or ``predict``."""

STAGES: tuple[Stage, ...] = get_args(Stage)


def check_stages(stages: object, owner: str) -> tuple[Stage, ...]:
    """Validate the ``stages`` option: one stage name or a sequence of them (order kept).

    Raises:
        RecorderConfigError: a name is not one of :data:`STAGES`.
    """
    items = (stages,) if isinstance(stages, str) else stages
    if not isinstance(items, Sequence) or isinstance(items, bytes):
        raise RecorderConfigError(
            f"Expected `stages` of {owner} to be a sequence of {', '.join(map(repr, STAGES))} "
            f"but got {stages!r}."
        )
    found: list[Stage] = []
    for item in items:
        if item not in STAGES:
            raise RecorderConfigError(
                f"Expected `stages` of {owner} to hold only {', '.join(map(repr, STAGES))} "
                f"but got {item!r}."
            )
        if item not in found:
            found.append(item)
    return tuple(found)


def attached_trainer(module: object) -> pl.Trainer | None:
    """The Trainer a LightningModule is attached to (its public ``trainer`` property); ``None``
    for a module that is not attached, or not a LightningModule."""
    if not isinstance(module, pl.LightningModule):
        return None
    try:
        return module.trainer
    except RuntimeError:  # "... is not attached to a `Trainer`"
        return None


def is_compiled(module: nn.Module) -> bool:
    """Whether ``torch.compile`` compiles ``module`` or a part of it: a LightningModule passed to
    ``fit`` as ``torch.compile(model)`` (Lightning unwraps it and marks it with its private
    ``_compiler_ctx``, which nothing public exposes), or what :func:`.compat.is_compiled` finds
    (an ``OptimizedModule`` inside, a submodule compiled in place)."""
    return getattr(module, "_compiler_ctx", None) is not None or compiled_by_torch(module)


def step_axis(trainer: pl.Trainer) -> int:
    """Lightning's x axis for logged metrics: optimizer steps completed before this batch."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    value = getattr(loop, "_batches_that_stepped", None)
    return value if isinstance(value, int) else int(trainer.global_step)


def completes_step(trainer: pl.Trainer) -> bool:
    """Whether the current training batch ends with an optimizer step (false while accumulating).

    Lightning's rule, from public properties: a batch steps when it completes a group of
    ``accumulate_grad_batches`` batches of its epoch, or when it is the epoch's last batch and
    the strategy does not accumulate over epochs itself (DeepSpeed does). Manual optimization
    accumulates nothing (``accumulate_grad_batches`` is 1 there): every batch completes.
    """
    batch = trainer.fit_loop.epoch_loop.batch_idx + 1  # the batch's number within its epoch
    if batch % trainer.accumulate_grad_batches == 0:
        return True
    last = batch == trainer.num_training_batches or trainer.is_last_batch
    return last and not trainer.strategy.handles_gradient_accumulation


def is_due(step: int, every_n_steps: int) -> bool:
    """Whether optimizer step ``step`` (0-based) is one of every ``every_n_steps`` steps."""
    return (step + 1) % every_n_steps == 0


def logger_prefix(logger: Logger) -> str:
    """The ``prefix`` a Lightning logger puts before its metric keys (``""`` without one).

    Lightning's loggers apply it in ``log_metrics`` and keep it in a private attribute, with no
    public accessor (Lightning 2.6); read here, so that a change in Lightning touches one file.
    """
    prefix = getattr(logger, "_prefix", "")
    return prefix if isinstance(prefix, str) else ""


def predict_batch_indices(
    trainer: pl.Trainer, batch_idx: int, dataloader_idx: int
) -> list[int] | None:
    """The dataset indices of a predict batch, from the batch sampler Lightning wraps (the
    indices Lightning's ``BasePredictionWriter`` gets); ``None`` where there are none (a batch
    sampler of another kind, an iterable that is not a ``DataLoader``)."""
    loaders = trainer.predict_dataloaders
    if loaders is None:
        return None
    try:
        # the predict loaders as `dataloader_idx` counts them (a list, a dict, or one loader)
        dataloader = CombinedLoader(loaders, mode="sequential").flattened[dataloader_idx]
        seen = dataloader.batch_sampler.seen_batch_indices
        return list(seen[batch_idx])
    except (AttributeError, IndexError, TypeError):
        return None
