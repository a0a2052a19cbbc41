"""Watch the feature statistics of a small CNN in TensorBoard while it learns to read digits.

Trains a two-layer CNN on scikit-learn's bundled 8x8 digits (no download) with one extra
callback, :class:`~lightning_recorder.FeatureStatsMonitor`, then prints the last statistics it
logged, read back from the event files. The logs go to the directory given with ``--out`` (each
run in its own ``version_N`` folder), to look at in TensorBoard::

    python examples/tensorboard_stats.py --out lightning_logs
    tensorboard --logdir lightning_logs

Without ``--out`` they go to a temporary directory, removed at the end. Other options:
``--max-epochs``, ``--every-n-steps``, ``--lr`` (run twice with two learning rates and compare the
runs in TensorBoard), and ``--plot PATH`` to render the logged statistics to an image with
matplotlib. Needs ``pip install "lightning-recorder[examples]"``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_recorder import FeatureStatsMonitor

SOURCES = ["features.*", "classifier"]
STATS = ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite")


class DigitsCNN(pl.LightningModule):
    """Two 3x3 convolutions, a pooling layer and a two-layer classifier, for 1x8x8 images."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def digits_loaders(batch_size: int = 32, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders over scikit-learn's digits (80 % / 20 %, pixels in [0, 1])."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, val = order[:cut], order[cut:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
        DataLoader(TensorDataset(x[val], y[val]), batch_size=256),
    )


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a TensorBoard run directory: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def last_stats_table(scalars: dict[str, list[tuple[int, float]]], prefix: str = "stats") -> str:
    """A text table of the last logged value of each feature statistic, per stage and module."""
    rows: dict[tuple[str, str], dict[str, float]] = {}
    steps: dict[str, int] = {}
    for tag, series in scalars.items():
        parts = tag.split("/")
        if len(parts) != 4 or parts[0] != prefix or parts[3] not in STATS:
            continue
        _, stage, module, stat = parts
        step, value = series[-1]
        rows.setdefault((stage, module), {})[stat] = value
        steps[stage] = max(steps.get(stage, 0), step)
    header = f"{'stage':<6} {'module':<13}" + "".join(f"{s:>14}" for s in STATS)
    lines = [header, "-" * len(header)]
    for (stage, module), values in sorted(
        rows.items(), key=lambda kv: (kv[0][0] != "train", kv[0])
    ):
        cells = "".join(f"{_fmt(values.get(s, math.nan)):>14}" for s in STATS)
        lines.append(f"{stage:<6} {module:<13}{cells}")
    where = ", ".join(f"{stage} at step {step}" for stage, step in sorted(steps.items()))
    return "\n".join([f"Last logged statistics ({where}):", *lines])


def _fmt(value: float) -> str:
    if value != value or value in (math.inf, -math.inf):
        return str(value)
    return f"{value:.4g}"


def plot(log_dir: str | Path, path: str | Path, prefix: str = "stats") -> None:
    """Render the logged statistics (read back from the event files) to an image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = read_scalars(log_dir)
    panels = [
        ("train", "std", "std of outputs (train)"),
        ("train", "zero_fraction", "fraction of zeros (train)"),
        ("val", "abs_mean", "mean |x| of outputs (val)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (stage, stat, title) in zip(axes.flat, panels, strict=False):
        for tag, series in sorted(scalars.items()):
            parts = tag.split("/")
            if len(parts) == 4 and parts[:2] == [prefix, stage] and parts[3] == stat:
                ax.plot(*zip(*series, strict=True), marker=".", label=parts[2])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    events = EventAccumulator(str(log_dir), size_guidance={"histograms": 0})
    events.Reload()
    tag = f"{prefix}/train/features.2/histogram"
    ax = axes.flat[3]
    if tag in events.Tags()["histograms"]:
        series = events.Histograms(tag)
        for event in (series[0], series[len(series) // 2], series[-1]):
            h = event.histogram_value
            limits, counts = list(h.bucket_limit), list(h.bucket)
            ax.stairs(counts[1:], limits, label=f"step {event.step}")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.set_title("histogram of features.2 (train)")
    ax.set_xlabel("value")
    fig.suptitle("FeatureStatsMonitor on a CNN learning scikit-learn's digits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Train, print the last statistics; return every logged scalar series (see ``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=None,
        help="directory for the TensorBoard logs, kept (default: a temporary one, removed)",
    )
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--every-n-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate")
    parser.add_argument("--plot", default=None, help="also render the statistics to this image")
    args = parser.parse_args(argv)

    with contextlib.ExitStack() as stack:
        out = args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="tb_stats_"))
        log_dir, prefix = train(out, args.max_epochs, args.every_n_steps, args.lr)
        scalars = read_scalars(log_dir)
        if args.out:
            print(f"\nTensorBoard logs: {log_dir}")
            print(f"View them with:   tensorboard --logdir {args.out}\n")
        else:
            print("\nTensorBoard logs in a temporary directory, removed at the end: keep them")
            print("with --out DIR, then view them with: tensorboard --logdir DIR\n")
        print(last_stats_table(scalars, prefix))
        if args.plot:
            plot(log_dir, args.plot, prefix)
            print(f"\nPlot written to {args.plot}")
    return scalars


def train(out: str | Path, max_epochs: int, every_n_steps: int, lr: float) -> tuple[Path, str]:
    """Fit the CNN with a :class:`FeatureStatsMonitor`, logging to ``out/version_N``; return
    that run's directory and the monitor's tag prefix."""
    pl.seed_everything(0)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    train_loader, val_loader = digits_loaders()
    logger = TensorBoardLogger(out, name="")
    monitor = FeatureStatsMonitor(SOURCES, every_n_steps=every_n_steps)
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(DigitsCNN(lr=lr), train_loader, val_loader)
    return Path(logger.log_dir), monitor.prefix


if __name__ == "__main__":
    main()
