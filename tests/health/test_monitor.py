"""HealthMonitor in real Trainer runs: policies, replay hygiene, evidence, reporting, options."""

from __future__ import annotations

import copy
import json
import logging
import math
import pickle
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.health_models import Fault, Injector, Net, data
from helpers.models import QUIET
from helpers.two_runs import Hold, check_second_run_refused
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_recorder import (
    DeadUnitsRule,
    FeatureDistillation,
    FeatureStatsMonitor,
    HealthEvent,
    HealthMonitor,
    NonFiniteError,
    RecorderConfigError,
    RecorderError,
    UnknownSourceError,
    UpdateRatioRule,
)
from lightning_recorder.callbacks import health as health_module
from lightning_recorder.callbacks._health_event import describe
from lightning_recorder.callbacks._health_sentinel import Reading, Sentinel
from lightning_recorder.callbacks.health import HealthRule, RuleInput


def fit(
    model: pl.LightningModule,
    callbacks: list[pl.Callback],
    steps: int = 4,
    loader: Any = None,
    **kwargs: Any,
) -> pl.Trainer:
    options = {**QUIET, "logger": False, "max_steps": steps, **kwargs}
    trainer = pl.Trainer(callbacks=callbacks, **options)
    trainer.fit(model, loader if loader is not None else data(model.arch, 4 * steps))
    return trainer


class Snapshots(pl.Callback):
    """Parameters and optimizer state after every batch."""

    def __init__(self) -> None:
        self.states: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.states.append(
            {
                "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
                "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()["state"]),
            }
        )


def same(a: Any, b: Any) -> bool:
    """Equal bit for bit (a skipped update must leave no trace at all)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():  # NaN where NaN, the same bits elsewhere
            return torch.equal(a.isnan(), b.isnan()) and torch.equal(
                a.nan_to_num(0), b.nan_to_num(0)
            )
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


# ---------------------------------------------------------------------------- policies
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_skip_changes_neither_parameters_nor_optimizer_state(
    optimizer: str, tmp_path: Path
) -> None:
    model = Net("mlp", optimizer=optimizer)
    shots = Snapshots()
    monitor = HealthMonitor("skip", evidence_dir=tmp_path)
    fit(model, [Injector({2: Fault("body.2", "forward", "nan", 2)}), monitor, shots], steps=4)
    assert [(e.step, e.module, e.direction, e.action) for e in monitor.events] == [
        (2, "body.2", "forward", "skipped")
    ]
    before, skipped, after = shots.states[1], shots.states[2], shots.states[3]
    assert same(before, skipped)  # momentum, weight decay, Adam's moments and step count
    assert not same(skipped["params"], after["params"])  # and training went on
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert monitor.counters["skipped_steps"] == 1 and monitor.counters["nonfinite_steps"] == 1


class _Normed(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_skipped_step_says_which_buffers_its_forward_left_non_finite() -> None:
    """The update is skipped, but BatchNorm's running statistics took the bad batch in the
    forward: evaluation reads them, and the event says so."""
    x = torch.randn(12, 4)
    x[5, 1] = math.nan  # batch 1
    monitor = HealthMonitor("skip", rules=(), evidence_max_bytes=0)
    model = _Normed()
    fit(model, [monitor], steps=3, loader=DataLoader(TensorDataset(x), batch_size=4))
    [event] = monitor.events
    names = ["body.1.running_mean", "body.1.running_var"]
    assert event.details["nonfinite_buffers"] == names
    assert not torch.isfinite(model.body[1].running_mean).all()  # the skip did not undo them
    assert "the update was skipped, but its forward left non-finite values in the buffers " in (
        event.message
    )
    assert "`body.1.running_mean`, `body.1.running_var`" in event.message


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_skip_works_with_gradient_clipping(algorithm: str, tmp_path: Path) -> None:
    """Lightning clips right after the check: a skipped step leaves no gradient, and clipping by
    value must not fail on that; the Trainer's clipping is as it was afterwards."""
    model = Net("mlp", optimizer="adam")
    shots = Snapshots()
    monitor = HealthMonitor("skip", evidence_dir=tmp_path)
    callbacks = [Injector({2: Fault("body.2", "forward", "nan", 2)}), monitor, shots]
    trainer = fit(
        model, callbacks, steps=4, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm
    )
    assert [(e.step, e.module, e.action) for e in monitor.events] == [(2, "body.2", "skipped")]
    assert same(shots.states[1], shots.states[2])  # the skipped update left no trace
    assert not same(shots.states[2]["params"], shots.states[3]["params"])
    assert trainer.global_step == 4 and trainer.gradient_clip_val == 0.5
    assert trainer.gradient_clip_algorithm == algorithm


def test_a_second_run_at_once_is_refused_and_the_first_still_finds_its_fault(
    tmp_path: Path,
) -> None:
    # One monitor handed to two Trainers running at once (a sweep in threads): the second run
    # used to reset the first's parameter names and windows, and release its step records at
    # its end; it is now refused at its start, naming the first run's thread.
    monitor, hold = HealthMonitor("skip", evidence_dir=tmp_path), Hold()
    first = Net("mlp")
    injector = Injector({2: Fault("body.2", "forward", "nan", 2)})
    check_second_run_refused(
        lambda: fit(first, [injector, monitor, hold], steps=4),
        lambda: fit(Net("mlp"), [monitor], steps=4),
        hold,
    )
    assert [(e.step, e.module, e.direction, e.action) for e in monitor.events] == [
        (2, "body.2", "forward", "skipped")
    ]
    assert monitor.counters["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in first.parameters())


def test_raise_writes_the_evidence_then_raises(tmp_path: Path) -> None:
    model = Net("resnet")
    monitor = HealthMonitor("raise", evidence_dir=tmp_path)
    fault = Fault("body.3.bn1", "forward", "posinf", 1, index=5)
    with pytest.raises(NonFiniteError, match=r"`body\.3\.bn1` made non-finite values") as info:
        fit(model, [Injector({1: fault}), monitor], steps=3)
    err = info.value
    assert isinstance(err, RecorderError) and isinstance(err, RuntimeError)
    event = err.event
    assert isinstance(event, HealthEvent) and event is monitor.events[-1]
    assert (event.module, event.direction, event.path, event.producer) == (
        "body.3.bn1",
        "forward",
        "output",
        True,
    )
    assert event.counts == {"nan": 0, "posinf": 1, "neginf": 0}
    assert event.shape == (4, 8, 8, 8) and event.dtype == "torch.float32"
    assert (event.step, event.batch_idx, event.rank, event.action) == (1, 1, 0, "raised")
    assert event.reproduced is True
    bundle = Path(event.evidence)
    assert bundle == tmp_path / "step00000001-rank0" and str(bundle) in event.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000001-rank0"]  # no temp dirs
    # readable without lightning_recorder: safetensors and JSON
    tensors = load_file(str(bundle / "tensors.safetensors"))
    meta = json.loads((bundle / "event.json").read_text())
    x, y = list(data("resnet", 12))[1]
    assert torch.equal(tensors["batch.0"], x) and torch.equal(tensors["batch.1"], y)
    assert tensors["body.3.bn1.output"].isposinf().sum() == 1
    assert "body.3.bn1.input.input" in tensors and tensors["rng.cpu"].dtype == torch.uint8
    assert meta["event"]["module"] == "body.3.bn1" and meta["step"] == 1 and meta["rank"] == 0
    assert meta["tensors"]["body.3.bn1.output"]["posinf"] == 1
    assert meta["batch"] == [
        {"tensor": "torch.float32", "shape": [4, 3, 8, 8]},
        {"tensor": "torch.int64", "shape": [4]},
    ]
    kinds = {row["kind"] for row in meta["summary"]}
    assert {"input", "output", "loss"} <= kinds
    assert pickle.loads(pickle.dumps(err)).event.module == "body.3.bn1"


def test_warn_lets_training_go_on_and_replays_only_the_first_bad_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = Net("mlp")
    monitor = HealthMonitor("warn", evidence_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="lightning_recorder.health"):
        fit(model, [Injector({1: Fault("body.4", "forward", "nan", 1)}), monitor], steps=4)
    first, *later = monitor.events
    assert (first.step, first.module, first.direction, first.action) == (
        1,
        "body.4",
        "forward",
        "warned",
    )
    # The update went through: every later step is non-finite, counted, not replayed.
    assert [e.step for e in later] == [2, 3]
    assert all(e.module is None and e.reproduced is None and e.evidence is None for e in later)
    assert model.logged == [0, 1, 1, 2, 3]  # training_step ran again for step 1 only
    assert [r.getMessage() for r in caplog.records] == [first.message]
    assert monitor.counters["nonfinite_steps"] == 3
    assert len(list(tmp_path.iterdir())) == 1


def test_max_consecutive_skips_then_raise(tmp_path: Path) -> None:
    faults = {s: Fault("body.0", "forward", "nan", s) for s in range(5)}
    monitor = HealthMonitor("skip", max_consecutive_skips=2, evidence_max_bytes=0)
    with pytest.raises(NonFiniteError, match=r"2 non-finite steps in a row were skipped"):
        fit(Net("mlp"), [Injector(faults), monitor], steps=5)
    assert [e.action for e in monitor.events] == ["skipped", "skipped", "raised"]


class Clock(pl.Callback):
    """The reporter's clock: 100 s per optimizer step."""

    def __init__(self) -> None:
        self.now = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.now = 100.0 * trainer.global_step

    def monotonic(self) -> float:
        return self.now


def test_skip_notices_are_rate_limited_per_module_as_rule_findings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under "skip", a skipped step is a warning (and a text entry) only when no step skipped
    for its module was noticed for `alert_interval_s` seconds; the next notice says how many
    went without one; every skipped step is an event, a DEBUG record and a counted step."""
    from types import SimpleNamespace

    from lightning_recorder.callbacks import _health_report

    clock = Clock()
    monkeypatch.setattr(_health_report, "time", SimpleNamespace(monotonic=clock.monotonic))
    where = {1: "body.2", 2: "body.2", 3: "body.0", 5: "body.2", 6: "body.2", 7: "body.2"}
    where[9] = "body.2"
    faults = {step: Fault(module, "forward", "nan", step) for step, module in where.items()}
    monitor = HealthMonitor("skip", rules=(), alert_interval_s=250, evidence_max_bytes=0)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    with caplog.at_level(logging.DEBUG, logger="lightning_recorder.health"):
        fit(Net("mlp"), [clock, Injector(faults), monitor], steps=11, logger=logger)
    events = {e.step: e for e in monitor.events}
    assert {s: (e.module, e.action) for s, e in events.items()} == {
        s: (m, "skipped") for s, m in where.items()
    }
    # 1: the first; 3: another module; 5 and 9: 400 s after the last notice of body.2
    noticed = [1, 3, 5, 9]
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert records == [
        (logging.WARNING if s in noticed else logging.DEBUG, events[s].message) for s in where
    ]
    assert "; 1 step skipped since the last notice (logged at DEBUG);" in events[3].message
    assert "since the last notice" not in events[5].message
    assert "; 2 steps skipped since the last notice (logged at DEBUG);" in events[9].message
    assert events[9].details["skipped_since_notice"] == 2
    assert monitor.counters["skipped_steps"] == 7 and monitor.state_dict()["counters"] == (
        monitor.counters
    )
    acc = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("health/events/text_summary")
    assert [t.step for t in texts] == noticed
    # the counter of skipped steps is logged at every skipped step, noticed or not
    skipped = {e.step: e.value for e in acc.Scalars("health/skipped_steps")}
    assert skipped == {s: float(k + 1) for k, s in enumerate(where)}


class Interrupt(pl.Callback):
    """Ctrl-C at the start of batch ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            raise KeyboardInterrupt


def test_a_new_fit_counts_only_its_own_steps_in_a_row(restore_sigint: None) -> None:
    faults = {s: Fault("body.0", "forward", "nan", s) for s in range(2)}
    monitor = HealthMonitor("skip", max_consecutive_skips=2, evidence_max_bytes=0)
    with pytest.raises(SystemExit):  # interrupted after two skipped steps in a row
        fit(Net("mlp"), [Injector(faults), monitor, Interrupt(2)], steps=4)
    # A new fit (not resumed) whose first step is non-finite: skipped, not refused as the third
    # in a row
    fit(Net("mlp"), [Injector({0: Fault("body.0", "forward", "nan", 0)}), monitor], steps=3)
    assert [(e.step, e.action) for e in monitor.events] == [(0, "skipped")]  # this fit's only
    assert monitor.state_dict()["streaks"] == {0: 0}


def test_each_fit_has_its_own_events_and_counters_but_a_resumed_fit_goes_on(
    tmp_path: Path,
) -> None:
    """A monitor reused for a second `fit` (a notebook) kept the first fit's events and
    counters; a fit resumed from a checkpoint goes on with the checkpoint's counters."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(fault: int | None, ckpt: str | None = None, saving: bool = False) -> None:
        faults = {} if fault is None else {fault: Fault("body.0", "forward", "nan", fault)}
        callbacks: list[pl.Callback] = [Injector(faults), monitor]
        options: dict[str, Any] = {"max_steps": 4}
        if saving:
            callbacks.append(ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1))
            options["enable_checkpointing"] = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a checkpoint within the epoch: not resumable data
            trainer = pl.Trainer(callbacks=callbacks, **{**QUIET, "logger": False, **options})
            trainer.fit(Net("mlp"), data("mlp", 16), ckpt_path=ckpt)

    def counts() -> tuple[int, int, list[tuple[int, str | None]]]:
        found = [(e.step, e.action) for e in monitor.events]
        return monitor.counters["nonfinite_steps"], monitor.counters["skipped_steps"], found

    monitor = HealthMonitor("skip", rules=(), evidence_max_bytes=0)
    run(1, saving=True)  # saves at steps 2 and 4, after its skipped step 1
    assert counts() == (1, 1, [(1, "skipped")])
    run(3)  # a second fit of the same monitor: its own step 3 only
    assert counts() == (1, 1, [(3, "skipped")])
    run(None)  # a clean fit: nothing
    assert counts() == (0, 0, [])
    # resumed at step 2 from the first fit's checkpoint: its counters go on, its events are this
    # fit's own (the checkpoint holds none)
    run(3, ckpt=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert counts() == (2, 2, [(3, "skipped")])


@pytest.mark.parametrize("interrupted", [False, True], ids=["fit", "interrupted"])
def test_a_monitor_leaves_nothing_on_the_feature_stats_monitor_after_its_fit(
    interrupted: bool, tmp_path: Path, restore_sigint: None
) -> None:
    """The dead-unit and saturation rules ask the FeatureStatsMonitor for per-channel extremes;
    a later fit of that FeatureStatsMonitor without the HealthMonitor computes none."""
    stats = FeatureStatsMonitor(["body.3", "body.4", "body.6"], every_n_steps=1)
    monitor = HealthMonitor(evidence_max_bytes=0)
    reports: list[Any] = []
    stats.subscribe(reports.append)
    if interrupted:
        with pytest.raises(SystemExit):
            fit(Net("mlp"), [stats, monitor, Interrupt(1)], steps=3, logger=CSVLogger(tmp_path))
    else:
        fit(Net("mlp"), [stats, monitor], steps=1, logger=CSVLogger(tmp_path))
    # the channels of the ReLU (dead units) and the Sigmoid (saturation), for the rules
    assert len(reports) == 1 and set(reports[0].channels) == {"body.4", "body.6"}
    reports.clear()
    fit(Net("mlp"), [stats], steps=2, logger=CSVLogger(tmp_path))
    assert len(reports) == 2 and all(r.channels == {} for r in reports)


def test_a_clean_run_reports_nothing(tmp_path: Path) -> None:
    monitor = HealthMonitor("raise", evidence_dir=tmp_path)
    fit(Net("transformer"), [monitor], steps=3)
    assert monitor.events == [] and not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------- replay hygiene
class LogCounter(Net):
    def __init__(self, arch: str) -> None:
        super().__init__(arch)
        self.log_calls = 0

    def log(self, *args: Any, **kwargs: Any) -> None:
        self.log_calls += 1
        super().log(*args, **kwargs)


class Around(pl.Callback):
    """Snapshots at ``on_before_optimizer_step`` (one before the monitor, one after it)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        self.seen.append(
            {
                "buffers": {n: b.clone() for n, b in pl_module.named_buffers()},
                "grads": {n: p.grad.clone() for n, p in pl_module.named_parameters()},
                "rng": torch.get_rng_state(),
            }
        )


def test_replay_restores_buffers_rng_and_gradients_and_logs_nothing_twice() -> None:
    model = LogCounter("resnet")
    before, after = Around(), Around()
    monitor = HealthMonitor("warn", evidence_max_bytes=0)
    injector = Injector({1: Fault("body.4.bn2", "backward", "nan", 1)})
    fit(model, [injector, before, monitor, after], steps=2)
    assert [(e.module, e.direction) for e in monitor.events] == [("body.4.bn2", "backward")]
    assert model.logged == [0, 1, 1]  # the replay ran training_step ...
    assert model.log_calls == 2  # ... but self.log only went through once per step
    assert same(before.seen[1], after.seen[1])  # BatchNorm statistics, grads, RNG restored


def test_replay_draws_the_same_dropout_masks() -> None:
    counts: list[int] = []
    model = Net("dropout")
    model.body[2].register_forward_hook(
        lambda m, i, out: counts.append(int((~torch.isfinite(out)).sum()))
    )
    monitor = HealthMonitor("skip", max_consecutive_skips=10, evidence_max_bytes=0)
    fit(model, [monitor], steps=3)
    # every step: the real forward, then the replay's; the replay saw what the step saw
    assert len(counts) == 6 and counts[0::2] == counts[1::2]
    assert [e.total for e in monitor.events] == counts[0::2]
    assert all(e.module == "body.2" and e.reproduced for e in monitor.events)


class NaNWhileOn(nn.Module):
    """The identity, or NaN everywhere while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * math.nan if self.on else x


class DropoutThenNaN(Net):
    """Dropout, then a head whose output is NaN on the last micro-batch of each optimizer step;
    the dropout layer's output of every training batch is kept, in order."""

    def __init__(self, accumulate: int) -> None:
        super().__init__("mlp")
        self.body = nn.Sequential(
            nn.Linear(12, 16), nn.Dropout(0.5), nn.Linear(16, 4), NaNWhileOn()
        )
        self.accumulate = accumulate
        self.dropped: list[torch.Tensor] = []
        self.body[1].register_forward_hook(lambda m, i, out: self.dropped.append(out.detach()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.body[3].on = batch_idx % self.accumulate == self.accumulate - 1
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("localize", ["always", False])
def test_every_bundle_holds_the_random_state_that_redraws_the_steps_dropout_mask(
    localize: Any, accumulate: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a replay too, the bundle holds the random state taken before the forward of its
    micro-batch (the second of a step under accumulation, whose mask differs from the first's):
    set again, it draws that micro-batch's dropout mask on the bundle's batch."""
    captures = _count_captures(monkeypatch)
    model = DropoutThenNaN(accumulate)
    monitor = HealthMonitor(
        "skip", localize=localize, evidence_dir=tmp_path, max_consecutive_skips=10, rules=()
    )
    loader = data("mlp", 4 * 3 * accumulate)  # one epoch: batch indices are batches
    fit(model, [monitor], steps=3, loader=loader, accumulate_grad_batches=accumulate)
    assert captures == list(range(3 * accumulate))  # once per micro-batch, no replay
    assert len(model.dropped) == 3 * accumulate
    assert [e.step for e in monitor.events] == [0, 1, 2]
    model.train()  # dropout on, as in the step; the parameters are the steps' (all skipped)
    for event in monitor.events:
        assert event.batch_idx == accumulate * event.step + accumulate - 1
        bundle = Path(event.evidence)
        tensors = load_file(bundle / "tensors.safetensors")
        x = loader.dataset.tensors[0]  # type: ignore[attr-defined]
        assert torch.equal(tensors["batch.0"], x[4 * event.batch_idx : 4 * event.batch_idx + 4])
        with torch.random.fork_rng(devices=[]), torch.no_grad():  # leaves the generator be
            torch.set_rng_state(tensors["rng.cpu"])
            again = model.body[:2](tensors["batch.0"])
        step = model.dropped[event.batch_idx]
        assert torch.equal(again == 0, step == 0)  # the same mask, exactly
        torch.testing.assert_close(again, step, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("localize", ["replay", "always", False])
def test_without_evidence_only_a_replay_copies_the_random_state(
    localize: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    captures = _count_captures(monkeypatch)
    monitor = HealthMonitor("skip", localize=localize, evidence_max_bytes=0, rules=())
    fit(Net("mlp"), [monitor], steps=3)
    assert len(captures) == (3 if localize == "replay" else 0)


def _count_captures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch indices ``capture_rng`` is called with, from now on."""
    calls: list[int] = []
    capture = health_module.capture_rng

    def counted(pl_module: Any, batch: Any, batch_idx: int) -> Any:
        calls.append(batch_idx)
        return capture(pl_module, batch, batch_idx)

    monkeypatch.setattr(health_module, "capture_rng", counted)
    return calls


class FailsOnReplay(Net):
    """A non-finite loss on step 1, and a training step that raises when that step runs again."""

    def __init__(self) -> None:
        super().__init__("mlp")
        self.calls_at_step_1 = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 1:
            self.calls_at_step_1 += 1
            if self.calls_at_step_1 > 1:
                raise RuntimeError("the data iterator is exhausted")
            return super().training_step(batch, batch_idx) * math.nan
        return super().training_step(batch, batch_idx)


def test_a_replay_that_fails_says_so_and_why() -> None:
    """The message of a step whose replay raised names the error, instead of saying that the
    replay did not reproduce the values (which reads as a non-deterministic NaN)."""
    monitor = HealthMonitor("skip", evidence_max_bytes=0, rules=())
    model = FailsOnReplay()
    fit(model, [monitor], steps=3)
    (event,) = monitor.events
    assert (event.step, event.module, event.reproduced, event.action) == (1, None, False, "skipped")
    assert event.details["replay_error"] == "RuntimeError: the data iterator is exhausted"
    assert "did not reproduce" not in event.message
    assert (
        "the replay that looks for the module failed (RuntimeError: the data iterator is "
        "exhausted)" in event.message
    )
    assert model.global_step == 3  # training went on


def test_gradient_accumulation_finds_the_micro_batch(tmp_path: Path) -> None:
    monitor = HealthMonitor("skip", evidence_max_bytes=0)
    loader = data("trapped", 24, marked=(2,))  # batches 2 and 3 make optimizer step 1
    fit(Net("trapped"), [monitor], steps=3, loader=loader, accumulate_grad_batches=2)
    [event] = monitor.events
    assert (event.step, event.batch_idx, event.module, event.direction) == (
        1,
        2,
        "body.0",
        "forward",
    )


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_without_localisation_the_event_is_about_the_micro_batch_whose_loss_was_bad(
    policy: Any, tmp_path: Path
) -> None:
    """Read at once ("skip") or lazily ("warn"): the event and its bundle are about micro-batch
    2, whose loss was NaN, not about the step's last micro-batch."""
    monitor = HealthMonitor(policy, localize=False, evidence_dir=tmp_path)
    loader = data("trapped", 24, marked=(2,))  # batches 2 and 3 make optimizer step 1
    fit(Net("trapped"), [monitor], steps=2, loader=loader, accumulate_grad_batches=2)
    event = monitor.events[0]
    assert (event.step, event.batch_idx) == (1, 2)
    assert event.evidence is not None
    batch = load_file(Path(event.evidence) / "tensors.safetensors")["batch.0"]
    assert torch.equal(batch, loader.dataset.tensors[0][8:12])  # type: ignore[attr-defined]


class _BadWeightGradient(pl.Callback):
    """At optimizer step ``step`` the gradient of ``name`` is NaN (a hook on the parameter):
    non-finite in that parameter only, passed on to no other gradient."""

    def __init__(self, name: str, step: int) -> None:
        self.name, self.step, self.handle = name, step, None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            weight = dict(pl_module.named_parameters())[self.name]
            self.handle = weight.register_hook(lambda grad: grad * math.nan)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


@pytest.mark.parametrize(
    ("cause", "module", "key", "bad"),
    [
        (Injector({1: Fault("body.6", "backward", "posinf", 1)}), "body.6", "grad.input.input", 1),
        (_BadWeightGradient("body.5.weight", 1), "body.5", "grad.weight", 256),
    ],
    ids=["an input's gradient", "a weight's gradient"],
)
def test_the_evidence_of_a_backward_fault_holds_the_bad_gradient(
    cause: pl.Callback, module: str, key: str, bad: int, tmp_path: Path
) -> None:
    model = Net("mlp")
    monitor = HealthMonitor("skip", evidence_dir=tmp_path, rules=())
    fit(model, [cause, monitor], steps=3)
    (event,) = monitor.events
    assert (event.step, event.module, event.direction) == (1, module, "backward")
    tensors = load_file(Path(event.evidence) / "tensors.safetensors")
    grads = {k: v for k, v in tensors.items() if ".grad." in k}
    assert list(grads) == [f"{module}.{key}"]  # the non-finite gradient only
    assert int((~grads[f"{module}.{key}"].isfinite()).sum()) == bad
    assert f"{module}.input.input" in tensors  # beside the call's inputs and outputs


@pytest.mark.parametrize("stats_first", [True, False])
def test_what_a_skipped_step_logs_for_the_parameters_follows_the_callbacks_order(
    stats_first: bool, tmp_path: Path
) -> None:
    # as the docs say ("With a FeatureStatsMonitor"): the callback first in the list reads
    # the gradients first
    stats = FeatureStatsMonitor([nn.Linear], every_n_steps=1, histograms=False)
    monitor = HealthMonitor("skip", evidence_max_bytes=0, rules=())
    model = Net("mlp")
    callbacks = [stats, monitor] if stats_first else [monitor, stats]
    injector = Injector({1: Fault("body.6", "backward", "nan", 1)})
    fit(model, [injector, *callbacks], steps=3, logger=TensorBoardLogger(tmp_path, name=""))
    (event,) = monitor.events
    assert (event.step, event.action) == (1, "skipped")
    accumulator = EventAccumulator(str(tmp_path / "version_0")).Reload()
    tags = accumulator.Tags()["scalars"]
    logged = {
        tag.rsplit("/", 1)[-1]: {e.step: e.value for e in accumulator.Scalars(tag)}
        for tag in tags
        if "body.0.weight" in tag
    }
    assert sorted(logged["norm"]) == [0, 1, 2]
    assert sorted(logged["grad_norm"]) == ([0, 1, 2] if stats_first else [0, 2])
    assert sorted(logged["update_ratio"]) == ([0, 1, 2] if stats_first else [0, 2])
    if stats_first:
        assert math.isnan(logged["grad_norm"][1]) and logged["update_ratio"][1] == 0.0
    assert logged["update_ratio"][2] > 0


# ---------------------------------------------------------------------------- other modes
def test_lazy_check_without_localisation() -> None:
    model = Net("mlp")
    monitor = HealthMonitor("warn", localize=False, evidence_max_bytes=0)
    fit(model, [Injector({1: Fault("body.6", "backward", "posinf", 1)}), monitor], steps=2)
    [event] = monitor.events
    assert (event.step, event.module, event.direction, event.reproduced) == (1, None, None, None)
    assert event.parameters and all(p.startswith("body.") for p in event.parameters)
    assert "were non-finite" in event.message and model.logged == [0, 1]  # no replay


class _AssertsFinite(Net):
    """Raises at a non-finite loss, as a training loop that asserts finiteness does."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the loss of batch {batch_idx} is {loss.item()}")
        return loss


@pytest.mark.parametrize("localize", ["always", False])
def test_a_check_not_read_yet_when_the_fit_crashes_is_reported(
    localize: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # before the fix: on a GPU, "warn" without replays reads a step's check at a later batch
    # start, once its copy has arrived; a fit that raised before then (here: step 1's NaN
    # gradients made the weights NaN, and step 2's loss asserts finiteness) dropped it unread.
    # The copy that has not arrived yet: the check is read only when something waits for it.
    monkeypatch.setattr(Reading, "ready", lambda self: False)
    monitor = HealthMonitor("warn", localize=localize, rules=(), evidence_dir=tmp_path)
    injector = Injector({1: Fault("body.2", "backward", "nan", 1)})
    logged = caplog.at_level(logging.WARNING, logger="lightning_recorder.health")
    with logged, pytest.raises(FloatingPointError, match="the loss of batch 2 is nan"):
        fit(_AssertsFinite("mlp"), [injector, monitor], steps=4)  # the run's own exception
    [event] = monitor.events
    assert (event.step, event.batch_idx, event.action) == (1, 1, "warned")
    if localize == "always":
        assert (event.module, event.direction) == ("body.2", "backward")
    else:
        assert event.module is None and event.parameters
    assert [r.getMessage() for r in caplog.records] == [event.message]  # the warning
    assert event.evidence == str(tmp_path / "step00000001-rank0")
    assert "batch.0" in load_file(Path(event.evidence) / "tensors.safetensors")
    assert monitor.counters["nonfinite_steps"] == 1


def test_a_check_that_cannot_be_reported_after_a_crash_leaves_the_run_s_exception(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Reading, "ready", lambda self: False)

    def broken(*args: Any) -> None:
        raise OSError("the disk is gone")

    monkeypatch.setattr(HealthMonitor, "_lazy", broken)
    monitor = HealthMonitor("warn", localize=False, rules=(), evidence_max_bytes=0)
    injector = Injector({1: Fault("body.2", "backward", "nan", 1)})
    with (
        pytest.warns(UserWarning, match="could not report the check of step 1, not read yet"),
        pytest.raises(FloatingPointError, match="the loss of batch 2 is nan"),
    ):
        fit(_AssertsFinite("mlp"), [injector, monitor], steps=4)
    assert monitor.events == [] and monitor._pending == []


class TwoLinear(pl.LightningModule):
    """Two Linear layers; the batch of ``bad`` holds NaN, so that the loss and every gradient
    are NaN throughout: 1 + 8*16 + 8 + 4*8 + 4 = 173 values."""

    def __init__(self, bad: int = 1) -> None:
        super().__init__()
        self.l1, self.l2, self.bad = nn.Linear(16, 8), nn.Linear(8, 4), bad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x * math.nan if batch_idx == self.bad else x
        return F.cross_entropy(self.l2(self.l1(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def classes(n: int = 24) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


class _TwoBackwards(TwoLinear):
    """Manual optimization: two losses back-propagated, then one step, per batch."""

    def __init__(self) -> None:
        super().__init__(bad=1)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(super().training_step(batch, batch_idx))
        self.manual_backward(self.l1(batch[0]).square().mean())
        optimizer.step()  # type: ignore[union-attr]


def test_without_localisation_a_manual_step_is_about_the_batch_of_its_bad_loss() -> None:
    monitor = HealthMonitor("skip", localize=False, rules=(), evidence_max_bytes=0)
    fit(_TwoBackwards(), [monitor], steps=3, loader=classes())
    [event] = monitor.events
    assert (event.step, event.batch_idx) == (1, 1)


@pytest.mark.parametrize("policy", ["warn", "skip"])  # read lazily / before the optimizer step
def test_the_check_counts_values_not_tensors_however_it_is_read(policy: str) -> None:
    monitor = HealthMonitor(policy, localize=False, rules=(), evidence_max_bytes=0)
    fit(TwoLinear(), [monitor], steps=2, loader=classes())
    event = monitor.events[0]
    assert event.counts == {"nan": 173, "posinf": 0, "neginf": 0}
    assert ": 173 NaN, 0 +inf, 0 -inf;" in event.message
    assert event.parameters == ("l1.weight", "l1.bias", "l2.weight", "l2.bias")


class ManualLinear(pl.LightningModule):
    """One Linear layer under manual optimization; the batch of step 1 holds NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.linear = nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        x = x * math.nan if batch_idx == 1 else x
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(F.cross_entropy(self.linear(x), y))
        opt.step()  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_optimization_read_lazily_counts_values() -> None:
    with pytest.warns(UserWarning, match="cannot replay steps: manual optimization"):
        monitor = HealthMonitor("warn", rules=(), evidence_max_bytes=0)  # no replay: lazily
        fit(ManualLinear(), [monitor], steps=2, loader=classes())
    event = monitor.events[0]  # the loss and the 4x16 + 4 gradient values
    assert event.counts == {"nan": 69, "posinf": 0, "neginf": 0} and "69 NaN" in event.message


def test_a_lazy_read_counts_the_gradients_as_checked_and_bounds_those_gone() -> None:
    a, b, c = (nn.Parameter(torch.zeros(n)) for n in (3, 4, 5))
    a.grad = torch.tensor([math.nan, math.nan, 1.0])
    b.grad = torch.tensor([math.inf, -math.inf, math.inf, 0.0])
    c.grad = torch.tensor([math.nan, 0.0, 0.0, 0.0, 0.0])
    sentinel = Sentinel()
    sentinel.add_loss(torch.tensor(math.nan))
    reading = sentinel.read([("a", a), ("b", b), ("c", c)], torch.device("cpu")).later()
    assert reading.host_bad()
    b.grad.mul_(0.5)  # changed in place since the check (gradient clipping)
    c.grad = None  # freed (zero_grad)
    (total, loss, grads), missed = reading.counts()
    assert missed == ["b", "c"]  # each counted from its norm: one +inf, one NaN
    assert total == {"nan": 1 + 2 + 1, "posinf": 1, "neginf": 0}
    assert loss == {"nan": 1, "posinf": 0, "neginf": 0}
    assert grads == [
        ("a", {"nan": 2, "posinf": 0, "neginf": 0}),
        ("b", {"nan": 0, "posinf": 1, "neginf": 0}),
        ("c", {"nan": 1, "posinf": 0, "neginf": 0}),
    ]
    event = HealthEvent("nonfinite", 3, 3, counts=total, details={"counted_at_least": missed})
    assert ": at least 4 NaN, 1 +inf, 0 -inf;" in describe(event)


def test_always_localises_every_step_without_replay() -> None:
    model = Net("cnn")
    monitor = HealthMonitor("skip", localize="always", evidence_max_bytes=0)
    fit(model, [Injector({1: Fault("body.4", "forward", "neginf", 1, index=3)}), monitor], steps=3)
    [event] = monitor.events
    assert (event.module, event.direction, event.reproduced) == ("body.4", "forward", None)
    assert model.logged == [0, 1, 2]


class Manual(Net):
    def __init__(self) -> None:
        super().__init__("mlp")
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]


def test_manual_optimization_cannot_replay_but_always_localises() -> None:
    with pytest.warns(UserWarning, match="cannot replay steps: manual optimization"):
        monitor = HealthMonitor("skip", evidence_max_bytes=0)
        shots = Snapshots()
        fit(Manual(), [Injector({1: Fault("body.2", "forward", "nan", 1)}), monitor, shots], 3)
    [event] = monitor.events
    assert event.module is None and event.action == "skipped"
    assert same(shots.states[0]["params"], shots.states[1]["params"])  # opt.step() did nothing
    monitor = HealthMonitor("warn", localize="always", evidence_max_bytes=0)
    fit(Manual(), [Injector({1: Fault("body.2", "forward", "nan", 1)}), monitor], steps=2)
    assert [(e.module, e.direction) for e in monitor.events] == [("body.2", "forward")]


class Poison(pl.Callback):
    """Sets one entry of ``l2.weight`` to NaN before batch 1, as a bad checkpoint or an
    in-place edit outside the optimizer would."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == 1:
            with torch.no_grad():
                pl_module.l2.weight[0, 0] = math.nan


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize(
    ("policy", "localize"), [("skip", "replay"), ("skip", "always"), ("warn", "always")]
)
def test_a_parameter_that_was_non_finite_before_the_step_is_named(
    policy: str, localize: Any, frozen: bool, tmp_path: Path
) -> None:
    # before the fix: "warn" with localize="always" (the check read lazily) reported l2 as
    # making NaN from finite inputs in its forward, and sent the user to l2's forward code
    model = TwoLinear(bad=-1)
    if frozen:  # l2 in no optimizer: the NaN reaches l1's gradients through it
        model.l2.requires_grad_(False)
        model.configure_optimizers = lambda: torch.optim.SGD(model.l1.parameters(), lr=0.1)  # type: ignore[method-assign]
    monitor = HealthMonitor(policy, localize=localize, rules=(), evidence_dir=tmp_path)
    fit(model, [Poison(), monitor], steps=2, loader=classes())
    [event] = monitor.events
    where = (event.step, event.module, event.direction, event.path)
    assert where == (1, "l2", "parameter", "weight")
    assert event.counts == {"nan": 1, "posinf": 0, "neginf": 0} and event.producer is None
    assert event.message.startswith("The parameter `l2.weight` was already non-finite")
    hint = NEXT_STEPS["parameter"]
    if policy == "skip":  # skipping leaves the weight as it is
        hint = hint.replace("made it: lower", "made it: " + RESTORE + " lower")
    assert hint in event.message
    tensors = load_file(Path(event.evidence) / "tensors.safetensors")
    assert tensors["l2.weight"].isnan().sum() == 1


def test_a_check_read_after_the_update_tells_weights_as_the_step_found_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU the "warn" check of localize="always" is read after the optimizer step, which
    made the weights under a NaN gradient NaN: the verdict goes by the weights as each module's
    call found them, not as they are when the check is read."""
    monkeypatch.setattr(Reading, "ready", lambda self: False)  # read at the end of training
    monitor = HealthMonitor("warn", localize="always", rules=(), evidence_max_bytes=0)
    fit(Net("mlp"), [Injector({1: Fault("body.2", "forward", "nan", 1)}), monitor], steps=3)
    found = [(e.step, e.module, e.direction, e.path, e.producer) for e in monitor.events]
    assert found == [
        (1, "body.2", "forward", "output", True),  # its weights were finite then
        (2, "body.0", "parameter", "weight", None),  # step 1's update made them NaN
    ]


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers stepped in each batch, GAN-style; the second
    step of the batches ``bad`` (batch 1) is non-finite."""

    def __init__(self, bad: Collection[int] = (1,)) -> None:
        super().__init__()
        self.bad = bad
        self.automatic_optimization = False
        self.first, self.second = nn.Linear(16, 4), nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        layers = (self.first, self.second)
        for k, (layer, opt) in enumerate(zip(layers, self.optimizers(), strict=True)):
            bad = k == 1 and batch_idx in self.bad
            opt.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(F.cross_entropy(layer(x * math.nan if bad else x), y))
            opt.step()  # type: ignore[union-attr]

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(layer.parameters(), lr=0.1) for layer in (self.first, self.second)]


@pytest.mark.parametrize("localize", ["always", False])
def test_a_later_optimizer_step_of_a_manual_batch_names_that_batch(
    localize: Any, tmp_path: Path
) -> None:
    monitor = HealthMonitor("skip", localize=localize, rules=(), evidence_dir=tmp_path)
    fit(TwoOptimizers(), [monitor], steps=6, loader=classes())
    [event] = monitor.events
    assert (event.step, event.batch_idx) == (3, 1)  # two optimizer steps per batch
    assert "at step 3, batch 1, rank 0" in event.message
    tensors = load_file(Path(event.evidence) / "tensors.safetensors")
    assert torch.equal(tensors["batch.0"], classes().dataset[8:16][0])  # the batch of index 1


def test_a_run_of_skipped_steps_is_counted_per_optimizer() -> None:
    """The second optimizer's step is non-finite in every batch, the first's never: its run of
    skipped steps is not ended by the clean steps of the other, and reaches the limit."""
    monitor = HealthMonitor("skip", max_consecutive_skips=2, rules=(), evidence_max_bytes=0)
    with pytest.raises(NonFiniteError, match=r"2 non-finite steps in a row were skipped"):
        fit(TwoOptimizers(bad=range(3)), [monitor], steps=12, loader=classes())
    assert [(e.step, e.action) for e in monitor.events] == [
        (1, "skipped"),
        (3, "skipped"),
        (5, "raised"),
    ]
    assert monitor.state_dict()["streaks"] == {0: 0, 1: 3}
    restored = HealthMonitor("skip")
    restored.load_state_dict({"counters": {}, "streak": 2})  # a checkpoint of one optimizer
    assert restored.state_dict()["streaks"] == {0: 2}


class Closures(pl.LightningModule):
    """Fitted with LBFGS, which calls its closure (``training_step`` and a backward) up to three
    times in one optimizer step: the calls ``bad`` names, ``(batch_idx, call)``, see a NaN batch."""

    def __init__(self, bad: Collection[tuple[int, int]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.bad, self.calls = set(bad), [0] * 8

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, call = batch[0], self.calls[batch_idx]
        self.calls[batch_idx] += 1
        if (batch_idx, call) in self.bad:
            x = x * math.nan
        return (self.lin(x).squeeze(-1) - x.sum(1)).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=3)


def lbfgs_data() -> DataLoader:
    return DataLoader(
        TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(0))), batch_size=8
    )


@pytest.mark.parametrize("localize", [False, "replay", "always"])
def test_a_closure_called_several_times_in_a_step_is_one_step(localize: Any) -> None:
    """LBFGS calls its closure three times a step, and Lightning checks after each backward:
    the step whose second call turned non-finite (and the later steps, its weights now NaN) is
    one event about its own batch, counted once, not one event per call."""
    monitor = HealthMonitor(localize=localize, rules=(), evidence_max_bytes=0)
    model = Closures(bad=[(1, 1)])
    fit(model, [monitor], loader=lbfgs_data())
    assert model.calls[0] >= 2  # the closure was called again within a step
    assert [(e.step, e.batch_idx, e.action) for e in monitor.events] == [
        (1, 1, "warned"),
        (2, 2, "warned"),
        (3, 3, "warned"),
    ]
    assert monitor.counters["nonfinite_steps"] == 3


def test_a_step_made_non_finite_by_a_later_closure_call_continues_the_run() -> None:
    """Step 1 is skipped; step 2's first call is clean and its second non-finite: two
    non-finite steps in a row, which reaches `max_consecutive_skips=1`."""
    monitor = HealthMonitor(
        "skip", localize=False, max_consecutive_skips=1, rules=(), evidence_max_bytes=0
    )
    with pytest.raises(NonFiniteError, match=r"1 non-finite steps in a row were skipped"):
        fit(Closures(bad=[(1, 0), (2, 1)]), [monitor], loader=lbfgs_data())
    assert [(e.step, e.action) for e in monitor.events] == [(1, "skipped"), (2, "raised")]
    assert monitor.state_dict()["streaks"] == {0: 2}


# ---------------------------------------------------------------------------- reporting
def test_loggers_get_a_text_entry_and_the_counters(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    monitor = HealthMonitor("skip")
    faults = {1: Fault("body.1", "forward", "nan", 1), 3: Fault("body.3", "backward", "neginf", 3)}
    fit(Net("mlp"), [Injector(faults), monitor], steps=4, logger=logger)
    acc = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"tensors": 0})
    acc.Reload()
    nonfinite = {e.step: e.value for e in acc.Scalars("health/nonfinite_steps")}
    assert nonfinite == {1: 1.0, 3: 2.0}
    # each skipped step is counted in its own report (it was logged one step late)
    assert {e.step: e.value for e in acc.Scalars("health/skipped_steps")} == {1: 1.0, 3: 2.0}
    assert {e.step: e.value for e in acc.Scalars("health/nan")} == {1: 1.0, 3: 0.0}
    assert {e.step: e.value for e in acc.Scalars("health/neginf")}[3] == 1.0
    texts = acc.Tensors("health/events/text_summary")
    assert [t.step for t in texts] == [1, 3]
    assert texts[0].tensor_proto.string_val[0].decode() == monitor.events[0].message
    # the evidence went under the logger's directory by default
    assert Path(monitor.events[0].evidence).parent == tmp_path / "run" / "version_0" / "health"


def test_alert_is_rate_limited_and_may_fail_without_stopping_training() -> None:
    alerts: list[HealthEvent] = []
    faults = {s: Fault("body.0", "forward", "nan", s) for s in (0, 2)}
    monitor = HealthMonitor("skip", alert=alerts.append, evidence_max_bytes=0)
    fit(Net("mlp"), [Injector(faults), monitor], steps=3)
    assert alerts == [monitor.events[0]]  # the second came within alert_interval_s

    def broken(event: HealthEvent) -> None:
        raise ConnectionError("no network")

    monitor = HealthMonitor("skip", alert=broken, evidence_max_bytes=0, alert_interval_s=1e-9)
    with pytest.warns(UserWarning, match="`alert` raised ConnectionError: no network"):
        fit(Net("mlp"), [Injector(faults), monitor], steps=3)
    assert len(monitor.events) == 2


# ---------------------------------------------------------------------------- evidence
def test_evidence_stays_within_its_budget(tmp_path: Path) -> None:
    # event.json (about 17 kB here) fits; the tensors do not all fit beside it
    monitor = HealthMonitor("skip", evidence_dir=tmp_path, evidence_max_bytes=20_000)
    faults = {s: Fault("body.0", "forward", "nan", s) for s in (0, 1)}
    fit(Net("resnet"), [Injector(faults), monitor], steps=2)
    first, second = monitor.events
    meta = json.loads((Path(first.evidence) / "event.json").read_text())
    assert meta["omitted"] and all(
        v["why"] == "over the evidence budget" for v in meta["omitted"].values()
    )
    assert second.evidence is None and "no evidence written" in second.message
    total = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert total <= 20_000


def test_a_budget_under_a_mebibyte_holds_bundles_that_fit(tmp_path: Path) -> None:
    monitor = HealthMonitor("skip", evidence_dir=tmp_path, evidence_max_bytes=100_000)
    faults = {s: Fault("body.0", "forward", "nan", s) for s in (0, 1)}
    fit(Net("resnet"), [Injector(faults), monitor], steps=2)
    assert len(monitor.events) == 2
    for event in monitor.events:  # two bundles of about 37 kB each, whole
        assert event.evidence is not None
        meta = json.loads((Path(event.evidence) / "event.json").read_text())
        assert meta["omitted"] == {} and "batch.0" in load_file(
            Path(event.evidence) / "tensors.safetensors"
        )
    total = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert total <= 100_000


class _Tabled(TwoLinear):
    """TwoLinear with a large buffer (a lookup table): 400 kB the parameters do not count."""

    def __init__(self) -> None:
        super().__init__(bad=1)
        self.register_buffer("table", torch.zeros(100_000))


def test_a_checkpoint_counts_the_buffers_against_the_evidence_budget(tmp_path: Path) -> None:
    monitor = HealthMonitor(
        "skip",
        rules=(),
        evidence_dir=tmp_path,
        evidence_max_bytes=100_000,
        evidence_checkpoint=True,
    )
    fit(_Tabled(), [monitor], steps=2, loader=classes())
    assert monitor.events and monitor.events[0].evidence is not None  # the bundle fits
    assert list(tmp_path.glob("*.ckpt")) == []  # the checkpoint, with its table, does not
    total = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert total <= 100_000


def test_checkpoint_before_the_bad_update(tmp_path: Path) -> None:
    model = Net("mlp")
    shots = Snapshots()
    monitor = HealthMonitor("warn", evidence_dir=tmp_path, evidence_checkpoint=True)
    fit(model, [Injector({1: Fault("body.2", "forward", "nan", 1)}), monitor, shots], steps=2)
    ckpt = torch.load(tmp_path / "step00000001-before-update.ckpt", weights_only=False)
    state = ckpt["state_dict"]
    assert all(torch.equal(state[n], p) for n, p in shots.states[0]["params"].items())
    meta = json.loads((Path(monitor.events[0].evidence) / "event.json").read_text())
    assert meta["checkpoint"].endswith("step00000001-before-update.ckpt")


@pytest.mark.parametrize("localize", ["always", False])
def test_checkpoint_before_the_bad_update_without_replays(localize: Any, tmp_path: Path) -> None:
    """With "warn" and no replay the check is read at the next step, after the update: until
    the checkpoint is saved it is read before the update instead."""
    model = Net("mlp")
    shots = Snapshots()
    monitor = HealthMonitor("warn", localize, evidence_dir=tmp_path, evidence_checkpoint=True)
    faults = {s: Fault("body.2", "forward", "nan", s) for s in (1, 2)}
    fit(model, [Injector(faults), monitor, shots], steps=3)
    ckpt = torch.load(tmp_path / "step00000001-before-update.ckpt", weights_only=False)
    state = ckpt["state_dict"]
    assert all(torch.equal(state[n], p) for n, p in shots.states[0]["params"].items())
    assert [p.name for p in tmp_path.glob("*.ckpt")] == ["step00000001-before-update.ckpt"]
    assert monitor.events[0].step == 1


def test_a_second_run_into_the_same_directory_keeps_the_first_checkpoint(tmp_path: Path) -> None:
    paths, params = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)  # two models with different weights
        shots = Snapshots()
        monitor = HealthMonitor("skip", evidence_dir=tmp_path, evidence_checkpoint=True)
        faults = Injector({1: Fault("body.2", "forward", "nan", 1)})
        fit(Net("mlp"), [faults, monitor, shots], steps=2)
        meta = json.loads((Path(monitor.events[0].evidence) / "event.json").read_text())
        paths.append(meta["checkpoint"])
        params.append(shots.states[0]["params"])
    assert paths[0] != paths[1]
    assert Path(paths[1]).name.startswith("step00000001-before-update-")
    assert Path(paths[1]).suffix == ".ckpt"  # found as a checkpoint by its extension
    for path, before in zip(paths, params, strict=True):
        state = torch.load(path, weights_only=False)["state_dict"]
        assert all(torch.equal(state[n], p) for n, p in before.items())


def test_each_fit_of_one_monitor_has_its_own_evidence_budget_and_checkpoint(
    tmp_path: Path,
) -> None:
    def one_fit(monitor: HealthMonitor, folder: str) -> HealthEvent:
        monitor.evidence_dir = tmp_path / folder
        fit(Net("mlp"), [Injector({1: Fault("body.2", "forward", "nan", 1)}), monitor], steps=2)
        return monitor.events[-1]

    sizes = HealthMonitor("skip", evidence_checkpoint=True)
    one_fit(sizes, "sizes")
    spent = sum(f.stat().st_size for f in (tmp_path / "sizes").rglob("*") if f.is_file())
    # Room for the evidence of one fit (its files, less the checkpoint's metadata: two thirds of
    # them), besides the 1 MiB a bundle keeps for its event.json; not for that of two fits.
    budget = (1 << 20) + spent * 2 // 3
    monitor = HealthMonitor("skip", evidence_checkpoint=True, evidence_max_bytes=budget)
    for folder in ("first", "second"):
        event = one_fit(monitor, folder)
        assert event.evidence is not None and Path(event.evidence).parent == tmp_path / folder
        meta = json.loads((Path(event.evidence) / "event.json").read_text())
        assert meta["tensors"] and not meta["omitted"]
        assert meta["checkpoint"] == str(tmp_path / folder / "step00000001-before-update.ckpt")


# ---------------------------------------------------------------------------- AMP, rules, state
def test_steps_the_grad_scaler_skips_are_not_alarms() -> None:
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)  # fp16 gradients overflow at once
    monitor = HealthMonitor("raise", evidence_max_bytes=0)
    fit(Net("mlp"), [monitor], steps=3, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    assert monitor.events and all(e.kind == "amp_skipped" for e in monitor.events)
    assert monitor.counters["amp_skipped_steps"] == len(monitor.events)
    assert "AMP grad scaler skipped" in monitor.events[0].message


def test_steps_the_grad_scaler_skips_are_no_data_for_the_update_ratio_rule() -> None:
    """While the grad scaler calibrates it skips the optimizer steps: no weight moves, and
    UpdateRatioRule found every layer "below 1e-06: it barely learns" on steps on which no
    update was made. Such steps have no update ratio: the rule has nothing to judge."""
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)  # fp16 gradients overflow at once
    stats = FeatureStatsMonitor([nn.Linear], every_n_steps=1, histograms=False)
    seen: list[dict[str, Any]] = []
    stats.subscribe(lambda report: seen.append(dict(report.parameters)))
    monitor = HealthMonitor(rules=[UpdateRatioRule(patience=1)], view=False, evidence_max_bytes=0)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler)]
    fit(Net("mlp"), [stats, monitor], steps=3, plugins=plugins, log_every_n_steps=1)
    assert monitor.counters["amp_skipped_steps"] == 3
    assert [(e.kind, e.step) for e in monitor.events] == [("amp_skipped", s) for s in range(3)]
    assert len(seen) == 3
    for parameters in seen:  # the norms and gradient norms are there, no update ratio
        assert parameters and all(sorted(f) == ["grad_norm", "norm"] for f in parameters.values())


class EveryOther(HealthRule):
    name = "every_other"
    needs_statistics = False

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        if seen.step % 2:
            return []
        return [HealthEvent(self.name, seen.step, None, module="body.0")]


def test_rules_report_their_events() -> None:
    monitor = HealthMonitor(rules=[EveryOther()])
    fit(Net("mlp"), [monitor], steps=3, log_every_n_steps=1)
    assert [(e.kind, e.step) for e in monitor.events] == [("every_other", 0), ("every_other", 2)]
    assert monitor.events[0].message.startswith("Rule 'every_other' fired on `body.0` at step 0")


def test_state_dict_round_trip() -> None:
    monitor = HealthMonitor("skip", evidence_max_bytes=0)
    fit(Net("mlp"), [Injector({0: Fault("body.0", "forward", "nan", 0)}), monitor], steps=1)
    restored = HealthMonitor("skip")
    restored.load_state_dict(monitor.state_dict())
    assert restored.counters == monitor.counters and restored.counters["skipped_steps"] == 1
    assert monitor.state_key == "HealthMonitor{'on_nonfinite': 'skip', 'localize': 'replay'}"


def test_a_resumed_run_goes_on_with_the_rules_counts_and_findings(tmp_path: Path) -> None:
    """A run resumed from a checkpoint in the middle of a rule's patience fires where the run
    without a break does, and a finding in force at the checkpoint does not fire again."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_recorder import FeatureStatsMonitor, UpdateRatioRule

    def run(resume: str | None, monitor: HealthMonitor | None = None) -> HealthMonitor:
        torch.manual_seed(0)
        stats = FeatureStatsMonitor([nn.Linear], every_n_steps=1, histograms=False)
        if monitor is None:
            monitor = HealthMonitor(rules=[UpdateRatioRule(patience=3)], evidence_max_bytes=0)
        saving = ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)
        options = {**QUIET, "enable_checkpointing": True, "log_every_n_steps": 1}
        trainer = pl.Trainer(callbacks=[stats, monitor, saving], max_steps=6, **options)
        ckpt = None if resume is None else str(tmp_path / resume)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a checkpoint within the epoch: not resumable data
            trainer.fit(Net("mlp", lr=0.0), data("mlp", 24), ckpt_path=ckpt)
        return monitor

    layers = ["body.0", "body.2", "body.5", "body.7"]  # lr=0: no weight moves
    straight = run(None)
    assert [(e.step, e.module) for e in straight.events] == [(2, m) for m in layers]
    # two of the three logged steps of patience seen before the checkpoint: the third fires
    mid = run("epoch=0-step=2.ckpt")
    assert [(e.step, e.module) for e in mid.events] == [(2, m) for m in layers]
    assert mid.counters["rule_events"] == 4
    # fired before the checkpoint: still in force after it, quiet, counted once
    after = run("epoch=0-step=4.ckpt")
    assert after.events == [] and after.counters["rule_events"] == 4
    assert sorted((k[1], e.step) for k, e in after.findings.items()) == [(m, 2) for m in layers]
    assert all(
        e.details["side"] == "low" and e.details["ratio"] == 0.0 for e in after.findings.values()
    )
    # a state loaded for another stage (`validate` with a checkpoint) is not a later fit's
    fresh = HealthMonitor(rules=[UpdateRatioRule(patience=3)], evidence_max_bytes=0)
    fresh.load_state_dict(after.state_dict())
    fresh.teardown(pl.Trainer(**QUIET, logger=False), Net("mlp"), "validate")
    again = run(None, fresh)
    assert [(e.step, e.module) for e in again.events] == [(2, m) for m in layers]


def test_a_run_resumed_with_another_on_nonfinite_goes_on_with_the_checkpoints_state(
    tmp_path: Path,
) -> None:
    """``on_nonfinite`` and ``localize`` make the monitor's ``state_key``: a run resumed with
    others takes the checkpoint's monitor state, with a warning, as the same monitor would."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_recorder import FeatureStatsMonitor, UpdateRatioRule

    def run(resume: str | None, on_nonfinite: Any) -> HealthMonitor:
        torch.manual_seed(0)
        stats = FeatureStatsMonitor([nn.Linear], every_n_steps=1, histograms=False)
        rules = [UpdateRatioRule(patience=3)]
        monitor = HealthMonitor(on_nonfinite, rules=rules, evidence_max_bytes=0)
        saving = ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)
        options = {**QUIET, "enable_checkpointing": True, "log_every_n_steps": 1}
        trainer = pl.Trainer(callbacks=[stats, monitor, saving], max_steps=6, **options)
        ckpt = None if resume is None else str(tmp_path / resume)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.fit(Net("mlp", lr=0.0), data("mlp", 24), ckpt_path=ckpt)
        taken = [str(w.message) for w in seen if "takes the state of" in str(w.message)]
        assert len(taken) == (resume is not None)
        assert all("checkpoint's HealthMonitor{'on_nonfinite': '" in m for m in taken)
        return monitor

    layers = ["body.0", "body.2", "body.5", "body.7"]  # lr=0: no weight moves
    assert [(e.step, e.module) for e in run(None, "warn").events] == [(2, m) for m in layers]
    mid = run("epoch=0-step=2.ckpt", "skip")  # two of the three steps of patience restored
    assert [(e.step, e.module) for e in mid.events] == [(2, m) for m in layers]
    after = run("epoch=0-step=4.ckpt", "raise")  # fired before: in force, quiet, counted once
    assert after.events == [] and after.counters["rule_events"] == 4


def test_two_named_monitors_run_together_and_each_resumes_with_its_own_state(
    tmp_path: Path,
) -> None:
    """Two monitors with the same ``on_nonfinite`` and ``localize`` but other rules, told apart
    by ``name``: both run in one Trainer, and a resumed run gives each its own state."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_recorder import FeatureStatsMonitor, UpdateRatioRule

    def run(resume: str | None) -> tuple[HealthMonitor, HealthMonitor]:
        torch.manual_seed(0)
        stats = FeatureStatsMonitor([nn.Linear], every_n_steps=1, histograms=False)
        fast = HealthMonitor(rules=[UpdateRatioRule(patience=3)], evidence_max_bytes=0, name="a")
        slow = HealthMonitor(rules=[UpdateRatioRule(patience=5)], evidence_max_bytes=0, name="b")
        saving = ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)
        options = {**QUIET, "enable_checkpointing": True, "log_every_n_steps": 1}
        trainer = pl.Trainer(callbacks=[stats, fast, slow, saving], max_steps=6, **options)
        ckpt = None if resume is None else str(tmp_path / resume)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.fit(Net("mlp", lr=0.0), data("mlp", 24), ckpt_path=ckpt)
        assert not [w for w in seen if "takes the state of" in str(w.message)]
        return fast, slow

    layers = ["body.0", "body.2", "body.5", "body.7"]  # lr=0: no weight moves
    fast, slow = run(None)
    assert (fast.state_key, slow.state_key) == (
        "HealthMonitor{'name': 'a'}",
        "HealthMonitor{'name': 'b'}",
    )
    assert [(e.step, e.module) for e in fast.events] == [(2, m) for m in layers]
    assert [(e.step, e.module) for e in slow.events] == [(4, m) for m in layers]
    states = torch.load(tmp_path / "epoch=0-step=4.ckpt", weights_only=False)["callbacks"]
    assert states[fast.state_key]["counters"]["rule_events"] == 4
    assert states[slow.state_key]["counters"]["rule_events"] == 0
    # resumed after step 3: `a`'s findings are in force (quiet), `b` fires where it did
    fast, slow = run("epoch=0-step=4.ckpt")
    assert fast.events == [] and fast.counters["rule_events"] == 4
    assert [(e.step, e.module) for e in slow.events] == [(4, m) for m in layers]
    assert slow.counters["rule_events"] == 4


def test_a_monitor_reads_as_its_options() -> None:
    """Printed (a Trainer's callbacks in a notebook, a message naming it), a monitor says what
    it is, as the other callbacks do, not ``<... object at 0x...>``."""
    monitor = HealthMonitor(on_nonfinite="skip", rules=[DeadUnitsRule()], name="probe")
    assert repr(monitor) == (
        "HealthMonitor(on_nonfinite='skip', localize='replay', rules=[DeadUnitsRule], name='probe')"
    )
    assert repr(HealthMonitor(rules=[])) == (
        "HealthMonitor(on_nonfinite='warn', localize='replay', rules=[])"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"on_nonfinite": "ignore"}, r"`on_nonfinite` of HealthMonitor to be one of 'warn'"),
        ({"localize": True}, r"`localize` of HealthMonitor to be 'replay', 'always' or False"),
        ({"rules": [object()]}, r"every item of `rules` .* to be a HealthRule"),
        ({"rules": [EveryOther(), EveryOther()]}, r"unique names .* 'every_other' is taken"),
        ({"alert": "wandb"}, r"`alert` to be a function of a HealthEvent or None"),
        ({"max_consecutive_skips": -1}, r"`max_consecutive_skips` of HealthMonitor to be a non"),
        ({"evidence_max_bytes": 1.5}, r"`evidence_max_bytes` of HealthMonitor to be a non-neg"),
        ({"exclude": "*.mask"}, r"`exclude` of HealthMonitor to be a list of glob patterns"),
        ({"exclude": 5}, r"`exclude` of HealthMonitor to be a list of glob patterns .* got 5"),
        ({"heatmap_stats": 5}, r"`heatmap_stats` of HealthMonitor to be a list of names .* got 5"),
        ({"heatmap_stats": "std"}, r"`heatmap_stats` of HealthMonitor to be a list of names"),
        ({"heatmap_stats": ["stdd"]}, r"but got \['stdd'\]\. Closest names: 'std'\.$"),
        ({"heatmap_stats": ["std", "mean", "std"]}, r"each name of `heatmap_stats` .* 'std' more"),
        ({"heatmap_stats": []}, r"`heatmap_stats` .* at least one .* got \[\]: .* `view=False`"),
        ({"heatmap_stats": ()}, r"`heatmap_stats` .* at least one .* got \(\): .* `view=False`"),
        ({"evidence_dir": 3}, r"`evidence_dir` of HealthMonitor to be a path or None"),
        ({"alert_interval_s": -1.0}, r"`alert_interval_s` of HealthMonitor to be a finite non"),
        ({"evidence_checkpoint": "yes"}, r"`evidence_checkpoint` of HealthMonitor to be a bool"),
        ({"name": 3}, r"`name` of HealthMonitor to be a str but got 3"),
        ({"name": ""}, r"`name` of HealthMonitor to be a non-empty str or None but got ''"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        HealthMonitor(**kwargs)


def test_an_exclude_pattern_of_a_module_the_model_lacks_is_refused_before_training(
    tmp_path: Path,
) -> None:
    model = TwoLinear(bad=-1)
    monitor = HealthMonitor(exclude=["l3.input.input"], rules=())
    with pytest.raises(UnknownSourceError, match=r"'l3.input.input' names the module 'l3'"):
        fit(model, [monitor], steps=2, loader=classes(), default_root_dir=tmp_path)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not list(tmp_path.iterdir()) and model.global_step == 0
    for patterns in (["l2.input.input", "batch.0"], ["l*.output"], ["*mask*"], ["l1.output.x"]):
        fit(TwoLinear(bad=-1), [HealthMonitor(exclude=patterns, rules=())], 1, classes())


def test_an_exclude_pattern_of_a_module_named_like_the_batch_is_checked(tmp_path: Path) -> None:
    # "batch..." names the batch's tensors only as "batch" or "batch.<path>": a module pattern
    # that merely starts with the word is checked against the model like any other
    monitor = HealthMonitor(exclude=["batchnorm1.output"], rules=())
    with pytest.raises(UnknownSourceError, match=r"names the module 'batchnorm1'"):
        fit(TwoLinear(bad=-1), [monitor], steps=2, loader=classes(), default_root_dir=tmp_path)
    for patterns in (["batch"], ["batch*"], ["batch.1"], ["batch[01]"]):
        fit(TwoLinear(bad=-1), [HealthMonitor(exclude=patterns, rules=())], 1, classes())


def test_an_exclude_pattern_that_can_never_match_is_refused_when_made() -> None:
    # without a glob character, a pattern lacking '.input.<argument>', '.output' or 'batch'
    # names no tensor of any model: it was taken and left nothing out
    cases = [("attn_mask", "'*.input.attn_mask'"), ("l1.input", "'l1.input.*'"), ("enc.mask", "")]
    for pattern, like in cases:
        with pytest.raises(RecorderConfigError, match=rf"{pattern!r} can never match.*{like}"):
            HealthMonitor(exclude=["*.input.x", pattern])
    for ok in ("batch", "batch.x", "l1.output", "l1.output.x", "l1.input.x", "*mask", "l?"):
        HealthMonitor(exclude=[ok])


def test_max_consecutive_skips_without_skip_is_said_to_have_no_effect() -> None:
    # it counts skipped steps: with "warn" or "raise" it was taken and ignored without a word
    for policy in ("warn", "raise"):
        with pytest.warns(UserWarning, match=rf"no effect with on_nonfinite='{policy}'"):
            HealthMonitor(on_nonfinite=policy, max_consecutive_skips=2)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HealthMonitor(on_nonfinite="skip", max_consecutive_skips=2)
        HealthMonitor(on_nonfinite="warn")  # the default is no request


def test_messages_read_as_one_sentence() -> None:
    event = HealthEvent(
        "nonfinite", 7, 3, 1, "enc.attn", "backward", {"nan": 2, "posinf": 0, "neginf": 0},
        producer=True, path="input.query", dtype="torch.bfloat16", shape=(2, 5, 16),
        action="skipped", evidence="/runs/health/step00000007-rank1",
    )  # fmt: skip
    from lightning_recorder.callbacks._health_event import describe

    assert describe(event) == (
        "`enc.attn` made non-finite values in its backward, in the gradient of its input "
        "`query` (from a finite output gradient) at step 7, batch 3, rank 1: 2 NaN, 0 +inf, "
        "0 -inf in a bfloat16 tensor of shape [2, 5, 16]; the update was skipped; evidence in "
        "/runs/health/step00000007-rank1. The derivative of `enc.attn` is infinite where its "
        "forward is finite (a sqrt, pow or norm at 0, a log or division near 0): add an eps "
        "inside, e.g. `(x + 1e-12).sqrt()`. Read the bundle with `safetensors.torch.load_file("
        "'/runs/health/step00000007-rank1/tensors.safetensors')` and its `event.json`."
    )
    assert HealthEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event
    assert not math.isnan(event.total)


def _bad_batch() -> DataLoader:
    x, y = torch.randn(12, 12), torch.randint(0, 4, (12,))
    x[5, 1] = math.nan  # batch 1
    return DataLoader(TensorDataset(x, y), batch_size=4)


NEXT_STEPS = {
    "batch": "Check the data pipeline: find the samples of batch 1 whose `batch.0` is not finite.",
    "forward": "Look for a log, sqrt, division or exp of the inputs in the forward of `body.2` "
    "and clamp them or add an eps (`torch.log_softmax`, not the log of a softmax).",
    "bf16": "Run `body.2` in float32 (under `torch.autocast(..., enabled=False)`, its inputs "
    "`.float()`): bfloat16 rounds small values to 0 before a log or a division.",
    "backward": "The derivative of `body.2` is infinite where its forward is finite (a sqrt, "
    "pow or norm at 0, a log or division near 0): add an eps inside, e.g. `(x + 1e-12).sqrt()`.",
    "parameter": "The optimizer step before (or the checkpoint loaded) made it: lower the "
    "learning rate, clip gradients (`Trainer(gradient_clip_val=1.0)`) or raise Adam's `eps`.",
    "unlocalised": "No module is named here: with `localize='replay'` (the default) or "
    "`'always'`, the first step of a run of non-finite steps names the one that made them.",
}


RESTORE = "restore the weights from a checkpoint saved before this step, then"


class _AdamWithoutEps(pl.LightningModule):
    """Adam with ``eps=0`` on a batch whose first feature is always 0: the first update divides
    0 by 0 in ``l1.weight[:, 0]`` (finite gradients, NaN weights), so every later step is
    non-finite from a weight that is non-finite before it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.l2(self.l1(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01, eps=0.0)


def test_a_skip_notice_says_skipping_cannot_recover_a_weight_already_non_finite(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(24, 4), torch.randint(0, 3, (24,))
    x[:, 0] = 0.0  # no gradient for l1.weight[:, 0]
    monitor = HealthMonitor("skip", max_consecutive_skips=2, rules=(), evidence_max_bytes=0)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    logged = caplog.at_level(logging.WARNING, logger="lightning_recorder.health")
    with logged, pytest.raises(NonFiniteError):
        fit(_AdamWithoutEps(), [monitor], steps=6, loader=loader)
    found = [(e.step, e.action, e.module, e.direction, e.path) for e in monitor.events]
    assert found == [
        (1, "skipped", "l1", "parameter", "weight"),
        (2, "skipped", "l1", "parameter", "weight"),
        (3, "raised", "l1", "parameter", "weight"),
    ]
    cannot = (
        "; the update was skipped; skipping will not recover from this, as the weight itself is "
        "non-finite: every later step will be skipped until `max_consecutive_skips` raises; no "
        "evidence written. The optimizer step before (or the checkpoint loaded) made it: "
        f"{RESTORE} lower the learning rate, clip gradients (`Trainer(gradient_clip_val=1.0)`) "
        "or raise Adam's `eps`."
    )
    first, second, last = (e.message for e in monitor.events)
    assert first.endswith(cannot) and second.endswith(cannot)
    assert caplog.records[0].getMessage().endswith(cannot)  # the notice the user reads
    # the step that raises skips nothing: its message says what it did, no restore advice
    assert "skipping will not recover" not in last and RESTORE not in last
    # a step skipped for anything but a weight already non-finite says nothing of the kind
    monitor = HealthMonitor("skip", rules=(), evidence_max_bytes=0)
    fit(Net("mlp"), [Injector({1: Fault("body.2", "forward", "nan", 1)}), monitor], steps=2)
    assert "skipping will not recover" not in monitor.events[0].message


@pytest.mark.parametrize("found", list(NEXT_STEPS))
@pytest.mark.parametrize("policy", ["warn", "skip", "raise"])
def test_a_non_finite_message_says_what_to_do(
    found: str, policy: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The warning, the skip notice and the error of a non-finite step end with one next step
    that depends on what was found, then how to read the evidence bundle written."""
    localize: Any = False if found == "unlocalised" else "replay"
    monitor = HealthMonitor(policy, localize=localize, rules=(), evidence_dir=tmp_path)
    model: pl.LightningModule = Net("mlp")
    callbacks: list[pl.Callback] = [monitor]
    options: dict[str, Any] = {}
    if found in ("forward", "bf16", "unlocalised"):
        callbacks.insert(0, Injector({1: Fault("body.2", "forward", "nan", 1)}))
    elif found == "backward":
        callbacks.insert(0, Injector({1: Fault("body.2", "backward", "posinf", 1)}))
    elif found == "batch":
        options["loader"] = _bad_batch()
    else:
        model = TwoLinear(bad=-1)
        callbacks.insert(0, Poison())
        options["loader"] = classes()
    if found == "bf16":
        options["precision"] = "bf16-mixed"  # autocast runs the Linear layers in bfloat16
    with caplog.at_level(logging.WARNING, logger="lightning_recorder.health"):
        if policy == "raise":
            with pytest.raises(NonFiniteError) as info:
                fit(model, callbacks, steps=3, **options)
            told = str(info.value)
        else:
            fit(model, callbacks, steps=3, **options)
            told = caplog.records[0].getMessage()
    event = monitor.events[0]
    assert told.endswith(event.message) and event.step == 1
    tensors = str(tmp_path / "step00000001-rank0" / "tensors.safetensors")
    read = f"Read the bundle with `safetensors.torch.load_file({tensors!r})` and its `event.json`."
    hint = NEXT_STEPS[found]
    if (found, policy) == ("parameter", "skip"):  # skipping leaves the weight as it is
        hint = hint.replace("made it: lower", "made it: " + RESTORE + " lower")
    assert event.message.endswith(f". {hint} {read}")
    assert "batch.0" in load_file(tensors)  # the line the message gives loads the bundle


def test_next_to_feature_stats_monitor(tmp_path: Path) -> None:
    from lightning_recorder import FeatureStatsMonitor

    stats = FeatureStatsMonitor([torch.nn.Linear], every_n_steps=1, histograms=False)
    monitor = HealthMonitor("skip", evidence_max_bytes=0)
    logger = TensorBoardLogger(tmp_path, name="both", version=0)
    faults = {1: Fault("body.2", "forward", "nan", 1)}
    fit(Net("mlp"), [Injector(faults), stats, monitor], steps=3, logger=logger)
    assert [(e.step, e.module, e.action) for e in monitor.events] == [(1, "body.2", "skipped")]


def test_the_replay_is_not_counted_in_the_steps_statistics(tmp_path: Path) -> None:
    """The replay of a flagged step runs every module again; the monitor's statistics of that
    step count each module call once, as on the clean steps."""
    from helpers.models import scalars

    from lightning_recorder import FeatureStatsMonitor

    stats = FeatureStatsMonitor(
        [torch.nn.Linear], every_n_steps=1, histograms=False, stats=["numel", "mean"]
    )
    monitor = HealthMonitor("skip", evidence_max_bytes=0)
    logger = TensorBoardLogger(tmp_path, name="once", version=0)
    faults = {1: Fault("body.0", "forward", "nan", 1)}
    fit(Net("mlp"), [Injector(faults), stats, monitor], steps=3, logger=logger)
    assert [(e.step, e.module, e.action) for e in monitor.events] == [(1, "body.0", "skipped")]
    assert monitor.events[0].reproduced
    got = scalars(logger.log_dir)
    counts = {name: got[f"stats/train/{name}/numel"] for name in ("body.0", "body.2")}
    for name, by_step in counts.items():
        assert by_step.keys() == {0, 1, 2}, name
        assert len(set(by_step.values())) == 1, (name, by_step)  # one batch of 4 each step


class _Student(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_distillation_connectors_gradient_is_named_after_the_connector() -> None:
    """A parameter outside the model that the optimizer steps (a FeatureDistillation connector,
    built at the first batch) is named as the expression that reaches it, not by position."""
    torch.manual_seed(0)
    connector = nn.Linear(8, 6, bias=False)
    teacher = nn.Sequential(nn.Linear(4, 6))
    distill = FeatureDistillation(teacher, {"body": "0"}, connectors=connector)

    class PoisonConnector(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 1:
                assert connector.weight.grad is not None
                connector.weight.grad[0, 0] = math.nan

    monitor = HealthMonitor("skip", evidence_max_bytes=0, rules=())  # the connector stays finite
    loader = DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4)
    fit(_Student(), [distill, PoisonConnector(), monitor], steps=3, loader=loader)
    (event,) = monitor.events
    assert (event.step, event.action) == (1, "skipped")
    assert event.parameters == ("FeatureDistillation.connectors['body'].weight",)
    assert "The gradients of `FeatureDistillation.connectors['body'].weight` were" in event.message
