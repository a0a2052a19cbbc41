"""HealthMonitor on a CUDA device: faults traced to their module, the skipped update, the AMP grad
scaler's own skips, the lazily read check, and the host synchronisations of a clean step.

Skipped where no CUDA device is available (hardware, not a failure). Synchronisations are
counted with ``torch.cuda.set_sync_debug_mode("warn")`` from the first callback's
``on_train_batch_start`` to the last callback's ``on_train_batch_end`` (forward, backward,
optimizer step and every hook), against the same Trainer without the monitor: ``"warn"`` with
``localize=False`` must add none, the configurations that decide before the optimizer step
exactly one.
"""

from __future__ import annotations

import random
import statistics
import traceback
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.health_models import (
    MASK_PATTERNS,
    VALUES,
    Fault,
    Injector,
    Net,
    Truth,
    candidates,
    data,
)

from lightning_recorder import HealthMonitor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU: dict[str, Any] = {
    "accelerator": "gpu",
    "devices": 1,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


class SyncCounter(pl.Callback):
    """Synchronising CUDA calls per training step (first and last in the callback list)."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []
        self._stacks: list[str] | None = None
        self._catcher: Any = None

    def begin(self) -> None:
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        self._stacks = []
        torch.cuda.set_sync_debug_mode("warn")

    def _show(self, message: Any, *args: Any, **kwargs: Any) -> None:
        if self._stacks is not None and "synchroniz" in str(message):
            self._stacks.append("".join(traceback.format_stack()[-12:-2]))

    def end(self) -> None:
        if self._stacks is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._catcher.__exit__(None, None, None)
            self.steps.append(self._stacks)
            self._stacks = None


class _Begin(pl.Callback):
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, *args: Any) -> None:
        self.counter.begin()


class _End(pl.Callback):
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_train_batch_end(self, *args: Any) -> None:
        self.counter.end()

    def on_train_end(self, *args: Any) -> None:
        self.counter.end()


def syncs_per_step(monitor: HealthMonitor | None, steps: int = 8) -> tuple[float, list[str]]:
    counter = SyncCounter()
    callbacks: list[pl.Callback] = [_Begin(counter)]
    if monitor is not None:
        callbacks.append(monitor)
    callbacks.append(_End(counter))
    pl.seed_everything(0, verbose=False)
    pl.Trainer(max_steps=steps, callbacks=callbacks, **GPU).fit(
        Net("resnet"), data("resnet", 4 * steps)
    )
    counted = counter.steps[3:]  # after warm-up
    return statistics.median(len(s) for s in counted), counted[-1]


def test_clean_steps_synchronise_once_or_never() -> None:
    plain, _ = syncs_per_step(None)
    configs = {
        "warn, localize=False": (HealthMonitor(localize=False, evidence_max_bytes=0), 0),
        "warn, localize='always'": (HealthMonitor(localize="always", evidence_max_bytes=0), 0),
        "skip": (HealthMonitor("skip", evidence_max_bytes=0), 1),
        "raise": (HealthMonitor("raise", localize=False, evidence_max_bytes=0), 1),
        "warn, replay (default)": (HealthMonitor(evidence_max_bytes=0), 1),
    }
    for name, (monitor, expected) in configs.items():
        count, stacks = syncs_per_step(monitor)
        assert count - plain == expected, (name, count, plain, stacks)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("arch", ["cnn", "resnet", "transformer"])
def test_faults_are_traced_on_cuda(arch: str, precision: str) -> None:
    pl.seed_everything(0, verbose=False)
    model = Net(arch)
    rng = random.Random(f"cuda-{arch}-{precision}")
    faults = {}
    for step in range(16):
        direction = rng.choice(("forward", "backward"))
        module = rng.choice(candidates(model, direction))
        faults[step] = Fault(module, direction, rng.choice(list(VALUES)), step, rng.randrange(997))
    truth = Truth()
    monitor = HealthMonitor(
        "skip", max_consecutive_skips=16, exclude=MASK_PATTERNS, evidence_max_bytes=0
    )
    pl.Trainer(
        max_steps=16, precision=precision, callbacks=[Injector(faults), truth, monitor], **GPU
    ).fit(model, data(arch, 64))
    events = {e.step: e for e in monitor.events}
    assert sorted(events) == sorted(truth.bad)
    cases = [(faults[s], events[s]) for s in truth.bad]
    assert all(e.direction == f.direction for f, e in cases), cases
    assert sum(e.module == f.module for f, e in cases) >= 0.95 * len(cases), cases
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_leaves_adam_untouched_on_cuda() -> None:
    model = Net("mlp", optimizer="adam")
    states: list[dict[str, Any]] = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            opt = trainer.optimizers[0].state_dict()["state"]
            params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            states.append(
                {
                    "params": params,
                    "opt": {k: {n: v.clone() for n, v in s.items()} for k, s in opt.items()},
                }
            )

    monitor = HealthMonitor("skip", evidence_max_bytes=0)
    pl.Trainer(
        max_steps=4,
        callbacks=[Injector({2: Fault("body.2", "forward", "nan", 2)}), monitor, Keep()],
        **GPU,
    ).fit(model, data("mlp", 16))
    assert [e.action for e in monitor.events] == ["skipped"]
    before, skipped = states[1], states[2]
    assert all(torch.equal(before["params"][n], skipped["params"][n]) for n in before["params"])
    for key, state in before["opt"].items():
        assert all(torch.equal(v, skipped["opt"][key][n]) for n, v in state.items())


def test_lazy_warn_reports_a_step_later_without_waiting() -> None:
    monitor = HealthMonitor(localize=False, evidence_max_bytes=0)
    injector = Injector({2: Fault("body.4", "backward", "nan", 2)})
    pl.Trainer(max_steps=5, callbacks=[injector, monitor], **GPU).fit(Net("mlp"), data("mlp", 20))
    assert monitor.events and monitor.events[0].step == 2 and monitor.events[0].action == "warned"


def test_steps_the_grad_scaler_skips_are_not_alarms_on_cuda() -> None:
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**60)
    monitor = HealthMonitor("raise", evidence_max_bytes=0)
    pl.Trainer(
        max_steps=3,
        plugins=[MixedPrecision("16-mixed", "cuda", scaler)],
        callbacks=[monitor],
        **GPU,
    ).fit(Net("mlp"), data("mlp", 12))
    assert monitor.events and all(e.kind == "amp_skipped" for e in monitor.events)


class _StopAfter(pl.Callback):
    """Raise at the end of batch ``batch``: after the monitor copied its check, before the
    batch start that would have read it."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step > self.batch:
            raise RuntimeError("stopped after the bad step")


def test_a_check_not_read_when_the_fit_raises_is_reported_on_cuda() -> None:
    monitor = HealthMonitor(localize=False, evidence_max_bytes=0)
    injector = Injector({2: Fault("body.4", "backward", "nan", 2)})
    with pytest.raises(RuntimeError, match="stopped after the bad step"):
        pl.Trainer(max_steps=5, callbacks=[injector, monitor, _StopAfter(2)], **GPU).fit(
            Net("mlp"), data("mlp", 20)
        )
    assert [(e.step, e.action) for e in monitor.events] == [(2, "warned")]


def test_a_weight_non_finite_before_the_step_is_named_on_cuda() -> None:
    class Poison(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                with torch.no_grad():
                    pl_module.body[0].weight[0, 0] = float("nan")

    monitor = HealthMonitor(localize="always", evidence_max_bytes=0)
    pl.Trainer(max_steps=4, callbacks=[Poison(), monitor], **GPU).fit(Net("mlp"), data("mlp", 16))
    first = monitor.events[0]
    assert (first.step, first.module, first.direction) == (2, "body.0", "parameter")
