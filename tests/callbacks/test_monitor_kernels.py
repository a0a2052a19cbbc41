"""The monitor's results do not depend on which path computes them: the fused CPU kernels
(``stats._native``) or torch operations (no compiler, ``LIGHTNING_RECORDER_NATIVE=0``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import events, scalars
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_recorder import FeatureStatsMonitor
from lightning_recorder._core import native
from lightning_recorder.stats import _native

HAVE_CC = native.compiler() is not None


class _Wide(pl.LightningModule):
    """Large outputs (fused pass with a sample) and small ones (one segmented call), float32
    parameters (fused copy and change norms)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 8), nn.Tanh(), nn.Linear(8, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _logged(root: Path, name: str) -> tuple[dict[str, dict[int, float]], dict[str, Any]]:
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 16)), 64)
    logger = TensorBoardLogger(root, name=name)
    monitor = FeatureStatsMonitor("body.*", every_n_steps=1)
    pl.Trainer(
        max_steps=3,
        logger=logger,
        callbacks=[monitor],
        accelerator="cpu",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    ).fit(_Wide(), data)
    acc = events(logger.log_dir)
    hists = {
        (tag, e.step): e.histogram_value
        for tag in acc.Tags()["histograms"]
        for e in acc.Histograms(tag)
    }
    return scalars(logger.log_dir), hists


def _cumulative(h: Any, at: list[float]) -> list[float]:
    """The count of values up to each limit in ``at`` (bucket i covers (limit[i-1], limit[i]])."""
    totals, running = {}, 0.0
    for limit, count in zip(h.bucket_limit, h.bucket, strict=True):
        running += count
        totals[limit] = running
    return [totals[x] for x in at]


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_the_monitor_logs_the_same_with_and_without_the_kernels(
    tmp_path: Path, fresh_native: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused, fused_hists = _logged(tmp_path, "fused")
    assert _native.available()
    monkeypatch.setenv("LIGHTNING_RECORDER_NATIVE", "0")
    native.reset()
    plain, plain_hists = _logged(tmp_path, "torch")
    assert not _native.available()
    assert fused.keys() == plain.keys()
    stats = {tag.rsplit("/", 1)[-1] for tag in fused}
    assert {"mean", "std", "zero_fraction", "norm", "grad_norm", "update_ratio"} <= stats
    for tag, series in fused.items():
        assert series.keys() == plain[tag].keys()
        for step, value in series.items():
            # both paths are within 1e-6 (relative) of the exact values, and TensorBoard stores
            # float32 scalars: 1e-5 relative, 1e-7 absolute for values near zero
            assert value == pytest.approx(plain[tag][step], rel=1e-5, abs=1e-7), (tag, step)
    # histograms: every module at once by the kernel, or module by module with torch
    assert fused_hists.keys() == plain_hists.keys() and len(fused_hists) == 5 * 3
    for key, h in fused_hists.items():
        other = plain_hists[key]
        assert (h.min, h.max) == (other.min, other.max)  # exact extremes
        assert h.num == pytest.approx(other.num, rel=1e-12)
        assert h.sum == pytest.approx(other.sum, rel=1e-5, abs=1e-7)
        assert sum(h.bucket) == pytest.approx(h.num, rel=1e-9)  # scaled to the count
        # the same edges (the same float64 operations), runs of empty buckets collapsed
        common = sorted(set(h.bucket_limit) & set(other.bucket_limit))
        assert len(common) >= 3
        # the same sample, float32 positions both ways (computed in another order): a value
        # within rounding of an edge may move to the next bucket; the samples here stand for at
        # most 2 values each, so the counts up to each limit agree within two such moves
        for a, b in zip(_cumulative(h, common), _cumulative(other, common), strict=True):
            assert a == pytest.approx(b, rel=0, abs=4.0), key
