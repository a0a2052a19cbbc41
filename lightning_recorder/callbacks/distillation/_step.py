"""One distillation step: recorders on both networks, the teacher's pass, the terms.

:class:`StepRunner` holds what :class:`~lightning_recorder.FeatureDistillation` installs on the
student and the teacher, and runs a step in phases: :meth:`StepRunner.begin` (student recorders
on), the teacher's pass (from the student's forward pre-hook, or on ``teacher_input(batch)``),
:meth:`StepRunner.end_capture`, :meth:`StepRunner.terms`, :meth:`StepRunner.finish` (records
freed). Entering and leaving are idempotent: Lightning's batch hooks do not always pair.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from ..._core.hooks import HookSet
from ...distill import DistillDeliveryManager, LossFn
from ...errors import RecorderConfigError, RecorderStateError
from ...recorders import RecorderManager
from ._bank import ConnectorBank
from ._config import feature
from ._patch import StudentInputHook


class StepRunner:
    """The recording side of a FeatureDistillation.

    Args:
        teacher: the teacher network.
        pairs: ``{student module name: teacher module name}``.
        losses: the loss of each pair.
        weights: the weight of each pair.
        bank: the connectors.
        deliveries: the deliveries (possibly empty).
    """

    def __init__(
        self,
        teacher: nn.Module,
        pairs: Mapping[str, str],
        losses: Mapping[str, LossFn],
        weights: Mapping[str, float],
        bank: ConnectorBank,
        deliveries: DistillDeliveryManager,
    ) -> None:
        self.teacher = teacher
        self.pairs = dict(pairs)
        self.losses = dict(losses)
        self.weights = dict(weights)
        self.bank = bank
        self.deliveries = deliveries
        self.module: pl.LightningModule | None = None
        self.phase: str | None = None
        self._hooks = HookSet("FeatureDistillation")
        # Per phase ("train", "val"): the student's and the teacher's recorders.
        self._recorders: dict[str, tuple[RecorderManager, RecorderManager]] = {}
        self._teacher_flags: tuple[bool, list[bool]] | None = None
        self._teacher_ran = False
        self._replaying = False

    # ------------------------------------------------------------------ install / uninstall
    def install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, validation: bool) -> None:
        """Prepare teacher and recorders for ``pl_module`` (nothing left behind on failure)."""
        if self.module is pl_module:
            return
        self.uninstall()
        if any(m is self.teacher for m in pl_module.modules()):
            raise RecorderConfigError(
                "Expected the teacher to live outside the student but it is a submodule of "
                f"{type(pl_module).__name__}: it would be saved in the student's checkpoint. "
                "Keep the teacher only in FeatureDistillation(teacher=...)."
            )
        try:
            teacher = self.teacher
            self._teacher_flags = (
                teacher.training,
                [p.requires_grad for p in teacher.parameters()],
            )
            teacher.requires_grad_(False)
            teacher.eval()
            teacher.to(pl_module.device)
            trainer.precision_plugin.convert_module(teacher)
            self._recorders["train"] = self._make_recorders(pl_module, detach=False)
            if validation:
                # Nothing back-propagates through validation records: they are detached.
                self._recorders["val"] = self._make_recorders(pl_module, detach=True)
            self.deliveries.initialize()
            hook = StudentInputHook(self)
            self._hooks.add(pl_module.register_forward_pre_hook(hook, with_kwargs=True))
            for fn in self.losses.values():
                if isinstance(fn, nn.Module):
                    fn.to(pl_module.device)
            self.module = pl_module
        except BaseException:
            self.uninstall()
            raise

    def _make_recorders(
        self, pl_module: pl.LightningModule, detach: bool
    ) -> tuple[RecorderManager, RecorderManager]:
        common: dict[str, Any] = {"type": "ModuleOutputs", "keep": "first", "detach": detach}
        student = RecorderManager({p: {**common, "source": p} for p in self.pairs})
        teacher = RecorderManager(
            {p: {**common, "source": t, "detach": True} for p, t in self.pairs.items()}
        )
        student.initialize(pl_module)
        try:
            teacher.initialize(self.teacher)
        except BaseException:
            student.release()
            raise
        return student, teacher

    def uninstall(self) -> None:
        """Remove every hook and patch, restore the teacher's flags. Idempotent."""
        self.end_capture()
        self.phase = None
        self._hooks.remove_all()
        for student, teacher in self._recorders.values():
            student.release()
            teacher.release()
        self._recorders = {}
        self.deliveries.release()
        if self._teacher_flags is not None:
            training, flags = self._teacher_flags
            for param, flag in zip(self.teacher.parameters(), flags, strict=False):
                param.requires_grad_(flag)
            self.teacher.train(training)
            self._teacher_flags = None
        self.module = None

    # ------------------------------------------------------------------ one step
    def begin(self, phase: str) -> None:
        """Start a step: fresh records, the student's recorders on, the teacher not run yet."""
        self.end_capture()
        self.phase = phase
        self._teacher_ran = False
        self.deliveries.reset()
        recorders = self._recorders.get(phase)
        if recorders is not None:
            recorders[0].stop()
            recorders[0].start()

    def end_capture(self) -> None:
        """Stop recording the student and replaying deliveries."""
        for student, _ in self._recorders.values():
            student.stop()
        if self._replaying:
            self._replaying = False
            self.deliveries.__exit__(None, None, None)

    def finish(self) -> None:
        """End the step and free its records."""
        self.phase = None
        for student, teacher in self._recorders.values():
            student.reset_data_buffer()
            teacher.reset_data_buffer()

    def _on_student_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.phase is not None and not self._teacher_ran:
            self.run_teacher(args, kwargs)

    def run_teacher(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run the teacher on ``(args, kwargs)`` without a graph, recording its pairs."""
        teacher, deliveries = self.teacher, self.deliveries
        if self.phase not in self._recorders:
            return
        recorders = self._recorders[self.phase][1]
        if teacher.training:
            teacher.eval()
        if len(deliveries):
            deliveries.override_data = False
            deliveries.__enter__()
        recorders.stop()
        recorders.start()
        try:
            with torch.no_grad():
                teacher(*args, **kwargs)
        finally:
            recorders.stop()
            if len(deliveries):
                deliveries.__exit__(None, None, None)
        self._teacher_ran = True
        if len(deliveries):  # the student's pass replays what the teacher's pass recorded
            deliveries.override_data = True
            deliveries.__enter__()
            self._replaying = True

    def terms(self) -> dict[str, Tensor]:
        """The weighted loss of each pair, from this step's records."""
        if self.phase not in self._recorders:
            raise RecorderStateError(
                "Expected the distillation loss to be requested inside `training_step` while "
                "FeatureDistillation is fitting, but no step is running."
            )
        if not self._teacher_ran:
            raise RecorderStateError(
                "Expected the teacher to have run in this step, but the student's forward was "
                "never called: FeatureDistillation runs the teacher on the inputs of the "
                "student's forward (`self(x)` in the step). Call the student through `self(...)`, "
                "or pass `teacher_input=` to map the batch to the teacher's input."
            )
        student, teacher = self._recorders[self.phase]
        terms: dict[str, Tensor] = {}
        for pair, t_name in self.pairs.items():
            s = feature(student.get_recorder(pair).get_record_data(), "student", pair)
            t = feature(teacher.get_recorder(pair).get_record_data(), "teacher", t_name)
            connector = self.bank.get(pair, s, t)
            terms[pair] = self.losses[pair](connector(s), t) * self.weights[pair]
        return terms

    def log(self, terms: Mapping[str, Tensor], prefix: str, on_step: bool) -> Tensor:
        """Log every term and their sum through the LightningModule; return the sum."""
        items = iter(terms.values())
        total = next(items)
        for value in items:
            total = total + value
        module = self.module
        if module is not None and module._trainer is not None:
            options: dict[str, Any] = {"on_step": on_step, "on_epoch": not on_step}
            if not on_step:
                options["sync_dist"] = True
            for pair, value in terms.items():
                module.log(f"{prefix}/{pair}", value.detach(), **options)
            module.log(f"{prefix}/total", total.detach(), **options)
        return total
