"""What `HealthMonitor` costs: its every-step check against the plain Trainer and against
``Trainer(detect_anomaly=True)``, side by side in one run; and what a replay costs.

**Models** (those of ``bench_logging.py``): the ResNet-18-like network (11.2 M parameters,
batches of 16 3x32x32 images) and the 64-layer MLP (4.1 M parameters, batches of 128), trained
with SGD and momentum on random data.

**Configurations** (clean steps: nothing is ever non-finite here):

* **plain** — the Trainer alone;
* **callback** — a ``Callback`` that does nothing: what Lightning's hook calls cost any
  callback (the floor of a callback's ratio);
* **HealthMonitor** — ``HealthMonitor()`` with its defaults (``"warn"``, replay on a flagged
  step): the check of the loss and every gradient before every optimizer step;
* **detect_anomaly** — ``Trainer(detect_anomaly=True)``, PyTorch's anomaly mode;
* **always** — ``HealthMonitor(localize="always")``: every module's outputs and gradients
  checked on every step (information: the price of not needing a replay).

**CPU timing** — the house method of ``bench_callbacks.py``: one torch thread; each repeat trains
one model per configuration, each ``fit`` in its own thread, and the threads take turns one step
at a time (a fresh random order each round), so that whatever slows the machine down for a while
falls on every configuration alike; malloc's thresholds are fixed. PyTorch's anomaly mode is a
process-wide switch, so each turn sets it for the configuration whose turn it is. Per repeat:
the median step (warm-up steps excluded) of each configuration over the plain one; the table
gives the median of those ratios over the repeats and their range.

**Replay** — in a separate run (one thread), every other step is replayed at
``on_before_optimizer_step`` exactly as a flagged step would be (forward and backward with every
module and parameter hooked, buffers and random state restored; a clean batch, so the replay
runs to the end of the backward, its longest path); the ratio is the median replay over the
median step without one.

**GPU** (``--device cuda``): the ResNet-18-like model on batches of 128 on the GPU; each
configuration trains in turn (the order rotating over repeats), timed over a window between two
``torch.cuda.synchronize()``; and the host synchronisations of each clean step, counted with
``torch.cuda.set_sync_debug_mode("warn")`` from ``on_train_batch_start`` to
``on_train_batch_end``, against the plain Trainer's.

Run ``python benchmarks/bench_health.py`` (``--quick`` for a smoke run, ``--device cuda`` on a
GPU, ``--json PATH`` to save the figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lightning_recorder import HealthMonitor  # noqa: E402
from lightning_recorder.callbacks._health_replay import capture_rng, replay  # noqa: E402

CONFIGS = ("plain", "callback", "HealthMonitor", "detect_anomaly", "always")
LIMITS = {"HealthMonitor": 1.01, "replay": 1.2, "gpu": 1.03}


def _sibling(name: str) -> Any:
    """Another benchmark module of this folder (importable however this one was loaded)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_callbacks = _sibling("bench_callbacks")
_logging = _sibling("bench_logging")
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "ResNet-18-like": (_logging.resnet18_like, (3, 32, 32), 16),
    "MLP, 64 layers": (_logging.mlp64, (64,), 128),
}


class Net(pl.LightningModule):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.net = body

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _loader(shape: tuple[int, ...], batch: int, steps: int, device: str = "cpu") -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, *shape, generator=g)
    y = torch.randint(0, 10, (steps * batch,), generator=g)
    return DataLoader(TensorDataset(x.to(device), y.to(device)), batch_size=batch)


def _trainer(config: str, steps: int, callbacks: list[pl.Callback], **kw: Any) -> pl.Trainer:
    if config == "callback":
        callbacks.append(pl.Callback())
    elif config == "HealthMonitor":
        callbacks.append(HealthMonitor(evidence_max_bytes=0))
    elif config == "always":
        callbacks.append(HealthMonitor(localize="always", evidence_max_bytes=0))
    elif config.startswith("HealthMonitor("):  # a GPU configuration: its keyword arguments
        callbacks.append(eval(config, {"HealthMonitor": HealthMonitor}))
    return pl.Trainer(
        max_steps=steps,
        callbacks=callbacks,
        detect_anomaly=config == "detect_anomaly",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kw,
    )


# ---------------------------------------------------------------------------- CPU, side by side
class _TurnTimer(_callbacks._StepTimer):  # type: ignore[misc,name-defined]
    """The house step timer; on getting its turn it sets the process-wide anomaly mode."""

    def __init__(self, baton: Any, me: int, anomaly: bool) -> None:
        super().__init__(baton, me)
        self.anomaly = anomaly

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_batch_start(trainer, *args)
        torch.autograd.set_detect_anomaly(self.anomaly)


def _side_by_side(
    model: str, names: Sequence[str], steps: int, seed: int
) -> dict[str, list[float]]:
    make, shape, batch = MODELS[model]
    baton = _callbacks._Baton(len(names), seed=seed)
    timers, fits = {}, []
    for k, name in enumerate(names):
        pl.seed_everything(0, verbose=False)
        timers[name] = _TurnTimer(baton, k, anomaly=name == "detect_anomaly")
        trainer = _trainer(name, steps, [timers[name]], accelerator="cpu")
        net, loader = Net(make()), _loader(shape, batch, steps)
        fits.append(lambda t=trainer, n=net, d=loader: t.fit(n, d))
    _callbacks.run_in_turns(fits, baton)
    torch.autograd.set_detect_anomaly(False)
    return {name: timer.wall for name, timer in timers.items()}


def measure_cpu(repeats: int, steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    pinned = _callbacks.pin_malloc()
    out: dict[str, Any] = {"malloc_pinned": pinned, "models": {}}
    for model in MODELS:
        ms: dict[str, list[float]] = {c: [] for c in CONFIGS}
        ratios: dict[str, list[float]] = {c: [] for c in CONFIGS if c != "plain"}
        model_steps = max(warmup + 2, steps // 4) if model.startswith("ResNet") else steps
        _side_by_side(model, CONFIGS, warmup + 2, seed=99)  # warm up
        for r in range(repeats):
            order = _callbacks.turn_order(CONFIGS, r)
            walls = _side_by_side(model, order, model_steps, seed=r)
            med = {c: statistics.median(walls[c][warmup:]) for c in CONFIGS}
            for c in CONFIGS:
                ms[c].append(1e3 * med[c])
                if c != "plain":
                    ratios[c].append(med[c] / med["plain"])
            print(f"  {model}: repeat {r + 1}/{repeats}", flush=True)
        out["models"][model] = {
            "steps_timed": model_steps - warmup,
            "ms": {c: statistics.median(v) for c, v in ms.items()},
            "ratio": {c: statistics.median(v) for c, v in ratios.items()},
            "range": {c: (min(v), max(v)) for c, v in ratios.items()},
        }
    return out


# ---------------------------------------------------------------------------- replay
class _Replayer(pl.Callback):
    """Replays every other step (after warm-up) as a flagged step would be; times steps and
    replays."""

    def __init__(self, warmup: int, device: str) -> None:
        self.warmup, self.device = warmup, device
        self.steps: list[float] = []
        self.replays: list[float] = []
        self._start = 0.0
        self._replayed = False
        self._micro: Any = None

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        self._sync()
        now = time.perf_counter()
        if trainer.global_step > self.warmup and not self._replayed:
            self.steps.append(now - self._start)
        self._start, self._replayed = now, False
        self._micro = capture_rng(pl_module, batch, i)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        if trainer.global_step >= self.warmup and trainer.global_step % 2:
            self._sync()
            start = time.perf_counter()
            finding, _ = replay(trainer, pl_module, [self._micro], summarize=False)
            self._sync()
            self.replays.append(time.perf_counter() - start)
            self._replayed = True
            assert not finding.reproduced and finding.error is None, finding


def measure_replay(steps: int, warmup: int, device: str = "cpu") -> dict[str, Any]:
    out = {}
    for model, (make, shape, batch) in MODELS.items():
        if device == "cuda":
            batch = 128
        elif model.startswith("ResNet"):
            steps = max(warmup + 6, steps // 4)
        pl.seed_everything(0, verbose=False)
        timer = _Replayer(warmup, device)
        accelerator = "gpu" if device == "cuda" else "cpu"
        _trainer("plain", steps, [timer], accelerator=accelerator).fit(
            Net(make()), _loader(shape, batch, steps, device)
        )
        step, rep = statistics.median(timer.steps), statistics.median(timer.replays)
        out[model] = {"step_ms": 1e3 * step, "replay_ms": 1e3 * rep, "ratio": rep / step}
    return out


# ---------------------------------------------------------------------------- GPU
GPU_CONFIGS = (
    "plain",
    "HealthMonitor(localize=False)",
    "HealthMonitor()",
    "HealthMonitor('skip')",
    "detect_anomaly",
)


class _Window(pl.Callback):
    def __init__(self, start: int) -> None:
        self.start, self.stamps = start, []  # type: ignore[var-annotated]

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.start:
            torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())


class _Syncs(pl.Callback):
    """Synchronising CUDA calls from the first ``on_train_batch_start`` to the last
    ``on_train_batch_end`` of each step (put it first and last in the callback list)."""

    def __init__(self) -> None:
        self.per_step: list[list[str]] = []
        self._stacks: list[str] | None = None
        self._catcher: Any = None

    def begin(self) -> None:
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        self._stacks = []
        torch.cuda.set_sync_debug_mode("warn")

    def _show(self, message: Any, *args: Any, **kwargs: Any) -> None:
        if self._stacks is not None and "synchroniz" in str(message):
            self._stacks.append("".join(traceback.format_stack()[-12:-2]))

    def end(self) -> None:
        if self._stacks is None:
            return
        torch.cuda.set_sync_debug_mode(0)
        self._catcher.__exit__(None, None, None)
        self.per_step.append(self._stacks)
        self._stacks = None


class _Begin(pl.Callback):
    def __init__(self, syncs: _Syncs) -> None:
        self.syncs = syncs

    def on_train_batch_start(self, *args: Any) -> None:
        self.syncs.begin()


class _End(pl.Callback):
    def __init__(self, syncs: _Syncs) -> None:
        self.syncs = syncs

    def on_train_batch_end(self, *args: Any) -> None:
        self.syncs.end()

    def on_train_end(self, *args: Any) -> None:
        self.syncs.end()


def measure_gpu(repeats: int, steps: int, warmup: int) -> dict[str, Any]:
    make, shape, batch = _logging.resnet18_like, (3, 32, 32), 128
    times: dict[str, list[float]] = {c: [] for c in GPU_CONFIGS}
    for r in range(repeats):
        for config in _callbacks.turn_order(GPU_CONFIGS, r):
            pl.seed_everything(0, verbose=False)
            window = _Window(warmup)
            _trainer(config, steps, [window], accelerator="gpu", devices=1).fit(
                Net(make()), _loader(shape, batch, steps, "cuda")
            )
            times[config].append((window.stamps[-1] - window.stamps[0]) / (steps - warmup))
        print(f"  GPU: repeat {r + 1}/{repeats}", flush=True)
    ratios = {
        c: statistics.median(a / b for a, b in zip(times[c], times["plain"], strict=True))
        for c in GPU_CONFIGS[1:]
    }
    syncs: dict[str, float] = {}
    stacks: dict[str, list[str]] = {}
    for config in GPU_CONFIGS:
        counter = _Syncs()
        pl.seed_everything(0, verbose=False)
        trainer = _trainer(config, warmup + 6, [_Begin(counter)], accelerator="gpu", devices=1)
        trainer.callbacks.append(_End(counter))  # after every other callback
        trainer.fit(Net(make()), _loader(shape, batch, warmup + 6, "cuda"))
        counted = counter.per_step[warmup:]
        syncs[config] = statistics.median(len(s) for s in counted)
        stacks[config] = counted[-1]
    added = {c: syncs[c] - syncs["plain"] for c in GPU_CONFIGS[1:]}
    return {
        "device": torch.cuda.get_device_name(),
        "ms": {c: 1e3 * statistics.median(v) for c, v in times.items()},
        "ratio": ratios,
        "syncs_per_clean_step": syncs,
        "syncs_added": added,
        "stacks": stacks,
    }


# ---------------------------------------------------------------------------- report
def cpu_table(result: dict[str, Any]) -> str:
    lines = [
        "| model | configuration | step (ms) | ratio to plain (min–max) | target |",
        "|---|---|---:|---:|---:|",
    ]
    for model, r in result["models"].items():
        lines.append(f"| {model} | plain | {r['ms']['plain']:.1f} | 1 | |")
        for c in CONFIGS[1:]:
            lo, hi = r["range"][c]
            limit = f"<= {LIMITS[c]}" if c in LIMITS else "(information)"
            lines.append(
                f"| {model} | {c} | {r['ms'][c]:.1f} | **{r['ratio'][c]:.3f}** "
                f"({lo:.3f}–{hi:.3f}) | {limit} |"
            )
    return "\n".join(lines)


def replay_table(result: dict[str, Any]) -> str:
    lines = [
        "| model | step (ms) | replay (ms) | replay / step | target |",
        "|---|---:|---:|---:|---:|",
    ]
    for model, r in result.items():
        lines.append(
            f"| {model} | {r['step_ms']:.1f} | {r['replay_ms']:.1f} | **{r['ratio']:.2f}** | "
            f"<= {LIMITS['replay']} |"
        )
    return "\n".join(lines)


def gpu_table(result: dict[str, Any]) -> str:
    lines = [
        f"GPU: {result['device']}",
        "| configuration | step (ms) | ratio to plain | host syncs per clean step (added) |",
        "|---|---:|---:|---:|",
    ]
    for c in GPU_CONFIGS:
        ratio = "1" if c == "plain" else f"**{result['ratio'][c]:.3f}**"
        added = "" if c == "plain" else f" ({result['syncs_added'][c]:+g})"
        lines.append(
            f"| {c} | {result['ms'][c]:.2f} | {ratio} | "
            f"{result['syncs_per_clean_step'][c]:g}{added} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its tables; return the figures."""
    parser = argparse.ArgumentParser(description="HealthMonitor overhead")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="steps per run (MLP; ResNet 1/4)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, short runs")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")
    warnings.filterwarnings("ignore", ".*Anomaly Detection has been enabled.*")
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 12, 2
    result: dict[str, Any] = {"device": args.device}
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("No CUDA device: nothing to measure.")
            return result
        steps = max(args.steps, 60)
        result["gpu"] = measure_gpu(args.repeats, steps, warmup=10)
        result["replay"] = measure_replay(30, 10, "cuda")
        print("\n" + gpu_table(result["gpu"]) + "\n\n" + replay_table(result["replay"]))
    else:
        result["cpu"] = measure_cpu(args.repeats, args.steps, args.warmup)
        result["replay"] = measure_replay(args.steps, args.warmup)
        pinned = "malloc fixed" if result["cpu"]["malloc_pinned"] else "glibc malloc"
        print(
            f"\nHealthMonitor's every-step check vs the plain Trainer and detect_anomaly: medians "
            f"of {args.repeats} repeats, configurations taking turns step by step, one torch "
            f"thread, {pinned}.\n"
        )
        print(cpu_table(result["cpu"]) + "\n\n" + replay_table(result["replay"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
