"""The C CRC-32C of TensorBoard's event records: the same checksums as TensorBoard's own, given to
a logger's event file while a monitor is attached and taken back after."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from helpers.models import QUIET, ProbeNet, features, loader, scalars
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as tb_crc
from tensorboard.summary.writer.record_writer import RecordWriter

from lightning_recorder import FeatureStatsMonitor
from lightning_recorder._core import crc32c, native
from lightning_recorder.callbacks._lightning import native_checksums, restore_checksums

pytestmark = pytest.mark.skipif(not crc32c.available(), reason="no C compiler to build with")


def test_known_value() -> None:
    # the check value of CRC-32C (Castagnoli), from the catalogue of parametrised CRCs
    assert crc32c.crc32c(b"123456789") == 0xE3069283
    assert crc32c.crc32c(b"") == 0


def test_same_as_tensorboard_at_every_length_and_alignment() -> None:
    rng = random.Random(3)
    data = bytes(rng.randrange(256) for _ in range(5000))
    for n in [*range(0, 70), 255, 256, 1023, 4099]:
        for offset in range(0, 8, 3):  # bytes objects start aligned; slices move the data
            chunk = data[offset : offset + n]
            assert crc32c.crc32c(chunk) == tb_crc.crc32c(chunk), (n, offset)
            assert crc32c.masked_crc32c(chunk) == tb_crc.masked_crc32c(chunk), (n, offset)


def test_portable_table_path_gives_the_same_checksums(tmp_path: Path) -> None:
    """Built without the CPU flags (no ``crc32`` instruction): the eight-table loop."""
    script = (
        "import random\n"
        "from lightning_recorder._core import crc32c, native\n"
        "native.cpu_flags = lambda: []\n"
        "from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as tb\n"
        "rng = random.Random(5)\n"
        "assert crc32c.available(), native.status()\n"
        "for n in [*range(0, 40), 1000, 4097]:\n"
        "    d = bytes(rng.randrange(256) for _ in range(n))\n"
        "    assert crc32c.masked_crc32c(d) == tb.masked_crc32c(d), n\n"
        "print('ok')\n"
    )
    env = {**os.environ, "LIGHTNING_RECORDER_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert len(list(tmp_path.glob("lightning_recorder_crc32c-*.so"))) == 1


def _records(path: Path) -> list[bytes]:
    """The records of a TFRecord file, each one's two checksums verified with TensorBoard's own
    pure-Python CRC-32C."""
    raw = path.read_bytes()
    found, at = [], 0
    while at < len(raw):
        header = raw[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", raw[at + 8 : at + 12])
        data = raw[at + 12 : at + 12 + length]
        (data_crc,) = struct.unpack("<I", raw[at + 12 + length : at + 16 + length])
        assert header_crc == tb_crc.masked_crc32c(header)
        assert data_crc == tb_crc.masked_crc32c(data)
        found.append(data)
        at += 16 + length
    assert at == len(raw)
    return found


class _WriterProbe(pl.Callback):
    """Whether the event file's record writer has the C checksum, after each training batch."""

    def __init__(self) -> None:
        self.seen: list[bool] = []
        self.record_writers: list[Any] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        file_writer = trainer.logger.experiment._get_file_writer()
        record_writer = file_writer.event_writer._async_writer._writer
        self.seen.append("write" in vars(record_writer))
        self.record_writers.append(record_writer)


@pytest.mark.parametrize("fast", [True, False])
def test_trainer_run_writes_valid_records_and_restores_the_writer(
    tmp_path: Path, fast: bool
) -> None:
    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = FeatureStatsMonitor(["probe", "body.1"], every_n_steps=1, fast_checksums=fast)
    probe = _WriterProbe()
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=3, callbacks=[monitor, probe])
    trainer.fit(ProbeNet(lr=1e-3), loader(features(12, seed=1)))
    # the monitor runs before the probe: from the first logged step on, the C checksum
    assert probe.seen == [fast] * 3
    assert len({id(w) for w in probe.record_writers}) == 1
    assert "write" not in vars(probe.record_writers[0])  # given back at the end of the run
    (path,) = Path(logger.log_dir).glob("events.out.tfevents.*")  # closed by Lightning
    assert len(_records(path)) >= 4  # the file version, then the logged steps
    got = scalars(logger.log_dir)
    assert sorted(got["stats/train/probe/mean"]) == [0, 1, 2]


def test_only_the_logger_record_writer_changes(tmp_path: Path) -> None:
    first, second = TensorBoardLogger(tmp_path, name="a"), TensorBoardLogger(tmp_path, name="b")
    changed = native_checksums(first)
    assert isinstance(changed, RecordWriter)
    assert native_checksums(first) is None  # already changed: left as it is
    other = second.experiment._get_file_writer().event_writer._async_writer._writer
    assert "write" not in vars(other) and RecordWriter.write is not changed.write
    first.experiment.add_scalar("x", 1.5, 0)
    first.experiment.flush()
    restore_checksums(changed)
    assert "write" not in vars(changed)
    first.experiment.add_scalar("x", 2.5, 1)
    first.experiment.flush()
    (path,) = Path(first.log_dir).glob("events.out.tfevents.*")
    assert len(_records(path)) == 3  # written with both checksums: all valid
    assert scalars(first.log_dir)["x"] == {0: 1.5, 1: 2.5}


def test_nothing_changes_without_the_native_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_RECORDER_NATIVE", "0")
    native.reset()
    try:
        assert native_checksums(TensorBoardLogger(tmp_path, name="off")) is None
    finally:
        monkeypatch.delenv("LIGHTNING_RECORDER_NATIVE")
        native.reset()
    assert crc32c.available()


class _FailingNet(ProbeNet):
    """Fails in its third training step, after two logged ones."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 2:
            raise RuntimeError("the third step fails")
        return super().training_step(batch, batch_idx)


def test_the_writer_is_given_back_when_the_run_fails(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = FeatureStatsMonitor(["probe"], every_n_steps=1)
    probe = _WriterProbe()
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=5, callbacks=[monitor, probe])
    with pytest.raises(RuntimeError, match="third step fails"):
        trainer.fit(_FailingNet(lr=1e-3), loader(features(20, seed=3)))
    assert probe.seen == [True, True]
    assert "write" not in vars(probe.record_writers[0])
