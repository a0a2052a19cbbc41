"""The floor plan holds: layers in folder names, no room importing a sibling, no cycle.

* ``_core`` is the torch-only foundation: it imports no room.
* The feature rooms (recorders, stats, distill, bulk, inspector, graph, activations) stand on
  ``_core`` and ``errors`` only: none imports another; they meet in ``callbacks``.
* ``callbacks`` is the only room that imports Lightning; outside it, only ``stats.metric``
  imports torchmetrics.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_recorder"
ROOMS = ("recorders", "stats", "distill", "bulk", "inspector", "graph", "activations")
FOUNDATION = ("_core", "errors")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """Package modules imported by ``path`` (absolute names; TYPE_CHECKING imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    modules = _modules()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lightning_recorder"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("lightning_recorder"):
                target = node.module
            else:
                continue
            for alias in node.names:  # `from . import patching` imports a module
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_is_in_a_room() -> None:
    top = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py"}
    assert top == {"__init__.py", "errors.py"}, "loose modules at the top level: " + str(top)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_rooms_import_only_downward(module: str) -> None:
    room = _room(module)
    for target in _imports(module, _modules()[module]):
        other = _room(target)
        if room in ("", "callbacks") or (other in ("", room) and room):
            if room and other == "":
                pytest.fail(f"{module} imports the package face {target}: import the room")
            continue
        if room == "errors":
            pytest.fail(f"errors imports {target}: it is the ground floor")
        if room == "_core":
            assert other in FOUNDATION, f"_core module {module} imports the room of {target}"
        elif room in ROOMS:
            assert other in FOUNDATION, (
                f"feature room {room!r} ({module}) imports {target}: rooms meet only in callbacks"
            )


def test_no_import_cycles() -> None:
    graph = {name: _imports(name, path) for name, path in _modules().items()}
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt in graph and nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_only_callbacks_import_lightning() -> None:
    """Import every module outside ``callbacks`` in a fresh interpreter, checking after each."""
    names = [n for n in _modules() if _room(n) != "callbacks" and n != "lightning_recorder"]
    names.sort(key=lambda n: n == "lightning_recorder.stats.metric")  # torchmetrics: last
    code = "\n".join(
        [
            "import importlib, sys",
            f"for name in {names!r}:",
            "    importlib.import_module(name)",
            "    assert 'lightning' not in sys.modules, name + ' imported lightning'",
            "    assert 'lightning.pytorch' not in sys.modules, name + ' imported lightning'",
            "    if name != 'lightning_recorder.stats.metric':",
            "        assert 'torchmetrics' not in sys.modules, name + ' imported torchmetrics'",
            "print(len(" + repr(names) + "))",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.strip()) == len(names) > 30


def test_the_package_face_loads_lightning_only_on_use() -> None:
    code = (
        "import sys, lightning_recorder as lr\n"
        "assert 'lightning' not in sys.modules and 'torchmetrics' not in sys.modules\n"
        "lr.FeatureStats\n"
        "assert 'torchmetrics' in sys.modules and 'lightning.pytorch' not in sys.modules\n"
        "lr.FeatureStatsMonitor\n"
        "assert 'lightning.pytorch' in sys.modules\n"
        "print(sorted(set(lr.__all__) - set(dir(lr))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
