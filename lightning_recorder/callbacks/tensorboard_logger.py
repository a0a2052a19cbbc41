"""`TensorBoardLogger`: Lightning's TensorBoard logger, with its event file checksummed in C."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from typing_extensions import override

from .._core.checks import check_int, check_number, installed
from ..errors import RecorderConfigError, RecorderStateError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from ._event_file import Checksum

__all__ = ["TensorBoardLogger"]

_WRITER_OPTIONS = ("comment", "purge_step", "max_queue", "flush_secs", "filename_suffix")
_EXTRA = 'pip install "lightning-recorder[fast-tensorboard]"'


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` whose event file is checksummed in C.

    Every record of a TensorBoard event file carries two CRC-32C checksums, and TensorBoard's
    writer computes them in pure Python: about 0.3 ms per KiB written, on its writer thread,
    holding the GIL the training thread needs (a logged step of
    :class:`~lightning_recorder.FeatureStatsMonitor` writes about 1 KiB per monitored module).
    This logger's ``experiment`` is a ``torch.utils.tensorboard.SummaryWriter`` whose event file
    is written by a small writer of this package: TensorBoard's own ``Event`` messages, framed
    as TFRecords (the documented format every TensorBoard reads), with the checksums of the
    ``google-crc32c`` wheel, on a background thread as TensorBoard's writer does. Everything
    else is Lightning's logger: the arguments, the directories, hyperparameters, the graph, and
    every ``SummaryWriter`` method on ``experiment``.

    Without the wheel (``pip install "lightning-recorder[fast-tensorboard]"`` installs it), or
    with a remote ``save_dir`` (a URL), it warns once and writes through TensorBoard's own
    writer, exactly as Lightning's logger does.

    Args:
        save_dir: the directory of the runs (``save_dir/name/version``).
        name: the experiment's name.
        version: the run's version (by default the next free ``version_N``).
        log_graph: add the model's graph (``example_input_array``).
        default_hp_metric: log ``hp_metric`` with the hyperparameters.
        prefix: put before every metric key (joined with ``-``), and before the tags the
            package's callbacks write to this logger's events (see :attr:`prefix`).
        sub_dir: a directory inside the run's.
        **kwargs: ``SummaryWriter`` options: ``max_queue``, ``flush_secs``,
            ``filename_suffix``, ``purge_step``, ``comment``.

    Raises:
        RecorderConfigError: ``save_dir`` is not a path, or a keyword argument is not a
            ``SummaryWriter`` option or not of its type (``max_queue`` and ``purge_step`` a
            non-negative int, ``flush_secs`` a positive number, ``comment`` and
            ``filename_suffix`` a str).
        RecorderStateError: TensorBoard is not installed (its writer writes the event files).

    Examples:
        >>> import tempfile
        >>> from lightning_recorder import TensorBoardLogger
        >>> logger = TensorBoardLogger(tempfile.mkdtemp(), name="run")
        >>> logger.log_metrics({"loss": 0.25}, step=0)
        >>> logger.finalize("success")
        >>> logger.version
        0
    """

    def __init__(
        self,
        save_dir: str | Path,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = [key for key in kwargs if key not in _WRITER_OPTIONS]
        if unknown:
            raise RecorderConfigError(
                f"Expected keyword arguments of {type(self).__name__} to be SummaryWriter "
                f"options ({', '.join(map(repr, _WRITER_OPTIONS))}) but got "
                f"{', '.join(map(repr, unknown))}."
            )
        _check_options(save_dir, kwargs, type(self).__name__)
        if not installed("tensorboard"):  # its writer is TensorBoard's (torch.utils.tensorboard)
            raise RecorderStateError(
                f"Expected TensorBoard to be installed for {type(self).__name__} but it is not: "
                f"its event files are written by TensorBoard's writer. Install it: `{_EXTRA}` "
                "(TensorBoard and the google-crc32c wheel that checksums its records in C)."
            )
        super().__init__(
            save_dir,
            name=name,
            version=version,
            log_graph=log_graph,
            default_hp_metric=default_hp_metric,
            prefix=prefix,
            sub_dir=sub_dir,
            **kwargs,
        )
        self._event_options = kwargs
        self._own_prefix = prefix
        self._events: SummaryWriter | None = None
        self._fast = _c_checksum() is not None
        if "://" in str(save_dir):
            self._fast = False
            rank_zero_warn(
                f"{type(self).__name__} writes a remote save_dir ({save_dir}) through "
                "TensorBoard's own writer, which checksums each record in pure Python."
            )
        elif not self._fast:
            rank_zero_warn(
                f"{type(self).__name__} {_why_no_c_checksum()}, so it "
                "writes through TensorBoard's own writer, which checksums each record in pure "
                f"Python (about 0.3 ms per KiB). To checksum in C: {_EXTRA}"
            )

    @property
    def prefix(self) -> str:
        """The ``prefix`` argument: put before every metric key, joined with ``-``. The package's
        callbacks write their TensorBoard events to the writer themselves (one event per logged
        step, not one ``log_metrics`` call per tag) and read it here, so that their tags carry it
        as ``log_metrics`` keys do. (Lightning's own loggers keep their prefix to themselves.)"""
        return self._own_prefix

    @property
    def checksums_in_c(self) -> bool:
        """Whether the event file is written by this package's writer, checksummed in C."""
        return self._fast

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> SummaryWriter:
        """The ``SummaryWriter`` (on rank 0; other ranks get Lightning's stand-in). After
        :meth:`finalize` closed it, a new one with a file of its own (a ``test`` after ``fit``)."""
        if self._events is not None and self._events.file_writer is not None:  # open
            return self._events
        checksum = _c_checksum() if self._fast else None
        if checksum is None:
            return super().experiment  # Lightning's own writer
        from ._event_file import ChecksummedSummaryWriter

        self._events = ChecksummedSummaryWriter(
            self.log_dir, checksum=checksum, **self._event_options
        )
        return self._events

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Write what is queued and close the writer (Lightning's too, and ``hparams.yaml`` on
        ``"success"``). Where that fails (a full disk, a removed folder), the package's writer is
        closed all the same and the error raised; with ``status="failed"`` (the Trainer's, after
        the run raised) it is one warning naming the log dir and the error instead, so that the
        run's own error is the one raised."""
        if status != "failed":
            try:
                super().finalize(status)  # Lightning's: its own writer (if any), hparams.yaml
            finally:
                if self._events is not None:  # writes what is queued; closed even when that fails
                    self._events.close()
            return
        failures: list[Exception] = []
        try:
            super().finalize(status)
        except Exception as err:  # the run's own error is the one to see
            failures.append(err)
        if self._events is not None:
            try:
                self._events.close()
            except Exception as err:
                failures.append(err)
        if failures:
            errors = "; ".join(f"{type(e).__name__}: {str(e).strip()[:300]}" for e in failures)
            rank_zero_warn(
                f"{type(self).__name__} could not finish its event file in {self.log_dir} after "
                f"the run failed ({errors}); the events written since its last flush may be "
                "lost; the run's own error is the one raised. Free space there, or pass another "
                "save_dir."
            )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_events"] = None  # a writer thread and an open file do not travel
        return state


def _check_options(save_dir: object, options: dict[str, Any], owner: str) -> None:
    """Refuse a ``save_dir`` that is not a path and a ``SummaryWriter`` option of the wrong type
    or range when the logger is made: the writer is only opened when the run starts, where
    TensorBoard's writer thread would fail on them (or spin, flushing without pause)."""
    if not isinstance(save_dir, (str, os.PathLike)):
        raise RecorderConfigError(
            f"Expected `save_dir` of {owner} to be a path or a URL such as 's3://bucket/logs' "
            f"but got {save_dir!r}."
        )
    for name in ("comment", "filename_suffix"):
        if name in options and not isinstance(options[name], str):
            raise RecorderConfigError(
                f"Expected `{name}` of {owner} to be a str but got {options[name]!r}."
            )
    if "purge_step" in options:
        check_int(options["purge_step"], "purge_step", owner, minimum=0, allow_none=True)
    if "max_queue" in options:
        check_int(options["max_queue"], "max_queue", owner, minimum=0)
    if "flush_secs" in options:
        check_number(options["flush_secs"], "flush_secs", owner, positive=True, allow_zero=False)


def _why_no_c_checksum() -> str:
    """Why :func:`_c_checksum` found none, as the warning says it."""
    try:
        from ._event_file import c_checksum  # noqa: F401
    except ImportError:
        try:
            from tensorboard import __version__ as version
        except ImportError:
            return "found no tensorboard (its record writer writes TensorBoard's messages)"
        return f"needs TensorBoard 2.12 or later for its record writer but found {version}"
    return "found no C CRC-32C (the google-crc32c wheel)"


def _c_checksum() -> Checksum | None:
    """The C CRC-32C, or ``None`` without it (or without tensorboard: Lightning's logger then
    writes through tensorboardX)."""
    try:
        from ._event_file import c_checksum
    except ImportError:
        return None
    return c_checksum()
