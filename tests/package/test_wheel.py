"""The package as a user gets it from a package index: the wheel and the sdist, their metadata,
and the README's first example run unchanged from the installed wheel in a fresh environment."""

from __future__ import annotations

import ast
import email
import importlib.metadata
import importlib.util
import os
import re
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from helpers.docs import python_blocks
from helpers.models import events, scalars

ROOT = Path(__file__).resolve().parents[2]
URLS = {
    "Documentation": "https://lightning-recorder.github.io/lightning-recorder/",
    "Source": "https://github.com/lightning-recorder/lightning-recorder",
    "Changelog": "https://github.com/lightning-recorder/lightning-recorder/blob/main/CHANGELOG.md",
    "Issues": "https://github.com/lightning-recorder/lightning-recorder/issues",
}


def run(command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a command to completion; its stdout, or a failure showing its output."""
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{command}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def without_pythonpath() -> dict[str, str]:
    """This process's environment, minus what would put the source tree on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and the sdist, built from the source tree with hatchling (the build backend)."""
    out = tmp_path_factory.mktemp("dist")
    env = without_pythonpath()
    if importlib.util.find_spec("hatchling") is None:  # it is in the dev extra; else fetch it
        backend = out / "backend"
        run([sys.executable, "-m", "pip", "install", "-q", "--target", str(backend), "hatchling"])
        env["PYTHONPATH"] = str(backend)
    run([sys.executable, "-m", "hatchling", "build", "-d", str(out / "dist")], cwd=ROOT, env=env)
    return out / "dist"


def test_wheel_ships_the_license_and_the_metadata(dist: Path) -> None:
    (wheel,) = dist.glob("lightning_recorder-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (info,) = {n.split("/")[0] for n in names if ".dist-info/" in n}
        (license_file,) = [n for n in names if n.startswith(info) and n.endswith("/LICENSE")]
        license_text = archive.read(license_file).decode()
        metadata = email.message_from_bytes(archive.read(f"{info}/METADATA"))
    assert license_text == (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "lightning_recorder/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "docs/", "examples/"))]

    assert (metadata.get("License-Expression") or metadata["License"]) == "Apache-2.0"
    classifiers = metadata.get_all("Classifier")
    assert "License :: OSI Approved :: Apache Software License" in classifiers
    assert "Operating System :: OS Independent" in classifiers
    assert not [c for c in classifiers if c.startswith("Framework :: Pytest")]
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL"))
    assert {k: urls[k] for k in URLS} == URLS
    extras = set(metadata.get_all("Provides-Extra"))
    assert {"tensorboard", "graph", "summary", "examples", "dev"} <= extras
    requires = [r.replace("'", '"') for r in metadata.get_all("Requires-Dist")]
    assert any(r.startswith("tensorboard") and 'extra == "tensorboard"' in r for r in requires)
    assert any(r.startswith("scikit-learn") and 'extra == "examples"' in r for r in requires)
    # one version, the package's own
    assert metadata["Version"] == _source_version()
    # every distribution a module imports at its top level is a requirement, of the core or of
    # the extra of a feature (the module is imported when that feature is used), not only of dev
    declared = {_name(r) for r in requires if 'extra == "dev"' not in r}
    assert sorted(_imported_at_top_level() - declared) == []
    # The README is the long description, with its install line.
    description = metadata.get_payload()
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert 'pip install "lightning-recorder[tensorboard]"' in description
    # The documentation site named in the metadata is the one mkdocs builds.
    assert f"site_url: {URLS['Documentation']}" in (ROOT / "mkdocs.yml").read_text()
    assert f"repo_url: {URLS['Source']}" in (ROOT / "mkdocs.yml").read_text()


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0]).lower()


def _source_version() -> str:
    """``__version__`` as the package's ``__init__.py`` assigns it."""
    tree = ast.parse((ROOT / "lightning_recorder" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == [
            "__version__"
        ]:
            return ast.literal_eval(node.value)
    raise AssertionError("no __version__ in lightning_recorder/__init__.py")


def _imported_at_top_level() -> set[str]:
    """The distributions (lower-case names) that provide the third-party modules the package's
    modules import at their top level (not inside a function, a ``try`` or ``TYPE_CHECKING``)."""
    of = importlib.metadata.packages_distributions()
    found: set[str] = set()
    for path in (ROOT / "lightning_recorder").rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in ("__future__", "lightning_recorder"):
                    continue
                found.update(_name(name) for name in of.get(top, [top]))
    return found


def test_sdist_ships_the_license(dist: Path) -> None:
    (sdist,) = dist.glob("lightning_recorder-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert {"LICENSE", "README.md", "pyproject.toml", "lightning_recorder/__init__.py"} <= names


@pytest.mark.slow
def test_readme_example_runs_from_the_installed_wheel(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("lightning_recorder-*.whl")
    # A fresh environment that sees this one's packages (torch, Lightning, TensorBoard: the
    # dependencies and the `tensorboard` extra) but not its copy of lightning_recorder. A venv
    # made from a venv is based on the base interpreter, so this environment's site-packages is
    # added by a path file, whose own path files (an editable install) are not processed.
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    venv_site = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).strip()
    )
    (venv_site / "parent_environment.pth").write_text(
        "\n".join([*site.getsitepackages(), site.getusersitepackages()]) + "\n"
    )
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    run(
        [*pip, "--no-deps", "--ignore-installed", "--no-index", str(wheel)],
        env=without_pythonpath(),
    )

    work = tmp_path / "work"
    work.mkdir()
    env = without_pythonpath()
    where = run(
        [str(python), "-c", "import lightning_recorder as m; print(m.__file__, m.__version__)"],
        cwd=work,
        env=env,
    )
    assert where.startswith(str(venv_site / "lightning_recorder")), where

    example = python_blocks(ROOT / "README.md")[0]  # the README's first example, unchanged
    assert "FeatureStatsMonitor" in example and "trainer.fit(" in example
    (work / "readme_example.py").write_text(example, encoding="utf-8")
    out = run([str(python), "readme_example.py"], cwd=work, env=env)
    assert "tensorboard --logdir lightning_logs" in out

    (run_dir,) = (work / "lightning_logs").glob("*/version_0")
    got = scalars(run_dir)
    for module in ("features.0", "features.1", "features.2", "features.3", "classifier"):
        for stat in ("mean", "std", "zero_fraction", "nonfinite"):
            assert sorted(got[f"stats/train/{module}/{stat}"]) == [9, 19, 29, 39, 49, 59]
    assert 0 < got["stats/train/features.1/zero_fraction"][59] < 1  # a ReLU's output
    assert "stats/train/features.0.weight/update_ratio" in got
    assert "stats/train/features.3/histogram" in events(run_dir).Tags()["histograms"]
