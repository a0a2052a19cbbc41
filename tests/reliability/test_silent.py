"""No silent emptiness: a recorded module that is replaced or stops being called is reported,
and pruned parameters are recorded as the weight the forward uses."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import QUIET, ProbeNet, features, loader
from torch import nn
from torch.nn.utils import prune

from lightning_recorder import (
    ParameterGradRecorder,
    ParameterRecorder,
    RecorderCallback,
    RecorderConfigError,
    RecorderManager,
    UnknownSourceError,
)
from lightning_recorder._core.hooks import live_hooks


def fit(callback: pl.Callback, model: ProbeNet, steps: int = 4) -> pl.Trainer:
    trainer = pl.Trainer(**QUIET, logger=False, max_steps=steps, callbacks=[callback])
    trainer.fit(model, loader(features(4 * steps)))
    return trainer


def silent_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "recorded nothing in training step" in str(w.message)]


def test_a_module_replaced_during_training_is_reported_once() -> None:
    model = ProbeNet()

    def replace(net: ProbeNet, batch_idx: int) -> None:
        if batch_idx == 1:  # after the forward of step 1: step 2 runs the new module
            net.body[0] = nn.Linear(4, 8)

    model.step_hook = replace
    callback = RecorderCallback({"feat": {"type": "ModuleOutputs", "source": "body.0"}})
    with pytest.warns(UserWarning, match=r"recorded nothing") as caught:
        fit(callback, model)
    messages = silent_warnings(caught.list)
    assert len(messages) == 1, messages  # steps 2 and 3 both miss it: reported once
    assert "'feat'" in messages[0] and "'body.0' was replaced" in messages[0]
    assert "training step 2" in messages[0]
    assert not live_hooks()


def test_a_module_that_stops_being_called_is_reported_once() -> None:
    class Skipping(ProbeNet):
        def __init__(self) -> None:
            super().__init__()
            self.shortcut = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.nan_to_num(self.probe(x), 0.0, 0.0, 0.0)
            if self.global_step >= 2:
                return self.shortcut(h)  # the body is no longer used
            return self.body(h)

    callback = RecorderCallback({"feat": {"type": "ModuleOutputs", "source": "body.*"}})
    with pytest.warns(UserWarning, match=r"recorded nothing") as caught:
        fit(callback, Skipping())
    messages = silent_warnings(caught.list)
    # body.0, body.1 and body.2 stop in the same step: one warning naming each of them
    assert len(messages) == 1, messages
    assert "the modules 'body.0', 'body.1', 'body.2' were recorded in earlier" in messages[0]
    assert "not called in this one" in messages[0] and "training step 2" in messages[0]


def test_modules_that_stop_being_called_are_reported_in_one_warning_a_step_each_once() -> None:
    """A mixture of experts routes each step to a few of its experts: the ones left out are
    reported in one warning per step (not one per expert), each expert once, the first five
    named and the others counted."""

    class Mixture(ProbeNet):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 2) for _ in range(24))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.nan_to_num(self.probe(x), 0.0, 0.0, 0.0)
            step = int(self.global_step)  # step 0 routes to all, then to a different half
            chosen = range(24) if step == 0 else range(step % 2, 24, 2)
            return sum((self.experts[k](h) for k in chosen), torch.zeros(()))

    callback = RecorderCallback({"moe": {"type": "ModuleOutputs", "source": "experts.*"}})
    with pytest.warns(UserWarning, match=r"recorded nothing") as caught:
        fit(callback, Mixture())
    messages = silent_warnings(caught.list)
    # step 1 leaves the 12 even experts out, step 2 the 12 odd ones (already reported: none)
    assert len(messages) == 2, messages
    assert "training step 1: the modules 'experts.0', 'experts.2', 'experts.4'," in messages[0]
    assert "'experts.8' and 7 more were recorded in earlier" in messages[0]
    assert "training step 2: the modules 'experts.1', 'experts.3'," in messages[1]
    assert "an expert of a mixture not routed to" in messages[1]


def test_a_module_never_called_in_training_is_not_reported() -> None:
    class WithSpare(ProbeNet):
        def __init__(self) -> None:
            super().__init__()
            self.spare = nn.Linear(4, 4)  # defined, never used

    callback = RecorderCallback({"spare": {"type": "ModuleOutputs", "source": "spare"}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(callback, WithSpare(), steps=2)
    assert silent_warnings(caught) == []


def test_empty_configurations_are_errors_but_an_unset_manager_is_not() -> None:
    with pytest.raises(RecorderConfigError, match=r"`recorders`.*non-empty"):
        RecorderManager({})
    with pytest.raises(RecorderConfigError, match=r"`recorders`.*non-empty"):
        RecorderManager([])
    manager = RecorderManager()  # recorders added later
    manager.add_recorder("feat", {"type": "ModuleOutputs", "source": "0"})
    assert list(manager.recorders) == ["feat"]
    with pytest.raises(RecorderConfigError, match=r"`stages`.*at least one"):
        RecorderCallback({"feat": {"type": "ModuleOutputs", "source": "body.0"}}, stages=[])


# ------------------------------------------------------------------------------------ pruning
def pruned_net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    prune.l1_unstructured(net[0], "weight", amount=0.5)
    return net


def test_parameter_recorder_records_the_effective_pruned_weight() -> None:
    net = pruned_net()
    recorder = ParameterRecorder("0.weight").initialize(net)
    try:
        with recorder:
            pass
        effective = net[0].weight_orig * net[0].weight_mask
        # The same product of the same tensors: exact.
        torch.testing.assert_close(recorder.get_record_data(), effective, rtol=0, atol=0)
        assert int((recorder.get_record_data() == 0).sum()) >= 12  # half of 24 pruned
        norm = torch.linalg.vector_norm(recorder.get_record_data())
        assert norm < torch.linalg.vector_norm(net[0].weight_orig)
    finally:
        recorder.release()


def test_parameter_recorder_names_orig_for_the_raw_weight_and_globs_see_both() -> None:
    net = pruned_net()
    raw = ParameterRecorder("0.weight_orig").initialize(net)
    group = ParameterRecorder("*.weight").initialize(net)
    try:
        assert raw.get_record_data() is net[0].weight_orig
        assert sorted(group.streams) == ["0.weight", "2.weight"]
    finally:
        raw.release()
        group.release()


def test_parameter_grad_recorder_records_the_masked_gradient_of_a_pruned_weight() -> None:
    net = pruned_net()
    recorder = ParameterGradRecorder("0.weight").initialize(net)
    x = torch.randn(5, 4)
    try:
        with recorder:
            net(x).square().sum().backward()
        grad = recorder.get_record_data()
        torch.testing.assert_close(grad, net[0].weight_orig.grad, rtol=0, atol=0)  # a copy of it
        assert bool((grad[net[0].weight_mask == 0] == 0).all())  # pruned entries get nothing
    finally:
        recorder.release()


def test_pruned_weight_name_unknown_without_pruning_suggests_orig() -> None:
    net = nn.Sequential(nn.Linear(4, 6))
    prune.identity(net[0], "weight")
    del net[0].weight_mask  # a broken pruning: orig without a mask is a plain parameter
    with pytest.raises(UnknownSourceError, match=r"'0.weight'.*'0.weight_orig'"):
        ParameterRecorder("0.weight").initialize(net)


def fit_pruned(config: dict[str, Any]) -> tuple[RecorderCallback, ProbeNet]:
    model = ProbeNet()
    prune.l1_unstructured(model.body[0], "weight", amount=0.5)
    seen: list[torch.Tensor] = []

    def grab(net: ProbeNet, batch_idx: int) -> None:
        seen.append(RecorderCallback.of(net).get_record_data("w").detach().clone())

    model.step_hook = grab
    callback = RecorderCallback({"w": config})
    fit(callback, model, steps=2)
    model.seen = seen  # type: ignore[attr-defined]
    return callback, model


def test_recorder_callback_records_the_effective_weight_of_a_pruned_module() -> None:
    _, model = fit_pruned({"type": "Parameter", "source": "body.0.weight", "clone": True})
    mask = model.body[0].weight_mask
    for record in model.seen:  # type: ignore[attr-defined]
        assert bool((record[mask == 0] == 0).all())
