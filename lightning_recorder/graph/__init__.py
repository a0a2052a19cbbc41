"""Record the execution graph of a forward pass: modules, parameters, tensors and operations.

:func:`record_graph` runs one forward pass and returns an :class:`ExecutionGraph`;
:class:`GraphRecorder` records the forward passes you run yourself inside a ``with`` block. The
recording only *reads*: no tensor is replaced, detached or copied, so outputs and gradients are
exactly those of an unrecorded run, and every hook is removed when recording ends.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> graph = record_graph(model, torch.randn(3, 4))
    >>> [n.name for n in graph.find(kind="module")]
    ['', '0', '1', '2']
    >>> print(graph.collapse(0).to_dot().count("->"))  # input -> model -> output
    2

torchrecorder's functions run on top of it, with its names and arguments: :func:`record`,
:func:`make_dot` (a ``graphviz.Digraph``, styled by :class:`GraphvizStyler` or a subclass) and
:func:`render_network`.
"""

from ._model import ExecutionGraph, GraphEdge, GraphNode, GraphRecorder, record_graph
from ._torchrecorder import (
    BaseNode,
    GraphvizStyler,
    LayerNode,
    OpNode,
    ParamNode,
    Recording,
    TensorNode,
    make_dot,
    record,
    render_network,
)

__all__ = [
    "BaseNode",
    "ExecutionGraph",
    "GraphEdge",
    "GraphNode",
    "GraphRecorder",
    "GraphvizStyler",
    "LayerNode",
    "OpNode",
    "ParamNode",
    "Recording",
    "TensorNode",
    "make_dot",
    "record",
    "record_graph",
    "render_network",
]
