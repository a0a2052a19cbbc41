"""Overhead of `FeatureStatsMonitor` on a training loop, measured side by side in one run.

The CNN of ``examples/tensorboard_stats.py`` trains on scikit-learn's digits with a
``FeatureStatsMonitor`` on every ``Conv2d`` and ``Linear`` output (parameters and histograms
included) logging every 50 steps, and with the same Trainer without it. Both write to a
TensorBoard logger with ``log_every_n_steps=50``.

**Step by step.** Each repeat trains one model per configuration, each ``fit`` in its own thread,
and the threads take turns one step at a time: a step of the first configuration, a step of the
second, …, then the first again. A timing callback hands the turn on at every
``on_train_batch_start`` and times each step from when its thread gets the turn to its next
batch start (data, forward, backward, optimizer, every callback, logging), on the wall clock and
on the thread's CPU clock. Whatever slows a shared machine down for a while (other tenants,
clock changes) then falls on every configuration alike, a few milliseconds apart; timed one
after the other, whole runs of the same configuration differed by several percent. Repeats
rotate the order of the turns (and reverse it every other repeat), so that every configuration
follows every other. A step that logged ends when the logger's writer thread has written its
events (checksums included; in a single run that work competes with the next steps): the timer
waits for it before it stops the clock and hands the turn on, so that no other configuration's
step pays for it. (Until 09362ce the timer waited only when the turn came back: the writer
thread ran during the other configurations' steps, and the ratios of a logging step read low,
most for the largest events.)

Per repeat, over steps 50-299 (five logging periods, warm-up excluded):

* **amortised** — the mean step time, logging steps included;
* **non-logging step** — the median time of a step that logs nothing;
* **logging step** — the median time of a step on which the monitor logs (Lightning's own
  ``log_every_n_steps`` logging happens on the same steps in both runs).

Ratios monitored / baseline are taken per repeat and their median is reported. Five more
configurations take turns too, for information (the targets are for the defaults): the same
monitor with ``histograms=False``, which shows what the histograms cost on a logging step; the
monitor with histograms on every other logged step (``histogram_every_n_steps=100``: two of the
five logged steps of the window write histograms), which shows what spacing them out saves; a
``Callback`` that does nothing, which shows what Lightning's hook calls cost any callback on
every step, the floor of the non-logging ratio; the monitor writing through
``lightning_recorder.TensorBoardLogger`` instead of Lightning's (its records checksummed by the
``google-crc32c`` wheel where installed, the ``fast-tensorboard`` extra; TensorBoard's own
writer checksums in pure Python, about 2 ms per logged step of this model), against the same
baseline (which writes next to nothing to its logger); and the defaults once more, a
configuration identical to the first, whose ratios differ from the first's only by the run's
noise: how far apart two readings of the same code land, the resolution of every row. Memory:
a separate process trains with the monitor alone for 2,000 steps and compares its peak RSS
after step 2,000 with that after step 200.

**The steps that log nothing** (``--idle``, for information; 24 repeats). Only configurations
that never log take turns: the baseline; a callback that does nothing, twice; the monitor with
``every_n_steps`` beyond the run, twice; and that monitor with its three per-step hooks
(``on_train_batch_start``, ``on_train_batch_end``, ``on_before_optimizer_step``) replaced by
``Callback``'s no-ops, attached as usual. Each is compared with the baseline as the median of
its per-step ratios and as the ratio of its mean step time. This splits what a step that logs
nothing costs into what any callback costs, what the monitor's presence costs and what its
per-step code costs. The two identical pairs show the run's noise.

**The benchmark models** (``--model resnet18`` or ``--model mlp64``, for information). The same
measures on the ResNet-18-like model (batch 16) and the 64-layer MLP (batch 128) of
``bench_logging.py``, every module monitored, on made-up data: a step of a real model is 70 and
5 times the digits CNN's, and what a logging step costs is mostly per module. Only the defaults
(with Lightning's logger and with ``lightning_recorder.TensorBoardLogger``), the baseline and
the defaults' twin take turns; no memory run. The ResNet's step takes about half a second here:
``--repeats 3 --periods 2`` keeps a run under twenty minutes.

Run ``python benchmarks/bench_callbacks.py`` (``--quick`` for a smoke run). Timings use one CPU
thread (``torch.set_num_threads(1)``) to keep the noise of a shared machine down, and batches of
128 digits (``--batch-size``; the example trains with 32), so that a step is long enough to time.

**Allocator.** glibc's ``malloc`` adapts its mmap threshold to the history of a process's
allocations: depending on it, one run maps (and the kernel zeroes) fresh pages for the large
activations of every step and the next run reuses its heap — about 250 page faults per step
against none, several percent of a step, landing on either side of a comparison at random. It
also gives each thread its own arena, so that the activations of each configuration lay out in
memory differently from repeat to repeat, and one of them sometimes ran several percent slower
for a whole repeat. The timing runs therefore fix the thresholds (``mallopt``: mmap above
32 MiB, trim above 256 MiB) and use one arena: the configurations' models are the same, so each
step reuses the memory the previous turn freed, at the same addresses for every configuration.
``--default-malloc`` keeps glibc's defaults. The memory child keeps them too.

**One CPU.** The configurations' threads take turns, but the operating system chose for each
where it ran, and kept a thread on one core or the other for seconds at a time: over a third of
a repeat, a configuration's median step read a few percent apart from the baseline's and from
itself in the next third (whatever else ran on the machine landed on one core), so that
per-repeat ratios spread over 0.94-1.11. The timing runs therefore put the process on one CPU
(``os.sched_setaffinity``; the threads it starts inherit it: the trainers, the loggers' writer
threads, which then share the trainers' core instead of a free one — a logged step pays for its
writer in full — and compiles), and give the process its CPUs back at the end. ``--all-cpus``
keeps every CPU. Where the operating system has no affinity call, nothing changes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import importlib.util
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from tensorboard_stats import DigitsCNN, digits_loaders  # noqa: E402

from lightning_recorder import FeatureStatsMonitor  # noqa: E402
from lightning_recorder import TensorBoardLogger as RecorderTensorBoardLogger  # noqa: E402
from lightning_recorder.callbacks._event_file import c_checksum  # noqa: E402
from lightning_recorder.stats._engine import warm_up  # noqa: E402

EVERY = 50
LIMITS = {"amortised": 1.01, "non-logging step": 1.01, "logging step": 1.5, "peak RSS": 1.02}
# The monitor's keyword arguments per configuration; None: no monitor (the baseline); EMPTY: a
# callback that does nothing, the floor of what Lightning's hook calls cost any callback.
EMPTY = "empty callback"
# the monitor with defaults, writing through lightning_recorder's TensorBoardLogger (records
# checksummed by the google-crc32c wheel where it is installed) instead of Lightning's
RECORDER_LOGGER = "monitor, recorder's logger"
SPACED = "histograms every other logged step"
# the defaults once more, a second configuration identical to "monitor": how far apart two
# identical configurations read in one run, the noise of every other row
TWIN = "monitor, again"
# ``--idle``: monitors that never log, to split the per-step cost of the steps that log nothing
NEVER = 10**6  # every_n_steps of a monitor that never logs in a run
NOOP_HOOKS = "monitor, never logging, per-step hooks no-ops"
IDLE_CONFIGS: dict[str, dict[str, Any] | str | None] = {
    "baseline": None,
    EMPTY: EMPTY,
    "empty callback, again": EMPTY,
    "monitor, never logging": {"every_n_steps": NEVER},
    "monitor, never logging, again": {"every_n_steps": NEVER},
    NOOP_HOOKS: NOOP_HOOKS,
}
CONFIGS: dict[str, dict[str, Any] | str | None] = {
    "monitor": {},
    "baseline": None,
    "scalars only": {"histograms": False},
    SPACED: {"histogram_every_n_steps": 2 * EVERY},
    EMPTY: EMPTY,
    RECORDER_LOGGER: {},
    TWIN: {},
}
# ``--model``: the model that trains. ``digits``, the default: the digits CNN, every Conv2d and
# Linear output monitored. The others: bench_logging's benchmark models (the CPU targets
# for a step that logs are set on them), every module monitored, on made-up data of
# their batch size; only the defaults (with Lightning's logger and with the package's), the
# baseline and the defaults' twin take turns (their steps are 5 to 70 times the digits CNN's).
DIGITS = "digits"
BENCHMARK_MODELS = {  # --model: (bench_logging's name of the model, what the table says)
    "resnet18": ("(b) ResNet-18-like, every module", "the ResNet-18-like model"),
    "mlp64": ("(c) MLP, 64 layers, every module", "the 64-layer MLP"),
}
MODEL_CONFIGS = ("monitor", "baseline", RECORDER_LOGGER, TWIN)
# The monitor's warning that Lightning's TensorBoardLogger checksums a large event in pure
# Python: the benchmarks (this one and bench_logging) measure that cost knowingly.
CHECKSUM_WARNING = ".*per logged step through Lightning's TensorBoardLogger.*"


class _Baton:
    """Whose turn it is: trainers in threads take their steps one at a time.

    Every runner takes one step per round. The first round follows the order given; each later
    round is a fresh random order, so that no runner keeps the same place in the round (where a
    periodic disturbance of the machine could fall on it again and again).
    """

    def __init__(self, runners: int, seed: int = 0) -> None:
        self._turn = 0
        self._done = [False] * runners
        self._round = list(range(1, runners))  # who goes next in this round
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self.ready = threading.Barrier(runners)  # every trainer has reached its first batch

    def pass_on(self, me: int) -> None:
        """Give the turn to the next runner still running (``me`` holds it)."""
        with self._cond:
            self._round = [k for k in self._round if not self._done[k]]
            if not self._round:
                live = [k for k, done in enumerate(self._done) if not done]
                self._rng.shuffle(live)
                if len(live) > 1 and live[0] == me:  # not two steps in a row
                    live.append(live.pop(0))
                self._round = live
            self._turn = self._round.pop(0) if self._round else me
            self._cond.notify_all()

    def wait(self, me: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == me)

    def finish(self, me: int) -> None:
        """``me`` has ended (or failed): the others go on without it."""
        with self._cond:
            self._done[me] = True
        self.ready.abort()  # if one failed before its first batch, free those waiting
        self.pass_on(me)


class _NoopHooksMonitor(FeatureStatsMonitor):
    """The monitor attached as usual, with its three per-step hooks replaced by ``Callback``'s
    no-ops (``--idle``): what its presence costs a step, without its per-step code."""

    on_train_batch_start = pl.Callback.on_train_batch_start
    on_train_batch_end = pl.Callback.on_train_batch_end
    on_before_optimizer_step = pl.Callback.on_before_optimizer_step


class _StepTimer(pl.Callback):
    """Times each training step on the wall clock and on its thread's CPU clock.

    A step runs from one ``on_train_batch_start`` to the next: data, forward, backward,
    optimizer, every callback and logging. With a baton, the timer hands the turn to the next
    trainer at each batch start and waits for it to come back, and the time spent waiting is not
    counted. A step that logged ends when the logger's writer thread has written its events:
    in a single training run that work competes with the following steps, and here it must not
    land in another trainer's step, so the timer waits for it before the clock stops.
    """

    def __init__(
        self, baton: _Baton | None = None, me: int = 0, rss_at: Sequence[int] = ()
    ) -> None:
        self.baton, self.me = baton, me
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.rss_at = set(rss_at)
        self.rss: dict[int, int] = {}
        self._started: tuple[float, float] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._started is not None and _logs(len(self.wall)):  # the step ending logged
            write_events(trainer)  # in its own time, not in another configuration's
        wall, cpu = time.perf_counter(), time.thread_time()
        if self._started is not None:
            self.wall.append(wall - self._started[0])
            self.cpu.append(cpu - self._started[1])
        step = len(self.wall)  # the step about to start
        if step in self.rss_at:
            self.rss[step] = _peak_rss_kib()
        if self.baton is not None:
            if self._started is None:
                self.baton.ready.wait()
            else:
                self.baton.pass_on(self.me)
            self.baton.wait(self.me)
        self._started = time.perf_counter(), time.thread_time()


def write_events(trainer: pl.Trainer) -> None:
    """Wait until the writer thread of ``trainer``'s logger has written (and checksummed) what
    was logged so far, where the logger has one that can be flushed: a timer calls it at the
    end of a step that logged, before the clock stops and the turn passes."""
    flush = getattr(getattr(trainer.logger, "experiment", None), "flush", None)
    if callable(flush):
        flush()


def pin_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds, one arena (see the module documentation).

    Returns False where the C library is not glibc (nothing changed).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return (
        bool(mallopt(m_mmap_threshold, 32 << 20))
        and bool(mallopt(m_trim_threshold, 256 << 20))
        and bool(mallopt(m_arena_max, 1))
    )


@contextlib.contextmanager
def one_cpu(wanted: bool = True) -> Iterator[int | None]:
    """Run this thread, and the threads it starts, on one of the CPUs it may use (the last);
    give the thread its CPUs back on leaving. Yields the CPU, or ``None`` when not ``wanted`` or
    where the operating system has no affinity call (nothing changed)."""
    if not wanted or not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    cpu = max(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


def _peak_rss_kib() -> int:
    """This process's peak resident set size, in KiB.

    Linux's ``VmHWM``: ``getrusage``'s ``ru_maxrss`` survives ``exec`` there, so that a child
    started by this (large) process would report the parent's peak, not its own.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _loader(steps: int, batch_size: int) -> DataLoader:
    """The digits training set repeated, so that a run stays inside one epoch."""
    train, _ = digits_loaders(batch_size=batch_size)
    x, y = train.dataset.tensors  # type: ignore[attr-defined]
    repeat = 1 + steps * batch_size // len(x)
    data = TensorDataset(x.repeat(repeat, 1, 1, 1), y.repeat(repeat))
    order = torch.Generator().manual_seed(0)  # the same batches in every run, in any thread
    return DataLoader(data, batch_size=batch_size, shuffle=True, generator=order)


def _bench_logging() -> Any:
    """``bench_logging`` of this folder, which defines the benchmark models (loaded once)."""
    found = sys.modules.get("_bench_logging")
    if found is None:
        spec = importlib.util.spec_from_file_location(
            "_bench_logging", Path(__file__).with_name("bench_logging.py")
        )
        assert spec is not None and spec.loader is not None
        found = importlib.util.module_from_spec(spec)
        sys.modules["_bench_logging"] = found
        spec.loader.exec_module(found)
    return found


def workload(model: str, steps: int, batch_size: int) -> tuple[pl.LightningModule, DataLoader, Any]:
    """The LightningModule, training data (``steps`` batches at least, the same in every run)
    and monitored sources of ``--model`` ``model``: the digits CNN (batches of ``batch_size``)
    or a benchmark model of ``bench_logging`` (its own batch size)."""
    if model == DIGITS:
        return DigitsCNN(), _loader(steps, batch_size), (nn.Conv2d, nn.Linear)
    bench = _bench_logging()
    body, data, batch = bench.model_data(BENCHMARK_MODELS[model][0], steps)
    return bench.Net(body), DataLoader(data, batch_size=batch), "net.*"


def _trainer(
    monitor: dict[str, Any] | str | None,
    steps: int,
    root: str,
    name: str,
    timer: _StepTimer,
    logger: type[TensorBoardLogger] = TensorBoardLogger,
    sources: Any = (nn.Conv2d, nn.Linear),
) -> pl.Trainer:
    """A Trainer for ``steps`` steps with a monitor of ``sources`` built with ``monitor``
    (``None``: without), logging to a ``logger`` (Lightning's ``TensorBoardLogger`` by
    default)."""
    callbacks: list[pl.Callback] = [timer]
    sources = list(sources) if isinstance(sources, tuple) else sources
    if monitor == EMPTY:
        callbacks.append(pl.Callback())
    elif monitor == NOOP_HOOKS:
        callbacks.append(_NoopHooksMonitor(sources, every_n_steps=NEVER))
    elif isinstance(monitor, dict):
        callbacks.append(FeatureStatsMonitor(sources, **{"every_n_steps": EVERY, **monitor}))
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=logger(root, name=name),
        callbacks=callbacks,
        log_every_n_steps=EVERY,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _side_by_side(
    names: Sequence[str],
    steps: int,
    batch_size: int,
    root: str,
    seed: int = 0,
    configs: dict[str, dict[str, Any] | str | None] = CONFIGS,
    model: str = DIGITS,
) -> dict[str, _StepTimer]:
    """Train one model per configuration, each in its own thread, one step at a time in turn.

    The configurations take turns: a step of each, in the order of ``names``, then a step of
    each in a random order (drawn with ``seed``), and so on. Whatever slows the machine down for
    a while (other tenants, clock changes) falls on every configuration alike.
    """
    baton = _Baton(len(names), seed=seed)
    timers = {name: _StepTimer(baton, k) for k, name in enumerate(names)}
    jobs = []
    for name in names:
        pl.seed_everything(0, verbose=False)  # the same initial weights for every configuration
        module, loader, sources = workload(model, steps, batch_size)
        label = name.replace(" ", "-")
        logger = RecorderTensorBoardLogger if name == RECORDER_LOGGER else TensorBoardLogger
        trainer = _trainer(configs[name], steps, root, label, timers[name], logger, sources)
        jobs.append((trainer, module, loader))
    run_in_turns(
        [
            lambda trainer=trainer, module=module, loader=loader: trainer.fit(module, loader)
            for trainer, module, loader in jobs
        ],
        baton,
    )
    return timers


def turn_order(names: Sequence[str], r: int) -> list[str]:
    """The order of the configurations ``names`` in repeat ``r`` (the first round of turns):
    rotated by ``r`` (over ``len(names)`` repeats every configuration takes every place) and
    reversed every other repeat (so that every configuration follows every other)."""
    k = r % len(names)
    order = [*names[k:], *names[:k]]
    return order if r % 2 == 0 else order[::-1]


def run_in_turns(fits: Sequence[Callable[[], Any]], baton: _Baton) -> None:
    """Run each of ``fits`` in its own thread (their timers hand the turn on with ``baton``),
    wait for all, and raise the first error any of them raised."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            fits[k]()
        except BaseException as err:
            errors.append(err)
        finally:
            baton.finish(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(fits))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _logs(k: int) -> bool:
    """Whether the step at index ``k`` of a timer's list is one on which the monitor logs."""
    return (k + 1) % EVERY == 0


def _split(monitored: list[float], baseline: list[float], window: range) -> dict[str, float]:
    """What each kind of step adds to the amortised time of ``monitored``: the excess over the
    baseline of its logging steps, of the steps right after them (the logger's writer finishing)
    and of the others, each as a fraction of the baseline's time over ``window``."""
    total = sum(baseline[k] for k in window)
    kinds = {
        "logging steps": [k for k in window if _logs(k)],
        "steps after them": [k for k in window if _logs(k - 1)],
        "other steps": [k for k in window if not (_logs(k) or _logs(k - 1))],
    }
    return {
        kind: sum(monitored[k] - baseline[k] for k in steps) / total
        for kind, steps in kinds.items()
    }


def _summary(times: list[float], window: range) -> dict[str, float]:
    logging = [times[k] for k in window if _logs(k)]
    quiet = [times[k] for k in window if not _logs(k)]
    return {
        "amortised": statistics.fmean(times[k] for k in window),
        "non-logging step": statistics.median(quiet),
        "logging step": statistics.median(logging),
    }


def _rss_child(steps: int, batch_size: int) -> None:
    torch.set_num_threads(1)
    # the compiled statistics ready before training (as the timed runs have them by step 50): a
    # background compile that ended after step 200 would raise the later peak, not a leak
    warm_up("cpu", [torch.float32], wait=True)
    timer = _StepTimer(rss_at=(200, steps))
    with tempfile.TemporaryDirectory() as root:
        pl.seed_everything(0, verbose=False)
        _trainer({}, steps + 1, root, "rss", timer).fit(DigitsCNN(), _loader(steps + 1, batch_size))
    print(json.dumps({"after_200": timer.rss[200], "after_last": timer.rss[steps]}))


def measure(
    repeats: int = 15,
    periods: int = 5,
    batch_size: int = 128,
    rss_steps: int = 2000,
    default_malloc: bool = False,
    all_cpus: bool = False,
    model: str = DIGITS,
) -> dict[str, Any]:
    """Run the benchmark; return per-clock medians, ratios and the RSS figures (the digits CNN:
    a benchmark model of ``--model`` has no memory run)."""
    torch.set_num_threads(1)
    pinned = False if default_malloc else pin_malloc()
    window = range(EVERY, EVERY * (periods + 1))  # whole logging periods after a warm-up
    steps = window.stop + 2
    keys = ("amortised", "non-logging step", "logging step")
    names = list(CONFIGS) if model == DIGITS else list(MODEL_CONFIGS)
    per: dict[str, dict[str, list[dict[str, float]]]] = {
        clock: {name: [] for name in names} for clock in ("wall", "cpu")
    }
    # ratios[clock][config][measure]: one ratio to the baseline per repeat
    ratios = {
        clock: {name: {k: [] for k in keys} for name in names if name != "baseline"}
        for clock in ("wall", "cpu")
    }
    splits: list[dict[str, float]] = []  # the monitor's amortised excess, by kind of step
    with tempfile.TemporaryDirectory() as root, one_cpu(not all_cpus) as cpu:
        # warm up imports, allocator, TensorBoard
        _side_by_side(names, 2 * EVERY, batch_size, root, model=model)
        for r in range(repeats):
            # the first round: every configuration takes every place; rotate, reverse every other
            order = turn_order(names, r)
            timers = _side_by_side(order, steps, batch_size, root, seed=r, model=model)
            splits.append(_split(timers["monitor"].wall, timers["baseline"].wall, window))
            for clock in ("wall", "cpu"):
                got = {name: _summary(getattr(t, clock), window) for name, t in timers.items()}
                for name in names:
                    per[clock][name].append(got[name])
                for name, by_key in ratios[clock].items():
                    for key in keys:
                        by_key[key].append(got[name][key] / got["baseline"][key])
    rss = _rss(rss_steps, batch_size) if model == DIGITS else None
    return {
        "model": model,
        "repeats": repeats,
        "malloc_pinned": pinned,
        "one_cpu": cpu,
        "batch_size": batch_size,
        "window": [window.start, window.stop],
        "ms": {
            clock: {
                side: {k: 1e3 * statistics.median(run[k] for run in runs) for k in keys}
                for side, runs in sides.items()
            }
            for clock, sides in per.items()
        },
        "ratio": {
            c: {n: {k: statistics.median(v) for k, v in r.items()} for n, r in by.items()}
            for c, by in ratios.items()
        },
        "ratio_range": {
            c: {n: {k: (min(v), max(v)) for k, v in r.items()} for n, r in by.items()}
            for c, by in ratios.items()
        },
        "ratios_per_repeat": ratios,
        "amortised_split": {k: statistics.median(s[k] for s in splits) for k in splits[0]},
        "rss_kib": rss,
        "rss_ratio": None if rss is None else rss["after_last"] / rss["after_200"],
        "rss_steps": rss_steps,
    }


def _rss(steps: int, batch_size: int) -> dict[str, int]:
    """Peak RSS after step 200 and after step ``steps`` of the monitor's training run, in a
    process of its own (:func:`_rss_child`)."""
    root_path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    child = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(steps), "--batch-size", str(batch_size)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root_path},
        check=True,
    )
    return cast(dict[str, int], json.loads(child.stdout.strip().splitlines()[-1]))


def measure_idle(
    repeats: int = 24,
    periods: int = 5,
    batch_size: int = 128,
    default_malloc: bool = False,
    all_cpus: bool = False,
) -> dict[str, Any]:
    """``--idle``: the configurations of :data:`IDLE_CONFIGS` side by side (none of them logs);
    per configuration and clock, the median over the repeats of each repeat's median per-step
    ratio to the baseline, and of its ratio of mean step times, over the timed window."""
    torch.set_num_threads(1)
    pinned = False if default_malloc else pin_malloc()
    window = range(EVERY, EVERY * (periods + 1))
    names = list(IDLE_CONFIGS)
    per_step: dict[str, dict[str, list[float]]] = {
        clock: {n: [] for n in names[1:]} for clock in ("wall", "cpu")
    }
    of_means: dict[str, dict[str, list[float]]] = {
        clock: {n: [] for n in names[1:]} for clock in ("wall", "cpu")
    }
    with tempfile.TemporaryDirectory() as root, one_cpu(not all_cpus) as cpu:
        _side_by_side(names, 2 * EVERY, batch_size, root, configs=IDLE_CONFIGS)  # warm up
        for r in range(repeats):
            order = turn_order(names, r)
            timers = _side_by_side(
                order, window.stop + 2, batch_size, root, seed=r, configs=IDLE_CONFIGS
            )
            for clock in ("wall", "cpu"):
                base = getattr(timers["baseline"], clock)
                for name in names[1:]:
                    times = getattr(timers[name], clock)
                    per_step[clock][name].append(
                        statistics.median(times[k] / base[k] for k in window)
                    )
                    of_means[clock][name].append(
                        sum(times[k] for k in window) / sum(base[k] for k in window)
                    )
    return {
        "repeats": repeats,
        "malloc_pinned": pinned,
        "one_cpu": cpu,
        "window": [window.start, window.stop],
        "per_step": {
            c: {n: statistics.median(v) for n, v in by.items()} for c, by in per_step.items()
        },
        "of_means": {
            c: {n: statistics.median(v) for n, v in by.items()} for c, by in of_means.items()
        },
        "per_step_by_repeat": per_step,
    }


def idle_table(result: dict[str, Any]) -> str:
    """The ``--idle`` figures as a Markdown table."""
    lines = [
        "| configuration | per-step ratio, wall | of the means, wall | per-step ratio, CPU |",
        "|---|---:|---:|---:|",
    ]
    for name, ratio in result["per_step"]["wall"].items():
        lines.append(
            f"| {name} | **{ratio:.4f}** | {result['of_means']['wall'][name]:.4f} | "
            f"{result['per_step']['cpu'][name]:.4f} |"
        )
    return "\n".join(lines)


def table(result: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    checksum = "google-crc32c" if c_checksum() is not None else "pure-Python checksum"
    lines = [
        "| measure | baseline (ms) | monitored (ms) | ratio, wall (min–max) | ratio, CPU | limit |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    measured = result["ratio"]["wall"]
    rows = [("monitor", key, key) for key in measured["monitor"]]
    rows.append(("scalars only", "logging step", "logging step, `histograms=False`"))
    rows.append(("scalars only", "amortised", "amortised, `histograms=False`"))
    rows.append((SPACED, "amortised", "amortised, histograms every other logged step"))
    rows.append((EMPTY, "non-logging step", "step, a callback that does nothing"))
    rows += [
        (TWIN, key, f"{key}, the same monitor again (identical: the noise)")
        for key in ("amortised", "non-logging step")
    ]
    rows += [
        (RECORDER_LOGGER, key, f"{key}, `lightning_recorder.TensorBoardLogger` ({checksum})")
        for key in ("amortised", "logging step")
    ]
    for config, key, label in [row for row in rows if row[0] in measured]:
        ratio = measured[config][key]
        lo, hi = result["ratio_range"]["wall"][config][key]
        cpu = result["ratio"]["cpu"][config][key]
        base, mon = result["ms"]["wall"]["baseline"][key], result["ms"]["wall"][config][key]
        limit = f"<= {LIMITS[key]}" if config == "monitor" else "(information)"
        lines.append(
            f"| {label} | {base:.2f} | {mon:.2f} | **{ratio:.3f}** ({lo:.2f}–{hi:.2f}) | "
            f"{cpu:.3f} | {limit} |"
        )
    rss, n = result["rss_kib"], result["rss_steps"]
    if rss is None:  # a benchmark model: no memory run
        return "\n".join(lines)
    lines.append(
        f"| peak RSS, after step {n} vs 200 | {rss['after_200'] / 1024:.1f} MiB | "
        f"{rss['after_last'] / 1024:.1f} MiB | **{result['rss_ratio']:.4f}** | | "
        f"<= {LIMITS['peak RSS']} |"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print a table of ratios; return the figures."""
    parser = argparse.ArgumentParser(description="FeatureStatsMonitor overhead")
    parser.add_argument("--repeats", type=int, default=None, help="15 (--idle: 24)")
    parser.add_argument("--periods", type=int, default=5, help="logging periods timed per run")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rss-steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, short runs")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument(
        "--default-malloc", action="store_true", help="keep glibc's adaptive malloc thresholds"
    )
    parser.add_argument(
        "--all-cpus", action="store_true", help="let the threads run on every CPU (noisier)"
    )
    parser.add_argument(
        "--idle",
        action="store_true",
        help="only monitors that never log, a callback that does nothing and the baseline, "
        "each twice or once (see IDLE_CONFIGS), 24 repeats unless --repeats says otherwise",
    )
    parser.add_argument(
        "--model",
        choices=[DIGITS, *BENCHMARK_MODELS],
        default=DIGITS,
        help="the digits CNN (default), or a benchmark model of bench_logging, every module "
        "monitored (the defaults with either logger, the baseline and the twin; no --idle)",
    )
    parser.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*validation_step.*but have no.*")
    warnings.filterwarnings("ignore", CHECKSUM_WARNING)  # the benchmark models' large events
    if args.rss_child is not None:
        _rss_child(args.rss_child, args.batch_size)
        return {}
    if args.repeats is None:
        args.repeats = 24 if args.idle else 15
    if args.quick:
        args.repeats, args.periods, args.rss_steps = 1, 1, 210
    if args.idle and args.model != DIGITS:
        parser.error("--idle times the digits CNN only: leave out --model")
    if args.idle:
        found = measure_idle(
            args.repeats, args.periods, args.batch_size, args.default_malloc, args.all_cpus
        )
        start, stop = found["window"]
        print(
            f"\nSteps that log nothing: configurations that never log vs the same Trainer "
            f"without them, medians of {found['repeats']} repeats, steps {start}-{stop - 1}, "
            "the configurations taking turns step by step (two identical configurations differ "
            "by the run's noise).\n"
        )
        print(idle_table(found))
        if args.json:
            Path(args.json).write_text(json.dumps(found, indent=2))
        return found
    result = measure(
        args.repeats,
        args.periods,
        args.batch_size,
        args.rss_steps,
        args.default_malloc,
        args.all_cpus,
        args.model,
    )
    start, stop = result["window"]
    malloc = "malloc fixed (thresholds, one arena)" if result["malloc_pinned"] else "glibc malloc"
    where = "every CPU" if result["one_cpu"] is None else "one CPU"
    watched = f"every Conv2d/Linear output of the digits CNN (batch {result['batch_size']})"
    if args.model != DIGITS:
        watched = f"every module of {BENCHMARK_MODELS[args.model][1]} (made-up data)"
    print(
        f"\nFeatureStatsMonitor on {watched}, "
        f"logging every {EVERY} steps, vs the same Trainer without it: "
        f"medians of {result['repeats']} repeats, the configurations taking turns step by step, "
        f"steps {start}-{stop - 1}, one torch thread, {where}, "
        f"{malloc}.\n"
    )
    print(table(result))
    split = ", ".join(f"{k} {100 * v:+.2f} %" for k, v in result["amortised_split"].items())
    print(f"\nThe monitor's amortised excess by kind of step (median of repeats): {split}.")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
