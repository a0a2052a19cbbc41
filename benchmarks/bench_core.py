"""Overhead of the recording core on a small CNN training step (CPU, one thread).

Every ``Conv2d`` and ``Linear`` output of the model is recorded at each step of a plain training
loop (forward, backward, SGD step). Five variants of the same step are timed:

* ``none``: no hooks at all;
* ``hand hooks``: hand-written ``register_forward_hook`` closures appending each output to a
  list that is replaced every step (the floor for a hook-based recorder);
* ``recorder``: :class:`~lightning_recorder.ModuleOutputsRecorder` (type selection) through a
  :class:`~lightning_recorder.RecorderManager`, recording inside ``with manager:`` every step;
* ``recorder idle``: the same recorders initialized (hooks installed) but never entered;
* ``recorder suspended``: initialized, then suspended (``manager.suspend()``: hooks removed
  until the next ``start``), as ``RecorderCallback`` leaves them between recorded steps.

The variants are timed in interleaved rounds (each round times a block of steps of every
variant, in a new random order); the table shows the median time per step and the median of the
per-round ratios, which cancels most of the drift of a busy machine. A second ``none`` row shows
the noise of the measurement itself. Times are the CPU time of the thread that runs the step
(``time.thread_time``; with one torch thread the forward and the backward run on it), so time
spent descheduled on a busy machine is not counted.

Variants that keep tensors alive across the step (hand hooks, recorder) make glibc's ``malloc``
return memory to the system and fault it back in, about 500 page faults per step, whose cost
depends on the machine's load far more than on the code. Unless ``--default-malloc`` is given,
``mallopt`` is told to keep freed memory, so that the table compares the code.

Run: ``python benchmarks/bench_core.py`` (``--quick`` for a short run), or ``make bench``.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import gc
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from lightning_recorder import RecorderManager

BATCH = 32
STEPS_PER_BLOCK = 5
WARMUP_STEPS = 20
CLOCK = time.thread_time


def make_model() -> nn.Module:
    """Three conv blocks and two linear layers for 3x32x32 inputs (five recorded layers)."""
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


#: variant -> (the variant it is compared with, the largest ratio allowed)
TARGETS: dict[str, tuple[str, float]] = {
    "recorder": ("hand hooks", 1.03),
    "recorder idle": ("none", 1.01),
}


def _trainer(model: nn.Module) -> Callable[[], None]:
    """One training step of ``model`` on a fixed batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (BATCH,), generator=generator)
    loss_fn = nn.CrossEntropyLoss()

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    return train_step


def make_variants() -> tuple[dict[str, Callable[[int], None]], Callable[[], None]]:
    """``{name: run n steps}``, each variant on its own copy of one model, and a cleanup."""
    base = make_model()
    recorded = (nn.Conv2d, nn.Linear)
    config = {"features": {"type": "ModuleOutputs", "source": recorded}}

    plain_step = _trainer(copy.deepcopy(base))
    again_step = _trainer(copy.deepcopy(base))

    def run_none(n: int) -> None:
        for _ in range(n):
            plain_step()

    def run_again(n: int) -> None:  # the same as `none`: shows the noise of the measurement
        for _ in range(n):
            again_step()

    hand_model = copy.deepcopy(base)
    hand_step = _trainer(hand_model)
    store: list[torch.Tensor] = []

    def keep(module: nn.Module, args: object, output: torch.Tensor) -> None:
        store.append(output)

    handles = [
        m.register_forward_hook(keep) for m in hand_model.modules() if isinstance(m, recorded)
    ]

    def run_hand(n: int) -> None:
        nonlocal store
        for _ in range(n):
            store = []  # a fresh list per step, as each recorder context starts a fresh buffer
            hand_step()
        store = []  # free the last step's outputs here, not in another variant's block

    active_model = copy.deepcopy(base)
    active_step = _trainer(active_model)
    active = RecorderManager(config)
    active.initialize(active_model)

    with active:  # guard: the five layers are recorded, once per step
        active_step()
    assert [len(stream) for _, stream in active.streams()] == [1] * 5

    def run_active(n: int) -> None:
        for _ in range(n):
            with active:
                active_step()
        active.reset_data_buffer()  # free the last step's records here

    idle_model = copy.deepcopy(base)
    idle_step = _trainer(idle_model)
    idle = RecorderManager(config)
    idle.initialize(idle_model)

    def run_idle(n: int) -> None:
        for _ in range(n):
            idle_step()

    suspended_model = copy.deepcopy(base)
    suspended_step = _trainer(suspended_model)
    suspended = RecorderManager(config)
    suspended.initialize(suspended_model)
    suspended.suspend()

    def run_suspended(n: int) -> None:
        for _ in range(n):
            suspended_step()

    def cleanup() -> None:
        # Guard: the measured variants did what they claim.
        assert len(handles) == 5
        assert [s.num_calls for _, s in idle.streams()] == [0] * 5
        assert not any(m._forward_hooks for m in suspended_model.modules())
        for handle in handles:
            handle.remove()
        active.release()
        idle.release()
        suspended.release()

    variants = {
        "none": run_none,
        "none, again": run_again,
        "hand hooks": run_hand,
        "recorder": run_active,
        "recorder idle": run_idle,
        "recorder suspended": run_suspended,
    }
    return variants, cleanup


def measure(
    rounds: int, steps: int = STEPS_PER_BLOCK, warmup: int = WARMUP_STEPS
) -> dict[str, tuple[float, dict[str, float]]]:
    """Per variant: median ms/step, and median per-round ratios against each variant."""
    variants, cleanup = make_variants()
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: no collector pauses inside the timed blocks
    try:
        for run in variants.values():  # warm-up: allocator, autograd, first-call paths
            run(warmup)
        order = random.Random(0)
        for r in range(rounds):
            order.shuffle(names)  # a new order every round: no variant always follows another
            for name in names:
                start = CLOCK()
                variants[name](steps)
                times[name].append((CLOCK() - start) / steps * 1e3)
            if r % 10 == 9:
                gc.collect()  # between blocks, untimed
    finally:
        if gc_was_enabled:
            gc.enable()
        cleanup()
    return {
        name: (
            statistics.median(samples),
            {
                ref: statistics.median(t / b for t, b in zip(samples, times[ref], strict=True))
                for ref in names
            },
        )
        for name, samples in times.items()
    }


def machine() -> str:
    """A one-line description of where the benchmark ran."""
    return (
        f"{os.cpu_count()} CPU core(s) ({platform.machine()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s), Python {platform.python_version()}"
    )


def table(results: dict[str, tuple[float, dict[str, float]]]) -> str:
    """The results as an aligned text table (also valid Markdown)."""
    rows = [["variant", "ms/step", "vs none", "vs hand hooks", "target", "result"]]
    for name, (ms, ratios) in results.items():
        target, result = "-", "-"
        if name in TARGETS:
            ref, limit = TARGETS[name]
            target = f"<= {limit:.2f} x {ref}"
            result = "pass" if ratios[ref] <= limit else "FAIL"
        rows.append(
            [
                name,
                f"{ms:.3f}",
                f"{ratios['none']:.3f}",
                f"{ratios['hand hooks']:.3f}",
                target,
                result,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory (no trimming, no mmap for blocks < 32 MiB).

    Returns:
        Whether it applied (``False`` off glibc).
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def main(quick: bool = False, default_malloc: bool = False) -> None:
    """Run the benchmark and print the table.

    Args:
        quick: a short run (about 20 s) instead of the full one (about 90 s).
        default_malloc: leave glibc's malloc settings alone (noisier; see the module docs).
    """
    torch.set_num_threads(1)  # one thread: steadier timings, and no overhead hidden by idle cores
    torch.manual_seed(0)
    steady = not default_malloc and keep_freed_memory()
    rounds = 80 if quick else 500
    results = measure(rounds, STEPS_PER_BLOCK)
    print(f"bench_core: CNN training step (forward, backward, SGD), batch {BATCH}x3x32x32")
    print(f"machine: {machine()}")
    print(
        f"{rounds} interleaved rounds x {STEPS_PER_BLOCK} steps per variant; medians of thread "
        f"CPU time; malloc {'keeps freed memory' if steady else 'default'}"
    )
    print(table(results))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (about 20 s)")
    parser.add_argument(
        "--default-malloc", action="store_true", help="leave glibc's malloc settings alone"
    )
    args = parser.parse_args()
    main(quick=args.quick, default_malloc=args.default_malloc)
