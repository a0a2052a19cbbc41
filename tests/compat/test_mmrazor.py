"""MMRazor's recorder and delivery tests, re-expressed in this package's API.

Source: https://github.com/open-mmlab/mmrazor at commit
90c7af1fdf35a606a2fceaaeb4b6be2f0dac4eb7, files ``tests/test_core/test_recorders/*.py`` (8 test
files, toy module ``toy_mod.py``) and ``tests/test_core/test_delivers/*.py`` (3 test files, toy
module ``toy_module.py``). Their toy modules are replaced by ``compat/_mmrazor_toys.py``:
``toy_func(a)`` is ``identity``, ``toy_func2`` is ``pair``, ``execute_toy_func*`` are
``calls_*``, the deliveries' random ``toy_func()`` is ``draw``, and the classes ``Toy``,
``ToyClass`` (both files) are merged into ``Counter`` (``toy``→``tick``, ``func``→``add``,
``toy_func``/``random_int``→``draw``, ``toy_list_func``→``draws``).

MMRazor builds recorders and deliveries through mmengine registries from ``ConfigDict``s; here
``RecorderManager`` and ``DistillDeliveryManager`` take plain dicts (any ``Mapping``), which is
what a ``ConfigDict`` is. MMRazor's Runner+``EMAHook`` tests are re-expressed with
``torch.optim.swa_utils.AveragedModel``, which deep-copies the model as the EMA hook does.

Deliberate differences, for every row below: user mistakes raise this package's
``RecorderConfigError`` family (``ValueError`` subclasses) instead of ``AssertionError``,
``ImportError`` or ``TypeError`` (the house rule is "never ``assert`` on user input"); a bad
function source is reported by ``initialize()`` instead of at context entry, and a bad method
source by ``initialize()`` instead of the constructor (deliveries check at construction, as
MMRazor's method delivery does); a full or empty delivery queue raises ``RecorderStateError`` /
``NoRecordError`` (``RuntimeError``s) instead of ``AssertionError``; a record index out of range
or a ``data_idx`` into a non-sequence raises ``NoRecordError`` (also an ``IndexError``) instead of
``AssertionError`` / ``TypeError``; module and parameter recorders hold hooks until ``release()``
(function and method patches live only inside the context, as in MMRazor, unless
``persistent=True``), so every test releases what it initialized; a copy of an initialized
function or method recorder is a fresh recorder with empty records.

Peer test (``file::function``) and the tests here that cover it:

======================================================  =========================================
MMRazor test                                            covered by
======================================================  =========================================
test_base_recorder::test_get_record_data                test_get_record_data_by_record_idx,
                                                        test_get_record_data_errors,
                                                        test_get_record_data_by_data_idx
test_func_inputs_recorder::test_context_manager         test_function_inputs_normalised
test_func_inputs_recorder::test_ema_hook                test_ema_copy_of_model_with_function_\
                                                        inputs_recorder
test_func_outputs_recorder::test_init                   test_function_outputs_init
test_func_outputs_recorder::test_context_manager        test_function_outputs_bad_sources,
                                                        test_function_outputs_recorded_only_in_\
                                                        context, test_function_patch_restored_\
                                                        on_exit
test_method_inputs_recorder::test_context_manager       test_method_inputs_normalised
test_method_outputs_recorder::test_init                 test_method_outputs_bad_sources
test_method_outputs_recorder::test_context_manager      test_method_outputs_recorded_only_in_\
                                                        context, test_method_patch_restored_on_\
                                                        exit
test_module_recorders::test_prepare_from_model          test_module_outputs_initialize_checks_\
                                                        model, test_prepare_from_model_public
test_module_recorders::test_module_outputs              test_module_outputs_context
test_module_recorders::test_module_intputs              test_module_inputs_context
test_param_recorder::test_prepare_from_model            test_parameter_recorder; its
                                                        ``prepare_from_model()`` call:
                                                        test_prepare_from_model_public
test_recorder_manager::test_init                        test_manager_init
test_recorder_manager::test_context_manager             test_manager_context
test_deliver_manager::test_init                         test_delivery_manager_init
test_deliver_manager::test_context_manager              test_delivery_manager_record_then_replay
test_function_outputs_deliver::test_init                test_function_delivery_init; with
                                                        ``func_path=``: test_delivery_path_\
                                                        keywords
test_function_outputs_deliver::test_context_manager     test_function_delivery_bad_sources,
                                                        test_function_delivery_record_then_replay
test_function_outputs_deliver::test_ema_hook            test_ema_copy_of_model_with_delivery
test_method_outputs_deliver::test_init                  test_method_delivery_init; with
                                                        ``method_path=``: test_delivery_path_\
                                                        keywords
test_method_outputs_deliver::test_context_manager       test_method_delivery_record_then_replay
(both EMA tests copy a model holding recorders)         test_deepcopy_and_pickle_initialized_\
                                                        callable_recorders
======================================================  =========================================
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from lightning_recorder import (
    DistillDeliveryManager,
    FunctionInputsRecorder,
    FunctionOutputsDelivery,
    FunctionOutputsRecorder,
    InvalidSourceError,
    MethodInputsRecorder,
    MethodOutputsDelivery,
    MethodOutputsRecorder,
    ModuleInputsRecorder,
    ModuleOutputsRecorder,
    NoRecordError,
    ParameterRecorder,
    RecorderConfigError,
    RecorderManager,
    RecorderStateError,
    UnknownSourceError,
)

from . import _mmrazor_toys as toys

TOYS = "compat._mmrazor_toys"


class ConvPair(nn.Module):
    """MMRazor's two 1x1-conv toy model (test_module_recorders.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 1, 1)
        self.conv2 = nn.Conv2d(1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.conv1(x))


# ---------------------------------------------------------------- test_base_recorder.py


def test_get_record_data_by_record_idx() -> None:
    counter = toys.Counter()
    recorder = MethodOutputsRecorder(f"{TOYS}.Counter.draw").initialize()
    try:
        with recorder:
            first, second = counter.draw(), counter.draw()
        assert recorder.get_record_data(record_idx=0) == first
        assert recorder.get_record_data(record_idx=1) == second
    finally:
        recorder.release()


def test_get_record_data_errors() -> None:
    counter = toys.Counter()
    recorder = MethodOutputsRecorder(f"{TOYS}.Counter.draw").initialize()
    try:
        with recorder:
            counter.draw()
            counter.draw()
        with pytest.raises(NoRecordError, match=r"`record_idx` in \[-2, 1\] but got 2"):
            recorder.get_record_data(record_idx=2)
        with pytest.raises(NoRecordError, match=r"`data_idx`.*a int"):
            recorder.get_record_data(data_idx=0)
    finally:
        recorder.release()


def test_get_record_data_by_data_idx() -> None:
    counter = toys.Counter()
    recorder = MethodOutputsRecorder(f"{TOYS}.Counter.draws").initialize()
    try:
        with recorder:
            result = counter.draws()
        assert len(result) == 3
        with pytest.raises(NoRecordError, match="a list of length 3, but got 3"):
            recorder.get_record_data(data_idx=3)
        assert recorder.get_record_data(data_idx=2) == result[2]
    finally:
        recorder.release()


# ---------------------------------------------------------------- function recorders


def test_function_inputs_normalised() -> None:
    recorder = FunctionInputsRecorder(f"{TOYS}.pair").initialize()
    try:
        with recorder:
            toys.calls_pair(1, 2)
            toys.calls_pair(1, b=2)
            toys.calls_pair(b=2, a=1)
        for record_idx in range(3):
            assert recorder.get_record_data(record_idx=record_idx, data_idx=0) == 1
            assert recorder.get_record_data(record_idx=record_idx, data_idx=1) == 2
    finally:
        recorder.release()


def test_function_outputs_init() -> None:
    FunctionOutputsRecorder(f"{TOYS}.identity")
    with pytest.raises(RecorderConfigError, match="dotted path string but got list"):
        FunctionOutputsRecorder([1])  # type: ignore[arg-type]
    with pytest.raises(InvalidSourceError, match=r"dotted path such as 'pkg\.module\.func'"):
        FunctionOutputsRecorder("aaaaa").initialize()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("aaa.bbb", "no prefix of it imports: No module named 'aaa'"),
        (f"{TOYS}.aaa", "has no function 'aaa'"),
        (f"{TOYS}.TOY_VAR", "to be a function but it is a str"),
    ],
)
def test_function_outputs_bad_sources(source: str, message: str) -> None:
    recorder = FunctionOutputsRecorder(source)
    with pytest.raises(InvalidSourceError, match=message):
        recorder.initialize()
    recorder.release()


def test_function_outputs_recorded_only_in_context() -> None:
    recorder = FunctionOutputsRecorder(f"{TOYS}.identity").initialize()
    try:
        with recorder:
            toys.calls_identity(1)
        assert recorder.get_record_data() == 1
        toys.calls_identity(2)  # outside the context: not recorded
        assert recorder.get_record_data() == 1
        assert len(recorder.data_buffer) == 1
    finally:
        recorder.release()


def test_function_patch_restored_on_exit() -> None:
    original = toys.identity
    recorder = FunctionOutputsRecorder(f"{TOYS}.identity").initialize()
    try:
        with recorder:
            assert toys.identity is not original  # patched while the context is open
            toys.calls_identity(3)
        assert recorder.get_record_data() == 3
        assert toys.identity is original  # restored on exit, release() not called yet
    finally:
        recorder.release()


# ---------------------------------------------------------------- method recorders


def test_method_inputs_normalised() -> None:
    counter = toys.Counter()
    recorder = MethodInputsRecorder(f"{TOYS}.Counter.add").initialize()
    try:
        with recorder:
            counter.add(x=1, y=2)
            counter.add(1, y=2)
            counter.add(y=2, x=1)
        for record_idx in range(3):
            assert recorder.get_record_data(record_idx=record_idx, data_idx=0) == 1
            assert recorder.get_record_data(record_idx=record_idx, data_idx=1) == 2
    finally:
        recorder.release()


@pytest.mark.parametrize(
    ("source", "error", "message"),
    [
        ("aaaaa", InvalidSourceError, r"dotted path such as 'pkg\.module\.Class\.method'"),
        ("aaa.bbb", InvalidSourceError, "No module named 'aaa'"),
        ("aaa.bbb.ccc", InvalidSourceError, "No module named 'aaa'"),
        (f"{TOYS}.aaa.bbb", InvalidSourceError, "has no class 'aaa'"),
        (f"{TOYS}.identity.bbb", InvalidSourceError, "to be a class but it is a function"),
        (f"{TOYS}.Counter.bbb", InvalidSourceError, "Counter has no method 'bbb'"),
        (f"{TOYS}.Counter.TOY_CLS", InvalidSourceError, "to be a method but it is a str"),
    ],
)
def test_method_outputs_bad_sources(source: str, error: type[Exception], message: str) -> None:
    MethodOutputsRecorder(f"{TOYS}.Counter.tick")  # a good source builds
    with pytest.raises(RecorderConfigError, match="dotted path string but got list"):
        MethodOutputsRecorder([1])  # type: ignore[arg-type]
    recorder = MethodOutputsRecorder(source)
    with pytest.raises(error, match=message):
        recorder.initialize()
    recorder.release()


def test_method_outputs_recorded_only_in_context() -> None:
    counter = toys.Counter()
    recorder = MethodOutputsRecorder(f"{TOYS}.Counter.tick").initialize()
    try:
        with recorder:
            result = counter.tick()
        assert recorder.get_record_data() == result
        later = counter.tick()  # outside the context: not recorded
        assert recorder.get_record_data() == result
        assert later != result
    finally:
        recorder.release()


def test_method_patch_restored_on_exit() -> None:
    original = toys.Counter.__dict__["tick"]
    recorder = MethodOutputsRecorder(f"{TOYS}.Counter.tick").initialize()
    try:
        with recorder:
            assert toys.Counter.__dict__["tick"] is not original
            toys.Counter().tick()
        assert recorder.get_record_data() == 1
        assert toys.Counter.__dict__["tick"] is original
    finally:
        recorder.release()


@pytest.mark.parametrize(
    ("cls", "source"),
    [
        (FunctionOutputsRecorder, f"{TOYS}.identity"),
        (FunctionInputsRecorder, f"{TOYS}.pair"),
        (MethodOutputsRecorder, f"{TOYS}.Counter.tick"),
        (MethodInputsRecorder, f"{TOYS}.Counter.add"),
    ],
)
def test_deepcopy_and_pickle_initialized_callable_recorders(cls: type, source: str) -> None:
    recorder = cls(source).initialize()
    copies = []
    try:
        copies.append(copy.deepcopy(recorder))
        copies.append(pickle.loads(pickle.dumps(recorder)))
        for duplicate in copies:
            assert type(duplicate) is cls
            assert duplicate.source == source
    finally:
        for duplicate in copies:
            duplicate.release()
        recorder.release()


# ---------------------------------------------------------------- module and parameter recorders


def test_module_outputs_initialize_checks_model() -> None:
    with pytest.raises(RecorderConfigError, match=r"expected `initialize\(model\)`"):
        ModuleOutputsRecorder("conv1").initialize()
    with pytest.raises(UnknownSourceError, match="No module named 'conv3' in the model"):
        ModuleOutputsRecorder("conv3").initialize(ConvPair())
    recorder = ModuleOutputsRecorder("conv2").initialize(ConvPair())
    assert recorder.initialized
    recorder.release()


def test_prepare_from_model_public() -> None:
    model = ConvPair()
    with pytest.raises(RecorderConfigError, match="model"):
        ModuleOutputsRecorder("conv1").prepare_from_model()
    with pytest.raises(UnknownSourceError, match="conv3"):
        ModuleOutputsRecorder("conv3").prepare_from_model(model)
    with pytest.raises(RecorderConfigError, match="model"):
        ParameterRecorder("conv1.bias").prepare_from_model()

    seen: list[nn.Module | None] = []

    class SeeingRecorder(ModuleOutputsRecorder):
        def prepare_from_model(self, model: nn.Module | None = None) -> None:
            seen.append(model)
            super().prepare_from_model(model)

    recorder = SeeingRecorder("conv2")
    try:
        recorder.initialize(model)  # a custom recorder's override is what initialize calls
        assert seen == [model]
        with recorder:
            out = model(torch.randn(1, 1, 1, 1))
        assert torch.equal(recorder.get_record_data(), out)
    finally:
        recorder.release()


def test_module_outputs_context() -> None:
    model = ConvPair()
    recorder = ModuleOutputsRecorder("conv2").initialize(model)
    try:
        with recorder:
            assert recorder.recording
            out = model(torch.randn(1, 1, 1, 1))
        assert torch.equal(recorder.get_record_data(), out)
        with recorder:
            assert len(recorder.data_buffer) == 0  # entering starts a fresh buffer
        model(torch.randn(1, 1, 1, 1))  # outside the context
        assert len(recorder.data_buffer) == 0
    finally:
        recorder.release()


def test_module_inputs_context() -> None:
    model = ConvPair()
    recorder = ModuleInputsRecorder("conv1").initialize(model)
    try:
        x = torch.randn(1, 1, 1, 1)
        with recorder:
            assert recorder.recording
            model(x)
        assert torch.equal(recorder.get_record_data(data_idx=0), x)
        with recorder:
            assert len(recorder.data_buffer) == 0
        model(torch.randn(1, 1, 1, 1))
        assert len(recorder.data_buffer) == 0
    finally:
        recorder.release()


class ParamToy(nn.Module):
    """MMRazor's parameter-recorder toy: one used conv, one unused."""

    def __init__(self) -> None:
        super().__init__()
        self.toy_conv = nn.Conv2d(1, 1, 1)
        self.no_record_conv = nn.Conv2d(1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.toy_conv(x)


def test_parameter_recorder() -> None:
    model = ParamToy()
    with pytest.raises(UnknownSourceError, match="No parameter named 'AAA'"):
        ParameterRecorder("AAA").initialize(model)
    recorder = ParameterRecorder("toy_conv.bias")
    with pytest.raises(RecorderConfigError, match=r"expected `initialize\(model\)`"):
        recorder.initialize()
    recorder.initialize(model)
    try:
        bias = recorder.get_record_data()  # available right after initialize
        assert bias is model.toy_conv.bias
        with recorder:
            model(torch.randn(1, 1, 1, 1))
        assert recorder.get_record_data() is model.toy_conv.bias
    finally:
        recorder.release()


# ---------------------------------------------------------------- RecorderManager


class ConvPairPlusDraw(ConvPair):
    """MMRazor's manager toy: conv2(conv1(x)) plus a random int from a method."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = toys.Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.counter.draw()


def test_manager_init() -> None:
    assert len(RecorderManager().recorders) == 0
    manager = RecorderManager(
        {
            "r1": {"type": "ModuleOutputs", "source": "conv1"},
            "r2": {"type": "MethodOutputs", "source": f"{TOYS}.Counter.draw"},
        }
    )
    manager.initialize(ConvPairPlusDraw())
    assert set(manager.recorders) == {"r1", "r2"}
    manager.release()


def test_manager_context() -> None:
    manager = RecorderManager(
        {
            "r1": {"type": "ModuleOutputs", "source": "conv2"},
            "r2": {"type": "MethodOutputs", "source": f"{TOYS}.Counter.draw"},
        }
    )
    model = ConvPairPlusDraw()
    manager.initialize(model)
    try:
        assert manager.get_recorder("r1") is manager.recorders["r1"]
        assert manager.get_recorder("r2") is manager.recorders["r2"]
        with manager:
            out = model(torch.ones(1, 1, 1, 1))
        drawn = manager.recorders["r2"].get_record_data()
        conv2_out = manager.recorders["r1"].get_record_data()
        # One element, one float addition in either order: float32 rounding only.
        torch.testing.assert_close(out.sum(), drawn + conv2_out.sum(), rtol=1e-6, atol=1e-3)
    finally:
        manager.release()


# ---------------------------------------------------------------- deliveries


def test_delivery_manager_init() -> None:
    config = {
        "delivery1": {
            "type": "MethodOutputs",
            "max_keep_data": 2,
            "method_path": f"{TOYS}.Counter.draw",
        }
    }
    assert len(DistillDeliveryManager(config).deliveries) == 1
    assert len(DistillDeliveryManager().deliveries) == 0


def test_delivery_manager_record_then_replay() -> None:
    manager = DistillDeliveryManager(
        {
            "delivery1": {
                "type": "MethodOutputs",
                "max_keep_data": 2,
                "method_path": f"{TOYS}.Counter.draw",
            }
        }
    )
    manager.override_data = False
    assert not manager.override_data
    with manager:
        counter = toys.Counter()
        teacher = [counter.draw(), counter.draw()]
    with pytest.raises(RecorderStateError, match="it is full"), manager:
        counter.draw()
    assert not manager.override_data
    manager.override_data = True
    assert manager.override_data
    with manager:
        student = [counter.draw(), counter.draw()]
    assert student == teacher
    with pytest.raises(NoRecordError, match="is empty"), manager:
        counter.draw()


def test_function_delivery_init() -> None:
    with pytest.raises(
        InvalidSourceError, match=r"dotted path such as 'pkg\.module\.func' but got 1"
    ):
        FunctionOutputsDelivery(1, max_keep_data=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidSourceError, match="but got 'draw'"):
        FunctionOutputsDelivery("draw", max_keep_data=1)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("aaa.bb", "No module named 'aaa'"),
        (f"{TOYS}.bb", "has no function 'bb'"),
        (f"{TOYS}.TOY_VAR", "to be a function but it is a str"),
    ],
)
def test_function_delivery_bad_sources(source: str, message: str) -> None:
    with pytest.raises(InvalidSourceError, match=message):
        FunctionOutputsDelivery(source, max_keep_data=2)


def test_function_delivery_record_then_replay() -> None:
    original = toys.draw
    delivery = FunctionOutputsDelivery(f"{TOYS}.draw", max_keep_data=2)
    delivery.override_data = False
    with delivery:
        teacher = [toys.draw(), toys.draw()]
    assert toys.draw is original  # restored on exit, as MMRazor's delivery does
    with pytest.raises(RecorderStateError, match="it is full"), delivery:
        toys.draw()
    delivery.override_data = True
    with delivery:
        student = [toys.draw(), toys.draw()]
    assert student == teacher
    with pytest.raises(NoRecordError, match="is empty"), delivery:
        toys.draw()
    assert toys.draw is original


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("draw", "but got 'draw'"),
        ("aaa.bb.b", "No module named 'aaa'"),
        (f"{TOYS}.bb.bbb", "has no class 'bb'"),
        (f"{TOYS}.draw.bbb", "to be a class but it is a function"),
        (f"{TOYS}.Counter.bbb", "Counter has no method 'bbb'"),
        (f"{TOYS}.Counter.count", "to be a method but it is a property"),
    ],
)
def test_method_delivery_init(source: str, message: str) -> None:
    with pytest.raises(InvalidSourceError, match="but got 1"):
        MethodOutputsDelivery(1, max_keep_data=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidSourceError, match=message):
        MethodOutputsDelivery(source, max_keep_data=1)


def test_method_delivery_record_then_replay() -> None:
    delivery = MethodOutputsDelivery(f"{TOYS}.Counter.draw", max_keep_data=2)
    delivery.override_data = False
    with delivery:
        counter = toys.Counter()
        teacher = [counter.draw(), counter.draw()]
    with pytest.raises(RecorderStateError, match="it is full"), delivery:
        counter.draw()
    delivery.override_data = True
    with delivery:
        student = [counter.draw(), counter.draw()]
    assert student == teacher
    with pytest.raises(NoRecordError, match="is empty"), delivery:
        counter.draw()


def test_delivery_path_keywords() -> None:
    with pytest.raises(InvalidSourceError, match="but got 1"):
        FunctionOutputsDelivery(max_keep_data=1, func_path=1)  # type: ignore[call-arg]
    with pytest.raises(InvalidSourceError, match="but got 'draw'"):
        MethodOutputsDelivery(max_keep_data=1, method_path="draw")  # type: ignore[call-arg]
    function = FunctionOutputsDelivery(max_keep_data=2, func_path=f"{TOYS}.draw")  # type: ignore[call-arg]
    method = MethodOutputsDelivery(max_keep_data=2, method_path=f"{TOYS}.Counter.draw")  # type: ignore[call-arg]
    assert (function.source, method.source) == (f"{TOYS}.draw", f"{TOYS}.Counter.draw")
    with function:
        drawn = toys.draw()
    function.override_data = True
    with function:
        assert toys.draw() == drawn


# ---------------------------------------------------------------- EMA (deep copies of the model)


def _ema_train(model: nn.Module) -> AveragedModel:
    """Two epochs of 4 batches of 3 (MMRazor's Runner setup), an EMA copy updated every step."""
    generator = torch.Generator().manual_seed(0)
    data, labels = torch.randn(12, 2, generator=generator), torch.ones(12)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))  # deep-copies model
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):
        for start in range(0, 12, 3):
            optimizer.zero_grad()
            outputs = model(data[start : start + 3])
            (labels[start : start + 3, None] - outputs).sum().backward()
            optimizer.step()
            ema.update_parameters(model)
    return ema


class LinearWithDelivery(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.deliver = FunctionOutputsDelivery(f"{TOYS}.draw", max_keep_data=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.deliver:
            return self.linear(x)


def test_ema_copy_of_model_with_delivery(tmp_path: object) -> None:
    model = LinearWithDelivery()
    ema = _ema_train(model)
    assert isinstance(ema.module.deliver, FunctionOutputsDelivery)
    assert ema.module.deliver is not model.deliver
    path = tmp_path / "ema.pt"  # type: ignore[operator]
    torch.save(ema.state_dict(), path)
    assert int(torch.load(path, weights_only=True)["n_averaged"]) == 8


class LinearWithRecorders(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.recorders = RecorderManager(
            {"out": {"type": "FunctionInputs", "source": f"{TOYS}.identity"}}
        )
        self.recorders.initialize(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.recorders:
            return self.linear(x)


def test_ema_copy_of_model_with_function_inputs_recorder(tmp_path: object) -> None:
    model = LinearWithRecorders()
    ema = None
    try:
        ema = _ema_train(model)
        assert ema.module.recorders is not model.recorders
        path = tmp_path / "ema.pt"  # type: ignore[operator]
        torch.save(ema.state_dict(), path)
        assert int(torch.load(path, weights_only=True)["n_averaged"]) == 8
        restored = pickle.loads(pickle.dumps(model))
        restored.recorders.release()
    finally:
        model.recorders.release()
        if ema is not None:
            ema.module.recorders.release()
