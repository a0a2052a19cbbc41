"""False alarms of `HealthMonitor`'s rules on healthy training runs, at their default thresholds.

The budget (issue "Training health, part two"): **at most one rule alert per 10,000 steps** on
healthy runs. Three healthy runs, each for ``--steps`` optimizer steps (10,000 by default), with
a ``FeatureStatsMonitor`` on the usual module types (those of ``Conv2d``, ``Linear``, ``ReLU``,
``Tanh``, ``LayerNorm``, ``BatchNorm1d``/``2d`` that the model has) and ``HealthMonitor()``
(every rule with its defaults, the view on, a TensorBoard logger), each trained twice: with the
Trainer's default ``log_every_n_steps=50``, as people have it, and with
``log_every_n_steps=10``, which gives the rules five times as many checks:

* **CNN + BatchNorm, digits** — two 3x3 convolutions with ``BatchNorm2d`` and ReLU, max-pooling
  and a two-layer classifier, on scikit-learn's 8x8 digits (80 % train, batches of 64, shuffled;
  Adam, learning rate 1e-3);
* **Transformer encoder, majority token** — ``nn.TransformerEncoder`` (2 layers, width 32, 4
  heads, post-norm, dropout 0.1, ``nn.ReLU()`` as its activation) with token and position
  embeddings, mean pooling and a BERT-like pooler (``Linear`` and ``Tanh``), on made-up
  sequences of 16 tokens out of 10 whose label is the token that occurs most often (a set of
  50,000 sequences, batches of 32; Adam, learning rate 1e-3);
* **residual MLP, digits** — a stem ``Linear`` and three residual blocks
  ``Linear → ReLU(inplace=True) → Linear`` (width 128) with ``ReLU(inplace=True)`` after each
  sum, on the flattened digits (SGD, momentum 0.9, learning rate 0.02, batches of 64).

Each run counts the rule events (``monitor.events`` whose ``kind`` is a rule's: a finding that
fired), per rule, and the alerts (calls of the ``alert`` callable, rate-limited per rule and
module as people get them, ``alert_interval_s`` at its default of 300 s); the budget is judged
on the events, which no clock rate-limits. It also reports the checks (logged training steps),
the accuracy on held-out data (digits: the 20 % not trained on; sequences: 2,000 fresh ones)
and the wall time; and, for information, how many loss-spike events Lightning's own
``SpikeDetection`` thresholds (``LossSpikeRule(atol=None)``) would have raised on the same losses.

Run ``python benchmarks/health_false_alarms.py`` (``make health-false-alarms``; ``--quick`` for a
smoke run, ``--steps N``, ``--runs`` to choose, ``--json PATH`` to save the figures). One torch
thread; a run of 10,000 steps takes a few minutes on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lightning_recorder import (  # noqa: E402
    FeatureStatsMonitor,
    HealthEvent,
    HealthMonitor,
    LossSpikeRule,
)
from lightning_recorder.callbacks import RuleInput  # noqa: E402

SOURCES = [
    nn.Conv2d,
    nn.Linear,
    nn.ReLU,
    nn.Tanh,
    nn.LayerNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
]
NOT_RULES = ("nonfinite", "amp_skipped")
BUDGET = 1.0  # rule alerts per 10,000 steps
BATCH = 64


# ---------------------------------------------------------------------------- models
class Classifier(pl.LightningModule):
    """A network, a loss, an optimizer: what the runs share."""

    def __init__(self, net: nn.Module, optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
        super().__init__()
        self.net = net
        self.make_optimizer = optimizer

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_optimizer(self.parameters())


def cnn_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


class Encoder(nn.Module):
    """Token and position embeddings, ``nn.TransformerEncoder`` (its ReLU a module, so that the
    monitor sees it), mean pooling, a BERT-like pooler (``Linear``, ``Tanh``), a classifier."""

    def __init__(self, vocab: int, length: int, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(0.02 * torch.randn(length, width))
        layer = nn.TransformerEncoderLayer(
            width,
            nhead=4,
            dim_feedforward=2 * width,
            dropout=0.1,
            activation=nn.ReLU(),
            batch_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.pooler = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.encoder(self.tokens(x) + self.positions)
        return self.head(self.pooler(self.norm(h.mean(dim=1))))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, width)
        )
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(x + self.body(x))


def residual_mlp(width: int = 128) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, width),
        nn.ReLU(inplace=True),
        *[Block(width) for _ in range(3)],
        nn.Linear(width, 10),
    )


# ---------------------------------------------------------------------------- data
def digits() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits, 80 % / 20 %, pixels in [0, 1], as ``(N, 1, 8, 8)``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(
        x[order[cut:]], y[order[cut:]]
    )


def majority(count: int, seed: int, length: int = 16, vocab: int = 10) -> TensorDataset:
    """Sequences of ``length`` tokens; the label is the most frequent token (ties: the
    smallest). A chosen token is planted 4-7 times among uniform ones, so most have one
    clear answer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (count, length), generator=g)
    planted = torch.randint(0, vocab, (count,), generator=g)
    times = torch.randint(4, 8, (count,), generator=g)
    where = torch.rand(count, length, generator=g).argsort(dim=1)
    mask = torch.arange(length)[None, :] < times[:, None]
    rows = torch.arange(count)[:, None].expand(count, length)
    x[rows[mask], where[mask]] = planted[:, None].expand(count, length)[mask]
    counts = F.one_hot(x, vocab).sum(dim=1)
    return TensorDataset(x, counts.argmax(dim=1))


def endless(data: TensorDataset, steps: int, batch: int = BATCH) -> DataLoader:
    """Shuffled batches of ``data`` for ``steps`` steps, in one epoch (repeats of the set)."""
    x, y = data.tensors
    repeat = 1 + steps * batch // len(x)
    order = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(x.repeat(repeat, *[1] * (x.ndim - 1)), y.repeat(repeat)),
        batch_size=batch,
        shuffle=True,
        generator=order,
        drop_last=True,
    )


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


Run = tuple[Classifier, TensorDataset, TensorDataset, int]  # model, train, held out, batch


def _runs() -> dict[str, Callable[[], Run]]:
    def cnn() -> Run:
        train, held = digits()
        return Classifier(cnn_bn(), adam), train, held, BATCH

    def transformer() -> Run:
        model = Classifier(Encoder(10, 16), adam)
        return model, majority(50_000, 0), majority(2_000, 1), 32

    def mlp() -> Run:
        train, held = digits()
        return Classifier(residual_mlp(), sgd), train, held, BATCH

    return {
        "CNN + BatchNorm, digits": cnn,
        "Transformer encoder, majority token": transformer,
        "residual MLP (ReLU inplace), digits": mlp,
    }


RUNS = _runs()


# ---------------------------------------------------------------------------- one run
class Losses(pl.Callback):
    """Keeps the loss of every training step (a host copy per step: CPU runs only)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *_: Any
    ) -> None:
        self.values.append(float(outputs["loss"]))


def lightning_spikes(losses: Sequence[float], every: int) -> int:
    """The loss-spike events of Lightning's own thresholds (``atol=None``) on these losses,
    checked every ``every`` steps as the monitor checks (a finding fires when it appears)."""
    rule, fired, before = LossSpikeRule(atol=None), 0, False
    values = np.asarray(losses, dtype=np.float64)
    for start in range(0, len(values), every):
        steps = np.arange(start, min(start + every, len(values)))
        now = bool(rule.check(RuleInput(int(steps[-1]), losses=values[steps], loss_steps=steps)))
        fired += now and not before
        before = now
    return fired


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def train(name: str, steps: int, every: int, root: str) -> dict[str, Any]:
    """Train run ``name`` for ``steps`` steps, logging every ``every``; its figures."""
    pl.seed_everything(0, verbose=False)
    model, data, held, batch = RUNS[name]()
    alerts: list[HealthEvent] = []
    present = {type(m) for m in model.modules()}
    stats = FeatureStatsMonitor([t for t in SOURCES if t in present])  # a type absent: an error
    health = HealthMonitor(alert=alerts.append, evidence_max_bytes=0)
    losses = Losses()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=TensorBoardLogger(root, name=name.split()[0].lower()),
        callbacks=[stats, health, losses],
        log_every_n_steps=every,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, endless(data, steps, batch))
    wall = time.perf_counter() - start
    events = [e for e in health.events if e.kind not in NOT_RULES]
    return {
        "run": name,
        "every": every,
        "steps": int(trainer.global_step),
        "checks": int(stats.logged_steps),
        "events": len(events),
        "by_rule": dict(Counter(e.kind for e in events)),
        "alerts": len(alerts),
        "per_10k": 1e4 * len(events) / max(1, trainer.global_step),
        "accuracy": accuracy(model, held),
        "wall_s": wall,
        "messages": [f"step {e.step}: {e.message}" for e in events[:20]],
        "nonfinite": len(health.events) - len(events),
        "lightning_spikes": lightning_spikes(losses.values, every),
    }


# ---------------------------------------------------------------------------- report
def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| run | log every | steps | checks | rule events (by rule) | alerts | events / 10k "
        "steps | held-out accuracy | wall (s) | loss spikes at Lightning's atol=None |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rules = ", ".join(f"{k} {v}" for k, v in sorted(r["by_rule"].items())) or "-"
        lines.append(
            f"| {r['run']} | {r['every']} | {r['steps']:,} | {r['checks']:,} | {r['events']} "
            f"({rules}) | {r['alerts']} | **{r['per_10k']:.2f}** | {r['accuracy']:.3f} | "
            f"{r['wall_s']:.0f} | {r['lightning_spikes']} |"
        )
    steps = sum(r["steps"] for r in results)
    events = sum(r["events"] for r in results)
    lines.append(
        f"| **all** | | {steps:,} | {sum(r['checks'] for r in results):,} | {events} | "
        f"{sum(r['alerts'] for r in results)} | **{1e4 * events / max(1, steps):.2f}** "
        f"(budget <= {BUDGET:g}) | | {sum(r['wall_s'] for r in results):.0f} | "
        f"{sum(r['lightning_spikes'] for r in results)} |"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Train the runs, print the table and the findings' messages; return the figures."""
    parser = argparse.ArgumentParser(description="HealthMonitor's false alarms on healthy runs")
    parser.add_argument("--steps", type=int, default=10_000, help="optimizer steps per run")
    parser.add_argument(
        "--every",
        type=int,
        nargs="+",
        default=[50, 10],
        help="the Trainer's log_every_n_steps, one run per value (default: 50 10)",
    )
    parser.add_argument(
        "--runs",
        nargs="+",
        default=None,
        help="runs by the first word of their name: cnn, transformer, residual (default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 60 steps, every 10")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")
    warnings.filterwarnings("ignore", ".*enable_nested_tensor.*")
    if args.quick:
        args.steps, args.every = 60, [10]
    torch.set_num_threads(1)
    chosen = [
        n
        for n in RUNS
        if args.runs is None or n.split()[0].lower() in [r.lower() for r in args.runs]
    ]
    if not chosen:
        parser.error(f"no run named {args.runs}; choose among cnn, transformer, residual")
    results = []
    with tempfile.TemporaryDirectory() as root:
        for every in args.every:
            for name in chosen:
                result = train(name, args.steps, every, root)
                results.append(result)
                print(
                    f"  {name}, every {every}: {result['steps']} steps, {result['events']} rule "
                    f"events, accuracy {result['accuracy']:.3f}, {result['wall_s']:.0f} s",
                    flush=True,
                )
                for message in result["messages"]:
                    print(f"    {message}", flush=True)
    print(
        f"\nHealthMonitor() (every rule at its defaults, the view on) with a FeatureStatsMonitor "
        f"on {', '.join(t.__name__ for t in SOURCES)}: rule events on healthy runs, "
        f"{args.steps:,} steps each, one torch thread.\n"
    )
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
