"""Function and method recorders: MMRazor's examples, patch sharing, restoration, errors."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from helpers import toy as toy_module

from lightning_recorder import (
    FunctionInputsRecorder,
    FunctionOutputsRecorder,
    InvalidSourceError,
    MethodInputsRecorder,
    MethodOutputsRecorder,
    NoRecordError,
    NotInitializedError,
    RecorderConfigError,
    RecorderStateError,
)
from lightning_recorder._core.patching import active_patches

ORIGINAL_TOY_FUNC = toy_module.toy_func
ORIGINAL_METHOD = toy_module.Toy.__dict__["toy_func"]


def test_mmrazor_function_outputs_example() -> None:
    r1 = FunctionOutputsRecorder("helpers.toy.toy_func")
    r1.initialize()
    with r1:
        out1 = toy_module.toy_func()
        out2 = toy_module.toy_func()
        out3 = toy_module.toy_func()
    data_buffer = r1.data_buffer
    assert data_buffer == [out1, out2, out3]
    assert r1.get_record_data(record_idx=2) == out3
    r1.release()
    assert toy_module.toy_func is ORIGINAL_TOY_FUNC


def test_mmrazor_method_outputs_example() -> None:
    toy = toy_module.Toy()
    r1 = MethodOutputsRecorder("helpers.toy.Toy.toy_func")
    r1.initialize()
    with r1:
        outs = [toy.toy_func() for _ in range(3)]
    assert r1.data_buffer == outs
    assert r1.get_record_data(record_idx=2) == outs[2]
    r1.release()
    assert toy_module.Toy.__dict__["toy_func"] is ORIGINAL_METHOD


def test_nothing_recorded_outside_context_and_fresh_buffer() -> None:
    rec = FunctionOutputsRecorder("helpers.toy.toy_func").initialize()
    toy_module.toy_func()
    with rec:
        first = toy_module.toy_func()
    toy_module.toy_func()
    assert rec.data_buffer == [first]
    with rec:
        second = toy_module.toy_func()
    assert rec.data_buffer == [second]
    rec.release()


def test_inputs_normalised_to_signature_order() -> None:
    rec = FunctionInputsRecorder("helpers.toy.add").initialize()
    with rec:
        toy_module.add(1, 2)
        toy_module.add(1, b=2)
        toy_module.add(b=2, a=1)
        toy_module.add(1)
        toy_module.add(1, 2, 3, 4, scale=2.0, z=5.0, y=6.0)
    records = rec.data_buffer
    rec.release()
    assert records[0] == records[1] == records[2] == (1, 2, 1.0)
    assert records[0].names == ("a", "b", "scale")
    assert records[3] == (1, 10.0, 1.0)
    assert records[4].names == ("a", "b", "rest[0]", "rest[1]", "scale", "y", "z")
    assert records[4]["z"] == 5.0


def test_method_inputs_exclude_self_static_and_classmethods() -> None:
    toy = toy_module.Toy()
    scale = MethodInputsRecorder("helpers.toy.Toy.scale").initialize()
    static = MethodOutputsRecorder("helpers.toy.Toy.static").initialize()
    klass = MethodOutputsRecorder("helpers.toy.Toy.klass").initialize()
    klass_in = MethodInputsRecorder("helpers.toy.Toy.klass").initialize()
    with scale, static, klass, klass_in:
        toy.scale(3.0, factor=4.0)
        assert toy_module.Toy.static(1) == 2
        assert toy.static(5) == 6
        assert toy_module.SubToy.klass(7) == "SubToy:7"
    assert scale.get_record_data().as_dict() == {"x": 3.0, "factor": 4.0}
    assert static.data_buffer == [2, 6]
    assert klass.data_buffer == ["SubToy:7"]
    assert tuple(klass_in.get_record_data()) == (7,)
    for rec in (klass_in, klass, static, scale):
        rec.release()
    assert isinstance(toy_module.Toy.__dict__["static"], staticmethod)
    assert isinstance(toy_module.Toy.__dict__["klass"], classmethod)
    assert toy_module.Toy.static(1) == 2


def test_inherited_method_is_restored_by_deletion() -> None:
    rec = MethodOutputsRecorder("helpers.toy.SubToy.scale", persistent=True).initialize()
    assert "scale" in toy_module.SubToy.__dict__
    with rec:
        toy_module.SubToy().scale(2.0)
        toy_module.Toy().scale(5.0)  # the base class is not patched
    assert rec.data_buffer == [4.0]
    rec.release()
    assert "scale" not in toy_module.SubToy.__dict__


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_two_recorders_share_a_patch_and_release_in_any_order(order: str) -> None:
    a = FunctionOutputsRecorder("helpers.toy.toy_func", persistent=True).initialize()
    b = FunctionOutputsRecorder("helpers.toy.toy_func", keep="last", persistent=True).initialize()
    assert active_patches() == ["helpers.toy.toy_func"]
    with a:
        with b:
            values = [toy_module.toy_func() for _ in range(2)]
        values.append(toy_module.toy_func())
    assert a.data_buffer == values
    assert b.data_buffer == [values[1]]
    first, second = (a, b) if order == "fifo" else (b, a)
    first.release()
    assert toy_module.toy_func is not ORIGINAL_TOY_FUNC  # the other still records
    with second:
        value = toy_module.toy_func()
    assert second.data_buffer == [value]
    second.release()
    assert toy_module.toy_func is ORIGINAL_TOY_FUNC
    assert active_patches() == []


def test_exception_inside_context_then_release_restores() -> None:
    rec = FunctionInputsRecorder("helpers.toy.raises").initialize()
    with pytest.raises(ValueError, match="bad input 3"), rec:
        toy_module.raises(3)
    assert not rec.recording
    assert tuple(rec.get_record_data()) == (3,)  # inputs are recorded before the call
    rec.release()
    assert active_patches() == []
    with pytest.raises(ValueError, match="bad input 4"):
        toy_module.raises(4)


def test_function_bound_under_another_module_is_explained() -> None:
    # uses_double calls toy_module.double; recording 'torch' paths is unrelated. Recording the
    # function where it is *defined* but called through another reference finds nothing.
    ref = toy_module.double
    rec = FunctionOutputsRecorder("helpers.toy.double").initialize()
    with rec:
        ref(torch.ones(1))
    with pytest.raises(NoRecordError, match="the module that uses the function"):
        rec.get_record_data()
    rec.release()


def test_an_empty_function_recorder_names_the_modules_that_hold_the_function() -> None:
    """A function imported into another module under its own name is called through that
    reference: the error for an empty record names the modules that hold one."""
    holder = types.ModuleType("lr_test_holder")
    holder.double = toy_module.double  # as `from helpers.toy import double` would
    sys.modules[holder.__name__] = holder
    try:
        rec = FunctionOutputsRecorder("helpers.toy.double").initialize()
        with rec:
            holder.double(torch.ones(1))
        held = r"hold it under their own name: .*'lr_test_holder.double'"
        with pytest.raises(NoRecordError, match=held):
            rec.get_record_data()
        rec.release()
    finally:
        del sys.modules[holder.__name__]


def test_release_is_idempotent_and_reinitialize_works() -> None:
    rec = FunctionOutputsRecorder("helpers.toy.toy_func").initialize()
    rec.release()
    rec.release()
    rec.initialize()
    rec.initialize()  # no second patch
    with rec:
        toy_module.toy_func()
    assert len(rec.data_buffer) == 1
    rec.release()
    assert toy_module.toy_func is ORIGINAL_TOY_FUNC


@pytest.mark.parametrize(
    ("cls", "source", "match"),
    [
        (FunctionOutputsRecorder, "toy_func", r"dotted path such as 'pkg.module.func'"),
        (FunctionOutputsRecorder, "no_such_pkg.func", r"no prefix of it imports"),
        (
            FunctionOutputsRecorder,
            "helpers.toy.toy_fnc",
            r"no function 'toy_fnc'.*'toy_func'",
        ),
        (
            FunctionOutputsRecorder,
            "helpers.toy.CONSTANT",
            r"to be a function but it is a int",
        ),
        (FunctionOutputsRecorder, "helpers.toy.Toy", r"it is a type.*'MethodOutputs'"),
        (FunctionOutputsRecorder, "helpers.toy.Toy.scale", r"MethodOutputsRecorder"),
        # A misspelt module is named as such, not taken for a class holding a method.
        (
            FunctionOutputsRecorder,
            "helpers.tyo.toy_func",
            r"^Source 'helpers.tyo.toy_func': helpers has no module or attribute 'tyo'.*'toy'",
        ),
        (FunctionOutputsRecorder, "helpers.toy.double.x", r"inside module 'helpers.toy'[^M]*$"),
        (
            MethodOutputsRecorder,
            "helpers.tyo.Toy.scale",
            r"helpers has no module or class 'tyo'.*'toy'",
        ),
        (MethodOutputsRecorder, "helpers.toy.toy_func", r"name a method of a class"),
        (MethodOutputsRecorder, "helpers.toy.Toy.scal", r"no method 'scal'.*'scale'"),
        (
            MethodOutputsRecorder,
            "helpers.toy.Toy.prop",
            r"to be a method but it is a property",
        ),
        (MethodOutputsRecorder, "helpers.toy.add.x", r"to be a class but it is a function"),
    ],
)
def test_invalid_sources(cls: type, source: str, match: str) -> None:
    rec = cls(source)
    with pytest.raises(InvalidSourceError, match=match):
        rec.initialize()
    assert active_patches() == []
    assert not rec.initialized


def test_inputs_path_is_checked_by_initialize() -> None:
    # A path that names no argument fails at initialize, as for module inputs, not in the call.
    cases = [
        (FunctionInputsRecorder, "helpers.toy.double", "y", r"double\(x\) but got 'y'.*'x'"),
        (MethodInputsRecorder, "helpers.toy.Toy.scale", "factr", r"'factr'.*'factor'"),
        (MethodInputsRecorder, "helpers.toy.Toy.scale", 2, r"position below 2"),
        (MethodInputsRecorder, "helpers.toy.Toy.static", "self", r"static\(x\)"),
    ]
    for cls, source, path, match in cases:
        rec = cls(source, path=path)
        with pytest.raises(RecorderConfigError, match=match):
            rec.initialize()
        assert not rec.initialized and active_patches() == []
    # Names and positions a record can have pass: `*rest` items, `**extra` keys.
    for path in ("scale", "rest[1]", 4, "anything"):
        FunctionInputsRecorder("helpers.toy.add", path=path).initialize().release()
    factor = MethodInputsRecorder("helpers.toy.Toy.scale", path="factor").initialize()
    with factor:
        toy_module.Toy().scale(1.0, 3.0)
    assert factor.data_buffer == [3.0]
    factor.release()


def test_reading_before_initialize() -> None:
    rec = FunctionOutputsRecorder("helpers.toy.toy_func")
    with pytest.raises(NotInitializedError, match=r"call `initialize\(model\)` first"):
        rec.get_record_data()
    with pytest.raises(NotInitializedError, match="is not initialized"), rec:
        pass


def test_keyword_named_like_a_positional_only_parameter_keeps_both() -> None:
    from lightning_recorder._core.structures import Binder

    def f(a: int, /, **kw: int) -> None:
        return None

    record = Binder(f)((1,), {"a": 2})
    assert record.names == ("a", "kw['a']")
    assert record.as_dict() == {"a": 1, "kw['a']": 2}


def test_patch_lives_only_inside_the_context_by_default() -> None:
    rec = FunctionOutputsRecorder("helpers.toy.toy_func").initialize()
    assert toy_module.toy_func is ORIGINAL_TOY_FUNC  # initialize only resolves the path
    assert active_patches() == []
    with rec:
        assert toy_module.toy_func is not ORIGINAL_TOY_FUNC
        value = toy_module.toy_func()
    assert toy_module.toy_func is ORIGINAL_TOY_FUNC
    assert rec.data_buffer == [value]
    with pytest.raises(ValueError, match="bad input 1"), rec:  # restored on an error too
        toy_module.raises(1)
    assert toy_module.toy_func is ORIGINAL_TOY_FUNC
    rec.release()


def test_persistent_patch_from_initialize_to_release() -> None:
    rec = MethodOutputsRecorder("helpers.toy.Toy.toy_func", persistent=True).initialize()
    assert toy_module.Toy.__dict__["toy_func"] is not ORIGINAL_METHOD
    with rec:
        value = toy_module.Toy().toy_func()
    toy_module.Toy().toy_func()  # outside the context: patched but inert
    assert toy_module.Toy.__dict__["toy_func"] is not ORIGINAL_METHOD
    assert rec.data_buffer == [value]
    rec.release()
    assert toy_module.Toy.__dict__["toy_func"] is ORIGINAL_METHOD


def test_persistent_must_be_a_bool() -> None:
    from lightning_recorder import RecorderConfigError

    with pytest.raises(RecorderConfigError, match="`persistent` to be a bool but got str"):
        FunctionOutputsRecorder("helpers.toy.toy_func", persistent="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("persistent", [False, True])
def test_copies_are_fresh_recorders(persistent: bool) -> None:
    import copy
    import pickle

    rec = FunctionInputsRecorder("helpers.toy.add", persistent=persistent, keep="last")
    rec.initialize()
    with rec:
        toy_module.add(1.0)
    copies = [copy.deepcopy(rec), pickle.loads(pickle.dumps(rec))]
    try:
        for dup in copies:
            assert type(dup) is FunctionInputsRecorder
            assert (dup.source, dup.keep, dup.persistent) == ("helpers.toy.add", "last", persistent)
            # A non-persistent copy is ready (it patches only in its context); a persistent
            # copy installs nothing until initialized.
            assert dup.initialized is not persistent
            dup.initialize()
            with dup:
                toy_module.add(2.0)
            assert dup.get_record_data(data_idx="a") == 2.0
            dup.release()
        assert rec.get_record_data(data_idx="a") == 1.0  # the original is untouched
    finally:
        for dup in copies:
            dup.release()
        rec.release()
    assert active_patches() == []


def test_torch_c_functions_are_normalised_like_python_functions() -> None:
    x, w, b = torch.randn(2, 3), torch.randn(4, 3), torch.randn(4)
    relu = FunctionInputsRecorder("torch.relu").initialize()
    linear = FunctionInputsRecorder("torch.nn.functional.linear").initialize()
    try:
        with relu, linear:
            torch.relu(x)
            torch.relu(input=x)
            torch.nn.functional.linear(x, w, b)
            torch.nn.functional.linear(x, w, bias=b)
            torch.nn.functional.linear(bias=b, weight=w, input=x)
            torch.nn.functional.linear(x, w)  # the schema's default fills in bias=None
        for i in range(2):
            record = relu.get_record_data(i)
            assert record.names == ("input",)
            assert record["input"] is x
        for i in range(3):
            record = linear.get_record_data(i)
            assert record.names == ("input", "weight", "bias")
            assert (record[0], record[1], record[2]) == (x, w, b)
        assert linear.get_record_data(3).as_dict() == {"input": x, "weight": w, "bias": None}
    finally:
        relu.release()
        linear.release()


def test_binder_overloads_and_callables_without_signature() -> None:
    from lightning_recorder._core.structures import Binder

    x = torch.ones(2, 3)
    total = Binder(torch.sum)  # overloads: sum(input, *, dtype) and sum(input, dim, keepdim, …)
    assert total((x, 1), {}).as_dict() == total((x,), {"dim": 1}).as_dict()
    assert total((x,), {}).names == ("input", "dtype")
    method = Binder(torch.Tensor.relu, drop_first=True)
    assert method((), {}).names == ()
    # A builtin with neither a signature nor a schema: positions, then sorted keywords.
    assert Binder(max)((3, 1), {"key": abs}).names == ("args[0]", "args[1]", "key")


def test_a_function_replaced_after_initialize_is_refused_not_run_as_its_old_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # importlib.reload (or a notebook cell run again) defines the function anew in its module.
    # Entering the recorder used to install a wrapper around the old function: inside the
    # context the program silently ran the code from before the reload.
    mod = types.ModuleType("reloaded_user_code")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    source = "def scale(x):\n    return x * {}\n\n\ndef f(x):\n    return scale(x) + 1\n"
    exec(source.format(2), mod.__dict__)
    rec = FunctionOutputsRecorder("reloaded_user_code.scale").initialize()
    exec(source.format(3), mod.__dict__)  # what a reload does: the module's code run again
    stale = r"'reloaded_user_code\.scale' .* replaced since .* release\(\) and then initialize"
    with pytest.raises(RecorderStateError, match=stale), rec:
        mod.f(torch.ones(1))
    assert not rec.recording and active_patches() == []
    assert mod.f(torch.ones(1)).item() == 4.0  # the new code, left in place
    rec.release()
    rec.initialize()
    with rec:
        out = mod.f(torch.ones(1))
    assert out.item() == 4.0 and rec.get_record_data().item() == 3.0
    rec.release()
