"""The examples run as a new user runs them, what they write is read back, and they leave
nothing behind: no file in the source tree, the working directory or the temporary directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.models import events, scalars

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
STATS = ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite")
MODULES = ("features.0", "features.1", "features.2", "features.3", "features.4", "classifier")

#: Every example, with arguments that make it quick; none writes anything that it keeps.
QUICK = {
    "activation_dataset.py": ["--epochs", "1"],
    "distill_digits.py": ["--steps", "20"],
    "graph_example.py": [],
    "health_view.py": ["--max-epochs", "1"],
    "record_standalone.py": [],
    "tensorboard_stats.py": ["--max-epochs", "1", "--every-n-steps", "20"],
}
#: Folders of the source tree that hold caches and build outputs, not sources (other tests,
#: running at the same time, may write Lightning's default output folders there).
NOT_SOURCES = {
    "lightning_logs",
    "checkpoints",
    "bench_out",
    ".git",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".hypothesis",
    "site",
    "build",
    "dist",
}


def run_example(name: str, *args: str, cwd: Path, tmp: Path | None = None) -> str:
    """Run ``examples/<name>`` in ``cwd`` with ``tmp`` as its temporary directory."""
    tmp = tmp or cwd.parent / f"{cwd.name}_tmp"
    tmp.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TMPDIR": str(tmp),
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def files(root: Path) -> dict[str, tuple[int, int]]:
    """``{path: (size, mtime)}`` of every file under ``root``, caches left out."""
    found = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in NOT_SOURCES and not d.endswith(".egg-info")]
        for name in names:
            stat = (Path(folder) / name).stat()
            found[os.path.relpath(Path(folder) / name, root)] = (stat.st_size, stat.st_mtime_ns)
    return found


def test_tensorboard_stats(tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = run_example(
        "tensorboard_stats.py",
        *("--out", "logs", "--max-epochs", "1", "--every-n-steps", "5", "--plot", "p.png"),
        cwd=cwd,
        tmp=tmp_path / "tmp",
    )
    log_dir = cwd / "logs" / "version_0"
    assert f"TensorBoard logs: {Path('logs') / 'version_0'}" in out
    assert "tensorboard --logdir logs" in out
    assert sorted(p.name for p in cwd.iterdir()) == ["logs", "p.png"]
    assert list((tmp_path / "tmp").iterdir()) == []
    assert "Last logged statistics (train at step 44, val at step 44)" in out
    table = [line.split() for line in out.splitlines() if line.startswith(("train ", "val "))]
    assert [(row[0], row[1]) for row in table] == [
        (stage, module) for stage in ("train", "val") for module in sorted(MODULES)
    ]
    assert (cwd / "p.png").stat().st_size > 10_000

    got = scalars(log_dir)
    steps = [4, 9, 14, 19, 24, 29, 34, 39, 44]  # 45 steps of 32 digits, every 5 steps
    for module in MODULES:
        for stat in STATS:
            assert sorted(got[f"stats/train/{module}/{stat}"]) == steps
            assert sorted(got[f"stats/val/{module}/{stat}"]) == [44]
    for name in ("features.0.weight", "classifier.3.bias"):
        for stat in ("norm", "grad_norm", "update_ratio"):
            assert sorted(got[f"stats/train/{name}/{stat}"]) == steps
    assert sorted(got["train_loss"]) == steps  # Lightning's own points, on the same axis

    # The statistics agree with what the layers do, at every logged step.
    for stage, step in [("train", s) for s in steps] + [("val", 44)]:

        def value(module: str, stat: str, stage: str = stage, step: int = step) -> float:
            return got[f"stats/{stage}/{module}/{stat}"][step]

        for module in MODULES:
            assert value(module, "nonfinite") == 0
            assert value(module, "min") <= value(module, "mean") <= value(module, "max")
            assert value(module, "std") > 0
        for conv, relu in (("features.0", "features.1"), ("features.2", "features.3")):
            assert value(conv, "zero_fraction") == 0 < value(relu, "zero_fraction") < 1
            assert value(relu, "min") == 0 and value(relu, "max") == value(conv, "max")
            assert value(relu, "abs_mean") == value(relu, "mean")
        assert value("features.4", "max") == value("features.3", "max")  # max pooling
        assert value("features.4", "zero_fraction") <= value("features.3", "zero_fraction")
    hists = events(log_dir).Tags()["histograms"]
    assert {f"stats/train/{m}/histogram" for m in MODULES} <= set(hists)


def test_health_view(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = run_example(
        "health_view.py", "--out", "logs", "--max-epochs", "1", cwd=cwd, tmp=tmp_path / "tmp"
    )
    assert f"TensorBoard logs: {Path('logs') / 'version_0'}" in out
    assert sorted(p.name for p in cwd.iterdir()) == ["logs"]
    assert list((tmp_path / "tmp").iterdir()) == []
    # The two sick branches are named, from the fifth logged step on (45 steps, every 5).
    found = {tuple(line.split()[:4]) for line in out.splitlines() if line.startswith("step ")}
    assert ("step", "24", "dead_units", "dead.1") in found
    assert ("step", "24", "saturation", "saturated.1") in found
    assert not any(module.startswith(("healthy", "trunk")) for *_, module in found)

    acc = EventAccumulator(
        str(cwd / "logs" / "version_0"), size_guidance={"images": 0, "tensors": 0}
    )
    acc.Reload()
    tags = acc.Tags()
    heatmaps = {f"health/heatmap/{s}" for s in ("zero_fraction", "std", "grad_norm")}
    assert heatmaps <= set(tags["images"])
    # Drawn at the first logged step, when a rule fired (update_ratio at 14: the dead layer's
    # weight stands still for 3 logged steps; dead_units and saturation at 24), every 5 logged
    # steps (24) and at the end (44).
    for tag in heatmaps:
        assert [e.step for e in acc.Images(tag)] == [4, 14, 24, 44]
    table = acc.Tensors("health/findings/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "| dead_units | `dead.1` | 24 |" in table
    assert "| saturation | `saturated.1` | 24 |" in table
    config = layout_pb2.Layout()
    config.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {c.title for category in config.category for c in category.chart}
    assert {"zero_fraction of every layer (train)", "grad_norm of every parameter"} <= charts


def test_record_standalone() -> None:
    import runpy

    namespace = runpy.run_path(str(EXAMPLES / "record_standalone.py"))
    dead = namespace["main"](epochs=2)
    assert sorted(dead) == ["1", "3"]  # one stream per ReLU, named after it
    assert all(0.0 <= fraction < 1.0 for fraction in dead.values())


@pytest.mark.parametrize("name", sorted(QUICK))
def test_example_help_describes_it_and_runs_nothing(name: str, tmp_path: Path) -> None:
    out = run_example(name, "--help", cwd=tmp_path)
    assert out.startswith("usage: "), out[:500]  # the help, not a run's output
    first_line = (EXAMPLES / name).read_text(encoding="utf-8").split('"""')[1].split("\n")[0]
    assert " ".join(first_line.split()) in " ".join(out.split())  # the docstring's summary
    for option in ("--out", "--epochs", "--max-epochs", "--steps"):
        if option in QUICK[name] or f"``{option}" in (EXAMPLES / name).read_text(encoding="utf-8"):
            assert option in out, (name, option)  # the options its docstring names
    assert not [p for p in tmp_path.iterdir()], "--help wrote files"


def test_every_example_is_run() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(QUICK))
def test_example_leaves_nothing_behind(name: str, tmp_path: Path) -> None:
    if name == "graph_example.py" and shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed (the Makefile's set-up installs it)")
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    before = files(ROOT)
    out = run_example(name, *QUICK[name], cwd=cwd, tmp=tmp)
    after = files(ROOT)
    assert out.strip()  # it ran and said something
    assert {p for p in after if after[p] != before.get(p)} == set(), "written in the source tree"
    assert list(cwd.iterdir()) == [], "written in the working directory"
    assert list(tmp.iterdir()) == [], "left in the temporary directory"
