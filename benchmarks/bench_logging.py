"""What a `FeatureStatsMonitor` logging step costs, against the floor of reading the data once.

Four measures, each side by side in one run (the variants of a measure take turns in a random
order within every repeat; medians over the repeats; the spread is the interquartile range of
the per-repeat ratios):

1. **Kernels** — on float32 tensors of 2**20 and 2**22 elements (Gaussian, and after a ReLU),
   the time of the monitor's statistics (one packed state: the engine eager, compiled by
   ``torch.compile``, and by the CPU kernel, the default), of the statistics with the sampled
   histogram (the monitor's ``Collector``: the state, a strided sample, its bucket counts) in
   units of ``x.sum()``, one read of the data; and a copy.
2. **Parameter statistics** — the parameters of the ResNet-18-like model (11.2 M): a clone
   before the step and a fresh difference after it, against persistent buffers filled by
   ``_foreach_copy_`` and an in-place ``_foreach_sub_`` (the monitor), in units of one
   ``_foreach_norm`` of the parameters (one read).
3. **Per-layer fixed cost** — 64 outputs of 64 elements (the data costs nothing): CPU time of
   the hook's work plus the logging step's merge, histograms and host copy, per layer.
4. **Trainer** — the time of a logging step (``every_n_steps=1``, parameters and histograms on,
   a TensorBoard logger) over that of a plain step, on (a) a small CNN, (b) a ResNet-18-like
   model (basic blocks 64-128-256-512, 32 x 32 inputs) with every module monitored, (c) a
   64-layer MLP (width 256) with every module monitored; the monitor with statistics in the
   hook (default) and with kept records (``exact_histograms``, ``clone=True``), both writing
   through ``lightning_recorder.TensorBoardLogger`` (C checksums with the ``fast-tensorboard``
   extra); for information, the default with the TensorBoard event neither built nor written
   (the package's own work) and with Lightning's ``TensorBoardLogger`` (TensorBoard's
   pure-Python checksum of every record); and the floor, a callback that only reads each
   monitored output once and copies and compares the parameters (:class:`FloorReads`). The
   configurations of a model train in threads that take turns one step at a time
   (:func:`side_by_side`).

Run ``python benchmarks/bench_logging.py`` (``--quick`` for a smoke run). One CPU thread.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from functools import cache, partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn

from lightning_recorder import FeatureStatsMonitor
from lightning_recorder import TensorBoardLogger as RecorderTensorBoardLogger
from lightning_recorder._core.compat import foreach_copy_, foreach_norm, foreach_sub, foreach_sub_
from lightning_recorder.stats._collect import Collector
from lightning_recorder.stats._engine import (
    compile_status,
    compiled_only,
    eager_only,
    tensor_state,
    warm_up,
)

# --------------------------------------------------------------------------- timing


def interleaved(
    variants: dict[str, Callable[[], Any]], repeats: int, inner: int = 1, clock: Any = None
) -> dict[str, list[float]]:
    """Seconds per call of each variant, per repeat; the variants take turns in random order."""
    clock = clock or time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up
    order = list(variants)
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            fn = variants[name]
            start = clock()
            for _ in range(inner):
                fn()
            times[name].append((clock() - start) / inner)
    return times


def ratio(times: dict[str, list[float]], name: str, floor: str) -> tuple[float, float, float]:
    """Median and quartiles of the per-repeat ratio ``name / floor``."""
    ratios = sorted(a / b for a, b in zip(times[name], times[floor], strict=True))
    # "inclusive": quartiles within the ratios measured (the default extrapolates beyond them
    # for few repeats: a spread below zero with --quick)
    q = (
        statistics.quantiles(ratios, n=4, method="inclusive")
        if len(ratios) > 1
        else [ratios[0]] * 3
    )
    return q[1], q[0], q[2]


def fmt(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"


# --------------------------------------------------------------------------- 1. kernels


def kernel_row(x: Tensor, kind: str, repeats: int) -> str:
    """One row of the kernel table: ratios to one read (``x.sum()``)."""
    cpu = torch.device("cpu")
    collector = Collector(1, FeatureStatsMonitor.histogram_sample, cpu)

    def with_histogram() -> Any:  # the monitor's path: the state, a sample, its histogram
        collector.clear()
        collector.add(0, x)
        states = collector.states()
        return collector.table(states, states, 30)

    def eager() -> Any:
        with eager_only():
            return tensor_state(x)

    def compiled() -> Any:
        with compiled_only():
            return tensor_state(x)

    variants = {
        "floor": lambda: x.sum(),
        "eager": eager,
        "compiled": compiled,
        "kernel": lambda: tensor_state(x),  # the default on the CPU: the CPU kernel
        "histogram": with_histogram,
        "copy": lambda: x.clone(),
    }
    t = interleaved(variants, repeats, inner=3)
    floor_us = statistics.median(t["floor"]) * 1e6
    names = ("eager", "compiled", "kernel", "histogram", "copy")
    cells = [fmt(ratio(t, k, "floor")) for k in names]
    size = x.numel().bit_length() - 1
    return f"| 2**{size} {kind} (one read: {floor_us:.0f} µs) | " + " | ".join(cells) + " |"


def kernels(repeats: int, sizes: Sequence[int]) -> list[str]:
    warm_up("cpu", [torch.float32], wait=True)
    warm_up("cpu", [torch.float32], wait=True, native=False)  # the compiled graphs too
    lines = [
        f"(engine: {compile_status()})",
        "",
        "| tensor | statistics, eager | statistics, compiled | statistics, CPU kernel "
        "(default) | + sampled histogram | copy |",
        "|---|---|---|---|---|---|",
    ]
    for n in sizes:
        for kind in ("gaussian", "relu"):
            x = torch.randn(n, generator=torch.Generator().manual_seed(0))
            lines.append(kernel_row(x.relu() if kind == "relu" else x, kind, repeats))
    return lines


# --------------------------------------------------------------------------- models


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.down(x))


def resnet18_like() -> nn.Module:
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 3, 1, 1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
    ]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]
    return nn.Sequential(*layers)


def mlp64() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(64, 256)]
    for _ in range(62):
        layers += [nn.ReLU(), nn.Linear(256, 256)]
    layers += [nn.ReLU(), nn.Linear(256, 10)]
    return nn.Sequential(*layers)


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "(a) CNN (digits-sized)": (cnn, (1, 8, 8), 128),
    "(b) ResNet-18-like, every module": (resnet18_like, (3, 32, 32), 16),
    "(c) MLP, 64 layers, every module": (mlp64, (64,), 128),
}


class Net(pl.LightningModule):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.net = body

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _sibling(name: str) -> Any:
    """Another benchmark module of this folder (importable however this one was loaded)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _turns() -> Any:
    """``bench_callbacks`` of this folder, loaded once (its baton, its turn runner, its event
    flush and its checksum-warning pattern; nothing here changes it)."""
    return _sibling("bench_callbacks")


class NoEventMonitor(FeatureStatsMonitor):
    """The monitor without writing anything: its own work, without building and writing the
    TensorBoard event (for information)."""

    def _write(self, *args: Any) -> None:
        return None


class TurnTimer(pl.Callback):
    """Step times (batch start to the next batch start), on the wall clock and on the training
    thread's CPU clock, while the configurations take turns one step at a time (the baton of
    ``bench_callbacks``): the time spent waiting for the turn is not counted. A step ends when
    the logger's writer thread has written its event, before the clock stops and the turn
    passes (in a single run that work competes with the next step; here it must not fall on
    another configuration's step; until 09362ce the wait came when the turn came back, after
    the writer thread had run during other configurations' steps)."""

    def __init__(self, baton: Any, me: int, write_events: Callable[[pl.Trainer], None]) -> None:
        self.baton, self.me = baton, me
        self.write_events = write_events  # bench_callbacks.write_events
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._start: tuple[float, float] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._start is not None:  # the step ending logged: its events written in its time
            self.write_events(trainer)
        now = (time.perf_counter(), time.thread_time())
        if self._start is not None:
            self.times.append(now[0] - self._start[0])
            self.cpu.append(now[1] - self._start[1])
            self.baton.pass_on(self.me)
        else:
            self.baton.ready.wait()
        self.baton.wait(self.me)
        self._start = (time.perf_counter(), time.thread_time())


class FloorReads(pl.Callback):
    """The floor of a logging step: each monitored output read once (``x.sum()`` in a forward
    hook), each parameter copied before the optimizer step while its gradient is read once, and
    read once more with its copy after the step (foreach copy and norms, the difference in
    place) -- the data an update ratio and the statistics must touch, and nothing else."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.handles: list[Any] = []
        self.buffers: list[Tensor] = []
        self.params: list[Tensor] = []
        self.sink: list[Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params = [p.detach() for m in self.modules for p in m.parameters(recurse=False)]
        self.buffers = [torch.empty_like(p) for p in self.params]
        for module in self.modules:
            self.handles.append(module.register_forward_hook(self._read))

    def _read(self, module: nn.Module, args: Any, out: Tensor) -> None:
        self.sink.append(out.detach().sum())

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        grads = [p.grad for m in self.modules for p in m.parameters(recurse=False)]
        foreach_copy_(self.buffers, self.params)
        self.sink.extend(foreach_norm([g for g in grads if g is not None]))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.sink.extend(foreach_norm(self.params))
        foreach_sub_(self.buffers, self.params)
        self.sink.extend(foreach_norm(self.buffers))
        self.sink.clear()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self.handles:
            handle.remove()


def model_data(model_name: str, steps: int) -> tuple[nn.Module, Any, int]:
    """The body of ``MODELS[model_name]``, made-up data for ``steps + 1`` of its batches (from
    seed 0: the same in every configuration and run) and its batch size."""
    build, shape, batch = MODELS[model_name]
    torch.manual_seed(0)
    body = build()
    data = torch.utils.data.TensorDataset(
        torch.randn(batch * (steps + 1), *shape), torch.randint(0, 10, (batch * (steps + 1),))
    )
    return body, data, batch


def job(model_name: str, config: str, steps: int, root: str, timer: pl.Callback) -> Any:
    """The Trainer, model and data of one configuration (every model from the same seed)."""
    body, data, batch = model_data(model_name, steps)
    callbacks: list[pl.Callback] = [timer]
    if config == "floor":
        types = (nn.Conv2d, nn.Linear)
        kinds = [m for m in body.modules() if isinstance(m, types)]
        modules = kinds if model_name.startswith("(a)") else list(body.modules())[1:]
        callbacks.append(FloorReads(modules))
    elif config != "plain":
        sources = "net.*" if not model_name.startswith("(a)") else [nn.Conv2d, nn.Linear]
        kept = config == "records kept"
        kind = NoEventMonitor if config == "no event write" else FeatureStatsMonitor
        callbacks.append(kind(sources, every_n_steps=1, clone=kept, exact_histograms=kept))
    # lightning_recorder's logger (C checksum with the fast-tensorboard extra), but in the
    # configuration that shows what Lightning's own logger (pure-Python checksum) costs
    logger_type = TensorBoardLogger if config == LIGHTNING_LOGGER else RecorderTensorBoardLogger
    trainer = pl.Trainer(
        max_steps=steps + 1,
        accelerator="cpu",
        logger=logger_type(root, name=config.replace(" ", "-").replace("'", "")),
        callbacks=callbacks,
        log_every_n_steps=1,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return trainer, Net(body), torch.utils.data.DataLoader(data, batch_size=batch)


def side_by_side(
    model_name: str, configs: Sequence[str], steps: int, root: str, seed: int
) -> dict[str, tuple[list[float], list[float]]]:
    """One Trainer per configuration, each in its own thread, taking turns step by step (a
    step of each in a fresh random order every round): the slow spells of a shared machine fall
    on every configuration alike. ``(wall, CPU)`` step times of each, warm-up excluded."""
    turns = _turns()
    baton = turns._Baton(len(configs), seed=seed)
    timers = {c: TurnTimer(baton, k, turns.write_events) for k, c in enumerate(configs)}
    jobs = [job(model_name, c, steps, root, timers[c]) for c in configs]
    turns.run_in_turns(
        [partial(trainer.fit, model, loader) for trainer, model, loader in jobs], baton
    )
    return {c: (t.times[2:], t.cpu[2:]) for c, t in timers.items()}


LIGHTNING_LOGGER = "in the hook, Lightning's logger"


def trainer_level(repeats: int, steps: int, models: str = "abc") -> list[str]:
    configs = (
        "plain",
        "in the hook",
        "records kept",
        "no event write",
        LIGHTNING_LOGGER,
        "floor",
    )
    warm_up("cpu", [torch.float32], wait=True)  # the compiled statistics, as after a run's start
    lines = [
        f"(engine: {compile_status()})",
        "",
        "| model | logging step, in the hook (default) | logging step, records kept | "
        "logging step, events not written (information) | logging step with Lightning's "
        "TensorBoardLogger (pure-Python checksum) | training-thread CPU, in the hook | "
        "floor: one read of each output, parameters copied and compared | plain step (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as root:
        for model_name in [m for m in MODELS if m[1] in models]:
            wall: dict[str, list[float]] = {c: [] for c in configs}
            cpu: dict[str, list[float]] = {c: [] for c in configs}
            for repeat in range(repeats):
                found = side_by_side(model_name, configs, steps, root, seed=repeat)
                for config, (times, cpu_times) in found.items():
                    wall[config].append(statistics.median(times))
                    cpu[config].append(statistics.median(cpu_times))
            cells = [fmt(ratio(wall, c, "plain")) for c in configs[1:5]]
            cells.append(fmt(ratio(cpu, "in the hook", "plain")))
            cells.append(fmt(ratio(wall, "floor", "plain")))
            plain = statistics.median(wall["plain"]) * 1e3
            lines.append(f"| {model_name} | " + " | ".join(cells) + f" | {plain:.1f} |")
    return lines


# --------------------------------------------------------------------------- 2., 3.


def parameters(repeats: int) -> list[str]:
    params = [p.detach() for p in resnet18_like().parameters()]
    grads = [torch.randn_like(p) for p in params]
    buffers = [torch.empty_like(p) for p in params]

    def before() -> Any:  # clone, then a fresh difference and three norms
        copies = [p.clone() for p in params]
        change = foreach_sub(params, copies)
        return foreach_norm([*params, *copies, *change])

    def foreach() -> Any:  # persistent buffers, in-place foreach difference
        foreach_copy_(buffers, params)
        norms = foreach_norm([*params, *buffers])
        foreach_sub_(buffers, params)
        return [*norms, *foreach_norm(buffers)]

    def grad_norms() -> Any:  # what the gradients' norms cost apart (one read of them)
        return foreach_norm(grads)

    variants = {
        "floor": lambda: foreach_norm(params),
        "before": before,
        "foreach": foreach,
        "grads": grad_norms,
    }
    t = interleaved(variants, repeats, inner=2)
    count = sum(p.numel() for p in params) / 1e6
    cells = [fmt(ratio(t, k, "floor")) for k in ("before", "foreach")]
    return [
        "| parameters | clone + difference | foreach buffers, in place (the monitor) | "
        "gradients' norms |",
        "|---|---|---|---|",
        f"| ResNet-18-like, {count:.1f} M | " + " | ".join(cells) + f" | "
        f"{fmt(ratio(t, 'grads', 'floor'))} |",
    ]


def per_layer(repeats: int) -> list[str]:
    layers = [torch.randn(8, 8) for _ in range(64)]
    cpu = torch.device("cpu")
    collector = Collector(len(layers), FeatureStatsMonitor.histogram_sample, cpu)

    def in_hook() -> Any:  # the hooks' copies, then the logging step's reductions and host copy
        collector.clear()
        for i, x in enumerate(layers):
            collector.add(i, x)
        states = collector.states()
        table = collector.table(states, states, 30)
        return torch.cat([states.reshape(-1), table.reshape(-1)]).tolist()

    t = interleaved({"hook": in_hook}, repeats, inner=2, clock=time.thread_time)
    us = statistics.median(t["hook"]) * 1e6 / len(layers)
    return [
        "| per monitored layer (CPU µs) | hooks' copies, states, histograms, host copy |",
        "|---|---|",
        f"| 64 outputs of 64 elements | {us:.0f} |",
    ]


def main(argv: Sequence[str] | None = None) -> dict[str, list[str]]:
    parser = argparse.ArgumentParser(description="FeatureStatsMonitor logging-step cost")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--only", default="kernels,parameters,layer,trainer")
    parser.add_argument("--models", default="abc", help="Trainer-level models: a, b and/or c")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per Trainer run")
    args = parser.parse_args(argv)
    # the MLP's event is large, and Lightning's logger's checksum is measured knowingly
    warnings.filterwarnings("ignore", _turns().CHECKSUM_WARNING)
    torch.set_num_threads(1)
    repeats = 2 if args.quick else args.repeats
    parts = args.only.split(",")
    report: dict[str, list[str]] = {}
    if "kernels" in parts:
        report["kernels"] = kernels(repeats, [2**16] if args.quick else [2**20, 2**22])
    if "parameters" in parts:
        report["parameters"] = parameters(repeats)
    if "layer" in parts:
        report["layer"] = per_layer(repeats)
    if "trainer" in parts:
        report["trainer"] = trainer_level(
            max(2, repeats // 3) if not args.quick else 1,
            3 if args.quick else args.steps,
            args.models,
        )
    for name, lines in report.items():
        print(f"\n### {name} (median ratio, interquartile range in brackets)\n")
        print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
