"""examples/activation_dataset.py runs as a new user runs it, and what it writes is read back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from lightning_recorder.activations import ActivationDataset

ROOT = Path(__file__).resolve().parents[2]


def test_activation_dataset_example(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "activation_dataset.py"),
            "--epochs",
            "1",
            "--out",
            str(tmp_path / "acts"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", proc.stdout)[1])  # type: ignore[index]
    assert accuracy > 0.8  # a linear probe on trained features; chance is 0.1
    dataset = ActivationDataset(tmp_path / "acts", "penultimate")
    assert len(dataset) == 1797 and dataset[0]["activation"].shape == (64,)
    assert torch.all(dataset.concat() >= 0)  # the output of a ReLU
