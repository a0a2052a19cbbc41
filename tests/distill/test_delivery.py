"""Deliveries: record outputs in one pass, replay them in the next (MMRazor semantics)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from helpers import toy as toy_module

from lightning_recorder import FunctionOutputsRecorder
from lightning_recorder._core.patching import (
    CALL_ORIGINAL,
    Sink,
    acquire,
    active_patches,
    release,
    resolve,
)
from lightning_recorder.distill.delivery import (
    DistillDelivery,
    DistillDeliveryManager,
    FunctionOutputsDelivery,
    MethodOutputsDelivery,
    build_delivery,
)
from lightning_recorder.errors import (
    DuplicateNameError,
    InvalidSourceError,
    NoRecordError,
    RecorderConfigError,
    RecorderStateError,
)


def test_function_outputs_record_then_replay_in_order() -> None:
    delivery = FunctionOutputsDelivery("helpers.toy.toy_func", max_keep_data=3)
    with delivery:
        recorded = [toy_module.toy_func() for _ in range(3)]
    assert list(delivery.data_queue) == recorded
    assert active_patches() == []  # the context installed the patch and removed it
    delivery.override_data = True
    with delivery:
        replayed = [toy_module.toy_func() for _ in range(3)]
    assert replayed == recorded and len(delivery.data_queue) == 0
    # Outside the context the original runs, and nothing is queued.
    toy_module.toy_func()
    assert len(delivery.data_queue) == 0 and active_patches() == []


def test_full_and_empty_queues_are_errors() -> None:
    delivery = FunctionOutputsDelivery("helpers.toy.toy_func", max_keep_data=1)
    with delivery:
        toy_module.toy_func()
        with pytest.raises(RecorderStateError, match=r"full \(max_keep_data=1\).*more often"):
            toy_module.toy_func()
    delivery.override_data = True
    with delivery:
        toy_module.toy_func()
        with pytest.raises(NoRecordError, match=r"queue of FunctionOutputsDelivery.*is empty"):
            toy_module.toy_func()
    assert active_patches() == []  # restored although the context exited through an error


def test_replay_does_not_run_the_function_and_keeps_tensors() -> None:
    delivery = FunctionOutputsDelivery("helpers.toy.double", max_keep_data=2)
    x = torch.ones(2)
    with delivery:
        first = toy_module.double(x)
    delivery.override_data = True
    with delivery:
        # Any argument: the queued output comes back, the same object.
        assert toy_module.double(torch.zeros(5)) is first


@pytest.mark.parametrize(
    ("source", "call"),
    [
        ("helpers.toy.Toy.toy_func", lambda: toy_module.SubToy().toy_func()),
        (
            "helpers.toy.Toy.static",
            lambda: toy_module.Toy.static(int(torch.randint(0, 99, ()))),
        ),
        (
            "helpers.toy.Toy.klass",
            lambda: toy_module.Toy().klass(int(torch.randint(0, 99, ()))),
        ),
    ],
)
def test_method_outputs_on_any_instance(source: str, call: object) -> None:
    delivery = MethodOutputsDelivery(source, max_keep_data=2)
    assert callable(call)
    with delivery:
        recorded = [call(), call()]
    delivery.override_data = True
    with delivery:
        assert [call(), call()] == recorded


def test_initialize_keeps_an_inert_patch_until_release() -> None:
    delivery = FunctionOutputsDelivery("helpers.toy.toy_func").initialize()
    assert delivery.initialized and active_patches() == ["helpers.toy.toy_func"]
    toy_module.toy_func()  # outside the context: nothing queued
    assert len(delivery.data_queue) == 0
    with delivery:
        toy_module.toy_func()
    assert active_patches() == ["helpers.toy.toy_func"] and len(delivery.data_queue) == 1
    delivery.reset()
    assert len(delivery.data_queue) == 0
    delivery.release()
    delivery.release()  # idempotent
    assert active_patches() == [] and not delivery.initialized


def test_contexts_do_not_nest_and_options_are_checked() -> None:
    delivery = FunctionOutputsDelivery("helpers.toy.toy_func")
    with delivery, pytest.raises(RecorderStateError, match="already active: delivery contexts"):
        delivery.__enter__()
    with pytest.raises(RecorderConfigError, match="Expected `max_keep_data` to be a positive int"):
        FunctionOutputsDelivery("helpers.toy.toy_func", max_keep_data=0)
    with pytest.raises(RecorderConfigError, match=r"Expected `max_keep_data`.*but got True"):
        FunctionOutputsDelivery("helpers.toy.toy_func", max_keep_data=True)
    with pytest.raises(RecorderConfigError, match="Expected `override_data` to be a bool"):
        delivery.override_data = 1  # type: ignore[assignment]
    with pytest.raises(RecorderConfigError, match="Expected a concrete delivery"):
        DistillDelivery("helpers.toy.toy_func")
    with pytest.raises(InvalidSourceError, match=r"has no function 'toy_fun'.*'toy_func'"):
        FunctionOutputsDelivery("helpers.toy.toy_fun")
    with pytest.raises(InvalidSourceError, match="to name a method of a class"):
        MethodOutputsDelivery("helpers.toy.toy_func")


def test_shares_the_function_with_a_recorder_in_either_order() -> None:
    for release_recorder_first in (True, False):
        recorder = FunctionOutputsRecorder("helpers.toy.toy_func", persistent=True).initialize()
        delivery = FunctionOutputsDelivery("helpers.toy.toy_func").initialize()
        with delivery:
            value = toy_module.toy_func()
        delivery.override_data = True
        with recorder, delivery:
            assert toy_module.toy_func() == value
        assert recorder.data_buffer == [value]  # the recorder sees the replayed output
        first, second = (recorder, delivery) if release_recorder_first else (delivery, recorder)
        first.release()
        assert active_patches() == ["helpers.toy.toy_func"]
        second.release()
        assert active_patches() == []


def test_copies_are_fresh_and_uninstalled() -> None:
    delivery = FunctionOutputsDelivery("helpers.toy.toy_func", max_keep_data=4).initialize()
    delivery.override_data = True
    try:
        for clone in (copy.deepcopy(delivery), pickle.loads(pickle.dumps(delivery))):
            assert isinstance(clone, FunctionOutputsDelivery)
            assert clone.max_keep_data == 4 and clone.override_data and not clone.initialized
    finally:
        delivery.release()


# --------------------------------------------------------------------------- the patch
def test_sink_replace_wins_in_order_and_after_sinks_see_the_result() -> None:
    target = resolve("helpers.toy.add", "function")
    seen: list[object] = []
    passthrough = Sink(replace=lambda args, kwargs: CALL_ORIGINAL)
    first = Sink(before=lambda a, k: seen.append("before"), replace=lambda a, k: -1.0)
    second = Sink(replace=lambda a, k: -2.0, after=lambda a, k, r: seen.append(r))
    for sink in (passthrough, first, second):
        acquire(target, sink)
    try:
        assert toy_module.add(1.0, 2.0) == -1.0
        assert seen == ["before", -1.0]
        release(target, first)
        assert toy_module.add(1.0, 2.0) == -2.0
        release(target, second)
        assert toy_module.add(1.0, 2.0) == 3.0  # only a pass-through left: the original runs
    finally:
        for sink in (passthrough, first, second):
            release(target, sink)
    assert active_patches() == []


# --------------------------------------------------------------------------- manager
def test_manager_from_config_switches_every_delivery() -> None:
    manager = DistillDeliveryManager(
        {
            "func": {
                "type": "FunctionOutputs",
                "source": "helpers.toy.toy_func",
                "max_keep_data": 2,
            },
            "method": {
                "type": "MethodOutputsDelivery",
                "method_path": "helpers.toy.Toy.toy_func",
            },
            "mmrazor": {
                "type": "FunctionOutputsDelivery",
                "func_path": "helpers.toy.double",
            },
        }
    )
    assert len(manager) == 3 and "func" in manager
    assert isinstance(manager.get_delivery("method"), MethodOutputsDelivery)
    x = torch.ones(1)
    with manager:  # the teacher's pass
        recorded = (toy_module.toy_func(), toy_module.toy_func(), toy_module.Toy().toy_func())
        doubled = toy_module.double(x)
    manager.override_data = True
    assert all(d.override_data for d in manager.deliveries.values())
    with manager:  # the student's pass
        assert (
            toy_module.toy_func(),
            toy_module.toy_func(),
            toy_module.Toy().toy_func(),
        ) == recorded
        assert toy_module.double(x * 0) is doubled
    manager.override_data = False
    with manager:
        toy_module.toy_func()
    manager.reset()
    assert all(len(d.data_queue) == 0 for d in manager.deliveries.values())
    assert active_patches() == []
    manager.initialize()
    assert len(active_patches()) == 3
    manager.release()
    assert active_patches() == []


def test_manager_enter_failure_unwinds() -> None:
    manager = DistillDeliveryManager(
        {
            "a": {"type": "FunctionOutputs", "source": "helpers.toy.toy_func"},
            "b": {"type": "FunctionOutputs", "source": "helpers.toy.double"},
        }
    )
    second = manager.get_delivery("b")
    with second:
        with pytest.raises(RecorderStateError, match="already active"):
            manager.__enter__()
        assert not manager.get_delivery("a").active
    assert active_patches() == []


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            {"type": "FunctionOutput", "source": "helpers.toy.toy_func"},
            "Closest types: 'FunctionOutputs'",
        ),
        (
            {"source": "helpers.toy.toy_func"},
            "Expected delivery 'd' to have a 'type' key; valid delivery types: FunctionOutputs",
        ),
        ({"type": "FunctionOutputs"}, "Expected delivery 'd' to have a 'source' key"),
        (
            {"type": "FunctionOutputs", "source": "helpers.toy.toy_func", "max_keep": 2},
            r"Unknown option\(s\) 'max_keep' in FunctionOutputsDelivery delivery 'd'. "
            r"Closest options: 'max_keep_data'",
        ),
        (
            {
                "type": "FunctionOutputs",
                "source": "helpers.toy.a",
                "func_path": "helpers.toy.b",
            },
            "Expected one of 'source' and 'func_path' in delivery 'd' but got both",
        ),
        ("helpers.toy.toy_func", "Expected delivery 'd' to be a mapping"),
    ],
)
def test_manager_config_errors(config: object, match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        DistillDeliveryManager({"d": config})  # type: ignore[dict-item]


def test_manager_names() -> None:
    one = FunctionOutputsDelivery("helpers.toy.toy_func")
    with pytest.raises(DuplicateNameError, match="A delivery named 'x' already exists"):
        DistillDeliveryManager([("x", one), ("x", one)])
    with pytest.raises(RecorderConfigError, match="Expected a non-empty str delivery name"):
        DistillDeliveryManager({"": one})
    manager = DistillDeliveryManager({"noise": one})
    assert build_delivery(one) is one and manager.get_delivery("noise") is one
    with pytest.raises(
        RecorderConfigError, match=r"No delivery named 'nose'\. Closest delivery names: 'noise'"
    ):
        manager.get_delivery("nose")
    assert "noise=FunctionOutputsDelivery('helpers.toy.toy_func', max_keep_data=1)" in repr(manager)


def test_mmrazor_path_keywords() -> None:
    from lightning_recorder import RecorderConfigError

    function = FunctionOutputsDelivery(func_path="helpers.toy.toy_func", max_keep_data=2)
    assert function.source == "helpers.toy.toy_func"
    method = MethodOutputsDelivery(method_path="helpers.toy.Toy.toy_func")
    assert method.source == "helpers.toy.Toy.toy_func"
    with pytest.raises(RecorderConfigError, match="either `source` or `func_path`"):
        FunctionOutputsDelivery("helpers.toy.toy_func", func_path="helpers.toy.toy_func")
    with pytest.raises(RecorderConfigError, match=r"`source` \(or `method_path`\)"):
        MethodOutputsDelivery()


def test_manager_rejects_what_is_not_named_configs() -> None:
    from lightning_recorder import RecorderConfigError

    with pytest.raises(RecorderConfigError, match=r"`deliveries` to be a mapping.*int 5"):
        DistillDeliveryManager(5)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"item 0 is 'a', not a \(name, config\) pair"):
        DistillDeliveryManager(["a"])  # type: ignore[list-item]
    pairs = (("d", {"type": "FunctionOutputs", "source": "helpers.toy.toy_func"}) for _ in "x")
    assert list(DistillDeliveryManager(pairs).deliveries) == ["d"]  # a generator works
