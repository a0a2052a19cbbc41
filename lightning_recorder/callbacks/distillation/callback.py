"""`FeatureDistillation`: distil a frozen teacher into the student with one callback.

The callback records the paired modules of both networks, runs the teacher on the inputs of the
student's forward (without a graph, in eval mode), maps the student features to the teacher's
shape with learned connectors, and adds ``weight * loss`` to the loss the student's
``training_step`` returns — the user's ``training_step`` and ``configure_optimizers`` stay as
they are. See the distillation guide in the docs for the YAML form.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from ..._core.checks import check_name
from ..._core.names import import_object
from ...distill import ConnectorSpec, DistillDelivery, DistillDeliveryManager
from ...distill.connectors import check_connector_spec
from ...errors import RecorderConfigError, RecorderStateError
from .._batch import BatchPart, batch_part, read_batch_part
from .._lightning import STATE_KEY, attached_trainer, check_one_run, serves, unclaimed_state
from ._bank import ConnectorBank
from ._config import (
    LossSpec,
    TeacherSide,
    add_term,
    check_arguments,
    connector_role,
    load_teacher,
    losses_per_pair,
    per_pair,
    teacher_label,
    weights_per_pair,
)
from ._patch import StepPatch
from ._shard import ShardTeacher, check_shard_teacher
from ._step import StepRunner, describe_call

__all__ = ["FeatureDistillation", "LossSpec", "TeacherInput", "distillation_loss"]


class TeacherInput:
    """The arguments of the teacher's call, positional and keyword, for ``teacher_input``.

    Return one from ``teacher_input`` to call the teacher with several arguments or with keyword
    arguments, as Hugging Face models take a batch's ``input_ids`` and ``attention_mask``;
    anything else ``teacher_input`` returns is the teacher's one positional argument.

    Examples:
        >>> import torch
        >>> batch = {"input_ids": torch.ones(2, 5), "attention_mask": torch.ones(2, 5)}
        >>> call = TeacherInput(batch["input_ids"], attention_mask=batch["attention_mask"])
        >>> len(call.args), sorted(call.kwargs)
        (1, ['attention_mask'])
        >>> TeacherInput(**batch).args
        ()
    """

    __slots__ = ("args", "kwargs")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"TeacherInput({describe_call(self.args, self.kwargs)})"


def teacher_call(value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The teacher's ``(args, kwargs)`` for what ``teacher_input`` returned: the arguments of a
    :class:`TeacherInput`, else the value as the one positional argument."""
    if isinstance(value, TeacherInput):
        return value.args, dict(value.kwargs)
    return (value,), {}


class FeatureDistillation(Callback):
    """Distil a frozen teacher into the LightningModule being trained (FitNets, AT, KD …).

    For each pair ``student module -> teacher module``, the term ``weight * loss(connector(s),
    t)`` of the two modules' outputs (their first call in the step) is added to the loss that
    ``training_step`` returns, and logged as ``"<log_prefix>/<student module>"``; the sum is
    logged as ``"<log_prefix>/total"``. The teacher is moved to the student's device, kept in
    eval mode with gradients off, never becomes part of the student (so never enters its
    checkpoint) and runs without building a graph.

    By default the teacher receives exactly what the student's forward receives: when
    ``training_step`` calls ``self(x)``, the teacher runs on ``x`` just before the student does.
    ``teacher_input`` maps the batch to the teacher's input instead.

    Connectors (learned adapters for features whose channels differ) are built at the first
    step, trained by the optimizer from ``configure_optimizers`` in one extra parameter group,
    saved in the callback's checkpoint state and restored on resume; under DDP they start equal
    and their gradients are averaged over the ranks.

    Args:
        teacher: the trained teacher network.
        pairs: ``{student module name: teacher module name}``. A teacher side may be a dict
            ``{"source": teacher module name, "path": path}`` to pair one tensor of a
            structured output (a tuple index, a ``ModelOutput`` field such as
            ``"last_hidden_state"``, or a dotted chain such as ``"hidden_states.2"``, as the
            ``path`` of :class:`~lightning_recorder.RecorderCallback`).
        loss: a loss for every pair, or ``{student module name: loss}``: a name (``"mse"``,
            ``"l1"``, ``"cosine"``, ``"attention"``, ``"kl"``), an ``nn.Module`` or a callable
            taking ``(student, teacher)``, or the import path of a loss class or function (as a
            YAML config gives it: ``"my_project.losses.feature_loss"``; see
            :func:`lightning_recorder.get_loss`).
        weight: the weight of every term, or ``{student module name: weight}``.
        loss_options: keyword options for the named losses, e.g. ``{"temperature": 4.0}``,
            or per pair: ``{student module name: {option: value}}``. Loss modules and
            callables are used as they are: one mapping when no pair's loss is named is an error.
        connectors: ``"auto"`` (a 1x1 convolution or linear layer where channels differ;
            nothing learned for an attention transfer pair, whose channels may differ, and
            none for KL logits of different class counts, an error: give such a pair its own),
            ``"identity"``, a module or a factory (also by its import path, as a YAML config
            gives it: ``"my_project.distill.connector"``); one for all pairs or a mapping per
            pair (see :func:`lightning_recorder.resolve_connector`).
        resize: let automatic connectors resize student maps to the teacher's ``(H, W)``.
        clone: record copies of the paired outputs (the student's keep their graph), for a
            module whose output a later in-place operation changes (a convolution or a
            ``BatchNorm2d`` followed by ``ReLU(inplace=True)``, a ResNet block's ``out +=
            identity``); without it such a pair fails with a ``RecordModifiedError``.
        connector_lr: learning rate of the connectors (default: that of the first group).
        optimizer_idx: the optimizer (in ``trainer.optimizers``) that trains the connectors.
        teacher_input: ``batch -> input``; the teacher is called as ``teacher(input)``, or,
            for a :class:`~lightning_recorder.TeacherInput` ``(*args, **kwargs)``, as
            ``teacher(*args, **kwargs)`` (e.g. ``lambda batch: TeacherInput(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])``).
        token_mask: the positions that count in token features, for language models whose
            batches are padded: a key or position of the batch holding a ``(N, L)`` mask (bool,
            or 0 and 1 as Hugging Face's ``attention_mask``: 1 for a real token), or a function
            ``(batch) -> mask`` or ``(batch, batch_idx) -> mask`` (or its import path, as a YAML
            config gives it), as ``sample_index`` of :class:`~lightning_recorder.ActivationWriter`.
            A pair whose student (after its connector) and teacher features are tokens
            ``(N, L, C)`` with the mask's ``(N, L)`` has its loss computed on the kept positions
            only, ``x[mask]`` of shape ``(M, C)`` (so ``"kl"`` averages over the real tokens, and a
            batch without any gives the pair ``0``); the other pairs (pooled ``(N, C)``
            features, maps) are left as they are. Validation (``log_validation``) uses it too.
        teacher_checkpoint: a file with the teacher's state dict (or a Lightning checkpoint
            of it), loaded with ``strict=True`` — handy in YAML configs. A tied weight may be
            there under one of its names only, as Hugging Face's ``save_pretrained`` writes it.
        add_to_loss: add the term to ``training_step``'s loss. With ``False``, add it yourself:
            ``loss = loss + distillation_loss(self)`` (needed for manual optimization).
        log_validation: also run the teacher on validation batches and log the terms as
            ``"val/<log_prefix>/…"`` (epoch means). Off by default: validation never runs it.
        deliveries: ``{name: {"type": "FunctionOutputs" | "MethodOutputs", "source": …,
            "max_keep_data": …}}`` or ``{name: DistillDelivery}``: outputs recorded in the
            teacher's pass are replayed in the student's (see
            :class:`lightning_recorder.DistillDeliveryManager`).
        log_prefix: the prefix of the logged names.
        name: distinguishes two callbacks with the same ``pairs`` and ``log_prefix``
            (checkpoint state): with a name, the callback's state is saved and restored under
            it alone, so that a run resumed with another ``log_prefix`` finds it; not empty or
            blank. ``None`` (the default) keeps the state under ``pairs`` and ``log_prefix``.
        on_nonfinite: what a non-finite (NaN or inf) distillation term does in training (the
            message says whether the teacher's features were non-finite too; a teacher feature
            that is not finite while the term is, a masked class's ``-inf`` logit, is no fault):
            ``"warn"`` (default) warns once per pair, naming it; ``"raise"`` stops the run with
            a :class:`~lightning_recorder.errors.RecorderStateError`; ``"ignore"`` checks
            nothing. The check costs no host sync on a step that Lightning
            does not log: the flags stay on the device and are read every
            ``log_every_n_steps`` steps (when Lightning reads logged values anyway) and at the
            end of each epoch; on the CPU they are read after every step. So on an accelerator
            the warning or error may come up to ``log_every_n_steps - 1`` steps after the step
            that produced the non-finite value (the message gives the range of steps).
        shard_teacher: shard the teacher with FSDP2 when fitting starts, for a teacher too
            large for one device (Lightning's ``ModelParallelStrategy`` only): ``True`` applies
            ``fully_shard`` over the mesh's data-parallel dimension to every teacher submodule
            that holds parameters of its own, then to the teacher; a callable
            ``(teacher, mesh) -> None`` applies a policy of your own. A teacher already sharded
            (for instance by you, with ``fully_shard``) is used as it is. The sharded teacher
            still runs without a graph and stays out of the checkpoint.

    Raises:
        RecorderConfigError: an argument is invalid (checked here), or, when fitting, a module
            name is unknown, shapes cannot be connected (or are KL logits of different class
            counts with ``connectors="auto"``), the teacher is the student, a submodule
            of it, or shares a trainable parameter with it (freezing the teacher would freeze
            it in the student), the teacher cannot take the student's input at its
            first call (pass ``teacher_input=``; a later error of the teacher is raised as it
            is), ``shard_teacher`` is set without a strategy that has a device
            mesh, or the teacher is sharded but no process group is running; at a step,
            ``token_mask`` gives no ``(N, L)`` mask of 0 and 1 (or bool), or one that fits no
            pair's features.
        RecorderStateError: with ``on_nonfinite="raise"``, a non-finite distillation term.

    Examples:
        >>> import lightning.pytorch as pl, torch
        >>> from torch import nn
        >>> class Student(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body = nn.Linear(4, 8)
        ...         self.head = nn.Linear(8, 2)
        ...     def forward(self, x):
        ...         return self.head(self.body(x).relu())
        ...     def training_step(self, batch, batch_idx):
        ...         x, y = batch
        ...         return nn.functional.cross_entropy(self(x), y)
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> teacher = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
        >>> distill = FeatureDistillation(teacher, {"body": "0", "head": "2"},
        ...                               loss={"body": "mse", "head": "kl"})
        >>> data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
        >>> trainer = pl.Trainer(max_steps=2, callbacks=[distill], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False)
        >>> trainer.fit(Student(), torch.utils.data.DataLoader(data, batch_size=8))
        >>> sorted(k for k in trainer.logged_metrics if k.startswith("distill/"))
        ['distill/body', 'distill/head', 'distill/total']
    """

    def __init__(
        self,
        teacher: nn.Module,
        pairs: Mapping[str, TeacherSide],
        loss: Mapping[str, LossSpec] | LossSpec = "mse",
        weight: Mapping[str, float] | float = 1.0,
        *,
        loss_options: Mapping[str, Any] | None = None,
        # a string first: LightningCLI (jsonargparse) keeps an import path for the callback to
        # import (it takes a function annotated to return a module for a class, and fails)
        connectors: Mapping[str, str | ConnectorSpec] | str | ConnectorSpec = "auto",
        resize: bool = False,
        clone: bool = False,
        connector_lr: float | None = None,
        optimizer_idx: int = 0,
        teacher_input: Callable[[Any], Any] | None = None,
        token_mask: BatchPart = None,
        teacher_checkpoint: str | os.PathLike[str] | None = None,
        add_to_loss: bool = True,
        log_validation: bool = False,
        deliveries: Mapping[str, DistillDelivery | Mapping[str, Any]] | None = None,
        log_prefix: str = "distill",
        on_nonfinite: Literal["warn", "raise", "ignore"] = "warn",
        shard_teacher: ShardTeacher = False,
        name: str | None = None,
    ) -> None:
        super().__init__()
        check_arguments(
            teacher,
            pairs,
            {
                "resize": resize,
                "clone": clone,
                "add_to_loss": add_to_loss,
                "log_validation": log_validation,
            },
            teacher_input,
            optimizer_idx,
            connector_lr,
            log_prefix,
            teacher_checkpoint,
            loss_options,
        )
        if on_nonfinite not in ("warn", "raise", "ignore"):
            raise RecorderConfigError(
                "Expected `on_nonfinite` to be one of 'warn', 'raise', 'ignore' but got "
                f"{on_nonfinite!r}."
            )
        check_shard_teacher(shard_teacher)
        check_name(name, type(self).__name__)
        if deliveries is not None and not isinstance(deliveries, Mapping):
            raise RecorderConfigError(
                "Expected `deliveries` to be a mapping {name: config} or None but got "
                f"{type(deliveries).__name__} {deliveries!r}."
            )
        self.teacher = teacher
        self.pairs = dict(pairs)
        self.add_to_loss = add_to_loss
        self.log_validation = log_validation
        self.teacher_input = teacher_input
        self.token_mask = batch_part(token_mask, type(self).__name__, "token_mask", "mask")
        self.optimizer_idx = optimizer_idx
        self.log_prefix = log_prefix
        self.name = name
        self.shard_teacher = shard_teacher
        losses = losses_per_pair(loss, loss_options, self.pairs)
        connector_specs = per_pair(connectors, self.pairs, "connectors", "auto")
        for pair, spec in connector_specs.items():
            if isinstance(spec, str) and "." in spec:  # an import path, as YAML gives a factory
                what = (
                    "a connector factory (student_shape, teacher_shape) -> module, or a module "
                    "class taking the two shapes,"
                )
                spec = connector_specs[pair] = import_object(spec, what, "callables", callable)
            check_connector_spec(spec, "connectors")
        roles = {pair: connector_role(fn) for pair, fn in losses.items()}
        labels = {pair: teacher_label(t) for pair, t in self.pairs.items()}
        self._bank = ConnectorBank(connector_specs, resize, connector_lr, roles, labels)
        self._runner = StepRunner(
            teacher,
            self.pairs,
            losses,
            weights_per_pair(weight, self.pairs),
            self._bank,
            DistillDeliveryManager(deliveries),
            on_nonfinite,
            clone,
        )
        if teacher_checkpoint is not None:
            load_teacher(teacher, teacher_checkpoint)
        self._patch: StepPatch | None = None
        self._thread = ""  # the name of the thread whose run installed it

    state_key = STATE_KEY  # made once by _make_state_key, then an instance attribute

    def _make_state_key(self) -> str:
        if self.name is not None:
            return self._generate_state_key(name=self.name)
        return self._generate_state_key(pairs=self.pairs, log_prefix=self.log_prefix)

    @property
    def connectors(self) -> Mapping[str, nn.Module]:
        """The connector of each pair built so far (by student module name)."""
        return dict(self._bank.modules)

    def _uninstall(self) -> None:
        self._bank.unhide()
        if self._patch is not None:
            self._patch.remove()
            self._patch = None
        self._runner.uninstall()

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_one_run(repr(self), self._runner.module, pl_module, self._thread)
        same = [
            cb
            for cb in trainer.callbacks  # type: ignore[attr-defined]
            if isinstance(cb, FeatureDistillation)
            and cb is not self
            and cb.log_prefix == self.log_prefix
        ]
        if same:
            raise RecorderConfigError(
                f"Expected each FeatureDistillation of a Trainer to have its own `log_prefix`, "
                f"but {self!r} and {same[0]!r} both have {self.log_prefix!r}: both would log "
                f"'{self.log_prefix}/total', and the second would overwrite the first. Give one "
                f"of them another `log_prefix` (e.g. '{self.log_prefix}_2')."
            )
        if stage == "fit" and self.add_to_loss and not pl_module.automatic_optimization:
            raise RecorderConfigError(
                "Expected `add_to_loss=False` with manual optimization (automatic_optimization is "
                "False): the loss training_step returns is not back-propagated by Lightning. Add "
                "`distillation_loss(self)` to the loss you pass to `manual_backward`."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._runner.install(
            trainer, pl_module, validation=self.log_validation, shard_teacher=self.shard_teacher
        )
        self._thread = threading.current_thread().name
        if self._patch is None:
            self._patch = StepPatch(self, pl_module)
        optimizers = trainer.optimizers
        if optimizers and self.optimizer_idx >= len(optimizers):
            raise RecorderConfigError(
                "Expected `optimizer_idx` to be below the number of optimizers "
                f"({len(optimizers)}) but got {self.optimizer_idx}."
            )
        optimizer = optimizers[self.optimizer_idx] if optimizers else None
        schedulers = [
            cfg.scheduler
            for cfg in trainer.lr_scheduler_configs
            if getattr(cfg.scheduler, "optimizer", None) is optimizer
        ]
        self._bank.bind(optimizer, schedulers)
        self._check_student(pl_module)

    def _check_student(self, pl_module: pl.LightningModule) -> None:
        """Warn when the connectors were built with another student, which they do not fit."""
        pairs = self._bank.serve(pl_module)
        if pairs:
            rank_zero_warn(
                f"FeatureDistillation: the connectors of pairs {pairs} were trained with another "
                f"student in an earlier fit or validation of this callback, and "
                f"{type(pl_module).__name__} starts from them: the callback keeps its connectors "
                "from one fit to the next, to go on training them. For another student, use a "
                "new FeatureDistillation, whose connectors start afresh."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the checkpoint's optimizer state is restored: connectors join the optimizer now.
        self._bank.restore(pl_module.device, pl_module)
        self._bank.attach()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if isinstance(optimizer, LightningOptimizer):  # its public view of the torch optimizer
            optimizer = optimizer.optimizer
        if optimizer is self._bank._optimizer:
            self._bank.unhide()  # in case a checkpoint's collection stopped half-way
            self._bank.all_reduce_grads()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        runner = self._runner
        if runner._nonfinite is None:
            return
        every = max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1))
        step = trainer.global_step  # optimizer steps completed, this one included
        on_host = runner._nonfinite.device.type == "cpu"
        if on_host or step % every == 0 or trainer.is_last_batch:
            runner.check_nonfinite(step)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._runner.check_nonfinite(trainer.global_step, wait=True)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.log_validation and not trainer.sanity_checking:
            self._runner.install(
                trainer, pl_module, validation=True, shard_teacher=self.shard_teacher
            )
            self._check_student(pl_module)
            self._bank.restore(pl_module.device, pl_module)

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self.log_validation or trainer.sanity_checking or self._runner.module is None:
            return
        self._runner.begin("val")
        self._runner.mask = self._read_mask(batch, batch_idx)
        if self.teacher_input is not None:
            self._runner.run_teacher(*teacher_call(self.teacher_input(batch)), own_input=True)

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
        runner = self._runner
        if runner.phase != "val":
            return
        try:
            runner.end_capture()
            # In the precision's context, as in training: under mixed precision the student's
            # features come out of autocast in half precision, the connectors stay in float32.
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                runner.log(runner.terms(), f"val/{self.log_prefix}", on_step=False)
        finally:
            runner.finish()

    @override
    def state_dict(self) -> dict[str, Any]:
        # Lightning asks for the callbacks' states just before the optimizers' states: the
        # connectors' group leaves the optimizer until on_save_checkpoint, so the checkpoint's
        # optimizer states match what configure_optimizers creates (with or without this
        # callback), and FSDP2 strategies, which name every optimized parameter after the
        # model's, never meet a parameter outside the model.
        state = {**self._bank.state_dict(), "mapping": dict(self.pairs)}
        self._bank.hide()
        return state

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A run resumed with another `log_prefix` or `name` (another `state_key`) goes on with the
        # connectors the checkpoint holds for the same pairs, in the same order (that of
        # their optimizer states).
        pairs = list(self.pairs.items())
        found = unclaimed_state(
            self,
            trainer,
            checkpoint,
            takes=lambda other: isinstance(other, FeatureDistillation),
            fits=lambda state: list(dict(state.get("mapping") or {}).items()) == pairs,
            fit_only=False,  # `validate(ckpt_path=...)` with `log_validation` uses them too
        )
        if found is None:
            return
        key, state = found
        self.load_state_dict(state)
        made_of = (
            f"`log_prefix` {self.log_prefix!r}" if self.name is None else f"`name` {self.name!r}"
        )
        rank_zero_warn(
            f"{type(self).__name__}: the checkpoint holds no state for this callback's "
            f"{made_of}, so it takes the connectors of the checkpoint's "
            f"{key} (the same pairs: their weights and optimizer state) and trains on with them."
        )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._bank.load_state_dict(state_dict)
        module = self._runner.module
        if module is not None and self._bank._group_index() is not None:
            # Restored during a fit (Lightning's Tuner, lr_find at a milestone epoch): the
            # connectors take the checkpoint's weights and optimizer state now, and their group
            # leaves the optimizer while the Trainer restores the optimizer states (saved
            # without it) until the next training batch starts.
            self._bank.restore(module.device, module)
            self._bank.hide()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._bank.unhide()  # after a restore during the fit (see load_state_dict)
        self._runner.mask = self._read_mask(batch, batch_idx)

    def _read_mask(self, batch: Any, batch_idx: int) -> Any:
        """The batch's token mask (``token_mask``), or None without one."""
        if self.token_mask is None:
            return None
        return read_batch_part(self.token_mask, batch, batch_idx, "token_mask", "the token mask")

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._bank.unhide()  # the optimizer states are collected: the group goes back

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if serves(self._runner.module, pl_module):  # not the install of another run going on
            self._uninstall()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if serves(self._runner.module, pl_module):
            self._uninstall()

    # ------------------------------------------------------------------ the training step
    def _training_step(
        self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        runner = self._runner
        trainer = attached_trainer(runner.module)
        callbacks: list[Callback] = getattr(trainer, "callbacks", [])
        if not any(callback is self for callback in callbacks):
            # a trial step of Lightning's Tuner (LearningRateFinder or BatchSizeFinder as a
            # callback, after this one's on_fit_start), run without the Trainer's callbacks
            return inner(*args, **kwargs)
        if trainer is not None and not trainer.training:
            # called from validation_step: validation adds no term (log_validation logs its own)
            return inner(*args, **kwargs)
        runner.begin("train")
        try:
            if self.teacher_input is not None:
                batch = args[0] if args else kwargs.get("batch")
                runner.run_teacher(*teacher_call(self.teacher_input(batch)), own_input=True)
            output = inner(*args, **kwargs)
            runner.end_capture()
            if self.add_to_loss and output is not None:
                output = add_term(output, self.loss())
            return output
        finally:
            runner.end_capture()
            runner.finish()

    def loss(self) -> Tensor:
        """The weighted distillation loss of the current training step (and log its terms).

        Call it inside ``training_step`` after the student's forward, when the callback was
        created with ``add_to_loss=False`` (or use :func:`distillation_loss`). In a
        ``training_step`` that ``validation_step`` calls during the fit it is ``0``: validation
        adds no term (``log_validation=True`` logs the validation terms).

        Raises:
            RecorderStateError: no training step is running, or the teacher did not run in it.
        """
        module = self._runner.module
        trainer = attached_trainer(module)
        if module is not None and trainer is not None and not trainer.training:
            return torch.zeros((), device=module.device)
        return self._runner.log(self._runner.terms(), self.log_prefix, on_step=True)

    def __repr__(self) -> str:
        extra = "" if self.name is None else f", name={self.name!r}"
        return (
            f"{type(self).__name__}(teacher={type(self.teacher).__name__}, "
            f"pairs={self.pairs}{extra})"
        )


def distillation_loss(pl_module: pl.LightningModule) -> Tensor:
    """The distillation loss of the current step, for a ``training_step`` that adds it itself.

    Sums :meth:`FeatureDistillation.loss` over the trainer's ``FeatureDistillation`` callbacks
    created with ``add_to_loss=False`` (``0`` in a ``training_step`` that ``validation_step``
    calls: validation adds no term)::

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            return loss + distillation_loss(self)

    Raises:
        RecorderStateError: no such callback is attached to the trainer, or no step is running.
    """
    if not isinstance(pl_module, pl.LightningModule):
        raise RecorderConfigError(
            "Expected `pl_module` to be the LightningModule being trained (call "
            f"distillation_loss(self) inside training_step) but got {type(pl_module).__name__}."
        )
    trainer = attached_trainer(pl_module)
    callbacks: list[Callback] = getattr(trainer, "callbacks", [])
    found = [cb for cb in callbacks if isinstance(cb, FeatureDistillation) and not cb.add_to_loss]
    if not found:
        raise RecorderStateError(
            "Expected a FeatureDistillation(..., add_to_loss=False) among the trainer's callbacks "
            "but found none (with add_to_loss=True the term is already added to the loss). "
            "Lightning's Tuner, `lr_find` and `scale_batch_size`, runs its trial steps without "
            "the Trainer's callbacks, so without the teacher: to tune, use add_to_loss=True "
            "(nothing is added in those steps), or skip the term when this RecorderStateError "
            "is raised."
        )
    if trainer is not None and not trainer.training:  # a training_step run by validation_step
        return torch.zeros((), device=pl_module.device)
    total = found[0].loss()
    for callback in found[1:]:
        total = total + callback.loss()
    return total
