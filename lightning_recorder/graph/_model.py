"""The execution graph (:class:`ExecutionGraph`, its nodes and edges) and :class:`GraphRecorder`."""

from __future__ import annotations

import json
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from os import PathLike
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import nn

from .._core.checks import check_option, inputs_taken, suggestion
from .._core.compat import uncompiled
from .._core.hooks import HookSet
from .._core.structures import shape_of
from ..errors import NoRecordError, RecorderConfigError, RecorderStateError, UnknownSourceError
from ._builder import GraphBuilder
from ._dot import render_dot, to_dot

__all__ = ["ExecutionGraph", "GraphEdge", "GraphNode", "GraphRecorder", "record_graph"]

NodeKind = Literal["module", "parameter", "tensor", "op"]
RenderFormat = Literal["svg", "png", "pdf"]
_KINDS: tuple[str, ...] = get_args(NodeKind)
_FORMATS: tuple[str, ...] = get_args(RenderFormat)


@dataclass(frozen=True)
class GraphNode:
    """One node of an :class:`ExecutionGraph`.

    Args:
        id: unique within the graph, e.g. ``"module:features.0"``, ``"param:fc.weight"``,
            ``"tensor:3"``, ``"op:7"``; a module called again gets ``"#2"``, ``"#3"`` …
        kind: ``"module"`` (one node per call), ``"parameter"``, ``"tensor"`` (a tensor that
            crossed a module boundary) or ``"op"`` (an autograd operation).
        name: the module's or parameter's qualified name (``""`` for the model itself), the
            tensor's role (``"x"``, ``"output[0]"``, ``"features.0:out"``), or the autograd
            node's name (``"ConvolutionBackward0"``).
        label: the text shown when rendered.
        depth: nesting depth: the model is 0, its children 1; what runs inside a module at
            depth ``d`` (operations, parameters, tensors passed between its children) is ``d + 1``.
        parent: id of the enclosing module call, ``None`` at the top.
        type: the module's class name, ``"Parameter"``, ``"Tensor"``, or the autograd node's name.
        shape: tensor and parameter shape.
        dtype: tensor and parameter dtype, e.g. ``"float32"``.
    """

    id: str
    kind: NodeKind
    name: str
    label: str
    depth: int
    parent: str | None = None
    type: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None


class GraphEdge(NamedTuple):
    """A directed edge: data flows from ``src`` to ``dst`` (both node ids)."""

    src: str
    dst: str


def _check_depth(depth: object) -> int | None:
    if depth is None or (isinstance(depth, int) and not isinstance(depth, bool) and depth >= 0):
        return depth
    raise RecorderConfigError(
        f"Expected `depth` to be None or a non-negative integer but got {depth!r}."
    )


class ExecutionGraph:
    """The nodes and edges of recorded forward passes; immutable.

    Args:
        nodes: the nodes; parents must come with them and nesting depths must be consistent.
        edges: ``(src, dst)`` pairs of node ids.

    Raises:
        RecorderConfigError: duplicate ids, edges or parents naming unknown nodes, a depth that
            is not a non-negative int or does not match the parent's.

    Examples:
        >>> import torch
        >>> graph = record_graph(torch.nn.Linear(3, 2), torch.randn(1, 3))
        >>> sorted({n.kind for n in graph.nodes})
        ['module', 'op', 'parameter', 'tensor']
        >>> ExecutionGraph.from_dict(json.loads(graph.to_json())) == graph
        True
    """

    def __init__(self, nodes: Iterable[GraphNode], edges: Iterable[tuple[str, str]]) -> None:
        self._nodes = tuple(nodes)
        self._by_id: dict[str, GraphNode] = {}
        for node in self._nodes:
            if node.id in self._by_id:
                raise RecorderConfigError(f"Expected unique node ids but got {node.id!r} twice.")
            if not isinstance(node.depth, int) or isinstance(node.depth, bool) or node.depth < 0:
                raise RecorderConfigError(
                    f"Expected node depth to be a non-negative int but got "
                    f"{type(node.depth).__name__} {node.depth!r} (node {node.id!r})."
                )
            if node.kind not in _KINDS:
                raise RecorderConfigError(
                    f"Expected node kind to be one of {', '.join(map(repr, _KINDS))} but got "
                    f"{node.kind!r} (node {node.id!r})."
                )
            self._by_id[node.id] = node
        for node in self._nodes:
            parent = self._by_id.get(node.parent) if node.parent is not None else None
            if node.parent is not None and parent is None:
                raise RecorderConfigError(
                    f"Expected the parent of {node.id!r} to be a node of the graph but got "
                    f"{node.parent!r}."
                )
            expected = 0 if parent is None else parent.depth + 1
            if node.depth != expected:
                raise RecorderConfigError(
                    f"Expected node {node.id!r} to have depth {expected} (its parent's depth + 1) "
                    f"but got {node.depth}."
                )
        unique = dict.fromkeys(GraphEdge(*e) for e in edges)
        for edge in unique:
            for end in edge:
                if end not in self._by_id:
                    raise RecorderConfigError(
                        f"Expected edge {tuple(edge)} to join nodes of the graph but got the "
                        f"unknown id {end!r}."
                    )
        self._edges = tuple(unique)

    @property
    def nodes(self) -> tuple[GraphNode, ...]:
        """All nodes: module calls in call order, then tensors, parameters and operations."""
        return self._nodes

    @property
    def edges(self) -> tuple[GraphEdge, ...]:
        """All edges, without duplicates."""
        return self._edges

    @property
    def max_depth(self) -> int:
        """The largest node depth (``-1`` for an empty graph)."""
        return max((n.depth for n in self._nodes), default=-1)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._by_id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExecutionGraph):
            return NotImplemented
        return self._nodes == other._nodes and self._edges == other._edges

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        counts = {k: sum(n.kind == k for n in self._nodes) for k in _KINDS}
        shown = ", ".join(f"{v} {k}s" for k, v in counts.items())
        return f"ExecutionGraph({shown}, {len(self._edges)} edges, max_depth={self.max_depth})"

    def node(self, node_id: str) -> GraphNode:
        """The node with id ``node_id``.

        Raises:
            UnknownSourceError: no such node; the message lists the closest ids.
        """
        if not isinstance(node_id, str):
            raise UnknownSourceError(
                f"Expected a node id of the graph (a str) but got {type(node_id).__name__} "
                f"{node_id!r}."
            )
        if node_id not in self._by_id:
            raise UnknownSourceError(
                f"Expected a node id of the graph but got {node_id!r}. "
                f"{suggestion(node_id, self._by_id, 'node ids')}"
            )
        return self._by_id[node_id]

    def find(self, kind: NodeKind | None = None, name: str | None = None) -> list[GraphNode]:
        """Nodes of a kind and/or with a name, in graph order.

        Raises:
            RecorderConfigError: an unknown ``kind``, or a ``name`` that is not a str.
        """
        if kind is not None:
            check_option("kind", kind, _KINDS)
        if name is not None and not isinstance(name, str):
            raise RecorderConfigError(
                f"Expected `name` to be a node name (a str such as 'features.0', '' for the model) "
                f"or None but got {type(name).__name__} {name!r}."
            )
        return [
            n
            for n in self._nodes
            if (kind is None or n.kind == kind) and (name is None or n.name == name)
        ]

    def children(self, node_id: str) -> list[GraphNode]:
        """The nodes directly inside module call ``node_id``."""
        self.node(node_id)
        return [n for n in self._nodes if n.parent == node_id]

    def successors(self, node_id: str) -> list[GraphNode]:
        """The nodes that ``node_id`` has an edge to."""
        self.node(node_id)
        return [self._by_id[e.dst] for e in self._edges if e.src == node_id]

    def predecessors(self, node_id: str) -> list[GraphNode]:
        """The nodes with an edge to ``node_id``."""
        self.node(node_id)
        return [self._by_id[e.src] for e in self._edges if e.dst == node_id]

    def collapse(self, depth: int | None) -> ExecutionGraph:
        """The graph seen at nesting ``depth``: deeper nodes merge into their module at ``depth``.

        Edges are redirected to the merged nodes; edges inside a merged module, duplicates, and
        the edge back into a module from a tensor it returned are dropped. ``None`` (or a depth
        at least :attr:`max_depth`) returns the graph unchanged.

        Raises:
            RecorderConfigError: ``depth`` is negative or not an integer.
        """
        limit = _check_depth(depth)
        if limit is None or limit >= self.max_depth:
            return self
        keep: dict[str, str] = {}
        for node in self._nodes:
            top = node
            while top.depth > limit and top.parent is not None:
                top = self._by_id[top.parent]
            keep[node.id] = top.id
        edges = {(keep[s], keep[d]): None for s, d in self._edges if keep[s] != keep[d]}
        # A tensor that a module both returns and uses inside itself (an intermediate feature
        # returned alongside the result) would read as module -> tensor -> module; keep the
        # first edge only, so that the collapsed graph stays acyclic.
        tensors = {n.id for n in self._nodes if n.kind == "tensor"}
        cycles = {(s, d) for s, d in edges if s in tensors and (d, s) in edges}
        return ExecutionGraph(
            [n for n in self._nodes if n.depth <= limit], [e for e in edges if e not in cycles]
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and dicts (JSON-ready): ``{"nodes": [...], "edges": [[src, dst], ...]}``."""
        nodes = []
        for node in self._nodes:
            data = asdict(node)
            data["shape"] = None if node.shape is None else list(node.shape)
            nodes.append(data)
        return {"nodes": nodes, "edges": [list(e) for e in self._edges]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExecutionGraph:
        """Rebuild a graph from :meth:`to_dict` output (e.g. after ``json.loads``).

        Raises:
            RecorderConfigError: the data lacks ``nodes`` or ``edges``, they are not lists, a
                node is not a mapping or lacks a field, or an edge is not a pair.
        """
        if not isinstance(data, Mapping):
            raise RecorderConfigError(
                "Expected `data` to be a mapping with 'nodes' and 'edges' (the output of "
                f"to_dict()) but got {type(data).__name__}."
            )
        missing = [k for k in ("nodes", "edges") if k not in data]
        if missing:
            raise RecorderConfigError(
                f"Expected a mapping with 'nodes' and 'edges' but got keys {sorted(data)}."
            )
        items, pairs = data["nodes"], data["edges"]
        for key, value in (("nodes", items), ("edges", pairs)):
            if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
                raise RecorderConfigError(
                    f"Expected {key!r} to be a list (the output of to_dict()) but got "
                    f"{type(value).__name__} {value!r:.80}."
                )
        nodes = []
        for number, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise RecorderConfigError(
                    f"Expected node {number} to be a mapping of its fields "
                    f"{list(GraphNode.__dataclass_fields__)} but got {type(item).__name__} "
                    f"{item!r:.80}."
                )
            fields = dict(item)
            if fields.get("shape") is not None:
                fields["shape"] = tuple(fields["shape"])
            try:
                nodes.append(GraphNode(**fields))
            except TypeError as err:
                raise RecorderConfigError(
                    f"Expected node fields {list(GraphNode.__dataclass_fields__)} but got "
                    f"{sorted(fields)}."
                ) from err
        edges = []
        for number, pair in enumerate(pairs):
            is_sequence = isinstance(pair, Iterable) and not isinstance(pair, (str, bytes))
            ends = list(pair) if is_sequence else []
            if len(ends) != 2:
                raise RecorderConfigError(
                    f"Expected edge {number} to be a [src, dst] pair of node ids but got "
                    f"{pair!r:.80}."
                )
            edges.append((str(ends[0]), str(ends[1])))
        return cls(nodes, edges)

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    def to_dot(self, depth: int | None = None) -> str:
        """Graphviz DOT source, module calls drawn as nested clusters (needs no Graphviz).

        Args:
            depth: show nodes down to this nesting depth (see :meth:`collapse`); ``None``: all.

        Raises:
            RecorderConfigError: ``depth`` is negative or not an integer.
        """
        return to_dot(self.collapse(depth))

    def render(
        self, path: str | Path, format: RenderFormat | None = None, depth: int | None = None
    ) -> Path:
        """Draw the graph with Graphviz's ``dot`` program into ``path``.

        Args:
            path: the output file. Its suffix picks the format when ``format`` is not given;
                without a ``.svg``/``.png``/``.pdf`` suffix, one is appended.
            format: ``"svg"``, ``"png"`` or ``"pdf"``; default: from the suffix, else ``"svg"``.
            depth: as in :meth:`to_dot`.

        Returns:
            The path written.

        Raises:
            RecorderConfigError: ``path`` is not a path, an unknown ``format``, a suffix that
                contradicts it, or a bad ``depth``.
            RecorderStateError: the ``dot`` program (or the ``graphviz`` Python package) is
                missing; the message says how to install it.
        """
        if not isinstance(path, (str, PathLike)):
            raise RecorderConfigError(
                "Expected `path` to be the output file, a str or os.PathLike such as "
                f"'graph.svg', but got {type(path).__name__} {path!r}."
            )
        target = Path(path)
        from_suffix = target.suffix[1:].lower() if target.suffix[1:].lower() in _FORMATS else None
        if format is None:
            format = from_suffix or "svg"  # type: ignore[assignment]
        check_option("format", format, _FORMATS)
        if from_suffix is not None and from_suffix != format:
            raise RecorderConfigError(
                f"Expected the suffix of `path` to match `format` {format!r} but got {str(path)!r}."
            )
        source = self.to_dot(depth)
        if from_suffix is None:
            target = target.with_name(f"{target.name}.{format}")
        return render_dot(source, target, str(format))


class GraphRecorder:
    """Record the execution graph of the forward passes run inside a ``with`` block.

    Hooks are installed on every submodule on entry and removed on exit (also when the block
    raises). The graph is built on exit and read from :attr:`graph`. Nothing the model computes
    is changed: use the outputs, call ``backward`` and step the optimizer as usual.

    Args:
        model: the module whose calls are recorded (wrappers such as DDP are looked through).

    Raises:
        RecorderConfigError: ``model`` is not a ``torch.nn.Module``, or is scripted
            (``torch.jit.script``; a scripted submodule is recorded as part of its caller).

    Examples:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
        >>> with GraphRecorder(model) as recorder:
        ...     loss = model(torch.randn(2, 3)).sum()
        >>> loss.backward()
        >>> [n.label for n in recorder.graph.find(kind="op")]
        ['T', 'Addmm', 'Tanh']
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise RecorderConfigError(
                f"Expected `model` to be a torch.nn.Module but got {type(model).__name__}."
            )
        if isinstance(model, torch.jit.ScriptModule):
            raise RecorderConfigError(
                f"Expected `model` to take module hooks but got a scripted module "
                f"({type(model).__name__}, torch.jit.script), on which torch allows none; record "
                "the model before scripting it."
            )
        self.model = model
        self._hooks = HookSet(f"GraphRecorder({type(model).__name__})")
        self._builder: GraphBuilder | None = None
        self._graph: ExecutionGraph | None = None

    def __enter__(self) -> GraphRecorder:
        if self._builder is not None:
            raise RecorderStateError(
                "Expected a GraphRecorder that is not recording but got one already inside its "
                "`with` block; use a second GraphRecorder to nest recordings."
            )
        self._graph = None
        self._builder = GraphBuilder(self.model)
        try:
            self._builder.attach(self._hooks)
        except BaseException:
            self._hooks.remove_all()
            self._builder = None
            raise
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        builder, self._builder = self._builder, None
        self._hooks.remove_all()
        if builder is not None and exc_type is None and builder.calls:
            nodes, edges = builder.build()
            self._graph = ExecutionGraph([GraphNode(**n) for n in nodes], edges)

    @property
    def graph(self) -> ExecutionGraph:
        """The graph recorded by the last ``with`` block.

        Raises:
            NoRecordError: still recording, the block raised, or the model was never called.
        """
        if self._graph is None:
            state = (
                "a recorder still inside its `with` block"
                if self._builder is not None
                else "no recorded call (the block raised or never called the model)"
            )
            raise NoRecordError(
                f"Expected a forward pass recorded inside `with GraphRecorder(model):` but got "
                f"{state}."
            )
        return self._graph


def record_graph(model: nn.Module, /, *args: Any, **kwargs: Any) -> ExecutionGraph:
    """Run ``model(*args, **kwargs)`` once and return its execution graph.

    The forward runs under the caller's grad mode: under ``torch.no_grad`` the graph holds module
    calls and tensors but no operations or parameters (those are found through autograd). A
    ``torch.compile``-d model runs uncompiled, through the module it wraps.

    Args:
        model: the module to run.
        *args: positional inputs of ``model``.
        **kwargs: keyword inputs of ``model``.

    Returns:
        The execution graph of the call.

    Raises:
        RecorderConfigError: ``model`` is not a ``torch.nn.Module``, or is scripted
            (``torch.jit.script``; a scripted submodule is recorded as part of its caller); or
            its forward raised on the inputs given (the forward's exception is its cause), as
            :class:`~lightning_recorder.Inspector` says of inputs its model cannot take.

    Examples:
        >>> import torch
        >>> graph = record_graph(torch.nn.Linear(3, 2), torch.randn(1, 3))
        >>> [(e.src, e.dst) for e in graph.collapse(0).edges]
        [('tensor:0', 'module:<root>'), ('module:<root>', 'tensor:1')]
    """
    with GraphRecorder(model) as recorder:
        # the module a torch.compile wrapper holds: compiling it just to record is wasted time
        net = uncompiled(model)
        fix = (
            "; pass what its forward takes: record_graph(model, *args, **kwargs) runs "
            "model(*args, **kwargs) once."
        )
        with inputs_taken(net, lambda: _inputs_text(args, kwargs), fix):
            net(*args, **kwargs)
    return recorder.graph


def _inputs_text(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The inputs of a call, for a message: a tensor as its shape, anything else as a short
    repr (made only for a forward that failed)."""

    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"Tensor{list(shape_of(value))}"
        return reprlib.repr(value)

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return f"the inputs of record_graph ({', '.join(parts) or 'none'})"
