"""Replay a flagged training step with a :class:`Trace` on every module, leaving no trace of it.

The replay runs before the optimizer step, so the parameters are those the step used. For each
micro-batch of the optimizer step (one, without gradient accumulation), in order, until one
shows non-finite values:

* torch's CPU and CUDA random generators are set to their state at the micro-batch's start
  (captured at ``on_train_batch_start``: a few kilobytes copied on the host), so that dropout
  draws the same masks; afterwards they are given back the state they had before the replay;
* ``training_step`` runs on the LightningModule itself (not through a DDP wrapper: no
  collective, no gradient reduction) in the precision plugin's ``train_step_context`` (autocast),
  with ``self.log``/``self.log_dict`` muted so that nothing is logged twice; a compiled model runs
  eagerly (``torch.compiler.set_stance("force_eager")``) so that the hooks see every module;
* the loss (times the AMP scale, if a grad scaler is used) is back-propagated with
  ``torch.autograd.grad``: the parameters' ``.grad`` — the real step's gradients — are not
  touched;
* every buffer (BatchNorm running statistics, counters) is copied before and written back after.

The recorder callbacks of the Trainer (``FeatureStatsMonitor``, ``ActivationWriter``) are
:meth:`~lightning_recorder.RecorderCallback.paused` meanwhile: the step's statistics and records
count its calls once. What is not restored: Python state that ``training_step`` changes by
itself (counters, attributes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn

from ._health_trace import Trace
from ._health_verdict import Finding
from ._lightning import is_compiled
from .recorder import RecorderCallback

__all__ = ["MicroBatch", "capture_rng", "replay", "why_not_replayable"]


@dataclass
class MicroBatch:
    """What the replay of one micro-batch, and its evidence bundle, need: captured at
    ``on_train_batch_start``."""

    batch: Any
    batch_idx: int
    cpu_rng: torch.Tensor
    cuda_rng: dict[int, torch.Tensor] = field(default_factory=dict)


def _cuda_devices(pl_module: nn.Module) -> list[int]:
    device = getattr(pl_module, "device", torch.device("cpu"))
    if isinstance(device, torch.device) and device.type == "cuda":
        return [device.index if device.index is not None else torch.cuda.current_device()]
    return []


def capture_rng(pl_module: nn.Module, batch: Any, batch_idx: int) -> MicroBatch:
    """The batch and the random generators' states, cheaply (no device synchronisation)."""
    cuda = {d: torch.cuda.get_rng_state(d) for d in _cuda_devices(pl_module)}
    return MicroBatch(batch, batch_idx, torch.get_rng_state(), cuda)


def why_not_replayable(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """Why steps of this run cannot be replayed, or ``None`` when they can."""
    if not pl_module.automatic_optimization:
        return (
            "manual optimization steps inside `training_step`, which therefore cannot be run "
            "again before the step"
        )
    model = trainer.strategy.model
    if model is not None and model is not pl_module:
        wrapper = type(model).__name__
        if wrapper != "DistributedDataParallel":
            return f"the strategy wraps the model in {wrapper}, which the replay cannot bypass"
    return None


@contextlib.contextmanager
def muted_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing on this instance for the duration."""
    saved = {name: vars(pl_module).get(name) for name in ("log", "log_dict")}

    def mute(*args: Any, **kwargs: Any) -> None:
        return None

    object.__setattr__(pl_module, "log", mute)
    object.__setattr__(pl_module, "log_dict", mute)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                vars(pl_module).pop(name, None)
            else:
                object.__setattr__(pl_module, name, previous)


@contextlib.contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """Every buffer is written back as it was (BatchNorm running statistics, counters)."""
    saved = [(b, b.detach().clone()) for b in module.buffers() if b is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, copy in saved:
                buffer.copy_(copy)


def _eager(pl_module: nn.Module) -> Any:
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if is_compiled(pl_module) and callable(set_stance):
        return set_stance("force_eager")
    return contextlib.nullcontext()


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a ``training_step`` output: the tensor, or a mapping's ``"loss"``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


def replay(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    window: Sequence[MicroBatch],
    exclude: Sequence[str] = (),
    scaler: Any = None,
    summarize: bool = True,
) -> tuple[Finding, MicroBatch | None]:
    """Replay the micro-batches of a step in order until one shows non-finite values.

    Returns the finding (``reproduced=False`` when none did, with ``error`` set when the
    replay itself failed; with ``summarize``, the timeline's summary for the evidence) and the
    micro-batch it is about.
    """
    if not window:
        return Finding(False, error="no batch to replay"), None
    trace = Trace(pl_module, exclude, keep=True, owner="HealthMonitor replay")
    devices = _cuda_devices(pl_module)
    takes_index = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
    named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    finding, about = Finding(False), window[-1]
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            stack.enter_context(kept_buffers(pl_module))
            stack.enter_context(muted_logging(pl_module))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(_eager(pl_module))
            for callback in trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(callback, RecorderCallback):
                    stack.enter_context(callback.paused())
            trace.install()
            for micro in window:
                torch.set_rng_state(micro.cpu_rng)
                for device, state in micro.cuda_rng.items():
                    torch.cuda.set_rng_state(state, device)
                trace.begin(micro.batch)
                args = (micro.batch, micro.batch_idx) if takes_index else (micro.batch,)
                with trainer.precision_plugin.train_step_context():
                    loss = loss_of(pl_module.training_step(*args))
                trace.end_forward(loss)
                finding = trace.timeline.verdict()  # the forward: no backward needed if found
                if not finding.reproduced and loss is not None and loss.requires_grad:
                    target = scaler.scale(loss) if scaler is not None else loss
                    grads = torch.autograd.grad(target, params, allow_unused=True)
                    trace.parameter_grads((n, g) for (n, _), g in zip(named, grads, strict=True))
                    del grads
                    finding = trace.timeline.verdict()
                line = trace.finish()
                if summarize:
                    finding.summary = line.summary()
                about = micro
                if finding.reproduced:
                    break
    except Exception as err:  # the replay must never be what stops training
        finding = Finding(False, error=f"{type(err).__name__}: {err}")
    finally:
        trace.remove()
    return finding, about
