"""`FeatureStatsMonitor` and `FeatureDistillation` on a CUDA GPU: step-time ratios and host
synchronisations, measured side by side in one run.

Two models, written here (no torchvision), train on batches of 128 random 3x32x32 images that
already sit on the GPU (the loader copies nothing):

* **small cnn** — three 3x3 convolutions (32, 32, 64 channels) and a linear head, the network of
  the CPU distillation benchmark, twice as wide;
* **resnet-18** — a CIFAR-style ResNet-18 (3x3 stem, four stages of two basic blocks, 64 to 512
  channels; 20 convolutions and a linear head).

Configurations of the same Trainer (``accelerator="gpu"``, a TensorBoard logger,
``log_every_n_steps=50``):

* **plain** — the model alone, its ``training_step`` returning the cross-entropy;
* **monitor** — with ``FeatureStatsMonitor([Conv2d, Linear], every_n_steps=50)``, parameters and
  histograms included (every convolution and the head);
* **distill** — the same model as the student of ``FeatureDistillation`` from a teacher twice as
  wide (MSE on the stage outputs through automatic 1x1 connectors, KL on the logits);
* **hand-written** — the same distillation written into the LightningModule with
  ``register_forward_hook`` closures and ``self.log`` calls, the comparison of the CPU benchmark;
* **callback** — a ``Callback`` that does nothing (information: what Lightning's hook calls
  cost any callback, and how far apart two runs of the same work land).

**Timing.** Each repeat trains every configuration of a model one after the other (the order
rotates from repeat to repeat) twice: once *synchronised*, a timing callback calling
``torch.cuda.synchronize()`` at every ``on_train_batch_start``, so that a step's wall time is
its host and device work (the medians of non-logging and logging steps come from these runs);
and once *free-running*, synchronised only at the start of the window and at the end of the
run, so that the host runs ahead of the GPU as in a real run (the amortised ratio comes from
these). Steps 50-249 are timed (the monitor logs steps 99, 149, 199 and 249). Ratios against the
plain model are taken per repeat; their medians over repeats are reported.

**Synchronisations.** With ``torch.cuda.set_sync_debug_mode("warn")`` every synchronising CUDA
call warns; each step is counted in two windows: *in the step* (from the first callback's
``on_train_batch_start`` to the last callback's ``on_train_batch_end``: forward, backward,
optimizer and every callback hook) and *after it* (Lightning's logging and the next batch's
fetch). The plain Trainer is counted too; the tables give what each callback adds.

Run ``python benchmarks/bench_gpu.py`` (``--quick`` for a smoke run, ``--json PATH`` to save the
results, ``--stacks`` to print where each added synchronisation comes from). Without a CUDA
device it says so and exits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

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

EVERY = 50
ACCELERATOR, DEVICE = "gpu", "cuda"  # a CPU smoke run of the code paths may change them
BATCH = 128
CLASSES = 10


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
    "small cnn": {
        "build": _small_cnn,
        "width": 32,
        "pairs": {"body.2": "body.2", "body.5": "body.5", "head": "head"},
    },
    "resnet-18": {
        "build": _resnet18,
        "width": 32,
        "pairs": {"body.1": "body.1", "body.2": "body.2", "body.4": "body.4", "head": "head"},
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
            x = torch.zeros(2, 3, 32, 32)
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


def _teacher(model: str) -> nn.Module:
    torch.manual_seed(1)
    return Net(model, 2 * MODELS[model]["width"]).eval().requires_grad_(False)


def _setup(
    config: str, model: str, every: int = EVERY
) -> tuple[pl.LightningModule, list[pl.Callback]]:
    """The LightningModule and callbacks of a configuration (seeded)."""
    width = MODELS[model]["width"]
    torch.manual_seed(0)
    if config == "plain":
        return Plain(model, width), []
    if config == "monitor":
        return Plain(model, width), [
            FeatureStatsMonitor([nn.Conv2d, nn.Linear], every_n_steps=every, parameters=True)
        ]
    if config == "distill":
        pairs = MODELS[model]["pairs"]
        teacher = _teacher(model)
        torch.manual_seed(0)
        return Plain(model, width), [FeatureDistillation(teacher, pairs, loss=_losses(pairs))]
    if config == "callback":
        return Plain(model, width), [_Nothing()]
    if config == "hand-written":
        teacher = _teacher(model)
        torch.manual_seed(0)
        return HandWritten(model, width, teacher), []
    raise ValueError(config)


class _Nothing(pl.Callback):
    """A callback that does nothing."""


CONFIGS = ("plain", "monitor", "distill", "hand-written", "callback")


def _batches(steps: int, pool: int = 16) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    made = [
        (
            torch.randn(BATCH, 3, 32, 32, generator=g).to(DEVICE),
            torch.randint(0, CLASSES, (BATCH,), generator=g).to(DEVICE),
        )
        for _ in range(pool)
    ]
    return [made[i % pool] for i in range(steps)]


def _fit(
    model: pl.LightningModule, callbacks: list[pl.Callback], steps: int, every: int = EVERY
) -> None:
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            accelerator=ACCELERATOR,
            devices=1,
            max_steps=steps,
            callbacks=callbacks,
            logger=TensorBoardLogger(logdir, name="", version=""),
            log_every_n_steps=every,
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
    """Wall-clock stamps at batch starts, after a device synchronisation: every step
    (``each=True``), or only at step ``start`` and at the end of the run."""

    def __init__(self, each: bool, start: int) -> None:
        self.each, self.start = each, start
        self.stamps: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.each or trainer.global_step == self.start:
            torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())


def _timed(config: str, model: str, steps: int, warmup: int, each: bool) -> list[float]:
    module, callbacks = _setup(config, model)
    timer = _Timer(each, warmup)
    _fit(module, [timer, *callbacks], steps)
    if each:
        times = [b - a for a, b in zip(timer.stamps, timer.stamps[1:], strict=False)]
        return times  # one per step
    return [(timer.stamps[-1] - timer.stamps[0]) / (steps - warmup)]


def _is_logging(step: int) -> bool:
    return (step + 1) % EVERY == 0


def measure(
    repeats: int, steps: int, warmup: int, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Time every configuration of every model; ``save`` gets the results after each model."""
    results: dict[str, Any] = {}
    for model in MODELS:
        runs: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
        for r in range(repeats):
            order = list(CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)])
            if r % 2:
                order.reverse()
            for config in order:
                times = _timed(config, model, steps, warmup, each=True)
                window = range(warmup, steps)
                plain_steps = [times[i] for i in window if not _is_logging(i)]
                logging = [times[i] for i in window if _is_logging(i)]
                free = _timed(config, model, steps, warmup, each=False)[0]
                runs[config].append(
                    {
                        "non_logging": statistics.median(plain_steps),
                        "logging": statistics.median(logging) if logging else float("nan"),
                        "amortised_synced": statistics.fmean(times[i] for i in window),
                        "amortised": free,
                    }
                )
            print(f"  {model}: repeat {r + 1}/{repeats} done", flush=True)
        ratios: dict[str, dict[str, float]] = {}
        for config in CONFIGS[1:]:
            ratios[config] = {
                key: statistics.median(
                    run[key] / base[key]
                    for run, base in zip(runs[config], runs["plain"], strict=True)
                )
                for key in ("non_logging", "logging", "amortised_synced", "amortised")
            }
        ratios["distill vs hand-written"] = {
            key: statistics.median(
                a[key] / b[key] for a, b in zip(runs["distill"], runs["hand-written"], strict=True)
            )
            for key in ("non_logging", "amortised")
        }
        results[model] = {
            "ms": {
                c: {k: statistics.median(run[k] for run in runs[c]) * 1e3 for k in runs[c][0]}
                for c in CONFIGS
            },
            "ratios": ratios,
            "per_repeat": runs,
        }
        if save is not None:
            save(results)
    return results


# ---------------------------------------------------------------------------- synchronisations
class _SyncCounter:
    def __init__(self) -> None:
        self.stacks: list[str] | None = None
        self._catcher: Any = None

    def begin(self) -> None:
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        self.stacks = []
        torch.cuda.set_sync_debug_mode("warn")

    def _show(self, message: Any, *args: Any, **kwargs: Any) -> None:
        if self.stacks is not None and "synchroniz" in str(message):
            self.stacks.append("".join(traceback.format_stack()[-14:-2]))

    def end(self) -> list[str]:
        if self.stacks is None:
            return []
        torch.cuda.set_sync_debug_mode(0)
        self._catcher.__exit__(None, None, None)
        stacks, self.stacks = self.stacks, None
        return stacks


class _First(pl.Callback):
    def __init__(self, counter: _SyncCounter, after: list[list[str]]) -> None:
        self.counter, self.after = counter, after

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > 0:
            self.after.append(self.counter.end())
        self.counter.begin()


class _Last(pl.Callback):
    def __init__(self, counter: _SyncCounter, after: list[list[str]]) -> None:
        self.counter, self.after = counter, after
        self.inside: list[list[str]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.inside.append(self.counter.end())
        self.counter.begin()

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.after.append(self.counter.end())


def count_syncs(model: str, config: str, steps: int, every: int) -> dict[str, list[list[str]]]:
    module, callbacks = _setup(config, model, every)
    counter, after = _SyncCounter(), []
    last = _Last(counter, after)
    _fit(module, [_First(counter, after), *callbacks, last], steps, every=every)
    counter.end()
    return {"inside": last.inside, "after": after}


def syncs(steps: int, every: int, stacks: bool) -> dict[str, Any]:
    """Synchronisations per step kind, and those our callbacks add to the plain Trainer's."""
    out: dict[str, Any] = {}
    for model in MODELS:
        configs = ("plain", "monitor", "distill", "hand-written")  # not "callback"
        counted = {c: count_syncs(model, c, steps, every) for c in configs}
        bare = counted["plain"]
        logging = [s for s in range(steps) if (s + 1) % every == 0]
        table: dict[str, Any] = {
            "plain": {
                "in step (every step)": sorted({len(x) for x in bare["inside"]}),
                "after step, Lightning logging steps": sorted(
                    {len(bare["after"][s]) for s in logging}
                ),
                "after step, other steps": sorted(
                    {len(bare["after"][s]) for s in range(steps) if s not in logging}
                ),
            }
        }
        for config in configs[1:]:
            ours = counted[config]
            added = [len(ours["inside"][s]) - len(bare["inside"][s]) for s in range(steps)]
            added_after = [len(ours["after"][s]) - len(bare["after"][s]) for s in range(steps)]
            kinds = {"first step (set-up)": [0]}
            if config == "monitor":  # logging steps: the monitor's and Lightning's
                kinds["non-logging steps"] = [s for s in range(1, steps) if s not in logging]
                kinds["logging steps"] = [s for s in logging if s > 0]
            else:
                kinds["every step"] = list(range(1, steps))
            table[config] = {
                f"added in step, {kind}": sorted({added[s] for s in chosen})
                for kind, chosen in kinds.items()
            }
            table[config]["added after step, Lightning logging steps"] = sorted(
                {added_after[s] for s in logging}
            )
            table[config]["added after step, other steps"] = sorted(
                {added_after[s] for s in range(steps) if s not in logging}
            )
            if stacks:
                for s in range(steps):
                    if added[s] > 0 or added_after[s] > 0:
                        print(
                            f"--- {model} / {config}: step {s}: "
                            f"+{added[s]} in, +{added_after[s]} after"
                        )
                        for where in ("inside", "after"):
                            for stack in ours[where][s]:
                                print(f"[{where}]\n{stack}")
        out[model] = table
    return out


# ---------------------------------------------------------------------------- report
def table(results: dict[str, Any]) -> str:
    lines = [
        "| model | configuration | non-logging step | logging step | amortised (free-running) "
        "| amortised (synchronised) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model, result in results.items():
        ms = result["ms"]["plain"]
        lines.append(
            f"| {model} | plain (ms) | {ms['non_logging']:.3f} | {ms['logging']:.3f} | "
            f"{ms['amortised']:.3f} | {ms['amortised_synced']:.3f} |"
        )
        for config, ratio in result["ratios"].items():
            cells = [
                f"{ratio[k]:.3f}" if k in ratio else "—"
                for k in ("non_logging", "logging", "amortised", "amortised_synced")
            ]
            lines.append(f"| {model} | {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sync_table(counted: dict[str, Any]) -> str:
    lines = ["| model | configuration | measure | syncs per step |", "|---|---|---|---|"]
    for model, rows in counted.items():
        for config, measures in rows.items():
            for measure_name, values in measures.items():
                shown = ", ".join(map(str, values)) or "—"
                lines.append(f"| {model} | {config} | {measure_name} | {shown} |")
    return "\n".join(lines)


class _Profile(pl.Callback):
    """Profiles one step (host and CUDA) and prints the operators that took longest."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.profiler: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.profiler is not None:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            events = self.profiler.key_averages()
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                print(f"\nstep {self.step}, by {key}:")
                print(events.table(sort_by=key, row_limit=14, max_name_column_width=60))
            self.profiler = None


def profile_logging_step(model: str) -> None:
    """Profile a logging step of the monitor, and the plain step before it."""
    for config, step in (("plain", 2 * EVERY - 1), ("monitor", 2 * EVERY - 1)):
        module, callbacks = _setup(config, model)
        print(f"\n=== profile: {model} / {config}, step {step}")
        _fit(module, [*callbacks, _Profile(step)], 2 * EVERY)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--stacks", action="store_true", help="print the added syncs' stacks")
    parser.add_argument("--syncs-only", action="store_true", help="count synchronisations only")
    parser.add_argument("--profile", help="profile a logging step of the monitor on this model")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device available; nothing measured.")
        return {}
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*smaller than the logging interval.*")
    repeats, steps, warmup = (
        (1, 2 * EVERY + 10, EVERY) if args.quick else (args.repeats, 5 * EVERY, EVERY)
    )
    info = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "batch": BATCH,
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
    }
    print(f"device: {info['device']}, torch {info['torch']}, lightning {info['lightning']}")
    if args.profile:
        profile_logging_step(args.profile)
        return {}
    counted = syncs(13, 4, args.stacks)
    print("\nHost synchronisations (monitor logging every 4 steps, 13 steps):\n")
    print(sync_table(counted))
    results: dict[str, Any] = {"info": info, "syncs": counted}

    def save(timing: dict[str, Any] | None = None) -> None:
        if timing is not None:
            results["timing"] = timing
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    save()
    if not args.syncs_only:
        results["timing"] = measure(repeats, steps, warmup, save)
        print("\nStep-time ratios against the plain model (medians over repeats):\n")
        print(table(results["timing"]))
    return results


if __name__ == "__main__":
    main()
