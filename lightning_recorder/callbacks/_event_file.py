"""TensorBoard event files checksummed by a C CRC-32C: the writer of
:class:`~lightning_recorder.TensorBoardLogger`.

An event file is a sequence of records, each one of TensorBoard's own ``Event`` messages
(``tensorboard.compat.proto.event_pb2``), serialized by protobuf and framed as a TFRecord, the
documented format every TensorBoard reads::

    uint64 length | uint32 masked CRC-32C of the length bytes | data | uint32 masked CRC-32C of data

little-endian, each CRC-32C (Castagnoli) masked as ``((crc >> 15) | (crc << 17)) + 0xa282ead8``
modulo 2**32. TensorBoard's own writer computes both checksums in pure Python (about 0.3 ms
per KiB, on its writer thread, holding the GIL the training thread needs);
:class:`EventFileWriter` computes them with the ``google-crc32c`` wheel, on a writer thread of
its own as TensorBoard's does. :class:`ChecksummedSummaryWriter` is a
``torch.utils.tensorboard.SummaryWriter`` that writes its event file through it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event, SessionLog, SourceMetadata
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter

from ..errors import RecorderStateError

Checksum = Callable[[bytes], int]
"""A CRC-32C (Castagnoli) of bytes, unmasked."""

_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_STOP = object()  # the writer thread's signal to end
# Tells apart the files one process opens in one second; the letter keeps them apart from the
# files of TensorBoard's own writer, numbered by a counter of its own from 0 as well.
_NUMBERS = itertools.count()


def c_checksum() -> Checksum | None:
    """``google_crc32c.value``, the CRC-32C in C, or ``None`` where the wheel is not installed
    or runs its pure-Python fallback (it does where its C extension cannot load)."""
    try:
        import google_crc32c
    except ImportError:
        return None
    if google_crc32c.implementation != "c":
        return None
    value: Checksum = google_crc32c.value
    return value


def python_checksum() -> Checksum:
    """TensorBoard's own pure-Python CRC-32C (what its record writer uses)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c

    value: Checksum = crc32c
    return value


def masked(crc: int) -> int:
    """A CRC-32C masked as TFRecords store it."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes, checksum: Checksum) -> bytes:
    """One TFRecord: the length of ``data``, its masked checksum, ``data``, its masked
    checksum."""
    header = _LENGTH.pack(len(data))
    return b"".join(
        (header, _CRC.pack(masked(checksum(header))), data, _CRC.pack(masked(checksum(data))))
    )


class EventFileWriter(FileWriter):
    """A new event file in ``log_dir``, written by a background thread: ``Event`` messages in,
    TFRecords out (:func:`frame`).

    It offers what ``torch.utils.tensorboard.writer.FileWriter`` offers (``SummaryWriter``
    writes through those methods; ``add_summary``, ``add_graph`` and ``add_onnx_graph`` are
    ``FileWriter``'s own, which call :meth:`add_event`). As TensorBoard's writer does, it
    serializes each event on the calling thread and queues the bytes (``max_queue`` of them; a
    full queue waits for the thread), and the thread frames and writes them and flushes the
    file every ``flush_secs`` seconds. An error of the thread is raised by the next call.

    Args:
        log_dir: the directory (made if missing).
        max_queue: the events that may wait for the writer thread.
        flush_secs: how often the thread flushes the file.
        filename_suffix: added to the file's name (``events.out.tfevents.<time>.<host>.<pid>.
            <number><suffix>``, TensorBoard's naming).
        checksum: the CRC-32C; by default :func:`c_checksum`'s, or TensorBoard's pure-Python one
            without the wheel.
    """

    def __init__(  # FileWriter's own __init__ would open TensorBoard's writer: not called
        self,
        log_dir: str,
        max_queue: int = 10,
        flush_secs: float = 120,
        filename_suffix: str = "",
        checksum: Checksum | None = None,
    ) -> None:
        self._log_dir = str(log_dir)
        self._max_queue, self._flush_secs = max_queue, flush_secs
        self._suffix = filename_suffix
        self._checksum = checksum or c_checksum() or python_checksum()
        self._lock = threading.Lock()
        self._closed = True
        self._start()

    def _start(self) -> None:
        os.makedirs(self._log_dir, exist_ok=True)
        while True:
            name = "events.out.tfevents.%010d.%s.%s.%s%s" % (  # noqa: UP031 - TensorBoard's form
                time.time(),
                socket.gethostname(),
                os.getpid(),
                f"r{next(_NUMBERS)}",
                self._suffix,
            )
            self.path = os.path.join(self._log_dir, name)
            try:
                self._file = open(self.path, "xb")  # noqa: SIM115 - closed by close()
                break
            except FileExistsError:  # another writer's file, of the same second and number
                continue
        self._queue: queue.Queue[Any] = queue.Queue(self._max_queue)
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="lightning_recorder event file", daemon=True
        )
        self._closed = False
        self._thread.start()
        header = Event(
            file_version="brain.Event:2",
            source_metadata=SourceMetadata(writer="lightning_recorder"),
        )
        try:
            self.add_event(header)
            self.flush()
        except BaseException:
            self.close_quietly()
            raise

    def _run(self) -> None:
        """The writer thread: frame and write what is queued, flush every ``flush_secs``."""
        file, pending = self._file, False
        next_flush = time.monotonic() + self._flush_secs
        while True:
            wait = next_flush - time.monotonic()
            try:
                data = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                data = None
            if data is _STOP:
                self._queue.task_done()
                return
            try:
                if data is not None and self._error is None:  # after an error: drained
                    file.write(frame(data, self._checksum))
                    pending = True
                if pending and time.monotonic() >= next_flush:
                    file.flush()
                    pending = False
            except BaseException as err:  # raised on the caller's next call
                self._error = err
            finally:
                if data is not None:
                    self._queue.task_done()
            if time.monotonic() >= next_flush:
                next_flush = time.monotonic() + self._flush_secs

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RecorderStateError(
                f"Expected the event file {self.path} to be written, but its writer thread "
                f"failed: {self._error!r}."
            ) from self._error

    def get_logdir(self) -> str:
        """The directory of the event file."""
        return self._log_dir

    def add_event(self, event: Any, step: int | None = None, walltime: float | None = None) -> None:
        """Queue an ``Event`` (its ``wall_time`` now or ``walltime``, its ``step`` if given).

        Raises:
            RecorderStateError: the file is closed, or the writer thread failed.
        """
        event.wall_time = time.time() if walltime is None else walltime
        if step is not None:
            event.step = int(step)
        data = event.SerializeToString()
        with self._lock:
            if self._closed:
                raise RecorderStateError(
                    f"Expected an open event file but {self.path} is closed; call reopen() to "
                    "start a new one."
                )
            self._raise_error()
            self._queue.put(data)

    def flush(self) -> None:
        """Write every event queued so far and flush the file.

        Raises:
            RecorderStateError: the writer thread failed.
        """
        with self._lock:
            if self._closed:
                return
            self._queue.join()
            self._raise_error()
            self._file.flush()

    def close(self) -> None:
        """Write what is queued, end the writer thread and close the file (again: nothing).

        Raises:
            RecorderStateError: the writer thread failed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join()
            try:
                self._file.flush()
            finally:
                self._file.close()
            self._raise_error()

    def close_quietly(self) -> None:
        """:meth:`close`, an error of the writer thread left unraised."""
        with contextlib.suppress(RecorderStateError):
            self.close()

    def reopen(self) -> None:
        """After :meth:`close`, start a new event file in the same directory."""
        if self._closed:
            self._start()


class ChecksummedSummaryWriter(SummaryWriter):
    """A ``torch.utils.tensorboard.SummaryWriter`` whose event file is an
    :class:`EventFileWriter` (its public ``file_writer``): the same methods, the same
    messages, the checksums in C.

    The arguments are ``SummaryWriter``'s (``log_dir`` required), and ``checksum`` that of
    :class:`EventFileWriter`. ``add_scalars`` writes its extra runs through TensorBoard's own
    writers, and after :meth:`close` the base class opens TensorBoard's own writer again if it
    is written to.
    """

    def __init__(
        self,
        log_dir: str,
        comment: str = "",
        purge_step: int | None = None,
        max_queue: int = 10,
        flush_secs: int = 120,
        filename_suffix: str = "",
        checksum: Checksum | None = None,
    ) -> None:
        # SummaryWriter's __init__ opens an event file through TensorBoard's writer: given a
        # suffix of its own, that file is closed and removed at once (it holds the file header
        # only), and this writer's own file takes its place.
        discarded = f".{uuid.uuid4().hex}.discarded"
        super().__init__(str(log_dir), comment, None, max_queue, flush_secs, discarded)
        if self.file_writer is not None:
            self.file_writer.close()
        for path in Path(self.log_dir).glob(f"*{discarded}"):
            path.unlink()
        self.filename_suffix = filename_suffix
        events = EventFileWriter(self.log_dir, max_queue, flush_secs, filename_suffix, checksum)
        # torch declares both attributes as None (its writer sets them on first use)
        self.file_writer = events  # type: ignore[assignment]
        self.all_writers = {events.get_logdir(): events}  # type: ignore[assignment]
        if purge_step is not None:  # as SummaryWriter does: TensorBoard hides later steps
            events.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            events.add_event(
                Event(step=purge_step, session_log=SessionLog(status=SessionLog.START))
            )

    def close(self) -> None:
        """``SummaryWriter.close``: write what is queued and close every writer. Where writing
        fails (a full disk), every writer is closed all the same, its thread ended and its file
        closed, and the error is raised: ``SummaryWriter`` stops at the first writer whose flush
        fails, and leaves the rest open."""
        writers: list[Any] = list((self.all_writers or {}).values())
        try:
            super().close()
        except BaseException:
            for writer in writers:
                with contextlib.suppress(Exception):  # the first error is the one to see
                    writer.close()
            self.file_writer = self.all_writers = None
            raise
