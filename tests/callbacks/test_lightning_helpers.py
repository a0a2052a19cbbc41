"""The Lightning helpers the callbacks share, against Lightning's own loop state in real runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import QUIET as HELPER_QUIET
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

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


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("saved", ["batch-end", "validation-end", "epoch-end"])
def test_step_axis_agrees_with_lightning_after_a_resume(
    tmp_path: Path, saved: str, manual: bool
) -> None:
    """Lightning restores its axis with a correction for where the checkpoint was saved; the
    public counters the axis is derived from are restored too."""
    model = TwoOptimizersEvaluated if manual else Evaluated
    every = {
        "batch-end": {"every_n_train_steps": 2, "save_on_train_epoch_end": False},
        "validation-end": {"save_on_train_epoch_end": False},
        "epoch-end": {"save_on_train_epoch_end": True},
    }[saved]
    interval = {"val_check_interval": 3} if saved == "validation-end" else {}
    accumulate = {} if manual else {"accumulate_grad_batches": 2}
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
