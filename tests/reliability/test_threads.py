"""Thread safety: a recorder (or manager) records for one thread at a time.

Two threads entering the same context used to both succeed, and one then silently read the
other's records. Entering a context another thread holds now raises a `RecorderStateError` naming
that thread. The tests use real threads ordered by events and barriers, never by sleeps.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_recorder import (
    FunctionOutputsRecorder,
    ModuleOutputsRecorder,
    RecorderManager,
    RecorderStateError,
)
from lightning_recorder.errors import RecorderError

TIMEOUT = 240  # seconds: only a deadlock would reach it, even on a loaded 2-core machine


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


class Worker(threading.Thread):
    """Runs ``body`` and keeps its result or its exception for the main thread."""

    def __init__(self, name: str, body: Callable[[], Any]) -> None:
        super().__init__(name=name, daemon=True)
        self.body = body
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.body()
        except BaseException as err:  # handed to the main thread
            self.error = err


def join(*workers: Worker) -> None:
    for worker in workers:
        worker.join(TIMEOUT)
        assert not worker.is_alive(), f"{worker.name} did not finish"


def test_entering_a_recorder_held_by_another_thread_raises_naming_it() -> None:
    net = model()
    recorder = ModuleOutputsRecorder("0").initialize(net)
    entered, tried = threading.Event(), threading.Event()
    x_a, x_b = torch.randn(2, 3), torch.randn(5, 3)

    def holder() -> torch.Tensor:
        with recorder:
            entered.set()
            assert tried.wait(TIMEOUT)
            net(x_a)
            return recorder.get_record_data()

    def intruder() -> None:
        assert entered.wait(TIMEOUT)
        try:
            with recorder:
                net(x_b)  # never runs: entering raises
        finally:
            tried.set()

    a, b = Worker("holder-A", holder), Worker("intruder-B", intruder)
    try:
        a.start()
        b.start()
        join(a, b)
    finally:
        recorder.release()
    assert a.error is None
    assert isinstance(b.error, RecorderStateError)
    with pytest.raises(RecorderStateError, match=r"recording in thread 'holder-A'"):
        raise b.error
    # The holder's records are its own: one call, its own batch.
    assert len(recorder.data_buffer) == 1
    torch.testing.assert_close(a.result, net[0](x_a), rtol=0, atol=0)  # same op, same input


def test_start_from_another_thread_raises_and_the_same_thread_may_restart() -> None:
    net = model()
    recorder = ModuleOutputsRecorder("0").initialize(net)
    try:
        recorder.start()
        recorder.start()  # idempotent in the holding thread
        other = Worker("other", recorder.start)
        other.start()
        join(other)
        assert isinstance(other.error, RecorderStateError)
        assert "MainThread" in str(other.error)
        recorder.stop()
        again = Worker("after-stop", recorder.start)  # free again: another thread may record
        again.start()
        join(again)
        assert again.error is None and recorder.recording
    finally:
        recorder.stop()
        recorder.release()


def test_only_one_of_two_threads_entering_at_once_gets_the_manager() -> None:
    net = model()
    manager = RecorderManager(
        {"first": {"type": "ModuleOutputs", "source": "0"}, "last": ModuleOutputsRecorder("2")}
    )
    manager.initialize(net)
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    done = threading.Event()
    inputs = {"A": torch.randn(2, 3), "B": torch.randn(7, 3)}

    def body(tag: str) -> Callable[[], int]:
        def run() -> int:
            barrier.wait()  # both threads enter as close together as the scheduler allows
            try:
                with manager:
                    net(inputs[tag])
                    assert done.wait(TIMEOUT)  # hold the context until the other has tried
                    return int(manager.get_recorder("first").get_record_data().shape[0])
            except RecorderError:
                done.set()
                raise

        return run

    a, b = Worker("A", body("A")), Worker("B", body("B"))
    try:
        a.start()
        b.start()
        join(a, b)
    finally:
        manager.release()
    winners = [w for w in (a, b) if w.error is None]
    losers = [w for w in (a, b) if w.error is not None]
    assert len(winners) == 1 and len(losers) == 1, [a.error, b.error]
    winner, loser = winners[0], losers[0]
    assert isinstance(loser.error, RecorderStateError)
    assert f"recording in thread {winner.name!r}" in str(loser.error)
    # The winner's records hold exactly its own batch, one call each: nothing of the loser.
    assert winner.result == inputs[winner.name].shape[0]
    assert len(manager.get_recorder("first").data_buffer) == 1
    assert len(manager.get_recorder("last").data_buffer) == 1
    assert not manager.recording


def run_two(
    body: Callable[[str], Callable[[], Any]], release: Callable[[], Any]
) -> tuple[Worker, Worker, list[str]]:
    """Run ``body("A")`` and ``body("B")`` in two threads at once, then ``release()`` what they
    recorded with; the two workers (both without error) and the warnings meanwhile that a call
    "was not recorded"."""
    a, b = Worker("A", body("A")), Worker("B", body("B"))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a.start()
            b.start()
            join(a, b)
    finally:
        release()
    assert a.error is None and b.error is None
    return a, b, [str(w.message) for w in caught if "was not recorded" in str(w.message)]


def test_parallel_threads_each_record_only_their_own_calls() -> None:
    net = model()
    recorders = {tag: ModuleOutputsRecorder("0").initialize(net) for tag in ("A", "B")}
    both_in = threading.Barrier(2, timeout=TIMEOUT)
    inputs = {"A": torch.randn(2, 3), "B": torch.randn(4, 3)}

    def body(tag: str) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            with recorders[tag]:
                both_in.wait()  # both contexts open at once
                net(inputs[tag])
                both_in.wait()  # both forwards done before either context closes
            return list(recorders[tag].data_buffer)

        return run

    a, b, unrecorded = run_two(body, lambda: [r.release() for r in recorders.values()])
    # Both recorders hook the same module, and both forwards ran while both recorded: each kept
    # only the call of its own thread. The other thread's call was recorded by that thread's own
    # recorder: not reported as unrecorded.
    assert unrecorded == []
    for worker in (a, b):
        (record,) = worker.result
        torch.testing.assert_close(record, net[0](inputs[worker.name]), rtol=0, atol=0)


@pytest.mark.parametrize("own_recorder", [True, False], ids=["each-thread-records", "one-records"])
def test_a_call_is_reported_unrecorded_only_where_its_thread_does_not_record_it(
    own_recorder: bool,
) -> None:
    # Two threads, each with a manager of its own recording one global function: the function's
    # patch serves both managers, and each thread's call is recorded by its own thread's manager.
    # A thread that records nothing itself gets the warning: its call was recorded by no one.
    tags = ("A", "B") if own_recorder else ("A",)
    managers = {
        tag: RecorderManager({"relu": FunctionOutputsRecorder("torch.nn.functional.relu")})
        for tag in tags
    }
    for manager in managers.values():
        manager.initialize()
    both_in = threading.Barrier(2, timeout=TIMEOUT)
    inputs = {"A": torch.randn(2, 3), "B": torch.randn(4, 3)}

    def body(tag: str) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            context = managers[tag] if tag in managers else contextlib.nullcontext()
            with context:
                both_in.wait()
                torch.nn.functional.relu(inputs[tag])
                both_in.wait()
            if tag not in managers:
                return []
            return list(managers[tag].get_recorder("relu").data_buffer)

        return run

    a, b, unrecorded = run_two(body, lambda: [m.release() for m in managers.values()])
    for worker in (a, b) if own_recorder else (a,):
        (record,) = worker.result
        torch.testing.assert_close(record, inputs[worker.name].relu(), rtol=0, atol=0)
    if own_recorder:
        assert unrecorded == []
    else:
        assert len(unrecorded) == 1 and "in thread 'B' was not recorded" in unrecorded[0]
