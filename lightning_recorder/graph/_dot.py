"""DOT text for an execution graph, and drawing it with Graphviz's ``dot`` program."""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from ..errors import RecorderStateError


class GraphNode(Protocol):
    """What drawing needs of a node (``graph.GraphNode`` has it; no import of the model)."""

    @property
    def id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def label(self) -> str: ...
    @property
    def parent(self) -> str | None: ...
    @property
    def depth(self) -> int: ...


class ExecutionGraph(Protocol):
    """What drawing needs of a graph: its nodes, its edges, and a node by id."""

    @property
    def nodes(self) -> Sequence[GraphNode]: ...
    @property
    def edges(self) -> Iterable[tuple[str, str]]: ...
    def node(self, node_id: str) -> GraphNode: ...


_INSTALL = (
    "Install Graphviz, e.g. `apt-get install graphviz` (Debian/Ubuntu), `brew install graphviz` "
    "(macOS) or `conda install graphviz`; `to_dot()` and `to_json()` work without it."
)

_GRAPH_ATTRS = (
    'rankdir="TB"',
    "compound=true",
    'fontname="Helvetica"',
    "fontsize=11",
    "nodesep=0.25",
    "ranksep=0.3",
)
_NODE_DEFAULTS = 'node [fontname="Helvetica", fontsize=10, height=0.3, margin="0.08,0.03"]'
_EDGE_DEFAULTS = 'edge [color="#555555", arrowsize=0.6]'
_STYLES: dict[str, str] = {
    "module": 'shape=box, style="rounded,filled", fillcolor="#d6e4f5", color="#3d6fa8"',
    "parameter": 'shape=box, style="filled", fillcolor="#dcefd2", color="#5e9148", fontsize=9',
    "tensor": 'shape=ellipse, style="filled", fillcolor="#fff2c2", color="#b8962e", fontsize=9',
    "op": 'shape=box, style="filled", fillcolor="#eeeeee", color="#8a8a8a", fontsize=9',
}
_CLUSTER_FILLS = ("#f4f8fd", "#ffffff")


def quote(text: str) -> str:
    """A DOT double-quoted string; a newline becomes a centred line break."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _cluster(node_id: str) -> str:
    return "cluster_" + node_id


def to_dot(graph: ExecutionGraph) -> str:
    """DOT source for ``graph`` as given (collapse it first to limit the depth).

    A module call with nodes inside is a cluster; one without (collapsed, or a module that ran no
    recorded operation) is a box. Edges to or from a cluster end at its border.
    """
    children: dict[str | None, list[GraphNode]] = {}
    for node in graph.nodes:
        children.setdefault(node.parent, []).append(node)

    def is_cluster(node: GraphNode) -> bool:
        return node.kind == "module" and bool(children.get(node.id))

    def anchor(node: GraphNode) -> str:
        while is_cluster(node):
            node = children[node.id][0]
        return node.id

    lines = ["digraph execution_graph {"]
    lines += [f"  {attr};" for attr in _GRAPH_ATTRS]
    lines += [f"  {_NODE_DEFAULTS};", f"  {_EDGE_DEFAULTS};"]

    def emit(node: GraphNode, indent: str) -> None:
        if is_cluster(node):
            title = node.label.replace("\n", ": ", 1) if node.name else node.label
            fill = _CLUSTER_FILLS[node.depth % len(_CLUSTER_FILLS)]
            lines.append(f"{indent}subgraph {quote(_cluster(node.id))} {{")
            lines.append(
                f"{indent}  label={quote(title)}; labeljust=l; fontsize=10; "
                f'style="rounded,filled"; fillcolor="{fill}"; color="#3d6fa8";'
            )
            for child in children[node.id]:
                emit(child, indent + "  ")
            lines.append(f"{indent}}}")
        else:
            tooltip = f"{node.kind}: {node.name or node.label}"
            lines.append(
                f"{indent}{quote(node.id)} [label={quote(node.label)}, "
                f"tooltip={quote(tooltip)}, {_STYLES[node.kind]}];"
            )

    for node in children.get(None, []):
        emit(node, "  ")
    for src_id, dst_id in graph.edges:
        src, dst = graph.node(src_id), graph.node(dst_id)
        attrs = []
        if is_cluster(src):
            attrs.append(f"ltail={quote(_cluster(src.id))}")
        if is_cluster(dst):
            attrs.append(f"lhead={quote(_cluster(dst.id))}")
        suffix = f" [{', '.join(attrs)}]" if attrs else ""
        lines.append(f"  {quote(anchor(src))} -> {quote(anchor(dst))}{suffix};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_dot(source: str, path: Path, fmt: str) -> Path:
    """Run ``dot -T<fmt>`` on ``source`` and write the result to ``path``.

    Raises:
        RecorderStateError: the ``dot`` program or the ``graphviz`` package is missing, or
            ``dot`` failed.
    """
    if shutil.which("dot") is None:
        raise RecorderStateError(
            f"Expected the Graphviz program `dot` on PATH to render a graph but found none. "
            f"{_INSTALL}"
        )
    try:
        import graphviz
    except ImportError as err:
        raise RecorderStateError(
            "Expected the Python package `graphviz` to render a graph but it is not installed: "
            '`pip install graphviz` (or `pip install "lightning-recorder[graph]"`).'
        ) from err
    try:
        data = graphviz.pipe("dot", fmt, source.encode("utf-8"), quiet=True)
    except graphviz.ExecutableNotFound as err:
        raise RecorderStateError(
            f"Expected the Graphviz program `dot` to run but it could not be started. {_INSTALL}"
        ) from err
    except graphviz.CalledProcessError as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else ""
        raise RecorderStateError(
            f"Expected `dot -T{fmt}` to succeed but it exited with status {err.returncode}: "
            f"{stderr.strip()}"
        ) from err
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
