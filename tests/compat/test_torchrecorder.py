"""torchrecorder's documented behaviours, re-expressed with this package's ``record_graph``.

Source: https://github.com/ahgamut/torchrecorder at commit
750837f16580aa4a76921527561ac84776db93a3. torchrecorder has no unit tests; its behaviours are
those its example scripts show (``examples/sample.py``, ``examples/styleargs.py``,
``examples/newstyler.py``, included in ``docs/source/manual.rst``) and that its helpers promise
(``src/torchrecorder/helpers.py``, ``recorder.py``, ``renderer/gv.py``).

The networks are the examples' ``SampleNet`` (two linears on the same input, concatenated, a
third linear, a ReLU; input shape ``(1, 3)``) and ``ConvSample`` (two convolutions, a residual
addition, a ReLU; input shape ``(1, 1, 10, 10)``).

The drop-in functions ``record``, ``make_dot``, ``render_network`` and the ``GraphvizStyler``
class, with torchrecorder's names and arguments, are in ``lightning_recorder.graph``.

==================================================  ============================================
torchrecorder example / promise                     covered by
==================================================  ============================================
sample.py ``main``: ``render_network(net, name,     test_render_network    ;
input_shapes=(1, 3), directory, fmt="svg",          here: test_render_svg_at_each_depth
render_depth=i)`` writes ``"<name>-<i>.svg"``
sample.py ``main2``: ``record(net, name,            test_record_then_make_dot    ;
input_shapes)``, ``make_dot(rec, render_depth=i)``  here: test_dot_source_renders_with_graphviz
gives an editable ``graphviz.Digraph`` (format,
label) that renders
what the pictures show: children of the network,    test_sample_net_at_depth_1,
the concatenation between them, parameters and      test_sample_net_at_depth_0,
operations inside the layers at greater depths      test_sample_net_full_depth
newstyler.py: ``ConvSample``'s residual graph       test_conv_sample_at_depth_1
styleargs.py: ``make_dot(..., fontname="Lato")``    test_styler_args
styles every node
newstyler.py: ``styler_cls`` subclassing            test_custom_styler
``GraphvizStyler``, ``style_node(node)`` /
``style_edge(fnode, tnode)`` returning Graphviz
attributes
helpers.py ``record``: input shapes, a list of      test_record_input_shapes_and_names    ;
shapes for several inputs, or ``input_data``; the   here: test_given_inputs, test_several_inputs
graph's name (``name``) labels the network
recorder.py ``remove_hooks``: hooks removed after   test_no_hooks_left_and_autograd_kept
recording
==================================================  ============================================

Deliberate differences: inputs and outputs are named after the ``forward`` arguments (``inputs``)
and ``output``, where torchrecorder says ``Input``/``Input-1`` and ``Output``; recording keeps
autograd intact (torchrecorder swaps module inputs and outputs for detached leaf tensors, so
gradients no longer reach the parameters), which test_no_hooks_left_and_autograd_kept checks;
``record_graph`` runs the model as it is, where ``render_network`` first moves it to the CPU and
into training mode.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_recorder.graph import ExecutionGraph, GraphRecorder, record_graph

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="Graphviz's `dot` program is not installed"
)


class SampleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(3, 3)
        self.linear_2 = nn.Linear(3, 3)
        self.linear_3 = nn.Linear(6, 1)
        self.my_special_relu = nn.ReLU()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.linear_1(inputs)
        y = self.linear_2(inputs)
        z = torch.cat([x, y], dim=1)
        return self.my_special_relu(self.linear_3(z))


class ConvSample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 5, kernel_size=5, stride=2, padding=2)
        self.conv2 = nn.Conv2d(5, 5, kernel_size=3, stride=1, padding=1)
        self.relu = nn.ReLU(inplace=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.conv1(x)
        x2 = self.conv2(x1)
        return self.relu(x1 + x2)


def named_edges(graph: ExecutionGraph) -> set[tuple[str, str]]:
    return {(graph.node(e.src).name, graph.node(e.dst).name) for e in graph.edges}


@pytest.fixture
def sample_graph() -> ExecutionGraph:
    torch.manual_seed(0)
    return record_graph(SampleNet(), torch.randn(1, 3))


def test_sample_net_at_depth_1(sample_graph: ExecutionGraph) -> None:
    top = sample_graph.collapse(1)
    modules = {n.name for n in top.find(kind="module")}
    assert modules == {"", "linear_1", "linear_2", "linear_3", "my_special_relu"}
    assert named_edges(top) == {
        ("inputs", "linear_1"),
        ("inputs", "linear_2"),
        ("linear_1", "linear_1:out"),
        ("linear_2", "linear_2:out"),
        ("linear_1:out", "CatBackward0"),
        ("linear_2:out", "CatBackward0"),
        ("CatBackward0", "linear_3:input"),
        ("linear_3:input", "linear_3"),
        ("linear_3", "linear_3:out"),
        ("linear_3:out", "my_special_relu"),
        ("my_special_relu", "output"),
    }


def test_sample_net_at_depth_0(sample_graph: ExecutionGraph) -> None:
    top = sample_graph.collapse(0)
    assert [(top.node(e.src).label, top.node(e.dst).label) for e in top.edges] == [
        ("inputs\n(1, 3)", "SampleNet"),
        ("SampleNet", "output\n(1, 1)"),
    ]


def test_sample_net_full_depth(sample_graph: ExecutionGraph) -> None:
    for name in ("linear_1", "linear_2", "linear_3"):
        inside = [n.name for n in sample_graph.children(f"module:{name}")]
        assert f"{name}.weight" in inside and f"{name}.bias" in inside
        assert "AddmmBackward0" in inside
    relu = sample_graph.node("module:my_special_relu")
    assert relu.depth == 1
    assert [n.name for n in sample_graph.children(relu.id)] == ["ReluBackward0"]
    (cat,) = sample_graph.find(kind="op", name="CatBackward0")
    assert (cat.depth, cat.parent) == (1, "module:<root>")  # between the children, in the net


def test_conv_sample_at_depth_1() -> None:
    graph = record_graph(ConvSample(), torch.randn(1, 1, 10, 10)).collapse(1)
    assert named_edges(graph) == {
        ("x", "conv1"),
        ("conv1", "conv1:out"),
        ("conv1:out", "conv2"),  # x1 feeds conv2 ...
        ("conv1:out", "AddBackward0"),  # ... and the residual addition
        ("conv2", "conv2:out"),
        ("conv2:out", "AddBackward0"),
        ("AddBackward0", "relu:input"),
        ("relu:input", "relu"),
        ("relu", "output"),
    }
    (conv1_out,) = [n for n in graph.nodes if n.name == "conv1:out"]
    assert conv1_out.shape == (1, 5, 5, 5)


def test_given_inputs() -> None:
    """torchrecorder's ``input_data``: the graph is recorded on the tensors given."""
    x = torch.rand(2, 3)
    graph = record_graph(SampleNet(), x)
    (inputs,) = [n for n in graph.find(kind="tensor") if n.name == "inputs"]
    assert inputs.shape == (2, 3)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return self.a(left) + self.b(right)


def test_several_inputs() -> None:
    """torchrecorder's list of input shapes, one per positional input."""
    graph = record_graph(TwoInputs(), torch.randn(1, 3), torch.randn(1, 2))
    labels = {n.name: n.label for n in graph.find(kind="tensor")}
    assert labels["left"] == "left\n(1, 3)" and labels["right"] == "right\n(1, 2)"
    assert ("left", "a") in named_edges(graph) and ("right", "b") in named_edges(graph)


def _hook_count(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def test_no_hooks_left_and_autograd_kept() -> None:
    torch.manual_seed(0)
    net, x = SampleNet(), torch.randn(4, 3)
    net(x).sum().backward()
    expected = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    net.zero_grad()
    record_graph(net, x)
    assert _hook_count(net) == 0
    with GraphRecorder(net):
        out = net(x)
    assert _hook_count(net) == 0
    out.sum().backward()
    for param, grad in zip(net.parameters(), expected, strict=True):
        # The same forward and backward kernels on the same data: equal up to rounding only.
        torch.testing.assert_close(param.grad, grad)


@needs_dot
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_render_svg_at_each_depth(sample_graph: ExecutionGraph, tmp_path: Path, depth: int) -> None:
    path = sample_graph.render(tmp_path / f"Sample Net-{depth}.svg", depth=depth)
    assert path == tmp_path / f"Sample Net-{depth}.svg"
    text = path.read_text()
    assert "<svg" in text
    assert ("linear_1" in text) == (depth >= 1)


@needs_dot
def test_dot_source_renders_with_graphviz(sample_graph: ExecutionGraph, tmp_path: Path) -> None:
    graphviz = pytest.importorskip("graphviz")
    source = graphviz.Source(sample_graph.to_dot(depth=1), format="svg")
    written = Path(source.render("Sample Net-1", directory=tmp_path, cleanup=True))
    assert written.suffix == ".svg" and "my_special_relu" in written.read_text()


# ---------------------------------------------------------------- drop-in functions (pending)


def test_record_input_shapes_and_names() -> None:
    from lightning_recorder.graph import make_dot, record

    rec = record(SampleNet(), name="Sample Net", input_shapes=(1, 3))
    source = make_dot(rec, render_depth=1).source
    assert "Sample Net" in source and "linear_1" in source and "my_special_relu" in source
    two = record(TwoInputs(), name="Two", input_shapes=[(1, 3), (1, 2)])
    assert "Two" in make_dot(two, render_depth=1).source
    given = record(SampleNet(), name="Given", input_shapes=None, input_data=torch.rand(2, 3))
    assert "(2, 3)" in make_dot(given).source or "[2, 3]" in make_dot(given).source


@needs_dot
def test_render_network(tmp_path: Path) -> None:
    from lightning_recorder.graph import render_network

    render_network(
        SampleNet(),
        name="Sample Net",
        input_shapes=(1, 3),
        directory=str(tmp_path),
        fmt="svg",
        render_depth=1,
    )
    written = tmp_path / "Sample Net-1.svg"
    assert written.exists()
    assert "Sample Net at depth = 1" in written.read_text()


@needs_dot
def test_record_then_make_dot(tmp_path: Path) -> None:
    graphviz = pytest.importorskip("graphviz")
    from lightning_recorder.graph import make_dot, record

    rec = record(SampleNet(), name="Sample Net", input_shapes=(1, 3))
    g = make_dot(rec, render_depth=2)
    assert isinstance(g, graphviz.Digraph)
    g.format = "svg"
    g.attr(label="Sample Net at depth=2")
    g.render("Sample Net-2", directory=str(tmp_path), cleanup=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Sample Net-2.svg"]
    assert "Sample Net at depth=2" in (tmp_path / "Sample Net-2.svg").read_text()


def test_styler_args() -> None:
    from lightning_recorder.graph import make_dot, record

    rec = record(SampleNet(), name="Sample Net", input_shapes=(1, 3))
    g = make_dot(rec, render_depth=1, fontname="Lato")
    assert "fontname=Lato" in g.source.replace('"', "")
    assert all("fontname=Lato" in line.replace('"', "") for line in g.body if "label=" in line)


def test_custom_styler() -> None:
    from lightning_recorder.graph import GraphvizStyler, make_dot, record

    class ConvStyler(GraphvizStyler):
        def style_node(self, node):  # type: ignore[no-untyped-def]
            style = super().style_node(node)
            if isinstance(node.fn, nn.Conv2d):
                style["label"] = f"{node.name}\n(kernel_size={node.fn.kernel_size})"
                style["penwidth"] = "2.4"
            return style

        def style_edge(self, fnode, tnode):  # type: ignore[no-untyped-def]
            if isinstance(fnode.fn, nn.Conv2d) and isinstance(tnode.fn, torch.Tensor):
                return {"penwidth": "4.8", "color": "#ee8800"}
            return super().style_edge(fnode, tnode)

    rec = record(ConvSample(), name="ConvSample", input_shapes=(1, 1, 10, 10))
    source = make_dot(rec, render_depth=1, styler_cls=ConvStyler, fontname="Lato").source
    assert "kernel_size=(5, 5)" in source and "kernel_size=(3, 3)" in source
    assert source.count("#ee8800") == 2  # conv1 -> its output, conv2 -> its output
