"""The Lightning helpers the callbacks share, against Lightning's own loop state in real runs."""

from __future__ import annotations

import contextlib
import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import QUIET as HELPER_QUIET
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_recorder.activations import ActivationDataset
from lightning_recorder.callbacks._lightning import completes_step, step_axis

QUIET = {**HELPER_QUIET, "logger": False}


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class TwoOptimizers(Net):
    """Manual optimization, two optimizers, the second stepping every other batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, second = self.optimizers()  # type: ignore[misc]
        loss = (self.layer(batch[0]) + self.other(batch[0])).square().mean()
        self.manual_backward(loss)
        first.step()
        first.zero_grad()
        if batch_idx % 2:
            second.step()
        second.zero_grad()

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD(self.layer.parameters(), 0.01),
            torch.optim.SGD(self.other.parameters(), 0.01),
        ]


class FromIterator(Net):
    """``training_step(dataloader_iter)``: the step fetches its own batch (Lightning learns the
    epoch's end only after that fetch)."""

    def training_step(self, dataloader_iter: Iterator[Any]) -> torch.Tensor:  # type: ignore[override]
        batch, _, _ = next(dataloader_iter)
        return self.layer(batch[0]).square().mean()


class Stream(IterableDataset[tuple[torch.Tensor]]):
    """Seven samples and no length: the epoch's end is known only from the fetcher."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor]]:
        return iter((torch.randn(4),) for _ in range(7))


class Oracle(pl.Callback):
    """At the start and end of every training batch: the helper's answer and the one of
    Lightning's own loop (its private ``_should_accumulate``, read here as the reference)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, bool, bool]] = []

    def _check(self, trainer: pl.Trainer, hook: str, batch_idx: int) -> None:
        lightning = not trainer.fit_loop._should_accumulate()
        self.seen.append((hook, batch_idx, completes_step(trainer), lightning))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._check(trainer, "start", args[-1])

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._check(trainer, "end", args[-1])


class Accumulating(SingleDeviceStrategy):
    """A strategy that accumulates over the epoch's end itself, as DeepSpeed's does."""

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


def _data(n: int) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.randn(n, 4)), batch_size=1)


CASES = {
    # accumulation with a partial group at the end of each epoch: 10 = 3 + 3 + 3 + 1
    "accumulate-3-partial": (
        Net,
        lambda: _data(10),
        {"accumulate_grad_batches": 3, "max_epochs": 2},
    ),
    "accumulate-4-limited": (
        Net,
        lambda: _data(20),
        {"accumulate_grad_batches": 4, "limit_train_batches": 6, "max_epochs": 2},
    ),
    # no length: the last batch is known from the fetcher (`trainer.is_last_batch`)
    "iterable-no-length": (
        Net,
        lambda: DataLoader(Stream(), batch_size=1),
        {"accumulate_grad_batches": 3, "max_epochs": 2},
    ),
    # the strategy accumulates: the epoch's last, partial group does not step on its own
    "strategy-accumulates": (
        Net,
        lambda: _data(10),
        {"accumulate_grad_batches": 3, "max_epochs": 1, "strategy": Accumulating("cpu")},
    ),
    "dataloader-iter": (
        FromIterator,
        lambda: _data(7),
        {"accumulate_grad_batches": 3, "max_epochs": 2},
    ),
    "max-steps-mid-epoch": (Net, lambda: _data(12), {"accumulate_grad_batches": 2, "max_steps": 4}),
    "no-accumulation": (Net, lambda: _data(5), {"max_epochs": 1}),
    "manual-two-optimizers": (TwoOptimizers, lambda: _data(5), {"max_epochs": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_completes_step_agrees_with_lightning_loop(case: str) -> None:
    model, data, options = CASES[case]
    oracle = Oracle()
    pl.Trainer(**QUIET, callbacks=[oracle], **options).fit(model(), data())
    assert oracle.seen, "no training batch ran"
    disagreements = [s for s in oracle.seen if s[2] != s[3]]
    assert not disagreements, disagreements
    stepping = {s[3] for s in oracle.seen}
    if options.get("accumulate_grad_batches", 1) > 1:
        assert stepping == {True, False}  # both answers occurred, the test decided something
    else:
        assert stepping == {True}


def test_completes_step_on_the_epoch_last_partial_group() -> None:
    """The expected pattern spelled out: 10 batches, accumulation 3, steps after 3, 6, 9, 10."""
    oracle = Oracle()
    pl.Trainer(**QUIET, callbacks=[oracle], accumulate_grad_batches=3, max_epochs=1).fit(
        Net(), _data(10)
    )
    ends = [idx for hook, idx, mine, _ in oracle.seen if hook == "end" and mine]
    assert ends == [2, 5, 8, 9]


# ----------------------------------------------------------------------------- the step axis

AXIS_HOOKS = (
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_epoch_end",
    "on_test_epoch_end",
    "on_train_end",
)


class AxisOracle(pl.Callback):
    """At every hook of :data:`AXIS_HOOKS`: ``step_axis`` and Lightning's own axis (its private
    ``_batches_that_stepped``, read here as the reference), and ``global_step``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int, int]] = []

    def _check(self, hook: str, trainer: pl.Trainer) -> None:
        lightning = trainer.fit_loop.epoch_loop._batches_that_stepped
        self.seen.append((hook, step_axis(trainer), lightning, trainer.global_step))


for _hook in AXIS_HOOKS:
    setattr(
        AxisOracle,
        _hook,
        lambda self, trainer, *args, _hook=_hook, **kwargs: self._check(_hook, trainer),
    )


class Evaluated(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", self.layer(batch[0]).mean())

    def test_step(self, batch: Any, batch_idx: int) -> None:
        pass


class SkipsBatches(Evaluated):
    """``training_step`` returns ``None`` on every third batch (Lightning skips its backward)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:  # type: ignore[override]
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 3 == 1 else loss


class TwoOptimizersEvaluated(TwoOptimizers):
    validation_step = Evaluated.validation_step
    test_step = Evaluated.test_step


AXIS_CASES = {
    # validation inside the epoch, after batches that step and batches that accumulate
    "val-every-2-accumulate-3": (
        Evaluated,
        {"accumulate_grad_batches": 3, "val_check_interval": 2},
    ),
    "val-every-3": (Evaluated, {"val_check_interval": 3}),
    "val-at-epoch-end-accumulate-2": (Evaluated, {"accumulate_grad_batches": 2}),
    "skipped-batches": (SkipsBatches, {"val_check_interval": 2}),
    "manual-two-optimizers": (TwoOptimizersEvaluated, {"val_check_interval": 2}),
    "strategy-accumulates": (
        Evaluated,
        {"accumulate_grad_batches": 3, "max_epochs": 1, "strategy": Accumulating("cpu")},
    ),
}


def _axis_fit(model: pl.LightningModule, options: dict[str, Any], **fit: Any) -> AxisOracle:
    oracle = AxisOracle()
    callbacks = [oracle, *options.pop("callbacks", [])]
    options = {"max_epochs": 2, "limit_val_batches": 1, "num_sanity_val_steps": 0, **options}
    if len(callbacks) > 1:  # a ModelCheckpoint
        options["enable_checkpointing"] = True
    trainer = pl.Trainer(**{**QUIET, **options}, callbacks=callbacks)
    trainer.fit(model, _data(7), _data(2), **fit)
    trainer.validate(model, _data(2), verbose=False)
    trainer.test(model, _data(2), verbose=False)
    return oracle


@pytest.mark.parametrize("case", list(AXIS_CASES))
def test_step_axis_agrees_with_lightning_at_every_hook(case: str) -> None:
    model, options = AXIS_CASES[case]
    oracle = _axis_fit(model(), dict(options))
    assert {hook for hook, *_ in oracle.seen} >= {"on_train_batch_end", "on_validation_end"}
    disagreements = [s for s in oracle.seen if s[1] != s[2]]
    assert not disagreements, disagreements
    # the test decides something: the optimizer steps are not that axis at some hook
    assert any(lightning != global_step for _, _, lightning, global_step in oracle.seen)


def _saving_in_training_step(model: type[Net], directory: Path) -> type[Net]:
    """``model`` saving a checkpoint at the start of ``training_step`` of the first epoch's
    batches 2 to 4, as ``OnExceptionCheckpoint`` saves after it raised: the batch started,
    not completed, and no optimizer stepped for it."""

    class SavesInTrainingStep(model):  # type: ignore[valid-type,misc]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.current_epoch == 0 and batch_idx in (2, 3, 4):
                self.trainer.save_checkpoint(directory / f"in-step-{batch_idx}.ckpt")
            return super().training_step(batch, batch_idx)

    return SavesInTrainingStep


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("saved", ["batch-end", "validation-end", "epoch-end", "training-step"])
def test_step_axis_agrees_with_lightning_after_a_resume(
    tmp_path: Path, saved: str, manual: bool
) -> None:
    """Lightning restores its axis with a correction for where the checkpoint was saved; the
    public counters the axis is derived from are restored too. Saved inside
    ``training_step`` (with accumulation 2 in automatic optimization: in a batch that
    accumulates, one that steps, one that accumulates), Lightning's axis of the resumed run
    counts the unfinished batch if it was to step."""
    model = TwoOptimizersEvaluated if manual else Evaluated
    interval = {"val_check_interval": 3} if saved == "validation-end" else {}
    accumulate = {} if manual else {"accumulate_grad_batches": 2}
    if saved == "training-step":
        first = _axis_fit(_saving_in_training_step(model, tmp_path)(), dict(accumulate))
    else:
        every = {
            "batch-end": {"every_n_train_steps": 2, "save_on_train_epoch_end": False},
            "validation-end": {"save_on_train_epoch_end": False},
            "epoch-end": {"save_on_train_epoch_end": True},
        }[saved]
        checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, **every)
        first = _axis_fit(model(), {**interval, **accumulate, "callbacks": [checkpoint]})
    assert not [s for s in first.seen if s[1] != s[2]]
    saved_files = sorted(tmp_path.glob("*.ckpt"))
    assert len(saved_files) >= 2
    for path in saved_files[:3]:
        oracle = _axis_fit(model(), {**interval, **accumulate, "max_epochs": 3}, ckpt_path=path)
        assert oracle.seen
        disagreements = [s for s in oracle.seen if s[1] != s[2]]
        assert not disagreements, (path.name, disagreements)


class Interrupted(Exception):
    """Stops a fit inside a batch, as a crash would."""


class LogsLoss(Net):
    """``self.log("loss")`` in every ``training_step``; in batch 5 of the first epoch, ``how``
    ``"raise"`` raises in ``training_step`` (for ``OnExceptionCheckpoint``), and
    ``"training_step"`` and ``"on_train_batch_end"`` call ``trainer.save_checkpoint`` there."""

    def __init__(self, how: str | None = None, path: Path | None = None) -> None:
        super().__init__()
        self.how, self.path = how, path

    def _save_at(self, hook: str, batch_idx: int) -> None:
        if self.current_epoch == 0 and batch_idx == 5 and self.how in (hook, "raise"):
            if self.how == "raise":
                raise Interrupted
            self.trainer.save_checkpoint(self.path)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        if self.how != "on_train_batch_end":
            self._save_at("training_step", batch_idx)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._save_at("on_train_batch_end", batch_idx)


class LabelOracle(pl.Callback):
    """Lightning's own step of each training batch (its private ``_batches_that_stepped``,
    read here as the reference), by ``(epoch, batch_idx)``."""

    def __init__(self) -> None:
        self.labels: dict[tuple[int, int], int] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        label = trainer.fit_loop.epoch_loop._batches_that_stepped
        self.labels[(trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)] = label


def _logged_fit(
    tmp_path: Path, version: str, model: LogsLoss, callbacks: list[Any], **fit: Any
) -> tuple[dict[str, list[int]], LabelOracle]:
    """A fit (7 batches an epoch, 2 epochs, ``log_every_n_steps=2``) with a
    ``FeatureStatsMonitor`` following the Trainer's cadence and an ``ActivationWriter`` of
    every training batch; the steps of its CSV log at which Lightning logged ``loss`` and at
    which the monitor logged."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_recorder import ActivationWriter, FeatureStatsMonitor

    oracle = LabelOracle()
    monitor = FeatureStatsMonitor("layer", histograms=False)
    writer = ActivationWriter("layer", tmp_path / "rows", stages="train", fsync=False)
    logger = CSVLogger(tmp_path, name="logs", version=version)
    trainer = pl.Trainer(
        **{**HELPER_QUIET, "enable_checkpointing": bool(callbacks)},
        callbacks=[monitor, writer, oracle, *callbacks],
        logger=logger,
        max_epochs=2,
        log_every_n_steps=2,
    )
    with contextlib.suppress(Interrupted):
        trainer.fit(model, _data(7), **fit)
    steps: dict[str, list[int]] = {"loss": [], "monitor": []}
    with open(tmp_path / "logs" / version / "metrics.csv") as file:
        for row in csv.DictReader(file):
            logged = {key for key, value in row.items() if value and key not in ("step", "epoch")}
            if "loss" in logged:
                steps["loss"].append(int(row["step"]))
            if logged - {"loss"}:
                steps["monitor"].append(int(row["step"]))
    return steps, oracle


@pytest.mark.parametrize(
    "how", ["raise", "training_step", "on_train_batch_end", "every_n_train_steps"]
)
def test_a_fit_resumed_from_inside_a_batch_logs_and_writes_at_lightnings_steps(
    tmp_path: Path, how: str
) -> None:
    """Saved inside a batch (``OnExceptionCheckpoint`` when ``training_step`` raises,
    ``trainer.save_checkpoint`` in ``training_step`` or in ``on_train_batch_end``,
    ``ModelCheckpoint(every_n_train_steps=5)``) and resumed: the monitor logs on the batches
    and at the steps Lightning logs ``loss`` at, and the activation rows of each batch carry
    Lightning's step of that batch, in the resumed run as in the first. (Saved before the
    batch's step, Lightning's steps of the resumed run are one more than an uninterrupted
    fit's: those are followed.)"""
    path = tmp_path / "inside.ckpt"
    callbacks: dict[str, list[Any]] = {
        "raise": [OnExceptionCheckpoint(tmp_path, filename="inside")],
        "every_n_train_steps": [
            ModelCheckpoint(tmp_path / "every", every_n_train_steps=5, save_top_k=-1)
        ],
    }
    first, first_labels = _logged_fit(
        tmp_path, "first", LogsLoss(how, path), callbacks.get(how, [])
    )
    if how == "every_n_train_steps":
        (path,) = (tmp_path / "every").glob("*step=5.ckpt")
    resumed, labels = _logged_fit(tmp_path, "resumed", LogsLoss(), [], ckpt_path=path)
    assert first["loss"][:2] == [1, 3]
    assert first["monitor"] == first["loss"]
    assert resumed["loss"], resumed
    assert resumed["monitor"] == resumed["loss"]
    # each batch written once: the first run's up to the checkpoint, then the resumed run's
    rows = {
        (row["epoch"], row["batch_idx"]): row["global_step"]
        for row in ActivationDataset(tmp_path / "rows").provenance()
    }
    assert rows == {**first_labels.labels, **labels.labels}
    assert len(rows) == 14


def test_state_key_is_made_once_and_then_read_without_a_python_call() -> None:
    """Lightning reads ``state_key`` at every hook call (into a profiler label): after the first
    read it is an attribute of the callback, which no Python function runs to read."""
    import sys

    from lightning_recorder import (
        ActivationWriter,
        FeatureDistillation,
        FeatureStatsMonitor,
        HealthMonitor,
    )

    made = [
        FeatureStatsMonitor([nn.Linear], every_n_steps=3),
        ActivationWriter(["body"], "memory://acts"),
        HealthMonitor(on_nonfinite="skip"),
        FeatureDistillation(nn.Sequential(nn.Linear(2, 2)), {"0": "0"}),
    ]
    for callback in made:
        first = callback.state_key
        assert first.startswith(type(callback).__name__) and first == callback._make_state_key()
        calls: list[str] = []

        def profile(frame: Any, event: str, arg: Any, calls: list[str] = calls) -> None:
            if event == "call":  # a Python function entered
                calls.append(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            again = (callback.state_key, callback.state_key, callback.state_key)
        finally:
            sys.setprofile(None)
        assert again == (first,) * 3 and calls == [], (type(callback).__name__, calls)
    assert len({c.state_key for c in made}) == len(made)
