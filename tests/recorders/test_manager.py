"""RecorderManager: config dicts, registry, errors, all-or-nothing initialization."""

from __future__ import annotations

from collections import OrderedDict
from types import MappingProxyType

import pytest
import torch
from torch import nn

from lightning_recorder import (
    DuplicateNameError,
    FunctionOutputsRecorder,
    ModuleOutputsRecorder,
    NotInitializedError,
    RecorderConfigError,
    RecorderManager,
    RecorderStateError,
    UnknownRecorderTypeError,
    UnknownSourceError,
    recorder_types,
    register_recorder,
)
from lightning_recorder._core.hooks import live_hooks
from lightning_recorder.recorders._registry import RECORDERS


def make_model() -> nn.Module:
    return nn.Sequential(OrderedDict(conv1=nn.Conv2d(1, 2, 1), conv2=nn.Conv2d(2, 1, 1)))


def test_short_and_full_type_names_any_mapping() -> None:
    configs = MappingProxyType(
        {
            "a": OrderedDict(type="ModuleOutputs", source="conv1"),
            "b": {"type": "ModuleOutputsRecorder", "source": "conv2", "detach": True},
            "c": {"type": "ModuleInputs", "source": "conv2"},
            "p": {"type": "Parameter", "source": "conv1.weight"},
        }
    )
    manager = RecorderManager(configs)
    model = make_model()
    manager.initialize(model)
    x = torch.randn(1, 1, 2, 2)
    with manager:
        out = model(x)
    assert manager.recording is False
    assert torch.equal(manager.get_recorder("b").get_record_data(), out)
    assert manager.get_recorder("b").get_record_data().grad_fn is None
    assert torch.equal(manager.get_recorder("c").get_record_data(data_idx=0), model.conv1(x))
    assert list(manager.recorders) == ["a", "b", "c", "p"]
    assert [name for name, _ in manager.streams()] == ["a", "b", "c", "p"]
    with pytest.raises(TypeError):
        manager.recorders["z"] = ModuleOutputsRecorder("conv1")  # type: ignore[index]
    manager.release()
    assert live_hooks() == []


def test_initialize_failure_leaves_nothing_installed() -> None:
    manager = RecorderManager(
        [
            ("ok", {"type": "ModuleOutputs", "source": "conv1"}),
            ("bad", {"type": "ModuleOutputs", "source": "conv3"}),
        ]
    )
    with pytest.raises(UnknownSourceError, match=r"'conv3'.*'conv1'"):
        manager.initialize(make_model())
    assert live_hooks() == []
    assert not manager.initialized


def test_register_custom_recorder_type() -> None:
    class AbsOutputsRecorder(ModuleOutputsRecorder):
        short_name = "AbsOutputs"

        def capture(self, stream, value):  # type: ignore[no-untyped-def]
            super().capture(stream, value.abs())

    try:
        register_recorder(AbsOutputsRecorder)
        assert recorder_types()["AbsOutputs"] is AbsOutputsRecorder
        with pytest.raises(DuplicateNameError, match=r"'AbsOutputsRecorder' is already registered"):

            @register_recorder
            class AbsOutputsRecorder(ModuleOutputsRecorder):  # type: ignore[no-redef]
                short_name = "AbsOutputs"

        manager = RecorderManager({"abs": {"type": "AbsOutputs", "source": "conv2"}})
        model = make_model()
        manager.initialize(model)
        with manager:
            out = model(torch.randn(1, 1, 2, 2))
        assert torch.equal(manager.get_recorder("abs").get_record_data(), out.abs())
        manager.release()
    finally:
        RECORDERS._types.pop("AbsOutputs", None)
        RECORDERS._types.pop("AbsOutputsRecorder", None)


def test_a_subclass_without_a_short_name_does_not_take_its_parents() -> None:
    """A subclass that defines no short_name of its own is registered under its class name
    without the Recorder suffix, and the parent's short name still names the parent."""

    class MagnitudeRecorder(ModuleOutputsRecorder):
        pass

    try:
        register_recorder(MagnitudeRecorder, replace=True)
        assert recorder_types()["Magnitude"] is MagnitudeRecorder
        assert recorder_types()["ModuleOutputs"] is ModuleOutputsRecorder
    finally:
        RECORDERS._types.pop("Magnitude", None)
        RECORDERS._types.pop("MagnitudeRecorder", None)
        RECORDERS._types["ModuleOutputs"] = ModuleOutputsRecorder


def test_an_unknown_option_without_a_close_one_lists_the_valid_options_once() -> None:
    config = {"type": "ModuleOutputs", "source": "conv1", "persistent": True}
    with pytest.raises(RecorderConfigError, match=r"Unknown option\(s\) 'persistent'") as err:
        RecorderManager({"r": config})
    message = str(err.value)
    assert message.count("'clone'") + message.count(" clone,") == 1
    assert "Valid options: source, detach, clone, device, dtype, keep, path." in message


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"type": "ModuleOutput", "source": "x"}, UnknownRecorderTypeError, r"'ModuleOutputs'"),
        (
            {"source": "x"},
            UnknownRecorderTypeError,
            r"'type' key; valid recorder types: .*ModuleInputs",
        ),
        ({"type": "ModuleOutputs"}, RecorderConfigError, r"'source' key"),
        (
            {"type": "ModuleOutputs", "source": "x", "clone_": True},
            RecorderConfigError,
            r"Unknown option\(s\) 'clone_'.*Closest options: 'clone'",
        ),
        ("conv1", RecorderConfigError, r"to be a mapping such as"),
        # An invalid option value names the recorder at fault.
        (
            {"type": "ModuleOutputs", "source": "x", "keep": 0},
            RecorderConfigError,
            r"^In recorder 'r': Expected `keep` to be 'all'.*got 0\.$",
        ),
        (
            {"type": "FunctionOutputs", "source": "a.b", "persistent": 1},
            RecorderConfigError,
            r"^In recorder 'r': Expected `persistent` to be a bool",
        ),
    ],
)
def test_bad_configs(config: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        RecorderManager({"r": config})  # type: ignore[dict-item]


def test_one_recorder_under_two_names_is_refused() -> None:
    # Its streams would come twice out of streams(), e.g. logged twice by a callback.
    recorder = ModuleOutputsRecorder("conv1")
    manager = RecorderManager({"first": recorder})
    with pytest.raises(DuplicateNameError, match=r"already in it as 'first'.*second recorder"):
        manager.add_recorder("second", recorder)
    assert list(manager.recorders) == ["first"]
    with pytest.raises(DuplicateNameError, match=r"already in it as 'a'"):
        RecorderManager([("a", recorder), ("b", recorder)])


def test_duplicate_names_and_unknown_recorder_name() -> None:
    with pytest.raises(DuplicateNameError, match=r"'r' already exists"):
        RecorderManager(
            [
                ("r", {"type": "ModuleOutputs", "source": "conv1"}),
                ("r", {"type": "ModuleOutputs", "source": "conv2"}),
            ]
        )
    manager = RecorderManager({"conv1_rec": {"type": "ModuleOutputs", "source": "conv1"}})
    with pytest.raises(RecorderConfigError, match=r"No recorder named 'conv_rec'.*'conv1_rec'"):
        manager.get_recorder("conv_rec")
    assert "conv1_rec" in manager and len(manager) == 1


def test_an_empty_manager_says_it_has_no_recorders() -> None:
    # The manager has no recorders; the message must not blame the model.
    with pytest.raises(RecorderConfigError, match=r"^No recorder named 'x'\. There are no ") as err:
        RecorderManager().get_recorder("x")
    assert "model" not in str(err.value)


def test_a_recorder_that_cannot_start_leaves_no_function_patched() -> None:
    """When one recorder of a manager cannot start, those started before it are stopped with
    their own ``stop``: a function recorder puts the original function back."""
    original = torch.nn.functional.relu
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    manager = RecorderManager(
        {"relu": {"type": "FunctionOutputs", "source": "torch.nn.functional.relu"}}
    )
    manager.initialize(model)
    manager.add_recorder("late", {"type": "ModuleOutputs", "source": "1"})  # not initialized
    for start in (manager.start, manager.__enter__):
        with pytest.raises(NotInitializedError, match=r"ModuleOutputsRecorder\('1'\)"):
            start()
        assert torch.nn.functional.relu is original
        assert not manager.get_recorder("relu").recording
    manager.release()


def test_entering_a_manager_whose_recorder_records_on_its_own_says_so() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    recorder = ModuleOutputsRecorder("0")
    manager = RecorderManager({"out": recorder})
    manager.initialize(model)
    with recorder:
        with pytest.raises(RecorderStateError, match=r"or started on its own.*stop it"):
            manager.__enter__()
        assert recorder.recording
    with manager:  # once it stopped, the manager records with it
        model(torch.randn(1, 2))
    assert len(recorder.data_buffer) == 1
    manager.release()


def test_register_rejects_non_recorders() -> None:
    with pytest.raises(RecorderConfigError, match="Expected a BaseRecorder subclass"):
        register_recorder(dict)  # type: ignore[type-var]


def test_register_rejects_a_name_or_replace_of_the_wrong_type() -> None:
    # A non-str name used to enter the registry and break every later listing of its types.
    class Odd(ModuleOutputsRecorder):
        short_name = "OddOne"

    before = dict(recorder_types())
    with pytest.raises(RecorderConfigError, match=r"`name` of register_recorder .* got 5"):
        register_recorder(Odd, name=5)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"`name` of register_recorder .* got ''"):
        register_recorder(Odd, name="")
    with pytest.raises(RecorderConfigError, match=r"`replace` of register_recorder to be a bool"):
        register_recorder(Odd, replace="yes")  # type: ignore[arg-type]
    assert dict(recorder_types()) == before
    with pytest.raises(UnknownRecorderTypeError, match="Valid recorder types"):
        RecorderManager({"r": {"type": "Nope", "source": "x"}})


def test_suspend_removes_hooks_until_start() -> None:
    configs = {
        "out": {"type": "ModuleOutputs", "source": "conv1"},
        "inp": {"type": "ModuleInputs", "source": "conv2"},
        "outgrad": {"type": "ModuleOutputGrads", "source": "conv1"},
        "ingrad": {"type": "ModuleInputGrads", "source": "conv2"},
        "wgrad": {"type": "ParameterGrad", "source": "conv1.weight"},
        "relu": {"type": "FunctionOutputs", "source": "torch.nn.functional.relu"},
    }
    model = make_model()
    x = torch.randn(2, 1, 3, 3)
    manager = RecorderManager(configs)
    manager.suspend()  # not initialized: nothing to do
    manager.initialize(model)
    installed = len(live_hooks())
    assert installed == 5  # the function recorder patches instead
    manager.suspend()
    manager.suspend()  # idempotent
    assert live_hooks() == []
    assert not model.conv1._forward_hooks and not model.conv2._forward_pre_hooks
    assert all(r.suspended for n, r in manager.recorders.items() if n != "relu")
    model(x).sum().backward()  # runs as without recorders
    with manager:  # reinstalled when recording starts
        assert len(live_hooks()) == installed
        manager.suspend()  # does nothing while recording
        assert len(live_hooks()) == installed
        out = model(x)
        torch.nn.functional.relu(out)
        out.sum().backward()
    assert torch.equal(manager.get_recorder("out").get_record_data(), model.conv1(x))
    assert manager.get_recorder("inp").get_record_data(data_idx=0).shape == (2, 2, 3, 3)
    assert manager.get_recorder("outgrad").get_record_data().shape == (2, 2, 3, 3)
    assert manager.get_recorder("ingrad").get_record_data().shape == (2, 2, 3, 3)
    assert torch.equal(manager.get_recorder("wgrad").get_record_data(), model.conv1.weight.grad)
    assert manager.get_recorder("relu").get_record_data().shape == (2, 1, 3, 3)
    manager.suspend()
    assert torch.equal(
        manager.get_recorder("out").get_record_data(), model.conv1(x)
    )  # records stay readable
    manager.release()
    assert live_hooks() == []
    manager.initialize(model)  # a suspended, released manager starts afresh
    assert len(live_hooks()) == installed
    manager.release()


def test_a_resumed_hook_runs_after_hooks_added_since() -> None:
    model = make_model()
    manager = RecorderManager({"out": {"type": "ModuleOutputs", "source": "conv1"}})
    manager.initialize(model)
    manager.suspend()
    model.conv1.register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(1, 1, 2, 2)
    with manager:
        model(x)
    assert torch.equal(
        manager.get_recorder("out").get_record_data(),
        2 * nn.functional.conv2d(x, model.conv1.weight, model.conv1.bias),
    )
    manager.release()


def test_a_stop_inside_paused_stands() -> None:
    """paused() resumes the recording it paused, not one stopped (or restarted) inside it."""
    original = torch.nn.functional.relu
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    out = ModuleOutputsRecorder("0").initialize(model)
    fn = FunctionOutputsRecorder("torch.nn.functional.relu").initialize()
    for recorder in (out, fn):
        recorder.start()
        with recorder.paused():
            recorder.stop()
        assert not recorder.recording
    assert torch.nn.functional.relu is original
    model(torch.ones(1, 2))
    assert len(out.data_buffer) == 0
    out.start()
    with out.paused():
        out.release()
    assert not out.recording and not out.initialized
    fn.release()


def test_paused_records_nothing_and_keeps_the_records_so_far() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    manager = RecorderManager(
        {
            "out": {"type": "ModuleOutputs", "source": "0"},
            "fn": {"type": "FunctionOutputs", "source": "torch.nn.functional.relu"},
        }
    )
    manager.initialize(model)
    try:
        first, second, third = torch.ones(1, 2), torch.zeros(1, 2), torch.full((1, 2), 2.0)
        with manager:
            model(first)
            with manager.paused():
                assert not manager.recording
                model(second)  # not part of the recording
            assert manager.recording
            model(third)
        records = manager.get_recorder("out").data_buffer
        assert len(records) == 2
        assert torch.equal(records[0], model[0](first))
        assert torch.equal(records[1], model[0](third))
        assert len(manager.get_recorder("fn").data_buffer) == 2  # a patched function too
        with manager.paused():  # not recording: nothing to pause
            model(second)
        assert not manager.recording
    finally:
        manager.release()
    assert live_hooks() == []
