"""torchrecorder's functions (``record``, ``make_dot``, ``render_network``) over ``record_graph``.

The names and arguments are torchrecorder's, so that its scripts run unchanged; the graph under
them is an :class:`~lightning_recorder.graph.ExecutionGraph`. The nodes a styler sees have
torchrecorder's attributes: ``fn`` (the module, the parameter, a tensor of the recorded shape, or
the autograd operation's name), ``name``, ``depth``, ``parent`` and, for layers, ``subnets``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._core.checks import suggestion
from .._core.names import canonical_name, named_modules
from ..errors import RecorderConfigError, RecorderStateError
from ._model import ExecutionGraph, GraphNode, record_graph

__all__ = [
    "BaseNode",
    "GraphvizStyler",
    "LayerNode",
    "OpNode",
    "ParamNode",
    "Recording",
    "TensorNode",
    "make_dot",
    "record",
    "render_network",
]


@dataclass(eq=False)
class BaseNode:
    """A node as torchrecorder's stylers see it.

    Attributes:
        fn: the module (layers), the parameter (parameters), an empty ``meta`` tensor of the
            recorded shape and dtype (tensors: values are not kept), or the autograd
            operation's name (operations, e.g. ``"CatBackward0"``).
        name: the module's or parameter's qualified name (the network's is the recording's
            name), the tensor's role (``"inputs"``, ``"linear_1:out"``, ``"output"``), or the
            operation's name.
        depth: the nesting depth (the network is 0, its children 1).
        parent: the enclosing layer's node, ``None`` for the network.
        node: the underlying :class:`~lightning_recorder.graph.GraphNode`.
    """

    fn: Any
    name: str
    depth: int
    parent: BaseNode | None
    node: GraphNode


@dataclass(eq=False)
class TensorNode(BaseNode):
    """A tensor that crossed a module boundary."""


@dataclass(eq=False)
class ParamNode(BaseNode):
    """A parameter."""


@dataclass(eq=False)
class OpNode(BaseNode):
    """An autograd operation."""


@dataclass(eq=False)
class LayerNode(BaseNode):
    """A module call; ``subnets`` are the nodes directly inside it."""

    subnets: list[BaseNode] = field(default_factory=list)


_NODE_CLASSES: dict[str, type[BaseNode]] = {
    "module": LayerNode,
    "parameter": ParamNode,
    "tensor": TensorNode,
    "op": OpNode,
}


@dataclass
class Recording:
    """What :func:`record` returns: the graph of one forward, the network and its name."""

    graph: ExecutionGraph
    net: nn.Module
    name: str


class GraphvizStyler:
    """torchrecorder's default styling; subclass it and pass ``styler_cls`` to :func:`make_dot`.

    Args:
        **styler_args: Graphviz attributes given to every node (``fontname="Lato"``); the
            defaults are ``style="filled"``, ``align="left"``, ``color="black"``.

    Attributes:
        styles: the attributes of each node class (:class:`TensorNode` light blue,
            :class:`ParamNode` dark olive green, :class:`OpNode` orange box, :class:`LayerNode`
            light grey box); edit them in a subclass's ``__init__``.
    """

    def __init__(self, **styler_args: Any) -> None:
        for key, value in (("style", "filled"), ("align", "left"), ("color", "black")):
            if styler_args.get(key) is None:
                styler_args[key] = value
        self.styles: dict[type[BaseNode], dict[str, Any]] = {
            BaseNode: dict(styler_args),
            TensorNode: {**styler_args, "fillcolor": "lightblue"},
            ParamNode: {**styler_args, "fillcolor": "darkolivegreen"},
            OpNode: {**styler_args, "fillcolor": "orange", "shape": "box"},
            LayerNode: {**styler_args, "fillcolor": "lightgrey", "shape": "box"},
        }

    def style_node(self, node: BaseNode) -> dict[str, Any]:
        """Graphviz attributes of ``node``, its ``label`` included (override to restyle)."""
        style = dict(self.styles.get(type(node), self.styles[BaseNode]))
        if isinstance(node, TensorNode):
            style["label"] = f"{node.name}\n{list(node.fn.shape)}"
        else:
            style["label"] = node.name
        return style

    def style_edge(self, fnode: BaseNode, tnode: BaseNode) -> dict[str, Any]:
        """Graphviz attributes of the edge ``fnode -> tnode`` (none by default)."""
        return {}


def _inputs(
    net: nn.Module, input_shapes: Any, input_data: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if input_data is not None:
        if isinstance(input_data, torch.Tensor):
            return (input_data,), {}
        if isinstance(input_data, dict):
            return (), dict(input_data)
        if isinstance(input_data, (tuple, list)):
            return tuple(input_data), {}
        raise RecorderConfigError(
            "Expected `input_data` to be a tensor, a tuple of tensors or a dict of keyword "
            f"arguments but got {type(input_data).__name__}."
        )

    def is_shape(value: Any) -> bool:
        return isinstance(value, (tuple, torch.Size)) and all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value
        )

    if is_shape(input_shapes):
        shapes = [tuple(input_shapes)]
    elif isinstance(input_shapes, list) and input_shapes and all(map(is_shape, input_shapes)):
        shapes = [tuple(s) for s in input_shapes]
    else:
        raise RecorderConfigError(
            "Expected `input_shapes` to be a shape tuple such as (1, 3), or a list of them (one "
            f"per input), or `input_data` to be given, but got {input_shapes!r}."
        )
    first = next(iter([*net.parameters(), *net.buffers()]), None)
    device = first.device if first is not None else torch.device("cpu")
    return tuple(torch.randn(s, device=device, requires_grad=True) for s in shapes), {}


def record(
    net: nn.Module,
    name: str,
    input_shapes: Any,
    input_data: Any = None,
) -> Recording:
    """torchrecorder's ``record``: run ``net`` once and return its recording.

    Args:
        net: the network.
        name: the graph's name; it labels the network's node.
        input_shapes: one shape tuple (one input, ``torch.randn``), or a list of them (one per
            input); the inputs require grad, as in torchrecorder.
        input_data: the inputs instead: a tensor, a tuple of tensors, or a dict of keyword
            arguments (``input_shapes`` is then ignored).

    Returns:
        A :class:`Recording` (its ``graph`` is the :class:`ExecutionGraph`).
    """
    if not isinstance(net, nn.Module):
        raise RecorderConfigError(
            f"Expected `net` to be a torch.nn.Module but got {type(net).__name__}."
        )
    if not isinstance(name, str):
        raise RecorderConfigError(f"Expected `name` to be a str but got {type(name).__name__}.")
    args, kwargs = _inputs(net, input_shapes, input_data)
    return Recording(record_graph(net, *args, **kwargs), net, name)


def _nodes(rec: Recording, graph: ExecutionGraph) -> dict[str, BaseNode]:
    # The graph names modules and parameters without wrapper prefixes (``module.`` of
    # DataParallel/DDP, ``_orig_mod.``), so look them up by those names, not on the wrapper.
    modules = named_modules(rec.net)
    params: dict[str, nn.Parameter] = {}
    for mname, module in modules.items():
        for pname, param in module.named_parameters(recurse=False):
            params.setdefault(canonical_name(f"{mname}.{pname}" if mname else pname), param)
    nodes: dict[str, BaseNode] = {}
    for node in graph.nodes:
        fn: Any
        name = node.name
        if node.kind == "module":
            fn = modules.get(node.name)
            if fn is None:
                fn = rec.net.get_submodule(node.name)
            if node.parent is None:
                name = rec.name
        elif node.kind == "parameter":
            fn = params.get(node.name)
            if fn is None:
                fn = rec.net.get_parameter(node.name)
        elif node.kind == "tensor":
            dtype = getattr(torch, node.dtype or "float32", torch.float32)
            fn = torch.empty(node.shape or (), dtype=dtype, device="meta")
        else:
            fn = node.name
        parent = nodes.get(node.parent) if node.parent is not None else None
        made = _NODE_CLASSES[node.kind](fn, name, node.depth, parent, node)
        nodes[node.id] = made
        if isinstance(parent, LayerNode):
            parent.subnets.append(made)
    return nodes


def _dot_name(node_id: str) -> str:
    """``node_id`` as a Graphviz node name: without ``:``, which an edge end reads as a port.

    ``graphviz.Digraph.edge`` splits ``"tensor:0"`` into node ``tensor`` and port ``0``; escaping
    ``%`` and ``:`` keeps distinct ids distinct.
    """
    return node_id.replace("%", "%25").replace(":", "%3A")


def _graphviz() -> Any:
    try:
        import graphviz
    except ImportError as err:
        raise RecorderStateError(
            "Expected the Python package `graphviz` for make_dot/render_network but it is not "
            "installed: `pip install graphviz`; `ExecutionGraph.to_dot()` works without it."
        ) from err
    return graphviz


def make_dot(
    rec: Recording,
    render_depth: int = 256,
    styler_cls: type[GraphvizStyler] | None = None,
    **styler_args: Any,
) -> Any:
    """torchrecorder's ``make_dot``: a ``graphviz.Digraph`` of a recording.

    Layers shallower than ``render_depth`` that hold nodes are drawn as clusters; the rest as
    nodes. The digraph can be edited (``format``, ``attr(label=...)``) and rendered.

    Args:
        rec: what :func:`record` returned.
        render_depth: how deep to draw (the network is depth 0).
        styler_cls: :class:`GraphvizStyler` or a subclass.
        **styler_args: passed to the styler; ``fontname`` also sets the graph's font.

    Returns:
        A ``graphviz.Digraph``.

    Raises:
        RecorderConfigError: ``rec`` is not a recording, a bad ``render_depth``, or a
            ``styler_cls`` that is not a styler class.
        RecorderStateError: the ``graphviz`` package is missing.
    """
    graphviz = _graphviz()
    if not isinstance(rec, Recording):
        raise RecorderConfigError(
            f"Expected `rec` to be what record() returns but got {type(rec).__name__}."
        )
    if isinstance(render_depth, bool) or not isinstance(render_depth, int) or render_depth < 0:
        raise RecorderConfigError(
            f"Expected `render_depth` to be a non-negative int but got {render_depth!r}."
        )
    if styler_cls is not None and not (
        isinstance(styler_cls, type)
        and callable(getattr(styler_cls, "style_node", None))
        and callable(getattr(styler_cls, "style_edge", None))
    ):
        raise RecorderConfigError(
            "Expected `styler_cls` to be GraphvizStyler or a subclass (a class with style_node "
            f"and style_edge methods), or None, but got {styler_cls!r}."
        )
    styler = (GraphvizStyler if styler_cls is None else styler_cls)(**styler_args)
    graph_attr = {"compound": "true", "ranksep": "0.5", "fontsize": "24"}
    node_attr = {"fontsize": "20"}
    if "fontname" in styler_args:
        graph_attr["fontname"] = node_attr["fontname"] = str(styler_args["fontname"])
    digraph = graphviz.Digraph(graph_attr=graph_attr, node_attr=node_attr)
    # Layers at depth < render_depth with nodes inside are clusters, so keep one level more.
    graph = rec.graph.collapse(render_depth)
    nodes = _nodes(rec, graph)

    def is_cluster(node: BaseNode) -> bool:
        return isinstance(node, LayerNode) and node.depth < render_depth and bool(node.subnets)

    def draw(target: Any, node: BaseNode) -> None:
        if is_cluster(node):
            assert isinstance(node, LayerNode)  # for mypy: is_cluster checked it
            style = {k: str(v) for k, v in styler.style_node(node).items()}
            style["fillcolor"] = "white"
            sub = graphviz.Digraph(
                name="cluster_" + node.node.id,
                graph_attr=style,
                node_attr={"group": str(node.depth)},
            )
            for child in node.subnets:
                draw(sub, child)
            target.subgraph(sub)
        else:
            style = {k: str(v) for k, v in styler.style_node(node).items()}
            target.node(_dot_name(node.node.id), **style)

    def anchor(node: BaseNode) -> BaseNode:
        while is_cluster(node):
            assert isinstance(node, LayerNode)
            node = node.subnets[0]
        return node

    for node in nodes.values():
        if node.parent is None:
            draw(digraph, node)
    for src_id, dst_id in graph.edges:
        fnode, tnode = nodes[src_id], nodes[dst_id]
        style = {k: str(v) for k, v in styler.style_edge(fnode, tnode).items()}
        if is_cluster(fnode):
            style.setdefault("ltail", "cluster_" + fnode.node.id)
        if is_cluster(tnode):
            style.setdefault("lhead", "cluster_" + tnode.node.id)
        digraph.edge(_dot_name(anchor(fnode).node.id), _dot_name(anchor(tnode).node.id), **style)
    return digraph


def render_network(
    net: nn.Module,
    name: str,
    input_shapes: Any,
    directory: str,
    filename: str | None = None,
    fmt: str = "svg",
    input_data: Any = None,
    render_depth: int = 1,
    **styler_args: Any,
) -> str:
    """torchrecorder's ``render_network``: record ``net`` and draw it to ``directory``.

    Writes ``"{name}-{render_depth}.{fmt}"`` (``filename`` is accepted and unused, as in
    torchrecorder), labelled ``"{name} at depth = {render_depth}"``. Unlike torchrecorder the
    network is not moved to the CPU or put in training mode: it runs where and as it is.

    Returns:
        The path of the written file.

    Raises:
        RecorderConfigError: an unknown ``fmt``, a ``directory`` that is not a path, or a bad
            ``render_depth``, ``name`` or input (raised before the network runs).
        RecorderStateError: Graphviz (the ``dot`` program or the ``graphviz`` package) is
            missing or failed.
    """
    graphviz = _graphviz()
    # Checked before the network runs, not after (graphviz would raise its own ValueError).
    if not isinstance(fmt, str) or fmt not in graphviz.FORMATS:
        near = suggestion(fmt, graphviz.FORMATS, "formats") if isinstance(fmt, str) else ""
        raise RecorderConfigError(
            f"Expected `fmt` to be a Graphviz output format such as 'svg', 'png' or 'pdf' but "
            f"got {fmt!r}. {near}".rstrip()
        )
    if not isinstance(directory, (str, os.PathLike)):
        raise RecorderConfigError(
            "Expected `directory` to be a path (str or os.PathLike) to write into but got "
            f"{type(directory).__name__} {directory!r}."
        )
    if isinstance(render_depth, bool) or not isinstance(render_depth, int) or render_depth < 0:
        raise RecorderConfigError(
            f"Expected `render_depth` to be a non-negative int but got {render_depth!r}."
        )
    rec = record(net, name, input_shapes, input_data)
    digraph = make_dot(rec, render_depth, None, **styler_args)
    digraph.format = fmt
    digraph.attr(label=f"{name} at depth = {render_depth}")
    try:
        return str(digraph.render(f"{name}-{render_depth}", directory=directory, cleanup=True))
    except graphviz.ExecutableNotFound as err:
        raise RecorderStateError(
            "Expected the Graphviz program `dot` to render the network but it could not be "
            "started; install Graphviz (e.g. `apt-get install graphviz`)."
        ) from err
