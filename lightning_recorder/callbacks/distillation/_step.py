"""One distillation step: recorders on both networks, the teacher's pass, the terms.

:class:`StepRunner` holds what :class:`~lightning_recorder.FeatureDistillation` installs on the
student and the teacher, and runs a step in phases: :meth:`StepRunner.begin` (student recorders
on), the teacher's pass (from the student's forward pre-hook, or on ``teacher_input(batch)``),
:meth:`StepRunner.end_capture`, :meth:`StepRunner.terms`, :meth:`StepRunner.finish` (records
freed). Entering and leaving are idempotent: Lightning's batch hooks do not always pair.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from ..._core.hooks import HookSet
from ..._core.structures import shape_of
from ...distill import DistillDeliveryManager, LossFn
from ...distill.losses import no_samples, zero_loss
from ...errors import (
    RecorderConfigError,
    RecorderError,
    RecorderStateError,
    UnknownSourceError,
)
from ...recorders import RecorderManager
from .._lightning import attached_trainer
from ._bank import ConnectorBank
from ._config import TeacherSide, feature, teacher_config, teacher_label
from ._patch import StudentInputHook
from ._shard import ShardTeacher, is_sharded, shard

# The teachers frozen for a fit (no gradients, eval mode), by id: the teacher (weakly), its train
# mode and requires_grad flags from before the first runner froze it, and the runners holding it.
# Several FeatureDistillation callbacks may share one teacher and let go of it in any order.
_FROZEN: dict[int, tuple[weakref.ref[nn.Module], tuple[bool, list[bool]], set[int]]] = {}


def _freeze(teacher: nn.Module, runner: object) -> tuple[bool, list[bool]]:
    """Freeze ``teacher`` for ``runner``; return its flags from before it was first frozen."""
    found = _FROZEN.get(id(teacher))
    if found is None or found[0]() is not teacher:  # not frozen (or another module's id)
        flags = (teacher.training, [p.requires_grad for p in teacher.parameters()])
        found = _FROZEN[id(teacher)] = (weakref.ref(teacher), flags, set())
    found[2].add(id(runner))
    teacher.requires_grad_(False)
    teacher.eval()
    return found[1]


def _thaw(teacher: nn.Module, runner: object) -> None:
    """``runner`` lets go of ``teacher``; the last runner to let go puts its flags back."""
    found = _FROZEN.get(id(teacher))
    if found is None or found[0]() is not teacher:
        return
    _, (training, flags), holders = found
    holders.discard(id(runner))
    if holders:
        return
    del _FROZEN[id(teacher)]
    for param, flag in zip(teacher.parameters(), flags, strict=False):
        param.requires_grad_(flag)
    teacher.train(training)


class StepRunner:
    """The recording side of a FeatureDistillation.

    Args:
        teacher: the teacher network.
        pairs: ``{student module name: teacher module name}`` (or ``{"source": teacher module
            name, "path": path}``).
        losses: the loss of each pair.
        weights: the weight of each pair.
        bank: the connectors.
        deliveries: the deliveries (possibly empty).
        on_nonfinite: what a non-finite teacher feature or term does: ``"warn"`` (once per
            pair), ``"raise"`` or ``"ignore"``.
        clone: record copies of the paired outputs (immune to later in-place changes).
    """

    def __init__(
        self,
        teacher: nn.Module,
        pairs: Mapping[str, TeacherSide],
        losses: Mapping[str, LossFn],
        weights: Mapping[str, float],
        bank: ConnectorBank,
        deliveries: DistillDeliveryManager,
        on_nonfinite: Literal["warn", "raise", "ignore"] = "warn",
        clone: bool = False,
    ) -> None:
        self.teacher = teacher
        self.clone = clone
        self.on_nonfinite = on_nonfinite
        # Device-side flags, one row per pair: (teacher feature non-finite, term non-finite),
        # or-ed over the steps since the last check; read on the host only by check_nonfinite.
        self._nonfinite: Tensor | None = None
        self._nonfinite_step = 0  # the first training step the current flags cover
        # flags on their way to the host: (pinned copy, CUDA event, first step, last step + 1)
        self._in_flight: list[tuple[Tensor, Any, int, int]] = []
        self._reported: set[str] = set()
        self._gradless: set[str] = set()  # pairs whose student feature had no gradient
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
        self._teacher_took_input = False  # the teacher ran once in this fit
        self._teacher_sharded = False
        self._replaying = False
        # This step's token mask (what `token_mask` read from the batch), or None.
        self.mask: Any = None
        # The pairs of the latest terms() without a sample (an empty batch, no real token):
        # their term is 0 and log() logs nothing for them.
        self.empty: set[str] = set()

    # ------------------------------------------------------------------ install / uninstall
    def install(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        validation: bool,
        shard_teacher: ShardTeacher = False,
    ) -> None:
        """Prepare teacher and recorders for ``pl_module`` (nothing left behind on failure).

        ``shard_teacher``: shard the teacher with FSDP2 first (see :func:`shard`).
        """
        if self.module is pl_module:
            return
        self.uninstall()
        if self.teacher is pl_module:
            raise RecorderConfigError(
                "Expected the teacher to be another model than the student but got the student "
                f"itself ({type(pl_module).__name__}). Pass the trained teacher, or a copy of "
                "the student made before training (copy.deepcopy(student))."
            )
        if any(m is self.teacher for m in pl_module.modules()):
            raise RecorderConfigError(
                "Expected the teacher to live outside the student but it is a submodule of "
                f"{type(pl_module).__name__}: it would be saved in the student's checkpoint. "
                "Keep the teacher only in FeatureDistillation(teacher=...)."
            )
        trainable = {id(p): n for n, p in pl_module.named_parameters() if p.requires_grad}
        for name, param in self.teacher.named_parameters():
            if id(param) in trainable:
                raise RecorderConfigError(
                    f"Expected the teacher to share no trainable parameter with the student but "
                    f"the teacher's {name!r} is the student's {trainable[id(param)]!r}: freezing "
                    "the teacher would stop it training in the student, silently. Give the "
                    "teacher its own copy of the shared module (copy.deepcopy), or freeze the "
                    "parameter in the student too (requires_grad=False)."
                )
        try:
            teacher = self.teacher
            self._teacher_flags = _freeze(teacher, self)
            self._teacher_took_input = False
            shard(teacher, shard_teacher, trainer)
            self._teacher_sharded = is_sharded(teacher)
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

    @property
    def labels(self) -> dict[str, str]:
        """The teacher side of each pair in messages: its module name (then "/" and its path)."""
        return {pair: teacher_label(t) for pair, t in self.pairs.items()}

    def _make_recorders(
        self, pl_module: pl.LightningModule, detach: bool
    ) -> tuple[RecorderManager, RecorderManager]:
        common: dict[str, Any] = {
            "type": "ModuleOutputs",
            "keep": "first",
            "detach": detach,
            "clone": self.clone,
        }
        student = RecorderManager({p: {**common, "source": p} for p in self.pairs})
        teacher = RecorderManager(
            {p: {**common, **teacher_config(t), "detach": True} for p, t in self.pairs.items()}
        )
        try:
            student.initialize(pl_module)
        except UnknownSourceError as err:
            raise _on_side(err, f"the student ({type(pl_module).__name__})", "keys") from None
        try:
            teacher.initialize(self.teacher)
        except BaseException as err:
            student.release()
            if isinstance(err, UnknownSourceError):
                side = f"the teacher ({type(self.teacher).__name__})"
                raise _on_side(err, side, "values") from None
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
            _thaw(self.teacher, self)
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
        self.mask = None
        for student, teacher in self._recorders.values():
            student.reset_data_buffer()
            teacher.reset_data_buffer()

    def _on_student_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.phase is not None and not self._teacher_ran:
            self.run_teacher(args, kwargs)

    def run_teacher(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, own_input: bool = False
    ) -> None:
        """Run the teacher on ``(args, kwargs)`` without a graph, recording its pairs.

        ``own_input``: the input comes from ``teacher_input`` (else from the student's forward).
        """
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
        except RecorderError:
            raise
        except Exception as err:
            if self._teacher_took_input or isinstance(err, torch.OutOfMemoryError):
                # the teacher took this kind of input before: its error is its own, as it is
                raise
            name = type(teacher).__name__
            if own_input:
                hint = (
                    f"The teacher ({name}) failed on the input that `teacher_input=` gave it "
                    f"({describe_call(args, kwargs)}): check that it returns what the teacher's "
                    "forward takes."
                )
                if not kwargs and len(args) == 1 and isinstance(args[0], (Mapping, tuple, list)):
                    hint += (
                        f" A {type(args[0]).__name__} returned by `teacher_input` is the "
                        "teacher's one positional argument: to call the teacher with several "
                        "arguments or keyword arguments (such as a Hugging Face model's "
                        "input_ids=..., attention_mask=...), return TeacherInput(*args, **kwargs), "
                        "e.g. TeacherInput(**batch)."
                    )
            else:
                hint = (
                    f"The teacher ({name}) could not take the student's input "
                    f"({describe_call(args, kwargs)}): FeatureDistillation runs the teacher on "
                    "what the student's forward receives. Pass `teacher_input=` (a callable "
                    "batch -> the teacher's input) to give the teacher its own input."
                )
                if not kwargs and len(args) == 1 and isinstance(args[0], Mapping):
                    hint += (
                        " For a dict batch, teacher_input=lambda batch: TeacherInput(**batch) "
                        "calls the teacher with its items as keyword arguments."
                    )
            if self._teacher_sharded:
                hint += (
                    " The teacher is sharded (FSDP2): its forward gathers its parameters from "
                    "every rank, so a rank that does not run the teacher at the same point of "
                    "the step, or a failed collective, also fails here."
                )
            raise RecorderConfigError(
                f"{hint} The teacher raised {type(err).__name__}: {err}"
            ) from err
        finally:
            recorders.stop()
            if len(deliveries):
                deliveries.__exit__(None, None, None)
        self._teacher_ran = self._teacher_took_input = True
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
                "or pass `teacher_input=` to map the batch to the teacher's input. (A student "
                "that torch compiled before this run runs without the callback's hooks: "
                "torch.compile does not recompile for hooks added later. Call "
                "torch.compiler.reset() before fit.)"
            )
        student, teacher = self._recorders[self.phase]
        mask = None if self.mask is None else _token_mask(self.mask)
        masked: list[str] = []  # the pairs the mask applies to
        shapes: list[str] = []  # every pair's shapes, for the error when it applies to none
        terms: dict[str, Tensor] = {}
        self.empty = set()
        for pair, t_name in self.labels.items():
            s = feature(student.get_recorder(pair).get_record_data(), "student", pair)
            t = feature(teacher.get_recorder(pair).get_record_data(), "teacher", t_name)
            if self.phase == "train" and not s.requires_grad and torch.is_grad_enabled():
                self._warn_gradless(pair, t_name)
            connector = self.bank.get(pair, s, t)
            try:
                mapped = connector(s)
            except (RecorderError, torch.OutOfMemoryError):
                raise
            except Exception as err:  # a connector given for other shapes
                built = self._built_for_other_shapes(pair, t_name, s, t)
                if built is not None:
                    raise built from err
                raise RecorderConfigError(
                    f"Expected the connector of pair {pair!r} -> {t_name!r} to take the student "
                    f"feature of shape {shape_of(s)} (to map it to the teacher's {shape_of(t)}) "
                    f"but {connector!r} raised {type(err).__name__}: {err}. Give a connector "
                    "built for these shapes, or leave this pair's connector to 'auto'."
                ) from err
            if mask is not None:
                shapes.append(f"{pair!r} {shape_of(mapped)} -> {t_name!r} {shape_of(t)}")
                tokens = mapped.dim() == 3 and t.dim() == 3  # (N, L, C); not maps (N, C, H, W)
                if tokens and mapped.shape[:2] == t.shape[:2] == mask.shape:
                    masked.append(pair)
                    keep = mask.to(mapped.device)
                    mapped, t = mapped[keep], t[keep]
            if no_samples(mapped) and no_samples(t):  # no real token, or an empty batch
                terms[pair] = zero_loss(mapped) * self.weights[pair]  # 0, with a zero gradient
                self.empty.add(pair)  # and not logged at this step
                continue
            loss = self.losses[pair]
            try:
                value = loss(mapped, t)
            except RecorderConfigError as err:  # e.g. the mapped feature is not the teacher's shape
                built = self._built_for_other_shapes(pair, t_name, s, t)
                if built is None:
                    raise
                raise built from err
            if not isinstance(value, Tensor) or value.numel() != 1:
                # a custom loss that forgot `return`, returned `.item()` or did not reduce
                got = (
                    f"a tensor of shape {shape_of(value)}"
                    if isinstance(value, Tensor)
                    else f"{type(value).__name__} {value!r}"
                )
                name = getattr(loss, "__qualname__", None) or repr(loss)
                raise RecorderConfigError(
                    f"Expected the loss of pair {pair!r} -> {t_name!r} ({name}) to return a "
                    f"tensor of one element but got {got}. A loss takes (student, teacher) and "
                    "returns the loss tensor itself: reduce it (`.mean()`), and return it rather "
                    "than `.item()`."
                )
            terms[pair] = value * self.weights[pair]
        if mask is not None and not masked:
            raise RecorderConfigError(
                f"Expected the token mask (`token_mask`) of shape {shape_of(mask)} to be the "
                "leading (N, L) of the student (after its connector) and teacher features of at "
                f"least one pair but got {'; '.join(shapes)}: a mask that applies to no pair is "
                "a mistake. Give the mask of the batch's tokens (such as Hugging Face's "
                "attention_mask), or pair token features (N, L, C)."
            )
        if self.on_nonfinite != "ignore" and self.phase == "train":
            self._flag_nonfinite(terms)
        return terms

    def _warn_gradless(self, pair: str, t_name: str) -> None:
        """Say once per pair that the student's feature has no gradient: its term would train
        the connector only, never the student."""
        if pair in self._gradless:
            return
        self._gradless.add(pair)
        rank_zero_warn(
            f"FeatureDistillation: the student feature of pair {pair!r} -> {t_name!r} does not "
            "require grad, so its term trains the connector only, not the student. A module "
            "inside a block that torch.utils.checkpoint runs with use_reentrant=True (as Hugging "
            "Face's gradient_checkpointing_enable() may) runs its forward without gradients: "
            "pass use_reentrant=False (gradient_checkpointing_kwargs={'use_reentrant': False}) "
            "or pair the checkpointed block itself. A frozen student module (requires_grad="
            "False), with everything before it, has none either: pair a trainable one. "
            "Reported once per pair."
        )

    def _built_for_other_shapes(
        self, pair: str, t_name: str, s: Tensor, t: Tensor
    ) -> RecorderConfigError | None:
        """The error to raise when ``pair``'s connector, restored from a checkpoint or built
        before this fit (an earlier fit or validation of the callback), was built for other
        feature shapes than this run's (another student or teacher); else ``None``."""
        if pair in self.bank.restored:
            where = "restored from the checkpoint,"
            fix = (
                "the student or the teacher is not the one of the run that saved the "
                "checkpoint. Resume with the models of that run, or start a new fit (without "
                "`ckpt_path`) to build a new connector."
            )
        elif pair in self.bank.earlier:
            where = "from an earlier fit or validation of this FeatureDistillation,"
            fix = (
                "the callback keeps its connectors from one fit to the next (to go on training "
                "them), and the student or the teacher is not the one they were built for. Use "
                "a new FeatureDistillation for another student or teacher."
            )
        else:
            return None
        saved_s, saved_t = self.bank.shapes[pair]
        now_s, now_t = list(shape_of(s)[1:]), list(shape_of(t)[1:])
        if (now_s, now_t) == (saved_s, saved_t):
            return None
        return RecorderConfigError(
            f"Expected the features of pair {pair!r} -> {t_name!r} to have the shapes its "
            f"connector, {where} was built for (student {saved_s}, teacher {saved_t}, without "
            f"the batch dimension) but got student {now_s} and teacher {now_t}: {fix}"
        )

    def _flag_nonfinite(self, terms: Mapping[str, Tensor]) -> None:
        """Or this step's non-finite flags into the device-side flags (no host sync): per pair,
        (a non-finite term with non-finite teacher features, a non-finite term). A teacher
        feature that is not finite while the term is (a logit of -inf, a masked class that
        kl_div_loss leaves out) is no fault."""
        teacher = self._recorders["train"][1]
        rows = []
        with torch.no_grad():
            for pair, t_name in self.labels.items():
                t = feature(teacher.get_recorder(pair).get_record_data(), "teacher", t_name)
                bad_term = ~torch.isfinite(terms[pair].detach()).all()
                rows.append(torch.stack([bad_term & ~torch.isfinite(t).all(), bad_term]))
            flags = torch.stack(rows)
        self._nonfinite = flags if self._nonfinite is None else self._nonfinite | flags

    def check_nonfinite(self, step: int, *, wait: bool = False) -> None:
        """Report the pairs whose flags say non-finite, then start new flags at ``step``.

        On the CPU the flags are read at once. On an accelerator reading them would synchronise
        the step, so they are copied to the host asynchronously and read at the next check,
        when the copy has long finished (``wait=True``, at the end of an epoch, waits for it):
        a report arrives one check later, and no training step waits for the device.
        """
        flags, self._nonfinite = self._nonfinite, None
        first, self._nonfinite_step = self._nonfinite_step, step
        if self.on_nonfinite == "ignore":
            return
        ready = self._take_pending(wait)
        if flags is not None and flags.device.type != "cpu":
            pinned = flags.device.type == "cuda"  # an asynchronous copy needs pinned memory
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=pinned)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event() if flags.device.type == "cuda" else None
            if event is not None:
                event.record()
            self._in_flight.append((host, event, first, step))
            if wait:
                ready.extend(self._take_pending(True))
        elif flags is not None:
            ready.append((flags.tolist(), first, step))
        for rows, since, until in ready:
            self._report_nonfinite(rows, since, until)

    def _take_pending(self, wait: bool) -> list[tuple[list[list[bool]], int, int]]:
        """The host rows of the flag copies that have arrived (all of them when ``wait``)."""
        done, kept = [], []
        for host, event, since, until in self._in_flight:
            if event is None or wait or event.query():
                if event is not None and wait:
                    event.synchronize()
                done.append((host.tolist(), since, until))
            else:
                kept.append((host, event, since, until))
        self._in_flight = kept
        return done

    def _report_nonfinite(self, rows: list[list[bool]], first: int, step: int) -> None:
        for (pair, t_name), (bad_teacher, bad_term) in zip(self.labels.items(), rows, strict=True):
            if not (bad_teacher or bad_term) or pair in self._reported:
                continue
            what = "teacher features" if bad_teacher else "distillation term"
            when = f"step {first}" if step - first <= 1 else f"steps {first}-{step - 1}"
            message = (
                f"FeatureDistillation: non-finite values (NaN or inf) in the {what} of pair "
                f"{pair!r} -> {t_name!r} (training {when}); the distillation loss is non-finite."
                + (
                    " Check the teacher (its weights, its input, its precision)."
                    if bad_teacher
                    else " Check the student's features and the loss's options."
                )
            )
            if self.on_nonfinite == "raise":
                raise RecorderStateError(message + " (on_nonfinite='raise')")
            self._reported.add(pair)
            rank_zero_warn(message + " Reported once per pair; on_nonfinite='raise' stops.")

    def log(self, terms: Mapping[str, Tensor], prefix: str, on_step: bool) -> Tensor:
        """Log every term and their sum through the LightningModule; return the sum."""
        items = iter(terms.values())
        total = next(items)
        for value in items:
            total = total + value
        module = self.module
        if module is not None and attached_trainer(module) is not None:
            options: dict[str, Any] = {"on_step": on_step, "on_epoch": not on_step}
            if not on_step:
                options["sync_dist"] = True
            for pair, value in terms.items():
                if pair in self.empty and on_step:
                    continue  # no sample: no value (a 0 would pull the curve down)
                # an epoch's mean (validation) weighs a pair without samples 0, but is logged:
                # every rank then logs the same keys and syncs them alike (sync_dist)
                weight = 0 if pair in self.empty else None  # None: the batch's size
                module.log(f"{prefix}/{pair}", value.detach(), batch_size=weight, **options)
            module.log(f"{prefix}/total", total.detach(), **options)
        return total


def _token_mask(value: Any) -> Tensor:
    """The bool ``(N, L)`` mask that ``token_mask`` gave, checked."""
    if not isinstance(value, Tensor) or value.dim() != 2 or value.is_complex():
        got = (
            f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {shape_of(value)}"
            if isinstance(value, Tensor)
            else f"{type(value).__name__} {value!r}"
        )
        raise RecorderConfigError(
            "Expected the token mask (`token_mask`) to be a (N, L) tensor, bool or 0 and 1 "
            f"(1 for a real token, as Hugging Face's attention_mask), but got {got}. Give "
            "the batch's (N, L) mask, not the (N, L, C) features or a mask per sample."
        )
    if value.dtype == torch.bool:
        return value
    if not bool(((value == 0) | (value == 1)).all()):
        odd = value[(value != 0) & (value != 1)].flatten()[:3].tolist()
        raise RecorderConfigError(
            "Expected the token mask (`token_mask`) to hold 0 and 1 only (1 for a real token, "
            f"as Hugging Face's attention_mask), or to be bool, but got {value.dtype} values "
            f"such as {odd}: a mask keeps or drops a position, it does not weight it. Give a "
            "bool mask (e.g. `weights > 0`)."
        )
    return value.bool()


def describe_call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """A short description of call arguments: types and tensor shapes."""

    def one(value: Any) -> str:
        if isinstance(value, Tensor):
            return f"Tensor{shape_of(value)} {str(value.dtype).removeprefix('torch.')}"
        return type(value).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts) or "no arguments"


def _on_side(err: UnknownSourceError, side: str, part: str) -> UnknownSourceError:
    """``err`` (a name not found) saying which model it was looked up in: the pairs' ``keys``
    name modules of the student, their ``values`` modules of the teacher."""
    return UnknownSourceError(
        f"{err} (looked up in {side}: the {part} of `pairs` name its modules)"
    )
