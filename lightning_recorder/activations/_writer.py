"""`ShardWriter`: activations written to shards by a background thread through a bounded queue."""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Protocol

import torch

from .._core.checks import STAGES, closest_hint
from ..errors import RecorderConfigError, RecorderStateError
from ._format import (
    FORMAT,
    INDEX_SUFFIX,
    SHARD_SUFFIX,
    STORABLE,
    TMP_SUFFIX,
    VERSION,
    Storage,
    as_index,
    check_run_id,
    check_storable,
    decode_index,
    encode_index,
    new_run_id,
    parse_stem,
    require_safetensors,
    stem,
)
from ._spec import SourceSpec

QueueFull = Literal["wait", "drop", "raise"]
_QUEUE_FULL = ("wait", "drop", "raise")
_MiB = 1 << 20


class _Stream(Protocol):  # what a RecordStream offers (duck-typed: no recorder import here)
    name: str

    @property
    def data_buffer(self) -> list[Any]: ...


class _Manager(Protocol):  # what a RecorderManager offers
    def streams(self) -> Iterable[tuple[str, _Stream]]: ...


def _positive(value: object, name: str, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecorderConfigError(
            f"Expected `{name}` of {owner} to be a positive int but got {value!r}."
        )
    return value


# A chunk's provenance as the producer hands it over: (source, module, batch fields, call,
# sample indices). The thread turns it into the index entry's dict when it commits the shard.
_Meta = tuple[str, str, dict[str, Any], int, list[int]]


_NICER = 10  # how much lower the writing thread's priority is (``nice`` steps)


def _lower_priority() -> None:
    """Lower the CPU priority of the calling thread (Linux only: there a thread has its own
    ``nice`` value; elsewhere ``setpriority`` would lower the whole process)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + _NICER, 19))
    except OSError:  # pragma: no cover - a sandbox that forbids it: keep the priority
        pass


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an ordinary dense one (strided, not nested, not quantized), whose
    rows the shards store (this room imports nothing of the package but its errors)."""
    return tensor.layout == torch.strided and not tensor.is_nested and not tensor.is_quantized


def _not_dense(tensor: torch.Tensor, where: str) -> RecorderConfigError:
    """The error for activations that are not an ordinary dense tensor, with what to pass."""
    if tensor.is_nested:
        what = (
            "a nested tensor of ragged rows (as torch's TransformerEncoder makes in evaluation "
            "with a padding mask)"
        )
        fix = (
            "pad them with `transform=lambda t: t.to_padded_tensor(0.0)` for this source, or "
            "build the encoder with enable_nested_tensor=False"
        )
    elif tensor.is_quantized:
        what, fix = "a quantized tensor", "pass `transform=lambda t: t.dequantize()` for it"
    else:
        what, fix = f"a sparse tensor ({tensor.layout})", "pass `transform=lambda t: t.to_dense()`"
    return RecorderConfigError(
        f"Expected the activations of {where} to be an ordinary dense tensor (rows of one shape "
        f"along dimension 0) but got {what}; {fix}."
    )


def _not_1d(found: str, rows: int | None) -> RecorderConfigError:
    """The error for sample indices of more or fewer dimensions than one (``found`` says what
    they are; ``rows``: the batch's first dimension, where known)."""
    n = "N" if rows is None else f"N = {rows} here"
    return RecorderConfigError(
        "Expected the sample indices (`sample_index`) to be 1-d, of shape (N,) with N the "
        f"batch's first dimension ({n}: one dataset index per row; (N, 1) is taken too, as a "
        f"dataset returning `torch.tensor([index])` collates them), but got {found}; pass one "
        "index per row."
    )


def _where(source: str, module: str) -> str:
    return f"source {source!r} (module {module!r})"


# The provenance numbers, all counts from 0: what each counts, and what to pass.
_COUNTS = {
    "global_step": "it counts the optimizer steps from 0; pass the Trainer's `global_step` "
    "(0 before the first step)",
    "call": "it numbers the calls of the module in one forward from 0; pass 0 for the first "
    "call (a module called once)",
    "epoch": "it counts the epochs from 0; pass the Trainer's `current_epoch`",
    "batch_idx": "it numbers the batches of the epoch from 0; pass the `batch_idx` Lightning "
    "gives the hook",
    "dataloader_idx": "it numbers the dataloaders of the stage from 0; pass 0 for a single "
    "dataloader",
}


def _provenance_int(name: str, value: object) -> int:
    """``value`` as an int (an int, a NumPy integer, an integer 0-d tensor), else an error: a
    float, ``None`` or a string would be truncated, or fail the readers that sort the rows; a
    bool is no number. Each counts from 0 (:data:`_COUNTS`): it must be ``>= 0`` too."""
    found = as_index(value)
    if found is None:
        raise RecorderConfigError(
            f"Expected `{name}` to be an int >= 0 but got {type(value).__name__} {value!r}."
        )
    if found < 0:
        raise RecorderConfigError(
            f"Expected `{name}` to be an int >= 0 but got {found}: {_COUNTS[name]}."
        )
    return found


class ShardWriter:
    """Write activations to sharded safetensors files from a background thread.

    :meth:`write` (or :meth:`write_records`, for every stream of a
    :class:`~lightning_recorder.RecorderManager`) puts one batch's tensor on a queue and returns;
    a thread takes it from there, collects tensors into a shard and, when the shard reaches
    ``max_shard_bytes``, writes it (see :mod:`lightning_recorder.activations` for the format).
    The caller waits only when the queue holds ``max_queue_bytes`` already (``queue_full``
    chooses: ``"wait"`` for room, ``"drop"`` the batch and count it in :attr:`dropped`, or
    ``"raise"``). Memory held: at most ``max_queue_bytes`` queued (one batch more when a single
    batch is larger) plus the shard being filled (``max_shard_bytes`` and one batch).

    CPU tensors are queued without a copy when they own their memory: do not modify them in
    place after :meth:`write`. Tensors on an accelerator are copied to the host without
    blocking and the thread waits for the copy.

    Each process writes its own files (``rank`` is part of their names): no gather, no shared
    file. A shard and then its index file are each written under a temporary name, flushed and
    given their names, so a crash leaves complete shards and index files that list exactly them.
    A shard takes the first number that no file has (on a local disk, by a hard link made only
    where no file has the name): two writers of one run and rank writing into one directory at
    the same time keep each other's shards, and each warns once that it found a number taken.
    On an fsspec filesystem two such writers replace each other's shards: give each its own
    ``run`` or ``rank``.

    Args:
        directory: a local path or an ``fsspec`` URL (``"memory://acts"``, ``"s3://bucket/x"``).
        run: the run id, part of every file name and index entry (default: a fresh random id).
        rank: the process's rank, part of every file name.
        sources: per-source options ``{source: {"tokens": ..., "mean": ..., "transform": ...,
            "dtype": ...}}`` (see :mod:`lightning_recorder.activations`), applied by
            :meth:`write` before queueing.
        max_shard_bytes: start a new shard when the current one holds this many bytes.
        max_queue_bytes: the most bytes waiting in the queue.
        queue_full: what :meth:`write` does when the queue is full.
        generation: tag of the shards written (see :meth:`checkpoint`, :meth:`discard_from`).
        fsync: flush every file to the disk before renaming it, so that the index survives a
            power loss or an operating-system crash too; without it a crash of the process
            still leaves only complete shards listed (the renames keep their order in the
            page cache), and writing is faster.
        low_priority: run the thread at a lower CPU priority than the step (Linux: ``nice``
            +10 for this thread only; elsewhere ignored), so that on a busy machine its copying
            into the page cache takes the time the step leaves, rather than the step's. The
            thread still gets every idle moment; the step waits for it only when the queue is
            full.

    Raises:
        RecorderConfigError: an argument is invalid, or ``directory`` cannot be written (at
            construction, before any thread starts).

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from lightning_recorder.activations import ActivationDataset, ShardWriter
        >>> tmp = tempfile.TemporaryDirectory()
        >>> directory = tmp.name
        >>> with ShardWriter(directory, run="demo") as writer:
        ...     _ = writer.write("feat", "layer", torch.ones(4, 3), stage="predict",
        ...                  sample_index=[0, 1, 2, 3])
        >>> len(ActivationDataset(directory))
        4
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        run: str | None = None,
        rank: int = 0,
        sources: Mapping[str, Mapping[str, Any]] | None = None,
        max_shard_bytes: int = 256 * _MiB,
        max_queue_bytes: int = 512 * _MiB,
        queue_full: QueueFull = "wait",
        generation: int = 0,
        fsync: bool = True,
        low_priority: bool = True,
    ) -> None:
        owner = type(self).__name__
        self.run = new_run_id() if run is None else check_run_id(run, owner)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise RecorderConfigError(
                f"Expected `rank` of {owner} to be an int >= 0 but got {rank!r}."
            )
        self.rank = rank
        self.max_shard_bytes = _positive(max_shard_bytes, "max_shard_bytes", owner)
        self.max_queue_bytes = _positive(max_queue_bytes, "max_queue_bytes", owner)
        if queue_full not in _QUEUE_FULL:
            raise RecorderConfigError(
                f"Expected `queue_full` of {owner} to be one of "
                f"{', '.join(map(repr, _QUEUE_FULL))} but got {queue_full!r}."
            )
        self.queue_full: QueueFull = queue_full
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise RecorderConfigError(
                f"Expected `generation` of {owner} to be an int >= 0 but got {generation!r}."
            )
        self.generation = generation
        if sources is not None and not isinstance(sources, Mapping):
            raise RecorderConfigError(
                f"Expected `sources` of {owner} to be a dict {{source: options}} but got "
                f"{sources!r}."
            )
        self._specs = {
            name: SourceSpec(opts, f"source {name!r}") for name, opts in (sources or {}).items()
        }
        if not isinstance(fsync, bool):
            raise RecorderConfigError(
                f"Expected `fsync` of {owner} to be a bool but got {fsync!r}."
            )
        self.fsync = fsync
        if not isinstance(low_priority, bool):
            raise RecorderConfigError(
                f"Expected `low_priority` of {owner} to be a bool but got {low_priority!r}."
            )
        self.low_priority = low_priority
        require_safetensors(owner)
        self.storage = Storage(directory, owner)
        self.storage.make_writable(owner)
        #: Batches not written because the queue was full (``queue_full="drop"``).
        self.dropped = 0
        #: Seconds :meth:`write` spent waiting for room in the queue.
        self.wait_seconds = 0.0
        #: Rows, bytes and shards written (committed) so far.
        self.rows_written = 0
        self.bytes_written = 0
        self.shards_written = 0
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._queued_bytes = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._seq: int | None = None  # next shard number (found on the first commit)
        self._shared = False  # another writer of this run and rank took a shard number
        self._pending: list[tuple[_Meta, torch.Tensor]] = []
        self._pending_bytes = 0

    # ------------------------------------------------------------------ producer side
    def write(
        self,
        source: str,
        module: str,
        tensor: torch.Tensor,
        *,
        stage: str = "predict",
        global_step: int = 0,
        epoch: int = 0,
        batch_idx: int = 0,
        dataloader_idx: int = 0,
        sample_index: Sequence[int] | torch.Tensor | None = None,
        call: int = 0,
    ) -> bool:
        """Queue one batch's activations of one source (rows along dimension 0).

        Args:
            source: the source name (a key of ``sources``, or any name).
            module: the module (or stream) the tensor comes from.
            tensor: the activations; the source's options are applied first.
            stage: provenance of the batch: the stage, one of ``"train"``, ``"val"``,
                ``"test"`` and ``"predict"``.
            global_step: provenance of the batch: the optimizer step (``>= 0``).
            epoch: provenance of the batch: the epoch (``>= 0``).
            batch_idx: provenance of the batch: its index in the epoch (``>= 0``).
            dataloader_idx: provenance of the batch: the index of its dataloader (``>= 0``).
            sample_index: the dataset index of each row, of shape ``(N,)`` for ``N`` rows
                (default: ``-1``, unknown).
            call: which call of the module in the forward (0 for the first, ``>= 0``).

        Returns:
            Whether the batch was queued (false only when ``queue_full="drop"`` dropped it).

        Raises:
            RecorderConfigError: the tensor cannot be stored, ``sample_index`` is not 1-d
                integers of the right length, a name is not a str, ``stage`` not one of the
                four, or a provenance number not an int or negative (checked before anything
                is queued).
            RecorderStateError: the writer is closed, the queue is full under
                ``queue_full="raise"``, or the thread failed (its error is the cause).
        """
        self._check_alive()
        base = self._base(stage, global_step, epoch, batch_idx, dataloader_idx)
        for name, value in (("source", source), ("module", module)):
            if not isinstance(value, str):
                raise RecorderConfigError(
                    f"Expected `{name}` to be a str but got {type(value).__name__} {value!r}."
                )
        call = _provenance_int("call", call)
        rows = None
        if isinstance(tensor, torch.Tensor):  # dimension 0, which the source's options keep
            rows = tensor.size(0) if tensor.dim() else 1
        chunk = self._chunk(source, module, tensor, base, self._index(sample_index, rows), call)
        return self._put(("chunks", [chunk]), chunk[1].nbytes)

    def write_records(
        self,
        manager: _Manager,
        *,
        stage: str = "predict",
        global_step: int = 0,
        epoch: int = 0,
        batch_idx: int = 0,
        dataloader_idx: int = 0,
        sample_index: Sequence[int] | torch.Tensor | None = None,
        names: Iterable[str] | None = None,
    ) -> int:
        """Queue every record of a :class:`~lightning_recorder.RecorderManager` (or of anything
        with its ``streams()``): the recorder name is the source, the stream name the module.

        Call it after the forward, before the records are reset. Records of one stream in one
        forward are its calls (``call`` 0, 1, …). The batch's tensors are queued together.
        ``names`` (recorder names of the manager, ``None`` for all) keeps the records of those
        recorders only; the other arguments are those of :meth:`write`.

        Returns:
            The number of tensors queued (0 when ``queue_full="drop"`` dropped the batch).

        Raises:
            RecorderConfigError: ``manager`` has no ``streams()``, ``names`` is not a collection
                of the manager's recorder names, or as :meth:`write`.
        """
        self._check_alive()
        chunks = self._record_chunks(
            manager, stage, global_step, epoch, batch_idx, dataloader_idx, sample_index, names
        )
        if not chunks:
            return 0
        queued = self._put(("chunks", chunks), sum(c[1].nbytes for c in chunks))
        return len(chunks) if queued else 0

    def _record_chunks(
        self,
        manager: _Manager,
        stage: str,
        global_step: int,
        epoch: int,
        batch_idx: int,
        dataloader_idx: int,
        sample_index: Sequence[int] | torch.Tensor | None,
        names: Iterable[str] | None,
    ) -> list[tuple[_Meta, torch.Tensor, Any]]:
        """Validate and prepare the records of :meth:`write_records` without queueing them."""
        if not callable(getattr(manager, "streams", None)):
            raise RecorderConfigError(
                "Expected `manager` to be a RecorderManager (or anything with its `streams()`) "
                f"but got {type(manager).__name__}; initialize a RecorderManager on the model and "
                "pass it."
            )
        if names is not None and (isinstance(names, str) or not isinstance(names, Iterable)):
            raise RecorderConfigError(
                "Expected `names` to be a collection of recorder names (a list of str) or None "
                f"but got {type(names).__name__} {names!r}"
                + (f"; pass [{names!r}] for one recorder." if isinstance(names, str) else ".")
            )
        base = self._base(stage, global_step, epoch, batch_idx, dataloader_idx)
        index = self._index(sample_index)
        streams = list(manager.streams())
        wanted = None if names is None else set(names)
        if wanted is not None:
            known = {source for source, _ in streams}
            unknown = wanted - known
            if unknown:
                raise RecorderConfigError(
                    f"Expected `names` to be among the manager's recorders {sorted(known)} but "
                    f"got {sorted(unknown, key=str)}."
                )
        return [
            self._chunk(source, stream.name, record, base, index, call)
            for source, stream in streams
            if wanted is None or source in wanted
            for call, record in enumerate(stream.data_buffer)
        ]

    @staticmethod
    def _base(
        stage: str, global_step: int, epoch: int, batch_idx: int, dataloader_idx: int
    ) -> dict[str, Any]:
        if not isinstance(stage, str):
            raise RecorderConfigError(
                'Expected `stage` to be a str ("train", "val", "test" or "predict") '
                f"but got {type(stage).__name__} {stage!r}."
            )
        if stage not in STAGES:  # a row of another stage no `stages` filter would name
            raise RecorderConfigError(
                f"Expected `stage` to be one of {', '.join(map(repr, STAGES))} (the stages "
                "ActivationWriter writes and ActivationDataset(stages=...) keeps) but got "
                f"{stage!r}.{closest_hint(stage, STAGES, 'stages')}"
            )
        return {
            "stage": stage,
            "global_step": _provenance_int("global_step", global_step),
            "epoch": _provenance_int("epoch", epoch),
            "batch_idx": _provenance_int("batch_idx", batch_idx),
            "dataloader_idx": _provenance_int("dataloader_idx", dataloader_idx),
        }

    @staticmethod
    def _index(
        sample_index: Sequence[int] | torch.Tensor | None, rows: int | None = None
    ) -> list[int] | None:
        """The sample indices as ints, checked: one dimension (or ``(N, 1)``), integers
        (``rows``: the batch's first dimension, for the message, where known)."""
        if sample_index is None:
            return None
        shape = getattr(sample_index, "shape", None)  # a tensor or a NumPy array
        if shape is not None and len(shape) == 2 and shape[1] == 1:  # (N, 1): one per row
            sample_index = sample_index[:, 0]  # type: ignore[call-overload]
        elif shape is not None and len(shape) != 1:
            raise _not_1d(f"shape {tuple(shape)}" + ("" if len(shape) else " (one value)"), rows)
        if isinstance(sample_index, torch.Tensor):
            wrong = sample_index.is_floating_point() or sample_index.is_complex()
            if wrong or sample_index.dtype == torch.bool:  # a mask: 0 and 1, not indices
                raise RecorderConfigError(
                    "Expected the sample indices (`sample_index`) to be integer dataset "
                    f"indices but got a tensor of {sample_index.dtype}; pass the indices "
                    "themselves (an integer tensor or a sequence of ints), not values of the "
                    "batch such as its inputs or targets."
                )
            return [int(i) for i in sample_index.tolist()]
        index: list[int] = []
        for item in sample_index:
            # a tensor [i] is an index to Python too: a row of a 2-d index, not an index
            if getattr(item, "ndim", 0) or (
                isinstance(item, Sequence) and not isinstance(item, str)
            ):
                raise _not_1d(f"a sequence holding {type(item).__name__} {item!r}", rows)
            found = as_index(item)  # a mask's values (bools), 0 and 1, are not indices
            if found is None:
                raise RecorderConfigError(
                    "Expected the sample indices (`sample_index`) to be integer dataset "
                    f"indices but got {item!r} ({type(item).__name__}); pass the indices "
                    "themselves (an integer tensor or a sequence of ints)."
                )
            index.append(found)
        return index

    def _chunk(
        self,
        source: str,
        module: str,
        tensor: torch.Tensor,
        base: dict[str, Any],
        index: list[int] | None,
        call: int,
    ) -> tuple[_Meta, torch.Tensor, Any]:
        """Validate and prepare one tensor: ``(metadata, host tensor, copy event or None)``."""
        if not isinstance(tensor, torch.Tensor):
            raise RecorderConfigError(
                f"Expected the activations of {_where(source, module)} to be a tensor but got "
                f"{type(tensor).__name__}; choose one inside a structured output with the "
                "`path` option."
            )
        if tensor.requires_grad:
            tensor = tensor.detach()
        spec = self._specs.get(source)
        if spec is not None:
            # only a transform alone sees a nested, sparse or quantized tensor as recorded
            only_transform = spec.tokens is None and spec.mean is None
            if not _plain(tensor) and (spec.transform is None or not only_transform):
                raise _not_dense(tensor, _where(source, module))
            tensor = spec.apply(tensor)
        if not _plain(tensor):
            raise _not_dense(tensor, _where(source, module))
        if tensor.dtype not in STORABLE:
            check_storable(tensor.dtype, _where(source, module))
        shape = tuple(tensor.shape)
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        rows = tensor.shape[0]
        if index is None:
            index = [-1] * rows
        elif len(index) != rows:
            found = "a 0-d tensor (one value)" if not shape else f"{rows} rows (shape {shape})"
            raise RecorderConfigError(
                f"Expected {_where(source, module)} to have one row per sample along its "
                f"dimension 0, as many as the sample indices ({len(index)}: `sample_index`, or "
                f"in `predict` the dataset indices of the batch), but got {found}; record an "
                "output with a row per sample (choose one with `path`, or record a module whose "
                "output is batch-first, such as an RNN or attention layer built with "
                "batch_first=True: a `transform` keeps the rows it is given), or give sample "
                "indices that match its rows."
            )
        event = None
        if not tensor.is_cpu:  # copied without blocking; the thread waits for it
            host = torch.empty(
                tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available()
            )
            host.copy_(tensor, non_blocking=True)
            if tensor.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
            tensor = host
        elif not tensor.is_contiguous():
            tensor = tensor.contiguous()
        elif tensor.untyped_storage().nbytes() > tensor.nbytes:  # a view would keep (and the
            tensor = tensor.clone()  # queue not count) the whole of its base alive
        return (source, module, base, call, index), tensor, event

    def _put(self, item: tuple[Any, ...], nbytes: int) -> bool:
        with self._cond:
            if self._thread is None:
                self._start()
            limit = self.max_queue_bytes
            if nbytes and self._queue and self._queued_bytes + nbytes > limit:
                if self.queue_full == "drop":
                    self.dropped += 1
                    return False
                if self.queue_full == "raise":
                    raise RecorderStateError(
                        f"The queue of {self!r} is full ({self._queued_bytes} of {limit} bytes "
                        "queued): the disk does not keep up. Raise `max_queue_bytes`, write "
                        "fewer or smaller activations, or pass queue_full='wait'."
                    )
                start = time.perf_counter()
                self._cond.notify_all()  # the thread drains the queue
                while self._queue and self._queued_bytes + nbytes > limit and self._error is None:
                    self._cond.wait()
                self.wait_seconds += time.perf_counter() - start
                self._raise_error()
            self._queue.append((*item, nbytes))
            queued = self._queued_bytes = self._queued_bytes + nbytes
            # The thread only collects chunks until a shard is full: waking it for every batch
            # would cost the step a thread switch (and the GIL) for nothing. It is woken when
            # the queue completes a shard or holds half its limit, and for flush and stop.
            if (
                not nbytes
                or queued + self._pending_bytes >= self.max_shard_bytes
                or 2 * queued >= limit
            ):
                self._cond.notify_all()
        return True

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"{self!r}", daemon=True)
        self._thread.start()

    def _check_alive(self) -> None:
        if self._closed:
            raise RecorderStateError(f"{self!r} is closed: create a new writer to write more.")
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RecorderStateError(
                f"{self!r} failed to write a shard: {self._error}"
            ) from self._error

    # ------------------------------------------------------------------ control
    def flush(self) -> None:
        """Write everything queued and the shard being filled; return when it is on disk."""
        self._raise_error()
        if self._thread is None:
            return
        done = threading.Event()
        self._put(("flush", done), 0)
        while not done.wait(0.1):
            if self._error is not None or not self._thread.is_alive():
                break
        self._raise_error()

    def checkpoint(self) -> int:
        """Write everything (:meth:`flush`) and start a new generation; return its number.

        Shards written from now on carry the new number: a run resumed from a checkpoint that
        stored it removes them with :meth:`discard_from`, since it writes those steps again.
        """
        self.flush()
        self.generation += 1
        return self.generation

    def discard_from(self, generation: int) -> int:
        """Remove this run's and rank's shards of ``generation`` or later; return how many.

        The index file goes first, so an interruption leaves a shard that no index lists. Also
        removes this run's and rank's temporary files and shards without an index (left by a
        crash). Call it before writing: the shards written next are numbered after every shard
        found, those removed too.
        """
        storage, removed = self.storage, 0
        names = storage.names()
        # Numbers go on after those removed too: a name never stands for two shards, so a reader
        # that listed a removed shard fails on it rather than reading another in its place.
        last = max((seq for _, seq in self._own(names)), default=-1)
        self._seq = max(last + 1, self._seq or 0)
        indexed = set()
        for name, _ in self._own(names):
            if name.endswith(INDEX_SUFFIX):
                entry = decode_index(storage.read(name), name)
                if entry.get("generation", 0) >= generation:
                    storage.remove(name)
                    storage.remove(entry["shard"])
                    removed += 1
                else:
                    indexed.add(entry["shard"])
        prefix = f"{self.run}-rank{self.rank:05d}-"
        for name in names:
            orphan = name.endswith(SHARD_SUFFIX) and name not in indexed
            if name.startswith(prefix) and (name.endswith(TMP_SUFFIX) or orphan):
                storage.remove(name)
        self.generation = max(self.generation, generation)
        return removed

    def close(self) -> None:
        """Write everything and stop the thread (idempotent).

        Raises:
            RecorderStateError: the thread failed to write a shard.
        """
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            thread = self._thread
            if thread is not None:
                with self._cond:
                    self._queue.append(("stop", 0))
                    self._cond.notify_all()
                thread.join()

    def __getstate__(self) -> dict[str, Any]:
        # `ddp_spawn` pickles the callbacks, and with them a writer that has not written yet:
        # the lock and the thread do not travel, each copy makes its own.
        if self._thread is not None and self._thread.is_alive():
            raise RecorderStateError(
                f"Expected {self!r} to be closed before it is copied or pickled but its thread "
                "is still writing; call close() first."
            )
        return {k: v for k, v in self.__dict__.items() if k not in ("_cond", "_thread")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _cond=threading.Condition(), _thread=None)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting in the queue now."""
        return self._queued_bytes

    # ------------------------------------------------------------------ writer thread
    def _loop(self) -> None:
        if self.low_priority:
            _lower_priority()
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue.popleft()
            kind = item[0]
            try:
                if kind == "stop":
                    return
                if self._error is None:
                    if kind == "chunks":
                        for meta, tensor, event in item[1]:
                            if event is not None:
                                event.synchronize()
                            self._pending.append((meta, tensor))
                            self._pending_bytes += tensor.nbytes
                            if self._pending_bytes >= self.max_shard_bytes:
                                self._commit()
                    elif kind == "flush":
                        self._commit()
            except BaseException as err:  # kept, raised to the producer on its next call
                self._error = err
                self._pending, self._pending_bytes = [], 0
            finally:
                if kind == "flush":
                    item[1].set()
                with self._cond:
                    self._queued_bytes -= item[-1]
                    self._cond.notify_all()

    def own_index_files(self) -> list[str]:
        """The names of the index files of this writer's run and rank in its storage (one per
        complete shard)."""
        return [n for n, _ in self._own(self.storage.names()) if n.endswith(INDEX_SUFFIX)]

    def run_ranks(self) -> set[int]:
        """The ranks that have files of this writer's run in its storage (any rank's)."""
        return {rank for _, rank, _ in self._of_run(self.storage.names())}

    def run_generation(self) -> int | None:
        """The latest generation of this writer's run over the complete shards of every rank in
        its storage (``None``: none). A rank's generations never go down from one shard to the
        next, so its last index file holds its largest: one read per rank, however many shards
        the run has."""
        last: dict[int, tuple[int, str]] = {}  # rank -> (seq, name) of its last index file
        for name, rank, seq in self._of_run(self.storage.names()):
            if name.endswith(INDEX_SUFFIX):
                last[rank] = max(last.get(rank, (-1, "")), (seq, name))
        storage = self.storage
        found = [decode_index(storage.read(n), n).get("generation", 0) for _, n in last.values()]
        return max(found, default=None)

    def _own(self, names: Iterable[str]) -> Iterator[tuple[str, int]]:
        """``(name, sequence number)`` of each of ``names`` of this writer's run and rank."""
        for name, rank, seq in self._of_run(names):
            if rank == self.rank:
                yield name, seq

    def _of_run(self, names: Iterable[str]) -> Iterator[tuple[str, int, int]]:
        """``(name, rank, sequence number)`` of each of ``names`` of this writer's run."""
        for name in names:
            parsed = parse_stem(name)
            if parsed is not None and parsed[0] == self.run:
                yield name, parsed[1], parsed[2]

    def _next_stem(self, take: Callable[[str], bool]) -> str:
        """The stem of the next free shard number: ``take(shard name)`` gives the shard that
        name unless a file has it (another writer of this run and rank, writing into the same
        directory at the same time, took the number); then the next number is tried."""
        if self._seq is None:
            taken = [seq for _, seq in self._own(self.storage.names())]
            self._seq = max(taken, default=-1) + 1
        seq = self._seq
        while not take(stem(self.run, self.rank, seq) + SHARD_SUFFIX):
            self._warn_shared(seq)
            seq += 1
        self._seq = seq + 1
        return stem(self.run, self.rank, seq)

    def _warn_shared(self, seq: int) -> None:
        if self._shared:
            return
        self._shared = True
        warnings.warn(
            f"{self!r}: shard number {seq} was taken by another writer, which is writing the "
            f"same run {self.run!r} and rank {self.rank} into {self.storage.url!r} at the same "
            "time; this writer's shards take the next free numbers, so both writers' shards "
            "are kept and ActivationDataset reads the rows of both. Give each writer its own "
            "`run` (or leave `run` out for a fresh id), or its own `rank`.",
            UserWarning,
            stacklevel=2,
        )

    def _commit(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        tensors: dict[str, torch.Tensor] = {}
        chunks: list[dict[str, Any]] = []
        for number, ((source, module, base, call, indices), tensor) in enumerate(pending):
            key = f"{source}/{module}/{number}"
            tensors[key] = tensor
            chunks.append(
                {
                    "key": key,
                    "source": source,
                    "module": module,
                    **base,
                    "call": call,
                    "sample_index": indices,
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "shape": list(tensor.shape),
                }
            )
        metadata = {
            "format": FORMAT,
            "version": str(VERSION),
            "run": self.run,
            "rank": str(self.rank),
        }
        storage = self.storage
        # Written under a name of its own, then given the first free number: a writer never
        # replaces a shard (nor so an index file) that another one wrote.
        tmp = f"{self.run}-rank{self.rank:05d}-{uuid.uuid4().hex[:12]}{SHARD_SUFFIX}{TMP_SUFFIX}"
        size = storage.write_tensors(tmp, tensors, metadata, self.fsync)
        try:
            name = self._next_stem(lambda shard: storage.publish(tmp, shard))
        except BaseException:
            storage.remove(tmp)
            raise
        shard = name + SHARD_SUFFIX
        entry = {
            "format": FORMAT,
            "version": VERSION,
            "run": self.run,
            "rank": self.rank,
            "seq": int(name.rsplit("-", 1)[1]),
            "generation": self.generation,
            "shard": shard,
            "bytes": size,
            "chunks": chunks,
        }
        index = encode_index(entry)
        try:
            storage.write_atomic(
                name + INDEX_SUFFIX, lambda handle: handle.write(index), self.fsync
            )
        except BaseException:  # a shard no index lists is never read: none is left
            storage.remove(shard)
            raise
        if self.fsync:
            storage.sync_directory()
        self.rows_written += sum(len(c["sample_index"]) for c in chunks)
        self.bytes_written += size
        self.shards_written += 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.storage.url!r}, run={self.run!r}, rank={self.rank})"
