"""The trace and its verdict on plain PyTorch: which module made the first NaN/Inf, which way."""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import torch
from helpers.health_models import Block, _Corrupt
from torch import Tensor, nn

from lightning_recorder._core.hooks import live_hooks
from lightning_recorder.callbacks._health_trace import Trace, tensor_paths
from lightning_recorder.callbacks._health_verdict import (
    Finding,
    exact_counts,
    quick_counts,
    resolve_counts,
)


def run(model: nn.Module, x: Any, exclude: tuple[str, ...] = (), backward: bool = True) -> Finding:
    trace = Trace(model, exclude, keep=True)
    trace.install()
    try:
        trace.begin(x)
        out = model(x)
        loss = out.float().square().mean()
        trace.end_forward(loss)
        if backward:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
            trace.parameter_grads((n, g) for (n, _), g in zip(named, grads, strict=True))
        return trace.finish().verdict()
    finally:
        trace.remove()


class Div(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x / x.sum(dim=-1, keepdim=True).sub(x.sum(dim=-1, keepdim=True))  # 0 / 0


class Sqrt(nn.Module):
    """sqrt(0): finite forward, infinite backward."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sqrt(torch.relu(x) * 0.0)


class Between(nn.Module):
    """Makes a NaN between its submodules, in its own code."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return self.b(torch.log(h - h.max()))  # log of values <= 0: NaN, -inf


def test_counts_on_cpu_are_ints_and_paths_walk_structures() -> None:
    t = torch.tensor([1.0, math.nan, math.inf, -math.inf, -math.inf])
    assert quick_counts(t) == (1, 1, 2) == exact_counts([t])[0]
    assert quick_counts(torch.ones(3)) == (0, 0, 0)
    assert quick_counts(torch.arange(3)) == (0, 0, 0)  # integers are always finite
    huge = torch.full((4,), 3e38)  # its sum overflows: the exact count says it is finite
    assert quick_counts(huge) == (0, 0, 0)
    assert quick_counts(torch.tensor([1.0, math.inf], dtype=torch.bfloat16)) == (0, 1, 0)
    # a device's flag (a sum) read later: at least one of the kind its value says
    flags = [torch.tensor([math.nan]), torch.tensor([-math.inf]), torch.tensor([2.0])]
    assert resolve_counts([*flags, (0, 0, 1)]) == [(1, 0, 0), (0, 0, 1), (0, 0, 0), (0, 0, 1)]
    paths = [p for p, _ in tensor_paths({"a": (t, [t]), "b": 3})]
    assert paths == ["a.0", "a.1.0"]


def test_forward_producer_is_named_with_its_output() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Div(), nn.Linear(4, 2))
    found = run(model, torch.randn(3, 4))
    assert (found.module, found.direction, found.path, found.producer) == (
        "1",
        "forward",
        "output",
        True,
    )
    assert (
        sum(found.counts.values()) == 12
        and found.shape == (3, 4)
        and found.dtype == "torch.float32"
    )
    assert [name for name, _ in found.tensors] == ["input.x", "output"]
    assert live_hooks() == []


def test_backward_producer_is_the_module_whose_backward_made_it() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Sqrt(), nn.Linear(4, 2))
    found = run(model, torch.randn(3, 4))
    assert (found.module, found.direction, found.path, found.producer) == (
        "1",
        "backward",
        "input.x",
        True,
    )


def test_code_between_submodules_is_the_enclosing_module() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Between())
    found = run(model, torch.randn(3, 4))
    assert (found.module, found.direction, found.path, found.producer) == (
        "1",
        "forward",
        "b.input.input",
        True,
    )


def test_scripted_submodules_take_no_hooks_and_the_others_are_named() -> None:
    # torch refuses hooks on a torch.jit.script module: the trace leaves it out
    model = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.Linear(4, 4)), Div())
    found = run(model, torch.randn(3, 4))
    assert (found.module, found.direction, found.path, found.producer) == (
        "2",
        "forward",
        "output",
        True,
    )
    assert sum(found.counts.values()) == 12
    # what a scripted submodule makes is named as its parent's code between submodules
    outer = nn.Sequential(nn.Linear(4, 4), nn.Sequential(torch.jit.script(Div()), nn.Linear(4, 2)))
    found = run(outer, torch.randn(3, 4))
    assert (found.module, found.direction, found.path, found.producer) == (
        "1",
        "forward",
        "1.input.input",
        True,
    )
    assert live_hooks() == []


class PerSample(nn.Module):
    """Runs its submodules on each sample with torch.func.vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), Div())

    def forward(self, x: Tensor) -> Tensor:
        return torch.func.vmap(self.inner)(x)


def test_calls_inside_vmap_are_not_traced_and_the_caller_is_named() -> None:
    # inside the transform a hook sees one sample's view, which cannot be counted
    found = run(nn.Sequential(PerSample(), nn.Linear(4, 2)), torch.randn(3, 4))
    assert (found.module, found.direction, found.path, found.producer) == (
        "0",
        "forward",
        "output",
        True,
    )
    assert sum(found.counts.values()) == 12
    assert live_hooks() == []


def test_a_bad_batch_is_no_module_s_doing() -> None:
    x = torch.randn(3, 4)
    x[1, 2] = math.nan
    found = run(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), x)
    assert found.module is None and found.producer is False and found.bad_batch
    assert found.path == "batch" and found.direction == "forward"


def test_passed_on_values_are_not_blamed_on_the_consumer() -> None:
    class Inf(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x * math.inf

    model = nn.Sequential(nn.Linear(4, 4), Inf(), nn.ReLU(inplace=True), nn.Linear(4, 2))
    found = run(model, torch.randn(3, 4))
    assert found.module == "1"  # not the in-place ReLU nor the Linear that received it


def test_in_place_relu_does_not_hide_the_batchnorm_output() -> None:
    class BnInf(nn.BatchNorm1d):
        def forward(self, x: Tensor) -> Tensor:
            out = super().forward(x)
            return out - math.inf * (out < 0)  # -inf where negative: the ReLU would zero it

    model = nn.Sequential(nn.Linear(4, 4), BnInf(4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    found = run(model, torch.randn(8, 4))
    assert found.module == "1" and found.counts["neginf"] > 0  # counted before the ReLU


def test_residual_backward_share_names_the_branch() -> None:
    """A block whose input feeds two submodules: the share tells which branch's backward."""

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.on = False

        def forward(self, x: Tensor) -> Tensor:
            return _Corrupt.apply(x, math.nan, 3) if self.on else x

    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.left, self.right = nn.Sequential(Probe(), nn.Linear(4, 4)), nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.left(x) + self.right(x)

    model = nn.Sequential(nn.Linear(4, 4), Res(), nn.Linear(4, 2))
    model[1].left[0].on = True
    found = run(model, torch.randn(3, 4))
    assert (found.module, found.direction) == ("1.left.0", "backward")


def test_resnet_block_with_in_place_relu() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Block(4, 4), Block(4, 8, 2))
    x = torch.randn(2, 3, 8, 8)
    assert not run(model, x).reproduced  # a clean model: nothing found
    big = torch.finfo(torch.float32).max  # finite weights whose output overflows
    model[2].bn1.weight.data[0] = model[2].bn1.bias.data[0] = big  # bn1 turns finite into inf
    found = run(model, x)
    assert (found.module, found.direction, found.producer) == ("2.bn1", "forward", True)
    model[2].bn1.weight.data[0] = math.inf  # a weight non-finite already: bn1 only passed it on
    found = run(model, x)
    assert (found.module, found.direction, found.path) == ("2.bn1", "parameter", "weight")
    assert found.producer is None and found.counts == {"nan": 0, "posinf": 1, "neginf": 0}


def test_a_lazy_module_is_traced_from_its_first_call() -> None:
    # its parameters are made by its first call: not counted then (nothing to count yet)
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    assert not run(model, torch.randn(3, 5)).reproduced
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
    found = run(model, torch.randn(3, 5))
    assert (found.module, found.direction, found.path) == ("0", "parameter", "weight")


def test_excluded_masks_are_not_alarms_and_stay_excluded_downstream() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

        def forward(self, x: Tensor) -> Tensor:
            mask = torch.full((x.shape[1], x.shape[1]), -math.inf).triu(1)
            return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]

    model = nn.Sequential(nn.Linear(4, 4), Masked())
    x = torch.randn(2, 5, 4)
    assert run(model, x).module == "1"  # the mask, made in Masked's code, looks like a NaN source
    assert not run(model, x, exclude=("*.input.attn_mask",)).reproduced


def test_loss_outside_modules() -> None:
    model = nn.Sequential(nn.Linear(4, 1))
    trace = Trace(model, keep=True)
    trace.install()
    try:
        trace.begin()
        out = model(torch.randn(3, 4))
        loss = torch.log(out - out.max() - 1.0).mean()  # log of negatives: NaN
        trace.end_forward(loss)
        found = trace.finish().verdict()
    finally:
        trace.remove()
    assert (found.module, found.direction, found.path) == (None, "loss", "loss")


def test_replay_of_a_checkpointed_module_counts_each_call_once() -> None:
    from torch.utils.checkpoint import checkpoint

    # Sqrt's backward is not finite only where its input is positive: a fixed seed, not one a
    # test run before this one left behind (some leave every input of it at or below zero)
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), Sqrt())

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Tensor) -> Tensor:
            return checkpoint(self.inner, x, use_reentrant=False)

    model = nn.Sequential(nn.Linear(4, 4), Outer())
    trace = Trace(model, keep=True)
    trace.install()
    try:
        trace.begin()
        loss = model(torch.randn(3, 4)).sum()
        trace.end_forward(loss)
        torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        line = trace.finish()
        found = line.verdict()
    finally:
        trace.remove()
    assert [c.name for c in line.calls] == ["0", "1", "1.inner", "1.inner.0", "1.inner.1"]
    assert (found.module, found.direction) == ("1.inner.1", "backward")


def test_device_flags_become_lower_bounds_or_exact_counts() -> None:
    """On a GPU a count is a flag (a sum) read later; a kept tensor is recounted exactly."""
    from lightning_recorder._core.structures import snapshot
    from lightning_recorder.callbacks._health_verdict import Entry, Timeline

    def line() -> Timeline:
        kept = torch.tensor([math.nan, math.nan, 1.0])
        timeline = Timeline()
        shape = tuple(kept.shape)
        timeline.entries = [
            Entry("output", -1, "output", kept.dtype, shape, kept.sum().reshape(1)),
            Entry("output", -1, "output", kept.dtype, shape, torch.tensor([-math.inf])),
            Entry("output", -1, "output", kept.dtype, shape, torch.tensor([3.0])),
        ]
        timeline.entries[0].tensor, timeline.entries[0].version = kept, snapshot(kept)
        return timeline

    resolved = line()
    resolved.resolve()
    assert [e.counts for e in resolved.entries] == [(2, 0, 0), (0, 0, 1), (0, 0, 0)]
    packed = line()
    flags = packed.pack()
    assert flags is not None and flags.shape == (3,)  # the loss, an int already, is not packed
    packed.unpack(flags.tolist())
    assert [e.counts for e in packed.entries] == [(1, 0, 0), (0, 0, 1), (0, 0, 0)]


def test_a_module_s_own_weights_are_told_as_its_call_found_them() -> None:
    """On a GPU a module's own weights are flags read with the rest, after the optimizer step:
    the verdict goes by the flag, and the weight changed since is no evidence."""
    import weakref

    from lightning_recorder._core.structures import snapshot
    from lightning_recorder.callbacks._health_verdict import Call, Entry, Timeline

    weight = torch.tensor([math.nan, 1.0])
    timeline = Timeline(calls=[Call(0, "lin", "Linear", -1, 0)])
    flag = torch.tensor([math.nan])
    timeline.entries = [Entry("output", 0, "output", torch.float32, (3,), flag)]
    timeline.weights = [("lin", "weight", weight.dtype, (2,), weight.sum().reshape(1))]
    timeline.held = [(weakref.ref(weight), snapshot(weight))]
    flags = timeline.pack()
    assert flags is not None and flags.shape == (2,)  # the output's and the weight's
    weight.add_(1.0)  # the optimizer step, before the copy was read
    timeline.unpack(flags.tolist())
    found = timeline.verdict()
    where = (found.module, found.direction, found.path, found.producer)
    assert where == ("lin", "parameter", "weight", None)
    assert found.counts == {"nan": 1, "posinf": 0, "neginf": 0} and found.tensors == []


class _ToNested(nn.Module):
    """Ragged sequences as a nested tensor, as a transformer's fast path makes them."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.nested.nested_tensor([x[0], x[1, :1]])


class _NestedNaN(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * math.nan


class _Padded(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.to_padded_tensor(0.0)


def test_nested_tensors_are_counted_and_named_with_their_shape() -> None:
    """A module that makes non-finite values inside a nested tensor is named, with the values'
    counts and the nested tensor's shape (-1 where its components differ); nested tensors have
    no ``shape`` of their own and no ``sum`` (both crashed the trace before)."""
    nested = torch.nested.nested_tensor([torch.tensor([1.0, math.inf]), torch.tensor([math.nan])])
    assert quick_counts(nested) == (1, 1, 0) == exact_counts([nested])[0]
    model = nn.Sequential(_ToNested(), _NestedNaN(), _Padded())
    with torch.no_grad():  # evaluation, where the fast path runs
        found = run(model, torch.randn(3, 2, 4), backward=False)
    assert (found.module, found.direction, found.path) == ("1", "forward", "output")
    assert found.shape == (2, -1, 4) and sum(found.counts.values()) == 12


def test_a_traced_class_is_not_kept_alive_after_its_model_is_gone() -> None:
    # A notebook cell defining the model's classes run again: the trace's cache of each class's
    # forward arguments held every old class (and what its methods refer to) for good.
    def traced_class() -> weakref.ref[type]:
        class Cell(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layer = nn.Linear(3, 3)

            def forward(self, x: Tensor) -> Tensor:
                return self.layer(x)

        model = nn.Sequential(Cell())
        trace = Trace(model, keep=True)
        trace.install()
        trace.remove()
        return weakref.ref(Cell)

    ref = traced_class()
    gc.collect()
    assert ref() is None
