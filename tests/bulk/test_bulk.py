"""Tests of lightning_recorder.bulk: collectors checked against values computed directly."""

from __future__ import annotations

import copy
import gc
import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from helpers.docs import DOCS, doctest_room, python_blocks, run_page
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_recorder.bulk as bulk_module
from lightning_recorder._core.hooks import live_hooks
from lightning_recorder.bulk import (
    BackwardOutput,
    CollectedRecord,
    ForwardInputsCollector,
    ForwardOutput,
    ForwardOutputsCollector,
    ForwardPre,
    OutputGradsCollector,
    load_collected,
)
from lightning_recorder.errors import (
    NoRecordError,
    RecorderConfigError,
    RecorderStateError,
    RecordModifiedError,
    UnknownSourceError,
)


def mnist_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10)
    )


class Reversed(nn.Module):
    """Runs its children in the reverse of their registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3)
        self.third = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(self.second(self.third(x)))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.stem(x))


# --- the seed's documented example -----------------------------------------------------------


def test_torchfunc_example_children_indices_sum_then_save_and_load(tmp_path: Path) -> None:
    model = mnist_mlp()
    batches = [torch.randn(8, 784) for _ in range(3)]
    recorder = ForwardPre(reduction=lambda x, y: x + y)  # torchfunc's name and arguments
    recorder.children(model, indices=(2, 3))
    for batch in batches:
        model(batch)
    recorder.release()
    with torch.no_grad():
        hidden = [model[1](model[0](b)) for b in batches]
        expected_2 = sum(hidden)
        expected_3 = sum(model[2](h) for h in hidden)
    assert len(recorder) == 2
    assert recorder.names == ("2", "3")
    assert recorder[0].shape == (8, 100) and recorder[1].shape == (8, 50)
    torch.testing.assert_close(recorder[0], expected_2)
    torch.testing.assert_close(recorder[1], expected_3)
    assert list(recorder.iter_samples()) == [3, 3]

    recorder.save(tmp_path / "analysis")
    assert sorted(p.name for p in (tmp_path / "analysis").iterdir()) == [
        ".index.json",
        "0.pt",
        "1.pt",
    ]
    loaded = load_collected(tmp_path / "analysis")
    assert [(r.index, r.name, r.type, r.samples) for r in loaded] == [
        (0, "2", "torch.nn.modules.linear.Linear", 3),
        (1, "3", "torch.nn.modules.activation.ReLU", 3),
    ]
    torch.testing.assert_close(loaded[0].data, expected_2)
    torch.testing.assert_close(loaded[1].data, expected_3)
    assert torch.equal(torch.load(tmp_path / "analysis" / "1.pt"), recorder[1])


def test_torchfunc_aliases_name_the_collectors() -> None:
    assert ForwardPre is ForwardInputsCollector
    assert ForwardOutput is ForwardOutputsCollector
    assert BackwardOutput is OutputGradsCollector


# --- selection --------------------------------------------------------------------------------


def test_modules_is_recursive_and_counts_the_model_itself_at_index_zero() -> None:
    model = Nested()
    assert [type(m).__name__ for m in model.modules()] == [
        "Nested",
        "Linear",
        "Sequential",
        "Linear",
        "Tanh",
        "Linear",
    ]
    with ForwardOutputsCollector().modules(model, types=nn.Linear) as linears:
        assert linears.names == ("stem", "block.0", "block.2")
    with ForwardOutputsCollector().modules(model, indices=[0, 2]) as chosen:
        assert chosen.names == ("", "block")
    with ForwardOutputsCollector().modules(model, types="Linear", indices=range(4)) as both:
        assert both.names == ("stem", "block.0")  # Linear and among the first four
    with ForwardOutputsCollector().modules(model) as everything:
        assert len(everything) == 6
    with ForwardOutputsCollector().children(model) as children:
        assert children.names == ("stem", "block")


def test_types_accept_names_and_several_classes() -> None:
    model = Nested()
    with ForwardOutputsCollector().modules(model, types=("torch.nn.Tanh", nn.Sequential)) as c:
        assert c.names == ("block", "block.1")


def test_names_drop_wrapper_prefixes() -> None:
    class Wrapper(nn.Module):  # as DDP holds the model under `module`
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    with ForwardOutputsCollector().modules(Wrapper(Nested()), types=nn.Linear) as c:
        assert c.names == ("stem", "block.0", "block.2")


def test_records_follow_registration_order_not_firing_order() -> None:
    model = Reversed()
    x = torch.randn(2, 3)
    with ForwardOutputsCollector().children(model) as outputs:
        model(x)
    third = model.third(x)
    second = model.second(third)
    first = model.first(second)
    assert outputs.names == ("first", "second", "third")
    torch.testing.assert_close(outputs[0][0], first)
    torch.testing.assert_close(outputs[1][0], second)
    torch.testing.assert_close(outputs[2][0], third)


def test_unfired_subrecorders_keep_their_index() -> None:
    model = Nested()
    with ForwardInputsCollector(reduction=lambda a, b: a + b).modules(model, types=nn.Linear) as c:
        model.block(torch.randn(1, 4))  # stem never runs
    assert c[0] is None and c.samples(0) == 0
    assert c[1] is not None and c.samples(1) == 1


def test_a_second_registration_appends_after_the_first() -> None:
    model = Nested()
    x = torch.randn(2, 4)
    collector = ForwardOutputsCollector().children(model, indices=[1])
    collector.modules(model, types=nn.Tanh)
    with collector:
        model(x)
    assert collector.names == ("block", "block.1")
    torch.testing.assert_close(collector[0][0], model(x))
    torch.testing.assert_close(collector[1][0], model.block[1](model.block[0](model.stem(x))))


# --- what is recorded -------------------------------------------------------------------------


def test_forward_inputs_record_the_first_positional_argument_or_a_path() -> None:
    class TwoInputs(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
            return x if scale is None else x * scale

    holder = nn.Sequential(TwoInputs())
    x, s = torch.randn(3), torch.randn(3)
    with ForwardInputsCollector(detach=False).children(holder) as first:
        holder[0](x, s)
        holder[0](scale=s, x=x)  # keywords only: the first argument of the signature
    assert first[0][0] is x and first[0][1] is x
    with ForwardInputsCollector(path="scale", detach=False).children(holder) as named:
        holder[0](x, s)
        holder[0](x, scale=s)
        holder[0](x)  # `scale` left None: no sample
    assert len(named[0]) == 2 and named[0][0] is s and named[0][1] is s
    assert named.samples(0) == 2


def test_an_input_left_none_is_not_a_sample() -> None:
    # An optional argument left None makes no sample, as an output without a tensor does: a
    # fold never sees None, and the count is of the calls that passed a value.
    class TwoInputs(nn.Module):
        def forward(self, x: torch.Tensor | None, scale: torch.Tensor | None = None) -> object:
            return x if scale is None else x * scale

    holder = nn.Sequential(TwoInputs())
    s = torch.arange(3.0)
    summed = ForwardInputsCollector(path="scale", reduction=lambda acc, v: acc + v)
    with summed.children(holder):
        holder[0](torch.ones(3))
        holder[0](torch.ones(3), scale=s)
        holder[0](torch.ones(3))
        holder[0](torch.ones(3), s)
    torch.testing.assert_close(summed[0], 2 * s)
    assert summed.samples(0) == 2
    with ForwardInputsCollector().children(holder) as first:
        holder[0](None)
    assert first[0] == [] and first.samples(0) == 0


def test_an_input_path_naming_no_argument_fails_at_registration() -> None:
    class TwoInputs(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
            return x if scale is None else x * scale

    class AnyKeyword(nn.Module):
        def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
            return x

    model = nn.Sequential(TwoInputs(), nn.Sequential(TwoInputs()))
    for path, message in (
        (
            "scael",
            r"an argument of TwoInputs.forward\(x, scale\) of module '0' but got 'scael'. "
            r"Closest argument names: 'scale'",
        ),
        ("scael.0", r"but got 'scael'"),
        (2, r"a position below 2 \(the arguments of TwoInputs.forward\(x, scale\) of module"),
    ):
        collector = ForwardInputsCollector(path=path)
        with pytest.raises(RecorderConfigError, match=message):
            collector.modules(model, types=TwoInputs)
        assert len(collector) == 0 and live_hooks() == []  # nothing registered
    with ForwardInputsCollector(path="scale").modules(model, types=TwoInputs) as named:
        model(torch.ones(2))
    assert named.samples(0) == 0 and named[0] == []  # `scale` left None: no sample
    # With **extra any name may come, so the name can only be checked when the call comes.
    with ForwardInputsCollector(path="mask").modules(AnyKeyword()) as free:
        assert free.names == ("",)


def test_forward_outputs_of_structured_values_record_the_first_tensor_or_a_path() -> None:
    torch.manual_seed(0)
    lstm = nn.Sequential(nn.LSTM(3, 4, batch_first=True))
    x = torch.randn(2, 5, 3)
    with ForwardOutputsCollector().children(lstm) as outs:
        out, (_, c) = lstm(x)
    with ForwardOutputsCollector(path="1.1").children(lstm) as cells:
        lstm(x)
    torch.testing.assert_close(outs[0][0], out)
    torch.testing.assert_close(cells[0][0], c)


def test_detach_is_the_default_and_can_be_turned_off() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with ForwardOutputsCollector().children(model) as detached:
        model(torch.randn(1, 2))
    with ForwardOutputsCollector(detach=False).children(model) as attached:
        model(torch.randn(1, 2))
    assert detached[0][0].grad_fn is None and not detached[0][0].requires_grad
    assert attached[0][0].grad_fn is not None


def test_device_and_dtype_options_convert_records() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with ForwardOutputsCollector(device="cpu", dtype="float16").children(model) as half:
        model(torch.randn(1, 2))
    assert half[0][0].dtype == torch.float16 and half[0][0].device.type == "cpu"


def test_output_grads_equal_autograd_grads_even_with_in_place_ops_after() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    x = torch.randn(5, 3)
    with OutputGradsCollector().children(model, indices=(0, 2)) as grads:
        model(x).pow(2).sum().backward()
    hidden = model[0](x)
    out = model[2](torch.relu(hidden))
    expected_hidden, expected_out = torch.autograd.grad(out.pow(2).sum(), (hidden, out))
    assert grads.samples(0) == 1 and grads.samples(1) == 1
    torch.testing.assert_close(grads[0][0], expected_hidden)
    torch.testing.assert_close(grads[1][0], expected_out)


def test_output_grads_with_reduction_sum_over_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    xs = [torch.randn(4, 3) for _ in range(3)]
    with OutputGradsCollector(reduction=lambda a, g: a + g).children(model) as grads:
        for x in xs:
            (model(x) * x[:, :2]).sum().backward()
    torch.testing.assert_close(grads[0], sum(x[:, :2] for x in xs))
    assert grads.samples(0) == 3


def test_no_grad_forward_gives_no_gradient_record() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    with OutputGradsCollector().children(model) as grads, torch.no_grad():
        model(torch.randn(1, 3))
    assert grads[0] == [] and grads.samples(0) == 0


# --- condition, reduction, samples -------------------------------------------------------------


def test_condition_decides_each_call_and_samples_count_recorded_calls() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    labels = [0, 3, 3, 1, 3]
    current = {"label": 0}
    xs = [torch.randn(1, 2) for _ in labels]
    with ForwardInputsCollector(condition=lambda: current["label"] == 3).children(model) as c:
        for label, x in zip(labels, xs, strict=True):
            current["label"] = label
            model(x)
    assert c.samples(0) == 3
    assert all(torch.equal(r, x) for r, x in zip(c[0], [xs[1], xs[2], xs[4]], strict=True))


def test_reduction_folds_and_never_writes_into_the_model_tensors() -> None:
    model = nn.Sequential(nn.Identity())
    xs = [torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)]
    originals = [x.clone() for x in xs]
    collector = ForwardOutputsCollector(reduction=lambda acc, x: acc.add_(x))  # in-place fold
    with collector.children(model):
        for x in xs:
            model(x)
    torch.testing.assert_close(collector[0], torch.full((2,), 6.0))
    for x, original in zip(xs, originals, strict=True):
        assert torch.equal(x, original)


def test_reduction_keeping_the_latest_sample_is_checked_for_in_place_changes() -> None:
    model = nn.Sequential(nn.Identity())
    a, b = torch.zeros(2), torch.zeros(2)
    with ForwardOutputsCollector(reduction=lambda acc, x: x).children(model) as last:
        model(a)
        model(b)
    assert last[0].data_ptr() == b.data_ptr()  # this fold keeps the model's own tensor
    b.add_(1)
    with pytest.raises(RecordModifiedError, match=r"modified in place.*clone=True"):
        last[0]


# --- in-place modification --------------------------------------------------------------------


def test_in_place_change_of_a_sample_is_detected_and_clone_prevents_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True))
    x = torch.randn(4, 3)
    expected = model[0](x)
    with ForwardInputsCollector().children(model, types=nn.ReLU) as shared:
        model(x)
    with pytest.raises(RecordModifiedError, match=r"subrecorder 0 \('1'\).*clone=True"):
        shared[0]
    with pytest.raises(RecordModifiedError, match=r"modified in place"):
        list(shared)
    with ForwardInputsCollector(clone=True).children(model, types=nn.ReLU) as copies:
        model(x)
    torch.testing.assert_close(copies[0][0], expected)


# --- apply, apply_sample, remove, reset ---------------------------------------------------------


def test_apply_really_replaces_the_data() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with ForwardOutputsCollector().children(model) as c:
        model(torch.randn(3, 2))
        model(torch.randn(3, 2))
    before = [torch.stack(samples) for samples in c]
    c.apply(torch.stack)
    assert isinstance(c[0], torch.Tensor) and c[0].shape == (2, 3, 2)
    torch.testing.assert_close(c.data, before)
    c.apply(lambda t: t * 2)
    torch.testing.assert_close(c[1], before[1] * 2)


def test_apply_sample_turns_sums_into_means() -> None:
    model = nn.Sequential(nn.Identity())
    xs = [torch.randn(4) for _ in range(5)]
    with ForwardOutputsCollector(reduction=lambda a, x: a + x).children(model) as c:
        for x in xs:
            model(x)
    seen: list[int] = []
    c.apply_sample(lambda total, n: seen.append(n) or total / n)
    assert seen == [5]
    torch.testing.assert_close(c[0], torch.stack(xs).mean(0))


def test_apply_skips_empty_subrecorders_and_is_all_or_nothing() -> None:
    model = Nested()
    with ForwardOutputsCollector(reduction=lambda a, x: a + x).children(model) as c:
        model.block(torch.randn(1, 4))
    c.apply(lambda t: t + 1)  # stem recorded nothing: fn is not called with None
    assert c[0] is None
    kept = c[1].clone()

    def failing(t: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    with pytest.raises(ValueError, match=r"boom"):
        c.apply(failing)
    assert torch.equal(c[1], kept)


def test_recording_after_apply_replaced_a_list_raises_until_reset() -> None:
    model = nn.Sequential(nn.Identity())
    with ForwardOutputsCollector().children(model) as c:
        model(torch.ones(1))
        c.apply(torch.stack)
        with pytest.raises(RecorderStateError, match=r"`apply` replaced it with a Tensor"):
            model(torch.ones(1))
        c.reset()
        assert c[0] == [] and c.samples(0) == 0
        model(torch.ones(1))
    assert c.samples(0) == 1


def test_remove_unregisters_one_subrecorder_and_returns_its_data() -> None:
    model = Reversed()
    x = torch.randn(1, 3)
    expected = model.second(model.third(x))
    collector = ForwardOutputsCollector().children(model)
    assert len(live_hooks()) == 3
    model(x)
    removed = collector.remove(1)
    torch.testing.assert_close(removed[0], expected)
    assert len(live_hooks()) == 2
    assert collector.names == ("first", "third") and len(collector) == 2
    model(x)
    assert [collector.samples(i) for i in range(2)] == [2, 2]
    collector.remove(-1)
    assert collector.names == ("first",)
    collector.release()
    assert live_hooks() == []


# --- container protocol and errors -------------------------------------------------------------


def test_len_getitem_iter_and_negative_indices() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    with ForwardOutputsCollector().children(model) as c:
        model(torch.randn(1, 2))
    assert len(c) == 2
    assert c[-1] is c[1] and c[-2] is c[0]
    assert list(c) == c.data == [c[0], c[1]]
    assert repr(c) == "ForwardOutputsCollector(['0', '1'])"
    for bad in (2, -3, "0", True):
        with pytest.raises(NoRecordError, match=r"Expected a subrecorder index in \[-2, 1\]"):
            c[bad]  # type: ignore[index]
    with pytest.raises(NoRecordError, match=r"has 2 subrecorder"):
        c.remove(5)
    with pytest.raises(NoRecordError, match=r"index"):
        c.samples(7)


def test_option_errors_name_what_was_expected() -> None:
    with pytest.raises(RecorderConfigError, match=r"Expected `condition` to be a zero-argument"):
        ForwardPre(condition=True)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `reduction` to be a two-argument"):
        ForwardPre(reduction="sum")  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `detach` to be a bool but got int"):
        ForwardPre(detach=1)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `dtype`"):
        ForwardPre(dtype="float99")
    with pytest.raises(RecorderConfigError, match=r"Expected `path`"):
        ForwardPre(path="")


def test_selection_errors_list_what_the_model_yields() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    collector = ForwardOutputsCollector()
    with pytest.raises(
        UnknownSourceError,
        match=re.escape(
            "positions in [0, 2) of model.children() but got 5. model.children() "
            "yields: 0 Linear, 1 ReLU."
        ),
    ):
        collector.children(model, indices=[0, 5])
    with pytest.raises(
        UnknownSourceError, match=r"No module of model.modules\(\) matches types Conv2d"
    ):
        collector.modules(model, types=nn.Conv2d)
    with pytest.raises(UnknownSourceError, match=r"matches types ReLU and indices \[0\]"):
        collector.children(model, types=nn.ReLU, indices=[0])
    with pytest.raises(RecorderConfigError, match=r"Expected `indices` to hold ints but got str"):
        collector.children(model, indices=["0"])  # type: ignore[list-item]
    with pytest.raises(RecorderConfigError, match=r"Expected `types` to be nn.Module classes"):
        collector.children(model, types=int)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"not a class in torch.nn"):
        collector.children(model, types="Linearr")
    with pytest.raises(RecorderConfigError, match=r"Expected `model` to be an nn.Module but got"):
        collector.children([model])  # type: ignore[arg-type]
    for options in ({}, {"types": nn.Linear}, {"indices": [0]}):
        with pytest.raises(
            UnknownSourceError,
            match=r"model.children\(\) to yield modules .* yields none: the model has no child "
            r"modules. Use modules\(\)",
        ):
            collector.children(nn.Linear(2, 2), **options)  # type: ignore[arg-type]
    assert len(collector) == 0 and live_hooks() == []  # nothing half-registered


def test_an_empty_collector_says_it_has_no_subrecorder() -> None:
    empty = ForwardOutputsCollector()
    for read in (lambda: empty[0], lambda: empty.samples(-1), lambda: empty.remove(0)):
        with pytest.raises(
            NoRecordError,
            match=r"got -?\d+ on ForwardOutputsCollector\(\[\]\), which has no subrecorder: "
            r"register modules with children\(\) or modules\(\) first",
        ):
            read()
    assert empty.data == [] and list(empty.iter_samples()) == []


# --- cleanup, copies, checkpointing ------------------------------------------------------------


def test_release_and_context_remove_every_hook_and_keep_the_data() -> None:
    model = Nested()
    collector = OutputGradsCollector().modules(model)
    ForwardInputsCollector().modules(model).release()
    assert len(live_hooks()) == 6
    model(torch.randn(2, 4)).sum().backward()
    collector.release()
    collector.release()  # idempotent
    assert live_hooks() == []
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert collector.samples(0) == 1 and collector[0][0].shape == (2, 2)
    with ForwardOutputsCollector().modules(model):
        assert len(live_hooks()) == 6
    assert live_hooks() == []


def test_entering_a_released_collector_again_raises_instead_of_recording_nothing() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    collector = ForwardOutputsCollector().children(model)
    with collector:
        model(torch.randn(1, 3))
    with pytest.raises(RecorderStateError, match=r"was released .* nothing would be recorded"):
        collector.__enter__()  # a second `with collector:`
    assert collector.samples(0) == 1 and live_hooks() == []
    with collector.children(model):  # registered again: records until the block ends
        model(torch.randn(1, 3))
    assert list(collector.iter_samples()) == [1, 1] and live_hooks() == []
    with ForwardOutputsCollector() as empty:  # registering inside the block is fine
        empty.children(model)
        model(torch.randn(1, 3))
    assert empty.samples(0) == 1


def test_a_dropped_collector_removes_its_hooks() -> None:
    model = Nested()
    ForwardOutputsCollector().modules(model)
    gc.collect()
    assert live_hooks() == []
    assert not any(m._forward_hooks for m in model.modules())


def test_models_with_collector_hooks_deepcopy_and_pickle_and_copies_do_not_record() -> None:
    model = Nested()
    x = torch.randn(1, 4)
    with ForwardOutputsCollector().modules(model) as c:
        twin = copy.deepcopy(model)
        restored = pickle.loads(pickle.dumps(model))
        twin(x)
        restored(x)
        assert list(c.iter_samples()) == [0] * 6
        model(x)
        assert list(c.iter_samples()) == [1] * 6
    torch.testing.assert_close(twin(x), model(x))


def test_a_copied_collector_keeps_which_samples_were_modified_in_place() -> None:
    # Copied tensors count their versions afresh: a sample reads as modified in the copy only
    # when it was modified before the copy, or is modified in the copy.
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True), nn.Linear(2, 2))
    for reduction in (None, lambda acc, x: acc + x):
        with ForwardOutputsCollector(reduction=reduction).children(model, indices=[0, 2]) as c:
            model(torch.randn(3, 2))  # the in-place ReLU writes into the output of model[0]
        copied = copy.deepcopy(c)
        if reduction is None:  # (a fold starts from a copy of the first sample)
            with pytest.raises(RecordModifiedError, match=r"subrecorder 0 \('0'\)"):
                copied[0]
        torch.testing.assert_close(copied[1], c[1])
        sample = copied[1] if reduction is not None else copied[1][0]
        sample.add_(1.0)
        with pytest.raises(RecordModifiedError, match=r"subrecorder 1 \('2'\)"):
            copied[1]
        assert c[1] is not None  # the original is untouched


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpoint_recomputation_is_not_recorded_twice(use_reentrant: bool) -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    head = nn.Linear(3, 1)
    x = torch.randn(2, 3, requires_grad=True)
    with (
        ForwardInputsCollector().children(block) as inputs,
        OutputGradsCollector().children(block) as grads,
    ):
        out = head(checkpoint(block, x, use_reentrant=use_reentrant))
        out.sum().backward()
    assert list(inputs.iter_samples()) == [1, 1]
    assert list(grads.iter_samples()) == [1, 1]
    hidden = block[0](x)
    expected = torch.autograd.grad(head(torch.tanh(hidden)).sum(), hidden)[0]
    torch.testing.assert_close(grads[0][0], expected)


# --- saving -----------------------------------------------------------------------------------


def test_save_writes_an_index_and_load_reads_every_kind_of_data(tmp_path: Path) -> None:
    model = Nested()
    with ForwardOutputsCollector().modules(model, types=nn.Linear) as lists:
        model(torch.randn(2, 4))
        model.block(torch.randn(2, 4))
    out = lists.save(tmp_path / "deep" / "dir")
    assert out == tmp_path / "deep" / "dir"
    index = json.loads((out / ".index.json").read_text())
    assert (
        index["format"] == "lightning_recorder.bulk"
        and index["collector"] == "ForwardOutputsCollector"
    )
    assert index["reduced"] is False
    assert [(r["file"], r["name"], r["samples"]) for r in index["records"]] == [
        ("0.pt", "stem", 1),
        ("1.pt", "block.0", 2),
        ("2.pt", "block.2", 2),
    ]
    loaded = load_collected(out, map_location="cpu")
    assert all(isinstance(r, CollectedRecord) for r in loaded)
    for record, data in zip(loaded, lists, strict=True):
        assert len(record.data) == len(data)
        for a, b in zip(record.data, data, strict=True):
            assert torch.equal(a, b)

    with ForwardOutputsCollector(reduction=lambda a, x: a + x).modules(model, types=nn.Tanh) as r:
        pass
    r.save(tmp_path / "empty")
    assert load_collected(tmp_path / "empty")[0].data is None


def test_save_of_a_sample_changed_in_place_writes_nothing(tmp_path: Path) -> None:
    # The second Linear's output is changed in place by the ReLU after it; the first is not.
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.ReLU(inplace=True))
    with ForwardOutputsCollector().children(model, types=nn.Linear) as outputs:
        model(torch.randn(2, 3))
    for mkdir in (None, True):
        folder = tmp_path / f"mkdir_{mkdir}"
        with pytest.raises(RecordModifiedError, match=r"subrecorder 1 \('1'\)"):
            outputs.save(folder, mkdir)
        assert not folder.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(RecordModifiedError):
        outputs.save(kept, False)
    assert list(kept.iterdir()) == []


def test_load_errors_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(RecorderConfigError, match=r"saved with `save\(\)`.*no index and no 0.pt"):
        load_collected(tmp_path)
    with pytest.raises(RecorderConfigError, match=r"`directory` to be a path.*got int 5"):
        load_collected(5)  # type: ignore[arg-type]
    (tmp_path / "index.json").write_text('{"format": "other"}')
    with pytest.raises(RecorderConfigError, match=r"format 'lightning_recorder.bulk'"):
        load_collected(tmp_path)
    model = nn.Sequential(nn.Identity())
    with ForwardOutputsCollector().children(model) as c:
        model(torch.ones(1))
    c.save(tmp_path)
    (tmp_path / "0.pt").unlink()
    with pytest.raises(RecorderConfigError, match=r"Expected '0.pt' \(subrecorder 0, module '0'\)"):
        load_collected(tmp_path)


def test_load_of_a_damaged_index_says_so(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Identity())
    with ForwardOutputsCollector().children(model) as c:
        model(torch.ones(1))
    index_path = c.save(tmp_path / "saved") / ".index.json"
    good = json.loads(index_path.read_text())
    (tmp_path / "elsewhere.pt").write_bytes((tmp_path / "saved" / "0.pt").read_bytes())
    entry = good["records"][0]
    for records, message in (
        (None, r"to list its subrecorders under 'records' but got NoneType None; .* damaged"),
        (5, r"under 'records' but got int 5"),
        (["0.pt"], r"record 0 of '.index.json' .* to be an object with 'file', 'name'"),
        ([{k: v for k, v in entry.items() if k != "file"}], r"an object with 'file', 'name'"),
        ([{**entry, "file": "../elsewhere.pt"}], r"a file inside that folder .* '../elsewhere.pt'"),
        ([{**entry, "file": 0}], r"a file inside that folder \(such as '0.pt'\) but got 0"),
    ):
        index_path.write_text(json.dumps({**good, "records": records}))
        with pytest.raises(RecorderConfigError, match=message):
            load_collected(tmp_path / "saved")


# --- documentation ----------------------------------------------------------------------------


def test_docstring_examples() -> None:
    result = doctest_room(bulk_module)
    assert result.attempted >= 20 and result.failed == 0


def test_docs_page_examples_run() -> None:
    assert len(python_blocks(DOCS / "bulk.md")) >= 3
    run_page(DOCS / "bulk.md")


def test_older_index_name_and_folders_without_index(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
    with ForwardOutputsCollector().children(model) as outputs:
        model(torch.ones(1, 2))
    new = outputs.save(tmp_path / "new")
    old = tmp_path / "old"
    outputs.save(old, index=False)
    assert sorted(p.name for p in old.iterdir()) == ["0.pt", "1.pt"]
    with pytest.raises(RecorderConfigError, match=r"no index and no 0.pt"):
        load_collected(tmp_path)  # the parent folder holds folders only
    (old / "0.pt").rename(old / "5.pt")
    with pytest.raises(RecorderConfigError, match=r"files 0.pt to 1.pt.*1.pt, 5.pt"):
        load_collected(old)
    (old / "5.pt").rename(old / "0.pt")
    (new / ".index.json").rename(old / "index.json")  # the name older versions wrote
    assert [(r.name, r.samples) for r in load_collected(old)] == [("0", 1), ("1", 1)]
    (old / "index.json").unlink()
    assert [(r.name, r.type, r.samples) for r in load_collected(old)] == [
        (None, None, 1),
        (None, None, 1),
    ]


def test_a_save_over_an_earlier_save_replaces_it(tmp_path: Path) -> None:
    # Neither the earlier index nor its files beyond the new ones are left for a reader.
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    with ForwardOutputsCollector().children(model) as three:
        model(torch.ones(1, 2))
    with ForwardOutputsCollector().children(model, indices=[2]) as one:
        model(torch.ones(1, 2))
        model(torch.zeros(1, 2))
    three.save(tmp_path)
    one.save(tmp_path, index=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.pt"]
    assert [(r.name, r.samples, len(r.data)) for r in load_collected(tmp_path)] == [(None, 2, 2)]
    three.save(tmp_path)
    (tmp_path / ".index.json").rename(tmp_path / "index.json")  # the name older versions wrote
    one.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".index.json", "0.pt"]
    assert [(r.name, r.samples, len(r.data)) for r in load_collected(tmp_path)] == [("2", 2, 2)]
    # A folder's other files, and an index.json that is not a save's, are not touched.
    (tmp_path / "index.json").write_text('{"other": 1}', encoding="utf-8")
    (tmp_path / "notes.txt").write_text("mine", encoding="utf-8")
    one.save(tmp_path, index=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.pt", "index.json", "notes.txt"]


def test_save_mkdir_modes(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 3))
    with ForwardOutputsCollector().children(model) as outputs:
        model(torch.ones(1, 2))
    outputs.save(tmp_path / "a", mkdir=True)
    with pytest.raises(RecorderConfigError, match=r"mkdir=True.*exist_ok=True"):
        outputs.save(tmp_path / "a", mkdir=True)
    outputs.save(tmp_path / "a", True, exist_ok=True)  # torchfunc's *args/**kwargs to mkdir
    with pytest.raises(RecorderConfigError, match=r"to exist \(mkdir=False\)"):
        outputs.save(tmp_path / "b", mkdir=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecorderConfigError, match=r"`directory` to be a directory.*is a file"):
        outputs.save(tmp_path / "file")
    with pytest.raises(
        RecorderConfigError, match=r"`directory` .*sub' to be a folder that can be created"
    ):
        outputs.save(tmp_path / "file" / "sub")  # a parent is a file
    with pytest.raises(RecorderConfigError, match=r"`mkdir` to be a bool or None"):
        outputs.save(tmp_path / "c", mkdir="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_data_method_sample_and_batch() -> None:
    model = nn.Sequential(nn.Linear(2, 3))
    x = torch.randn(4, 2)
    inputs = ForwardInputsCollector(data_method="sample").children(model)
    outputs = ForwardOutputsCollector(data_method="batch").children(model)
    grads = OutputGradsCollector(data_method="batch").children(model)
    try:
        out = model(x)
        out.sum().backward()
        torch.testing.assert_close(inputs[0][0], x, rtol=0, atol=0)  # inputs[0]: the tensor
        torch.testing.assert_close(outputs[0][0], out, rtol=0, atol=0)  # the same output
        assert isinstance(grads[0][0], tuple)
        torch.testing.assert_close(grads[0][0][0], torch.ones(4, 3), rtol=0, atol=0)
        outputs.set_data_method("sample")
        model(x)
        assert outputs[0][1].shape == (3,)  # the first row
        outputs.set_data_method(None)
        model(x)
        assert outputs[0][2].shape == (4, 3)
        with pytest.raises(RecorderConfigError, match=r"`data_method` to be 'sample'.*'rows'"):
            outputs.set_data_method("rows")  # type: ignore[arg-type]
        with pytest.raises(RecorderConfigError, match=r"either `path` or `data_method`"):
            ForwardOutputsCollector(path=0, data_method="batch")
    finally:
        for collector in (inputs, outputs, grads):
            collector.release()
