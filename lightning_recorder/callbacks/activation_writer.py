"""`ActivationWriter`: module outputs written to an activation dataset while a Trainer runs."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from .._core.names import import_object
from ..activations import ShardWriter
from ..activations._format import require_safetensors
from ..errors import RecorderConfigError, RecorderError
from ._batch import batch_part, read_batch_part
from ._lightning import (
    Stage,
    fast_dev_run,
    predict_batch_indices,
    serves,
    step_axis,
    unclaimed_state,
)
from .recorder import RecorderCallback

__all__ = ["ActivationWriter"]

ModuleSource = str | type[nn.Module]
# A batch position or key before the function: LightningCLI (jsonargparse) tries the members in
# this order, to parse `--sample_index=1` as the position 1 and to write a key or a position
# back into a saved config (a function first made both a string it could not write back).
SampleIndex = int | str | Callable[[Any, int], Sequence[int] | torch.Tensor] | None
_SOURCE_KEYS = ("source", "path", "tokens", "mean", "transform", "dtype")
_MiB = 1 << 20


def _source_name(source: ModuleSource) -> str:
    return source if isinstance(source, str) else f"{source.__module__}.{source.__qualname__}"


def _parse_sources(sources: object, owner: str) -> dict[str, dict[str, Any]]:
    """``{source name: {"source": ..., options}}`` from the accepted forms of ``sources``."""
    if isinstance(sources, Mapping):
        items: list[tuple[str, Any]] = list(sources.items())
    elif isinstance(sources, (str, type)):
        items = [(_source_name(sources), sources)]
    elif isinstance(sources, Sequence) and all(isinstance(s, (str, type)) for s in sources):
        items = [(_source_name(s), s) for s in sources]
    else:
        items = []
    if not items:
        raise RecorderConfigError(
            f"Expected `sources` of {owner} to be a module name, glob pattern or module type, a "
            f"list of them, or a dict {{name: {{'source': ..., 'path': ..., 'mean': ...}}}} but "
            f"got {sources!r}."
        )
    parsed: dict[str, dict[str, Any]] = {}
    for name, config in items:
        if isinstance(config, (str, type)):
            config = {"source": config}
        if not isinstance(name, str) or not name or not isinstance(config, Mapping):
            raise RecorderConfigError(
                f"Expected each entry of `sources` of {owner} to map a name to a module source "
                f"or a dict such as {{'source': 'layer1', 'mean': 1}} but got {name!r}: "
                f"{config!r}."
            )
        unknown = sorted(set(config) - set(_SOURCE_KEYS))
        if unknown or "source" not in config:
            raise RecorderConfigError(
                f"Expected `sources[{name!r}]` of {owner} to have a 'source' and options among "
                f"{', '.join(_SOURCE_KEYS[1:])} but got {dict(config)!r}."
            )
        parsed[name] = dict(config)
    return parsed


class ActivationWriter(RecorderCallback):
    """Write the outputs of chosen modules to an activation dataset (sharded safetensors files).

    For every recorded batch of the chosen ``stages`` the outputs of the ``sources`` are handed
    to a :class:`~lightning_recorder.activations.ShardWriter`: a background thread writes them,
    so the step does not wait for the disk unless the queue (``max_queue_bytes``) is full. Each
    rank writes its own shards (nothing is gathered), each with an index file recording, for
    every row, the run, stage, global step, epoch, batch index, rank, sample index, module and
    shape. Read them back with :class:`~lightning_recorder.activations.ActivationDataset`.

    **Which batches.** Every batch of an evaluation stage in ``stages`` (never the sanity
    check); training batches every ``every_n_steps`` optimizer steps. The hooks are removed
    between recorded batches (see :class:`~lightning_recorder.RecorderCallback`).

    **Sample indices.** In ``predict`` they are the dataset indices Lightning's batch sampler
    drew (right under DDP too). Elsewhere pass ``sample_index``: a key or position of the batch
    holding them, or a function ``(batch, batch_idx) -> indices``; without it they are ``-1``.

    **fast_dev_run.** Under ``Trainer(fast_dev_run=...)``, where Lightning writes no logs or
    checkpoints, the sources are recorded and their tensors checked as for a write (rows against
    the sample indices, a dtype the shards store), but nothing is written (an info message says
    so), and a ``ckpt_path`` removes nothing.

    **Crash and resume.** A shard and then its index file are written under temporary names and
    renamed, so after a crash the index files list exactly the complete shards. Saving a
    checkpoint writes everything queued first; a fit resumed from that checkpoint keeps the run
    id and removes what was written after it (those steps run again), so no row is written
    twice (``validate``, ``test`` and ``predict`` with a ``ckpt_path`` remove nothing); so does
    a writer resumed with other ``sources`` or ``stages`` into the same directory, with a
    warning (one given another ``name`` writes a new run). A run
    that is not resumed adds its rows to the shards its run id already has in
    ``directory`` (the same ``run`` given again, or this writer used for another loop), with
    a warning.

    Args:
        sources: module names from ``named_modules()``, glob patterns (``"features.*"``) or module
            types, one or a list; or ``{name: {"source": ..., **options}}`` with options
            ``path`` (into a structured output), ``tokens`` (positions of dimension 1 to keep),
            ``mean`` (dimensions to average), ``transform`` (a function of the tensor, or its
            import path) and ``dtype``.
        directory: where to write: a local path or an ``fsspec`` URL.
        stages: the loops to write: any of ``"train"``, ``"val"``, ``"test"``, ``"predict"``.
        every_n_steps: write training batches every N optimizer steps (another value than 1
            needs ``"train"`` in ``stages``).
        dtype: cast every source without its own ``dtype`` (e.g. ``"float16"``).
        sample_index: where the sample indices of a batch are: a key or position of the batch
            holding them, or a function ``(batch, batch_idx) -> indices`` or ``(batch) ->
            indices`` (or its import path,
            as a YAML config gives it: ``"my_project.data.indices"``); ``None``: in
            ``predict`` the dataset indices the batch sampler drew, elsewhere ``-1``.
        run: the run id in file names and index (default: a random id). A resumed fit keeps
            the checkpoint's run id (warning if another ``run`` is given).
        max_shard_bytes: roll over to a new shard at this size.
        max_queue_bytes: the most bytes waiting to be written.
        queue_full: when the queue is full, ``"wait"`` for room, ``"drop"`` the batch (counted
            in ``writer.dropped``) or ``"raise"``.
        fsync: flush each file to the disk before renaming it (the index then survives an
            operating-system crash or power loss too; a crash of the process needs no fsync).
        low_priority: run the writing thread at a lower CPU priority than the step (Linux),
            so that on a busy machine it takes the time the step leaves.
        clone: record a copy of each output (for outputs changed in place afterwards, e.g. by
            ``ReLU(inplace=True)``). Outside inference mode such a change raises
            :class:`~lightning_recorder.RecordModifiedError`; under ``torch.inference_mode()``
            (Lightning's default for ``predict``) it cannot be detected, so set ``clone``.
        name: distinguishes two writers with the same configuration; not empty or blank.
        keep_hooks: see :class:`~lightning_recorder.RecorderCallback`.

    Raises:
        RecorderConfigError: an argument is invalid or ``directory`` is not writable (at
            construction); a source matches no module (``UnknownSourceError``, when the run
            starts, naming the closest names).

    Examples:
        >>> import tempfile
        >>> import lightning.pytorch as pl
        >>> import torch
        >>> from torch import nn
        >>> from lightning_recorder.activations import ActivationDataset
        >>> class Net(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        ...     def predict_step(self, batch, batch_idx):
        ...         return self.body(batch[0])
        >>> directory = tempfile.mkdtemp()
        >>> writer = ActivationWriter(["body.1"], directory)
        >>> data = torch.utils.data.DataLoader(
        ...     torch.utils.data.TensorDataset(torch.randn(10, 4)), batch_size=4)
        >>> trainer = pl.Trainer(callbacks=[writer], logger=False, enable_progress_bar=False,
        ...     enable_model_summary=False)
        >>> _ = trainer.predict(Net(), data)
        >>> dataset = ActivationDataset(directory)
        >>> len(dataset), dataset.concat("body.1").shape
        (10, torch.Size([10, 8]))
    """

    def __init__(
        self,
        sources: ModuleSource | Sequence[ModuleSource] | Mapping[str, Any],
        directory: str | os.PathLike[str],
        stages: Stage | Sequence[Stage] = ("predict",),
        every_n_steps: int = 1,
        *,
        dtype: torch.dtype | str | None = None,
        sample_index: SampleIndex = None,
        run: str | None = None,
        max_shard_bytes: int = 256 * _MiB,
        max_queue_bytes: int = 512 * _MiB,
        queue_full: Literal["wait", "drop", "raise"] = "wait",
        fsync: bool = True,
        low_priority: bool = True,
        clone: bool = False,
        name: str | None = None,
        keep_hooks: bool | None = None,
    ) -> None:
        owner = type(self).__name__
        require_safetensors(owner)
        configs = _parse_sources(sources, owner)
        recorders = {
            key: {
                "type": "ModuleOutputs",
                "source": config["source"],
                "detach": True,
                "clone": clone,
                "path": config.get("path"),
            }
            for key, config in configs.items()
        }
        if every_n_steps is None:
            raise RecorderConfigError(
                f"Expected `every_n_steps` of {owner} to be a positive int but got None."
            )
        super().__init__(recorders, stages, every_n_steps, name=name, keep_hooks=keep_hooks)
        self.sample_index = batch_part(sample_index, owner, "sample_index", "indices")
        specs = {
            key: {k: v for k, v in config.items() if k in ("tokens", "mean", "transform", "dtype")}
            for key, config in configs.items()
        }
        for spec in specs.values():
            transform = spec.get("transform")
            if isinstance(transform, str) and "." in transform:  # an import path, as YAML has
                spec["transform"] = import_object(transform, "a function", "functions", callable)
            if dtype is not None:
                spec.setdefault("dtype", dtype)
        self.directory = directory
        self._writer_options: dict[str, Any] = {
            "sources": specs,
            "max_shard_bytes": max_shard_bytes,
            "max_queue_bytes": max_queue_bytes,
            "queue_full": queue_full,
            "fsync": fsync,
            "low_priority": low_priority,
        }
        # Validates every option and that the directory is writable; no thread starts until a
        # batch is written, and this one is replaced (by rank) in `setup`.
        self.writer: ShardWriter = ShardWriter(directory, run=run, **self._writer_options)
        self.run: str | None = run
        self._given_run = run
        self._restored: tuple[str, int] | None = None  # (run, generation) from a checkpoint
        self._failing = False
        self._train_batch: tuple[Any, int] | None = None  # the recorded training batch

    def _make_state_key(self) -> str:
        if self.name is not None:
            return self._generate_state_key(name=self.name)
        sources = {k: repr(v.get("source")) for k, v in self._configs.items()}
        return self._generate_state_key(
            sources=sources, directory=os.fspath(self.directory), stages=self.stages
        )

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        url = self.writer.storage.url
        for other in trainer.callbacks:  # type: ignore[attr-defined]
            same = (
                isinstance(other, ActivationWriter)
                and other is not self
                and self._given_run is not None
                and other._given_run == self._given_run
                and other.writer.storage.url == url
            )
            if same:  # both would number their shards alike and replace each other's
                raise RecorderConfigError(
                    f"Expected each {type(self).__name__} writing into {url!r} to have its own "
                    f"`run` but the writers of sources {sorted(self._configs)} and "
                    f"{sorted(other._configs)} both have run={self._given_run!r}: they would "
                    "give their shards the same names and overwrite each other's rows. Give one "
                    "another `run` (or none, for a fresh id), or write all the sources with one "
                    "writer."
                )
        super().setup(trainer, pl_module, stage)
        if self.run is None:  # one id for all ranks, chosen by rank 0
            self.run = trainer.strategy.broadcast(self.writer.run, src=0)
        self._failing = False
        self.writer = ShardWriter(
            self.directory, run=self.run, rank=trainer.global_rank, **self._writer_options
        )
        # The generations go on from the shards this run already has (an earlier fit or loop
        # of this writer): a resume from a checkpoint of this loop then removes what it wrote
        # after the checkpoint, not the earlier loop's shards of the same numbers. Those of
        # every rank count, so that the ranks agree (a checkpoint holds rank 0's number).
        latest = self.writer.run_generation()
        if latest is not None:
            self.writer.generation = latest + 1

    def _on_attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored, self._restored = self._restored, None
        if fast_dev_run(trainer):  # Lightning's smoke test: no logs, no checkpoints, no shards
            rank_zero_info(
                f"{type(self).__name__} writes no activations under `fast_dev_run`, as "
                f"Lightning writes no logs or checkpoints then: its sources are recorded, but "
                f"nothing is written to (or removed from) {self.writer.storage.url!r}. Run "
                "without fast_dev_run (e.g. `limit_predict_batches=1`) to write them."
            )
            return
        # validate/test/predict(ckpt_path=...) restore the callbacks' states too, but only a fit
        # resumes training: those loops write beside the run's shards, and remove none
        if restored is not None and trainer.state.fn == "fit":
            # resumed: this run's shards after the checkpoint are stale
            if self._given_run not in (None, restored[0]):
                rank_zero_warn(
                    f"{type(self).__name__}: resumed from a checkpoint of run {restored[0]!r}, "
                    f"so it continues that run (replacing what it wrote after the checkpoint) "
                    f"and not `run={self._given_run!r}`. To write a new run instead, resume "
                    "without this writer's state (another `name`) or start a new fit."
                )
            self.run, generation = restored
            self.writer.run = self.run
            self.writer.discard_from(generation)
            if trainer.global_rank == 0:  # resumed on fewer processes: theirs are stale too
                gone = {rank for rank in self.writer.run_ranks() if rank >= trainer.world_size}
                for rank in sorted(gone):
                    ShardWriter(
                        self.directory, run=self.run, rank=rank, **self._writer_options
                    ).discard_from(generation)
            return
        writer = self.writer
        shards = len(writer.own_index_files())
        if shards:  # not a resume: the rows of this run go beside those already written
            rank_zero_warn(
                f"{type(self).__name__}: {writer.storage.url!r} already holds {shards} shard(s) "
                f"of run {writer.run!r}, written before this fit or loop started; its rows "
                "are added to them, and ActivationDataset reads both (the same steps and "
                "samples twice if they are written again). Pass another `run` (or none, for a "
                "fresh id) to keep them apart, or resume with `ckpt_path=` to replace what was "
                "written after the checkpoint."
            )

    def _on_detach(self) -> None:
        self._train_batch = None
        try:
            self.writer.close()
        except RecorderError:
            if not self._failing:
                raise

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if serves(self._module, pl_module):  # not another run's writer
            self._failing = True  # write what is queued; the run's own error is the one to see
        super().on_exception(trainer, pl_module, exception)

    # ------------------------------------------------------------------ per batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._train_batch = (batch, batch_idx) if self._active == "train" else None

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._train_batch = None
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _write_done_batch(self) -> None:
        """Write the training batch now if a checkpoint is saved in its ``on_train_batch_end``
        before this callback's: the checkpoint holds that batch as done (a resume does not run
        it again), so its rows belong before the checkpoint."""
        pending, module = self._train_batch, self._module
        if pending is None or module is None or self._active != "train":
            return
        # ready, started, processed and completed batches, over the whole fit
        total: Any = module.trainer.fit_loop.epoch_loop.batch_progress.total
        if total.processed > total.completed:  # between the optimizer step and the batch's end
            self.on_train_batch_end(module.trainer, module, None, *pending)

    def _indices(self, trainer: pl.Trainer, stage: Stage) -> Any:
        batch, batch_idx, dataloader_idx = self._batch
        how = self.sample_index
        if how is None:
            return (
                predict_batch_indices(trainer, batch_idx, dataloader_idx)
                if stage == "predict"
                else None
            )
        return read_batch_part(how, batch, batch_idx, "sample_index", "the sample indices")

    def _after_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: Stage, completes: bool
    ) -> None:
        _, batch_idx, dataloader_idx = self._batch
        # train: optimizer steps done before this batch, Lightning's step axis
        step = step_axis(trainer) if stage == "train" else trainer.global_step
        indices = self._indices(trainer, stage)
        if fast_dev_run(trainer):  # see `_on_attach`: checked as for a write, but not written
            self.writer._record_chunks(
                self.manager,
                stage,
                step,
                trainer.current_epoch,
                batch_idx,
                dataloader_idx,
                indices,
                None,
            )
            return
        self.writer.write_records(
            self.manager,
            stage=stage,
            global_step=step,
            epoch=trainer.current_epoch,
            batch_idx=batch_idx,
            dataloader_idx=dataloader_idx,
            sample_index=indices,
        )

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        # Every rank saves a checkpoint's state: each writes what it has queued, and the
        # shards written after this point get the next generation number.
        self._write_done_batch()
        generation = self.writer.checkpoint()
        return {
            **super().state_dict(),
            "run": self.run,
            "generation": generation,
            "directory": os.fspath(self.directory),
        }

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A writer resumed with other sources or stages (another `state_key`) into the
        # directory of the checkpoint's writer continues its run there: a new run would write
        # the steps after the checkpoint a second time.
        directory = os.fspath(self.directory)
        found = unclaimed_state(
            self,
            trainer,
            checkpoint,
            takes=lambda other: (
                isinstance(other, ActivationWriter)
                and other.name is None
                and os.fspath(other.directory) == directory
            ),
            fits=lambda state: state.get("directory") == directory,
        )
        if found is None:
            return
        key, state = found
        self.load_state_dict(state)
        if self._restored is not None:
            rank_zero_warn(
                f"{type(self).__name__}: the checkpoint holds no state for this writer's "
                f"sources and stages, so it continues run {self._restored[0]!r} of the "
                f"checkpoint's {key} in {directory!r} (replacing what that run wrote after the "
                "checkpoint), so that no step is written twice. Give it another `name` to write a "
                "new run instead."
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        run, generation = state_dict.get("run"), state_dict.get("generation")
        if isinstance(run, str) and isinstance(generation, int):
            self._restored = (run, generation)
