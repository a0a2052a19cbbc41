"""The CPU kernel of the packed state: the custom op ``lightning_recorder::rows_state``.

The op computes what :func:`~._state.rows_state` defines (the packed states of the rows of a
2-d tensor, NaN and infinities counted apart) in one read of the data, for ``float32`` and
``float64`` rows that are contiguous, on the CPU; given a ``sample`` buffer it also copies a
row's elements at a stride into it (the histogram sample, taken while the row is in the cache).
It is registered with torch's dispatcher (a schema and a fake implementation here, the CPU
kernel in ``_cpu_state.cpp``), so it composes with ``torch.compile`` and the rest of torch;
:func:`~._state.rows_state` stays the definition, the path of every other device and dtype,
and the reference the tests hold the kernel to.

**Why a native kernel.** On the CPU, the logging step of a model with many small layers is
bound by the cost of each call, not by the data: a call of a ``torch.compile`` d graph costs
about 75-170 µs of Python (dynamo's guards, AOTAutograd's and inductor's wrappers), the op's
call a few µs, so each output is reduced in its hook at once, without a copy (figures in
``docs/benchmarks_callbacks.md``).

**Build.** :func:`build` compiles the source with torch's extension builder
(``torch.utils.cpp_extension.load``: a C++ compiler and ``ninja`` on ``PATH``, the same
compiler inductor uses) into torch's extension cache (``TORCH_EXTENSIONS_DIR``), once per
source, torch and Python version; the engine calls it in its background compile thread, never
inside a training step. Until it is loaded, and where it cannot be built (one warning, from the
engine), the engine runs :func:`~._state.rows_state` compiled or eagerly.
``LIGHTNING_RECORDER_NATIVE=0`` turns the kernel off.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from pathlib import Path

import torch
from torch import Tensor

from .._core.checks import switched_on
from ._state import F64, WIDTH

__all__ = ["DTYPES", "ENV", "build", "enabled", "loaded", "rows_state"]

SOURCE = Path(__file__).with_name("_cpu_state.cpp")
# The dtypes the kernel reads.
DTYPES = (torch.float32, torch.float64)
# The environment variable that turns the kernel off (``0``/``off``).
ENV = "LIGHTNING_RECORDER_NATIVE"

_LIB = torch.library.Library("lightning_recorder", "DEF")
# Two overloads of the one op: ``default`` reads (a pure function, as torch.compile takes it
# best), ``sampled`` also writes the row's elements 0, stride, 2 stride, ... into ``sample``
# (one row only). One overload with an optional written argument instead failed in inductor
# when the argument was left out (the functionalized call's result indexed after the call had
# been put back in place).
_LIB.define("rows_state(Tensor x) -> Tensor")
_LIB.define("rows_state.sampled(Tensor x, Tensor(a!) sample, int stride) -> Tensor")


def _fake(x: Tensor, sample: Tensor | None = None, stride: int = 1) -> Tensor:
    """The op's fake implementation (both overloads): the shape and dtype of the result,
    without data."""
    torch._check(x.dim() == 2, lambda: f"rows_state takes a 2-d tensor, got {x.dim()}-d")
    return x.new_empty((x.shape[0], WIDTH), dtype=F64)


# torch.library.register_fake since torch 2.4, impl_abstract before
_register_fake = getattr(torch.library, "register_fake", None) or torch.library.impl_abstract
_register_fake("lightning_recorder::rows_state", _fake, lib=_LIB)
_register_fake("lightning_recorder::rows_state.sampled", _fake, lib=_LIB)


_lock = threading.Lock()
_loaded = False
# the op's overloads, resolved once (a call through the overload packet costs a few µs more)
_OP = torch.ops.lightning_recorder.rows_state.default
_OP_SAMPLED = torch.ops.lightning_recorder.rows_state.sampled


def enabled() -> bool:
    """Whether the kernel may be used (``LIGHTNING_RECORDER_NATIVE`` is not ``0``/``off``)."""
    return switched_on(ENV)


def loaded() -> bool:
    """Whether the CPU kernel is built and registered in this process."""
    return _loaded


def build() -> None:
    """Build (or find in torch's extension cache) and load the CPU kernel. Raises what the
    builder raises (no compiler, no ``ninja``) and ``RuntimeError`` when the kernel is off."""
    global _loaded
    if not enabled():
        raise RuntimeError(f"the CPU kernel is off ({ENV}=0)")
    with _lock:
        if _loaded:
            return
        from torch.utils.cpp_extension import load

        tag = f"{torch.__version__}|{sys.version_info[:2]}".encode()
        digest = hashlib.sha256(SOURCE.read_bytes() + tag).hexdigest()[:16]
        load(
            name=f"lightning_recorder_cpu_state_{digest}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3"],
            is_python_module=False,
            verbose=False,
        )
        _loaded = True


def rows_state(x: Tensor, sample: Tensor | None = None, stride: int = 1) -> Tensor:
    """The packed states ``(R, WIDTH)`` of the rows of ``x`` ``(R, L)`` (``float32`` or
    ``float64`` on the CPU, rows contiguous), by the CPU kernel (:func:`build` first).

    With ``sample`` (1-d, contiguous, ``x``'s dtype; ``R == 1``), also ``sample.copy_(x[0,
    ::stride][: len(sample)])`` in the same call, while the row is in the cache: the strided
    histogram sample of an output, taken with its state."""
    if sample is None:
        return _OP(x)
    return _OP_SAMPLED(x, sample, stride)
