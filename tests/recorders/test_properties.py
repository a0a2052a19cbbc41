"""Property-based tests of the recording core.

Random module trees (nested ``Sequential`` / ``ModuleList`` / custom containers of ``Linear``,
``ReLU`` (also in place), ``Tanh`` and ``Identity``; modules called several times, shared, or
never called; optionally under a DDP-like or torch.compile-like wrapper), random selections
(names, wrapper-prefixed names, glob patterns, types, parameter names and patterns), random
options (``detach``, ``clone``, ``keep``, ``dtype``, ``device``, ``path``) and grad modes (with a
backward, ``no_grad``, ``inference_mode``). Every record is compared with an *oracle*: the same
forward computed by hand, op by op (gradients by ``torch.autograd.grad``), and plain
``register_forward_hook`` closures that see the very tensors the model produced. Also checked:
nothing recorded outside a context, a fresh buffer per entry, records readable after release, no
hook left, and a model that pickles and deep-copies into one with inert hooks.

Argument normalisation (:class:`Binder`) is checked on random signatures (positional-only,
defaults, keyword-only, ``*args``, ``**kwargs``) called in random equivalent forms.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
import inspect
import io
import pickle
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_recorder import (
    Arguments,
    FunctionInputsRecorder,
    FunctionOutputsRecorder,
    ModuleInputGradsRecorder,
    ModuleInputsRecorder,
    ModuleOutputsRecorder,
    NoRecordError,
    NotInitializedError,
    RecorderManager,
    RecorderStateError,
    RecordModifiedError,
)
from lightning_recorder._core.hooks import _inert_hook, live_hooks
from lightning_recorder._core.structures import Binder

PROPERTY = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEW = settings(PROPERTY, max_examples=100)


# --------------------------------------------------------------------------- random module trees
class Block(nn.Module):
    """Calls its layers in ``order``: repeats allowed, layers missing from it never run."""

    def __init__(self, layers: list[nn.Module], order: list[int], spare: nn.Module | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.order = order
        if spare is not None:
            self.spare = spare  # registered, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.layers[i](x)
        return x


class Residual(nn.Module):
    """``x + body(x)``; the body is called positionally or by keyword."""

    def __init__(self, body: nn.Module, by_keyword: bool) -> None:
        super().__init__()
        self.body = body
        self.keyword = next(iter(inspect.signature(body.forward).parameters)) if by_keyword else ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(**{self.keyword: x}) if self.keyword else self.body(x)
        return x + y


@dataclass
class Tree:
    model: nn.Module
    width: int  # input features
    out_width: int
    inplace: bool  # holds a ReLU(inplace=True)


@st.composite
def trees(draw: st.DrawFn, *, identity: bool = True, inplace: bool | None = None) -> Tree:
    """A random tree; ``inplace``: may hold ``ReLU(inplace=True)`` (``None``: drawn)."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    if inplace is None:
        inplace = draw(st.booleans())
    leaves = ["linear", "linear", "relu", "tanh"] + ["identity"] * identity
    leaves += ["relu_", "relu_"] * inplace
    pool: list[tuple[nn.Module, int]] = []  # width-preserving leaves that may be shared

    def leaf(width: int, preserve: bool) -> tuple[nn.Module, int]:
        shared = [m for m, w in pool if w == width]
        if shared and draw(st.integers(0, 4)) == 0:
            return draw(st.sampled_from(shared)), width
        kind = draw(st.sampled_from(leaves))
        out = width
        if kind == "linear":
            out = width if preserve else draw(st.integers(2, 4))
            module: nn.Module = nn.Linear(width, out, bias=draw(st.booleans()))
        elif kind == "relu":
            module = nn.ReLU()
        elif kind == "relu_":
            module = nn.ReLU(inplace=True)
        elif kind == "tanh":
            module = nn.Tanh()
        else:
            module = nn.Identity()
        if out == width:
            pool.append((module, width))
        return module, out

    def node(width: int, depth: int, preserve: bool, root: bool = False) -> tuple[nn.Module, int]:
        kinds = ["seq", "block"] if root else ["leaf", "seq", "block", "residual"]
        kind = draw(st.sampled_from(kinds)) if depth > 0 else "leaf"
        if kind == "leaf":
            return leaf(width, preserve)
        if kind == "seq":
            children, w = [], width
            for _ in range(draw(st.integers(1, 3))):
                child, w = node(w, depth - 1, preserve=False)
                children.append(child)
            if preserve and w != width:
                children.append(nn.Linear(w, width))
                w = width
            return nn.Sequential(*children), w
        if kind == "block":
            n = draw(st.integers(1, 3))
            layers = [node(width, depth - 1, preserve=True)[0] for _ in range(n)]
            order = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4))
            spare = leaf(width, preserve=True)[0] if draw(st.booleans()) else None
            return Block(layers, order, spare), width
        body = node(width, depth - 1, preserve=True)[0]
        return Residual(body, by_keyword=draw(st.booleans())), width

    width = draw(st.integers(2, 4))
    model, out_width = node(width, draw(st.integers(1, 3)), preserve=False, root=True)
    has_inplace = any(isinstance(m, nn.ReLU) and m.inplace for m in model.modules())
    return Tree(model, width, out_width, has_inplace)


# --------------------------------------------------------------------------- the oracle
@dataclass
class Call:
    """One module call seen by the oracle: the tensors, their values and versions at the time."""

    module: nn.Module
    inp: torch.Tensor
    inp_value: torch.Tensor
    inp_version: int
    out: torch.Tensor
    out_value: torch.Tensor
    out_version: int


def oracle(module: nn.Module, x: torch.Tensor, calls: list[Call]) -> torch.Tensor:
    """The forward of ``module`` computed op by op, without calling any module."""
    inp_value, inp_version = x.detach().clone(), version(x)
    if isinstance(module, nn.Linear):
        y = F.linear(x, module.weight, module.bias)
    elif isinstance(module, nn.ReLU):
        y = torch.relu_(x) if module.inplace else torch.relu(x)
    elif isinstance(module, nn.Tanh):
        y = torch.tanh(x)
    elif isinstance(module, nn.Identity):
        y = x
    elif isinstance(module, nn.Sequential):
        y = x
        for child in module:
            y = oracle(child, y, calls)
    elif isinstance(module, Block):
        y = x
        for i in module.order:
            y = oracle(module.layers[i], y, calls)
    elif isinstance(module, Residual):
        y = x + oracle(module.body, x, calls)
    else:  # pragma: no cover - the generator builds nothing else
        raise TypeError(type(module))
    calls.append(Call(module, x, inp_value, inp_version, y, y.detach().clone(), version(y)))
    return y


def kept_indices(count: int, keep: Any) -> list[int]:
    if keep == "all":
        return list(range(count))
    if keep == "first":
        return list(range(min(1, count)))
    if keep == "last":
        return [count - 1] if count else []
    return list(range(min(keep, count)))


# --------------------------------------------------------------------------- random recorders
MODULE_VALUE_KINDS = ("ModuleOutputs", "ModuleInputs")


def module_sources(model: nn.Module) -> st.SearchStrategy[tuple[Any, list[str], bool]]:
    """(source, names it selects, whether it is a group): names, patterns, types."""
    modules = dict(model.named_modules())
    names = [n for n in modules if n]

    @st.composite
    def draw_source(draw: st.DrawFn) -> tuple[Any, list[str], bool]:
        how = draw(st.sampled_from(["exact", "glob", "type"]))
        if how == "exact":
            name = draw(st.sampled_from(names))
            return draw(st.sampled_from(["", "module.", "_orig_mod."])) + name, [name], False
        if how == "glob":
            name = draw(st.sampled_from(names))
            style = draw(st.sampled_from(["part", "prefix", "all", "char"]))
            if style == "part":
                parts = name.split(".")
                parts[draw(st.integers(0, len(parts) - 1))] = "*"
                pattern = ".".join(parts)
            elif style == "prefix":
                pattern = name[: draw(st.integers(0, len(name) - 1))] + "*"
            elif style == "char":
                i = draw(st.integers(0, len(name) - 1))
                pattern = name[:i] + "?" + name[i + 1 :]
            else:
                pattern = "*"
            return pattern, [n for n in names if fnmatch.fnmatchcase(n, pattern)], True
        present = list(dict.fromkeys(type(modules[n]) for n in names))
        chosen = draw(st.lists(st.sampled_from(present), min_size=1, max_size=2, unique=True))
        form = draw(st.sampled_from(["class", "tuple", "string"]))
        if form == "tuple":
            source: Any = tuple(chosen)
        elif form == "class":
            chosen = chosen[:1]
            source = chosen[0]
        else:
            chosen = chosen[:1]
            cls = chosen[0]
            full = f"{cls.__module__}.{cls.__qualname__}"
            short = cls.__name__ if cls.__module__.startswith("torch.nn") else full
            source = draw(st.sampled_from([full, short]))
        return source, [n for n in names if isinstance(modules[n], tuple(chosen))], True

    return draw_source()


def parameter_sources(model: nn.Module) -> st.SearchStrategy[tuple[str, list[str]]]:
    names = [n for n, _ in model.named_parameters()]

    @st.composite
    def draw_source(draw: st.DrawFn) -> tuple[str, list[str]]:
        name = draw(st.sampled_from(names))
        how = draw(st.sampled_from(["exact", "prefixed", "leaf", "part", "all"]))
        if how == "exact":
            return name, [name]
        if how == "prefixed":
            return "module." + name, [name]
        if how == "leaf":
            pattern = "*." + name.rsplit(".", 1)[-1]
        elif how == "part":
            parts = name.split(".")
            parts[draw(st.integers(0, len(parts) - 1))] = "*"
            pattern = ".".join(parts)
        else:
            pattern = "*"
        return pattern, [n for n in names if fnmatch.fnmatchcase(n, pattern)]

    return draw_source()


OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "detach": st.booleans(),
        "clone": st.booleans(),
        "keep": st.sampled_from(["all", "first", "last"]) | st.integers(1, 3),
        "dtype": st.sampled_from(["float64", torch.float64]),
        "device": st.sampled_from(["cpu", torch.device("cpu")]),  # already there: no copy
    },
)


@dataclass
class Spec:
    kind: str
    config: dict[str, Any]
    names: list[str]  # the streams expected, in named_modules / named_parameters order
    group: bool

    @property
    def keep(self) -> Any:
        return self.config.get("keep", "all")


@st.composite
def specs(draw: st.DrawFn, model: nn.Module, backward: bool) -> Spec:
    kinds = list(MODULE_VALUE_KINDS)
    has_params = any(True for _ in model.parameters())
    if has_params:
        kinds.append("Parameter")
    if backward:  # gradients weigh as much as values then
        kinds += ["ModuleOutputGrads"] * 2
        if has_params:
            kinds += ["ParameterGrad"] * 2
    kind = draw(st.sampled_from(kinds))
    if kind.startswith("Module"):
        source, names, group = draw(module_sources(model))
    else:
        source, names = draw(parameter_sources(model))
        group = any(c in source for c in "*?[")
    config: dict[str, Any] = {
        "type": draw(st.sampled_from([kind, kind + "Recorder"])),
        "source": source,
        **draw(OPTIONS),
    }
    if kind == "ParameterGrad":
        config.pop("clone", None)  # default True: .grad accumulates in place
    if kind == "ModuleInputs" and draw(st.booleans()):
        config["path"] = 0
    return Spec(kind, config, names, group)


# --------------------------------------------------------------------------- checks
def check_tensor(
    record: Any,
    value: torch.Tensor,
    requires_grad: bool,
    opts: dict[str, Any],
    source: torch.Tensor | None,
) -> None:
    """``record`` holds ``value`` transformed by the options; ``source`` is the live tensor."""
    assert isinstance(record, torch.Tensor)
    if opts.get("dtype") is not None:
        assert record.dtype == torch.float64
        assert torch.equal(record, value.double())
    else:
        assert record.dtype == value.dtype
        assert torch.equal(record, value)
    assert record.requires_grad == (requires_grad and not opts.get("detach", False))
    if source is None:
        return
    transformed = opts.get("detach") or opts.get("clone") or opts.get("dtype") is not None
    if not transformed:
        assert record is source
    elif opts.get("clone") or opts.get("dtype") is not None:
        assert record.data_ptr() != source.data_ptr()
    else:  # detached only: the same memory
        assert record.data_ptr() == source.data_ptr()


@dataclass
class Want:
    value: torch.Tensor
    requires_grad: bool
    modified: bool
    source: torch.Tensor | None = None  # the model's own tensor, when known
    names: tuple[str, ...] | None = None  # Arguments names (inputs)


def check_stream(stream: Any, wants: list[Want], spec: Spec, *, live: bool) -> None:
    """Records of ``stream`` against the wanted values (in call order) and the keep option."""
    opts = spec.config
    assert stream.num_calls == len(wants)
    kept = [wants[i] for i in kept_indices(len(wants), spec.keep)]
    assert len(stream) == len(kept)
    if not kept:
        with pytest.raises(NoRecordError, match="recorded nothing"):
            stream.get_record_data()
        assert stream.data_buffer == []
        return
    if any(w.modified for w in kept):
        with pytest.raises(RecordModifiedError, match="modified in place"):
            _ = stream.data_buffer
    else:
        assert len(stream.data_buffer) == len(kept)
    for j, want in enumerate(kept):
        if want.modified:
            with pytest.raises(RecordModifiedError, match="Pass clone=True"):
                stream.get_record_data(j)
            continue
        record = stream.get_record_data(j)
        source = want.source if live else None
        if want.names is not None and "path" not in opts:
            assert isinstance(record, Arguments)
            assert record.names == want.names
            assert len(record) == 1
            assert stream.get_record_data(j, want.names[0]) is record[0]
            assert stream.get_record_data(j, 0) is record[0]
            record = record[0]
        check_tensor(record, want.value, want.requires_grad, opts, source)


def check_grad_stream(stream: Any, chunks: list[list[torch.Tensor]], spec: Spec) -> None:
    """Gradient records: one per gradient arriving; each backward's set is known, not its order."""
    flat = [(i, g) for i, chunk in enumerate(chunks) for g in chunk]
    assert stream.num_calls == len(flat)
    kept = kept_indices(len(flat), spec.keep)
    assert len(stream) == len(kept)
    unused = [list(chunk) for chunk in chunks]
    for j, g_idx in enumerate(kept):
        record = stream.get_record_data(j)
        chunk = unused[flat[g_idx][0]]
        dtype = torch.float64 if spec.config.get("dtype") is not None else torch.float32
        assert record.dtype == dtype
        assert not record.requires_grad
        match = next(
            (k for k, g in enumerate(chunk) if torch.allclose(record, g.to(dtype), atol=1e-6)),
            None,
        )
        assert match is not None, f"gradient record {j} of {stream.name!r} matches no expected"
        chunk.pop(match)


def expectations(
    spec: Spec,
    model: nn.Module,
    calls_per_forward: list[list[Call]],
    grads_per_forward: list[dict[int, torch.Tensor]],
    param_grads: list[dict[str, torch.Tensor | None]],
    seen: dict[tuple[str, str], list[torch.Tensor]] | None,
) -> dict[str, Any]:
    """What each stream of ``spec`` must hold: wants (values) or chunks (gradients)."""
    name_of = {id(m): n for n, m in model.named_modules()}
    params = dict(model.named_parameters())
    out: dict[str, Any] = {}
    tracked = not spec.config.get("clone", False) and spec.config.get("dtype") is None
    for name in spec.names:
        if spec.kind == "Parameter":
            out[name] = [Want(params[name].detach(), True, False, params[name])]
        elif spec.kind == "ParameterGrad":
            # One record per backward that reached the parameter (its module ran).
            wants = []
            for calls, grads in zip(calls_per_forward, param_grads, strict=True):
                used = {id(p) for c in calls for p in c.module.parameters(recurse=False)}
                if id(params[name]) in used:
                    grad = grads[name]
                    assert grad is not None
                    wants.append(Want(grad, False, False))
            out[name] = wants
        elif spec.kind == "ModuleOutputGrads":
            out[name] = [
                [
                    grads[id(c.out)]
                    for c in calls
                    if name_of[id(c.module)] == name and id(c.out) in grads
                ]
                for calls, grads in zip(calls_per_forward, grads_per_forward, strict=True)
            ]
        else:
            inputs = spec.kind == "ModuleInputs"
            wants = []
            for calls in calls_per_forward:
                mine = [c for c in calls if name_of[id(c.module)] == name]
                for c in mine:
                    tensor = c.inp if inputs else c.out
                    expected_version = c.inp_version if inputs else c.out_version
                    value = c.inp_value if inputs else c.out_value
                    names = tuple(inspect.signature(c.module.forward).parameters)
                    wants.append(
                        Want(
                            value,
                            tensor.requires_grad,
                            tracked and version(tensor) != expected_version,
                            names=names if inputs else None,
                        )
                    )
            if seen is not None:
                objects = seen[(name, spec.kind)]
                assert len(objects) == len(wants)
                for want, obj in zip(wants, objects, strict=True):
                    want.source = obj
            out[name] = wants
    return out


def hand_hooks(model: nn.Module) -> tuple[list[Any], dict[tuple[str, str], list[torch.Tensor]]]:
    """Plain forward hooks (the baseline) that keep the tensors each module received / returned."""
    seen: dict[tuple[str, str], list[torch.Tensor]] = defaultdict(list)

    def pre(name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen[(name, "ModuleInputs")].append(args[0] if args else next(iter(kwargs.values())))

    def post(name: str, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen[(name, "ModuleOutputs")].append(output)

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(
                module.register_forward_pre_hook(functools.partial(pre, name), with_kwargs=True)
            )
            handles.append(module.register_forward_hook(functools.partial(post, name)))
    return handles, seen


MODES: dict[str, Callable[[], Any]] = {
    "grad": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference": torch.inference_mode,  # as in Lightning's validate() / test() / predict()
}


def version(tensor: torch.Tensor) -> int:
    """The version counter (inference tensors have none: -1)."""
    return -1 if tensor.is_inference() else tensor._version


def step(
    model: nn.Module, x: torch.Tensor, weight: torch.Tensor, backward: bool, mode: str = "grad"
) -> torch.Tensor:
    with MODES[mode]():
        out = model(x.clone())
    if backward:
        (out * weight).sum().backward()
    return out


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) + sum(
        len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()
    )


# --------------------------------------------------------------------------- the main property
@PROPERTY
@given(data=st.data())
def test_records_match_a_hand_computed_forward(data: st.DataObject) -> None:
    _records_match_the_oracle(data, data.draw(trees(), label="tree"))


@FEW
@given(data=st.data())
def test_in_place_changes_are_detected_or_copied_away(data: st.DataObject) -> None:
    _records_match_the_oracle(data, data.draw(trees(inplace=True), label="tree"))


def _records_match_the_oracle(data: st.DataObject, tree: Tree) -> None:
    model = tree.model
    backward = not tree.inplace and data.draw(st.booleans(), label="backward")
    # Forwards run with grad, under no_grad, or under inference_mode (whose tensors have no
    # version counter: in-place changes cannot be detected there, so no in-place layers then).
    modes = ["grad"] if backward else ["grad", "no_grad"] + ["inference"] * (not tree.inplace)
    mode = data.draw(st.sampled_from(modes), label="mode")
    drawn = data.draw(st.lists(specs(model, backward), min_size=1, max_size=3), label="specs")
    count = data.draw(st.integers(1, 3), label="calls")
    # With a backward, the data requires grad too, so every loss has a graph.
    xs = [torch.randn(2, tree.width).requires_grad_(backward) for _ in range(count)]
    weight = torch.randn(2, tree.out_width)
    hooks_before = live_hooks()

    # Wrapped as DDP (`module.`) or torch.compile (`_orig_mod.`) would: names stay the same.
    wrapper = data.draw(st.sampled_from(["", "module", "_orig_mod"]), label="wrapper")
    target = Wrapper(model, wrapper) if wrapper else model

    manager = RecorderManager({f"r{i}": s.config for i, s in enumerate(drawn)})
    manager.initialize(target)
    try:
        _check_manager(target, model, drawn, manager, xs, weight, backward, mode)
    finally:
        manager.release()
    assert live_hooks() == hooks_before
    assert hook_count(target) == 0


class Wrapper(nn.Module):
    """Holds the model under a wrapper attribute name, as DDP or torch.compile do."""

    def __init__(self, inner: nn.Module, attr: str) -> None:
        super().__init__()
        self.attr = attr
        self.add_module(attr, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.attr)(x)


def _check_manager(
    target: nn.Module,
    model: nn.Module,
    drawn: list[Spec],
    manager: RecorderManager,
    xs: list[torch.Tensor],
    weight: torch.Tensor,
    backward: bool,
    mode: str,
) -> None:
    recorders = [manager.get_recorder(f"r{i}") for i in range(len(drawn))]
    for spec, recorder in zip(drawn, recorders, strict=True):
        assert list(recorder.streams) == spec.names
        assert recorder.is_group == spec.group

    # Nothing is recorded before any context (a parameter is recorded at initialize).
    for x in xs:
        step(target, x, weight, backward, mode)
    for spec, recorder in zip(drawn, recorders, strict=True):
        for stream in recorder.streams.values():
            assert len(stream) == (1 if spec.kind == "Parameter" else 0)
            if spec.kind != "Parameter":
                with pytest.raises(NoRecordError, match=r"has recorded nothing .* yet"):
                    stream.get_record_data()
    model.zero_grad(set_to_none=True)

    # The oracle: the same forwards computed op by op, and their gradients.
    calls_per_forward: list[list[Call]] = []
    grads_per_forward: list[dict[int, torch.Tensor]] = []
    for x in xs:
        calls: list[Call] = []
        with MODES[mode]():
            out = oracle(model, x.clone(), calls)
        calls.pop()  # the root is never recorded
        calls_per_forward.append(calls)
        grads: dict[int, torch.Tensor] = {}
        if backward:
            tensors = list({id(c.out): c.out for c in calls if c.out.requires_grad}.values())
            found = torch.autograd.grad((out * weight).sum(), tensors, allow_unused=True)
            grads = {id(t): g for t, g in zip(tensors, found, strict=True) if g is not None}
        grads_per_forward.append(grads)

    # Record, with plain hooks watching the same calls.
    handles, seen = hand_hooks(model)
    param_grads: list[dict[str, torch.Tensor | None]] = []
    try:
        with manager:
            assert manager.recording
            for x in xs:
                step(target, x, weight, backward, mode)
                param_grads.append(
                    {
                        n: None if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()
                    }
                )
    finally:
        for handle in handles:
            handle.remove()
    assert not manager.recording

    wanted = [
        expectations(s, model, calls_per_forward, grads_per_forward, param_grads, seen)
        for s in drawn
    ]
    for spec, want in zip(drawn, wanted, strict=True):  # what the examples covered
        event(f"{spec.kind}, group={spec.group}, keep={spec.keep}")
        for wants in want.values():
            if spec.kind in MODULE_VALUE_KINDS and any(w.modified for w in wants):
                event("a record modified in place")
            if spec.kind in MODULE_VALUE_KINDS and len(wants) > 1:
                event("a module called more than once")
            if not wants:
                event("a stream with no calls")
    event(f"mode={mode}, backward={backward}")

    def check_all(live: bool) -> None:
        for spec, recorder, want in zip(drawn, recorders, wanted, strict=True):
            for name, stream in recorder.streams.items():
                if spec.kind in ("ModuleOutputGrads",):
                    check_grad_stream(stream, [list(c) for c in want[name]], spec)
                else:
                    check_stream(stream, want[name], spec, live=live)
            # The recorder reads its streams: directly for one name, by `source` for a group.
            for name, stream in recorder.streams.items():
                if not len(stream) or spec.kind == "ModuleOutputGrads":
                    continue
                kept = kept_indices(len(want[name]), spec.keep)
                if want[name][kept[-1]].modified:
                    continue
                if spec.group:
                    assert recorder.get_record_data(-1, source=name) is stream.get_record_data(-1)
                else:
                    assert recorder.get_record_data(-1) is stream.get_record_data(-1)
                    if not any(want[name][i].modified for i in kept):
                        assert recorder.data_buffer is stream.data_buffer
            if spec.group:
                with pytest.raises(RecorderStateError, match=r"records .* sources?"):
                    _ = recorder.data_buffer

    check_all(live=True)

    # Outside the context: nothing more is recorded.
    counts = [
        {n: (len(s), s.num_calls, s._records) for n, s in r.streams.items()} for r in recorders
    ]
    for x in xs:
        step(target, x, weight, backward, mode)
    for recorder, before in zip(recorders, counts, strict=True):
        for n, s in recorder.streams.items():
            assert (len(s), s.num_calls, s._records) == before[n]
    check_all(live=True)

    # The model pickles and deep-copies with hooks installed; copies carry only inert hooks.
    expected_out = target(xs[0].clone())
    pickled = pickle.loads(pickle.dumps(target))
    buffer = io.BytesIO()
    torch.save(target, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(target)
    for other in (pickled, loaded, twin):
        assert torch.equal(other(xs[0].clone()), expected_out)
        for module in other.modules():
            for hooks in (module._forward_hooks, module._forward_pre_hooks):
                assert all(h is _inert_hook for h in hooks.values())
    assert hook_count(twin) <= hook_count(target)

    # A new context starts fresh buffers; a copied model records nothing into them.
    with manager:
        for x in xs:
            step(twin, x, weight, backward, mode)
    for spec, recorder, before in zip(drawn, recorders, counts, strict=True):
        for n, s in recorder.streams.items():
            assert s._records is not before[n][2]  # a fresh list; the old one is untouched
            assert len(before[n][2]) == before[n][0]
            if spec.kind == "Parameter":
                assert len(s) == 1
            else:
                assert (len(s), s.num_calls) == (0, 0)
                with pytest.raises(NoRecordError, match=r"recorded nothing .* last context"):
                    s.get_record_data()

    # Record again, release: records stay readable, no hook is left anywhere.
    model.zero_grad(set_to_none=True)
    with manager:
        for x in xs:
            step(target, x, weight, backward, mode)
    manager.release()
    assert not manager.initialized
    assert hook_count(target) == 0
    check_all(live=False)
    with pytest.raises(NotInitializedError, match="not initialized"), manager:
        pass
    assert not manager.recording


@FEW
@given(
    calls=st.integers(0, 5),
    keep=st.sampled_from(["all", "first", "last"]) | st.integers(1, 4),
    entries=st.integers(1, 3),
    clone=st.booleans(),
)
def test_k_calls_give_k_records_in_call_order(
    calls: int, keep: Any, entries: int, clone: bool
) -> None:
    linear = nn.Linear(3, 3)
    model = Block([linear], [0] * calls, spare=None)
    recorder = ModuleOutputsRecorder("layers.0", keep=keep, clone=clone).initialize(model)
    try:
        for _ in range(entries):  # each entry starts afresh
            x = torch.randn(2, 3)
            expected = []
            y = x
            for _ in range(calls):
                y = F.linear(y, linear.weight, linear.bias)
                expected.append(y)
            with recorder:
                model(x)
            assert recorder.streams["layers.0"].num_calls == calls
            kept = kept_indices(calls, keep)
            assert len(recorder.data_buffer) == len(kept)
            for record, i in zip(recorder.data_buffer, kept, strict=True):
                assert torch.equal(record, expected[i])
    finally:
        recorder.release()


@FEW
@given(data=st.data())
def test_input_gradients_are_the_part_flowing_through_each_call(data: st.DataObject) -> None:
    tree = data.draw(trees(identity=False, inplace=False), label="tree")
    model = tree.model
    source, names, group = data.draw(module_sources(model), label="source")
    opts = data.draw(OPTIONS, label="options")
    count = data.draw(st.integers(1, 2), label="calls")
    xs = [torch.randn(2, tree.width).requires_grad_() for _ in range(count)]
    weight = torch.randn(2, tree.out_width)
    name_of = {id(m): n for n, m in model.named_modules()}

    chunks: dict[str, list[list[torch.Tensor]]] = {n: [] for n in names}
    for x in xs:
        calls: list[Call] = []
        out = oracle(model, x.clone(), calls)
        calls.pop()
        loss = (out * weight).sum()
        outs = list({id(c.out): c.out for c in calls if c.out.requires_grad}.values())
        g_out = dict(
            zip(map(id, outs), torch.autograd.grad(loss, outs, retain_graph=True), strict=True)
        )
        for name in names:
            chunk = []
            for c in calls:
                if name_of[id(c.module)] == name and c.inp.requires_grad:
                    (g,) = torch.autograd.grad(c.out, c.inp, g_out[id(c.out)], retain_graph=True)
                    chunk.append(g)
            chunks[name].append(chunk)

    recorder = ModuleInputGradsRecorder(source, **opts).initialize(model)
    try:
        with recorder:
            for x in xs:
                step(model, x, weight, backward=True)
        assert recorder.is_group == group
        spec = Spec("ModuleInputGrads", {"source": source, **opts}, names, group)
        assert list(recorder.streams) == names
        for name, stream in recorder.streams.items():
            check_grad_stream(stream, chunks[name], spec)
        before = {n: s.num_calls for n, s in recorder.streams.items()}
        for x in xs:
            step(model, x, weight, backward=True)
        assert {n: s.num_calls for n, s in recorder.streams.items()} == before
    finally:
        recorder.release()
    assert hook_count(model) == 0


# --------------------------------------------------------------------------- argument normalisation
@dataclass
class Signature:
    source: str  # "def f(...): return None"
    params: list[inspect.Parameter]


@st.composite
def signatures(draw: st.DrawFn, first: str = "") -> Signature:
    n_posonly = draw(st.integers(0, 2))
    n_pos = draw(st.integers(0, 3))
    n_kwonly = draw(st.integers(0, 2))
    n_defaults = draw(st.integers(0, n_posonly + n_pos))
    var_args, var_kw = draw(st.booleans()), draw(st.booleans())
    P = inspect.Parameter
    params: list[inspect.Parameter] = []
    for i in range(n_posonly + n_pos):
        kind = P.POSITIONAL_ONLY if i < n_posonly else P.POSITIONAL_OR_KEYWORD
        default = 100 + i if i >= n_posonly + n_pos - n_defaults else P.empty
        params.append(P(f"p{i}", kind, default=default))
    if var_args:
        params.append(P("rest", P.VAR_POSITIONAL))
    for i in range(n_kwonly):
        default = 200 + i if draw(st.booleans()) else P.empty
        params.append(P(f"k{i}", P.KEYWORD_ONLY, default=default))
    if var_kw:
        params.append(P("extra", P.VAR_KEYWORD))
    sig = str(inspect.Signature(params))[1:-1]
    if first:
        sig = f"{first}, {sig}" if sig else first
    return Signature(f"def f({sig}):\n    return None\n", params)


@dataclass
class CallForm:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@st.composite
def equivalent_calls(draw: st.DrawFn, sig: Signature) -> tuple[Arguments, list[CallForm]]:
    """A call's normalised record (computed here) and several equivalent ways to write the call."""
    P = inspect.Parameter
    values: dict[str, Any] = {}
    counter = iter(range(1000, 2000))
    rest: list[Any] = []
    extra: dict[str, Any] = {}
    for p in sig.params:
        if p.kind is P.VAR_POSITIONAL:
            rest = [next(counter) for _ in range(draw(st.integers(0, 2)))]
        elif p.kind is P.VAR_KEYWORD:
            keys = draw(st.lists(st.sampled_from(["x0", "x1", "x2"]), max_size=3, unique=True))
            extra = {k: next(counter) for k in keys}
        elif p.default is P.empty or draw(st.booleans()):
            values[p.name] = next(counter)
        else:
            values[p.name] = p.default
    names: list[str] = []
    expected: list[Any] = []
    for p in sig.params:
        if p.kind is P.VAR_POSITIONAL:
            names += [f"rest[{i}]" for i in range(len(rest))]
            expected += rest
        elif p.kind is P.VAR_KEYWORD:
            names += sorted(extra)
            expected += [extra[k] for k in sorted(extra)]
        else:
            names.append(p.name)
            expected.append(values[p.name])

    positional = [p for p in sig.params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    keyword_only = [p for p in sig.params if p.kind is P.KEYWORD_ONLY]
    lowest = len(positional) if rest else 0
    for i, p in enumerate(positional):
        if p.kind is P.POSITIONAL_ONLY and values[p.name] != p.default:
            lowest = max(lowest, i + 1)
    forms = []
    for _ in range(draw(st.integers(2, 4))):
        cut = draw(st.integers(lowest, len(positional)))
        args = [values[p.name] for p in positional[:cut]] + (rest if cut == len(positional) else [])
        kwargs: dict[str, Any] = {}
        for p in positional[cut:] + keyword_only:
            omit = p.kind is P.POSITIONAL_ONLY or (
                values[p.name] == p.default and draw(st.booleans())
            )
            if not omit:
                kwargs[p.name] = values[p.name]
        kwargs.update(extra)
        order = draw(st.permutations(list(kwargs)))
        forms.append(CallForm(tuple(args), {k: kwargs[k] for k in order}))
    return Arguments(expected, names), forms


def compile_function(source: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    return namespace["f"]


def same_record(record: Any, expected: Arguments) -> None:
    assert isinstance(record, Arguments)
    assert tuple(record) == tuple(expected)
    assert record.names == expected.names
    assert record.as_dict() == expected.as_dict()


@PROPERTY
@given(data=st.data())
def test_binder_gives_one_record_for_every_equivalent_call(data: st.DataObject) -> None:
    sig = data.draw(signatures(), label="signature")
    fn = compile_function(sig.source)
    expected, forms = data.draw(equivalent_calls(sig), label="calls")
    binder = Binder(fn)
    for form in forms:
        fn(*form.args, **form.kwargs)  # the form is a valid call
        record = binder(form.args, form.kwargs)
        same_record(record, expected)
        clone = pickle.loads(pickle.dumps(record))
        same_record(clone, expected)


@FEW
@given(data=st.data())
def test_module_inputs_record_every_equivalent_call_alike(data: st.DataObject) -> None:
    sig = data.draw(signatures(first="self"), label="signature")
    forward = compile_function(sig.source)
    model = nn.Module()
    model.inner = type("Generated", (nn.Module,), {"forward": forward})()
    expected, forms = data.draw(equivalent_calls(sig), label="calls")
    keep = data.draw(st.sampled_from(["all", "last"]))
    recorder = ModuleInputsRecorder("inner", keep=keep).initialize(model)
    try:
        with recorder:
            for form in forms:
                model.inner(*form.args, **form.kwargs)
        assert not recorder.recording
        assert len(recorder.data_buffer) == (len(forms) if keep == "all" else 1)
        assert recorder.get_record_data(-1).names == expected.names
        for record in recorder.data_buffer:
            same_record(record, expected)
    finally:
        recorder.release()


@FEW
@given(data=st.data())
def test_function_inputs_record_every_equivalent_call_alike(data: st.DataObject) -> None:
    sig = data.draw(signatures(), label="signature")
    module = sys.modules[__name__]
    module.generated = compile_function(sig.source)  # type: ignore[attr-defined]
    try:
        expected, forms = data.draw(equivalent_calls(sig), label="calls")
        recorder = FunctionInputsRecorder(f"{__name__}.generated").initialize()
        try:
            with recorder:
                for form in forms:
                    generated(*form.args, **form.kwargs)  # type: ignore[name-defined]  # noqa: F821
            assert len(recorder.data_buffer) == len(forms)
            for record in recorder.data_buffer:
                same_record(record, expected)
        finally:
            recorder.release()
    finally:
        del module.generated  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- regressions
def test_manager_entry_that_fails_leaves_no_recorder_recording() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    manager = RecorderManager({"first": {"type": "ModuleOutputs", "source": "0"}})
    manager.initialize(model)
    manager.add_recorder("late", {"type": "ModuleOutputs", "source": "1"})  # not initialized
    try:
        with pytest.raises(NotInitializedError, match="not initialized"), manager:
            pass
        assert not manager.recording
        assert not manager.get_recorder("first").recording
        model(torch.randn(1, 2))
        assert len(manager.get_recorder("first").data_buffer) == 0
    finally:
        manager.release()


def test_a_stream_outliving_its_recorder_still_raises_no_record_error() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    recorder = ModuleOutputsRecorder("0").initialize(model)
    stream = recorder.streams["0"]
    del recorder  # its hooks go with it
    assert hook_count(model) == 0
    with pytest.raises(NoRecordError, match="recorded nothing for '0'"):
        stream.get_record_data()


def scaled(x: float) -> float:
    return 2 * x


def test_a_dropped_function_recorder_restores_the_function() -> None:
    original = scaled
    # persistent: patched from initialize to release (the compile-friendly mode)
    recorder = FunctionOutputsRecorder(f"{__name__}.scaled", persistent=True).initialize()
    assert scaled is not original  # patched
    del recorder  # like a hook, a patch must not keep its recorder alive
    assert scaled is original


def test_records_taken_under_inference_mode() -> None:
    # Lightning's standalone validate() / test() / predict() run under inference_mode, whose
    # tensors carry no version counter.
    model = nn.Sequential(nn.Linear(2, 2))
    recorder = ModuleOutputsRecorder("0").initialize(model)
    try:
        with recorder, torch.inference_mode():
            out = model(torch.randn(1, 2))
        assert recorder.get_record_data() is out
        assert recorder.data_buffer == [out]
    finally:
        recorder.release()
