"""What the TensorBoard event of a `FeatureStatsMonitor` logging step costs to build and write.

A logging step writes one event: 7 statistics per monitored module, ``norm``, ``grad_norm`` and
``update_ratio`` of its two parameters (``weight``, ``bias``) and one 30-bucket histogram per
module (``histograms=False`` leaves them out). For N modules (16, 64, 128) the table gives, per
logged step:

* **bytes** — the serialized ``Event`` (what the event file grows by, less 16 bytes of record
  framing), and bytes per module;
* **build** — :func:`~lightning_recorder.callbacks._lightning.tensorboard_summary`, the
  ``Summary`` that ``write_tensorboard`` fills (training thread): from the histograms'
  keyword arguments (``now``: the histograms through protobuf's Python API, the scalars' entries
  encoded in C where the package's encoder is built), or from the monitor's one table of every
  module's histogram (``C, one table``: a ``HistogramTable``, every entry encoded in C, then
  parsed by protobuf in one call);
* **serialize** — ``Event(...).SerializeToString()``, which ``EventFileWriter.add_event`` runs on
  the training thread before it queues the bytes;
* **writer** — ``RecordWriter.write`` of those bytes into memory: TensorBoard's writer thread
  computes two masked CRC32C checksums in pure Python, holding the GIL, then writes the record
  (the file write itself is left out: it depends on the disk);
* **writer, C CRC** — the same record with the checksums in C: the package's own (what
  ``FeatureStatsMonitor(fast_checksums=True)``, the default, gives the logger's writer), or
  where it cannot be built the ``crc32c`` package's (tensorboardX's); ``n/a`` without either.

``before`` builds the histograms with every bucket (an earlier release); ``now`` and ``C, one
table`` collapse each run of empty buckets into one, as ``write_tensorboard`` does (the same
bytes). The variants take turns in a random
order within every repeat; the figures are medians over the repeats, in CPU time of the thread
(``--clock wall`` for wall-clock time): the writer thread's work is CPU work under the GIL, and
CPU time stays steady on a loaded machine.

The histograms come from data of three shapes, one per module in turn: Gaussian, after a ReLU,
and heavy-tailed (a Gaussian times a log-normal, which puts outliers far from the bulk); the
second table gives the bytes and buckets of one histogram of each shape, and of a Gaussian with
a few outliers far out (as in the activations of large transformers), where most buckets are
empty.

Run ``python benchmarks/bench_writer.py`` (``--quick`` for a smoke run). One CPU thread.
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

from lightning_recorder._core import crc32c
from lightning_recorder.callbacks._lightning import (
    HistogramTable,
    tensorboard_summary,
    write_record,
)
from lightning_recorder.stats import histogram_raw_kwargs

STATS = ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite")
PARAMETER_STATS = ("norm", "grad_norm", "update_ratio")
SHAPES = ("gaussian", "relu", "heavy-tailed")
OUTLIERS = "outliers"  # a Gaussian with 0.1 % of its values 30 to 60 standard deviations out
BINS = 30

# --------------------------------------------------------------------------- the event


def sample(shape: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` values of one of :data:`SHAPES`."""
    x = torch.randn(n, generator=gen)
    if shape == "relu":
        return x.relu()
    if shape == "heavy-tailed":
        return x * torch.randn(n, generator=gen).exp()
    if shape == OUTLIERS:
        far = torch.randperm(n, generator=gen)[: max(1, n // 1000)]
        x[far] = 30 + 30 * torch.rand(far.numel(), generator=gen)
    return x


def step_values(
    modules: int, histograms: bool, numel: int = 4096
) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """The scalars and histogram keyword arguments of one logging step, tagged as the monitor
    tags them (``stats/train/<module>/<statistic>``)."""
    gen = torch.Generator().manual_seed(modules)
    scalars: dict[str, float] = {}
    hists: dict[str, dict[str, Any]] = {}
    for i in range(modules):
        name = f"blocks.{i}.conv"
        x = sample(SHAPES[i % len(SHAPES)], numel, gen)
        values = (x.mean(), x.std(), x.min(), x.max(), x.abs().mean(), (x == 0).float().mean())
        for stat, value in zip(STATS, [*values, torch.tensor(0.0)], strict=True):
            scalars[f"stats/train/{name}/{stat}"] = float(value)
        for param in ("weight", "bias"):
            for stat in PARAMETER_STATS:
                scalars[f"stats/train/{name}.{param}/{stat}"] = float(torch.rand(1, generator=gen))
        kwargs = histogram_raw_kwargs(x, bins=BINS) if histograms else None
        if kwargs is not None:
            hists[f"stats/train/{name}/histogram"] = kwargs
    return scalars, hists


def summary_before(scalars: dict[str, float], hists: dict[str, dict[str, Any]]) -> Summary:
    """The previous release's ``Summary``: every bucket written."""
    summary = Summary()
    add = summary.value.add
    for tag, value in scalars.items():
        add(tag=tag, simple_value=value)
    for tag, kw in hists.items():
        histo = add(tag=tag).histo
        histo.min, histo.max, histo.num = kw["min"], kw["max"], kw["num"]
        histo.sum, histo.sum_squares = kw["sum"], kw["sum_squares"]
        histo.bucket_limit.extend(kw["bucket_limits"])
        histo.bucket.extend(kw["bucket_counts"])
    return summary


def as_table(hists: dict[str, dict[str, Any]]) -> HistogramTable:
    """The histograms as the monitor hands them to the writer: one table, a row a module."""
    rows = [
        [
            *(kw["num"], kw["sum"], kw["sum_squares"], kw["min"], kw["max"]),
            *kw["bucket_limits"],
            *kw["bucket_counts"][1:],  # the leading empty bucket is the writer's
        ]
        for kw in hists.values()
    ]
    table = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), 2 * BINS + 6)
    return HistogramTable(table, BINS, tuple(hists))


Builder = Callable[[dict[str, float], dict[str, dict[str, Any]], HistogramTable], Summary]
BUILDERS: dict[str, Builder] = {
    "before": lambda scalars, hists, table: summary_before(scalars, hists),
    "now": lambda scalars, hists, table: tensorboard_summary(scalars, hists),
    "C, one table": lambda scalars, hists, table: tensorboard_summary(scalars, table),
}


def native_writer() -> Callable[[bytes], None] | None:
    """A record write into memory with a C checksum: the monitor's (``fast_checksums``), else
    one with the ``crc32c`` package's; ``None`` without either."""
    if crc32c.available():
        return lambda data: write_record(io.BytesIO(), data)
    try:
        from crc32c import crc32c as package  # type: ignore[import-not-found]
    except ImportError:
        return None

    def write(data: bytes) -> None:
        io.BytesIO().write(native_record(package, data))

    return write


def native_record(crc: Callable[[bytes], int], data: bytes) -> bytes:
    """A TFRecord of ``data`` (the layout of ``RecordWriter.write``) with a C checksum."""

    def masked(chunk: bytes) -> int:
        x = crc(chunk) & 0xFFFFFFFF
        return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked(header)) + data + struct.pack("<I", masked(data))


# --------------------------------------------------------------------------- timing


def measure(
    modules: int,
    histograms: bool,
    repeats: int,
    native: Callable[[bytes], None] | None,
    clock: Callable[[], float],
) -> dict[str, dict[str, float]]:
    """Median seconds of each phase and the event's bytes, per variant (interleaved)."""
    scalars, hists = step_values(modules, histograms)
    table = as_table(hists)
    phases = ("build", "serialize", "writer", "writer, C CRC")
    times: dict[str, dict[str, list[float]]] = {v: {p: [] for p in phases} for v in BUILDERS}
    size: dict[str, int] = {}
    order = list(BUILDERS)
    rng = random.Random(modules)
    for repeat in range(repeats + 1):  # the first round warms up
        rng.shuffle(order)
        for name in order:
            t0 = clock()
            summary = BUILDERS[name](scalars, hists, table)
            t1 = clock()
            data = Event(wall_time=time.time(), step=7, summary=summary).SerializeToString()
            t2 = clock()
            RecordWriter(io.BytesIO()).write(data)
            t3 = clock()
            if native is not None:
                native(data)
            t4 = clock()
            if repeat:
                for phase, seconds in zip(
                    phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True
                ):
                    times[name][phase].append(seconds)
            size[name] = len(data)
    result = {v: {p: statistics.median(times[v][p]) for p in phases} for v in BUILDERS}
    for v in BUILDERS:
        result[v]["bytes"] = size[v]
        if native is None:
            result[v]["writer, C CRC"] = float("nan")
    return result


def ms(seconds: float) -> str:
    return "n/a" if seconds != seconds else f"{seconds * 1e3:.2f}"


def event_table(sizes: Sequence[int], repeats: int, clock: Callable[[], float]) -> list[str]:
    native = native_writer()
    lines = [
        "| modules | histograms | variant | bytes | bytes / module | build ms | serialize ms "
        "| writer ms (Python CRC) | writer ms (C CRC) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for modules in sizes:
        for histograms in (True, False):
            result = measure(modules, histograms, repeats, native, clock)
            for variant, r in result.items():
                lines.append(
                    f"| {modules} | {'on' if histograms else 'off'} | {variant} "
                    f"| {int(r['bytes'])} | {r['bytes'] / modules:.0f} | {ms(r['build'])} "
                    f"| {ms(r['serialize'])} | {ms(r['writer'])} | {ms(r['writer, C CRC'])} |"
                )
    return lines


def shape_table() -> list[str]:
    """Bytes and buckets of one histogram value of each data shape, before and now."""
    lines = [
        "| data | buckets before | buckets now | bytes before | bytes now |",
        "|---|---|---|---|---|",
    ]
    gen = torch.Generator().manual_seed(0)
    for shape in (*SHAPES, OUTLIERS):
        kwargs = histogram_raw_kwargs(sample(shape, 4096, gen), bins=BINS)
        assert kwargs is not None
        hists = {"stats/train/blocks.0.conv/histogram": kwargs}
        before, now = summary_before({}, hists), tensorboard_summary({}, hists)
        lines.append(
            f"| {shape} | {len(before.value[0].histo.bucket)} | {len(now.value[0].histo.bucket)} "
            f"| {before.ByteSize()} | {now.ByteSize()} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> dict[str, list[str]]:
    parser = argparse.ArgumentParser(description="TensorBoard event cost of a logging step")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--modules", default="16,64,128", help="comma-separated module counts")
    parser.add_argument(
        "--clock",
        choices=("thread", "wall"),
        default="thread",
        help="CPU time of this thread (steady on a loaded machine) or wall-clock time",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats = min(3, args.repeats) if args.quick else args.repeats
    sizes = [16] if args.quick else [int(n) for n in args.modules.split(",")]
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    report = {"event": event_table(sizes, repeats, clock), "histogram": shape_table()}
    print(f"\n### one logged step's event (medians, {args.clock} clock)\n")
    print("\n".join(report["event"]))
    print("\n### one histogram value by data shape\n")
    print("\n".join(report["histogram"]))
    return report


if __name__ == "__main__":
    main()
