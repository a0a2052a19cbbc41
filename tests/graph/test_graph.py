"""Execution graphs: what is recorded, depth collapsing, export and rendering, and that the
recording changes nothing about the computation."""

from __future__ import annotations

import copy
import graphlib
import json
import re
import runpy
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_recorder._core.hooks import live_hooks
from lightning_recorder.errors import (
    NoRecordError,
    RecorderConfigError,
    RecorderStateError,
    UnknownSourceError,
)
from lightning_recorder.graph import (
    ExecutionGraph,
    GraphEdge,
    GraphNode,
    GraphRecorder,
    record_graph,
)
from lightning_recorder.graph import _builder as _graph_record

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None,
    reason="Graphviz `dot` is not installed (the Makefile's set-up installs it)",
)


class SmallCNN(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.ReLU()),
            nn.AdaptiveAvgPool2d(1),
        )
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.drop(self.features(x).flatten(1)))


class Shared(nn.Module):
    """One block called twice, an in-place ReLU, an identity, kwargs, a structured output."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.same = nn.Identity()

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict[str, object]:
        h = self.same(self.act(self.block(x)))
        h = self.block(h) * scale
        return {"h": h, "pair": (h.sum(), None)}


@pytest.fixture
def cnn() -> SmallCNN:
    torch.manual_seed(0)
    return SmallCNN()


@pytest.fixture
def graph(cnn: SmallCNN) -> ExecutionGraph:
    return record_graph(cnn, torch.randn(2, 3, 8, 8))


def by_name(graph: ExecutionGraph, kind: str) -> dict[str, GraphNode]:
    return {n.name: n for n in graph.find(kind=kind)}  # type: ignore[arg-type]


def assert_acyclic(graph: ExecutionGraph) -> list[str]:
    sorter: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter()
    for node in graph.nodes:
        sorter.add(node.id)
    for edge in graph.edges:
        sorter.add(edge.dst, edge.src)
    return list(sorter.static_order())  # raises graphlib.CycleError on a cycle


def reaches(graph: ExecutionGraph, src: str, dst: str) -> bool:
    seen, todo = {src}, [src]
    while todo:
        for nxt in graph.successors(todo.pop()):
            if nxt.id not in seen:
                seen.add(nxt.id)
                todo.append(nxt.id)
    return dst in seen


# ---------------------------------------------------------------- what is recorded
def test_module_nodes_have_nesting_depths_and_parents(graph: ExecutionGraph) -> None:
    modules = by_name(graph, "module")
    expected = {
        "": (0, None, "SmallCNN"),
        "features": (1, "module:<root>", "Sequential"),
        "features.0": (2, "module:features", "Conv2d"),
        "features.3": (2, "module:features", "Sequential"),
        "features.3.0": (3, "module:features.3", "Conv2d"),
        "features.3.1": (3, "module:features.3", "ReLU"),
        "classifier": (1, "module:<root>", "Linear"),
    }
    for name, (depth, parent, type_) in expected.items():
        node = modules[name]
        assert (node.depth, node.parent, node.type) == (depth, parent, type_), name
    assert len(modules) == 11  # every module called once
    assert modules["features.3.0"].label == "features.3.0\nConv2d"


def test_parameters_belong_to_their_module_and_feed_its_operations(graph: ExecutionGraph) -> None:
    params = by_name(graph, "parameter")
    assert set(params) == {f"{m}.{p}" for m in ("features.0", "features.3.0", "classifier")
                           for p in ("weight", "bias")}  # fmt: skip
    weight = params["features.3.0.weight"]
    assert (weight.parent, weight.depth, weight.shape) == ("module:features.3.0", 4, (6, 4, 3, 3))
    assert weight.label == "weight\n(6, 4, 3, 3)" and weight.dtype == "float32"
    (conv,) = graph.successors(weight.id)
    assert (conv.kind, conv.name, conv.parent) == ("op", "ConvolutionBackward0", weight.parent)


def test_operations_are_given_to_the_innermost_module_call(graph: ExecutionGraph) -> None:
    ops = {(n.label, n.parent) for n in graph.find(kind="op")}
    assert ("Convolution", "module:features.0") in ops
    assert ("Convolution", "module:features.3.0") in ops
    assert ("Relu", "module:features.3.1") in ops
    assert ("View", "module:<root>") in ops  # .flatten(1) in the model's own forward
    assert ("Addmm", "module:classifier") in ops
    for op in graph.find(kind="op"):
        assert op.depth == graph.node(op.parent).depth + 1  # type: ignore[arg-type]


def test_tensors_at_module_boundaries(graph: ExecutionGraph) -> None:
    tensors = by_name(graph, "tensor")
    assert (tensors["x"].depth, tensors["x"].parent, tensors["x"].shape) == (0, None, (2, 3, 8, 8))
    assert tensors["output"].label == "output\n(2, 3)"
    between = tensors["features.0:out"]  # passed from features.0 to features.1
    assert (between.parent, between.depth, between.shape) == ("module:features", 2, (2, 4, 8, 8))
    escaped = tensors["features.4:out"]  # returned by `features`: lives in the model's scope
    assert (escaped.parent, escaped.depth) == ("module:<root>", 1)


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_nested_tensors_have_ragged_dimensions_as_minus_one(layout: torch.layout) -> None:
    # variable-length rows of four features: the ragged dimension has no single size
    x = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=layout)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    graph = record_graph(net, x)
    tensors = by_name(graph, "tensor")
    assert tensors["input"].shape == (2, -1, 4)
    assert tensors["0:out"].shape == (2, -1, 4) and tensors["output"].shape == (2, -1, 4)
    assert by_name(graph, "parameter")["0.weight"].shape == (4, 4)


def test_edges_form_a_dag_from_input_to_output(cnn: SmallCNN) -> None:
    x = torch.randn(2, 3, 8, 8, requires_grad=True)  # a leaf that autograd sees
    graph = record_graph(cnn, x)
    order = assert_acyclic(graph)
    tensors = by_name(graph, "tensor")
    src, dst = tensors["x"].id, tensors["output"].id
    assert reaches(graph, src, dst)
    assert order.index(src) < order.index(dst)
    assert [n.label for n in graph.successors(src)] == ["Convolution"]
    # An input without grad is linked to the innermost module that received it.
    plain = record_graph(cnn, torch.randn(2, 3, 8, 8))
    x_id = by_name(plain, "tensor")["x"].id
    assert [n.id for n in plain.successors(x_id)] == ["module:features.0"]
    for depth in range(plain.max_depth + 1):
        collapsed = plain.collapse(depth)
        assert_acyclic(collapsed)
        # Once features.0 is a single node, x reaches the output through it; deeper, the edge
        # ends at the features.0 cluster and autograd cannot say which operation read x.
        found = reaches(collapsed, x_id, by_name(plain, "tensor")["output"].id)
        assert found == (depth <= 2), depth


def test_a_module_called_twice_gives_one_node_per_call() -> None:
    graph = record_graph(Shared(), torch.randn(2, 4), scale=torch.tensor(2.0))
    calls = graph.find(kind="module", name="block")
    assert [c.id for c in calls] == ["module:block", "module:block#2"]
    assert calls[1].label == "block #2\nLinear"
    weights = graph.find(kind="parameter", name="block.weight")
    assert [w.parent for w in weights] == ["module:block", "module:block#2"]
    addmm = [n.parent for n in graph.find(kind="op", name="AddmmBackward0")]
    assert addmm == ["module:block", "module:block#2"]
    assert_acyclic(graph)


def test_structured_outputs_kwargs_and_in_place_ops() -> None:
    graph = record_graph(Shared(), torch.randn(2, 4), scale=torch.tensor(2.0))
    tensors = by_name(graph, "tensor")
    assert {"x", "scale", "output['h']", "output['pair'][0]"} <= set(tensors)
    assert tensors["output['pair'][0]"].shape == ()
    # ReLU(inplace=True) rewrites its input: before and after are two tensor nodes.
    (relu,) = graph.find(kind="op", name="ReluBackward0")
    assert [n.name for n in graph.predecessors(relu.id)] == ["block:out"]
    assert [n.name for n in graph.successors(relu.id)] == ["act:out"]
    # The Identity returns its input: an edge in, none out.
    assert [n.name for n in graph.predecessors("module:same")] == ["act:out"]
    assert graph.successors("module:same") == []
    # `scale` does not require grad: it is linked to the call that received it.
    assert [n.id for n in graph.successors(tensors["scale"].id)] == ["module:<root>"]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_without_autograd_modules_and_tensors_are_still_recorded(cnn: SmallCNN, mode: type) -> None:
    with mode():
        graph = record_graph(cnn, torch.randn(2, 3, 8, 8))
    assert graph.find(kind="op") == [] and graph.find(kind="parameter") == []
    assert len(graph.find(kind="module")) == 11
    assert [n.id for n in graph.successors("module:features.0")] == ["tensor:1"]
    assert [n.id for n in graph.successors("tensor:1")] == ["module:features.1"]
    order = assert_acyclic(graph)
    assert order.index("tensor:0") < order.index("module:classifier")


def test_a_first_recording_under_inference_mode_leaves_later_ones_whole(cnn: SmallCNN) -> None:
    _graph_record._probe_leaf.cache_clear()  # as in a fresh process
    with torch.inference_mode():
        record_graph(cnn, torch.randn(2, 3, 8, 8))
    graph = record_graph(cnn, torch.randn(2, 3, 8, 8))
    assert len(graph.find(kind="parameter")) == 6 and graph.find(kind="op")


def test_frozen_parameters_and_operations_outside_the_model_are_left_out(cnn: SmallCNN) -> None:
    cnn.features.requires_grad_(False)
    with GraphRecorder(cnn) as recorder:
        loss = cnn(torch.randn(2, 3, 8, 8)).square().mean()
    graph = recorder.graph
    assert set(by_name(graph, "parameter")) == {"classifier.weight", "classifier.bias"}
    assert {n.parent for n in graph.find(kind="op")} == {"module:classifier"}
    assert not graph.find(kind="op", name="MeanBackward0")  # the loss ran outside the model
    assert loss.requires_grad


def test_leaf_tensors_that_are_not_parameters_are_tensor_nodes() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = torch.ones(3, requires_grad=True)  # a plain attribute, not a Parameter
            self.bias = nn.Parameter(torch.zeros(3))  # the model's own parameter

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain + self.bias

    graph = record_graph(Scaled(), torch.randn(2, 3))
    (leaf,) = graph.find(kind="tensor", name="leaf")
    assert (leaf.parent, leaf.shape) == ("module:<root>", (3,))
    assert [n.label for n in graph.successors(leaf.id)] == ["Mul"]
    (bias,) = graph.find(kind="parameter")
    assert (bias.id, bias.name, bias.label, bias.parent) == (
        "param:bias",
        "bias",
        "bias\n(3,)",
        "module:<root>",
    )


def test_wrapper_prefixes_are_looked_through(cnn: SmallCNN) -> None:
    class Wrapper(nn.Module):  # the shape of DDP: the user's model as `self.module`
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    graph = record_graph(Wrapper(cnn), torch.randn(1, 3, 8, 8))
    names = [n.name for n in graph.find(kind="module")]
    assert names[:3] == ["", "features", "features.0"]
    assert graph.node("module:<root>").type == "SmallCNN"


def test_compiled_models(cnn: SmallCNN) -> None:
    x = torch.randn(1, 3, 8, 8)
    eager = record_graph(cnn, x)
    compiled: nn.Module = torch.compile(cnn, backend="eager")  # type: ignore[assignment]
    assert record_graph(compiled, x) == eager  # recorded through the module it wraps
    with GraphRecorder(compiled) as recorder:  # the hooks run eagerly, between compiled pieces
        out = compiled(x)
    # Two code paths (the captured graph replayed by dynamo, and plain eager): float32 results
    # that may differ by a few ulps should an op be reordered; 1e-5 relative is far below any
    # change a lost or doubled module call would make.
    torch.testing.assert_close(out, cnn(x), rtol=1e-5, atol=1e-6)
    assert recorder.graph == eager


def test_scripted_submodules_belong_to_their_caller_and_a_scripted_model_is_refused() -> None:
    torch.manual_seed(0)
    block = torch.jit.script(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    model = nn.Sequential(nn.Linear(3, 3), block, nn.Linear(3, 2))
    x = torch.randn(2, 3)
    with GraphRecorder(model) as recorder:  # torch allows a scripted module no hooks
        out = model(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    graph = recorder.graph
    assert [n.name for n in graph.find(kind="module")] == ["", "0", "2"]
    assert [n.label for n in graph.children("module:<root>") if n.kind == "op"] == [
        "T",
        "Addmm",
        "Relu",
    ]
    assert graph.node("param:1.0.weight").parent == "module:<root>"
    assert not live_hooks()
    with pytest.raises(RecorderConfigError, match=r"scripted module.*before scripting it"):
        record_graph(torch.jit.script(nn.Linear(3, 2)), x)


# ---------------------------------------------------------------- the computation is unchanged
def test_outputs_and_gradients_are_identical_with_and_without_recording() -> None:
    torch.manual_seed(0)
    model = SmallCNN(dropout=0.5).train()  # dropout: the recording must not consume RNG either
    x = torch.randn(4, 3, 8, 8)

    def step(record: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        if record:
            with GraphRecorder(model) as recorder:
                out = model(x)
            assert recorder.graph.find(kind="op")
        else:
            out = model(x)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    plain_out, plain_grads = step(record=False)
    rec_out, rec_grads = step(record=True)
    assert torch.equal(plain_out, rec_out)
    assert len(plain_grads) == len(rec_grads) == 6
    for a, b in zip(plain_grads, rec_grads, strict=True):
        assert torch.equal(a, b)


def test_the_model_trains_normally_after_recording() -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    record_graph(model, x)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert live_hooks() == []

    def train(net: nn.Module) -> list[float]:
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        losses = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    losses = train(model)
    assert losses == train(reference)
    assert losses[-1] < losses[0]
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_hooks_are_removed_when_the_forward_raises(cnn: SmallCNN) -> None:
    with pytest.raises(RecorderConfigError, match="channels") as info:
        record_graph(cnn, torch.randn(2, 5, 8, 8))  # wrong channel count
    assert isinstance(info.value.__cause__, RuntimeError)
    assert live_hooks() == []
    recorder = GraphRecorder(cnn)
    with pytest.raises(RuntimeError, match="channels"), recorder:
        assert live_hooks() != []
        cnn(torch.randn(2, 5, 8, 8))
    assert live_hooks() == []
    with pytest.raises(NoRecordError, match="the block raised or never called the model"):
        _ = recorder.graph


def test_inputs_the_model_cannot_take_are_named_as_inspector_names_them(cnn: SmallCNN) -> None:
    """`record_graph(model, None)` let the model's own TypeError through, where Inspector says
    which model could not take which inputs: both now say it the same way."""
    from lightning_recorder import Inspector

    for args, kwargs, shown in [
        ((None,), {}, "None"),
        ((), {}, "none"),
        ((torch.randn(2, 3, 8, 8),), {"scale": 2.0}, "Tensor[2, 3, 8, 8], scale=2.0"),
    ]:
        with pytest.raises(RecorderConfigError) as info:
            record_graph(cnn, *args, **kwargs)
        message = str(info.value)
        assert message.startswith(
            f"Expected the inputs of record_graph ({shown}) to be valid inputs of SmallCNN but "
            "the forward raised TypeError: "
        ), message
        assert message.endswith(
            "record_graph(model, *args, **kwargs) runs model(*args, **kwargs) once."
        )
        assert isinstance(info.value.__cause__, TypeError)
        assert live_hooks() == []
    # Inspector's error, from the one shared wrapper: the same sentence, its own names
    with pytest.raises(RecorderConfigError) as inspected:
        Inspector(cnn, input_data=[None])
    assert str(inspected.value).startswith(
        "Expected `input_size`/`input_data` to be valid inputs of SmallCNN but the traced forward "
        "raised TypeError: "
    )
    assert isinstance(inspected.value.__cause__, TypeError)


def test_a_caught_error_inside_the_block_keeps_the_recording_consistent(cnn: SmallCNN) -> None:
    with GraphRecorder(cnn) as recorder:
        with pytest.raises(RuntimeError):
            cnn(torch.randn(2, 5, 8, 8))
        cnn(torch.randn(2, 3, 8, 8))
    graph = recorder.graph
    assert [n.id for n in graph.find(kind="module", name="")] == [
        "module:<root>",
        "module:<root>#2",
    ]
    assert graph.node("module:features.0#2").parent == "module:features#2"
    assert_acyclic(graph)


# ---------------------------------------------------------------- depth, DOT, JSON, rendering
def test_collapse_keeps_nodes_down_to_the_depth_and_merges_the_rest(graph: ExecutionGraph) -> None:
    assert graph.max_depth == 4
    for depth in range(graph.max_depth + 1):
        collapsed = graph.collapse(depth)
        assert {n.depth for n in collapsed.nodes} == set(range(depth + 1))
        assert all(e.src != e.dst for e in collapsed.edges)
        assert len(set(collapsed.edges)) == len(collapsed.edges)
    top = graph.collapse(0)
    assert [(top.node(e.src).name, top.node(e.dst).name) for e in top.edges] == [
        ("x", ""),
        ("", "output"),
    ]
    assert graph.collapse(None) is graph and graph.collapse(9) is graph


def test_collapse_stays_acyclic_when_a_module_returns_a_feature_it_also_uses() -> None:
    class Backbone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            feature = self.stem(x)
            return feature, self.head(feature)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = Backbone()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            feature, logits = self.backbone(x)
            return feature.sum() + logits.sum()

    graph = record_graph(Model(), torch.randn(3, 4))
    feature = by_name(graph, "tensor")["backbone.stem:out"]
    assert feature.parent == "module:<root>"  # it escaped the backbone
    for depth in range(graph.max_depth + 1):
        assert_acyclic(graph.collapse(depth))
    level1 = graph.collapse(1)
    assert [n.id for n in level1.predecessors(feature.id)] == ["module:backbone"]


def test_dot_at_a_depth_names_only_modules_down_to_it(graph: ExecutionGraph) -> None:
    modules = graph.find(kind="module")
    for depth in range(graph.max_depth + 1):
        dot = graph.to_dot(depth=depth)
        for module in modules:
            shown = f'"{module.id}"' in dot or f'"cluster_{module.id}"' in dot
            assert shown == (module.depth <= depth), (depth, module.id)
        # modules at `depth` are boxes; shallower ones are clusters, unless nothing ran inside
        # them (the Dropout with p=0 returns its input)
        collapsed = graph.collapse(depth)
        for module in collapsed.find(kind="module"):
            cluster = module.depth < depth and module.name != "drop"
            assert bool(collapsed.children(module.id)) == cluster
            assert (f'subgraph "cluster_{module.id}"' in dot) == cluster
            assert (f'"{module.id}" [label=' in dot) != cluster
    dot = graph.to_dot()
    assert dot.startswith("digraph execution_graph {") and dot.rstrip().endswith("}")
    assert "compound=true" in dot and "lhead=" in dot  # x -> the features.0 cluster
    assert dot.count("->") == len(graph.edges)


def test_json_round_trips(graph: ExecutionGraph) -> None:
    data = json.loads(graph.to_json())
    assert data == graph.to_dict()
    assert set(data) == {"nodes", "edges"} and len(data["edges"]) == len(graph.edges)
    node = next(n for n in data["nodes"] if n["name"] == "features.0.weight")
    assert node == {
        "id": "param:features.0.weight", "kind": "parameter", "name": "features.0.weight",
        "label": "weight\n(4, 3, 3, 3)", "depth": 3, "parent": "module:features.0",
        "type": "Parameter", "shape": [4, 3, 3, 3], "dtype": "float32",
    }  # fmt: skip
    assert ExecutionGraph.from_dict(data) == graph
    assert graph.to_json(indent=None).count("\n") == 0
    assert repr(graph).startswith("ExecutionGraph(11 modules, 6 parameters")


@needs_dot
def test_render_svg_and_png(graph: ExecutionGraph, tmp_path: Path) -> None:
    svg = graph.render(tmp_path / "g.svg")
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    assert "features.3.0: Conv2d" in svg.read_text()
    png = graph.render(tmp_path / "sub" / "g", format="png", depth=1)
    assert png == tmp_path / "sub" / "g.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    pdf = graph.render(str(tmp_path / "g.pdf"), depth=0)
    assert pdf.read_bytes()[:5] == b"%PDF-"
    assert graph.render(tmp_path / "g.v2", format="svg").name == "g.v2.svg"


@needs_dot
def test_render_quotes_odd_names(tmp_path: Path) -> None:
    model = nn.ModuleDict({'say "hi"\\': nn.Linear(2, 2)})
    with GraphRecorder(model) as recorder:
        model['say "hi"\\'](torch.randn(1, 2))
    svg = recorder.graph.render(tmp_path / "odd.svg")
    ET.parse(svg)
    assert "say &quot;hi&quot;\\" in svg.read_text()


def test_render_without_dot_explains_how_to_install_it(
    graph: ExecutionGraph, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no `dot` anywhere
    assert shutil.which("dot") is None
    with pytest.raises(RecorderStateError, match=r"Expected the Graphviz program `dot`") as info:
        graph.render(tmp_path / "g.svg")
    message = str(info.value)
    for hint in ("apt-get install graphviz", "brew install graphviz", "conda install graphviz"):
        assert hint in message
    assert isinstance(info.value, RuntimeError)
    assert not (tmp_path / "g.svg").exists()
    assert graph.to_dot().startswith("digraph") and json.loads(graph.to_json())


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("depth", [-1, 1.5, True, "2"])
def test_bad_depth(graph: ExecutionGraph, depth: object) -> None:
    pattern = r"Expected `depth` to be None or a non-negative integer but got"
    with pytest.raises(RecorderConfigError, match=pattern):
        graph.to_dot(depth=depth)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=pattern):
        graph.collapse(depth)  # type: ignore[arg-type]


def test_bad_format_and_path(graph: ExecutionGraph, tmp_path: Path) -> None:
    with pytest.raises(RecorderConfigError, match=r"Expected `format` to be one of 'svg', 'png'"):
        graph.render(tmp_path / "g", format="gif")  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"suffix of `path` to match `format` 'svg'"):
        graph.render(tmp_path / "g.png", format="svg")
    with pytest.raises(RecorderConfigError, match=r"Expected `depth`"):
        graph.render(tmp_path / "g.svg", depth=-2)
    for path in (5, None, b"g.svg"):
        with pytest.raises(RecorderConfigError, match=r"Expected `path` to be the output file"):
            graph.render(path)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_bad_model_and_recorder_states(cnn: SmallCNN) -> None:
    with pytest.raises(
        RecorderConfigError, match=r"Expected `model` to be a torch\.nn\.Module but"
    ):
        record_graph(lambda x: x, torch.randn(1))  # type: ignore[arg-type]
    recorder = GraphRecorder(cnn)
    with pytest.raises(NoRecordError, match="never called the model"):
        _ = recorder.graph
    with recorder:
        with pytest.raises(RecorderStateError, match="already inside its `with` block"):
            recorder.__enter__()
        with pytest.raises(NoRecordError, match="still inside its `with` block"):
            _ = recorder.graph
    with pytest.raises(NoRecordError, match="never called the model"):
        _ = recorder.graph  # the block ran no forward pass
    assert live_hooks() == []


def test_bad_lookups_and_bad_graph_data(graph: ExecutionGraph) -> None:
    with pytest.raises(UnknownSourceError, match=r"Closest node ids: 'module:features.0'"):
        graph.node("module:feature.0")
    with pytest.raises(RecorderConfigError, match=r"Expected `kind` to be one of 'module'"):
        graph.find(kind="ops")  # type: ignore[arg-type]
    for name in (0, ("features", 0), graph.node("module:features")):
        with pytest.raises(RecorderConfigError, match=r"Expected `name` to be a node name \(a str"):
            graph.find(name=name)  # type: ignore[arg-type]
    assert [n.id for n in graph.find(name="features")] == ["module:features"]
    with pytest.raises(
        RecorderConfigError, match=r"with 'nodes' and 'edges' but got keys \['nodes'\]"
    ):
        ExecutionGraph.from_dict({"nodes": []})
    with pytest.raises(RecorderConfigError, match=r"Expected node fields \['id', 'kind'"):
        ExecutionGraph.from_dict({"nodes": [{"id": "a"}], "edges": []})
    for bad, message in (
        ({"nodes": [1], "edges": []}, r"Expected node 0 to be a mapping of its fields \['id'"),
        ({"nodes": "abc", "edges": []}, r"Expected 'nodes' to be a list .* but got str 'abc'"),
        ({"nodes": [], "edges": 5}, r"Expected 'edges' to be a list .* but got int 5"),
        ({"nodes": [], "edges": [["a", "b", "c"]]}, r"edge 0 to be a \[src, dst\] pair"),
        ({"nodes": [], "edges": ["ab"]}, r"edge 0 to be a \[src, dst\] pair .* got 'ab'"),
    ):
        with pytest.raises(RecorderConfigError, match=message):
            ExecutionGraph.from_dict(bad)
    node = graph.to_dict()["nodes"][0]
    with pytest.raises(RecorderConfigError, match=r"depth to be a non-negative int but got str"):
        ExecutionGraph.from_dict({"nodes": [{**node, "depth": "0"}], "edges": []})
    a = GraphNode("a", "module", "a", "a", 0)
    with pytest.raises(RecorderConfigError, match="Expected unique node ids but got 'a' twice"):
        ExecutionGraph([a, a], [])
    with pytest.raises(RecorderConfigError, match="Expected node kind to be one of"):
        ExecutionGraph([GraphNode("b", "layer", "b", "b", 0)], [])  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match="parent of 'b' to be a node of the graph"):
        ExecutionGraph([GraphNode("b", "op", "b", "b", 1, parent="zz")], [])
    with pytest.raises(RecorderConfigError, match="Expected node 'b' to have depth 1"):
        ExecutionGraph([a, GraphNode("b", "op", "b", "b", 3, parent="a")], [])
    with pytest.raises(RecorderConfigError, match="the unknown id 'c'"):
        ExecutionGraph([a], [("a", "c")])
    small = ExecutionGraph([a], [])
    assert len(small) == 1 and "a" in small and small.edges == ()
    assert GraphEdge("a", "b") == ("a", "b")


# ---------------------------------------------------------------- docs and example
def test_docs_page_shows_the_committed_pictures() -> None:
    page = (ROOT / "docs" / "graph.md").read_text()
    assert "```python" in page  # run by tests/test_docs.py
    for name in re.findall(r"\]\((images/[^)]+)\)", page):
        assert (ROOT / "docs" / name).is_file(), name
    svg = ROOT / "docs" / "images" / "graph_example.svg"
    assert ET.parse(svg).getroot().tag.endswith("svg")
    png = ROOT / "docs" / "images" / "graph_example.png"
    assert png.read_bytes()[:8] == PNG_MAGIC


@needs_dot
def test_example_script_writes_the_pictures(tmp_path: Path) -> None:
    example = runpy.run_path(str(ROOT / "examples" / "graph_example.py"))
    written = example["main"](tmp_path)
    assert [p.name for p in written] == [
        "graph_example.svg",
        "graph_example.png",
        "graph_example_depth1.svg",
    ]
    assert written[1].read_bytes()[:8] == PNG_MAGIC
    assert "features.0: Conv2d" in written[0].read_text()
