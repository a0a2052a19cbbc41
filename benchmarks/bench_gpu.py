"""`FeatureStatsMonitor` on a CUDA GPU: every GPU row of the statistics engine's targets, measured
side by side in one run with its baseline.

**Model.** A CIFAR-style ResNet-18 written here (no torchvision: a 3x3 stem, four stages of two
basic blocks, 64 to 512 channels, 20 convolutions and a linear head), trained on batches of 128
random 3x32x32 images that already sit on the GPU (the loader copies nothing), in float32
(``precision="32-true"``) and in bfloat16 (``precision="bf16-mixed"``: the outputs of the
convolutions are bfloat16).

**Configurations** of the same Trainer (``accelerator="gpu"``, a TensorBoard logger,
``log_every_n_steps=50``):

* **plain** — the model alone, its ``training_step`` returning the cross-entropy;
* **callback** — with a ``Callback`` that does nothing: what Lightning's hook calls cost any
  callback, and how far apart two runs of the same work land;
* **monitor** — with ``FeatureStatsMonitor([Conv2d, Linear])`` and its defaults: it logs every
  ``log_every_n_steps`` (50) steps the statistics and histograms of every convolution and the
  head, and the norms, gradient norms and update ratios of their parameters.

``--all`` adds the small CNN of the CPU distillation benchmark (twice as wide) and, for both
models, ``FeatureDistillation`` from a teacher twice as wide against the same distillation
written by hand into the LightningModule (``register_forward_hook`` closures, ``self.log``).
``--package-logger`` adds the monitor writing through ``lightning_recorder.TensorBoardLogger``
instead of Lightning's (its records checksummed by the ``google-crc32c`` wheel where installed;
TensorBoard's own writer checksums them in pure Python, on a thread that holds the GIL, while a
host-bound step waits).

**The engine is compiled first.** The run waits for the statistics engine's compiled graphs
(``warm_up(..., wait=True)``) before anything is timed, and reports ``compile_status()`` before
and after (``LIGHTNING_RECORDER_COMPILE=0``, or ``--eager``, measures the eager engine instead).

**Timing.** Each repeat trains every configuration once, in an order that rotates from repeat to
repeat (and reverses every other repeat), each fit in three phases: steps 0-49 warm up; steps
50-199 are *synchronised* (a timing callback calls ``torch.cuda.synchronize()`` at every
``on_train_batch_start``, so that a step's wall time is its host and device work: the medians
of the non-logging and the logging steps, 99, 149 and 199, come from these); steps 200-349 run
*free*, synchronised only at their start and at the end of the run, so that the host runs ahead
of the GPU as in a real run (the amortised step, logging steps 249, 299 and 349 included, one
in 50). Ratios against the plain model are taken per repeat; their medians are reported, with
the spread over repeats.

**Synchronisations and memory.** A separate short fit of each configuration (13 steps, the
monitor logging every 4: steps 3, 7 and 11) counts with ``torch.cuda.set_sync_debug_mode("warn")``
every synchronising CUDA call, in two windows per step: *in the step* (from the first callback's
``on_train_batch_start`` to the last callback's ``on_train_batch_end``: forward, backward,
optimizer and every callback hook) and *after it* (Lightning's logging and the next batch's
fetch); the plain Trainer is counted too and the tables give what each callback adds. The same
fits take the peak of allocated GPU memory of each step window
(``torch.cuda.reset_peak_memory_stats`` at its start, ``torch.cuda.max_memory_allocated`` at its
end) and compare it with the plain model's same step, against a tenth of the largest monitored
output (measured by a forward with hooks), with the part of it already held when the step
starts (buffers kept from an earlier step; each fit starts after a garbage collection, so
that nothing an earlier fit left counts); a monitor with ``parameters=False`` is measured too,
to tell the copies that the update ratios take (one float32 copy of each monitored parameter,
taken before the optimizer step of a logging step and freed at its end) from the rest.

**The engine alone.** The packed state of one large output (2**24 float32, 2**25 bfloat16
elements), compiled and eager, against one read of it (``x.sum(dtype=torch.float32)``), timed
with CUDA events: what one monitored output costs a logging step, apart from the model. And what
one output costs the host, which a ResNet-18 step is bound by: the host time per output of the
state of an output of the first and of the last stage, taken as the monitor's collector takes
it (eight outputs, then their merge) and as ``tensor_state`` takes it (the device left to run
behind), and the kernels and copies run on the GPU per output (``torch.profiler``).

**One graph, two ways of calling it** (``--aot``, for information; ``make gpu-check`` runs it
last). The state of a large output's rows (masked, as the monitor takes it on a GPU) compiled
by ``torch.compile``, as the engine compiles it (dynamo's guard and Python wrappers around the
kernels at every call), and the same function exported by ``torch.export`` with symbolic sizes
and compiled ahead of time by AOTInductor into a package whose C++ runner launches the kernels:
host time and device operations per call, the compile's seconds, and how far apart the two
results are. A per-output host cost is what keeps a ResNet-18 logging step above its target
(see ``docs/benchmarks.md``); this says what the other way of calling the same graph would save.
Before it, the same option compares two ways of taking the states of every convolution output of
a ResNet-18 step (20; as rows, masked): a ``torch.compile`` call per output, as the monitor's
hooks call the engine, and one call of one graph for all of them: host time and device
operations per output, each way's first call (its compile), and how far apart the results are.

Run ``python benchmarks/bench_gpu.py`` (``--quick``: one repeat; ``--json PATH``: save every
figure; ``--stacks``: print where each added synchronisation comes from; ``--profile MODEL``:
profile a logging step; ``--aot``: only the comparison above). Without a CUDA device it says so
and exits 0; ``--device cpu`` runs every part of it on the CPU at toy sizes, to check the script
itself (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_recorder import (
    FeatureDistillation,
    FeatureStatsMonitor,
    KLDivLoss,
    MSELoss,
    build_connector,
)
from lightning_recorder import TensorBoardLogger as RecorderTensorBoardLogger
from lightning_recorder.callbacks._event_file import c_checksum
from lightning_recorder.stats import _engine as engine
from lightning_recorder.stats._collect import Collector
from lightning_recorder.stats._state import rows_state

EVERY = 50
BATCH = 128
IMAGE = 32
CLASSES = 10
PRECISIONS = {"float32": "32-true", "bfloat16": "bf16-mixed"}
TARGETS = {"logging": 1.2, "amortised": 1.02, "syncs_non_logging": 0, "syncs_logging": 1}


class Setup:
    """Where and how big: the GPU (the default) or a toy run on the CPU (``--device cpu``)."""

    accelerator, device = "gpu", "cuda"
    batch, every = BATCH, EVERY
    warmup, synced, free = EVERY, 3 * EVERY, 3 * EVERY
    sync_steps, sync_every = 13, 4
    engine_sizes: ClassVar[dict[torch.dtype, int]] = {torch.float32: 2**24, torch.bfloat16: 2**25}
    widths: ClassVar[dict[str, int]] = {"resnet-18": 64, "small cnn": 32}

    @classmethod
    def cpu(cls) -> None:
        cls.accelerator, cls.device = "cpu", "cpu"
        cls.batch, cls.every = 4, 2
        cls.warmup, cls.synced, cls.free = 2, 4, 4
        cls.sync_steps, cls.sync_every = 5, 2
        cls.engine_sizes = {torch.float32: 2**18, torch.bfloat16: 2**18}
        cls.widths = {"resnet-18": 4, "small cnn": 4}

    @classmethod
    def cuda(cls) -> bool:
        return cls.device == "cuda"


def _sync() -> None:
    if Setup.cuda():
        torch.cuda.synchronize()


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    """Start a new peak: the CUDA allocator's, or on the CPU (a smoke run of this script) the
    resident set's high-water mark where the kernel lets a process reset it."""
    if Setup.cuda():
        torch.cuda.reset_peak_memory_stats()
    elif os.access("/proc/self/clear_refs", os.W_OK):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _memory_now() -> int:
    return torch.cuda.memory_allocated() if Setup.cuda() else _proc_status("VmRSS:")


def _memory_peak() -> int:
    return torch.cuda.max_memory_allocated() if Setup.cuda() else _proc_status("VmHWM:")


def _stamp(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


# ---------------------------------------------------------------------------- models
def _small_cnn(width: int) -> nn.Module:
    net = nn.Module()
    net.body = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )
    net.head = nn.Linear(2 * width, CLASSES)
    return net


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def _resnet18(width: int) -> nn.Module:
    """CIFAR-style ResNet-18: ``body`` (stem and four stages) and ``head``."""
    net = nn.Module()
    stages: list[nn.Module] = [
        nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
    ]
    cin = width
    for i, stride in enumerate((1, 2, 2, 2)):
        cout = width * 2**i
        stages.append(nn.Sequential(_Block(cin, cout, stride), _Block(cout, cout, 1)))
        cin = cout
    net.body = nn.Sequential(*stages)
    net.head = nn.Linear(cin, CLASSES)
    return net


MODELS: dict[str, dict[str, Any]] = {
    "resnet-18": {
        "build": _resnet18,
        "pairs": {"body.1": "body.1", "body.2": "body.2", "body.4": "body.4", "head": "head"},
    },
    "small cnn": {
        "build": _small_cnn,
        "pairs": {"body.2": "body.2", "body.5": "body.5", "head": "head"},
    },
}


class Net(nn.Module):
    def __init__(self, model: str, width: int) -> None:
        super().__init__()
        inner = MODELS[model]["build"](width)
        self.body, self.head = inner.body, inner.head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x).mean((2, 3)))


class Plain(pl.LightningModule):
    """The model alone: its step returns the loss and synchronises nothing."""

    def __init__(self, model: str, width: int) -> None:
        super().__init__()
        net = Net(model, width)
        self.body, self.head = net.body, net.head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x).mean((2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _losses(pairs: dict[str, str]) -> dict[str, Callable[[Tensor, Tensor], Tensor]]:
    return {p: KLDivLoss(temperature=4.0) if p == "head" else MSELoss() for p in pairs}


class HandWritten(Plain):
    """The same student with the distillation written into it, as people do by hand."""

    def __init__(self, model: str, width: int, teacher: nn.Module) -> None:
        super().__init__(model, width)
        self.pairs = MODELS[model]["pairs"]
        self.losses = _losses(self.pairs)
        self._teacher = [teacher]  # kept out of the module tree
        self._s: dict[str, Tensor] = {}
        self._t: dict[str, Tensor] = {}
        self._handles = []
        for name, t_name in self.pairs.items():
            self._handles.append(
                self.get_submodule(name).register_forward_hook(self._store(self._s, name))
            )
            self._handles.append(
                teacher.get_submodule(t_name).register_forward_hook(self._store(self._t, name))
            )
        with torch.no_grad():
            x = torch.zeros(2, 3, IMAGE, IMAGE)
            self.eval()(x)
            teacher(x)
            self.train()
        self.connectors = nn.ModuleDict(
            {
                n.replace(".", "_"): build_connector(self._s[n].shape, self._t[n].shape)
                for n in self.pairs
            }
        )

    @staticmethod
    def _store(into: dict[str, Tensor], name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            into[name] = output

        return hook

    def on_fit_start(self) -> None:
        self._teacher[0].to(self.device)  # out of the module tree: the Trainer does not move it

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        with torch.no_grad():
            self._teacher[0](x)
        loss = F.cross_entropy(self(x), y)
        total: Tensor | None = None
        for name in self.pairs:
            connector = self.connectors[name.replace(".", "_")]
            term = self.losses[name](connector(self._s[name]), self._t[name])
            self.log(f"distill/{name}", term.detach())
            total = term if total is None else total + term
        assert total is not None
        self.log("distill/total", total.detach())
        self._s.clear()
        self._t.clear()
        return loss + total

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()


class _Nothing(pl.Callback):
    """A callback that does nothing."""


def _teacher(model: str) -> nn.Module:
    torch.manual_seed(1)
    return Net(model, 2 * Setup.widths[model]).eval().requires_grad_(False)


# the monitor with its defaults, writing through lightning_recorder's TensorBoardLogger (records
# checksummed by the google-crc32c wheel where it is installed) instead of Lightning's, whose
# TensorBoard writer checksums each record in pure Python on a thread that holds the GIL
PACKAGE_LOGGER = "monitor, lightning_recorder.TensorBoardLogger"


def _setup(config: str, model: str) -> tuple[pl.LightningModule, list[pl.Callback]]:
    """The LightningModule and callbacks of a configuration (seeded)."""
    width = Setup.widths[model]
    torch.manual_seed(0)
    if config == "plain":
        return Plain(model, width), []
    if config == "callback":
        return Plain(model, width), [_Nothing()]
    if config in ("monitor", PACKAGE_LOGGER):  # defaults: every log_every_n_steps, parameters
        return Plain(model, width), [FeatureStatsMonitor([nn.Conv2d, nn.Linear])]
    if config == "monitor, parameters=False":
        return Plain(model, width), [FeatureStatsMonitor([nn.Conv2d, nn.Linear], parameters=False)]
    if config == "distill":
        pairs = MODELS[model]["pairs"]
        teacher = _teacher(model)
        torch.manual_seed(0)
        return Plain(model, width), [FeatureDistillation(teacher, pairs, loss=_losses(pairs))]
    if config == "hand-written":
        teacher = _teacher(model)
        torch.manual_seed(0)
        return HandWritten(model, width, teacher), []
    raise ValueError(config)


def _batches(steps: int, pool: int = 16) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    made = [
        (
            torch.randn(Setup.batch, 3, IMAGE, IMAGE, generator=g).to(Setup.device),
            torch.randint(0, CLASSES, (Setup.batch,), generator=g).to(Setup.device),
        )
        for _ in range(pool)
    ]
    return [made[i % pool] for i in range(steps)]


def _fit(
    model: pl.LightningModule,
    callbacks: list[pl.Callback],
    steps: int,
    precision: str,
    every: int | None = None,
    package_logger: bool = False,
) -> None:
    """Train ``model`` for ``steps`` steps, logging to Lightning's ``TensorBoardLogger`` (the
    package's with ``package_logger``)."""
    logger_class = RecorderTensorBoardLogger if package_logger else TensorBoardLogger
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            accelerator=Setup.accelerator,
            devices=1,
            max_steps=steps,
            precision=precision,  # type: ignore[arg-type]
            callbacks=callbacks,
            logger=logger_class(logdir, name="", version=""),
            log_every_n_steps=every or Setup.every,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, DataLoader(_batches(steps), batch_size=None))
        for logger in trainer.loggers:
            logger.finalize("success")
    if isinstance(model, HandWritten):
        model.remove_hooks()


# ---------------------------------------------------------------------------- timing
class _Timer(pl.Callback):
    """Wall-clock stamps at batch starts after a device synchronisation: every step of the
    synchronised phase, then at the start of the free phase and at the end of the run."""

    def __init__(self) -> None:
        self.synced: list[float] = []
        self.free: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if Setup.warmup <= step <= Setup.warmup + Setup.synced:
            _sync()
            now = time.perf_counter()
            self.synced.append(now)
            if step == Setup.warmup + Setup.synced:
                self.free.append(now)

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        _sync()
        self.free.append(time.perf_counter())


def _is_logging(step: int) -> bool:
    return (step + 1) % Setup.every == 0


def _timed(config: str, model: str, precision: str) -> dict[str, float]:
    module, callbacks = _setup(config, model)
    timer = _Timer()
    steps = Setup.warmup + Setup.synced + Setup.free
    _fit(module, [timer, *callbacks], steps, precision, package_logger=config == PACKAGE_LOGGER)
    _check_logged(callbacks, steps, Setup.every)
    times = [b - a for a, b in zip(timer.synced, timer.synced[1:], strict=False)]
    window = range(Setup.warmup, Setup.warmup + Setup.synced)
    assert len(times) == len(window), (len(times), len(window))
    by_step = dict(zip(window, times, strict=True))
    quiet = [t for s, t in by_step.items() if not _is_logging(s)]
    logging = [t for s, t in by_step.items() if _is_logging(s)]
    return {
        "non_logging": statistics.median(quiet),
        "logging": statistics.median(logging) if logging else math.nan,
        "amortised_synced": statistics.fmean(times),
        "amortised": (timer.free[-1] - timer.free[0]) / Setup.free,
    }


KEYS = ("non_logging", "logging", "amortised", "amortised_synced")


def measure(
    models: Sequence[str],
    configs: Sequence[str],
    repeats: int,
    save: Callable[[dict[str, Any]], None] | None = None,
    budget: float | None = None,
) -> dict[str, Any]:
    """Time every configuration of every model in each precision; ``save`` gets the results
    after each repeat. With a ``budget`` (seconds), no repeat starts that would end past it
    (judged by the slowest repeat so far); the first always runs."""
    results: dict[str, Any] = {}
    started = time.perf_counter()
    longest = 0.0
    cells = [(m, p) for m in models for p in PRECISIONS]
    runs: dict[tuple[str, str], dict[str, list[dict[str, float]]]] = {
        cell: {c: [] for c in configs} for cell in cells
    }
    for r in range(repeats):
        elapsed = time.perf_counter() - started
        if budget is not None and r > 0 and elapsed + longest > budget:
            _stamp(f"timing: stopped after {r} repeat(s), the time budget ({budget:.0f} s) spent")
            break
        begun = time.perf_counter()
        for model, name in cells:
            order = list(configs[r % len(configs) :]) + list(configs[: r % len(configs)])
            if r % 2:
                order.reverse()
            for config in order:
                runs[model, name][config].append(_timed(config, model, PRECISIONS[name]))
            _stamp(f"timing: {model} {name}: repeat {r + 1}/{repeats} done")
        longest = max(longest, time.perf_counter() - begun)
        for (model, name), cell in runs.items():
            results.setdefault(model, {})[name] = _summarise(cell, configs)
        if save is not None:
            save(results)
    return results


def _ratios(runs: list[dict[str, float]], base: list[dict[str, float]], key: str) -> list[float]:
    return [a[key] / b[key] for a, b in zip(runs, base, strict=True)]


def _summarise(runs: dict[str, list[dict[str, float]]], configs: Sequence[str]) -> dict[str, Any]:
    ratios: dict[str, dict[str, Any]] = {}
    done = [c for c in configs if runs[c]]
    n = min(len(runs[c]) for c in done)
    cut = {c: runs[c][:n] for c in done}
    for config in done[1:]:
        ratios[config] = {}
        for key in KEYS:
            per = _ratios(cut[config], cut["plain"], key)
            ratios[config][key] = statistics.median(per)
            ratios[config][key + "_range"] = [min(per), max(per)]
    if "monitor" in cut and "callback" in cut:
        per = _ratios(cut["monitor"], cut["callback"], "non_logging")
        ratios["monitor vs callback"] = {
            "non_logging": statistics.median(per),
            "non_logging_range": [min(per), max(per)],
        }
    if "distill" in cut and "hand-written" in cut:
        ratios["distill vs hand-written"] = {
            key: statistics.median(_ratios(cut["distill"], cut["hand-written"], key))
            for key in ("non_logging", "amortised")
        }
    return {
        "ms": {
            c: {k: statistics.median(run[k] for run in cut[c]) * 1e3 for k in KEYS} for c in done
        },
        "ratios": ratios,
        "per_repeat": cut,
    }


# ---------------------------------------------------------------------------- syncs and memory
class _SyncCounter:
    """Counts synchronising CUDA calls (``set_sync_debug_mode("warn")``) with their stacks."""

    def __init__(self) -> None:
        self.stacks: list[str] | None = None
        self._catcher: Any = None

    def begin(self) -> None:
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        self.stacks = []
        if Setup.cuda():
            torch.cuda.set_sync_debug_mode("warn")

    def _show(self, message: Any, *args: Any, **kwargs: Any) -> None:
        if self.stacks is not None and "synchroniz" in str(message):
            self.stacks.append("".join(traceback.format_stack()[-14:-2]))

    def end(self) -> list[str]:
        if self.stacks is None:
            return []
        if Setup.cuda():
            torch.cuda.set_sync_debug_mode(0)
        self._catcher.__exit__(None, None, None)
        stacks, self.stacks = self.stacks, None
        return stacks


class _First(pl.Callback):
    def __init__(self, counter: _SyncCounter, after: list[list[str]]) -> None:
        self.counter, self.after = counter, after
        self.held: list[int] = []  # memory allocated at each step's start

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > 0:
            self.after.append(self.counter.end())
        _reset_peak()
        self.held.append(_memory_now())
        self.counter.begin()


class _Last(pl.Callback):
    def __init__(self, counter: _SyncCounter, after: list[list[str]]) -> None:
        self.counter, self.after = counter, after
        self.inside: list[list[str]] = []
        self.peaks: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.inside.append(self.counter.end())
        self.peaks.append(_memory_peak())
        self.counter.begin()

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.after.append(self.counter.end())


def count_syncs(model: str, config: str, precision: str) -> dict[str, Any]:
    gc.collect()  # what earlier fits left for the collector is not this one's memory
    if Setup.cuda():
        torch.cuda.empty_cache()
    module, callbacks = _setup(config, model)
    counter, after = _SyncCounter(), []
    first, last = _First(counter, after), _Last(counter, after)
    _fit(module, [first, *callbacks, last], Setup.sync_steps, precision, every=Setup.sync_every)
    counter.end()
    _check_logged(callbacks, Setup.sync_steps, Setup.sync_every)
    return {"inside": last.inside, "after": after, "peaks": last.peaks, "held": first.held}


def _check_logged(callbacks: list[pl.Callback], steps: int, every: int) -> None:
    """A monitor of the run logged on every ``every``-th step (the figures are of logging steps)."""
    for callback in callbacks:
        if isinstance(callback, FeatureStatsMonitor):
            assert callback.logged_steps == steps // every, (callback.logged_steps, steps, every)


def largest_output(model: str, precision: str) -> tuple[int, int]:
    """The bytes of the largest output of a monitored module (``Conv2d``, ``Linear``) in one
    training forward under ``precision``, and the bytes of the float32 copies of their
    parameters that the update ratios keep."""
    module, _ = _setup("plain", model)
    module = module.to(Setup.device)
    sizes: list[int] = []
    chosen = [m for m in module.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    handles = [
        m.register_forward_hook(lambda m, a, out: sizes.append(out.numel() * out.element_size()))
        for m in chosen
    ]
    bf16 = precision.startswith("bf16")
    try:
        with torch.autocast(Setup.device, dtype=torch.bfloat16, enabled=bf16):
            module(_batches(1)[0][0])
    finally:
        for handle in handles:
            handle.remove()
    copies = sum(p.numel() * 4 for m in chosen for p in m.parameters())
    return max(sizes), copies


SYNC_CONFIGS = ("plain", "callback", "monitor", "monitor, parameters=False")


def syncs_and_memory(models: Sequence[str], configs: Sequence[str], stacks: bool) -> dict:
    """Per model and precision: the synchronisations our callbacks add to each kind of step,
    and the peak memory they add to a step."""
    out: dict[str, Any] = {}
    steps, every = Setup.sync_steps, Setup.sync_every
    logging = [s for s in range(steps) if (s + 1) % every == 0]
    for model in models:
        for name, precision in PRECISIONS.items():
            counted = {c: count_syncs(model, c, precision) for c in configs}
            bare = counted["plain"]
            largest, copies = largest_output(model, precision)
            table: dict[str, Any] = {
                "largest monitored output (bytes)": largest,
                "memory budget (bytes)": largest / 10,
                "parameter copies (bytes)": copies,
                "plain": {
                    "syncs in step (every step)": sorted({len(x) for x in bare["inside"]}),
                    "syncs after step, logging steps": sorted(
                        {len(bare["after"][s]) for s in logging}
                    ),
                    "peak memory (bytes), by step": bare["peaks"],
                },
            }
            for config in configs[1:]:
                ours = counted[config]
                added = [len(ours["inside"][s]) - len(bare["inside"][s]) for s in range(steps)]
                after = [len(ours["after"][s]) - len(bare["after"][s]) for s in range(steps)]
                monitor = config.startswith("monitor")
                kinds = {
                    "first step (set-up)": [0],
                    "non-logging steps": [s for s in range(1, steps) if s not in logging],
                    "logging steps": [s for s in logging if s > 0],
                }
                if not monitor:
                    kinds = {"first step (set-up)": [0], "every step": list(range(1, steps))}
                row: dict[str, Any] = {
                    f"syncs added in step, {kind}": sorted({added[s] for s in chosen})
                    for kind, chosen in kinds.items()
                }
                row["syncs added after step, logging steps"] = sorted({after[s] for s in logging})
                row["syncs added after step, other steps"] = sorted(
                    {after[s] for s in range(steps) if s not in logging}
                )
                extra = [ours["peaks"][s] - bare["peaks"][s] for s in range(steps)]
                row["peak memory added (bytes), logging steps"] = [
                    extra[s] for s in logging if s > 0
                ]
                row["peak memory added (bytes), non-logging steps, max"] = max(
                    extra[s] for s in range(1, steps) if s not in logging
                )
                held = [ours["held"][s] - bare["held"][s] for s in range(steps)]
                row["of which held since earlier steps (bytes), logging steps"] = [
                    held[s] for s in logging if s > 0
                ]
                table[config] = row
                if stacks:
                    for s in range(steps):
                        if added[s] > 0 or after[s] > 0:
                            print(
                                f"--- {model} {name} / {config}, step {s}: +{added[s]} in, "
                                f"+{after[s]} after"
                            )
                            for where in ("inside", "after"):
                                for stack in ours[where][s]:
                                    print(f"[{where}]\n{stack}")
            out.setdefault(model, {})[name] = table
            _stamp(f"syncs and memory: {model} {name} done")
    return out


# ---------------------------------------------------------------------------- the engine alone
def _time(fn: Callable[[], Any], repeats: int = 20) -> float:
    """Median seconds of ``fn`` (CUDA events on the GPU, the wall clock on the CPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if Setup.cuda():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def engine_rows() -> dict[str, Any]:
    """The packed state of one large tensor, compiled and eager, against one read of it."""
    rows: dict[str, Any] = {}
    for dtype, n in Setup.engine_sizes.items():
        x = torch.randn(n, device=Setup.device).to(dtype)
        read = _time(lambda x=x: x.sum(dtype=torch.float32))
        compiled = _time(lambda x=x: engine.tensor_state(x))
        with engine.eager_only():
            eager = _time(lambda x=x: engine.tensor_state(x))
        name = str(dtype).removeprefix("torch.")
        rows[f"{name}, {n} elements"] = {
            "read (ms)": read * 1e3,
            "state, compiled (ms)": compiled * 1e3,
            "state, eager (ms)": eager * 1e3,
            "compiled / read": compiled / read,
            "eager / read": eager / read,
            "read (GB/s)": n * x.element_size() / read / 1e9,
        }
    return rows


def _host_per_call(fn: Callable[[], Any], calls: int = 200) -> float:
    """Seconds of host time per call of ``fn``, the device left to run behind (what a call
    costs a host-bound step: the launches and the Python around them)."""
    for _ in range(10):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    _sync()
    return host


def _device_operations_per_call(fn: Callable[[], Any], calls: int = 10) -> float:
    """Kernels and copies run on the GPU per call of ``fn`` (``torch.profiler``); NaN on the
    CPU."""
    if not Setup.cuda():
        return math.nan
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync()
    on_device = torch.autograd.DeviceType.CUDA
    return sum(1 for event in prof.events() if event.device_type == on_device) / calls


def call_rows() -> dict[str, Any]:
    """One output's state as the monitor takes it in a logging step (its collector, eight
    outputs at a time, their rows merged together as the monitor merges them), and as
    ``feature_stats`` takes it (``tensor_state``, the rows merged in the graph): host time and
    device operations per output, on outputs of the ResNet-18's first and last stages."""
    rows: dict[str, Any] = {}
    batch = Setup.batch
    width = Setup.widths["resnet-18"]
    shapes = [(batch, width, IMAGE, IMAGE), (batch, 8 * width, IMAGE // 8, IMAGE // 8)]
    several = 8
    collector = Collector(1, 2**12, torch.device(Setup.device))

    def collect(x: Tensor) -> None:
        for _ in range(several):
            collector.add(0, x, sample=False)
        collector.states()
        collector.clear()

    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            x = torch.randn(shape, device=Setup.device).to(dtype)
            name = f"{str(dtype).removeprefix('torch.')}, {'x'.join(map(str, shape))}"
            with torch.no_grad():
                for how, fn, per in (
                    ("monitor", lambda x=x: collect(x), several),
                    ("tensor_state", lambda x=x: engine.tensor_state(x), 1),
                ):
                    host = _host_per_call(fn, calls=200 // per)
                    operations = _device_operations_per_call(fn)
                    rows[f"{name}, {how}"] = {
                        "host per output (µs)": host / per * 1e6,
                        "device operations per output": operations / per,
                    }
    return rows


class _StateOfRows(nn.Module):
    """The state of the rows of a 2-d tensor, as the monitor takes a large output's on a GPU
    (``rows_state``, masked): a module, for ``torch.export``."""

    def forward(self, x: Tensor) -> Tensor:
        return rows_state(x, False)


def _ahead_of_time(example: Tensor, folder: str) -> tuple[Callable[[Tensor], Tensor], float]:
    """``rows_state`` (masked) exported with symbolic sizes and compiled ahead of time by
    AOTInductor into a package in ``folder``, loaded: its runner, and the seconds it took."""
    start = time.perf_counter()
    dynamic = torch.export.Dim.DYNAMIC
    exported = torch.export.export(
        _StateOfRows(), (example,), dynamic_shapes={"x": {0: dynamic, 1: dynamic}}
    )
    name = f"state-{example.device.type}-{str(example.dtype).removeprefix('torch.')}.pt2"
    path = torch._inductor.aoti_compile_and_package(
        exported, package_path=os.path.join(folder, name)
    )
    runner = torch._inductor.aoti_load_package(path)
    return runner, time.perf_counter() - start


def _all_states(xs: list[Tensor]) -> Tensor:
    """The states of the rows of each 2-d tensor of ``xs`` (``rows_state``, masked), one tensor
    after another: every output of a step in one call of one graph."""
    return torch.cat([rows_state(x, False) for x in xs])


def step_output_shapes() -> list[tuple[int, ...]]:
    """The shapes of the convolution outputs of one step of the benchmark's ResNet-18: per
    stage, the stem or the stage's shortcut and the four convolutions of its two blocks (20 in
    all); on the CPU (toy sizes), one per stage (a shorter compile)."""
    width, side = Setup.widths["resnet-18"], IMAGE
    per_stage = 5 if Setup.cuda() else 1
    return [
        (Setup.batch, width * 2**stage, side >> stage, side >> stage)
        for stage in range(4)
        for _ in range(per_stage)
    ]


def batched_rows() -> dict[str, Any]:
    """The states of every convolution output of a ResNet-18 step (each as :data:`BLOCK_ROWS`
    rows, masked, as the monitor takes a large output on a GPU), for information: one
    ``torch.compile`` call per output, as the monitor calls the engine in its hooks, against one
    call of one graph for them all (``_all_states``). Host time and device operations per
    output (the device left to run behind), the seconds of each first call (its compile), and
    the largest relative difference of the two results."""
    each = torch.compile(rows_state, dynamic=True)
    together = torch.compile(_all_states, dynamic=True)
    with torch.no_grad():
        xs = [
            torch.randn(shape, device=Setup.device).reshape(engine.BLOCK_ROWS, -1)
            for shape in step_output_shapes()
        ]
        ways: dict[str, Callable[[], Tensor]] = {
            "a torch.compile call per output": lambda: torch.cat([each(x, False) for x in xs]),
            "one torch.compile call for all": lambda: together(xs),
        }
        found: dict[str, Tensor] = {}
        seconds: dict[str, float] = {}
        for label, fn in ways.items():
            start = time.perf_counter()
            found[label] = fn()
            _sync()
            seconds[label] = time.perf_counter() - start
        first, second = found.values()
        difference = ((second - first).abs() / first.abs().clamp(min=1e-30)).max().item()
        n = len(xs)
        return {
            f"float32, {n} outputs, {label}": {
                "host per output (µs)": _host_per_call(fn, calls=50) / n * 1e6,
                "device operations per output": _device_operations_per_call(fn) / n,
                "first call (s)": seconds[label],
                "largest relative difference": difference,
            }
            for label, fn in ways.items()
        }


def aot_rows() -> dict[str, Any]:
    """The same graph called two ways, for information: the state of a large output's rows
    (``BLOCK_ROWS`` rows, masked, as on a GPU) compiled by ``torch.compile`` (the engine's way:
    dynamo's guard and the Python wrappers around the kernels at every call) and ahead of time
    by AOTInductor (``torch.export``, then a package whose C++ runner launches the kernels):
    host time and device operations per call, and the largest relative difference of the two
    results."""
    rows: dict[str, Any] = {}
    batch = Setup.batch
    width = Setup.widths["resnet-18"]
    shapes = [(batch, width, IMAGE, IMAGE), (batch, 8 * width, IMAGE // 8, IMAGE // 8)]
    compiled = torch.compile(rows_state, dynamic=True)
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        for dtype in (torch.float32,):  # one compile: a minute's work on the GPU machine
            name = str(dtype).removeprefix("torch.")
            example = torch.randn(2 * engine.BLOCK_ROWS, 256, device=Setup.device).to(dtype)
            try:
                runner, seconds = _ahead_of_time(example, folder)
            except Exception as err:  # the comparison is for information: say why, go on
                reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
                rows[f"{name}, AOTInductor"] = {"failed": reason}
                _stamp(f"AOTInductor, {name}: {reason}")
                continue
            for shape in shapes:
                x = torch.randn(shape, device=Setup.device).to(dtype)
                x = x.reshape(engine.BLOCK_ROWS, -1)
                found, expected = runner(x), compiled(x, False)
                scale = expected.abs().clamp(min=1e-30)
                difference = ((found - expected).abs() / scale).max().item()
                for how, fn in (
                    ("torch.compile", lambda x=x: compiled(x, False)),
                    ("AOTInductor", lambda x=x, runner=runner: runner(x)),
                ):
                    rows[f"{name}, {'x'.join(map(str, shape))}, {how}"] = {
                        "host per call (µs)": _host_per_call(fn) * 1e6,
                        "device operations per call": _device_operations_per_call(fn),
                        "compile (s)": seconds if how == "AOTInductor" else math.nan,
                        "largest relative difference": difference,
                    }
    return rows


# ---------------------------------------------------------------------------- report
def _cell(value: float) -> str:
    return (
        "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"
    )


def timing_table(results: dict[str, Any]) -> str:
    lines = [
        "| model | precision | configuration | non-logging step | logging step "
        "| amortised (free-running) | amortised (synchronised) |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for model, by_precision in results.items():
        for name, result in by_precision.items():
            ms = result["ms"]["plain"]
            cells = " | ".join(f"{ms[k]:.2f}" for k in KEYS)
            lines.append(f"| {model} | {name} | plain (ms) | {cells} |")
            for config, ratio in result["ratios"].items():
                shown = []
                for k in KEYS:
                    if k not in ratio:
                        shown.append("—")
                        continue
                    spread = ratio.get(k + "_range")
                    extra = f" ({spread[0]:.3f}–{spread[1]:.3f})" if spread else ""
                    shown.append(_cell(ratio[k]) + extra)
                lines.append(f"| {model} | {name} | {config} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def sync_table(counted: dict[str, Any]) -> str:
    lines = ["| model | precision | configuration | measure | value |", "|---|---|---|---|---|"]
    for model, by_precision in counted.items():
        for name, rows in by_precision.items():
            for config, measures in rows.items():
                if not isinstance(measures, dict):
                    lines.append(f"| {model} | {name} | | {config} | {measures:,.0f} |")
                    continue
                for measure_name, values in measures.items():
                    if isinstance(values, list):
                        shown = ", ".join(map(str, values)) or "—"
                    else:
                        shown = str(values)
                    lines.append(f"| {model} | {name} | {config} | {measure_name} | {shown} |")
    return "\n".join(lines)


def _keyed_table(
    label: str,
    keys: Sequence[str],
    rows: dict[str, Any],
    cell: Callable[[str, dict[str, Any]], str] = lambda key, row: _cell(row[key]),
) -> str:
    """A table of one row per entry of ``rows`` (its name, then ``cell`` of each key)."""
    lines = [f"| {label} | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join(cell(key, row) for key in keys) + " |")
    return "\n".join(lines)


def engine_table(rows: dict[str, Any]) -> str:
    keys = (
        "read (ms)",
        "state, compiled (ms)",
        "state, eager (ms)",
        "compiled / read",
        "eager / read",
    )
    return _keyed_table("tensor", keys, rows, lambda key, row: f"{row[key]:.3f}")


def call_table(rows: dict[str, Any]) -> str:
    return _keyed_table("output", ("host per output (µs)", "device operations per output"), rows)


def _comparison_table(label: str, keys: Sequence[str], rows: dict[str, Any]) -> str:
    """A table of the ways of calling one graph: a failed row shows its reason in the first
    column, a relative difference in scientific notation."""

    def cell(key: str, row: dict[str, Any]) -> str:
        if "failed" in row:  # the reason in the first column, the others empty
            return f"failed: {row['failed']}" if key == keys[0] else ""
        return f"{row[key]:.2e}" if key.startswith("largest") else _cell(row[key])

    return _keyed_table(label, keys, rows, cell)


def aot_table(rows: dict[str, Any]) -> str:
    keys = (
        "host per call (µs)",
        "device operations per call",
        "compile (s)",
        "largest relative difference",
    )
    return _comparison_table("call", keys, rows)


def batched_table(rows: dict[str, Any]) -> str:
    keys = (
        "host per output (µs)",
        "device operations per output",
        "first call (s)",
        "largest relative difference",
    )
    return _comparison_table("calls", keys, rows)


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of the GPU rows, one line per row and precision: measured value, target,
    met or not (``None`` where the run did not measure it)."""
    lines: list[dict[str, Any]] = []
    timing = results.get("timing", {}).get("resnet-18", {})
    counted = results.get("syncs", {}).get("resnet-18", {})
    for name in PRECISIONS:
        ratios = timing.get(name, {}).get("ratios", {})
        monitor = ratios.get("monitor", {})
        floor = ratios.get("callback", {})
        versus = ratios.get("monitor vs callback", {})

        def add(
            row: str, value: Any, target: str, met: bool | None, note: str = "", name: str = name
        ) -> None:
            lines.append(
                {
                    "row": row,
                    "precision": name,
                    "value": value,
                    "target": target,
                    "met": met,
                    "note": note,
                }
            )

        value = monitor.get("logging")
        add(
            "logging step / plain step",
            value,
            "<= 1.2",
            None if value is None or not Setup.cuda() else value <= TARGETS["logging"],
        )
        value = monitor.get("amortised")
        add(
            f"amortised at every {Setup.every} steps / plain",
            value,
            "<= 1.02",
            None if value is None or not Setup.cuda() else value <= TARGETS["amortised"],
        )
        value = versus.get("non_logging")
        spread = floor.get("non_logging_range")
        add(
            "non-logging step / a callback that does nothing",
            value,
            "indistinguishable (within the callback's own spread)",
            None,
            f"callback / plain over repeats: {spread[0]:.3f}–{spread[1]:.3f}" if spread else "",
        )
        rows = counted.get(name, {})
        mon = rows.get("monitor", {})
        quiet = mon.get("syncs added in step, non-logging steps")
        counted_here = Setup.cuda() and quiet is not None
        add("host syncs, non-logging step", quiet, "0", quiet == [0] if counted_here else None)
        loud = mon.get("syncs added in step, logging steps")
        add("host syncs, logging step", loud, "1", loud == [1] if counted_here else None)
        budget = rows.get("memory budget (bytes)")
        for config in ("monitor", "monitor, parameters=False"):
            added = rows.get(config, {}).get("peak memory added (bytes), logging steps")
            worst = max(added) if added else None
            add(
                f"peak memory of a logging step above plain ({config})",
                worst,
                f"<= largest output / 10 = {budget:,.0f} bytes" if budget else "<= largest / 10",
                worst <= budget if Setup.cuda() and worst is not None and budget else None,
                f"parameter copies: {rows.get('parameter copies (bytes)', 0):,} bytes"
                if config == "monitor"
                else "",
            )
    return lines


def summary_table(lines: list[dict[str, Any]]) -> str:
    out = ["| row | precision | measured | target | met |", "|---|---|---|---|---|"]
    for line in lines:
        value = line["value"]
        shown = (
            f"{value:.3f}"
            if isinstance(value, float)
            else f"{value:,}"
            if isinstance(value, int)
            else str(value)
        )
        met = {True: "yes", False: "NO", None: "—"}[line["met"]]
        note = f" ({line['note']})" if line["note"] else ""
        out.append(
            f"| {line['row']} | {line['precision']} | {shown}{note} | {line['target']} | {met} |"
        )
    return "\n".join(out)


class _Profile(pl.Callback):
    """Profiles one step (host and CUDA) and prints the operators that took longest."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.profiler: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            from torch.profiler import ProfilerActivity, profile

            _sync()
            activities = [ProfilerActivity.CPU]
            if Setup.cuda():
                activities.append(ProfilerActivity.CUDA)
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.profiler is not None:
            _sync()
            self.profiler.__exit__(None, None, None)
            events = self.profiler.key_averages()
            keys = (
                ("self_cuda_time_total", "self_cpu_time_total")
                if Setup.cuda()
                else ("self_cpu_time_total",)
            )
            for key in keys:
                print(f"\nstep {self.step}, by {key}:")
                print(events.table(sort_by=key, row_limit=25, max_name_column_width=60))
            self.profiler = None


def profile_logging_step(model: str, precision: str) -> None:
    """Profile a logging step of the monitor, and the plain step before it."""
    step = 2 * Setup.every - 1
    for config in ("plain", "monitor"):
        module, callbacks = _setup(config, model)
        print(f"\n=== profile: {model} / {config} ({precision}), step {step}")
        _fit(module, [*callbacks, _Profile(step)], step + 1, precision)


def _versions() -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if Setup.cuda() else "cpu (a smoke run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": pl.__version__,
        "python": sys.version.split()[0],
        "LIGHTNING_RECORDER_COMPILE": os.environ.get("LIGHTNING_RECORDER_COMPILE", "(unset)"),
        # what lightning_recorder.TensorBoardLogger checksums its records with
        "checksum": "google-crc32c" if c_checksum() is not None else "pure Python",
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--budget", type=float, help="seconds for the timing repeats (no repeat starts past it)"
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: every part at toy sizes, to check the script",
    )
    parser.add_argument("--json", help="write every figure to this file (after each part)")
    parser.add_argument("--stacks", action="store_true", help="print the added syncs' stacks")
    parser.add_argument("--syncs-only", action="store_true", help="syncs and memory only")
    parser.add_argument(
        "--all", action="store_true", help="also the small CNN and the distillation configurations"
    )
    parser.add_argument("--eager", action="store_true", help="the eager engine (no compiling)")
    parser.add_argument(
        "--package-logger",
        action="store_true",
        help="also time the monitor writing through lightning_recorder.TensorBoardLogger",
    )
    parser.add_argument(
        "--aot",
        action="store_true",
        help="only compare a torch.compile call of the state with an AOTInductor one",
    )
    parser.add_argument(
        "--profile",
        choices=tuple(MODELS),
        help="profile a logging step of the monitor on this model",
    )
    args = parser.parse_args(argv)
    if args.device == "cpu":
        Setup.cpu()
    elif not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA device available; nothing measured "
            "(--device cpu checks the script on the CPU)."
        )
        return {}
    if args.eager:
        os.environ["LIGHTNING_RECORDER_COMPILE"] = "0"
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    info = _versions()
    info.update(
        batch=Setup.batch,
        every=Setup.every,
        widths=Setup.widths,
        phases={"warm-up": Setup.warmup, "synchronised": Setup.synced, "free": Setup.free},
    )
    _stamp(
        f"device: {info['device']}; torch {info['torch']} (CUDA {info['cuda']}), triton "
        f"{info['triton']}, lightning {info['lightning']}, Python {info['python']}; the "
        f"package's TensorBoardLogger checksums in {info['checksum']}"
    )
    if args.aot:
        _stamp("every output of a step: a call each, or one call for all ...")
        batched = batched_rows()
        print(
            "\nThe states of every convolution output of a ResNet-18 step, a torch.compile call "
            "per output (as the monitor's hooks call the engine) or one call of one graph for "
            "all (for information): host time and the device's operations per output:\n"
        )
        print(batched_table(batched), flush=True)  # kept in the log if the rest runs too long
        _stamp("the state's graph called two ways ...")
        found = {"info": info, "batched": batched, "aot": aot_rows()}
        print(
            "\nThe state of a large output's rows, the same graph compiled by torch.compile "
            "and ahead of time by AOTInductor (for information): host time per call (the "
            "device left to run behind), the device's operations per call:\n"
        )
        print(aot_table(found["aot"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(found, f, indent=1, default=str)
        return found
    info["compile_status_before"] = engine.compile_status()
    start = time.perf_counter()
    engine.warm_up(Setup.device, [torch.float32, torch.bfloat16], wait=True)
    info["warm_up_seconds"] = time.perf_counter() - start
    info["compile_status"] = engine.compile_status()
    _stamp(
        f"engine warm-up: {info['warm_up_seconds']:.1f} s; compile_status(): "
        f"{info['compile_status']}"
    )
    if args.profile:
        for precision in PRECISIONS.values():
            profile_logging_step(args.profile, precision)
        return {}
    models = list(MODELS) if args.all else ["resnet-18"]
    results: dict[str, Any] = {"info": info}

    def save(timing: dict[str, Any] | None = None) -> None:
        if timing is not None:
            results["timing"] = timing
        results["summary"] = summary(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)

    results["engine"] = engine_rows()
    print(
        "\nThe engine alone: the packed state of one tensor against one read of it "
        "(medians of 20):\n"
    )
    print(engine_table(results["engine"]))
    results["calls"] = call_rows()
    print(
        "\nOne output's state as the monitor takes it (eight at a time) and as "
        "tensor_state takes it: host time per output (the device left to run behind) and the "
        "device's kernels and copies per output:\n"
    )
    print(call_table(results["calls"]))
    save()
    _stamp("syncs and memory ...")
    results["syncs"] = syncs_and_memory(models, SYNC_CONFIGS, args.stacks)
    print(
        f"\nHost synchronisations and peak memory ({Setup.sync_steps} steps, the monitor "
        f"logging every {Setup.sync_every}):\n"
    )
    print(sync_table(results["syncs"]))
    save()
    if not args.syncs_only:
        configs = ["plain", "callback", "monitor"]
        if args.all:
            configs += ["distill", "hand-written"]
        if args.package_logger:
            configs.append(PACKAGE_LOGGER)
        repeats = 1 if args.quick else args.repeats
        info["repeats"] = repeats
        _stamp(f"timing: {repeats} repeat(s) of {', '.join(configs)} ...")
        results["timing"] = measure(models, configs, repeats, save, args.budget)
        first = next(iter(next(iter(results["timing"].values())).values()))
        info["repeats_done"] = len(first["per_repeat"]["plain"])
        print("\nStep-time ratios against the plain model (medians over repeats, range):\n")
        print(timing_table(results["timing"]))
    info["compile_status_after"] = engine.compile_status()
    save()
    print(
        f"\nAgainst the targets (device: {info['device']}; engine: "
        f"{info['compile_status_after']}):\n"
    )
    print(summary_table(results["summary"]))
    _stamp("done")
    return results


if __name__ == "__main__":
    main()
