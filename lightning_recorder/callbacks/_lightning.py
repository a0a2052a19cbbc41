"""Small Lightning helpers shared by the callbacks: stages, Lightning's step axis, step gating.

What the callbacks need to know about Lightning's loops and loggers is read here, so that a
change in Lightning touches one file. The step axis of ``self.log`` (:func:`step_axis`), which
Lightning keeps privately, is derived from public counters (its agreement with Lightning's own
value at every hook is tested, resumed runs included). Nothing private of Lightning's is read:
everything goes through public properties and public traces (a model Lightning unwrapped from
``torch.compile``: :func:`unwrapped_from_compile`); a logger's key prefix is read where the
logger makes it public (:func:`logger_prefix`).

* **Step axis.** Lightning logs ``self.log`` metrics of training step ``k`` (0-based, counted in
  optimizer steps) at ``step=k``, and validation metrics at the number of optimizer steps done so
  far. :func:`step_axis` returns that number, so callbacks log on the same x axis. (During
  ``on_train_batch_end`` ``trainer.global_step`` is already ``k + 1``, and it counts one step per
  optimizer, so it is not that axis.)
* **Loggers.** :func:`logger_prefix` reads the prefix a logger puts before its keys, where the
  logger makes it public (the writing itself is in :mod:`._tensorboard`).
* **Gating.** "Every N steps" counts optimizer steps, not micro-batches: with gradient
  accumulation every micro-batch of a due optimizer step is recorded (:func:`is_due`), and the
  step is complete on the micro-batch that steps (:func:`completes_step`). Due steps are those
  where ``(k + 1) % N == 0`` — the rule of ``Trainer(log_every_n_steps=N)``, so that statistics
  land on the same steps as the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import CombinedLoader
from torch import nn

from .._core.checks import STAGES, Stage
from .._core.compat import is_compiled as compiled_by_torch
from ..errors import RecorderConfigError, RecorderStateError

#: The stages each entry point of the Trainer runs, by the ``stage`` Lightning passes to a
#: callback's ``setup`` (``trainer.state.fn``).
LOOP_STAGES: dict[str, tuple[Stage, ...]] = {
    "fit": ("train", "val"),
    "validate": ("val",),
    "test": ("test",),
    "predict": ("predict",),
}


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


def serves(running: object, pl_module: object) -> bool:
    """Whether the run of ``pl_module`` may use, or release, what a callback installed on
    ``running`` (``None``: nothing installed): a callback serves one run at a time, and a second
    Trainer's run, refused at its start, leaves the first one's as they are."""
    return running is None or running is pl_module


def check_one_run(owner: str, running: object, pl_module: object, thread: str) -> None:
    """Raise unless the run of ``pl_module`` :func:`serves` what the callback ``owner`` (as the
    message names it) installed on ``running`` in a run that has not ended (started in the
    thread named ``thread``)."""
    if not serves(running, pl_module):
        raise RecorderStateError(
            f"Expected {owner} to serve one run at a time, but it is still installed on "
            f"another {type(running).__name__} by a run that has not ended (in thread "
            f"{thread!r}); give each Trainer its own callback."
        )


def _made_state_key(callback: Any) -> str:
    key: str = callback._make_state_key()
    return key


#: ``state_key`` of the package's callbacks: made once by the callback's ``_make_state_key``,
#: then kept in its ``__dict__``, where attribute lookup finds it without calling any Python.
#: Lightning formats it into a profiler label at every hook call, six a training step, and a
#: property's call there cost a step more than it does in a warm loop (the caches are cold
#: after the step's tensor work): about 0.2 % of a small CNN's step, in the side-by-side runs.
STATE_KEY = cached_property(_made_state_key)


def unclaimed_state(
    callback: pl.Callback,
    trainer: pl.Trainer,
    checkpoint: dict[str, Any],
    takes: Callable[[pl.Callback], bool],
    fits: Callable[[dict[str, Any]], bool],
    fit_only: bool = True,
) -> tuple[str, dict[str, Any]] | None:
    """The state another configuration of ``callback``'s class saved in ``checkpoint``, for
    ``callback`` to take in ``on_load_checkpoint`` (Lightning then finds none of its own).

    Lightning restores a callback's state by its ``state_key``, made of options that a resumed
    run may change. ``None`` unless the checkpoint holds no state under ``callback``'s key and
    exactly one state of its class that no callback of the Trainer claims and that ``fits``,
    and ``callback`` is the one callback of its class without a state of its own that ``takes``
    it (two would both take it); with ``fit_only``, ``None`` in the loops other than ``fit``
    (which load a checkpoint's states but resume nothing)."""
    states = checkpoint.get("callbacks") or {}
    if fit_only and trainer.state.fn != "fit":
        return None
    if callback.state_key in states or not takes(callback):
        return None
    cls = type(callback)
    callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    claimed = {other.state_key for other in callbacks}
    takers = [
        other
        for other in callbacks
        if type(other) is cls and other.state_key not in states and takes(other)
    ]
    found = [
        (key, state)
        for key, state in states.items()
        if isinstance(key, str)
        and key.startswith(f"{cls.__qualname__}{{")
        and key not in claimed
        and isinstance(state, dict)
        and fits(state)
    ]
    return found[0] if len(found) == 1 and takers == [callback] else None


def is_compiled(module: nn.Module) -> bool:
    """Whether ``torch.compile`` compiles ``module`` or a part of it: a LightningModule passed to
    ``fit`` as ``torch.compile(model)`` (:func:`unwrapped_from_compile`), or what
    :func:`.compat.is_compiled` finds (an ``OptimizedModule`` inside, a submodule compiled in
    place)."""
    return unwrapped_from_compile(module) or compiled_by_torch(module)


def unwrapped_from_compile(module: nn.Module) -> bool:
    """Whether ``module`` looks as Lightning's public ``from_compiled`` leaves a LightningModule
    (``fit`` calls it on ``torch.compile(model)``): its ``forward`` and ``training_step``
    replaced, on the instance, by ``torch.compile``'s wrappers of its own methods
    (``functools.wraps``: each wrapper's ``__wrapped__`` is the module's bound method).

    Told from those public traces, not from the private mark Lightning also leaves. A module
    whose two methods a user wrapped the same way by hand is taken for compiled too: the
    callbacks then keep their hooks and records as on a compiled model, which costs memory
    and time but changes no statistic.
    """
    own = vars(module)
    for name in ("forward", "training_step"):
        inner = getattr(own.get(name), "__wrapped__", None)
        if getattr(inner, "__self__", None) is not module or getattr(inner, "__name__", "") != name:
            return False
    return True


def step_axis(trainer: pl.Trainer) -> int:
    """Lightning's x axis for logged metrics: the batches that stepped before this batch, as
    Lightning counts them, at every hook of a fit, resumed or not.

    Lightning counts a batch that steps (see :func:`completes_step`) after its
    ``on_train_batch_end`` and the validation that may follow it, so that everything logged
    for training batch ``k`` and that validation lands on step ``k``. Derived from public
    counters: the optimizer steps taken (``trainer.global_step``, automatic optimization: one
    optimizer, one step per batch that steps) or the training batches completed (manual
    optimization: every batch counts, whatever its optimizers did), less the current batch
    where that count already holds it and Lightning's does not yet: in automatic optimization
    from the optimizer step to the end of the validation after the batch, in manual
    optimization during that validation. Both counts are restored from a checkpoint, as
    Lightning's axis is.

    A checkpoint saved inside a batch, before it completed (``OnExceptionCheckpoint`` after
    ``training_step`` raised, ``trainer.save_checkpoint`` in ``training_step``), holds the
    batch as started but not completed. A fit resumed from it runs the batch again, and
    Lightning counts the unfinished batch as one that stepped if it was to step (in automatic
    optimization with gradient accumulation, if it completes its group): from then on its axis
    is one more than the uninterrupted fit's for each such batch. So that callbacks follow
    Lightning's axis of the resumed run, those batches are added: the batches Lightning's
    fit-long count holds as ready beyond its epoch-long one (which a resume sets back to the
    completed batches); in automatic optimization with gradient accumulation, the optimizer
    steps its fit-long count holds as begun beyond its epoch-long one instead (Lightning runs
    ``training_step`` of a batch that steps inside the optimizer's step). The one batch this
    misses: with gradient accumulation, a checkpoint saved in ``on_train_batch_start`` of a
    batch that completes its group (counted by Lightning, but no step had begun).
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    # ready, started, processed and completed batches: over the whole fit, and in the epoch
    total: Any = progress.total
    current: Any = progress.current
    # batches a resumed fit counts as ready but not completed: saved inside a batch
    unfinished = total.ready - total.completed - (current.ready - current.completed)
    module = trainer.lightning_module
    if module is None or module.automatic_optimization:
        if trainer.accumulate_grad_batches > 1:  # optimizer steps begun, not batches
            optimizer: Any = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
            step = optimizer.optimizer.step
            unfinished = step.total.ready - step.total.completed
            unfinished -= step.current.ready - step.current.completed
        counted = trainer.global_step + unfinished
        if current.processed < current.ready:  # before this batch's optimizer step (batch start)
            return counted
        holds_batch = current.completed < current.ready or _validating_in_fit(trainer)
    else:
        counted = total.completed + unfinished
        holds_batch = current.completed == current.ready and _validating_in_fit(trainer)
    if holds_batch and total.ready > 0 and completes_step(trainer):
        return counted - 1
    return counted


def _validating_in_fit(trainer: pl.Trainer) -> bool:
    return trainer.validating and trainer.state.fn == "fit"


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


def fast_dev_run(trainer: pl.Trainer) -> bool:
    """Whether the Trainer runs Lightning's smoke test (``Trainer(fast_dev_run=True)`` or ``=N``),
    where it writes no logs or checkpoints: the callbacks write no files then either. Lightning
    sets the attribute when the Trainer is built; it is not among the Trainer's declared ones."""
    return bool(getattr(trainer, "fast_dev_run", False))


def is_due(step: int, every_n_steps: int) -> bool:
    """Whether optimizer step ``step`` (0-based) is one of every ``every_n_steps`` steps."""
    return (step + 1) % every_n_steps == 0


def logger_prefix(logger: Logger) -> str:
    """The prefix a logger puts before its metric keys, where it makes it public: its ``prefix``
    property (:class:`~lightning_recorder.TensorBoardLogger`'s); ``""`` for a logger without one.

    Lightning's loggers (2.6) keep their ``prefix`` argument in a private attribute and apply it
    only in ``log_metrics``; it is not read. What the callbacks hand to ``log_metrics`` gets it
    from Lightning; what they write to a TensorBoard writer themselves carries the prefix of a
    logger that makes it public, and otherwise none (the callbacks' own ``prefix`` options put
    anything before their tags).
    """
    prefix = getattr(logger, "prefix", "")
    return prefix if isinstance(prefix, str) else ""


def prefixed_tag(logger: Logger, tag: str) -> str:
    """``tag`` as a logger whose prefix is public (:func:`logger_prefix`) would write it: after
    its prefix and join character, as its ``log_metrics`` does; ``tag`` itself otherwise."""
    prefix = logger_prefix(logger)
    return f"{prefix}{getattr(logger, 'LOGGER_JOIN_CHAR', '-')}{tag}" if prefix else tag


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
