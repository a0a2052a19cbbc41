"""`TensorBoardLogger`: Lightning's logger with its event file checksummed in C.

The record writer (TFRecord framing of TensorBoard's own ``Event`` messages, checksums of the
``google-crc32c`` wheel) against TensorBoard's pure-Python checksum and its own readers; the
``SummaryWriter`` built on it; the logger in real Trainer runs, with and without the wheel; and
no private attribute of TensorBoard's writers read or written anywhere in the package.
"""

from __future__ import annotations

import doctest
import errno
import inspect
import io
import os
import pickle
import re
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.models import QUIET, ProbeNet, events, features, loader, scalars
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as tb_crc
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter

from lightning_recorder import FeatureStatsMonitor, RecorderStateError, TensorBoardLogger
from lightning_recorder.callbacks import tensorboard_logger
from lightning_recorder.callbacks._event_file import (
    ChecksummedSummaryWriter,
    EventFileWriter,
    c_checksum,
    frame,
    masked,
    python_checksum,
)

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_recorder"
THREAD = "lightning_recorder event file"

pytestmark = pytest.mark.skipif(c_checksum() is None, reason="the dev extra installs google-crc32c")


def records(path: str | Path) -> list[bytes]:
    """The records of an event file, read by TensorBoard's own TFRecord reader, which checks
    both checksums of every record (a mismatch raises ``DataLossError``)."""
    reader = tb_crc.PyRecordReader_New(str(path))
    found = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return found
        found.append(reader.record())


def event_files(log_dir: str | Path) -> list[Path]:
    return sorted(Path(log_dir).glob("events.out.tfevents.*"))


def no_writer_thread() -> bool:
    return not any(t.name == THREAD for t in threading.enumerate())


# ------------------------------------------------------------------ the checksum and the framing
def test_the_c_checksum_is_crc32c() -> None:
    crc = c_checksum()
    assert crc is not None
    assert crc(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc(b"") == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=5000))
def test_checksums_are_tensorboards_pure_python_ones(data: bytes) -> None:
    crc = c_checksum()
    assert crc is not None
    assert crc(data) == tb_crc.crc32c(data)
    assert masked(crc(data)) == tb_crc.masked_crc32c(data)
    assert python_checksum()(data) == tb_crc.crc32c(data)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=3000))
def test_a_frame_is_the_record_tensorboard_writes(data: bytes) -> None:
    crc = c_checksum()
    assert crc is not None
    theirs = io.BytesIO()
    RecordWriter(theirs).write(data)
    assert frame(data, crc) == theirs.getvalue()
    assert frame(data, python_checksum()) == theirs.getvalue()


# ------------------------------------------------------------------ the event file
def _summary(step: int) -> Summary:
    summary = Summary()
    summary.value.add(tag="loss", simple_value=1.0 / (step + 1))
    histo = summary.value.add(tag="h").histo
    histo.num, histo.min, histo.max = 3.0, 0.0, 2.0
    histo.bucket_limit.extend([0.0, 1.0, 2.0])
    histo.bucket.extend([0.0, 1.0, 2.0])
    return summary


def test_event_file_records_pass_tensorboards_checks_and_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    writer = EventFileWriter(str(tmp_path), flush_secs=0.01)
    for step in range(5):
        writer.add_summary(_summary(step), step)
    writer.close()
    (path,) = event_files(tmp_path)
    assert re.fullmatch(r"events\.out\.tfevents\.\d{10}\.[^.]+.*\.\d+\.r\d+", path.name)
    raw = [Event.FromString(r) for r in records(path)]
    assert raw[0].file_version == "brain.Event:2"
    assert raw[0].source_metadata.writer == "lightning_recorder"
    assert [e.step for e in raw[1:]] == [0, 1, 2, 3, 4]
    assert [e.summary for e in raw[1:]] == [_summary(step) for step in range(5)]
    loaded = list(LegacyEventFileLoader(str(path)).Load())
    assert [e.SerializeToString() for e in loaded] == [e.SerializeToString() for e in raw]
    assert no_writer_thread()


def test_a_corrupted_record_fails_tensorboards_check(tmp_path: Path) -> None:
    writer = EventFileWriter(str(tmp_path))
    writer.add_summary(_summary(0), 0)
    writer.close()
    (path,) = event_files(tmp_path)
    assert len(records(path)) == 2
    data = bytearray(path.read_bytes())
    data[-6] ^= 0x01  # a bit of the last record's data
    path.write_bytes(bytes(data))
    with pytest.raises(errors.DataLossError, match="crc32 check"):
        records(path)


def test_event_file_with_the_pure_python_checksum_is_the_same_file_format(
    tmp_path: Path,
) -> None:
    writer = EventFileWriter(str(tmp_path), checksum=python_checksum())
    writer.add_summary(_summary(3), 3)
    writer.close()
    (path,) = event_files(tmp_path)
    assert Event.FromString(records(path)[1]).summary == _summary(3)


def test_event_file_writer_errors_and_reopen(tmp_path: Path) -> None:
    def failing(data: bytes) -> int:
        raise OSError("disk on fire")

    with pytest.raises(RecorderStateError, match=r"writer thread failed: OSError\('disk on fire'"):
        EventFileWriter(str(tmp_path / "a"), checksum=failing)  # the file's header
    assert no_writer_thread()  # nothing left running

    calls = []

    def fails_later(data: bytes) -> int:
        calls.append(data)
        if len(calls) > 4:  # two checksums a record: the header and one more record pass
            raise OSError("disk full")
        return tb_crc.crc32c(data)

    writer = EventFileWriter(str(tmp_path / "c"), checksum=fails_later, max_queue=1)
    with pytest.raises(RecorderStateError, match=r"writer thread failed: OSError\('disk full'"):
        for step in range(3):  # the error comes back on a later call
            writer.add_summary(_summary(step), step)
            writer.flush()
    with pytest.raises(RecorderStateError, match="writer thread failed"):
        writer.close()
    assert no_writer_thread()
    writer.close()  # closed: nothing more
    (path,) = event_files(tmp_path / "c")
    assert [Event.FromString(r).step for r in records(path)] == [0, 0]  # what was written holds

    writer = EventFileWriter(str(tmp_path / "b"))
    writer.close()
    with pytest.raises(RecorderStateError, match=r"closed; call reopen\(\)"):
        writer.add_summary(_summary(0), 0)
    writer.flush()  # closed: nothing to write
    writer.reopen()
    writer.add_summary(_summary(1), 1)
    writer.close()
    files = event_files(tmp_path / "b")
    assert len(files) == 2  # reopen starts a new file
    assert Event.FromString(records(files[1])[1]).step == 1


def test_two_writers_of_one_second_get_two_files(tmp_path: Path) -> None:
    first, second = EventFileWriter(str(tmp_path)), EventFileWriter(str(tmp_path))
    first.close()
    second.close()
    assert len(event_files(tmp_path)) == 2


def test_filewriters_methods_not_overridden_only_call_add_event() -> None:
    """``add_summary``, ``add_graph`` and ``add_onnx_graph`` are ``FileWriter``'s own: they must
    reach the file through ``add_event`` only (a new torch that changes that fails here)."""
    inherited = [
        name
        for name, member in inspect.getmembers(FileWriter, inspect.isfunction)
        if not name.startswith("_") and name not in vars(EventFileWriter)
    ]
    assert sorted(inherited) == ["add_graph", "add_onnx_graph", "add_summary"]
    for name in inherited:
        source = inspect.getsource(getattr(FileWriter, name))
        assert "self.add_event(" in source and "event_writer" not in source, name


# ------------------------------------------------------------------ the SummaryWriter
def test_checksummed_summary_writer_is_a_summary_writer_with_one_file(tmp_path: Path) -> None:
    stock = SummaryWriter(str(tmp_path / "stock"))
    ours = ChecksummedSummaryWriter(str(tmp_path / "ours"), filename_suffix=".x", purge_step=5)
    try:
        assert set(vars(stock)) <= set(vars(ours))  # every attribute torch's methods read
        assert isinstance(ours.file_writer, EventFileWriter) and ours.filename_suffix == ".x"
        ours.add_scalar("a", 1.5, 6)
        ours.add_histogram("w", np.arange(10.0), 6)
        ours.add_text("note", "hello", 6)
        ours.add_scalars("pair", {"x": 1.0, "y": 2.0}, 6)  # extra runs: TensorBoard's writers
        ours.flush()
    finally:
        stock.close()
        ours.close()
    (path,) = event_files(tmp_path / "ours")  # the discarded file of the base class is gone
    assert path.name.endswith(".x")
    steps_and_kinds = [(e.step, e.WhichOneof("what")) for e in map(Event.FromString, records(path))]
    assert steps_and_kinds[:3] == [(0, "file_version"), (5, "file_version"), (5, "session_log")]
    acc = events(tmp_path / "ours")
    assert acc.Scalars("a")[0].value == 1.5 and acc.Histograms("w")[0].step == 6
    assert sorted(p.name for p in (tmp_path / "ours").iterdir() if p.is_dir()) == [
        "pair_x",
        "pair_y",
    ]
    assert no_writer_thread()


def test_summary_writer_written_after_close_opens_tensorboards_writer(tmp_path: Path) -> None:
    ours = ChecksummedSummaryWriter(str(tmp_path))
    ours.add_scalar("a", 1.0, 0)
    ours.close()
    ours.add_scalar("a", 2.0, 1)  # the base class opens its own writer again
    ours.close()
    assert len(event_files(tmp_path)) == 2
    for path in event_files(tmp_path):
        records(path)  # both pass TensorBoard's checks
    # two files of one second: TensorBoard orders them by name, not by age
    assert sorted((e.step, e.value) for e in events(tmp_path).Scalars("a")) == [(0, 1.0), (1, 2.0)]


# ------------------------------------------------------------------ the logger
def _fit(logger: pl.loggers.Logger, steps: int = 3) -> FeatureStatsMonitor:
    x = features(12, seed=3)
    x[::4, 0] = 25.0  # outliers: empty buckets to collapse
    monitor = FeatureStatsMonitor(["probe", "body.1"], every_n_steps=1, bins=30)
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=steps, callbacks=[monitor])
    torch.manual_seed(0)
    trainer.fit(ProbeNet(lr=1e-3), loader(x))
    return monitor


def test_logger_writes_what_lightnings_logger_writes(tmp_path: Path) -> None:
    ours = TensorBoardLogger(tmp_path, name="ours", prefix="run")
    theirs = LightningTensorBoardLogger(tmp_path, name="theirs", prefix="run")
    assert ours.checksums_in_c
    for logger in (ours, theirs):  # Lightning writes the hparams plugin's summaries itself
        logger.log_hyperparams({"lr": 1e-3, "depth": 2})
        _fit(logger)
    assert no_writer_thread()  # finalize closed the file
    (path,) = event_files(ours.log_dir)
    kinds = [Event.FromString(r) for r in records(path)]  # each passes TensorBoard's checks
    assert kinds[0].source_metadata.writer == "lightning_recorder"  # the package's writer
    assert len(kinds) == 1 + 1 + 3 + 3  # header, hp_metric, hparams (3), the logged steps
    assert set(events(ours.log_dir).PluginTagToContent("hparams")) == {
        "_hparams_/experiment",
        "_hparams_/session_start_info",
        "_hparams_/session_end_info",
    }
    assert (Path(ours.log_dir) / "hparams.yaml").is_file()
    got, want = scalars(ours.log_dir), scalars(theirs.log_dir)
    # the monitor writes its events itself: with the package's logger they carry its public
    # prefix; Lightning's logger keeps its prefix private, and applies it in `log_metrics` only
    assert "stats/train/probe/mean" in want and "run-hp_metric" in want
    want = {f"run-{t}" if t.startswith("stats/") else t: series for t, series in want.items()}
    assert set(got) == set(want) and "run-hp_metric" in got
    assert "run-stats/train/probe/mean" in got
    for tag, series in want.items():  # the same run; float32 values, a tolerance of rounding
        assert set(got[tag]) == set(series), tag
        for step, value in series.items():
            assert got[tag][step] == pytest.approx(value, rel=1e-5, abs=1e-6), (tag, step)
    tag = "stats/train/probe/histogram"
    got_h = events(ours.log_dir).Histograms(f"run-{tag}")
    want_h = events(theirs.log_dir).Histograms(tag)
    assert [e.step for e in got_h] == [e.step for e in want_h] == [0, 1, 2]
    for a, b in zip(got_h, want_h, strict=True):
        assert list(a.histogram_value.bucket) == list(b.histogram_value.bucket)
        assert len(a.histogram_value.bucket) < 31  # collapsed
        np.testing.assert_allclose(
            a.histogram_value.bucket_limit, b.histogram_value.bucket_limit, rtol=1e-6
        )


def test_logger_writes_a_test_after_fit_through_its_own_writer(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="fit_test")
    monitor = FeatureStatsMonitor(["probe"], every_n_steps=1, stages=["train", "test"])
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[monitor])
    model = ProbeNet()
    trainer.fit(model, loader(features(8)))
    trainer.test(model, loader(features(8, seed=1)))  # after fit's finalize closed the writer
    files = event_files(logger.log_dir)
    assert len(files) == 2  # fit's file, and the test's
    for path in files:  # each written by the package's writer, and passing TensorBoard's checks
        header = Event.FromString(records(path)[0])
        assert header.source_metadata.writer == "lightning_recorder", path.name
    assert set(scalars(logger.log_dir)["stats/test/probe/mean"]) == {2}
    assert no_writer_thread()


def _open_event_files() -> list[str]:
    """The event files this process holds open (Linux: its file descriptors)."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since it was listed (the listing's own descriptor)
            continue
        if "tfevents" in target:
            found.append(target)
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="lists open files from /proc")
def test_a_disk_that_fails_during_the_fit_leaves_no_writer_thread_or_open_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checksum = c_checksum()
    assert checksum is not None
    calls = []

    def fails_later(data: bytes) -> int:  # the writer thread's step before the disk: it fails
        calls.append(data)
        if len(calls) > 6:  # the header and two more records pass
            raise OSError("disk full")
        return checksum(data)

    monkeypatch.setattr(tensorboard_logger, "_c_checksum", lambda: fails_later)
    before = _open_event_files()
    with (
        pytest.warns(UserWarning, match=r"could not finish its event file in .*full"),
        pytest.raises(RecorderStateError, match=r"writer thread failed: OSError\('disk full'"),
    ):
        _fit(TensorBoardLogger(tmp_path, name="full"), steps=6)
    # finalize("failed") ended the thread and closed the file, though flushing them failed, and
    # warned: the error raised is the fit's own (the logging call that found the thread failed)
    assert no_writer_thread()
    assert _open_event_files() == before
    (path,) = event_files(tmp_path / "full" / "version_0")
    assert len(records(path)) == 3  # what was written before the failure holds


def _disk_full(self: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="lists open files from /proc")
def test_a_writer_that_cannot_finish_after_a_failed_step_leaves_the_steps_error_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning calls ``finalize("failed")`` after the run raised: an error of finishing the
    event file there replaced the run's own (``fit`` raised the ``OSError``); it is a warning."""
    logger = TensorBoardLogger(tmp_path, name="failed")
    model = ProbeNet()

    def fails(module: ProbeNet, batch_idx: int) -> None:  # the disk fills up, the step fails
        if batch_idx == 1:
            monkeypatch.setattr(EventFileWriter, "flush", _disk_full)
            raise ValueError("the step's own error")

    model.step_hook = fails
    before = _open_event_files()
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=4)
    with pytest.warns(UserWarning) as caught, pytest.raises(ValueError, match="step's own error"):
        trainer.fit(model, loader(features(12)))
    [told] = [str(w.message) for w in caught if "event file" in str(w.message)]
    assert told.startswith(
        f"TensorBoardLogger could not finish its event file in {logger.log_dir} after the run "
        "failed (OSError: [Errno 28] No space left on device)"
    )
    assert no_writer_thread()  # the writer is closed all the same
    assert _open_event_files() == before
    (path,) = event_files(logger.log_dir)
    assert Event.FromString(records(path)[0]).source_metadata.writer == "lightning_recorder"


def test_a_writer_that_cannot_finish_a_run_that_did_not_fail_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for status in ("success", "finished"):
        logger = TensorBoardLogger(tmp_path, name=status)
        logger.log_metrics({"a": 1.0}, step=0)
        with monkeypatch.context() as patch:
            patch.setattr(EventFileWriter, "flush", _disk_full)
            with pytest.raises(OSError, match="No space left"):
                logger.finalize(status)
        assert no_writer_thread()


def test_lightnings_writer_that_cannot_finish_after_a_failed_run_warns_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "google_crc32c", None)  # TensorBoard's own writer
    with pytest.warns(UserWarning, match="google-crc32c"):
        logger = TensorBoardLogger(tmp_path, name="plain")
    logger.log_metrics({"a": 1.0}, step=0)
    monkeypatch.setattr(SummaryWriter, "flush", _disk_full)
    with pytest.warns(UserWarning, match=r"could not finish .*\(OSError: \[Errno 28\]"):
        logger.finalize("failed")


def test_logger_without_the_wheel_is_lightnings_logger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "google_crc32c", None)  # `import google_crc32c` fails
    assert c_checksum() is None
    with pytest.warns(UserWarning, match=r"no C CRC-32C \(the google-crc32c wheel\).*pip install"):
        logger = TensorBoardLogger(tmp_path, name="plain")
    assert not logger.checksums_in_c
    _fit(logger, steps=2)
    assert type(logger.experiment) is SummaryWriter  # TensorBoard's own writer
    assert "stats/train/probe/mean" in scalars(logger.log_dir)
    assert events(logger.log_dir).Histograms("stats/train/probe/histogram")


def test_logger_without_tensorboard_names_the_extra_when_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its writer is TensorBoard's: without TensorBoard it said Lightning's "Neither tensorboard
    nor tensorboardX is available" (tensorboardX would not do); it names the package's extra."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(RecorderStateError) as caught:
        TensorBoardLogger(tmp_path)
    message = str(caught.value)
    assert message.startswith("Expected TensorBoard to be installed for TensorBoardLogger")
    assert '`pip install "lightning-recorder[fast-tensorboard]"`' in message
    assert not list(tmp_path.iterdir())  # nothing made


def test_logger_with_tensorboard_older_than_2_12_says_so_not_that_the_wheel_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard 2.11 (the ``tensorboard`` extra's bound) has no ``event_pb2.SourceMetadata``,
    which the record writer needs: the logger said it found no google-crc32c wheel, installed
    there, and the extra's line did not say why it would help (it upgrades TensorBoard)."""
    from tensorboard.compat.proto import event_pb2

    monkeypatch.delattr(event_pb2, "SourceMetadata")
    monkeypatch.setattr("tensorboard.__version__", "2.11.0")
    monkeypatch.delitem(sys.modules, "lightning_recorder.callbacks._event_file")
    with pytest.warns(UserWarning) as caught:
        logger = TensorBoardLogger(tmp_path, name="old")
    [told] = [str(w.message) for w in caught if "TensorBoard 2.12" in str(w.message)]
    assert told.startswith(
        "TensorBoardLogger needs TensorBoard 2.12 or later for its record writer but found 2.11.0"
    )
    assert "google-crc32c" not in told
    assert told.endswith('To checksum in C: pip install "lightning-recorder[fast-tensorboard]"')
    assert not logger.checksums_in_c


def test_the_wheels_pure_python_fallback_counts_as_no_wheel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import google_crc32c

    monkeypatch.setattr(google_crc32c, "implementation", "python")
    assert c_checksum() is None


def test_logger_with_a_remote_save_dir_uses_tensorboards_writer() -> None:
    with pytest.warns(UserWarning, match=r"remote save_dir \(memory://runs\)"):
        logger = TensorBoardLogger("memory://runs", name="remote")
    assert not logger.checksums_in_c


def test_logger_pickles_without_its_writer(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="p", max_queue=3, flush_secs=1)
    logger.log_metrics({"a": 1.0}, step=0)
    copy = pickle.loads(pickle.dumps(logger))
    logger.finalize("success")
    assert copy.checksums_in_c and copy.log_dir == logger.log_dir
    copy.log_metrics({"a": 2.0}, step=1)  # a writer of its own, a file of its own
    copy.finalize("success")
    assert len(event_files(logger.log_dir)) == 2
    assert sorted((e.step, e.value) for e in events(logger.log_dir).Scalars("a")) == [
        (0, 1.0),
        (1, 2.0),
    ]
    assert no_writer_thread()


def test_logger_docstring_example_runs() -> None:
    result = doctest.testmod(tensorboard_logger, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0


# ------------------------------------------------------------------ no private attribute
# TensorBoard's and torch's private writer attributes: the file writer getter, the chain to the
# record writer (`event_writer._async_writer._writer`), wherever read or written on an object.
PRIVATE = re.compile(r"_get_file_writer|\b_async_writer\b|\bevent_writer\b|[\w)\]]\._writer\b")


def test_the_package_touches_no_private_attribute_of_tensorboards_writers() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert found == []
    assert PRIVATE.search("writer._get_file_writer().event_writer._async_writer._writer")


# ------------------------------------------------------------------ the cost of a slow checksum
class _Deep(pl.LightningModule):
    """``depth`` small linear layers: an event of about 0.9 KiB per layer with the defaults."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(depth)])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _checksum_warnings(logger: pl.loggers.Logger, depth: int) -> list[str]:
    """The warnings about the checksum's cost of a run of three logged steps (each of
    Lightning's category for a possible performance problem)."""
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    monitor = FeatureStatsMonitor("net.*", every_n_steps=1)
    trainer = pl.Trainer(max_steps=3, logger=logger, callbacks=[monitor], **QUIET)
    with pytest.warns() as caught:  # every warning of the run, whichever there are
        trainer.fit(_Deep(depth), loader(features(12)))
    assert monitor.logged_steps == 3
    told = [w for w in caught if "per logged step" in str(w.message)]
    assert all(w.category is PossibleUserWarning for w in told)
    return [str(w.message) for w in told]


def test_monitor_warns_once_of_tensorboards_pure_python_checksum_of_a_large_event(
    tmp_path: Path,
) -> None:
    from lightning_recorder.callbacks._tensorboard import SLOW_CHECKSUM_BYTES

    logger = LightningTensorBoardLogger(tmp_path, name="large")
    (told,) = _checksum_warnings(logger, depth=48)  # three logged steps, one warning
    size = int(re.search(r"writes (\d+) KiB", told).group(1))  # type: ignore[union-attr]
    assert size * 1024 > SLOW_CHECKSUM_BYTES
    assert "pure Python" in told and "lightning_recorder.TensorBoardLogger" in told
    assert "fast-tensorboard" in told and "every_n_steps" in told and "Reported once" in told
    (path,) = event_files(logger.log_dir)  # the size said is that of the events written
    written = [len(r) for r in records(path) if Event.FromString(r).summary.value]
    assert len(written) == 3 and all(abs(n / 1024 - size) <= 1 for n in written)
    # a second monitor (another run) says it again, once
    assert len(_checksum_warnings(LightningTensorBoardLogger(tmp_path, name="again"), 48)) == 1


def test_monitor_says_nothing_of_a_small_event_or_a_c_checksum(tmp_path: Path) -> None:
    # a few layers: a small event, its pure-Python checksum a millisecond or two
    assert _checksum_warnings(LightningTensorBoardLogger(tmp_path, name="small"), depth=4) == []
    # the package's logger checksums in C: the same large event, nothing to say
    ours = TensorBoardLogger(tmp_path, name="ours")
    assert ours.checksums_in_c
    assert _checksum_warnings(ours, depth=48) == []


def test_monitor_leaves_the_package_logger_without_the_wheel_to_warn_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "google_crc32c", None)
    with pytest.warns(UserWarning, match="no C CRC-32C"):  # said once, when it is made
        logger = TensorBoardLogger(tmp_path, name="plain")
    assert type(logger.experiment) is SummaryWriter  # TensorBoard's own writer after all
    assert _checksum_warnings(logger, depth=48) == []
