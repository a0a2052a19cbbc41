"""Cost of writing every module output of a small CNN during predict (CPU, one torch thread).

Two measurements:

* **Step time.** A plain predict loop (``torch.inference_mode``, batch 64 of 3x32x32) with
  every leaf module's output recorded by a :class:`~lightning_recorder.RecorderManager` and
  queued to a :class:`~lightning_recorder.activations.ShardWriter` (``writer``), against the
  same loop without recording (``none``; ``none again`` shows the noise). The variants are
  timed in interleaved rounds (a block of steps of each, in a new random order every round);
  after each ``writer`` block, untimed, the writer flushes, so that its disk work does not
  spill into another variant's block. The table shows median wall-clock ms per step and the
  median of the per-round ratios; wall clock, because the writer's thread competes for the GIL
  and the cores. ``queue waits`` is the time the step waited for room in the queue (zero when
  the disk keeps up). Three more rows split the cost: ``hand-written hooks`` (a forward hook
  on each leaf keeping its output: what PyTorch's hooks cost by themselves), ``recorders`` (the
  manager recording the same outputs) and ``recorders + queue`` (also queued to a writer whose
  thread drops each shard instead of writing it); ``writer`` then adds the writing itself.
* **Throughput.** The same activations (precomputed) written by the writer (queue, thread,
  shards, index files, ``fsync``), against the floor: one ``safetensors.torch.save_file`` call
  per shard of the same tensors (``floor``), and the same followed by an ``fsync`` (``floor +
  fsync``), each in interleaved repeats; MB/s is the median, the ratio the median of per-repeat
  ratios. Between two ways, untimed, ``os.sync`` lets the kernel finish writing back what the
  last one left in the page cache, so that no way pays for another's. The writer's thread runs
  at the floor's priority here (``low_priority=False``): the table compares ways of writing;
  ``writer, low priority`` (the default, which favours the step) shows what the lower priority
  costs when other processes want the cores while the writer finishes a queue that nothing
  else is waiting on.

A third table times ``trainer.predict`` itself, with and without the ``ActivationWriter``
callback writing every leaf output (per-batch wall time from a timing callback, the first batch
of each run left out; the two trainers take turns, 12 batches each, in a new random order every
round).

Targets (issue 17): step-time ratio ``writer / none`` <= 1.10; writer throughput >= 0.80 of
the floor.

Run: ``python benchmarks/bench_activations.py`` (``--quick`` for a short run), or
``python benchmarks/run.py --only activations``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_recorder import RecorderManager
from lightning_recorder.activations import ShardWriter

BATCH = 64
STEPS_PER_BLOCK = 5
WARMUP_STEPS = 5
SHARD_BYTES = 16 << 20
CLOCK = time.perf_counter


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory, as ``bench_core.py`` does (see there)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def make_model() -> nn.Module:
    """Three conv blocks and two linear layers for 3x32x32 inputs (13 leaf modules)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def _manager(model: nn.Module) -> RecorderManager:
    names = [name for name, m in model.named_modules() if name and not list(m.children())]
    # ReLU is in place-free here; every output is a fresh tensor the writer may keep as is.
    return RecorderManager(
        {name: {"type": "ModuleOutputs", "source": name, "detach": True} for name in names}
    )


class _NoDisk(ShardWriter):
    """A writer that does everything but write: its thread takes the batches off the queue
    and drops each shard where the real one writes it (the split's "queued, not written")."""

    def _commit(self) -> None:
        self._pending, self._pending_bytes = [], 0


def step_times(
    rounds: int, directory: Path
) -> tuple[dict[str, float], dict[str, float], dict[str, float], ShardWriter]:
    """Median ms/step per variant, median per-round ratios to ``none`` (wall time, then the
    CPU time of the stepping thread), and the writer used."""
    model = make_model().eval()
    x = torch.randn(BATCH, 3, 32, 32)
    index = torch.arange(BATCH)
    manager = _manager(model)
    manager.initialize(model)
    manager.suspend()
    writers = {
        fsync: ShardWriter(
            directory, run=f"bench{fsync:d}", max_shard_bytes=SHARD_BYTES, fsync=fsync
        )
        for fsync in (True, False)
    }
    no_disk = _NoDisk(directory, run="nodisk", max_shard_bytes=SHARD_BYTES)
    leaves = [m for name, m in model.named_modules() if name and not list(m.children())]
    counter = [0]

    def run_none(n: int) -> None:
        with torch.inference_mode():
            for _ in range(n):
                model(x)

    def run_hooks(n: int) -> None:
        kept: list[torch.Tensor] = []
        handles = [m.register_forward_hook(lambda m, a, out: kept.append(out)) for m in leaves]
        with torch.inference_mode():
            for _ in range(n):
                model(x)
                kept.clear()
        for handle in handles:
            handle.remove()

    def run_recorders(n: int) -> None:
        with torch.inference_mode():
            for _ in range(n):
                with manager:
                    model(x)
                manager.reset_data_buffer()
        manager.suspend()

    def run_writer(n: int, writer: ShardWriter) -> None:
        with torch.inference_mode():
            for _ in range(n):
                with manager:
                    model(x)
                writer.write_records(
                    manager, stage="predict", batch_idx=counter[0], sample_index=index
                )
                manager.reset_data_buffer()
                counter[0] += 1
        manager.suspend()

    variants: dict[str, Callable[[int], None]] = {
        "none": run_none,
        "none again": run_none,
        "hand-written hooks": run_hooks,
        "recorders": run_recorders,
        "recorders + queue": lambda n: run_writer(n, no_disk),
        "writer": lambda n: run_writer(n, writers[True]),
        "writer, no fsync": lambda n: run_writer(n, writers[False]),
    }
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    gc.disable()
    try:
        for run in variants.values():
            run(WARMUP_STEPS)
        for writer in (*writers.values(), no_disk):
            writer.flush()
        order = random.Random(0)
        for _ in range(rounds):
            order.shuffle(names)
            for name in names:
                start, start_cpu = CLOCK(), time.thread_time()
                variants[name](STEPS_PER_BLOCK)
                times[name].append((CLOCK() - start) / STEPS_PER_BLOCK * 1e3)
                cpu[name].append((time.thread_time() - start_cpu) / STEPS_PER_BLOCK * 1e3)
                if name.startswith(("writer", "recorders +")):
                    for writer in (*writers.values(), no_disk):  # untimed: the disk work of
                        writer.flush()  # a block stays out of the other blocks
            gc.collect()
    finally:
        gc.enable()
        for writer in (*writers.values(), no_disk):
            writer.close()
        manager.release()
    medians = {name: statistics.median(samples) for name, samples in times.items()}
    ratios = {
        name: statistics.median(t / b for t, b in zip(samples, times["none"], strict=True))
        for name, samples in times.items()
    }
    cpu_ratios = {
        name: statistics.median(t / b for t, b in zip(samples, cpu["none"], strict=True))
        for name, samples in cpu.items()
    }
    return medians, ratios, cpu_ratios, writers[True]


class _StepClock(pl.Callback):
    """Wall time between consecutive predict batch starts (the first batch of a run skipped)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None

    def on_predict_batch_start(self, *args: object, **kwargs: object) -> None:
        now = CLOCK()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


class _Predictor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.net(batch[0])


def lightning_steps(rounds: int, directory: Path) -> dict[str, tuple[float, float]]:
    """``trainer.predict`` with and without ``ActivationWriter`` (every leaf output), in turns:
    median ms/step and the median of per-round ratios to ``none``."""
    from lightning_recorder.callbacks.activation_writer import ActivationWriter

    model = _Predictor().eval()
    leaves = [n for n, m in model.named_modules() if n and not list(m.children())]
    data = torch.utils.data.TensorDataset(torch.randn(BATCH * 12, 3, 32, 32))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    quiet = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    }
    clocks = {"none": _StepClock(), "writer": _StepClock()}
    writer = ActivationWriter(leaves, directory, max_shard_bytes=SHARD_BYTES)
    trainers = {
        "none": pl.Trainer(**quiet, callbacks=[clocks["none"]]),
        "writer": pl.Trainer(**quiet, callbacks=[writer, clocks["writer"]]),
    }
    per_round: dict[str, list[float]] = {name: [] for name in trainers}
    names = list(trainers)
    order = random.Random(2)
    for _ in range(rounds):
        order.shuffle(names)
        for name in names:
            before = len(clocks[name].times)
            trainers[name].predict(model, loader, return_predictions=False)
            per_round[name].append(statistics.median(clocks[name].times[before:]))
    return {
        name: (
            statistics.median(samples) * 1e3,
            statistics.median(t / b for t, b in zip(samples, per_round["none"], strict=True)),
        )
        for name, samples in per_round.items()
    }


def _activations(steps: int) -> list[dict[str, torch.Tensor]]:
    model = make_model().eval()
    manager = _manager(model)
    manager.initialize(model)
    batches = []
    with torch.inference_mode():
        for _ in range(steps):
            with manager:
                model(torch.randn(BATCH, 3, 32, 32))
            batches.append({name: stream.data_buffer[0] for name, stream in manager.streams()})
    manager.release()
    return batches


def _floor(batches: list[dict[str, torch.Tensor]], directory: Path, sync: bool) -> float:
    """Seconds to write the tensors with one save_file per shard (same shard boundaries)."""
    start = CLOCK()
    shard: dict[str, torch.Tensor] = {}
    size, seq = 0, 0

    def commit() -> None:
        nonlocal shard, size, seq
        path = directory / f"floor-{seq:06d}.safetensors"
        save_file(shard, str(path))
        if sync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        shard, size, seq = {}, 0, seq + 1
        storages.clear()

    storages: set[int] = set()
    for number, batch in enumerate(batches):
        for name, tensor in batch.items():
            ptr = tensor.untyped_storage().data_ptr()
            # safetensors refuses tensors that share memory (Flatten's output is a view)
            shard[f"{name}/{number}"] = tensor.clone() if ptr in storages else tensor
            storages.add(ptr)
            size += tensor.nbytes
            if size >= SHARD_BYTES:
                commit()
    if shard:
        commit()
    return CLOCK() - start


def _writer(
    batches: list[dict[str, torch.Tensor]], directory: Path, fsync: bool, low: bool = False
) -> float:
    index = torch.arange(BATCH)
    start = CLOCK()
    with ShardWriter(
        directory, run="tp", max_shard_bytes=SHARD_BYTES, fsync=fsync, low_priority=low
    ) as writer:
        for number, batch in enumerate(batches):
            for name, tensor in batch.items():
                writer.write(name, name, tensor, batch_idx=number, sample_index=index)
    return CLOCK() - start


def throughput(steps: int, repeats: int, root: Path) -> dict[str, tuple[float, float]]:
    """MB/s (median) and median per-repeat ratio to ``floor`` of each way of writing."""
    batches = _activations(steps)
    total = sum(t.nbytes for batch in batches for t in batch.values())
    ways: dict[str, Callable[[Path], float]] = {
        "floor": lambda d: _floor(batches, d, sync=False),
        "floor + fsync": lambda d: _floor(batches, d, sync=True),
        "writer": lambda d: _writer(batches, d, fsync=False),
        "writer + fsync": lambda d: _writer(batches, d, fsync=True),
        "writer, low priority": lambda d: _writer(batches, d, fsync=False, low=True),
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    order = random.Random(1)
    for _ in range(repeats):
        order.shuffle(names)
        for name in names:
            directory = root / name.replace(" + ", "_").replace(", ", "_").replace(" ", "_")
            directory.mkdir()
            seconds[name].append(ways[name](directory))
            shutil.rmtree(directory)
            if hasattr(os, "sync"):  # untimed: the kernel's write-back of this way's files
                os.sync()  # is not left to slow the next way down
    out = {"_bytes": (total / 1e6, 0.0)}
    for name, s in seconds.items():
        floor = seconds["floor + fsync" if name.endswith("fsync") else "floor"]
        ratio = statistics.median(f / w for f, w in zip(floor, s, strict=True))
        out[name] = (total / 1e6 / statistics.median(s), ratio)
    return out


def machine() -> str:
    return (
        f"{os.cpu_count()} CPU core(s) ({platform.machine()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s), Python {platform.python_version()}"
    )


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def main(quick: bool = False) -> None:
    """Run both measurements and print their tables.

    Args:
        quick: a short run (about 30 s) instead of the full one (a few minutes).
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steady = keep_freed_memory()
    rounds, steps, repeats = (20, 30, 3) if quick else (100, 60, 5)
    with tempfile.TemporaryDirectory(prefix="bench_activations_") as tmp:
        root = Path(tmp)
        medians, ratios, cpu_ratios, writer = step_times(rounds, root / "steps")
        in_lightning = lightning_steps(max(rounds // 5, 4), root / "lightning")
        tp = throughput(steps, repeats, root)
    per_step = writer.bytes_written / max(writer.rows_written / BATCH / 13, 1) / 1e6
    print(f"bench_activations: CNN predict step, batch {BATCH}x3x32x32, all 13 leaf outputs")
    print(f"machine: {machine()}")
    print(
        f"{rounds} interleaved rounds x {STEPS_PER_BLOCK} steps per variant; medians of wall "
        f"time; malloc {'keeps freed memory' if steady else 'default'}; {per_step:.1f} MB written "
        f"per step; queue waits {writer.wait_seconds:.3f} s"
    )
    rows = [["variant", "ms/step", "vs none", "step thread CPU vs none", "target", "result"]]
    for name in medians:
        target, result = "-", "-"
        if name.startswith("writer"):
            target, result = "<= 1.10", "pass" if ratios[name] <= 1.10 else "FAIL"
        rows.append(
            [
                name,
                f"{medians[name]:.3f}",
                f"{ratios[name]:.3f}",
                f"{cpu_ratios[name]:.3f}",
                target,
                result,
            ]
        )
    print(_table(rows))
    print("\nin trainer.predict (ActivationWriter on every leaf module; wall time per step):")
    rows = [["variant", "ms/step", "vs none", "target", "result"]]
    for name, (ms, ratio) in in_lightning.items():
        target, result = "-", "-"
        if name == "writer":
            target, result = "<= 1.10", "pass" if ratio <= 1.10 else "FAIL"
        rows.append([name, f"{ms:.3f}", f"{ratio:.3f}", target, result])
    print(_table(rows))
    total = tp.pop("_bytes")[0]
    print(f"\nthroughput: {total:.0f} MB in {SHARD_BYTES >> 20} MiB shards, {repeats} repeats")
    rows = [["way", "MB/s", "vs floor (+ fsync)", "target", "result"]]
    for name, (rate, ratio) in tp.items():
        target, result = "-", "-"
        if name in ("writer", "writer + fsync"):
            target, result = ">= 0.80", "pass" if ratio >= 0.80 else "FAIL"
        rows.append([name, f"{rate:.0f}", f"{ratio:.3f}", target, result])
    print(_table(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (about 30 s)")
    main(quick=parser.parse_args().quick)
