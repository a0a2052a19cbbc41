"""What distillation gives: a digit the student never saw, and a student with little data.

A miniature of the MNIST experiment of Hinton, Vinyals & Dean (2015, "Distilling the Knowledge
in a Neural Network", section 3) on scikit-learn's bundled digits (8x8 images):

1. A teacher (an MLP with dropout) is trained on all ten digits of the training split.
2. The *transfer set* is the training split with every image of one digit (``--omit``, 3 by
   default) removed. Two students with the same initial weights are trained on it: one on the
   hard labels alone, one also distilled from the teacher's soft targets with
   ``FeatureDistillation`` (Hinton's KL on the logits, ``KLDivLoss(temperature=T)``). The first
   cannot predict the omitted digit; the second recognises most of it.
3. Hinton et al. also raise the bias of the omitted class. Here the shift is chosen without test
   data and without labels: the student's logit of the omitted digit is raised until, on the
   training images, the student predicts that digit as often as the teacher does.
4. The data-limited case: two students trained on a small fraction (``--fraction``) of the
   training split (all digits), on hard labels alone and distilled.

Every student takes the same number of optimizer steps. One seed runs on a laptop CPU in well
under a minute; ``--seeds 10`` gives the table of the docs (mean, standard deviation, range).

    python examples/distill_digits.py
    python examples/distill_digits.py --seeds 10
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from lightning_recorder import FeatureDistillation, KLDivLoss


class Classifier(pl.LightningModule):
    """An MLP on the 64 pixels; its last layer, ``head``, gives the logits.

    The students are plain classifiers (cross-entropy on the hard labels): the distillation
    term comes from the callback, not from the student's code.
    """

    def __init__(self, hidden: int, dropout: float = 0.0, lr: float = 3e-3) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
        )
        self.head = nn.Linear(hidden, 10)
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The digits as (N, 8, 8) floats in [0, 1]; a stratified half for training, half for test."""
    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.5, random_state=seed, stratify=labels
    )

    def to_tensors(x: Any, y: Any) -> TensorDataset:
        x_t = torch.tensor(x, dtype=torch.float32).reshape(-1, 8, 8) / 16.0
        return TensorDataset(x_t, torch.tensor(y, dtype=torch.long))

    return to_tensors(x_train, y_train), to_tensors(x_test, y_test)


def subset(data: TensorDataset, keep: Tensor) -> TensorDataset:
    return TensorDataset(*(t[keep] for t in data.tensors))


def train(
    model: Classifier,
    data: TensorDataset,
    steps: int,
    seed: int,
    callbacks: list[pl.Callback] | None = None,
) -> Classifier:
    """``steps`` optimizer steps on batches of 128 drawn with replacement (one epoch)."""
    generator = torch.Generator().manual_seed(seed)
    batch = min(128, len(data))
    sampler = RandomSampler(data, replacement=True, num_samples=steps * batch, generator=generator)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks or [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=batch, sampler=sampler))
    return model.eval()


def logits(model: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        return model(x)


def bias_shift(student: nn.Module, teacher: nn.Module, images: Tensor, digit: int) -> float:
    """The shift of ``digit``'s logit after which the student predicts it as often as the teacher.

    Label-free: on ``images`` the teacher predicts ``digit`` ``k`` times; an image turns to
    ``digit`` once the shift exceeds (best other logit - logit of ``digit``); the shift is the
    ``k``-th smallest of those margins (just above it).
    """
    k = int((logits(teacher, images).argmax(1) == digit).sum())
    if k == 0:
        return 0.0
    out = logits(student, images)
    others = torch.cat([out[:, :digit], out[:, digit + 1 :]], dim=1)
    margins = others.max(1).values - out[:, digit]
    return float(margins.kthvalue(k).values) + 1e-4


def scores(
    model: nn.Module, test: TensorDataset, digit: int, shift: float = 0.0
) -> dict[str, float]:
    """Accuracy on the whole test split and on the images of ``digit``."""
    x, y = test.tensors
    out = logits(model, x)
    out[:, digit] += shift
    hit = out.argmax(1) == y
    return {"all": float(hit.float().mean()), "digit": float(hit[y == digit].float().mean())}


def run_seed(
    seed: int,
    omit: int = 3,
    steps: int = 400,
    temperature: float = 20.0,
    weight: float = 10.0,
    fraction: float = 0.05,
    teacher_hidden: int = 256,
    student_hidden: int = 64,
) -> dict[str, dict[str, float]]:
    """One seed of every experiment: ``{row name: {measure: accuracy}}``."""
    train_set, test_set = digits(seed)
    images, labels = train_set.tensors

    pl.seed_everything(seed)
    teacher = train(Classifier(teacher_hidden, dropout=0.2), train_set, steps, seed)

    def distill() -> list[pl.Callback]:
        # Hinton's soft targets: KL(softmax(t/T) || softmax(s/T)) * T**2 on the logits, here
        # weighted 10 times the student's own cross-entropy on the hard labels.
        pair = {"head": "head"}
        kl = KLDivLoss(temperature=temperature)
        return [FeatureDistillation(teacher, pair, loss=kl, weight=weight)]

    def students(data: TensorDataset) -> tuple[Classifier, Classifier]:
        """A hard-label student and a distilled one, from the same initial weights."""
        pl.seed_everything(seed + 1)
        hard = Classifier(student_hidden)
        soft = Classifier(student_hidden)
        soft.load_state_dict(hard.state_dict())
        return train(hard, data, steps, seed), train(soft, data, steps, seed, distill())

    transfer = subset(train_set, labels != omit)
    hard, soft = students(transfer)
    small = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    small_hard, small_soft = students(subset(train_set, small[: small_size(len(small), fraction)]))

    def row(model: nn.Module) -> dict[str, float]:
        corrected = scores(model, test_set, omit, bias_shift(model, teacher, images, omit))
        return {
            **scores(model, test_set, omit),
            "all+": corrected["all"],
            "digit+": corrected["digit"],
        }

    return {
        "teacher": scores(teacher, test_set, omit),
        "hard": row(hard),
        "soft": row(soft),
        "small hard": scores(small_hard, test_set, omit),
        "small soft": scores(small_soft, test_set, omit),
    }


def spread(values: list[float]) -> str:
    """``mean ± std (min-max)`` in percent; the mean alone for one value."""
    pct = [100 * v for v in values]
    if len(pct) == 1:
        return f"{pct[0]:.1f}"
    return (
        f"{statistics.mean(pct):.1f} ± {statistics.stdev(pct):.1f} ({min(pct):.1f}-{max(pct):.1f})"
    )


#: The rows of the table: (key in the scores, model, what it was trained on).
ROWS = (
    ("teacher", "teacher", "all digits"),
    ("hard", "student, hard labels", "all but the {omit}s"),
    ("soft", "student, distilled", "all but the {omit}s"),
    ("small hard", "student, hard labels", "{small} images"),
    ("small soft", "student, distilled", "{small} images"),
)


def small_size(n: int, fraction: float) -> int:
    """How many training images the data-limited students get (at least 10)."""
    return max(10, int(fraction * n))


def table(runs: list[dict[str, dict[str, float]]], omit: int, small: int) -> str:
    """The Markdown table of test accuracies over the seeds."""

    def cell(key: str, measure: str) -> str:
        if measure not in runs[0][key]:
            return "—"
        return spread([run[key][measure] for run in runs])

    def line(*cells: str) -> str:
        return "| " + " | ".join(cells) + " |"

    header = ("test: digit {omit}", "test: all digits", "digit {omit}, bias corrected")
    lines = [
        line(
            "model",
            "trained on",
            *(h.format(omit=omit) for h in header),
            "all digits, bias corrected",
        ),
        line(*["---"] * 6),
    ]
    for key, model, data in ROWS:
        measures = [cell(key, m) for m in ("digit", "all", "digit+", "all+")]
        lines.append(line(model, data.format(omit=omit, small=small), *measures))
    return "\n".join(lines)


def report_seed(
    got: dict[str, dict[str, float]], seed: int, omit: int, report: Callable[[str], None]
) -> None:
    report(
        f"seed {seed}: digit {omit} recognised by the teacher {got['teacher']['digit']:.3f}, "
        f"the hard-label student {got['hard']['digit']:.3f}, "
        f"the distilled student {got['soft']['digit']:.3f} "
        f"({got['soft']['digit+']:.3f} bias corrected)"
    )


def main(
    seeds: int = 1,
    omit: int = 3,
    steps: int = 400,
    temperature: float = 20.0,
    weight: float = 10.0,
    fraction: float = 0.05,
    report: Callable[[str], None] = print,
) -> list[dict[str, dict[str, float]]]:
    """Run ``seeds`` seeds of every experiment, print the table and return the per-seed scores."""
    start = time.perf_counter()
    runs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # networks this small run fastest on one thread
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(num_workers|LeafSpec).*")
            for seed in range(seeds):
                runs.append(run_seed(seed, omit, steps, temperature, weight, fraction))
                report_seed(runs[-1], seed, omit, report)
    finally:
        torch.set_num_threads(threads)
    train_set, test_set = digits(0)
    report(
        f"\nTest accuracy in percent, {seeds} seed(s) (mean ± std (min-max) over the seeds); "
        f"{len(train_set)} training and {len(test_set)} test images; {steps} steps of 128 "
        f"images for every model; distilled: KL at T={temperature:g}, weight {weight:g}\n"
    )
    report(table(runs, omit, small_size(len(train_set), fraction)))
    report(f"\n({time.perf_counter() - start:.1f} s)")
    return runs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (default 1)")
    parser.add_argument(
        "--omit", type=int, default=3, help="the digit left out of the transfer set"
    )
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of every model")
    parser.add_argument("--temperature", type=float, default=20.0, help="the softmax temperature T")
    parser.add_argument("--weight", type=float, default=10.0, help="weight of the KL term")
    parser.add_argument(
        "--fraction", type=float, default=0.05, help="the data-limited students' share of the data"
    )
    args = parser.parse_args()
    # no banner and no "Seed set to" line per fit
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    main(args.seeds, args.omit, args.steps, args.temperature, args.weight, args.fraction)
