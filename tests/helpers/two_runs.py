"""One callback handed to two Trainers running at once (a sweep in threads): the first run is
held at its second batch while the second starts, which must be refused."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_recorder.errors import RecorderStateError

TIMEOUT = 240  # seconds: only a deadlock would reach it


class Hold(pl.Callback):
    """Holds the run at the start of its second batch until ``go`` is set."""

    def __init__(self) -> None:
        self.inside, self.go = threading.Event(), threading.Event()

    def on_train_batch_start(self, trainer: pl.Trainer, m: Any, batch: Any, idx: int) -> None:
        if idx == 1:
            self.inside.set()
            assert self.go.wait(TIMEOUT)


def check_second_run_refused(
    first: Callable[[], object], second: Callable[[], object], hold: Hold
) -> None:
    """Run ``first`` (a fit whose callbacks hold ``hold``) in thread ``"A"`` until it is held at
    its second batch, then ``second`` (a fit with the same callback) in thread ``"B"``: the
    second is refused at its start with a :class:`RecorderStateError` naming thread ``"A"``, and
    the first, let go once the second has ended, ends without an error."""
    errors: dict[str, BaseException] = {}

    def run(name: str, fit: Callable[[], object]) -> None:
        try:
            fit()
        except BaseException as err:  # handed to the main thread
            errors[name] = err
        finally:
            hold.go.set()

    a = threading.Thread(target=run, args=("A", first), name="A", daemon=True)
    b = threading.Thread(target=run, args=("B", second), name="B", daemon=True)
    a.start()
    assert hold.inside.wait(TIMEOUT)
    b.start()
    for worker in (b, a):
        worker.join(TIMEOUT)
        assert not worker.is_alive()
    assert list(errors) == ["B"]
    with pytest.raises(RecorderStateError, match=r"one run at a time.*in thread 'A'.*its own"):
        raise errors["B"]
