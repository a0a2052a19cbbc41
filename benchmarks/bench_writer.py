"""What the TensorBoard event of a `FeatureStatsMonitor` logging step costs to build and to
checksum.

Three tables, each side by side in one run (the variants of a measure take turns in a random
order within every repeat; medians over the repeats, in CPU time of the thread, which stays
steady on a loaded machine):

1. **Build** — the ``Summary`` of one logged step for 16, 64 and 127 modules: 7 statistics and
   one 30-bucket histogram per module (``+ parameters``: and the ``norm``, ``grad_norm`` and
   ``update_ratio`` of two parameters per module, 13 scalars), built as the monitor builds it
   (``tensorboard_summary`` from one ``HistogramTable``: a template of the step's tags copied
   in one call, then filled through protobuf's API) and, for comparison, value by value
   (``summary.value.add`` for every scalar and histogram); then serialized (the writer does
   that on the training thread). Histograms of three data shapes in turn (Gaussian, after a
   ReLU, heavy-tailed), runs of empty buckets collapsed.
2. **Checksum per KiB** — TensorBoard's pure-Python CRC-32C (what its writer thread computes
   for every record, holding the GIL) and the ``google-crc32c`` wheel's (what
   ``lightning_recorder.TensorBoardLogger`` uses), on 64 KiB of random bytes.
3. **Checksum per logged step, amortised** — for the CNN of ``examples/tensorboard_stats.py``
   (its sources, batch 32) and a 64-layer MLP (width 256, every module monitored, batch 128,
   as in ``benchmarks/bench_logging.py``): the event a real monitor writes for one logged step
   (read back from its event file), the time to frame it as a record with each checksum, and
   that time spread over the default cadence (one logged step in 50) as a fraction of a plain
   training step of the same model measured in the same run (forward, cross-entropy,
   backward and an SGD step in torch, one thread: a Lightning step is a little longer, so the
   fractions are upper bounds).

Run ``python benchmarks/bench_writer.py`` (``--quick`` for a smoke run). One CPU thread.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from torch import Tensor, nn

from lightning_recorder import FeatureStatsMonitor
from lightning_recorder.callbacks._event_file import c_checksum, frame, python_checksum
from lightning_recorder.callbacks._tensorboard import (
    HistogramTable,
    collapse_empty_buckets,
    tensorboard_summary,
)

STATS = ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite")
PARAMETER_STATS = ("norm", "grad_norm", "update_ratio")
SHAPES = ("gaussian", "relu", "heavy-tailed")
BINS = 30
CADENCE = 50  # the monitor's default: Trainer(log_every_n_steps=50)
ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- timing


def interleaved(
    variants: dict[str, Callable[[], Any]], repeats: int, clock: Callable[[], float]
) -> dict[str, float]:
    """Median seconds per call of each variant; the variants take turns in random order."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up
    order = list(variants)
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            start = clock()
            variants[name]()
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


# --------------------------------------------------------------------------- 1. build


def sample(shape: str, n: int, gen: torch.Generator) -> Tensor:
    x = torch.randn(n, generator=gen)
    if shape == "relu":
        return x.relu()
    if shape == "heavy-tailed":
        return x * torch.randn(n, generator=gen).exp()
    return x


def step_values(
    modules: int, parameters: bool, numel: int = 4096
) -> tuple[dict[str, float], HistogramTable]:
    """The scalars and the histogram table of one logged step, tagged as the monitor tags
    them (``stats/train/<module>/<statistic>``)."""
    gen = torch.Generator().manual_seed(modules)
    scalars: dict[str, float] = {}
    rows, tags = [], []
    for i in range(modules):
        name = f"blocks.{i}.conv"
        x = sample(SHAPES[i % len(SHAPES)], numel, gen).double()
        values = (x.mean(), x.std(), x.min(), x.max(), x.abs().mean(), (x == 0).double().mean())
        for stat, value in zip(STATS, [*values, torch.tensor(0.0)], strict=True):
            scalars[f"stats/train/{name}/{stat}"] = float(value)
        if parameters:
            for param in ("weight", "bias"):
                for stat in PARAMETER_STATS:
                    scalars[f"stats/train/{name}.{param}/{stat}"] = float(
                        torch.rand(1, generator=gen)
                    )
        counts, edges = torch.histogram(x, bins=BINS)
        head = [x.numel(), x.sum(), (x * x).sum(), x.min(), x.max()]
        rows.append([*map(float, head), *edges.tolist(), *counts.tolist()])
        tags.append(f"stats/train/{name}/histogram")
    return scalars, HistogramTable(torch.tensor(rows, dtype=torch.float64), BINS, tags)


def value_by_value(scalars: dict[str, float], hists: HistogramTable) -> Summary:
    """The same ``Summary``, one ``summary.value.add`` per scalar and per histogram."""
    summary = Summary()
    add = summary.value.add
    for tag, value in scalars.items():
        add(tag=tag, simple_value=value)
    for tag, kw in hists.items():
        histo = add(tag=tag).histo
        histo.num, histo.sum, histo.sum_squares = kw["num"], kw["sum"], kw["sum_squares"]
        histo.min, histo.max = kw["min"], kw["max"]
        limits, counts = collapse_empty_buckets(kw["bucket_limits"], kw["bucket_counts"])
        histo.bucket_limit.extend(limits)
        histo.bucket.extend(counts)
    return summary


def build_table(sizes: Sequence[int], repeats: int, clock: Callable[[], float]) -> list[str]:
    lines = [
        "| modules | scalars per module | event KiB | build ms, template (the monitor's) "
        "| build ms, value by value | serialize ms |",
        "|---|---|---|---|---|---|",
    ]
    for modules in sizes:
        for parameters in (False, True):
            scalars, table = step_values(modules, parameters)
            ours = tensorboard_summary(scalars, table)
            assert ours == value_by_value(scalars, table)  # the same message
            event = Event(wall_time=time.time(), step=7, summary=ours)
            result = interleaved(
                {
                    "template": lambda s=scalars, t=table: tensorboard_summary(s, t),
                    "value by value": lambda s=scalars, t=table: value_by_value(s, t),
                    "serialize": event.SerializeToString,
                },
                repeats,
                clock,
            )
            kib = event.ByteSize() / 1024
            lines.append(
                f"| {modules} | {len(scalars) // modules} | {kib:.1f} | {ms(result['template'])} "
                f"| {ms(result['value by value'])} | {ms(result['serialize'])} |"
            )
    return lines


# --------------------------------------------------------------------------- 2. per KiB


def checksums() -> dict[str, Callable[[bytes], int]]:
    found = {"TensorBoard's, pure Python": python_checksum()}
    wheel = c_checksum()
    if wheel is not None:
        found["google-crc32c"] = wheel
    return found


def per_kib_table(repeats: int, clock: Callable[[], float]) -> tuple[list[str], dict[str, float]]:
    data = os.urandom(64 * 1024)
    crcs = checksums()
    result = interleaved({n: lambda c=c: c(data) for n, c in crcs.items()}, repeats, clock)
    per_kib = {name: seconds / 64 for name, seconds in result.items()}
    lines = ["| checksum | ms per KiB |", "|---|---|"]
    lines += [f"| {name} | {seconds * 1e3:.5f} |" for name, seconds in per_kib.items()]
    if len(crcs) == 1:
        lines.append("| google-crc32c | not installed |")
    return lines, per_kib


# --------------------------------------------------------------------------- 3. per logged step


def mlp64() -> nn.Module:
    """The 64-layer MLP of ``benchmarks/bench_logging.py`` (127 modules)."""
    layers: list[nn.Module] = [nn.Linear(64, 256)]
    for _ in range(62):
        layers += [nn.ReLU(), nn.Linear(256, 256)]
    layers += [nn.ReLU(), nn.Linear(256, 10)]
    return nn.Sequential(*layers)


def example_module() -> Any:
    """``examples/tensorboard_stats.py``, imported."""
    path = ROOT / "examples" / "tensorboard_stats.py"
    spec = importlib.util.spec_from_file_location("_tensorboard_stats", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Net(pl.LightningModule):
    """A body trained with cross-entropy and SGD (the monitor's sources are under ``net.``)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.net = body

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def models() -> dict[str, tuple[Callable[[], pl.LightningModule], Any, tuple[int, ...], int]]:
    """``{name: (LightningModule factory, monitor sources, input shape, batch)}``."""
    example = example_module()
    return {
        "CNN of examples/tensorboard_stats.py": (
            example.DigitsCNN,
            example.SOURCES,
            (1, 8, 8),
            32,
        ),
        "MLP, 64 layers, every module": (lambda: Net(mlp64()), "net.*", (64,), 128),
    }


def logged_event(
    factory: Callable[[], pl.LightningModule], sources: Any, shape: tuple[int, ...], batch: int
) -> bytes:
    """The serialized event of a real monitor's logged training step, read from its file."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.rand(batch * 3, *shape), torch.randint(0, 10, (batch * 3,))
    )
    with tempfile.TemporaryDirectory() as root:
        logger = TensorBoardLogger(root, name="event")
        trainer = pl.Trainer(
            max_steps=3,
            accelerator="cpu",
            logger=logger,
            callbacks=[FeatureStatsMonitor(sources, every_n_steps=1)],
            limit_val_batches=0,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(factory(), torch.utils.data.DataLoader(data, batch_size=batch))
        found = []
        for path in sorted(Path(logger.log_dir).glob("events.out.tfevents.*")):
            for record in RawEventFileLoader(str(path)).Load():
                event = Event.FromString(record)
                if any(v.tag.startswith("stats/train/") for v in event.summary.value):
                    found.append(record)
    return found[-1]


def plain_step(
    factory: Callable[[], pl.LightningModule], shape: tuple[int, ...], batch: int
) -> Callable[[], None]:
    """One plain training step of the model in torch: forward, loss, backward, SGD."""
    torch.manual_seed(0)
    module = factory()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.rand(batch, *shape), torch.randint(0, 10, (batch,))

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()

    return step


def step_table(repeats: int, clock: Callable[[], float]) -> list[str]:
    crcs = checksums()
    lines = [
        "| model | event KiB | plain step ms | checksum | checksum ms per logged step "
        f"| amortised, 1 step in {CADENCE} |",
        "|---|---|---|---|---|---|",
    ]
    for name, (factory, sources, shape, batch) in models().items():
        record = logged_event(factory, sources, shape, batch)
        variants: dict[str, Callable[[], Any]] = {"plain step": plain_step(factory, shape, batch)}
        for crc_name, crc in crcs.items():
            variants[crc_name] = lambda c=crc, r=record: frame(r, c)
        result = interleaved(variants, repeats, clock)
        plain = result["plain step"]
        for crc_name in crcs:
            cost = result[crc_name]
            lines.append(
                f"| {name} | {len(record) / 1024:.1f} | {ms(plain)} | {crc_name} | {ms(cost)} "
                f"| {100 * cost / (CADENCE * plain):.3f} % |"
            )
    return lines


# --------------------------------------------------------------------------- main


def run(
    quick: bool = False,
    repeats: int = 21,
    sizes: Sequence[int] = (16, 64, 127),
    clock: str = "thread",
) -> dict[str, list[str]]:
    """Print the three tables; return their lines."""
    torch.set_num_threads(1)
    repeats = min(3, repeats) if quick else repeats
    sizes = [16] if quick else list(sizes)
    timer = time.thread_time if clock == "thread" else time.perf_counter
    report: dict[str, list[str]] = {"build": build_table(sizes, repeats, timer)}
    report["per KiB"], _ = per_kib_table(repeats, timer)
    report["per logged step"] = step_table(repeats, timer)
    titles = {
        "build": "the Summary of one logged step",
        "per KiB": "the CRC-32C of a record, per KiB",
        "per logged step": "the checksum of a real logged step's event, amortised",
    }
    for key, lines in report.items():
        print(f"\n### {titles[key]} (medians, {clock} clock)\n")
        print("\n".join(lines))
    return report


def main(quick: bool = False) -> dict[str, list[str]]:
    """The benchmark with its defaults (``quick``: a smoke run)."""
    return run(quick=quick)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The TensorBoard event of a logging step")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--modules", default="16,64,127", help="comma-separated module counts")
    parser.add_argument(
        "--clock",
        choices=("thread", "wall"),
        default="thread",
        help="CPU time of this thread (steady on a loaded machine) or wall-clock time",
    )
    args = parser.parse_args()
    run(args.quick, args.repeats, [int(n) for n in args.modules.split(",")], args.clock)
