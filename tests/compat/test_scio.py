"""scio's ``Recorder`` tests, re-expressed with this package's ``Inspector``.

Source: https://github.com/ThalesGroup/scio at commit 3aceaf464195cb9bc0d915a498e9a2817ee29144,
files ``test/scio/recorder/test_recorder.py`` (22 test functions), ``test/scio/recorder/
test_conftest.py`` (1) and their fixtures ``test/scio/recorder/conftest.py`` and
``test/scio/conftest.py`` (``Net3DFactory``); expected outputs in ``test/expected/test_recorder_*``;
the behaviours they rely on are in ``scio/recorder.py``.

The network is scio's ``Net3DFactory`` at its minimal size (conv 1→2 channels 3x3, softplus with
beta 0.4, 2x2 max-pool, flatten, linear 2→2) with parameters drawn from a seeded generator, run on
``torch.rand(5, 1, 4, 4)``, float32 on CPU (scio's ``float-cpu`` case); ``layer_func`` recomputes
each layer with ``torch.nn.functional``. ``LAYERS_*`` are scio's parameter sets.

=================================================  ==============================================
scio test                                          covered by
=================================================  ==============================================
test_recorder_passes_torchinfo_kwargs              test_torchinfo_kwargs_pass_through
test_recorder_repr                                 test_repr
test_invalid_record                                test_invalid_record
test_invalid_record_with_hint                      test_invalid_record_with_hint;
                                                   test_invalid_record_hint_names_the_pair
test_recording                                     test_recording; nested network:
                                                   test_recording_sorted_when_nested
test_correct_activations                           test_correct_activations
test_layer_01                                      test_layer_01
test_dont_record                                   test_dont_record
test_correct_activations_with_postproc             test_correct_activations_with_postproc
test_no_interference_multiple_recorder             test_no_interference_multiple_inspectors
                                                   (every layer instead of a random one)
test_recorded_modules                              test_recorded_modules
test_recorded_params                               test_recorded_params
test_respects_grad                                 test_respects_grad
test_recorder_forward_with_kwarg                   test_forward_with_kwarg
test_dynamic_flow_requires_enabling                test_dynamic_flow_requires_enabling
                                                   (with ``force_static_flow=True``: the default
                                                   here is ``False``)
test_recorder_manages_refs                         test_manages_refs
test_recorder_requires_shape_info                  test_requires_shape_info
test_recorder_activation_postproc_as_list          test_postproc_list_order (scio's order, and
                                                   the current activations seen from inside),
                                                   test_postproc_list_order_alone;
                                                   test_postproc_list_without_recorded_layers;
                                                   test_postproc_list_must_fit (difference)
test_recorder_activation_postproc_missing          test_postproc_list_missing
test_recorder_missing_activation                   test_missing_activation
test_lazy_func_works                               difference: scio's private weak-reference
                                                   helper; what it is for (hooks do not keep the
                                                   wrapper alive) is test_manages_refs
test_layer_info_util                               test_root_layer_row; test_summary_is_model_
                                                   statistics; the ``None`` ``depth_index``
                                                   guard is internal to scio's torchinfo use
test_conftest::test_layer_func_raises_on_invalid   test_layer_func_raises_on_invalid (this
                                                   file's helper, as scio checks its own)
=================================================  ==============================================

Documented differences (``docs/inspector.md``): the table shows the root row's label ``0-1``
and a ``Recorded`` column, opens with ``Inspector of <Net>`` and has no size estimates; parameter
names have no ``_net.`` prefix; a list of post-processors must have exactly one per recorded
layer; errors are this package's (``UnknownSourceError``/``RecorderConfigError`` are
``ValueError``s, ``RecorderStateError`` a ``RuntimeError``); ``dont_record=True`` leaves the
latest recording forward's activations in place where scio empties them (scio's tests only check
a fresh wrapper, which is empty either way).
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterator
from functools import partial
from itertools import chain, combinations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_recorder import RecorderConfigError, RecorderStateError, UnknownSourceError
from lightning_recorder.inspector import Inspector

Label = tuple[int, int]
LAYERS_ALL: tuple[Label, ...] = tuple((1, i) for i in range(1, 6))
LAYERS_RECORD: tuple[tuple[Label, ...], ...] = (
    (),
    ((1, 4),),
    ((1, 3), (1, 1)),
    ((1, 5), (1, 2), (0, 1), (1, 5)),
)
LAYERS_FORWARD: tuple[tuple[Label, ...], ...] = tuple(
    chain.from_iterable(combinations(LAYERS_ALL, n) for n in (0, 1, 2, 5))
)
N_SAMPLES = 5


class Net3D(nn.Module):
    """conv > softplus > pool > flatten > fc on 1x4x4 samples.

    A layer named in ``skip`` still computes, through ``forward`` instead of a module call, so no
    hook sees it: for a recorder, that layer did not run.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(2, 2)
        self.softplus = nn.Softplus(beta=0.4)
        self.skip: set[str] = set()

    def forward(self, x: Tensor) -> Tensor:
        for name in ("conv", "softplus", "pool", "flatten", "fc"):
            layer = getattr(self, name)
            x = layer.forward(x) if name in self.skip else layer(x)
        return x


@pytest.fixture
def params() -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"conv.weight": (2, 1, 3, 3), "conv.bias": (2,), "fc.weight": (2, 2), "fc.bias": (2,)}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


@pytest.fixture
def net(params: dict[str, Tensor]) -> Net3D:
    model = Net3D()
    model.load_state_dict(params, strict=True)
    return model


@pytest.fixture
def data() -> Tensor:
    return torch.rand(N_SAMPLES, 1, 4, 4, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def rnet(net: Net3D, data: Tensor) -> Iterator[Inspector]:
    inspector = Inspector(net, input_data=data)
    yield inspector
    inspector.release()


@pytest.fixture
def layer_func(params: dict[str, Tensor]) -> Callable[[Label], Callable[[Tensor], Tensor]]:
    def inner(layer: Label) -> Callable[[Tensor], Tensor]:
        if layer == (1, 1):
            return partial(F.conv2d, weight=params["conv.weight"], bias=params["conv.bias"])
        if layer == (1, 2):
            return partial(F.softplus, beta=0.4)
        if layer == (1, 3):
            return partial(F.max_pool2d, kernel_size=2)
        if layer == (1, 4):
            return partial(torch.flatten, start_dim=1)
        if layer == (1, 5):
            return partial(F.linear, weight=params["fc.weight"], bias=params["fc.bias"])
        raise ValueError(f"Invalid layer: {layer}")

    return inner


def by_hand(layer_func: Callable[[Label], Callable[[Tensor], Tensor]], x: Tensor) -> list[Tensor]:
    """The output of each of LAYERS_ALL, in order, computed with the functional ops."""
    outputs = []
    for layer in LAYERS_ALL:
        x = layer_func(layer)(x)
        outputs.append(x)
    return outputs


# Functional ops against the same ops inside modules, same dtype and device: equal up to the
# float32 rounding of differently fused kernels, well inside assert_close's float32 defaults.


@pytest.mark.parametrize("layer", [0, (1, 6)])
def test_layer_func_raises_on_invalid(
    layer_func: Callable[[Label], Callable[[Tensor], Tensor]], layer: object
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(f'Invalid layer: {layer}')}$"):
        layer_func(layer)  # type: ignore[arg-type]


def test_torchinfo_kwargs_pass_through(net: Net3D, data: Tensor) -> None:
    inspector = Inspector(net, input_data=data, col_names=["output_size"])
    try:
        text = repr(inspector)
        assert "Output Shape" in text
        assert "Input Shape" not in text and "Param #" not in text
        assert re.search(r"Conv2d \(conv\): 1-1\s+\[5, 2, 2, 2\]\s*\n", text)
    finally:
        inspector.release()


ROWS = [
    r"Conv2d \(conv\): 1-1\s+\[5, 1, 4, 4\]\s+\[5, 2, 2, 2\]\s+20\s+76\.92%",
    r"Softplus \(softplus\): 1-2\s+\[5, 2, 2, 2\]\s+\[5, 2, 2, 2\]\s+--\s+--",
    r"MaxPool2d \(pool\): 1-3\s+\[5, 2, 2, 2\]\s+\[5, 2, 1, 1\]\s+--\s+--",
    r"Flatten \(flatten\): 1-4\s+\[5, 2, 1, 1\]\s+\[5, 2\]\s+--\s+--",
    r"Linear \(fc\): 1-5\s+\[5, 2\]\s+\[5, 2\]\s+6\s+23\.08%",
]
RECORDING_LINE = ["None", "1-4", "1-1, 1-3", "0-1, 1-2, 1-5"]


@pytest.mark.parametrize(("layers", "line"), list(zip(LAYERS_RECORD, RECORDING_LINE, strict=True)))
def test_repr(rnet: Inspector, layers: tuple[Label, ...], line: str) -> None:
    rnet.record(*layers)
    text = repr(rnet)
    for row in ROWS:
        assert re.search(row, text), row
    assert re.search(r"Net3D \(Net3D\): 0-1\s+\[5, 1, 4, 4\]\s+\[5, 2\]", text)
    assert "Total params: 26\nTrainable params: 26\nNon-trainable params: 0" in text
    assert f"\nCurrently recording: {line}\n" in text


def test_invalid_record(rnet: Inspector) -> None:
    rnet.record((1, 2))
    with pytest.raises(UnknownSourceError, match="No layer labelled 1-0"):
        rnet.record((1, 0))
    assert rnet.recording == ((1, 2),)  # the operation was cancelled


def test_invalid_record_with_hint(rnet: Inspector) -> None:
    with pytest.raises(ValueError, match=r"such as \(1, 3\) or '1-3'"):
        rnet.record(1, 3)  # type: ignore[arg-type]
    assert rnet.recording == ()


def test_invalid_record_hint_names_the_pair(rnet: Inspector) -> None:
    with pytest.raises(ValueError, match=re.escape("rnet.record((1, 2))")):
        rnet.record(1, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("layers", [*LAYERS_RECORD, *LAYERS_FORWARD])
def test_recording(rnet: Inspector, layers: tuple[Label, ...]) -> None:
    rnet.record(*layers)
    assert rnet.recording == tuple(sorted(set(layers)))


def test_recording_sorted_when_nested() -> None:
    net = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    with Inspector(net, input_size=(1, 2)) as inspector:
        inspector.record((2, 1), (1, 2))
        assert inspector.recording == ((1, 2), (2, 1))


@pytest.mark.parametrize("layers", LAYERS_FORWARD)
def test_correct_activations(
    rnet: Inspector,
    layers: tuple[Label, ...],
    data: Tensor,
    layer_func: Callable[[Label], Callable[[Tensor], Tensor]],
) -> None:
    rnet.record(*layers)
    out = rnet(data)
    activations = rnet.activations
    assert tuple(sorted(activations)) == rnet.recording
    expected = by_hand(layer_func, data)
    for layer, value in zip(LAYERS_ALL, expected, strict=True):
        if layer in layers:
            torch.testing.assert_close(activations[layer], value, msg=f"Layer: {layer}")
    torch.testing.assert_close(out, expected[-1])


def test_layer_01(rnet: Inspector, data: Tensor) -> None:
    rnet.record((0, 1))
    out = rnet(data)
    torch.testing.assert_close(rnet.activations[(0, 1)], out, rtol=0, atol=0)  # the same tensor


def test_dont_record(rnet: Inspector, data: Tensor) -> None:
    rnet.record((0, 1))
    rnet(data, dont_record=True)
    assert not rnet.activations


@pytest.mark.parametrize("dont_record", [True, False])
@pytest.mark.parametrize("layers", LAYERS_FORWARD)
def test_correct_activations_with_postproc(
    rnet: Inspector,
    layers: tuple[Label, ...],
    data: Tensor,
    dont_record: bool,
    layer_func: Callable[[Label], Callable[[Tensor], Tensor]],
) -> None:
    rnet.record(*layers)
    postproc = partial(torch.roll, shifts=1)  # changes the network's output
    out = rnet(data, activation_postproc=postproc, dont_record=dont_record)
    activations = rnet.activations
    if dont_record:
        assert not activations
    expected = data
    for layer in LAYERS_ALL:
        expected = layer_func(layer)(expected)
        if layer in layers:
            if not dont_record:
                torch.testing.assert_close(activations[layer], expected, msg=f"Layer: {layer}")
            expected = postproc(expected)
    torch.testing.assert_close(out, expected)
    if layers:
        assert not torch.allclose(rnet(data), out)


@pytest.mark.parametrize("layer", LAYERS_ALL)
def test_no_interference_multiple_inspectors(net: Net3D, data: Tensor, layer: Label) -> None:
    with Inspector(net, input_data=data) as first, Inspector(net, input_data=data) as second:
        first.record(layer)
        second.record(layer)
        assert layer not in first.activations and layer not in second.activations
        first(data)
        assert layer in first.activations
        assert layer not in second.activations
        second(data)
        # The same modules on the same input: the same values.
        torch.testing.assert_close(first.activations[layer], second.activations[layer])


@pytest.mark.parametrize("layers", LAYERS_RECORD)
def test_recorded_modules(rnet: Inspector, net: Net3D, layers: tuple[Label, ...]) -> None:
    modules = {
        (0, 1): net,
        (1, 1): net.conv,
        (1, 2): net.softplus,
        (1, 3): net.pool,
        (1, 4): net.flatten,
        (1, 5): net.fc,
    }
    rnet.record(*layers)
    assert dict(rnet.recorded_modules) == {layer: modules[layer] for layer in layers}


@pytest.mark.parametrize("layers", LAYERS_RECORD)
def test_recorded_params(
    rnet: Inspector, params: dict[str, Tensor], layers: tuple[Label, ...]
) -> None:
    rnet.record(*layers)
    expected = {}
    if (0, 1) in layers or (1, 1) in layers:
        expected |= {name: params[name] for name in ("conv.weight", "conv.bias")}
    if (0, 1) in layers or (1, 5) in layers:
        expected |= {name: params[name] for name in ("fc.weight", "fc.bias")}
    observed = rnet.recorded_params
    assert observed.keys() == expected.keys()
    for name, value in observed.items():
        # load_state_dict copied these very values: exact equality.
        torch.testing.assert_close(value.detach(), expected[name], rtol=0, atol=0)


def test_respects_grad(
    rnet: Inspector, data: Tensor, layer_func: Callable[[Label], Callable[[Tensor], Tensor]]
) -> None:
    data.requires_grad_()
    by_hand(layer_func, data)[-1].sum().backward()
    expected = data.grad
    assert expected is not None and expected.shape == data.shape
    data.grad = None
    rnet(data).sum().backward()
    torch.testing.assert_close(data.grad, expected)


class RaisesOnKeyword(nn.Module):
    """Returns its input, or raises when ``obj`` is the given object."""

    def __init__(self, null: object) -> None:
        super().__init__()
        self.null = null

    def forward(self, x: Tensor, *, obj: object = 0) -> Tensor:
        if obj is self.null:
            raise ValueError(f"'obj' should not be {self.null!r}")
        return x


def test_forward_with_kwarg(data: Tensor) -> None:
    null = object()
    with Inspector(RaisesOnKeyword(null), input_size=(1,)) as inspector:
        torch.testing.assert_close(inspector(data), data, rtol=0, atol=0)
        message = f"'obj' should not be {null!r}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            inspector(data, obj=null)


class DynamicFlow(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x if x.sum() > 0 else -x


def test_dynamic_flow_requires_enabling(data: Tensor) -> None:
    """scio checks by default; here the check is asked for (the default accepts any network)."""
    with pytest.raises(RuntimeError, match=re.escape("force_static_flow=False")):
        Inspector(DynamicFlow(), input_data=data, force_static_flow=True)
    Inspector(DynamicFlow(), input_data=data, force_static_flow=False).release()
    Inspector(DynamicFlow(), input_data=data).release()
    Inspector(Net3D(), input_data=data, force_static_flow=True).release()  # a static network


def _hook_count(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def test_manages_refs(net: Net3D, data: Tensor) -> None:
    gc.collect()
    refs_before = len(gc.get_referrers(net))
    assert _hook_count(net) == 0
    inspector = Inspector(net, input_data=data)
    inspector.record((1, 1))
    gc.collect()
    assert _hook_count(net) > 0
    assert len(gc.get_referrers(net)) > refs_before
    del inspector  # no release(): garbage collection alone removes the hooks
    gc.collect()
    assert _hook_count(net) == 0
    assert len(gc.get_referrers(net)) == refs_before


def test_requires_shape_info(net: Net3D) -> None:
    with pytest.raises(RecorderConfigError, match=r"`input_size`.*or `input_data`.*got neither"):
        Inspector(net)


def _postproc_spy(rnet: Inspector, seen: list[set[Label]]) -> Callable[[Tensor], None]:
    def spy(tensor: Tensor) -> None:
        seen.append({layer for layer, act in rnet.activations.items() if act is tensor})

    return spy


# scio's expected output: the i-th callable runs on the i-th recorded layer to finish (forward
# hooks' order), and sees that layer's output among the activations of the current forward.
POSTPROC_ORDER = [
    (((1, 4),), [{(1, 4)}]),
    (((1, 3), (1, 1)), [{(1, 1)}, {(1, 3)}]),
    (((1, 5), (1, 2), (0, 1), (1, 5)), [{(1, 2)}, {(1, 5)}, {(0, 1), (1, 5)}]),
]


@pytest.mark.parametrize(("layers", "expected"), POSTPROC_ORDER)
def test_postproc_list_order(
    rnet: Inspector, data: Tensor, layers: tuple[Label, ...], expected: list[set[Label]]
) -> None:
    rnet.record(*layers)
    seen: list[set[Label]] = []
    rnet(data, activation_postproc=[_postproc_spy(rnet, seen) for _ in expected])
    assert seen == expected


def test_postproc_list_order_alone(rnet: Inspector, data: Tensor) -> None:
    """The order alone, told by output shapes: 1-2 ends first, then 1-5, then the root 0-1."""
    rnet.record((1, 5), (1, 2), (0, 1))
    calls: list[tuple[int, tuple[int, ...]]] = []

    def numbered(i: int) -> Callable[[Tensor], None]:
        return lambda t: calls.append((i, tuple(t.shape)))

    rnet(data, activation_postproc=[numbered(i) for i in range(3)])
    assert calls == [(0, (5, 2, 2, 2)), (1, (5, 2)), (2, (5, 2))]


def test_postproc_list_without_recorded_layers(rnet: Inspector, data: Tensor) -> None:
    """With no recorded layer, no post-processor runs and the output is unchanged."""
    out = rnet(data, activation_postproc=[])
    torch.testing.assert_close(out, rnet(data), rtol=0, atol=0)  # the same computation


def test_postproc_list_must_fit(rnet: Inspector, data: Tensor) -> None:
    """scio ignores extra callables; here a list must fit the recorded layers exactly."""
    rnet.record((1, 3), (1, 1))
    spies = [_postproc_spy(rnet, []) for _ in range(5)]
    with pytest.raises(RecorderConfigError, match="a list of 2 callables, one per recorded layer"):
        rnet(data, activation_postproc=spies)


def test_postproc_list_missing(rnet: Inspector, data: Tensor) -> None:
    rnet.record(*LAYERS_ALL)
    with pytest.raises(ValueError, match="a list of 5 callables, one per recorded layer"):
        rnet(data, activation_postproc=[])


NAMES = {(1, 1): "conv", (1, 2): "softplus", (1, 3): "pool", (1, 4): "flatten", (1, 5): "fc"}


@pytest.mark.parametrize("layers", [layers for layers in LAYERS_RECORD if layers])
def test_missing_activation(
    rnet: Inspector, net: Net3D, data: Tensor, layers: tuple[Label, ...]
) -> None:
    rnet.record(*layers)
    skipped = [layer for layer in rnet.recording if layer in NAMES]
    net.skip = {NAMES[layer] for layer in skipped}  # those layers no longer run as modules
    pattern = ".*".join(f"{depth}-{idx}" for depth, idx in skipped)
    with pytest.raises(RuntimeError, match=f"every recorded layer to run.*{pattern}"):
        rnet(data)
    with pytest.raises(RecorderStateError, match="The control flow differs from the traced"):
        rnet(data)


def test_root_layer_row(rnet: Inspector) -> None:
    assert rnet.layers[0].label == (0, 1)
    assert rnet.layers[0].type_name == "Net3D"


def test_summary_is_model_statistics(rnet: Inspector) -> None:
    torchinfo = pytest.importorskip("torchinfo")
    assert isinstance(rnet.summary, torchinfo.ModelStatistics)
    first = rnet.summary.summary_list[0]
    assert (first.depth, first.depth_index) == (0, 1)
