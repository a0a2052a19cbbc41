"""Small LightningModules and data for the callback tests (also imported by subprocess scripts)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


def features(n: int, offset: float = 0.0, seed: int = 0, special: bool = False) -> torch.Tensor:
    """``n`` rows of 4 features; with ``special``, a NaN, an inf, a -inf and zeros included."""
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed)) + offset
    if special:
        x[1, 0] = math.nan
        x[3, 2] = math.inf
        x[5, 1] = -math.inf
        x[2] = 0.0
    return x


def loader(x: torch.Tensor, batch_size: int = 4) -> DataLoader:
    """A loader over ``x`` in order (batch ``k`` holds rows ``k*b .. k*b+b-1``)."""
    return DataLoader(TensorDataset(x), batch_size=batch_size, shuffle=False)


class ProbeNet(pl.LightningModule):
    """``probe`` (an identity on the input: its statistics are those of the data), then an MLP.

    Non-finite inputs are zeroed after the probe so that training stays finite.
    """

    def __init__(self, lr: float = 0.1, momentum: float = 0.0) -> None:
        super().__init__()
        self.lr, self.momentum = lr, momentum
        self.probe = nn.Identity()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.step_hook: Callable[[ProbeNet, int], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.nan_to_num(self.probe(x), 0.0, 0.0, 0.0))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch[0])
        if self.step_hook is not None:
            self.step_hook(self, batch_idx)
        loss = out.square().mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(batch[0]).square().mean())

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self(batch[0])

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class TinyClassifier(pl.LightningModule):
    """A classifier for ``LightningCLI`` tests (all hyperparameters in the signature)."""

    def __init__(self, hidden: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class DocsNet(TinyClassifier):
    """A classifier with the module names used in the documentation's YAML examples."""

    def __init__(self, hidden: int = 8, lr: float = 0.1) -> None:
        super().__init__(hidden, lr)
        del self.body
        self.features = nn.Sequential(nn.Linear(4, hidden), nn.ReLU())
        self.backbone = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 4))
        self.head = nn.Linear(4, 4)
        self.classifier = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(self.backbone(self.features(x))))


def linear_connector(student_shape: torch.Size, teacher_shape: torch.Size) -> nn.Linear:
    """A connector factory (annotated to return a module): a linear map without bias."""
    return nn.Linear(student_shape[-1], teacher_shape[-1], bias=False)


def tiny_data_indices(batch: Any, batch_idx: int) -> torch.Tensor:
    """The dataset indices of a batch of ``TinyData``'s training loader (in order, 4 a batch)."""
    return torch.arange(4 * batch_idx, 4 * batch_idx + len(batch[0])) + 100


class TinyData(pl.LightningDataModule):
    """Random 4-feature, 3-class data."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:8], self.y[:8]), batch_size=self.batch_size)


def events(log_dir: str | Path) -> EventAccumulator:
    """The TensorBoard events of a run directory, everything kept."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def scalars(log_dir: str | Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar in a run directory."""
    acc = events(log_dir)
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def reference_stats(x: torch.Tensor) -> dict[str, float]:
    """The statistics as plain torch defines them (finite elements only, sample std)."""
    flat = x.detach().reshape(-1).double()
    finite = flat[torch.isfinite(flat)]
    return {
        "mean": finite.mean().item(),
        "std": finite.std().item(),
        "min": finite.min().item(),
        "max": finite.max().item(),
        "abs_mean": finite.abs().mean().item(),
        "zero_fraction": (flat == 0).double().mean().item(),
        "nonfinite": float((~torch.isfinite(flat)).sum().item()),
        "numel": float(flat.numel()),
    }


def assert_counts_up_to_edges(
    counts: torch.Tensor, values: torch.Tensor, edges: torch.Tensor, dtype: torch.dtype
) -> None:
    """``counts`` are ``torch.histogram``'s counts of the finite ``values`` over ``edges``, but for
    values within rounding of an edge in ``dtype`` (the precision the buckets are computed in),
    which may land in the bucket next to it, as with ``torch.histc``: every cumulative count
    (values in the buckets before edge ``i``) lies between the number of values below
    ``edges[i] - delta`` and below ``edges[i] + delta``, ``delta`` four units of rounding of the
    range's magnitude, and at least four of ``dtype``'s smallest subnormal value: the edges of a
    range only a few subnormals wide are rounded to multiples of it (``[0, 5e-324]`` in three
    buckets has the edges ``0, 0, 5e-324, 5e-324``)."""
    v = values.detach().reshape(-1).double()
    v = v[torch.isfinite(v)]
    e = edges.double()
    assert counts.shape == (e.numel() - 1,)
    assert float(counts.sum()) == v.numel()
    if not dtype.is_floating_point:  # integers are bucketed in float64
        dtype = torch.float64
    elif dtype in (torch.float16, torch.bfloat16):  # upcast exactly to float32
        dtype = torch.float32
    magnitude = float(e.abs().max())
    info = torch.finfo(dtype)
    delta = 4 * max(info.eps * magnitude, info.tiny * info.eps)  # tiny * eps: the least subnormal
    cumulative = torch.cumsum(counts.double(), 0)
    for i in range(1, e.numel() - 1):
        low = float((v < e[i] - delta).sum())
        high = float((v < e[i] + delta).sum())
        assert low <= float(cumulative[i - 1]) <= high, (i, low, float(cumulative[i - 1]), high)
