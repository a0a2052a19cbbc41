"""Small C kernels, compiled on first use with the system's C compiler and loaded with ctypes.

Some passes over data are cheaper in one loop than in any sequence of torch calls: the
monitor's statistics of an activation (sums, extremes, zeros in one read) and its parameter
statistics (a copy and a norm in one pass). Their C source ships inside the package; the first
call builds it into a shared library in a cache directory, and later runs load that file.

* **Where.** ``$LIGHTNING_RECORDER_CACHE``, else ``$XDG_CACHE_HOME/lightning_recorder``, else
  ``~/.cache/lightning_recorder``. The file name carries a hash of the source, the flags and the
  compiler, so a changed source, another CPU level or another compiler builds anew; builds go
  to a temporary name and are renamed into place, so concurrent processes never load half a
  file.
* **Which compiler.** ``$CC``, else the one Python was built with, else ``cc``, ``gcc`` or
  ``clang`` on the ``PATH``. GCC and Clang vector extensions are used (no intrinsics); on x86-64
  CPUs where torch itself runs AVX2 kernels the build targets AVX2 too, and AVX-512 (512-bit
  vectors) where torch runs AVX-512 kernels.
* **Without one.** Anything that fails (no compiler, a failed build, a library that does not
  load, ``LIGHTNING_RECORDER_NATIVE=0``) makes :func:`load` return ``None``, once per process,
  with the reason logged at INFO level and kept in :func:`status`; callers then take their
  torch path, which computes the same values.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL | None] = {}
_STATUS: dict[str, str] = {}

Signature = tuple[Any, Sequence[Any]]


def enabled() -> bool:
    """Whether native kernels may be used (``LIGHTNING_RECORDER_NATIVE`` is not ``0``/``off``)."""
    flag = os.environ.get("LIGHTNING_RECORDER_NATIVE", "1").strip().lower()
    return flag not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    """Where built libraries are kept."""
    explicit = os.environ.get("LIGHTNING_RECORDER_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_recorder"


def compiler() -> list[str] | None:
    """The C compiler's command (with its own leading arguments), or ``None``."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC")):
        if candidate:
            words = shlex.split(candidate)
            if words and shutil.which(words[0]):
                return words
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def cpu_flags() -> list[str]:
    """Code-generation flags for this CPU: AVX2 where torch runs its own AVX2 kernels, AVX-512
    (512-bit vectors) where it runs its AVX-512 ones."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        return []
    if capability == "AVX512":
        return ["-mavx2", "-mfma", "-mavx512f"]
    return ["-mavx2", "-mfma"] if capability == "AVX2" else []


def status() -> Mapping[str, str]:
    """For each library asked for: ``"loaded from <path>"`` or why it is not used."""
    return dict(_STATUS)


def load(name: str, source: str, signatures: Mapping[str, Signature]) -> ctypes.CDLL | None:
    """The library built from ``source`` with ``signatures`` (``{symbol: (restype, argtypes)}``)
    set on its functions; ``None`` where native kernels are off or cannot be built here."""
    if name in _LOADED:
        return _LOADED[name]
    with _LOCK:
        if name not in _LOADED:
            library, why = _build_and_load(name, source)
            if library is not None:
                try:
                    for symbol, (restype, argtypes) in signatures.items():
                        function = getattr(library, symbol)
                        function.restype = restype
                        function.argtypes = list(argtypes)
                except AttributeError as error:
                    library, why = None, f"missing symbol: {error}"
            if library is None:
                log.info("lightning_recorder: native kernels %r not used (%s)", name, why)
            _STATUS[name] = why
            _LOADED[name] = library
    return _LOADED[name]


def _build_and_load(name: str, source: str) -> tuple[ctypes.CDLL | None, str]:
    if not enabled():
        return None, "disabled by LIGHTNING_RECORDER_NATIVE"
    command = compiler()
    if command is None:
        return None, "no C compiler found (set CC)"
    wanted = cpu_flags()
    levels = [wanted]
    if "-mavx512f" in wanted:  # a compiler too old for AVX-512 still builds for AVX2
        levels.append([flag for flag in wanted if not flag.startswith("-mavx512")])
    library, why = None, ""
    for level in levels:
        library, why = _build_level(name, source, command, level)
        if not why.startswith("build failed"):
            break
    return library, why


def _build_level(
    name: str, source: str, command: list[str], level: list[str]
) -> tuple[ctypes.CDLL | None, str]:
    """Build (unless the cache has it) and load ``source`` with the CPU flags ``level``."""
    flags = ["-O3", "-shared", "-fPIC", "-fno-math-errno", *level]
    key = hashlib.sha256("\0".join([source, *command, *flags]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                c_file = Path(scratch) / f"{name}.c"
                c_file.write_text(source, encoding="utf-8")
                built = Path(scratch) / target.name
                result = subprocess.run(
                    [*command, *flags, str(c_file), "-o", str(built)],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                )
                if result.returncode != 0:
                    detail = (result.stderr or result.stdout).strip().splitlines()
                    return None, f"build failed: {detail[-1] if detail else result.returncode}"
                os.replace(built, target)
        except (OSError, subprocess.SubprocessError) as error:
            return None, f"build failed: {error}"
    try:
        return ctypes.CDLL(str(target)), f"loaded from {target}"
    except OSError as error:
        return None, f"load failed: {error}"


def reset() -> None:
    """Forget what was loaded (the next :func:`load` looks again; for tests)."""
    with _LOCK:
        _LOADED.clear()
        _STATUS.clear()
