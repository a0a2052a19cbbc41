"""Record the execution graph of a small CNN and draw it with Graphviz.

Writes ``graph_example.svg`` and ``graph_example.png`` (all depths) and ``graph_example_depth1.svg``
(the model's children only) into the folder given with ``--out``; without it, into a temporary
folder that is removed at the end. Runs in about a second on a laptop CPU; needs Graphviz's ``dot``
program (``apt-get install graphviz``, ``brew install graphviz`` or ``conda install graphviz``)
and the ``graphviz`` Python package (``pip install "lightning-recorder[graph]"``).

    python examples/graph_example.py --out graphs/

The pictures in the documentation's ``docs/images`` are made with ``--out docs/images``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn

from lightning_recorder.graph import record_graph


class SmallCNN(nn.Module):
    """Two convolution blocks in a ``Sequential``, then a linear classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def main(out: Path) -> list[Path]:
    """Record one forward pass of :class:`SmallCNN` and render it; return the files written."""
    torch.manual_seed(0)
    graph = record_graph(SmallCNN(), torch.randn(1, 3, 32, 32))
    return [
        graph.render(out / "graph_example.svg"),
        graph.render(out / "graph_example.png"),
        graph.render(out / "graph_example_depth1.svg", depth=1),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for the pictures (default: a temporary one)"
    )
    out = parser.parse_args().out
    if out is not None:
        for path in main(out):
            print(path)
    else:
        with tempfile.TemporaryDirectory(prefix="graph_example_") as tmp:
            for path in main(Path(tmp)):
                print(f"{path.name}: {path.stat().st_size:,} bytes")
        print("(written to a temporary folder, now removed: keep them with --out DIR)")
