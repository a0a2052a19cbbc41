"""The Lightning helpers the callbacks share, against Lightning's own loop state in real runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import QUIET as HELPER_QUIET
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_recorder.callbacks._lightning import completes_step

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
