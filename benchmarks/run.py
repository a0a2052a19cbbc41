"""Run the benchmarks: every ``benchmarks/bench_*.py`` module's ``main()``, in name order.

A benchmark module defines ``main(quick: bool = False) -> None`` that prints its own report.
A ``main(argv: list[str] | None = None)`` that parses its own command line also works: it gets
``["--quick"]`` or ``[]``. Whatever ``main`` returns is ignored.

Each benchmark runs in a fresh Python process, so that the settings one of them makes (torch
threads, allocator options, imported state) cannot change the timings of the next.

Usage::

    python benchmarks/run.py                 # all benchmarks (``make bench``)
    python benchmarks/run.py --quick         # short runs, e.g. to check that they work
    python benchmarks/run.py --only core     # bench_core.py only (repeatable)
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def discover() -> dict[str, Path]:
    """``{name: path}`` for every ``bench_<name>.py`` next to this file."""
    return {path.stem.removeprefix("bench_"): path for path in sorted(HERE.glob("bench_*.py"))}


def call_main(path: Path, quick: bool) -> None:
    """Import the benchmark module at ``path`` and call its ``main`` (in this process)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has one
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.argv = [str(path)]  # the runner's own flags are not the benchmark's
    spec.loader.exec_module(module)
    main = module.main
    parameters = inspect.signature(main).parameters
    if "quick" in parameters:
        main(quick=quick)
    elif "argv" in parameters:
        main(["--quick"] if quick else [])
    else:
        main()


def run(name: str, path: Path, quick: bool) -> bool:
    """Run one benchmark in a child process; whether it succeeded."""
    print(f"=== {name} ({path.name}){' [quick]' if quick else ''}", flush=True)
    start = time.perf_counter()
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(path)]
    code = subprocess.run(command + ["--quick"] * quick, check=False).returncode
    status = "done" if code == 0 else f"FAILED (exit status {code})"
    print(f"=== {name}: {status} in {time.perf_counter() - start:.1f} s\n", flush=True)
    return code == 0


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the chosen benchmarks; the exit status is 1 if one failed."""
    found = discover()
    parser = argparse.ArgumentParser(description="Run the benchmarks/bench_*.py modules.")
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help=f"run only this benchmark (repeatable); one of: {', '.join(found) or 'none found'}",
    )
    parser.add_argument("--quick", action="store_true", help="short runs")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        call_main(args.child, args.quick)
        return 0
    chosen = found
    if args.only:
        names = [n.removeprefix("bench_").removesuffix(".py") for n in args.only]
        unknown = [n for n in names if n not in found]
        if unknown:
            parser.error(
                f"unknown benchmark(s) {', '.join(map(repr, unknown))}; "
                f"available: {', '.join(found)}"
            )
        chosen = {n: found[n] for n in names}
    failed = [name for name, path in chosen.items() if not run(name, path, args.quick)]
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
