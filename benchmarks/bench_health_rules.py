"""What `HealthMonitor`'s rules and view cost on top of the `FeatureStatsMonitor` they read.

Target (issue "Training health, part two"): the rules and the pictures add **at most 5 %** to
the monitor's logging step, and nothing measurable to the other steps.

**Models.** The CNN of ``examples/tensorboard_stats.py`` on scikit-learn's digits (batches of
128; the monitor on its ``Conv2d``, ``Linear`` and ``ReLU`` modules: 7 series, 4 weight tensors)
and the 64-layer MLP of ``bench_logging.py``, He-initialised (4.1 M parameters, batches of 128 of
random data; the monitor on its ``Linear`` and ``ReLU`` modules: 127 series, 64 weight tensors,
heat maps 127 and 64 rows high), trained with Adam (lr 1e-3: healthy runs, no rule fires; the
rule events of each run are printed), a TensorBoard logger, logging
every ``EVERY`` = 5 steps (the monitor and the Trainer), so that a run has many logged steps and
the heat maps fill up to their 100 columns.

**Configurations**, taking turns step by step (the house method of ``bench_callbacks.py``: one
torch thread, each ``fit`` in its own thread, a fresh random order each round, malloc's
thresholds fixed):

* **monitor** — ``FeatureStatsMonitor`` alone;
* **monitor + check** — and ``HealthMonitor(rules=(), view=False)``: the every-step
  non-finite check, no rule, no picture;
* **monitor + health** — and ``HealthMonitor()``: every rule at its defaults and the view
  (custom scalars, heat maps of ``zero_fraction``, ``std`` and ``grad_norm``, the findings
  table), redrawn every ``view_every`` = 10 logged steps.

Per repeat, over the timed window (steps 100 to 599: 100 logged steps, 10 of them redraws):

* **logging step, amortised** — the mean logged step of *monitor + health* over the mean logged
  step of *monitor* (target <= 1.05), and the same with *monitor + check* as the reference (the
  rules' and the view's own part, without the non-finite check);
* **logging step without a redraw** and **redraw step** — medians of the logged steps that drew
  no picture, and of those that drew the heat maps and the table, over the median logged step of
  *monitor* (information: what a redraw costs when it comes);
* **non-logging step** — the median step that logs nothing of *monitor + health* over that of
  *monitor + check* (the rules' part: keeping each step's loss on its device; "nothing
  measurable": <= 1.01), and of *monitor + check* over *monitor* (information: the non-finite
  check).

The table gives the median of the per-repeat ratios and their range. A last row times one redraw
alone with the heat maps full (100 logged steps): ``HealthView.write``, the heat maps drawn and
the three images and the table written to TensorBoard, median of 20.

Run ``python benchmarks/bench_health_rules.py`` (``make bench-health-rules``; ``--quick`` for a
smoke run, ``--json PATH`` to save the figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
for where in (ROOT, ROOT / "examples"):
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

from lightning_recorder import FeatureStatsMonitor, HealthMonitor  # noqa: E402
from lightning_recorder.callbacks import StatsReport  # noqa: E402


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
EVERY = 5
_callbacks.EVERY = EVERY  # the house timer flushes the logger after each logged step
VIEW_EVERY = 10
CONFIGS = ("monitor", "monitor + check", "monitor + health")
LIMITS = {"logging": 1.05, "non-logging": 1.01}
FINDINGS: list[int] = []  # the rule events of each run of "monitor + health"


class Net(pl.LightningModule):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.net = body

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _cnn() -> nn.Module:
    from tensorboard_stats import DigitsCNN

    return DigitsCNN()


def _digits(steps: int, batch: int) -> DataLoader:
    return _callbacks._loader(steps, batch)


def _random(steps: int, batch: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 64, generator=g)
    y = torch.randint(0, 10, (steps * batch,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def _mlp() -> pl.LightningModule:
    """The 64-layer MLP, He-initialised (with PyTorch's default initialisation the gradient of
    its first layers vanishes, which the rules report, redrawing the view each time)."""
    body = _logging.mlp64()
    for layer in body:
        if isinstance(layer, nn.Linear):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
    return Net(body)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, int], DataLoader], list[Any]]] = {
    "CNN (digits)": (_cnn, _digits, [nn.Conv2d, nn.Linear, nn.ReLU]),
    "MLP, 64 layers": (_mlp, _random, [nn.Linear, nn.ReLU]),
}


class _Drawn:
    """Notes the timer's step index of each redraw of a HealthMonitor's view."""

    def __init__(self, monitor: HealthMonitor, timer: Any) -> None:
        self.steps: set[int] = set()
        view = monitor._view  # this library's own view: which logged steps drew pictures
        assert view is not None
        write = view.write

        def noted(*args: Any, **kwargs: Any) -> None:
            self.steps.add(len(timer.wall))  # the step under way
            write(*args, **kwargs)

        view.write = noted  # type: ignore[method-assign]


def _trainer(config: str, sources: list[Any], steps: int, root: str, timer: Any) -> pl.Trainer:
    callbacks: list[pl.Callback] = [timer, FeatureStatsMonitor(sources, every_n_steps=EVERY)]
    if config == "monitor + check":
        callbacks.append(HealthMonitor(rules=(), view=False, evidence_max_bytes=0))
    elif config == "monitor + health":
        callbacks.append(HealthMonitor(evidence_max_bytes=0, view_every=VIEW_EVERY))
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=TensorBoardLogger(root, name=config.replace(" ", "").replace("+", "-")),
        callbacks=callbacks,
        log_every_n_steps=EVERY,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _side_by_side(
    model: str, names: Sequence[str], steps: int, root: str, seed: int
) -> tuple[dict[str, Any], set[int]]:
    make, data, sources = MODELS[model]
    baton = _callbacks._Baton(len(names), seed=seed)
    timers, fits, drawn = {}, [], set()
    health: HealthMonitor | None = None
    for k, name in enumerate(names):
        pl.seed_everything(0, verbose=False)
        timers[name] = timer = _callbacks._StepTimer(baton, k)
        trainer = _trainer(name, sources, steps, root, timer)
        if name == "monitor + health":
            health = next(cb for cb in trainer.callbacks if isinstance(cb, HealthMonitor))
            drawn = _Drawn(health, timer).steps
        net, loader = make(), data(steps, 128)
        fits.append(lambda t=trainer, n=net, d=loader: t.fit(n, d))
    _callbacks.run_in_turns(fits, baton)
    if health is not None:  # the rules' findings: a healthy run has none
        FINDINGS.append(sum(e.kind not in ("nonfinite", "amp_skipped") for e in health.events))
    return timers, drawn


def _summary(times: list[float], window: range, drawn: set[int]) -> dict[str, float]:
    logged = [k for k in window if (k + 1) % EVERY == 0]
    return {
        "logging": statistics.fmean(times[k] for k in logged),
        "logging median": statistics.median(times[k] for k in logged),
        "no redraw": statistics.median(times[k] for k in logged if k not in drawn),
        "redraw": statistics.median(times[k] for k in logged if k in drawn) if drawn else 0.0,
        "non-logging": statistics.median(times[k] for k in window if (k + 1) % EVERY != 0),
    }


# (measure, configuration, reference configuration, what of the reference)
RATIOS = [
    ("logging step, amortised", "monitor + health", "monitor", "logging", "logging"),
    ("logging step, amortised: rules + view", "monitor + health", "monitor + check", "logging",
     "logging"),
    ("logging step without a redraw", "monitor + health", "monitor", "no redraw",
     "logging median"),
    ("redraw step", "monitor + health", "monitor", "redraw", "logging median"),
    ("non-logging step: rules", "monitor + health", "monitor + check", "non-logging",
     "non-logging"),
    ("non-logging step: the non-finite check", "monitor + check", "monitor", "non-logging",
     "non-logging"),
]  # fmt: skip


def measure(model: str, repeats: int, start: int, stop: int) -> dict[str, Any]:
    window = range(start, stop)
    ratios: dict[str, list[float]] = {r[0]: [] for r in RATIOS}
    ms: dict[str, dict[str, list[float]]] = {c: {} for c in CONFIGS}
    redraws = []
    FINDINGS.clear()
    with tempfile.TemporaryDirectory() as root:
        _side_by_side(model, CONFIGS, 3 * EVERY * VIEW_EVERY // 2, root, seed=99)  # warm up
        for r in range(repeats):
            order = _callbacks.turn_order(CONFIGS, r)
            timers, drawn = _side_by_side(model, order, stop + 2, root, seed=r)
            got = {c: _summary(t.wall, window, drawn if c == CONFIGS[-1] else set()) for c, t in
                   timers.items()}  # fmt: skip
            redraws.append(len(drawn & set(window)))
            for c in CONFIGS:
                for key, value in got[c].items():
                    ms[c].setdefault(key, []).append(1e3 * value)
            for label, config, ref, key, ref_key in RATIOS:
                ratios[label].append(got[config][key] / got[ref][ref_key])
            print(f"  {model}: repeat {r + 1}/{repeats}", flush=True)
    return {
        "window": [start, stop],
        "redraws_in_window": statistics.median(redraws),
        "rule_events_per_run": list(FINDINGS),
        "ms": {c: {k: statistics.median(v) for k, v in by.items()} for c, by in ms.items()},
        "ratio": {k: statistics.median(v) for k, v in ratios.items()},
        "range": {k: (min(v), max(v)) for k, v in ratios.items()},
    }


def redraw_alone(model: str, columns: int = 100, repeats: int = 20) -> float:
    """Milliseconds of one redraw with ``columns`` logged steps kept (median)."""
    make, data, sources = MODELS[model]
    with tempfile.TemporaryDirectory() as root:
        pl.seed_everything(0, verbose=False)
        health = HealthMonitor(evidence_max_bytes=0)
        stats = FeatureStatsMonitor(sources, every_n_steps=1)
        reports: list[StatsReport] = []
        stats.subscribe(reports.append)
        trainer = pl.Trainer(
            max_steps=2,
            accelerator="cpu",
            logger=TensorBoardLogger(root, name="redraw"),
            callbacks=[stats, health],
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        net = make()
        trainer.fit(net, data(2, 128))
        view = health._view
        assert view is not None and reports
        weights = {n for n, p in net.named_parameters() if p.ndim >= 2}
        rng = np.random.default_rng(0)
        view.start()
        for step in range(columns):  # a full history: the last report, jittered
            last = reports[-1]
            jitter = {k: v * rng.uniform(0.5, 2.0, v.shape) for k, v in last.stats.items()}
            view.add(
                StatsReport("train", step, None, last.modules, jitter, last.parameters), weights
            )
        times = []
        for k in range(repeats):
            start = time.perf_counter()
            view.write(trainer, [], columns + k, [r.name for r in health.rules])
            times.append(time.perf_counter() - start)
        trainer.logger.finalize("success")  # type: ignore[union-attr]
    return 1e3 * statistics.median(times)


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | measure | configuration (ms) | reference (ms) | ratio (min–max) | target |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model, r in result["models"].items():
        for label, config, ref, key, ref_key in RATIOS:
            lo, hi = r["range"][label]
            target = (
                f"<= {LIMITS['logging']}"
                if label == "logging step, amortised"
                else f"<= {LIMITS['non-logging']}"
                if label == "non-logging step: rules"
                else "(information)"
            )
            lines.append(
                f"| {model} | {label} | {r['ms'][config][key]:.2f} | {r['ms'][ref][ref_key]:.2f} "
                f"| **{r['ratio'][label]:.3f}** ({lo:.3f}–{hi:.3f}) | {target} |"
            )
        lines.append(
            f"| {model} | one redraw alone, heat maps full (100 steps) | "
            f"{r['redraw_alone_ms']:.1f} | | | (information) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print its table; return the figures."""
    parser = argparse.ArgumentParser(description="HealthMonitor rules and view: their cost")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, short runs")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument(
        "--default-malloc", action="store_true", help="keep glibc's adaptive malloc thresholds"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")
    torch.set_num_threads(1)
    pinned = False if args.default_malloc else _callbacks.pin_malloc()
    start, stop = (100, 600) if not args.quick else (10, 2 * EVERY * VIEW_EVERY + 10)
    repeats = 1 if args.quick else args.repeats
    result: dict[str, Any] = {"malloc_pinned": pinned, "repeats": repeats, "models": {}}
    for model in args.models:
        result["models"][model] = measure(model, repeats, start, stop)
        result["models"][model]["redraw_alone_ms"] = redraw_alone(model, repeats=3 if args.quick
                                                                  else 20)  # fmt: skip
    malloc = "malloc fixed" if pinned else "glibc malloc"
    print(
        f"\nHealthMonitor's rules and view on top of a FeatureStatsMonitor logging every {EVERY} "
        f"steps (heat maps redrawn every {VIEW_EVERY} logged steps): medians of {repeats} "
        f"repeats, configurations taking turns step by step, steps {start}-{stop - 1}, one torch "
        f"thread, {malloc}.\n"
    )
    print(table(result))
    for model, found in result["models"].items():
        print(
            f"rule events per run of 'monitor + health' ({model}): {found['rule_events_per_run']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
