"""Module, parameter and gradient recorders: semantics, options, guarantees and errors."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_recorder import (
    ModuleInputGradsRecorder,
    ModuleInputsRecorder,
    ModuleOutputGradsRecorder,
    ModuleOutputsRecorder,
    NoRecordError,
    NotInitializedError,
    ParameterGradRecorder,
    ParameterRecorder,
    RecorderConfigError,
    RecorderManager,
    RecorderStateError,
    RecordModifiedError,
    UnknownSourceError,
)
from lightning_recorder._core.hooks import live_hooks
from lightning_recorder.bulk import ForwardOutputsCollector

ROOT = Path(__file__).resolve().parents[2]


class ToyModel(nn.Module):
    """MMRazor's documented toy model: conv1 is called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 1, 1)
        self.conv2 = nn.Conv2d(1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.conv1(x)
        x2 = self.conv1(x + 1)
        return self.conv2(x1 + x2)


def test_mmrazor_module_outputs_example() -> None:
    model = ToyModel()
    r1 = ModuleOutputsRecorder("conv1")
    r1.initialize(model)
    x = torch.randn(1, 1, 1, 1)
    with r1:
        model(x)
    assert len(r1.data_buffer) == 2
    assert torch.equal(r1.data_buffer[0], model.conv1(x))
    assert torch.equal(r1.data_buffer[1], model.conv1(x + 1))
    assert r1.data_buffer[0].grad_fn is not None  # attached to autograd by default
    r1.release()
    assert live_hooks() == []
    assert len(model.conv1._forward_hooks) == 0


def test_mmrazor_parameter_example() -> None:
    model = nn.Sequential(OrderedDict(toy_conv=nn.Conv2d(1, 1, 1)))
    r1 = ParameterRecorder("toy_conv.weight")
    r1.initialize(model)
    assert torch.equal(r1.data_buffer[0], model.toy_conv.weight)
    assert r1.data_buffer[0] is model.toy_conv.weight
    snap = ParameterRecorder("toy_conv.weight", clone=True).initialize(model)
    with snap, torch.no_grad():
        model.toy_conv.weight.add_(1.0)
    assert torch.equal(snap.get_record_data() + 1.0, model.toy_conv.weight)
    r1.release()
    snap.release()


def test_a_parameter_recorder_whose_first_record_fails_is_not_left_initialized() -> None:
    # ParameterRecorder records at initialize; a `path` the parameter lacks fails there, and
    # the recorder must not claim to be initialized, nor stay so inside a manager.
    model = nn.Sequential(nn.Linear(2, 2))
    rec = ParameterRecorder("0.weight", path="x")
    with pytest.raises(RecorderConfigError, match="`path` item 'x' does not exist"):
        rec.initialize(model)
    assert not rec.initialized
    with pytest.raises(NotInitializedError):
        rec.start()
    manager = RecorderManager(
        {
            "out": {"type": "ModuleOutputs", "source": "0"},
            "param": {"type": "Parameter", "source": "0.weight", "path": "x"},
        }
    )
    with pytest.raises(RecorderConfigError, match="`path` item 'x'"):
        manager.initialize(model)
    assert not any(r.initialized for r in manager.recorders.values())
    assert live_hooks() == []


def test_mmrazor_manager_example() -> None:
    from helpers import toy as toy_module

    class ToyModelWithMethod(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 1, 1)
            self.conv2 = nn.Conv2d(1, 1, 1)
            self.toy = toy_module.Toy()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv2(self.conv1(x)) + self.toy.toy_func()

    manager = RecorderManager(
        {
            "conv1_rec": {"type": "ModuleOutputs", "source": "conv1"},
            "conv2_rec": {"type": "ModuleOutputs", "source": "conv2"},
            "func_rec": {"type": "MethodOutputs", "source": "helpers.toy.Toy.toy_func"},
        }
    )
    model = ToyModelWithMethod()
    manager.initialize(model)
    x = torch.rand(1, 1, 1, 1)
    with manager:
        out = model(x)
    conv2_out = manager.get_recorder("conv2_rec").get_record_data()
    func_out = manager.get_recorder("func_rec").get_record_data()
    assert torch.equal(out, conv2_out + func_out)
    manager.release()


def test_k_calls_give_k_records_in_order_and_fresh_buffers() -> None:
    lin = nn.Linear(2, 2)
    model = nn.Sequential(OrderedDict(lin=lin))
    rec = ModuleOutputsRecorder("lin").initialize(model)
    xs = [torch.randn(1, 2) for _ in range(3)]
    lin(xs[0])  # outside: not recorded
    with rec:
        for x in xs:
            lin(x)
    assert [torch.equal(r, lin(x)) for r, x in zip(rec.data_buffer, xs, strict=True)] == [True] * 3
    with rec:
        lin(xs[0])
    assert len(rec.data_buffer) == 1
    rec.reset_data_buffer()
    assert rec.data_buffer == []
    rec.release()


def test_initialize_twice_adds_no_second_hook_and_moves_between_models() -> None:
    a, b = ToyModel(), ToyModel()
    rec = ModuleOutputsRecorder("conv2")
    rec.initialize(a)
    rec.initialize(a)
    assert len(a.conv2._forward_hooks) == 1
    rec.initialize(b)
    assert len(a.conv2._forward_hooks) == 0 and len(b.conv2._forward_hooks) == 1
    rec.release()


def test_release_after_exception_in_forward() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin(x)
            raise RuntimeError("boom")

    model = Boom()
    manager = RecorderManager(
        {
            "o": {"type": "ModuleOutputs", "source": "lin"},
            "i": {"type": "ModuleInputs", "source": "lin"},
        }
    )
    manager.initialize(model)
    with pytest.raises(RuntimeError, match="boom"), manager:
        model(torch.randn(1, 2))
    assert not manager.recording
    assert len(manager.get_recorder("o").data_buffer) == 1
    manager.release()
    assert live_hooks() == []


def test_inplace_modification_detected_and_clone_avoids_it() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.ReLU(inplace=True))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    plain = ModuleOutputsRecorder("0").initialize(model)
    cloned = ModuleOutputsRecorder("0", clone=True).initialize(model)
    x = torch.linspace(-1.0, 1.0, 18).view(2, 1, 3, 3)
    with plain, cloned:
        model(x)
    with pytest.raises(RecordModifiedError, match=r"modified in place.*clone=True"):
        plain.get_record_data()
    with pytest.raises(RecordModifiedError, match="ReLU"):
        _ = plain.data_buffer
    assert torch.allclose(cloned.get_record_data(), model[0](x))
    assert (cloned.get_record_data() < 0).any()
    plain.release()
    cloned.release()


def test_model_pickles_and_deep_copies_after_recording() -> None:
    model = ToyModel()
    manager = RecorderManager(
        {
            "out": {"type": "ModuleOutputs", "source": "conv1"},
            "inp": {"type": "ModuleInputs", "source": "conv2"},
            "grad": {"type": "ModuleOutputGrads", "source": "conv2"},
        }
    )
    manager.initialize(model)
    with manager:
        model(torch.randn(1, 1, 2, 2)).sum().backward()
    clone = copy.deepcopy(model)
    restored = pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    for other in (clone, restored):
        out = other(torch.randn(1, 1, 2, 2))  # the copies' hooks are inert
        assert out.shape == (1, 1, 2, 2)
    assert len(manager.get_recorder("out").data_buffer) == 2  # the copies did not record
    manager.release()


def test_a_model_holding_records_of_a_forward_with_gradients_copies_them_detached() -> None:
    # An EMA copy of a model that holds its manager, taken in a training step: the records
    # carry the step's graph, which cannot be copied (deepcopy raised torch's "Only Tensors
    # created explicitly by the user" error). The copy gets their values, detached.
    model = ToyModel()
    manager = RecorderManager(
        {
            "out": {"type": "ModuleOutputs", "source": "conv1"},
            "inp": {"type": "ModuleInputs", "source": "conv2"},
        }
    )
    manager.initialize(model)
    with manager:
        model(torch.randn(1, 1, 2, 2))
    holder = nn.ModuleDict({"model": model})
    holder.manager = manager  # a plain attribute
    original = manager.get_recorder("out").get_record_data()
    assert original.grad_fn is not None
    for copied in (copy.deepcopy(holder), pickle.loads(pickle.dumps(holder))):
        for name in ("out", "inp"):
            record = copied.manager.get_recorder(name).get_record_data()
            record = record if isinstance(record, torch.Tensor) else record[0]
            expected = manager.get_recorder(name).get_record_data()
            expected = expected if isinstance(expected, torch.Tensor) else expected[0]
            assert record.grad_fn is None
            torch.testing.assert_close(record, expected.detach(), rtol=0, atol=0)  # a copy
    assert manager.get_recorder("out").get_record_data() is original  # the original keeps it
    manager.release()


class _Holding(nn.Module):
    """A model that holds the recorder of its own layer (as a LightningModule may)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 2))
        self.rec = ModuleOutputsRecorder("net.0").initialize(self)


def test_a_copied_recorder_reads_its_own_records() -> None:
    # The streams of a deep-copied or unpickled recorder answer for the copy, not for a
    # half-built third recorder (which raised AttributeError).
    model = _Holding()
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        rec = copied.rec
        with pytest.raises(NoRecordError, match=r"has recorded nothing for 'net\.0' yet"):
            rec.get_record_data()
    model.rec.release()


def test_a_copied_recorder_keeps_which_records_were_modified_in_place() -> None:
    # Copied tensors count their versions afresh: a record read as modified in the copy only
    # when it was modified before the copy, or is modified in the copy.
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True), nn.Linear(2, 2))
    kept = ModuleOutputsRecorder("2").initialize(model)
    changed = ModuleOutputsRecorder("0").initialize(model)  # the ReLU after it writes into it
    with kept, changed, torch.no_grad():
        model(torch.randn(3, 2))
    for rec, copied in (
        (r, c) for r in (kept, changed) for c in (copy.deepcopy(r), pickle.loads(pickle.dumps(r)))
    ):
        if rec is changed:
            with pytest.raises(RecordModifiedError, match=r"Record 0 of .*ReLU\(inplace=True\)"):
                copied.get_record_data()
            continue
        record = copied.get_record_data()
        torch.testing.assert_close(record, rec.get_record_data())
        record.add_(1.0)
        with pytest.raises(RecordModifiedError, match=r"Record 0 of .* modified in place"):
            copied.get_record_data()
    assert kept.get_record_data().shape == (3, 2)  # the original is untouched
    kept.release()
    changed.release()


@pytest.mark.parametrize(
    "options",
    [{"detach": True}, {"clone": True}, {"dtype": "float16"}, {"device": "cpu", "clone": True}],
)
def test_a_model_holding_a_recorder_with_options_pickles(options: dict[str, Any]) -> None:
    # ddp_spawn and worker processes pickle the model, and with it the recorders it holds.
    model = _Holding()
    model.rec.release()
    model.rec = ModuleOutputsRecorder("net.0", **options).initialize(model)
    with model.rec, torch.no_grad():
        model.net(torch.ones(1, 2))
    restored = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(restored.rec.get_record_data(), model.rec.get_record_data())
    collector = ForwardOutputsCollector(**options).children(model.net)
    model.net(torch.ones(1, 2))
    collector.release()
    torch.testing.assert_close(pickle.loads(pickle.dumps(collector))[0], collector[0])
    model.rec.release()


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    extra: torch.Tensor | None = None


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Output:
        h = self.lin(x)
        return Output(logits=h * 2, hidden=(h, h + 1), extra=None)


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Structured()
        self.other = nn.Identity()

    def forward(self, x: torch.Tensor) -> Output:
        return self.block(x, mask=torch.ones(1))


@pytest.mark.parametrize(
    ("path", "expect"),
    [
        ("logits", lambda o: o.logits),
        ("hidden.1", lambda o: o.hidden[1]),
        (("hidden", 0), lambda o: o.hidden[0]),
    ],
)
def test_path_into_dataclass_outputs(path: object, expect: object) -> None:
    model = Holder()
    rec = ModuleOutputsRecorder("block", path=path).initialize(model)  # type: ignore[arg-type]
    with rec:
        out = model(torch.randn(2, 3))
    assert torch.equal(rec.get_record_data(), expect(out))  # type: ignore[operator]
    rec.release()


def test_path_errors_name_what_exists() -> None:
    model = Holder()
    rec = ModuleOutputsRecorder("block", path="hiden").initialize(model)
    with (
        pytest.raises(RecorderConfigError, match=r"'hiden' does not exist.*fields logits, hidden"),
        rec,
    ):
        model(torch.randn(2, 3))
    rec.release()


def test_inputs_with_kwargs_and_argument_path() -> None:
    model = Holder()
    rec = ModuleInputsRecorder("block").initialize(model)
    mask = ModuleInputsRecorder("block", path="mask").initialize(model)
    x = torch.randn(2, 3)
    with rec, mask:
        model(x)
        model.block(x, torch.ones(1))
    first, second = rec.data_buffer
    assert first.names == ("x", "mask") and second.names == ("x", "mask")
    assert first[0] is x and torch.equal(first["mask"], torch.ones(1))
    assert rec.get_record_data(0, data_idx="mask") is first[1]
    assert torch.equal(mask.get_record_data(1), torch.ones(1))
    rec.release()
    mask.release()


class Concat(nn.Module):
    def forward(self, *parts: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat(parts, dim)


def test_inputs_path_names_an_item_of_var_positional_arguments() -> None:
    # A `*parts` item's record name ("parts[1]") is a valid `path`, as the record shows it.
    model = nn.Sequential(Concat())
    second = ModuleInputsRecorder("0", path="parts[1]").initialize(model)
    a, b = torch.ones(2), torch.zeros(3)
    with second:
        model[0](a, b)
    assert second.get_record_data() is b
    second.release()
    with pytest.raises(RecorderConfigError, match=r"got 'part\[1\]'.*'parts\[0\]'"):
        ModuleInputsRecorder("0", path="part[1]").initialize(model)
    # The gradient recorder finds an input by position or parameter name only.
    with pytest.raises(RecorderConfigError, match=r"got 'parts\[1\]'"):
        ModuleInputGradsRecorder("0", path="parts[1]").initialize(model)
    assert not model[0]._forward_pre_hooks


def test_hugging_face_model_output_fields() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import BaseModelOutput

    class HF(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> object:
            h = self.enc(x)
            return BaseModelOutput(last_hidden_state=h, hidden_states=(x, h))

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = HF()

        def forward(self, x: torch.Tensor) -> object:
            return self.model(x)

    assert transformers.__version__
    net = Wrap()
    last = ModuleOutputsRecorder("model", path="last_hidden_state").initialize(net)
    states = ModuleOutputsRecorder("model", path="hidden_states.0", detach=True).initialize(net)
    whole = ModuleOutputsRecorder("model", detach=True).initialize(net)
    x = torch.randn(2, 4)
    with last, states, whole:
        out = net(x)
    assert torch.equal(last.get_record_data(), out.last_hidden_state)
    assert torch.equal(states.get_record_data(), x)
    assert type(whole.get_record_data()).__name__ == "BaseModelOutput"
    assert whole.get_record_data().last_hidden_state.grad_fn is None
    for rec in (last, states, whole):
        rec.release()


def test_detach_device_dtype_options() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    rec = ModuleOutputsRecorder("0", detach=True, device="cpu", dtype="float64").initialize(model)
    with rec:
        out = model(torch.randn(1, 2))
    record = rec.get_record_data()
    assert record.dtype == torch.float64 and record.grad_fn is None
    assert torch.allclose(record, out.double())
    rec.release()


@pytest.mark.parametrize(
    ("keep", "expected"), [("all", [0, 1, 2, 3]), ("first", [0]), ("last", [3]), (2, [0, 1])]
)
def test_keep_option(keep: object, expected: list[int]) -> None:
    model = nn.Sequential(nn.Identity())
    rec = ModuleOutputsRecorder("0", keep=keep).initialize(model)  # type: ignore[arg-type]
    with rec:
        for i in range(4):
            model(torch.tensor(float(i)))
    assert [int(r) for r in rec.data_buffer] == expected
    assert rec.streams["0"].num_calls == 4
    rec.release()


def test_pattern_and_type_selection_give_named_streams() -> None:
    model = nn.Sequential(
        OrderedDict(
            features=nn.Sequential(nn.Conv2d(1, 2, 1), nn.ReLU(), nn.Conv2d(2, 2, 1)),
            head=nn.Linear(2, 2),
        )
    )
    by_glob = ModuleOutputsRecorder("features.*").initialize(model)
    by_type = ModuleOutputsRecorder(nn.Conv2d).initialize(model)
    by_name = ModuleOutputsRecorder("torch.nn.Conv2d").initialize(model)
    by_types = ModuleOutputsRecorder((nn.Conv2d, nn.Linear)).initialize(model)
    assert list(by_glob.streams) == ["features.0", "features.1", "features.2"]
    assert list(by_type.streams) == ["features.0", "features.2"]
    assert list(by_name.streams) == ["features.0", "features.2"]
    assert list(by_types.streams) == ["features.0", "features.2", "head"]
    x = torch.randn(1, 1, 2, 2)
    with by_glob:
        model.features(x)
    assert torch.equal(by_glob.get_record_data(source="features.0"), model.features[0](x))
    with pytest.raises(RecorderStateError, match=r"records 3 sources.*streams\[name\]"):
        _ = by_glob.data_buffer
    with pytest.raises(RecorderConfigError, match=r"no stream 'features.3'.*'features.0'"):
        by_glob.get_record_data(source="features.3")
    # A stream is named by a str: an int or a list is told so (a list raised a TypeError).
    for wrong in (0, ["features.0"]):
        with pytest.raises(RecorderConfigError, match=r"stream .*a str: 'features.0'.* but got"):
            by_glob.get_record_data(source=wrong)  # type: ignore[arg-type]
    for rec in (by_glob, by_type, by_name, by_types):
        rec.release()


def test_wrapper_prefixes_are_ignored() -> None:
    inner = ToyModel()

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    wrapped = Wrapper()
    rec = ModuleOutputsRecorder("conv2").initialize(wrapped)
    prefixed = ModuleOutputsRecorder("module.conv2").initialize(wrapped)
    with rec, prefixed:
        out = wrapped(torch.randn(1, 1, 1, 1))
    assert torch.equal(rec.get_record_data(), out)
    assert torch.equal(prefixed.get_record_data(), out)
    rec.release()
    prefixed.release()


def test_fabric_setup_model_names_resolve() -> None:
    # `fabric.setup` wraps the model in a module whose child is `_forward_module`: "conv2" was
    # an UnknownSourceError suggesting "_forward_module.conv2"
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = ToyModel()
    wrapped = fabric.setup_module(model)
    manager = RecorderManager(
        {
            "out": {"type": "ModuleOutputs", "source": "conv2"},
            "weight": {"type": "ParameterGrad", "source": "conv1.weight"},
        }
    )
    manager.initialize(wrapped)
    assert list(manager.get_recorder("out").streams) == ["conv2"]
    with manager:
        out = wrapped(torch.randn(1, 1, 1, 1))
        fabric.backward(out.sum())
    assert torch.equal(manager.get_recorder("out").get_record_data(), out)
    assert torch.equal(manager.get_recorder("weight").get_record_data(), model.conv1.weight.grad)
    manager.release()


def test_compiled_model_names_resolve() -> None:
    model = ToyModel()
    compiled = torch.compile(model, backend="eager")
    rec = ModuleOutputsRecorder("conv2").initialize(compiled)
    with rec:
        out = compiled(torch.randn(1, 1, 1, 1))
    assert torch.allclose(rec.get_record_data(), out)
    rec.release()


def test_fullgraph_compile_of_a_hooked_model_fails_as_the_docs_say() -> None:
    """The pages said that a monitored compiled model trains as the unmonitored one does;
    with ``fullgraph=True`` it fails at its first call (the hooks' records are a graph break),
    which the monitor's page and the troubleshooting page now say, with the way out."""
    torch.compiler.reset()  # no code compiled for ToyModel earlier (without fullgraph) reused
    model = ToyModel()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    rec = ModuleOutputsRecorder("conv2").initialize(compiled)
    try:
        with rec, pytest.raises(Exception) as raised:
            compiled(torch.randn(1, 1, 1, 1))
    finally:
        rec.release()
        torch.compiler.reset()
    assert type(raised.value).__name__ == "Unsupported"
    docs = ROOT / "docs"
    monitor = (docs / "feature_stats_monitor.md").read_text().split("## Compiled models", 1)[1]
    assert "`torch.compile(..., fullgraph=True)`" in monitor.split("\n## ", 1)[0]
    assert '"Unsupported: …" from dynamo' in (docs / "troubleshooting.md").read_text()


def test_activation_checkpoint_recomputation_not_double_counted() -> None:
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model = nn.Sequential(OrderedDict(block=block, head=nn.Linear(4, 1)))
    rec = ModuleOutputsRecorder("block.0").initialize(model)
    for use_reentrant in (False, True):
        x = torch.randn(3, 4, requires_grad=True)
        with rec:
            h = checkpoint(block, x, use_reentrant=use_reentrant)
            model.head(h).sum().backward()
        assert len(rec.data_buffer) == 1, use_reentrant
    rec.release()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_recorders_inside_activation_checkpoint(use_reentrant: bool) -> None:
    """One gradient per call of a checkpointed module, the one autograd gives, in both kinds of
    checkpoint (a reentrant one runs its forward without autograd, then again in backward)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4))
    model = nn.Sequential(OrderedDict(block=block, head=nn.Linear(4, 1)))
    out_grad = ModuleOutputGradsRecorder("block.0").initialize(model)
    in_grad = ModuleInputGradsRecorder("block.2").initialize(model)
    x = torch.randn(5, 3, requires_grad=True)
    with out_grad, in_grad:
        model.head(checkpoint(block, x, use_reentrant=use_reentrant)).sum().backward()
    assert len(out_grad.data_buffer) == len(in_grad.data_buffer) == 1
    h = block[0](x)
    a = torch.tanh(h)
    want_h, want_a = torch.autograd.grad(model.head(block[2](a)).sum(), (h, a))
    torch.testing.assert_close(out_grad.get_record_data(), want_h, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(in_grad.get_record_data(), want_a, rtol=1e-6, atol=1e-7)
    out_grad.release()
    in_grad.release()


def test_a_gradient_accumulated_into_afterwards_is_reported_with_its_cause() -> None:
    """The gradient of a leaf input becomes its `.grad`; a later backward adds to it in place,
    and the error says so (not an in-place operation of the forward)."""
    model = nn.Sequential(nn.Linear(2, 2))
    in_grad = ModuleInputGradsRecorder("0").initialize(model)
    x = torch.randn(3, 2, requires_grad=True)
    with in_grad:
        model(x).sum().backward()
    model(x).sum().backward()  # accumulates into x.grad
    with pytest.raises(RecordModifiedError, match=r"later backward accumulates.*clone=True") as err:
        in_grad.get_record_data()
    assert "ReLU" not in str(err.value)
    in_grad.release()


def test_gradient_recorders_match_autograd() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    out_grad = ModuleOutputGradsRecorder("0").initialize(model)
    in_grad = ModuleInputGradsRecorder("2").initialize(model)
    param_grad = ParameterGradRecorder("*.weight").initialize(model)
    x = torch.randn(5, 3)
    with out_grad, in_grad, param_grad:
        model(x).pow(2).sum().backward()
    # Reference by hand.
    ref = [p.grad.clone() for p in (model[0].weight, model[2].weight)]  # type: ignore[union-attr]
    model.zero_grad()
    h = model[0](x)
    h.retain_grad()
    a = torch.relu(h)
    a.retain_grad()
    model[2](a).pow(2).sum().backward()
    assert torch.allclose(out_grad.get_record_data(), h.grad)  # type: ignore[arg-type]
    assert torch.allclose(in_grad.get_record_data(), a.grad)  # type: ignore[arg-type]
    assert torch.allclose(param_grad.get_record_data(source="0.weight"), ref[0])
    assert torch.allclose(param_grad.get_record_data(source="2.weight"), ref[1])
    for rec in (out_grad, in_grad, param_grad):
        rec.release()


def test_input_grad_is_the_part_through_this_module() -> None:
    class Fork(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 1)
            self.b = nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) + 3 * self.b(x)

    model = Fork()
    rec = ModuleInputGradsRecorder("a").initialize(model)
    x = torch.randn(4, 2, requires_grad=True)
    with rec:
        model(x).sum().backward()
    assert torch.allclose(rec.get_record_data(), model.a.weight.expand(4, 2))
    rec.release()


def test_gradients_need_backward_inside_context() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    rec = ModuleOutputGradsRecorder("0").initialize(model)
    with rec:
        out = model(torch.randn(1, 2))
    out.sum().backward()
    with pytest.raises(NoRecordError, match=r"inside the same context"):
        rec.get_record_data()
    rec.release()


def test_grad_of_structured_output_requires_path() -> None:
    model = Holder()
    rec = ModuleOutputGradsRecorder("block").initialize(model)
    with pytest.raises(RecorderConfigError, match=r"holds 3 tensors; choose one with `path`"), rec:
        model(torch.randn(2, 3))
    rec.release()


def test_parameter_grad_accumulation_records_each_backward() -> None:
    model = nn.Sequential(nn.Linear(2, 1, bias=False))
    rec = ParameterGradRecorder("0.weight").initialize(model)
    x = torch.ones(1, 2)
    with rec:
        model(x).sum().backward()
        model(x).sum().backward()
    first, second = rec.data_buffer
    assert torch.equal(second, 2 * first)
    rec.release()


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: ModuleOutputsRecorder("conv3"), r"No module named 'conv3'.*'conv1'"),
        (lambda: ModuleOutputsRecorder("conv*x"), r"pattern 'conv\*x' matches no module"),
        (lambda: ModuleOutputsRecorder(nn.LSTM), r"No module of type LSTM.*Conv2d"),
        (lambda: ParameterRecorder("conv1.weigth"), r"No parameter named.*'conv1.weight'"),
        (lambda: ParameterGradRecorder("conv9.bias"), r"No parameter named 'conv9.bias'"),
    ],
)
def test_unknown_names_list_closest(factory: object, match: str) -> None:
    rec = factory()  # type: ignore[operator]
    with pytest.raises(UnknownSourceError, match=match):
        rec.initialize(ToyModel())
    assert live_hooks() == []


class _Tied(nn.Module):
    """An embedding tied to the output layer, and one block registered under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight
        self.block = nn.Linear(4, 4)
        self.again = self.block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.again(self.block(self.emb(x))))


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: ParameterRecorder("head.weight"), r"second name of the parameter 'emb.weight'"),
        (lambda: ParameterGradRecorder("head.weight"), r"Record 'emb.weight'"),
        (lambda: ModuleOutputsRecorder("again"), r"second name of the module 'block'"),
        # A pattern that matches second names only says so, and which names to use.
        (
            lambda: ParameterRecorder("head.*"),
            r"'head.\*' matches no name in named_parameters\(\), only second names .*"
            r"'head.weight' \(listed as 'emb.weight'\)",
        ),
        (lambda: ParameterRecorder(r"re:he.d\..*"), r"'head.weight' \(listed as 'emb.weight'\)"),
        (
            lambda: ModuleOutputsRecorder("aga*"),
            r"'aga\*' matches no name in named_modules\(\).*'again' \(listed as 'block'\)",
        ),
    ],
)
def test_a_second_name_of_a_shared_object_names_the_one_to_record(
    factory: object, match: str
) -> None:
    rec = factory()  # type: ignore[operator]
    with pytest.raises(UnknownSourceError, match=match):
        rec.initialize(_Tied())
    assert live_hooks() == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source": ""}, r"root module itself cannot be recorded"),
        ({"source": "conv1", "keep": 0}, r"Expected `keep` to be 'all', 'first', 'last'"),
        ({"source": "conv1", "dtype": "float17"}, r"Expected `dtype` to be a torch.dtype"),
        # Casting a float record to an integer or bool dtype would truncate it.
        ({"source": "conv1", "dtype": torch.int8}, r"floating-point dtype .* got torch.int8"),
        ({"source": "conv1", "dtype": "bool"}, r"floating-point dtype .* got torch.bool"),
        ({"source": "conv1", "device": "gpu9"}, r"Expected `device` to be a torch.device"),
        ({"source": "conv1", "clone": "yes"}, r"Expected `clone` to be a bool"),
        ({"source": "conv1", "path": 1.5}, r"Expected `path` to be an int, a str"),
    ],
)
def test_bad_options(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        ModuleOutputsRecorder(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("source", [None, 3, [nn.Conv2d]])
def test_a_source_of_a_wrong_type_is_named_with_what_is_expected(source: object) -> None:
    with pytest.raises(
        RecorderConfigError, match=r"\(or a tuple of nn.Module types\) but got"
    ) as err:
        ModuleOutputsRecorder(source)  # type: ignore[arg-type]
    assert type(source).__name__ in str(err.value) and "root module" not in str(err.value)


@pytest.mark.parametrize("recorder", [ModuleOutputsRecorder, ModuleInputsRecorder])
@pytest.mark.parametrize("source", ["1", "*", "re:.*"])
def test_a_scripted_module_is_refused_by_name_before_any_hook(
    recorder: type[ModuleOutputsRecorder], source: str
) -> None:
    model = nn.Sequential(nn.Linear(3, 3), torch.jit.script(nn.Linear(3, 3)), nn.Linear(3, 3))
    with pytest.raises(
        RecorderConfigError,
        match=rf"the source '{re.escape(source)}' selects to take hooks but '1' is a scripted "
        r"module \(torch\.jit\.script\), on which torch allows no hooks\. Record the module "
        "before scripting it",
    ):
        recorder(source).initialize(model)
    assert live_hooks() == [] and not model[0]._forward_hooks and not model[0]._forward_pre_hooks
    rec = recorder(nn.Linear).initialize(model)  # a type leaves the scripted module out
    assert list(rec.streams) == ["0", "2"]
    rec.release()


def test_initialize_needs_a_model_and_reading_needs_initialize() -> None:
    rec = ModuleOutputsRecorder("conv1")
    with pytest.raises(NotInitializedError, match="has not been initialized"):
        _ = rec.data_buffer
    with pytest.raises(
        RecorderConfigError, match=r"expected `initialize\(model\)` with an nn.Module"
    ):
        rec.initialize()
    rec.initialize(ToyModel())
    with pytest.raises(NoRecordError, match=r"recorded nothing for 'conv1' yet.*only inside"):
        rec.get_record_data()
    with rec:
        pass
    with pytest.raises(NoRecordError, match=r"never called by the forward"):
        rec.get_record_data()
    rec.release()


def test_record_and_data_index_errors() -> None:
    model = ToyModel()
    rec = ModuleOutputsRecorder("conv1").initialize(model)
    inputs = ModuleInputsRecorder("conv1").initialize(model)
    with rec, inputs:
        model(torch.randn(1, 1, 1, 1))
    assert torch.equal(rec.get_record_data(-1), rec.data_buffer[1])
    with pytest.raises(NoRecordError, match=r"`record_idx` in \[-2, 1\] but got 2.*2 record"):
        rec.get_record_data(2)
    with pytest.raises(NoRecordError, match=r"`data_idx` to index record 0.*Arguments of length 1"):
        inputs.get_record_data(0, data_idx=3)
    with pytest.raises(
        NoRecordError,
        match=r"got 'inputs'. Valid: an int in \[-1, 0\] or an argument name, 'input'",
    ):
        inputs.get_record_data(0, data_idx="inputs")
    with pytest.raises(NoRecordError, match=r"got 5. Valid: an int in \[-1, 0\]\.$"):
        rec.get_record_data(0, data_idx=5)
    with pytest.raises(IndexError):  # NoRecordError is also an IndexError
        rec.get_record_data(5)
    with pytest.raises(RecorderStateError, match="do not nest"), rec, rec:
        pass
    rec.release()
    inputs.release()


def test_records_free_with_the_buffer() -> None:
    import weakref

    model = nn.Sequential(nn.Linear(2, 2))
    rec = ModuleOutputsRecorder("0").initialize(model)
    with rec:
        model(torch.randn(1, 2))
    ref = weakref.ref(rec.get_record_data())
    rec.reset_data_buffer()
    assert ref() is None
    rec.release()


def test_messages_about_a_value_or_a_group_read_as_english() -> None:
    # "which is a int", "which is a arguments (...)" and "records 1 sources" before
    model = nn.Sequential(nn.Linear(2, 2))
    group = ModuleOutputsRecorder(nn.Linear).initialize(model)
    with pytest.raises(RecorderStateError, match=r"records 1 source \('0'\); read one"):
        _ = group.data_buffer
    inputs = ModuleInputsRecorder("0", path="input.0").initialize(model)
    with inputs, pytest.raises(RecorderConfigError, match=r"in `input`, which is a Tensor of"):
        model(torch.ones(1, 2))
    counting = nn.Sequential(_Count())
    counted = ModuleOutputsRecorder("0", path="x").initialize(counting)
    with counted, pytest.raises(RecorderConfigError, match=r"recorded value, which is an int\."):
        counting(torch.ones(1))
    for recorder in (group, inputs, counted):
        recorder.release()


class _Count(nn.Module):
    def forward(self, x: torch.Tensor) -> int:
        return int(x.numel())
