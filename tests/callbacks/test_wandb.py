"""A W&B offline run: the monitor's scalars and histograms reach W&B, read back from its file.

The test reads the history records back (:mod:`helpers.wandb_records`) and compares them with
the same run's TensorBoard events: the same scalars, and histograms from the very same buckets.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
from helpers.models import QUIET, ProbeNet, events, features, loader, scalars
from helpers.wandb_records import wait_for_history
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_recorder import FeatureStatsMonitor

wandb = pytest.importorskip("wandb")


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B runs offline and silent, writing under the test's ``tmp_path``."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))


@pytest.mark.usefixtures("offline")
def test_wandb_offline_run_gets_scalars_and_real_histograms(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import WandbLogger

    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    wb = WandbLogger(save_dir=str(tmp_path), offline=True, project="lr-test")
    monitor = FeatureStatsMonitor("probe", every_n_steps=1, bins=4, stats=["mean", "max"])
    trainer = pl.Trainer(max_steps=2, logger=[tb, wb], callbacks=[monitor], **QUIET)
    try:
        trainer.fit(ProbeNet(), loader(features(8)))
    finally:
        wandb.finish()
    tb.experiment.close()  # every TensorBoard event on disk before reading them back
    # W&B's service process writes the offline run file; on a loaded machine its last records
    # may land after `finish` returns, so wait for them (up to a minute)
    history = wait_for_history(
        tmp_path, lambda rows: len([r for r in rows if "stats/train/probe/mean" in r]) >= 2
    )
    tb_scalars = scalars(tmp_path / "tb" / "version_0")
    tb_hists = events(tmp_path / "tb" / "version_0").Histograms("stats/train/probe/histogram")
    logged = [row for row in history if "stats/train/probe/mean" in row]
    assert len(tb_hists) == 2, tb_hists
    assert len(logged) == 2, history
    for step, (row, tb_hist) in enumerate(zip(logged, tb_hists, strict=True)):
        for tag in ("stats/train/probe/mean", "stats/train/probe/max"):
            # TensorBoard stores float32; W&B keeps the float64 value.
            assert row[tag] == pytest.approx(tb_scalars[tag][step], rel=1e-6)
        tag = "stats/train/probe/histogram"  # W&B stores a histogram's fields as nested keys
        assert row[f"{tag}/_type"] == "histogram"
        value = tb_hist.histogram_value
        assert row[f"{tag}/bins"] == pytest.approx(list(value.bucket_limit), rel=1e-12)
        assert row[f"{tag}/values"] == [int(c) for c in list(value.bucket)[1:]]  # same buckets


@pytest.mark.usefixtures("offline")
def test_more_buckets_than_a_wandb_histogram_holds_fail_at_setup(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import WandbLogger

    from lightning_recorder.errors import RecorderConfigError

    wb = WandbLogger(save_dir=str(tmp_path), offline=True, project="lr-test")
    monitor = FeatureStatsMonitor("probe", every_n_steps=1, bins=513)
    trainer = pl.Trainer(max_steps=1, logger=wb, callbacks=[monitor], **QUIET)
    try:
        with pytest.raises(RecorderConfigError, match=r"`bins` .* at most 512 .*got 513"):
            trainer.fit(ProbeNet(), loader(features(8)))
    finally:
        wandb.finish()
    assert monitor.logged_steps == 0  # refused at setup, before the first step
