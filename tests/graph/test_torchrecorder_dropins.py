"""torchrecorder's drop-in functions over record_graph: nodes, styling, errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_recorder.errors import RecorderConfigError
from lightning_recorder.graph import (
    GraphvizStyler,
    LayerNode,
    OpNode,
    ParamNode,
    TensorNode,
    make_dot,
    record,
    render_network,
)

pytest.importorskip("graphviz")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_nodes_carry_torchrecorder_attributes() -> None:
    net = Block()
    seen: list[object] = []

    class Spy(GraphvizStyler):
        def style_node(self, node):  # type: ignore[no-untyped-def]
            seen.append(node)
            return super().style_node(node)

    rec = record(net, "Block", input_shapes=(4, 2))
    make_dot(rec, styler_cls=Spy)
    layers = {n.name: n for n in seen if isinstance(n, LayerNode)}
    assert layers["Block"].fn is net and layers["Block"].parent is None
    assert layers["inner.0"].fn is net.inner[0] and layers["inner.0"].depth == 2
    assert layers["inner.0"].parent is layers["inner"]
    assert layers["inner.0"] in layers["inner"].subnets
    params = {n.name: n for n in seen if isinstance(n, ParamNode)}
    assert params["head.weight"].fn is net.head.weight
    tensors = [n for n in seen if isinstance(n, TensorNode)]
    assert all(t.fn.device.type == "meta" for t in tensors)
    assert any(tuple(t.fn.shape) == (4, 1) for t in tensors)  # the output
    assert any(isinstance(n, OpNode) and n.fn == n.name for n in seen)


def test_render_depth_chooses_clusters_and_styles_apply() -> None:
    rec = record(Block(), "Block", input_shapes=(1, 2))
    shallow = make_dot(rec, render_depth=1).source
    assert "cluster_module:<root>" in shallow and "cluster_module:inner" not in shallow
    deep = make_dot(rec, render_depth=2).source
    assert "cluster_module:inner" in deep
    top = make_dot(rec, render_depth=0).source
    assert "cluster" not in top and "Block" in top
    styled = make_dot(rec, render_depth=1, fontname="Lato", color="red").source
    assert "fontname=Lato" in styled and "color=red" in styled
    assert "fillcolor=lightgrey" in shallow and "fillcolor=lightblue" in shallow


def test_several_inputs_and_errors() -> None:
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a.sum() + b.sum()

    rec = record(Two(), "Two", input_shapes=[(1, 3), (2, 2)])
    source = make_dot(rec).source
    assert "[1, 3]" in source and "[2, 2]" in source
    with pytest.raises(RecorderConfigError, match=r"`input_shapes` to be a shape tuple"):
        record(Two(), "Two", input_shapes="1x3")
    with pytest.raises(RecorderConfigError, match=r"`net` to be a torch.nn.Module"):
        record(5, "x", input_shapes=(1, 3))  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"`render_depth` to be a non-negative int"):
        make_dot(rec, render_depth=-1)
    with pytest.raises(RecorderConfigError, match=r"`rec` to be what record\(\) returns"):
        make_dot(rec.graph)  # type: ignore[arg-type]
    for styler_cls in (int, GraphvizStyler(), "GraphvizStyler"):
        with pytest.raises(
            RecorderConfigError, match=r"`styler_cls` to be GraphvizStyler or a subclass"
        ):
            make_dot(rec, styler_cls=styler_cls)  # type: ignore[arg-type]


def _drawn(source: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The drawn nodes of DOT ``source`` (name -> first line of the label) and its edges."""
    nodes = dict(re.findall(r'^\s*("[^"]+"|\S+) \[label="?([^"\n ]+)', source, flags=re.M))
    edges = re.findall(r"^\s*(\S+) -> (\S+?)(?: \[|$)", source, flags=re.M)
    return nodes, edges


def test_make_dot_edges_join_the_drawn_nodes() -> None:
    # Node ids hold a colon ("tensor:0"), which graphviz reads in an edge end as node:port; every
    # edge must join two of the nodes drawn, not new nodes named "tensor" or "module".
    rec = record(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), "S", input_shapes=(1, 3))
    for depth in (0, 1, 256):
        nodes, edges = _drawn(make_dot(rec, render_depth=depth).source)
        assert edges
        assert {end for edge in edges for end in edge} <= set(nodes), (nodes, edges)
    nodes, edges = _drawn(make_dot(rec, render_depth=1).source)
    assert [(nodes[src], nodes[dst]) for src, dst in edges] == [
        ("input", "0"),
        ("0", "0:out"),
        ("0:out", "1"),
        ("1", "output"),
    ]


def test_render_network_checks_its_arguments_before_running_the_network(tmp_path: Path) -> None:
    calls: list[int] = []
    net = nn.Linear(3, 1)
    net.register_forward_hook(lambda *_: calls.append(1))
    for bad, message in (
        ({"fmt": "jpgx"}, r"`fmt` to be a Graphviz output format .* got 'jpgx'. Closest .*'jpg'"),
        ({"fmt": None}, r"`fmt` to be a Graphviz output format .* got None"),
        ({"directory": 5}, r"`directory` to be a path \(str or os.PathLike\) .* got int 5"),
        ({"render_depth": -1}, r"`render_depth` to be a non-negative int but got -1"),
    ):
        arguments = {"directory": str(tmp_path), **bad}
        with pytest.raises(RecorderConfigError, match=message):
            render_network(net, "n", (1, 3), **arguments)
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_record_and_make_dot_look_through_a_data_parallel_wrapper() -> None:
    net = Block()
    wrapped = nn.DataParallel(net)  # on a CPU-only machine it calls the module it wraps
    seen: list[object] = []

    class Spy(GraphvizStyler):
        def style_node(self, node):  # type: ignore[no-untyped-def]
            seen.append(node)
            return super().style_node(node)

    rec = record(wrapped, "Wrapped", input_shapes=(2, 2))
    source = make_dot(rec, styler_cls=Spy).source
    layers = {n.name: n.fn for n in seen if isinstance(n, LayerNode)}
    assert layers["Wrapped"] is net and layers["inner.0"] is net.inner[0]
    assert layers["head"] is net.head
    params = {n.name: n.fn for n in seen if isinstance(n, ParamNode)}
    assert params["head.weight"] is net.head.weight and "module.head.weight" not in params
    assert "->" in source
