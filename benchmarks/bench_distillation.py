"""Step time of `FeatureDistillation` against a hand-written distillation loop, in one run.

Two ways to train the same student against the same frozen teacher, with the same losses:

* **callback** — a plain student LightningModule (its ``training_step`` computes only the task
  loss) and a ``FeatureDistillation`` callback: recorders on both networks, the teacher run from
  the student's forward, automatic 1x1 connectors trained through an extra optimizer group, the
  term added to the returned loss, every term logged;
* **hand-written** — the loop people write by hand: a LightningModule holding the teacher (out of
  its module tree) and its connectors, raw ``register_forward_hook`` closures that store the
  features, the teacher run under ``torch.no_grad()`` in ``training_step``, the same losses,
  weights and ``self.log`` calls.

Each repeat trains both variants for the same steps (order alternating AB, BA, …); a timing
callback stamps every ``on_train_batch_start`` with the process's CPU time, so a step's time
covers everything between two batch starts (data, teacher, student, losses, backward, optimizer,
callbacks, logging). Per run the median step time after the warm-up is kept; the ratio
callback / hand-written is taken per repeat and its median over repeats is reported.

Run ``python benchmarks/bench_distillation.py`` (``--quick`` for a smoke run). Timings use one
CPU thread (``torch.set_num_threads(1)``) and CPU time rather than wall time, to keep the noise
of a shared machine down.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_recorder import FeatureDistillation, KLDivLoss, MSELoss, build_connector

LIMIT = 1.05


@dataclass(frozen=True)
class Case:
    """One benchmark configuration."""

    name: str
    width: int  # the student's width; the teacher is twice as wide
    image: int
    batch: int


CASES = (
    Case("cnn 32x32, batch 32", width=16, image=32, batch=32),
    Case("cnn 16x16, batch 32", width=8, image=16, batch=32),
    # Almost no compute: the step time is Lightning's and the distillation code's own overhead.
    Case("tiny cnn 4x4, batch 2", width=2, image=4, batch=2),
)


def _cnn(width: int) -> tuple[nn.Sequential, nn.Linear]:
    body = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )
    return body, nn.Linear(2 * width, 10)


class Teacher(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body, self.head = _cnn(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x).mean((2, 3)))


class Student(pl.LightningModule):
    """The plain student: its training step knows nothing of distillation."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body, self.head = _cnn(width)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x).mean((2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


# Student module -> teacher module, the loss and its weight.
PAIRS = {"body.2": "body.2", "body.5": "body.5", "head": "head"}
LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "body.2": MSELoss(),
    "body.5": MSELoss(),
    "head": KLDivLoss(temperature=4.0),
}
WEIGHTS = {"body.2": 0.5, "body.5": 1.0, "head": 1.0}


class HandWritten(Student):
    """The same student with distillation written into it, as people do by hand."""

    def __init__(self, width: int, teacher: Teacher, image: int) -> None:
        super().__init__(width)
        self._teacher = [teacher]  # a list: kept out of the module tree and the checkpoint
        self._student_feats: dict[str, Tensor] = {}
        self._teacher_feats: dict[str, Tensor] = {}
        self._handles = []
        for name, t_name in PAIRS.items():
            self._handles.append(
                self.get_submodule(name).register_forward_hook(
                    self._store(self._student_feats, name)
                )
            )
            self._handles.append(
                teacher.get_submodule(t_name).register_forward_hook(
                    self._store(self._teacher_feats, name)
                )
            )
        with torch.no_grad():  # connectors from the known shapes
            x = torch.zeros(2, 3, image, image)
            self(x)
            teacher(x)
        self.connectors = nn.ModuleList(
            build_connector(self._student_feats[n].shape, self._teacher_feats[n].shape)
            for n in PAIRS
        )

    @staticmethod
    def _store(into: dict[str, Tensor], name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            into[name] = output

        return hook

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        with torch.no_grad():
            self._teacher[0](x)
        loss = F.cross_entropy(self(x), y)
        total: Tensor | None = None
        for connector, name in zip(self.connectors, PAIRS, strict=True):
            s, t = self._student_feats[name], self._teacher_feats[name]
            term = LOSSES[name](connector(s), t) * WEIGHTS[name]
            self.log(f"distill/{name}", term.detach())
            total = term if total is None else total + term
        assert total is not None
        self.log("distill/total", total.detach())
        self._student_feats.clear()
        self._teacher_feats.clear()
        return loss + total

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()


class _StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.stamps.append(time.process_time())


def _loader(case: Case, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = case.batch * steps
    x = torch.randn(n, 3, case.image, case.image, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=case.batch)


def _run(variant: str, case: Case, steps: int, warmup: int) -> float:
    """Train ``steps`` steps; return the median step time (s) after ``warmup`` steps."""
    torch.manual_seed(0)
    teacher = Teacher(2 * case.width).eval().requires_grad_(False)
    timer = _StepTimer()
    callbacks: list[pl.Callback] = [timer]
    hand: HandWritten | None = None
    if variant == "callback":
        model: pl.LightningModule = Student(case.width)
        callbacks.append(FeatureDistillation(teacher, PAIRS, loss=LOSSES, weight=WEIGHTS))
    else:
        model = hand = HandWritten(case.width, teacher, case.image)
    trainer = pl.Trainer(
        max_steps=steps + 1,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, _loader(case, steps + 1))
    if hand is not None:
        hand.remove_hooks()
    deltas = [b - a for a, b in zip(timer.stamps, timer.stamps[1:], strict=False)]
    return statistics.median(deltas[warmup:])


def bench(case: Case, steps: int, warmup: int, repeats: int) -> dict[str, float]:
    """Median step times of both variants and the median of the per-repeat ratios."""
    times: dict[str, list[float]] = {"callback": [], "hand-written": []}
    ratios = []
    for repeat in range(repeats):
        order = ("callback", "hand-written") if repeat % 2 == 0 else ("hand-written", "callback")
        got = {variant: _run(variant, case, steps, warmup) for variant in order}
        for variant, value in got.items():
            times[variant].append(value)
        ratios.append(got["callback"] / got["hand-written"])
    return {
        "callback_ms": statistics.median(times["callback"]) * 1e3,
        "hand_ms": statistics.median(times["hand-written"]) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run every case, print the table, return the figures by case name."""
    parser = argparse.ArgumentParser(description="FeatureDistillation vs a hand-written loop.")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps not timed")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 6, 2, 2
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        __import__("logging").getLogger(name).setLevel("ERROR")

    results = {
        case.name: bench(case, args.steps + args.warmup, args.warmup, args.repeats)
        for case in CASES
    }
    print(
        f"\nFeatureDistillation vs hand-written hooks + loss: {len(PAIRS)} pairs (two feature "
        f"maps with 1x1 connectors, logits with KL), SGD, {args.threads} CPU thread(s); "
        f"median of {args.repeats} interleaved repeats of {args.steps} timed steps."
    )
    header = (
        f"{'case':<24}{'callback ms':>13}{'hand ms':>10}{'diff us':>9}{'ratio':>8}"
        f"{'range':>15}{'limit':>7}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        spread = f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
        diff = (r["callback_ms"] - r["hand_ms"]) * 1e3
        print(
            f"{name:<24}{r['callback_ms']:>13.3f}{r['hand_ms']:>10.3f}{diff:>9.0f}"
            f"{r['ratio']:>8.3f}{spread:>15}{LIMIT:>7.2f}"
        )
    return results


if __name__ == "__main__":
    main()
