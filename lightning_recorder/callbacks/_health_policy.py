"""What a :class:`~lightning_recorder.HealthMonitor` does with a step's check: decide before the
optimizer step, or read it lazily at the next; localise; write the event and the evidence; act.

**Deciding before the step** (``"skip"``, ``"raise"``, ``"warn"`` with replays, and every run
with an AMP grad scaler, which synchronises on every step itself): the check's flag is reduced
over the ranks (a maximum) and read — the one synchronisation of a clean step. A flagged step
is counted element by element (the flag also fires on a float32 norm overflow, which is not a
NaN); a step whose gradients overflowed under a grad scaler at a scale above 1 with a finite
loss is the scaler's business (``amp_skipped``). Otherwise the step is replayed (under ``"warn"``
only the first of a run of consecutive non-finite steps: after a non-finite update every later
step is non-finite), the ranks' findings are gathered and the most telling chosen, the evidence
is written on every rank, the event reported, and the policy applied: ``"skip"`` sets every
gradient of the optimizer to ``None`` (optimizers skip parameters without a gradient and leave
their state alone); ``"raise"``, or ``"skip"`` past ``max_consecutive_skips``, raises
:class:`~lightning_recorder.NonFiniteError`.

**Reading lazily** (``"warn"`` without replays): the check and the ``"always"`` timelines are
copied to the host without waiting and handled as soon as they have arrived — on the CPU at
once, before the optimizer step; on a GPU at a later batch start (or at the end of training).
On a GPU each rank reports what it saw, without collectives (each rank's copy arrives at its
own time); where the check is read at once, every rank is at the same point of a step whose
all-reduced DDP gradients are non-finite, and the ranks gather what they saw, as above. A
flagged step is counted element by element then, as above, from the gradients the check saw (see
:meth:`._health_sentinel.Reading.counts` for one freed or changed before the copy arrived).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from .._core.compat import distributed_active
from .._core.names import canonical_name, named_parameters
from ..errors import NonFiniteError
from ._health_event import HealthEvent
from ._health_evidence import Evidence
from ._health_replay import MicroBatch, replay
from ._health_report import Reporter
from ._health_sentinel import Reading, nonfinite_parameters
from ._health_step import (
    Check,
    all_reduce_max,
    choose,
    finish_event,
    gather,
    make_event,
    seen_on,
    write_evidence,
)
from ._health_verdict import Counts, Finding, Timeline
from ._lightning import step_axis

if TYPE_CHECKING:
    from ._health_rules import HealthRule

__all__ = ["Decisions", "Pending"]


@dataclass
class Pending:
    """A step read lazily: its check (copied without waiting) and its timelines."""

    reading: Reading
    step: int
    log_step: int
    window: list[MicroBatch]
    optimizer: int = 0  # its index in trainer.optimizers: each optimizer's run of bad steps
    timelines: list[Timeline] = field(default_factory=list)
    again: bool = False  # the closure called again in the same optimizer step (LBFGS)
    packed: list[torch.Tensor | None] = field(default_factory=list)


class Decisions:
    """The flagged-step half of :class:`~lightning_recorder.HealthMonitor` (a mixin)."""

    on_nonfinite: str
    max_consecutive_skips: int
    exclude: tuple[str, ...]
    evidence_checkpoint: bool
    rules: tuple[HealthRule, ...]
    events: list[HealthEvent]
    counters: dict[str, int]
    _reporter: Reporter
    _evidence: Evidence
    _pending: list[Pending]
    _replays: bool
    _streaks: dict[int, int]  # per optimizer (its index): its non-finite steps in a row
    _streak_before: dict[int, int]  # per optimizer: its run before the step in progress
    _reported: set[int]  # the optimizers whose step in progress is reported
    _checkpointed: bool
    _paused_clip: tuple[pl.Trainer, float] | None  # a skipped step's clipping value, to restore

    # ------------------------------------------------------------------ decisions
    def _reported_already(self, optimizer: int, again: bool) -> bool:
        """Whether the step of this check is reported already: an optimizer that calls its
        closure several times in one step (LBFGS) has each backward checked, and its step
        reported, counted and acted on once. A check that starts a step forgets the last."""
        if not again:
            self._reported.discard(optimizer)
            self._streak_before[optimizer] = self._streaks.get(optimizer, 0)
        return optimizer in self._reported

    def _run_of(self, optimizer: int, bad: bool) -> int:
        """Count the step of ``optimizer`` in its run of non-finite steps (a clean one ends the
        run; a step is non-finite if any of its checks is); return the run's length."""
        before = self._streak_before.get(optimizer, self._streaks.get(optimizer, 0))
        run = before + 1 if bad else 0
        self._streaks[optimizer] = run
        if bad:
            self._reported.add(optimizer)
        return run

    def _decides_now(self, trainer: pl.Trainer) -> bool:
        """Whether the check is read before the optimizer step (else lazily, at the next): a
        checkpoint before the first bad update must be saved before that update."""
        checkpoint = self.evidence_checkpoint and not self._checkpointed and self._evidence.enabled
        return (
            self.on_nonfinite != "warn"
            or self._replays
            or checkpoint
            or _scaler(trainer) is not None
        )

    def _decide(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        named: list[tuple[str, torch.Tensor]],
        reading: Reading,
        window: list[MicroBatch],
        timelines: list[Timeline],
        optimizer: int = 0,
        again: bool = False,
    ) -> None:
        """Decide on the step of ``optimizer`` (its index in ``trainer.optimizers``): a run of
        non-finite steps is counted per optimizer, so that a clean step of another one (a GAN's
        discriminator) does not end the generator's. ``again``: the closure called again in the
        same step (LBFGS)."""
        if self._reported_already(optimizer, again):  # alike on every rank: a reduced decision
            if self.on_nonfinite == "skip":  # this step's update stays discarded
                for _, p in named:
                    p.grad = None
            return
        flag = all_reduce_max(reading.flag().float().reshape(1))
        if not bool(flag):  # the one synchronisation of a clean step
            self._run_of(optimizer, bad=False)
            return
        (total, loss, grads), _ = reading.counts()
        mine = [float(any(total.values())), float(any(loss.values()))]
        any_bad, loss_bad = all_reduce_max(torch.tensor(mine, device=flag.device)).tolist()
        if not any_bad:  # a norm overflowed float32, no value was NaN or infinite
            self._run_of(optimizer, bad=False)
            return
        check = Check(total, loss, [name for name, _ in grads])
        if timelines:  # "always": the gradients counted here are the parameters' part
            timelines[-1].params = _parameter_rows(reading, grads)
        step, log_step = trainer.global_step, step_axis(trainer)
        scaler = _scaler(trainer)
        if scaler is not None and not loss_bad and scaler.get_scale() > 1.0:
            self._amp_skipped(trainer, step, log_step, window, check)
            return
        streak = self._run_of(optimizer, bad=True)
        self.counters["nonfinite_steps"] += 1
        replayed = self._replays and (self.on_nonfinite != "warn" or streak == 1)
        finding: Finding | None = None
        micro = _about(window, reading)
        if replayed or timelines:  # a weight that was non-finite already: no module made it
            finding = _poisoned(list(named_parameters(pl_module).items()))
        if finding is not None:
            replayed = False
        elif replayed:
            summarize = self._evidence.enabled
            finding, about = replay(trainer, pl_module, window, self.exclude, scaler, summarize)
            micro = about if finding.reproduced else micro
        elif timelines:
            finding, about = _first(timelines, window)
            micro = about if finding.reproduced else micro
        found = None
        if finding is not None:
            found = {**finding.plain(), "batch_idx": micro.batch_idx if micro else None}
        # every rank is here (the decision was reduced): the event is about the rank that saw most
        event = _event(trainer, step, micro, check, found, replayed, together=True)
        action = {"warn": "warned", "skip": "skipped", "raise": "raised"}[self.on_nonfinite]
        too_many = action == "skipped" and streak > self.max_consecutive_skips
        action = "raised" if too_many else action
        loud = self.on_nonfinite != "warn" or streak == 1
        extra: dict[str, Any] = {"rank": trainer.global_rank, "world_size": trainer.world_size}
        if loud and self.evidence_checkpoint and not self._checkpointed:
            extra["checkpoint"], failed = self._checkpoint(trainer, pl_module, step)
            if failed is not None:  # in the bundle's event.json and the message
                event.details["checkpoint_error"] = extra["checkpoint_error"] = failed
        if action == "skipped":  # counted before the report, which logs the counters
            self.counters["skipped_steps"] += 1
            left = _nonfinite_buffers(pl_module)  # the forward updated them: no skip undoes it
            if left:
                event.details["nonfinite_buffers"] = left
        self._finish(trainer, event, action, micro, finding, check, extra, loud, log_step)
        if action == "skipped":
            for _, p in named:
                p.grad = None  # optimizers skip parameters without a gradient: no state change
            self._pause_value_clipping(trainer, pl_module)
        elif action == "raised":
            reason = event.message
            if too_many:
                reason = (
                    f"{self.max_consecutive_skips} non-finite steps in a row were skipped "
                    f"(`max_consecutive_skips`); this one is not: {event.message}"
                )
            raise NonFiniteError(reason, event)

    def _pause_value_clipping(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Turn the Trainer's clipping by value off for a skipped step: Lightning clips right
        after this hook, and torch's ``clip_grad_value_`` fails on an optimizer whose every
        gradient is ``None`` (clipping by norm takes it). :meth:`_resume_clipping` turns it back
        on after the optimizer step (at the batch's end, or when training stops)."""
        value = trainer.gradient_clip_val
        if not pl_module.automatic_optimization or not value or value <= 0:
            return
        if trainer.gradient_clip_algorithm != "value" or self._paused_clip is not None:
            return
        self._paused_clip = (trainer, value)
        trainer.gradient_clip_val = None

    def _resume_clipping(self) -> None:
        """Give the Trainer back the clipping value :meth:`_pause_value_clipping` took."""
        if self._paused_clip is not None:
            trainer, value = self._paused_clip
            trainer.gradient_clip_val = value
            self._paused_clip = None

    def _finish(
        self,
        trainer: pl.Trainer,
        event: HealthEvent,
        action: str,
        micro: MicroBatch | None,
        finding: Finding | None,
        check: Check,
        extra: dict[str, Any],
        loud: bool,
        log_step: int,
    ) -> None:
        """Write the evidence (the first step of a run of "warn" steps, every loud one) and
        report."""
        mine = self._evidence.path(event.step, trainer.global_rank) if loud else None
        if mine is not None:  # the event names the bundle written now, not an earlier run's
            mine = self._evidence.free(mine)
        at = self._evidence.path(event.step, event.rank) if loud else None
        at = mine if event.rank == trainer.global_rank else at
        finish_event(event, action, str(at) if at is not None else None)
        written = write_evidence(self._evidence, mine, event, micro, finding, check, extra)
        if written is None and event.rank == trainer.global_rank and at is not None:
            if mine is not None and self._evidence.error is not None:  # it failed: say why
                event.details["evidence_error"] = self._evidence.error
            finish_event(event, action, None)  # nothing could be written here after all
        self._emit(trainer, event, log_step, loud)

    def _amp_skipped(
        self,
        trainer: pl.Trainer,
        step: int,
        log_step: int,
        window: list[MicroBatch],
        check: Check,
    ) -> None:
        self.counters["amp_skipped_steps"] += 1
        micro = window[-1] if window else None
        event = make_event(step, micro, trainer.global_rank, check, None, False, "amp_skipped")
        finish_event(event, None, None)
        self._emit(trainer, event, log_step, loud=False)

    def _checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int
    ) -> tuple[str | None, str | None]:
        """Save a checkpoint before the bad update, once a fit, when the parameters, the
        buffers and the optimizer state fit in ``evidence_max_bytes`` (a test that gives the
        same answer on every rank: ``save_checkpoint`` is a collective). It counts against the
        budget: the file's size where this rank sees it.

        Returns its path, and why it could not be written (an ``OSError``: a full disk, a
        folder made read-only or removed), alike on every rank; a checkpoint that could not be
        written leaves no file, and training goes on (one warning a fit, rank zero)."""
        self._checkpointed = True
        tensors = [*pl_module.parameters(), *pl_module.buffers()]
        size = sum(t.numel() * t.element_size() for t in tensors)
        for optimizer in trainer.optimizers:
            for state in optimizer.state.values():
                size += sum(
                    v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v)
                )
        if not self._evidence.enabled or size > self._evidence.max_bytes:  # alike on every rank
            return None, None
        assert self._evidence.root is not None
        path = self._evidence.root / f"step{step:08d}-before-update.ckpt"
        # not over the checkpoint of an earlier run; rank zero's choice, which writes it
        path = trainer.strategy.broadcast(self._evidence.free(path))
        error = None
        try:
            trainer.save_checkpoint(path)
        except OSError as err:  # raised by the write, before save_checkpoint's closing barrier
            with contextlib.suppress(OSError):  # a name nothing had: nothing half-written
                if Path(path).is_dir():  # a strategy that saves a folder (DeepSpeed)
                    shutil.rmtree(path)
                else:
                    Path(path).unlink(missing_ok=True)
            error = self._evidence.failed("checkpoint", Path(path), err)
            trainer.strategy.barrier("Trainer.save_checkpoint")  # where the other ranks wait
        # every rank says the same: the writer's error (rank zero's under DDP), else none
        errors = [e for e in gather(error) if e is not None]
        if errors:
            return None, errors[0]
        with contextlib.suppress(OSError):  # the file's size, where this rank can see it
            size = Path(path).stat().st_size if Path(path).is_file() else size
        self._evidence.used += size
        return str(path), None

    def _emit(self, trainer: pl.Trainer, event: HealthEvent, log_step: int, loud: bool) -> None:
        self.events.append(event)
        self._reporter.report(trainer, event, self.counters, log_step, loud)

    # ------------------------------------------------------------------ lazy reading
    def _resolve(self, trainer: pl.Trainer, wait: bool) -> None:
        """Handle the checks of earlier steps whose values have arrived (all when ``wait``)."""
        while self._pending:
            pending = self._pending[0]
            if not pending.reading.ready():
                if not wait:
                    return
                pending.reading.wait()
            self._pending.pop(0)
            self._lazy(trainer, pending)

    def _lazy(self, trainer: pl.Trainer, pending: Pending) -> None:
        key = pending.optimizer
        if self._reported_already(key, pending.again):
            return
        if not pending.reading.host_bad():
            self._run_of(key, bad=False)
            return
        (total, loss, grads), missed = pending.reading.counts()
        if not any(total.values()):  # a norm overflowed float32, no value was NaN or infinite
            self._run_of(key, bad=False)
            return
        check = Check(total, loss, [name for name, _ in grads])
        if pending.timelines:
            pending.timelines[-1].params = _parameter_rows(pending.reading, grads)
        streak = self._run_of(key, bad=True)
        self.counters["nonfinite_steps"] += 1
        finding: Finding | None = None
        micro = _about(pending.window, pending.reading)
        for line, packed in zip(pending.timelines, pending.packed, strict=True):
            line.unpack(packed.tolist() if packed is not None else None)
        if pending.timelines:
            finding, about = _first(pending.timelines, pending.window)
            micro = about if finding.reproduced else micro
        found = None
        if finding is not None:
            found = {**finding.plain(), "batch_idx": micro.batch_idx if micro else None}
        # under DDP, every rank's gradients are these all-reduced ones, non-finite: where the check
        # is read at once (not on a GPU) every rank is here, and can say what its batch showed
        together = pending.reading.event is None and _replicated(trainer, grads)
        event = _event(trainer, pending.step, micro, check, found, False, together)
        extra: dict[str, Any] = {"rank": trainer.global_rank, "world_size": trainer.world_size}
        extra["read"] = "lazily"
        if missed and not (found and found.get("reproduced")):  # the check's counts
            event.details["counted_at_least"] = missed
            extra["counted_at_least"] = missed
        loud = streak == 1
        self._finish(trainer, event, "warned", micro, finding, check, extra, loud, pending.log_step)


def _replicated(trainer: pl.Trainer, grads: Sequence[tuple[str, Any]]) -> bool:
    """Whether every rank found non-finite values in the gradients ``grads`` too: DDP's
    all-reduced gradients of the LightningModule's parameters (not DeepSpeed's or FSDP's
    shards, nor those of parameters outside the module, such as a ``FeatureDistillation``
    connector's, which may be all-reduced later)."""
    strategy = trainer.strategy
    if not distributed_active() or not isinstance(strategy, DDPStrategy):
        return False
    if isinstance(strategy, DeepSpeedStrategy):
        return False
    inside = named_parameters(trainer.lightning_module)
    return any(name in inside for name, _ in grads)


def _event(
    trainer: pl.Trainer,
    step: int,
    micro: MicroBatch | None,
    check: Check,
    found: dict[str, Any] | None,
    replayed: bool,
    together: bool,
) -> HealthEvent:
    """The event of a flagged step; ``together``: every rank is here for it, and the event is
    about the rank whose own batch showed most (:func:`choose`), naming under
    ``details["ranks"]`` every rank whose batch showed non-finite values; else about this one."""
    if not together or not distributed_active():
        return make_event(step, micro, trainer.global_rank, check, found, replayed)
    mine = found if found is not None else {"reproduced": False}
    batch_idx = micro.batch_idx if micro is not None else None
    checked = {"check_loss": check.loss, "check_counts": check.counts}
    findings = gather({"batch_idx": batch_idx, **mine, **checked})
    rank = choose(findings)
    theirs = findings[rank]
    told = Check(theirs["check_counts"], theirs["check_loss"], check.parameters)
    event = make_event(step, micro, rank, told, theirs if found is not None else None, replayed)
    event.batch_idx = theirs["batch_idx"]
    ranks = seen_on(findings)
    if ranks:
        event.details["ranks"] = ranks
    return event


def _split(name: str) -> tuple[str, str]:
    owner, _, local = name.rpartition(".")
    return owner, local


def _row(counts: dict[str, int]) -> tuple[int, int, int]:
    return counts.get("nan", 0), counts.get("posinf", 0), counts.get("neginf", 0)


def _parameter_rows(
    reading: Reading, grads: Sequence[tuple[str, dict[str, int]]]
) -> list[tuple[str, str, torch.dtype, tuple[int, ...], Counts]]:
    """A timeline's parameter entries for the non-finite gradients of the check (a gradient
    freed since: float32, shape unknown)."""
    rows: list[tuple[str, str, torch.dtype, tuple[int, ...], Counts]] = []
    for name, counts in grads:
        grad = reading.gradient(name)
        dtype, shape = (grad.dtype, tuple(grad.shape)) if grad is not None else (torch.float32, ())
        rows.append((*_split(name), dtype, shape, _row(counts)))
    return rows


def _scaler(trainer: pl.Trainer) -> Any:
    """The AMP grad scaler of the run (``precision="16-mixed"``), or ``None``."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def _nonfinite_buffers(pl_module: pl.LightningModule) -> list[str]:
    """The floating-point buffers that hold non-finite values (BatchNorm's running statistics
    after a forward over a bad batch), by name."""
    named = [
        (canonical_name(name), b)
        for name, b in pl_module.named_buffers()
        if b is not None and b.is_floating_point()
    ]
    return [name for name, _, _ in nonfinite_parameters(named)]


def _poisoned(named: Sequence[tuple[str, torch.Tensor]]) -> Finding | None:
    """The first parameter that holds non-finite values itself (before the optimizer step:
    as the forward saw it; a frozen one too), or ``None``."""
    found = nonfinite_parameters(named)
    if not found:
        return None
    name, param, counts = found[0]
    module, local = _split(name)
    dtype, shape = str(param.dtype), tuple(param.shape)
    tensors = [(local, param.detach())]
    return Finding(True, module, "parameter", local, counts, dtype, shape, tensors=tensors)


def _about(window: Sequence[MicroBatch], reading: Reading) -> MicroBatch | None:
    """The micro-batch a step's event is about when no module is named: the one whose loss was
    the first non-finite, else the last."""
    first = reading.about_first_bad_loss()
    if isinstance(first, MicroBatch):
        return first
    return window[-1] if window else None


def _first(
    timelines: Sequence[Timeline], window: Sequence[MicroBatch]
) -> tuple[Finding, MicroBatch | None]:
    """The first micro-batch's timeline with a finding (``localize="always"``)."""
    fallback = window[-1] if window else None
    for k, line in enumerate(timelines):
        finding = line.verdict()
        if finding.reproduced:
            finding.summary = line.summary()
            return finding, window[k] if k < len(window) else fallback
    return Finding(False), fallback
