"""What works on a plain ``pip install lightning-recorder``: the core dependencies only.

The development environment holds every optional library; these tests hide one from the import
system (``sys.modules[name] = None`` makes ``import name`` raise ``ImportError``, as on a machine
without it) and check that the feature that needs it says so instead of stopping a run.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_recorder.callbacks._health_evidence import Evidence


def test_health_evidence_without_safetensors_warns_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HealthMonitor saves a bundle's tensors with safetensors (a dependency of the package,
    which an environment may still lack or hold broken): without it, a non-finite step of a run
    with the defaults raised ``ModuleNotFoundError`` out of ``fit`` and left a half-written
    folder."""
    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)
    evidence = Evidence(tmp_path / "health", max_bytes=2**22)
    path = evidence.path(step=1, rank=0)
    assert path is not None
    batch = torch.tensor([1.0, float("nan"), 3.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = evidence.write(path, {"batch": ("batch", batch)}, {"kind": "nonfinite"})
    assert written is None
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "pip install safetensors" in messages[0] and "training goes on" in messages[0]
    assert list((tmp_path / "health").iterdir()) == []  # nothing half-written left


def test_render_without_graphviz_names_the_extra_in_a_line_every_shell_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The message said `pip install lightning-recorder[graph]`: unquoted, zsh (macOS's shell)
    reads the brackets as a glob and answers "no matches found"; the README quotes it."""
    from torch import nn

    from lightning_recorder.errors import RecorderStateError
    from lightning_recorder.graph import _dot, record_graph

    monkeypatch.setattr(_dot.shutil, "which", lambda name: f"/usr/bin/{name}")  # `dot` is there
    monkeypatch.setitem(sys.modules, "graphviz", None)
    graph = record_graph(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), torch.randn(2, 3))
    with pytest.raises(RecorderStateError) as caught:
        graph.render(tmp_path / "graph.svg")
    message = str(caught.value)
    assert message.startswith("Expected the Python package `graphviz` to render a graph")
    assert '`pip install "lightning-recorder[graph]"`' in message
    assert not (tmp_path / "graph.svg").exists()


def test_inspector_summary_without_torchinfo_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchinfo is the `summary` extra's: the message names it beside the plain install, and
    the package's own table still works."""
    from torch import nn

    from lightning_recorder import Inspector
    from lightning_recorder.errors import RecorderConfigError

    monkeypatch.setitem(sys.modules, "torchinfo", None)
    inspector = Inspector(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), input_size=(2, 3))
    with pytest.raises(RecorderConfigError) as caught:
        _ = inspector.summary
    message = str(caught.value)
    assert message.startswith("Expected torchinfo to be installed for `summary`")
    assert '`pip install "lightning-recorder[summary]"`' in message
    assert "Linear" in inspector.summary_text()


def test_activation_writers_and_dataset_without_safetensors_fail_when_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Activation shards are safetensors files: without the package, ActivationWriter was made
    and its fit failed at the first checkpoint ("failed to write a shard: No module named
    'safetensors'", no install line), and ActivationDataset failed on its first item."""
    from lightning_recorder import ActivationDataset, ActivationWriter
    from lightning_recorder.activations import ShardWriter
    from lightning_recorder.errors import RecorderStateError

    with ShardWriter(tmp_path / "written") as writer:  # a shard to read back
        writer.write("probe", "probe", torch.ones(2, 3))
    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)
    expected = r"Expected the Python package `safetensors` for {} .* `pip install safetensors`"
    with pytest.raises(RecorderStateError, match=expected.format("ShardWriter")):
        ShardWriter(tmp_path / "shards")
    with pytest.raises(RecorderStateError, match=expected.format("ActivationWriter")):
        ActivationWriter(["body.0"], tmp_path / "acts")
    with pytest.raises(RecorderStateError, match=expected.format("ActivationDataset")):
        ActivationDataset(tmp_path / "written")
    assert not (tmp_path / "shards").exists() and not (tmp_path / "acts").exists()
