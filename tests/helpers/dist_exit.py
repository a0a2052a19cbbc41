"""Ending the multi-process test runs cleanly: the process group destroyed before the exit.

Lightning destroys the default process group at exit for NCCL only; under gloo (every CPU test
here) each process would reach the end of its interpreter with the process group alive, and with
it torch's native threads: the gloo workers (``pt_gloo_runloop``, which take the GIL to drop
their references to tensors created in Python), gloo's socket loop (``gloo_tcp_loop``) and, on
rank 0, the store's server (``pt_tcpstore_uv``). A native thread that asks for the GIL as the
interpreter finalizes is ended by CPython (``pthread_exit``), and unwinding a C++ destructor that
way ends the process: ``terminate called without an active exception`` (SIGABRT). Destroying
the process group while Python is fully alive joins those threads first.

* ``strategy="ddp"`` scripts (every rank runs ``__main__``): call :func:`end_process_group`
  after the run, also after a failed one: ending a gloo process group is local to the process
  (it does not wait for the other ranks), and a rank still waiting in a collective with this one
  then fails at once instead of at its timeout.
* ``ddp_spawn`` (the workers run ``fit`` only): add :class:`DestroyProcessGroup` to the
  callbacks; its ``teardown`` is the last hook of the fit in each worker.
* :func:`record_threads_at_exit` writes the names of the process's native threads, as the
  interpreter starts to exit, for the tests to check that none of torch's is left
  (:func:`assert_no_c10d_threads_left`).
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

#: Name prefixes of torch's native threads that live as long as a process group does.
C10D_THREADS = ("pt_gloo", "gloo_", "pt_tcpstore")


def end_process_group() -> None:
    """Destroy the default process group (and every subgroup) if there is one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class DestroyProcessGroup(pl.Callback):
    """Destroys the process group at the end of the fit, in every process (``ddp_spawn``).

    With ``threads_dir``, each process also writes its thread names at exit to
    ``threads_dir/threads{rank}.txt`` (see :func:`record_threads_at_exit`).
    """

    def __init__(self, threads_dir: str | Path | None = None) -> None:
        self.threads_dir = threads_dir

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.threads_dir is not None:
            path = Path(self.threads_dir) / f"threads{trainer.global_rank}.txt"
            record_threads_at_exit(path)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        end_process_group()


def native_threads() -> list[str] | None:
    """The names of this process's threads (Linux), ``None`` where ``/proc`` does not list them."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    names = []
    for task in sorted(tasks.iterdir()):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names


def record_threads_at_exit(path: Path) -> None:
    """At the interpreter's exit (``atexit``), write this process's thread names to ``path``."""

    def write(*_: Any) -> None:
        names = native_threads()
        if names is not None:
            Path(path).write_text("\n".join(names) + "\n")

    atexit.register(write)


def leftover_c10d_threads(path: Path) -> list[str]:
    """The torch process-group threads listed in a file of :func:`record_threads_at_exit`."""
    names = Path(path).read_text().split()
    return [name for name in names if name.startswith(C10D_THREADS)]


def assert_no_c10d_threads_left(out: Path, ranks: tuple[int, ...] = (0, 1)) -> None:
    """Assert that each rank's threads at exit (``out/threads{rank}.txt`` of
    :func:`record_threads_at_exit`) held no thread of the process group; where ``/proc`` lists
    no threads (not Linux) there is nothing to check."""
    if native_threads() is None:
        return
    for rank in ranks:
        left = leftover_c10d_threads(Path(out) / f"threads{rank}.txt")
        assert left == [], f"rank {rank} exited with process-group threads: {left}"
