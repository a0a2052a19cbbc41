"""`RecorderCallback`: a `RecorderManager` on the LightningModule, entered around each step."""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import Self, override

from .._core.checks import check_name, check_positive_int, listing
from .._core.names import named_modules
from .._core.registry import option_names
from ..errors import NoRecordError, NotInitializedError, RecorderConfigError, RecorderStateError
from ..recorders import BaseRecorder, RecorderManager, RecordStream, recorder_types
from ._lightning import (
    STATE_KEY,
    Stage,
    check_one_run,
    check_stages,
    completes_step,
    is_compiled,
    is_due,
    serves,
    step_axis,
)

__all__ = ["RecorderCallback"]


def _listed(names: list[str], one: str, several: str) -> str:
    """``names`` (without repeats, the first five) after ``one`` or ``several``."""
    names = list(dict.fromkeys(names))
    return f"{one if len(names) == 1 else several} {listing([repr(n) for n in names])}"


class RecorderCallback(Callback):
    """Record inside a LightningModule while it trains: the callback form of `RecorderManager`.

    The recorders are built from the same config dicts as
    :class:`~lightning_recorder.RecorderManager` and installed on the (unwrapped) LightningModule
    when its module tree is final: at the start of ``fit`` (after ``configure_model`` and the
    strategy's wrapping, before the first — possibly compiled — step), or at the start of a
    standalone ``validate``, ``test`` or ``predict``. They record only inside a step of a chosen
    stage: from ``on_*_batch_start`` to ``on_*_batch_end``, which covers the forward, the
    backward and the optimizer step. Every hook and patch is removed on ``teardown`` and in
    ``on_exception``.

    **Between recorded steps** the module and gradient hooks are suspended: removed, and
    reinstalled when the next recorded step starts, so that a step that records nothing runs
    the model as it would run without the callback (an idle hook still costs every call of its
    module PyTorch's slow call path). A compiled model keeps its hooks throughout:
    ``torch.compile`` traces them once, and removing them would make it recompile. It also
    keeps them *recording* in every batch of a recorded stage, and drops the records of the
    batches that are not chosen at the batch end: dynamo guards on the hooks' on/off flag, so
    a flag that changed between batches would compile the model a second time. The price is
    the capture (``detach``/``clone``) in those batches. ``keep_hooks`` overrides the choice
    (``True`` keeps and records, ``False`` suspends).

    **Reading records.** Inside ``training_step`` (after the forward), in ``on_*_batch_end`` hooks
    of the module and of callbacks, the records of the current step are readable; one line::

        feat = RecorderCallback.of(self).get_record_data("feat")

    They are freed when the next batch starts (or the loop ends): nothing outlives the step.
    Records are attached to the autograd graph unless the config says ``"detach": True``, so a
    loss may back-propagate through them.

    **Which steps.** Training steps are recorded every ``every_n_steps`` *optimizer* steps: with
    gradient accumulation every micro-batch of a due optimizer step is recorded, each in a fresh
    buffer. Due steps are ``k`` (0-based) with ``(k + 1) % every_n_steps == 0``, the rule of
    ``Trainer(log_every_n_steps=...)``. Every batch of an evaluation stage in ``stages`` is
    recorded; the sanity check never is.

    Args:
        recorders: ``{name: config}``, each config a dict with ``type`` (e.g.
            ``"ModuleOutputs"``), ``source`` (a module name from ``named_modules()``, a glob
            pattern, a module type, a function path …) and recorder options (``detach``,
            ``clone``, ``keep`` …).
        stages: the loops that record: any of ``"train"``, ``"val"``, ``"test"``, ``"predict"``.
        every_n_steps: record every N optimizer steps of training; ``None`` follows the
            Trainer's ``log_every_n_steps`` (0, no training step logged, is an error in ``fit``
            when ``stages`` has ``"train"``). Another value than the default needs ``"train"``
            in ``stages``.
        name: distinguishes two callbacks with the same configuration (checkpoint state key,
            :meth:`of`); not empty or blank.
        keep_hooks: keep the hooks installed between recorded steps (``True``), or suspend them
            (``False``). ``None`` (default) keeps them when the LightningModule is compiled
            (passed to ``fit`` as ``torch.compile(model)``, or holding a compiled submodule);
            pass ``True`` when a function compiled with ``torch.compile`` calls the recorded
            modules.

    Raises:
        RecorderConfigError: a config, a stage or ``every_n_steps`` is invalid, or
            ``every_n_steps`` is given without ``"train"`` in ``stages`` (at construction);
            a source is not in the model (``UnknownSourceError``, at the start of the run, naming
            the closest names).
        UnknownRecorderTypeError: a config's ``type`` names no recorder type.

    Examples:
        >>> import lightning.pytorch as pl
        >>> import torch
        >>> from torch import nn
        >>> class Net(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body = nn.Linear(4, 8)
        ...         self.head = nn.Linear(8, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         loss = self.head(self.body(batch[0])).square().mean()
        ...         feat = RecorderCallback.of(self).get_record_data("feat")
        ...         return loss + 1e-3 * feat.square().mean()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)))
        >>> callback = RecorderCallback({"feat": {"type": "ModuleOutputs", "source": "body"}})
        >>> trainer = pl.Trainer(max_steps=2, callbacks=[callback], logger=False,
        ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(Net(), data)
        >>> callback.recorded_steps
        2
    """

    def __init__(
        self,
        recorders: dict[str, dict[str, Any]],
        stages: Stage | Sequence[Stage] = ("train", "val"),
        every_n_steps: int | None = 1,
        name: str | None = None,
        keep_hooks: bool | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if not isinstance(recorders, Mapping) or not recorders:
            raise RecorderConfigError(
                f"Expected `recorders` of {owner} to be a non-empty dict of config dicts such as "
                f"{{'feat': {{'type': 'ModuleOutputs', 'source': 'layer1'}}}} but got "
                f"{recorders!r}."
            )
        for key, config in recorders.items():
            if not isinstance(config, Mapping):
                raise RecorderConfigError(
                    f"Expected `recorders[{key!r}]` of {owner} to be a config dict such as "
                    f"{{'type': 'ModuleOutputs', 'source': 'layer1'}} but got "
                    f"{type(config).__name__}."
                )
        RecorderManager(recorders)  # validate types and options now; rebuilt for each run
        check_positive_int(every_n_steps, "every_n_steps", owner, allow_none=True)
        check_name(name, owner)
        if keep_hooks is not None and not isinstance(keep_hooks, bool):
            raise RecorderConfigError(
                f"Expected `keep_hooks` of {owner} to be True, False or None but got "
                f"{keep_hooks!r}."
            )
        self._configs: dict[str, dict[str, Any]] = {
            k: copy.deepcopy(dict(v)) for k, v in recorders.items()
        }
        self.stages: tuple[Stage, ...] = check_stages(stages, owner)
        if not self.stages:
            raise RecorderConfigError(
                f"Expected `stages` of {owner} to hold at least one of 'train', 'val', 'test', "
                f"'predict' but got {stages!r}: with no stage, nothing would be recorded."
            )
        if (
            "train" not in self.stages
            and every_n_steps is not None
            and not _default_every(type(self), every_n_steps)
        ):
            raise RecorderConfigError(
                f"Expected `every_n_steps` of {owner} to be left out without 'train' in "
                f"`stages` (it chooses the training steps that record; every batch of an "
                f"evaluation stage is recorded) but got {every_n_steps!r} with "
                f"stages={list(self.stages)!r}, where it would be ignored; add 'train' to "
                "`stages`, or leave every_n_steps out."
            )
        self.every_n_steps: int | None = every_n_steps
        self.name = name
        self.keep_hooks = keep_hooks
        #: Optimizer steps recorded so far (kept across checkpoint and resume).
        self.recorded_steps = 0
        self._every = every_n_steps or 1
        self._manager: RecorderManager | None = None
        self._active: Stage | None = None  # the stage recording the current batch
        self._holding = False  # records of a finished batch are still readable
        self._suspend_idle = False  # suspend the hooks between recorded batches (this run)
        self._suspended = False  # the hooks are suspended now
        self._record_idle = False  # record unchosen batches too, and drop them (compiled)
        self._compiled_checked = False  # the first chosen batch of a compiled model was checked
        self._idle = False  # the current batch records only to keep the flag on
        #: ``(batch, batch_idx, dataloader_idx)`` of a recorded batch while its records are
        #: handed over (``_after_batch``, for subclasses); ``(None, 0, 0)`` otherwise.
        self._batch: tuple[Any, int, int] = (None, 0, 0)
        self._module: pl.LightningModule | None = None  # the module the recorders are on
        self._thread = ""  # the name of the thread whose run installed them
        self._called: set[tuple[str, str]] = set()  # (recorder, stream) recorded in training
        self._silent: set[tuple[str, str]] = set()  # (recorder, stream) already reported
        self._train_step = 0  # the optimizer step of the current training batch
        self._loader = 0  # the dataloader index of the current evaluation batch

    # ------------------------------------------------------------------ public API
    state_key = STATE_KEY  # made once by _make_state_key, then an instance attribute

    def _make_state_key(self) -> str:
        if self.name is not None:
            return self._generate_state_key(name=self.name)
        # what each recorder records: its type, source and path (two callbacks that record
        # the inputs and the outputs of one module under one name are not the same)
        recorded = {
            k: repr((v.get("type"), v.get("source"), v.get("path")))
            for k, v in self._configs.items()
        }
        return self._generate_state_key(
            recorders=recorded, stages=self.stages, every_n_steps=self.every_n_steps
        )

    @classmethod
    def of(cls, where: pl.Trainer | pl.LightningModule, name: str | None = None) -> Self:
        """The callback of this class attached to a trainer (or to a module's trainer).

        Args:
            where: the ``Trainer``, or a LightningModule attached to one (``self`` inside
                ``training_step``).
            name: the ``name`` given to the callback, when several of this class are attached.

        Raises:
            RecorderConfigError: ``where`` is neither a Trainer nor a LightningModule.
            RecorderStateError: none, or more than one, matches, or the module is not attached
                to a Trainer.
        """
        if not isinstance(where, (pl.Trainer, pl.LightningModule)):
            raise RecorderConfigError(
                f"Expected `where` of {cls.__name__}.of to be a Trainer or a LightningModule "
                f"(`self` inside `training_step`) but got {type(where).__name__}."
            )
        if isinstance(where, pl.Trainer):
            trainer = where
        else:
            try:
                trainer = where.trainer
            except RuntimeError:  # Lightning's: the module is not attached to a Trainer
                raise RecorderStateError(
                    f"Expected the {type(where).__name__} given to {cls.__name__}.of to be "
                    "attached to a Trainer but it is not (a step called outside `fit`, "
                    "`validate`, `test` or `predict`): call it from a step the Trainer runs, or "
                    "pass the Trainer."
                ) from None
        found = [cb for cb in trainer.callbacks if isinstance(cb, cls)]  # type: ignore[attr-defined]
        if name is not None:
            found = [cb for cb in found if cb.name == name]
        exact = [cb for cb in found if type(cb) is cls]
        if len(found) > 1 and len(exact) == 1:
            found = exact
        which = cls.__name__ + ("" if name is None else f" named {name!r}")
        if not found:
            raise RecorderStateError(
                f"Expected a {which} among the trainer's callbacks but found none: pass it in "
                "`Trainer(callbacks=[...])`. (Lightning's Tuner, `lr_find` and "
                "`scale_batch_size`, runs its trial steps without the Trainer's callbacks: a "
                "step that may run there skips its use of the callback when this "
                "RecorderStateError is raised.)"
            )
        if len(found) > 1:
            raise RecorderStateError(
                f"Expected one {which} among the trainer's callbacks but found {len(found)}: give "
                "each a `name` and pass it to `of(..., name=...)`."
            )
        return found[0]

    @property
    def manager(self) -> RecorderManager:
        """The :class:`~lightning_recorder.RecorderManager` of the current run.

        Raises:
            NotInitializedError: outside a run (before ``fit``/``validate``/… or after it ended).
        """
        if self._manager is None:
            raise NotInitializedError(
                f"{self!r} has no recorders outside a run: they are installed when fit, validate, "
                "test or predict starts, and removed when it ends."
            )
        return self._manager

    @property
    def recording(self) -> bool:
        """Whether the current batch is recorded: its records are readable until the next batch."""
        return self._active is not None or self._holding

    def get_recorder(self, name: str) -> BaseRecorder:
        """The recorder named ``name`` (see :attr:`manager`)."""
        return self.manager.get_recorder(name)

    def get_record_data(
        self,
        name: str,
        record_idx: int = 0,
        data_idx: int | str | None = None,
        *,
        source: str | None = None,
    ) -> Any:
        """One record of the recorder ``name`` in the current step.

        Args:
            name: the recorder's key in ``recorders``.
            record_idx: which call (``0`` the first, ``-1`` the latest).
            data_idx: an index (or argument name) into a tuple, list or arguments record.
            source: the module name to read when the recorder's source is a pattern or type.

        Raises:
            NotInitializedError: outside a run.
            NoRecordError: this step is not recorded (see :attr:`recording`), or the source was
                not called in it.
        """
        recorder = self.manager.get_recorder(name)
        if self._active is None and not self._holding:
            raise NoRecordError(
                f"{self!r} records nothing in this step: it records the stages "
                f"{', '.join(self.stages)}, training every {self._every} optimizer step(s), "
                "never the sanity check. Check `.recording` before reading."
            )
        return recorder.get_record_data(record_idx, data_idx, source=source)

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # before anything of a run still holding the callback changes
        check_one_run(repr(self), self._module, pl_module, self._thread)
        every = self.every_n_steps or getattr(trainer, "log_every_n_steps", None)
        # Lightning then logs no training step (a loop without training has nothing to follow)
        if every == 0 and "train" in self.stages and stage == "fit":
            why = "Lightning logs no training step then"
            if getattr(trainer, "barebones", False):
                why = "set by barebones=True, which logs nothing"
            raise RecorderConfigError(
                f"Expected the Trainer's `log_every_n_steps`, which {self!r} follows for "
                f"training steps (every_n_steps=None), to be positive but got 0 ({why}). Pass "
                "every_n_steps=N, or leave 'train' out of `stages`."
            )
        self._every = every if isinstance(every, int) and every > 0 else 1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if serves(self._module, pl_module):  # not the recorders of another run still going
            self._detach()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if serves(self._module, pl_module):
            self._detach()

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._manager is not None:
            check_one_run(repr(self), self._module, pl_module, self._thread)
            return
        keep = is_compiled(pl_module) if self.keep_hooks is None else self.keep_hooks
        configs = self._configs_for(pl_module)
        if keep:  # patches of functions and methods stay in place too, so nothing recompiles
            configs = {name: _persistent(config) for name, config in configs.items()}
        manager = RecorderManager(configs)
        manager.initialize(pl_module)  # releases what it installed if a source is missing
        self._manager = manager
        self._module = pl_module
        self._thread = threading.current_thread().name
        self._called, self._silent = set(), set()
        self._suspend_idle = not keep
        # Compiled: the recorders stay on in every batch (records of unchosen batches are
        # dropped at the batch end), so the hooks' on/off flag that dynamo guards on never
        # changes and the model compiles once.
        self._record_idle = keep
        self._compiled_checked = False
        try:
            self._on_attach(trainer, pl_module)
        except BaseException:
            self._detach()
            raise
        if self._suspend_idle:  # nothing records until a chosen batch starts (not the sanity check)
            manager.suspend()
            self._suspended = True

    def _detach(self) -> None:
        manager, self._manager = self._manager, None
        self._module = None
        self._active, self._holding, self._idle = None, False, False
        self._suspended = False
        if manager is not None:
            manager.stop()
            manager.reset_data_buffer()
            manager.release()
        self._on_detach()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Record nothing inside; the batch's records so far stay, and recording goes on after.

        For a forward pass inside the step that is not the step's own: ``HealthMonitor``
        replays a flagged step inside it, so that the step's statistics count its calls once.
        """
        manager = self._manager
        return contextlib.nullcontext() if manager is None else manager.paused()

    def _configs_for(self, pl_module: pl.LightningModule) -> dict[str, dict[str, Any]]:
        """The configs of the recorders to install on ``pl_module``: all of them (a subclass
        may leave some out)."""
        return self._configs

    def _on_attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Called once the recorders are installed (subclasses prepare here)."""

    def _on_detach(self) -> None:
        """Called when the recorders are removed (subclasses drop their state here)."""

    def _after_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: Stage, completes: bool
    ) -> None:
        """Called at the end of each recorded batch; ``completes`` if an optimizer step ended."""

    # ------------------------------------------------------------------ per batch
    def _free(self) -> None:
        """Stop recording and free the records of the previous batch (idempotent, cheap)."""
        if self._active is not None or self._holding or self._idle:
            manager = self._manager
            if manager is not None:
                manager.stop()
                manager.reset_data_buffer()
            self._active, self._holding, self._idle = None, False, False

    def _batch_start(self, stage: Stage, records: bool) -> None:
        """Free the last batch's records; record this one, or suspend the hooks if it is not."""
        self._free()
        manager = self._manager
        if manager is None:
            return
        if records:
            manager.start()  # reinstalls suspended hooks
            self._active, self._suspended = stage, False
        elif self._record_idle:
            manager.start()  # compiled: the same flag value in every batch (dropped at its end)
            self._idle, self._suspended = True, False
        elif self._suspend_idle and not self._suspended:  # not once per recorder every batch
            manager.suspend()
            self._suspended = True

    def _batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        stage: Stage,
        completes: bool,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """End a batch of any stage: an unchosen batch recorded only to keep the hooks' flag on
        (compiled models) is dropped; a chosen one is handed to :meth:`_after_batch`, with the
        batch in ``self._batch`` meanwhile (not kept after it: the memory of an unchosen batch
        is the data loader's to reuse)."""
        if self._idle:
            self._free()
        if self._active != stage or self._manager is None:
            return
        self._manager.stop()
        self._active, self._holding = None, True
        self._check_compiled_hooks(stage)
        if stage == "train":
            self._report_silent_modules()
            if completes:
                self.recorded_steps += 1
        self._batch = (batch, batch_idx, dataloader_idx)
        try:
            self._after_batch(trainer, pl_module, stage, completes)
        finally:
            self._batch = (None, 0, 0)

    def _check_compiled_hooks(self, stage: Stage) -> None:
        """Warn once when the first chosen batch of a compiled model recorded nothing from any
        module the recorders hook: torch then runs code it compiled before the hooks existed."""
        if self._compiled_checked or not self._record_idle:
            return
        streams = [stream for _, _, _, stream in self._hooked_streams()]
        if not streams:
            return
        self._compiled_checked = True
        if any(stream.num_calls for stream in streams):
            return
        rank_zero_warn(
            f"{self!r} recorded nothing in its first {stage} batch from any of the modules it "
            "hooks, and the model is compiled. If those modules ran, torch is running code it "
            "compiled before the hooks were installed: torch.compile does not recompile when "
            "hooks are added later (the model, or another of its class, was compiled and run "
            "earlier in this process, as in a first fit in a notebook, or in the trial steps "
            "of Lightning's Tuner, `lr_find` and `scale_batch_size`, which run without the "
            "Trainer's callbacks). Call torch.compiler.reset() before this run, so that the "
            "model compiles with the hooks."
        )

    def _report_silent_modules(self) -> None:
        """Warn once per module that recorded in earlier training steps and not in this one,
        in one warning per step for all of them (a mixture of experts leaves many out).

        The usual cause is a module replaced in the model after the recorders were installed
        (``model.body[0] = nn.Linear(...)``): the hooks stay on the old object.
        """
        module = self._module
        if module is None:
            return
        current: dict[str, Any] | None = None
        replaced: list[tuple[str, str]] = []  # (recorder, module) of this step
        stopped: list[tuple[str, str]] = []
        for rec_name, hooked, name, stream in self._hooked_streams():
            key = (rec_name, name)
            if stream.num_calls:
                self._called.add(key)
                continue
            if key in self._silent:
                continue
            if current is None:
                current = named_modules(module)
            was_replaced = name in hooked and current.get(name) is not hooked[name]
            self._silent.add(key)  # checked once: the walk above is not repeated
            if was_replaced:
                replaced.append(key)
            elif key in self._called:  # one never called so far (unused in training): no news
                stopped.append(key)
        for found, why in (
            (
                replaced,
                "{modules} replaced in the model (or removed) after the recorders were "
                "installed at the start of the run, and the hooks are on the old module. Replace "
                "modules before fit, or in configure_model",
            ),
            (
                stopped,
                "{modules} recorded in earlier training steps but not called in this one (a "
                "branch not taken, an expert of a mixture not routed to, or a module the forward "
                "no longer uses)",
            ),
        ):
            if found:
                recorders = _listed([rec for rec, _ in found], "recorder", "recorders")
                modules = _listed([name for _, name in found], "the module", "the modules")
                verb = "was" if modules.startswith("the module ") else "were"
                rank_zero_warn(
                    f"{self!r}: {recorders} recorded nothing in training step "
                    f"{self._train_step}: {why.format(modules=f'{modules} {verb}')}. Each "
                    "module is reported once."
                )

    def _hooked_streams(self) -> Iterator[tuple[str, dict[str, nn.Module], str, RecordStream]]:
        """``(recorder name, its hooked modules, stream name, stream)`` of every stream of the
        recorders that hook modules (none without a manager)."""
        manager = self._manager
        if manager is None:
            return
        for rec_name, recorder in manager.recorders.items():
            hooked = getattr(recorder, "hooked_modules", None)
            if hooked:
                for name, stream in recorder.streams.items():
                    yield rec_name, hooked, name, stream

    def _records_eval(self, trainer: pl.Trainer, stage: Stage) -> bool:
        return stage in self.stages and not trainer.sanity_checking

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._train_step = step = step_axis(trainer)
        self._batch_start("train", "train" in self.stages and is_due(step, self._every))

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        completes = self._active == "train" and completes_step(trainer)
        self._batch_end(trainer, pl_module, "train", completes, batch, batch_idx)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._free()

    def _eval_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, pl_module)  # a standalone run: nothing installed yet
        self._free()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, pl_module)

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._loader = dataloader_idx
        self._batch_start("val", self._records_eval(trainer, "val"))

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end(trainer, pl_module, "val", True, batch, batch_idx, dataloader_idx)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._free()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, pl_module)

    @override
    def on_test_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._loader = dataloader_idx
        self._batch_start("test", self._records_eval(trainer, "test"))

    @override
    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end(trainer, pl_module, "test", True, batch, batch_idx, dataloader_idx)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._free()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, pl_module)

    @override
    def on_predict_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._loader = dataloader_idx
        self._batch_start("predict", self._records_eval(trainer, "predict"))

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end(trainer, pl_module, "predict", True, batch, batch_idx, dataloader_idx)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._free()

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"recorded_steps": self.recorded_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.recorded_steps = int(state_dict.get("recorded_steps", self.recorded_steps))

    def __repr__(self) -> str:
        names = ", ".join(self._configs)
        extra = "" if self.name is None else f", name={self.name!r}"
        return f"{type(self).__name__}({names}{extra})"


def _default_every(cls: type, every_n_steps: int) -> bool:
    """Whether ``every_n_steps`` is the default of that option in the signature of ``cls``, the
    class a user constructs; also when ``cls`` does not take the option (a subclass that sets it
    for its users: nothing of theirs to refuse)."""
    parameter = inspect.signature(cls).parameters.get("every_n_steps")
    return parameter is None or every_n_steps == parameter.default


def _persistent(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``persistent=True`` when it builds a function or method recorder that
    does not say otherwise: its patch then stays from ``initialize`` to ``release``."""
    kind = config.get("type")
    cls = recorder_types().get(kind) if isinstance(kind, str) else None
    if cls is None or "persistent" in config or "persistent" not in option_names(cls):
        return config
    return {**config, "persistent": True}
