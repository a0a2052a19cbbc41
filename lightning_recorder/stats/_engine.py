"""The statistics engine: the package's kernels, compiled where they can be, eager elsewhere.

The kernels are plain torch functions written once: :func:`~._state.rows_state` (the packed
states of the rows of a 2-d tensor) and :func:`~._histogram.bucket_keys` (the histogram bucket
of every value of the rows of a 2-d tensor, as a key of one count for all rows);
:func:`blocks_state` is the first followed by :func:`~._state.merge`, the state of a whole
tensor read as rows; :func:`~._histogram.sample_keys` and :func:`~._histogram.sample_table`
are the two halves of a batch's histogram table around its integer count
(:func:`sampled_table`), composed of the histogram's own functions.

**Compiled.** ``torch.compile(kernel, dynamic=True)`` fuses a kernel into one read of its data
(inductor on the CPU, Triton on CUDA) with no ``float64`` copy of it. Inputs are 2-d (a
flattened output is one row; on a GPU, :data:`BLOCK_ROWS` rows, reduced in parallel), so the
sizes stay symbolic and one graph serves every size; each
variant (kernel, device type, dtype, one row or several, inference mode, masking) gets a graph
of its own (:func:`_own_copy`), compiled once per process (and cached on disk by torch). A
compile is slow (seconds), so it never runs inside a training step: :func:`warm_up` compiles in
a background thread (or waits, if asked), and until a graph is ready the same function runs
eagerly; a variant nobody warmed up runs eagerly too. A compile that fails is reported once, as
a :class:`UserWarning` saying why and what it costs, and everything stays eager.
``LIGHTNING_RECORDER_COMPILE=0`` turns compiling off.

**Eager.** The same functions, op by op, on pieces of at most :data:`CHUNK` elements (states
are merged): the transient memory stays a few chunks, whatever the size of the tensor.

**The CPU kernel.** On the CPU, ``float32`` and ``float64`` tensors take the custom op of
:mod:`._cpu_kernel` (the same state in one read, a few µs per call where a compiled graph costs
about a hundred) once :func:`warm_up` has built it in the same background thread; until then,
and where it cannot be built (one warning), the compiled or eager function.
``LIGHTNING_RECORDER_NATIVE=0`` turns it off.

**Two variants of the state.** *Masked* states count NaN and infinities apart and leave them
out of the other statistics; *unmasked* states assume finite data and skip the masking
(cheaper where arithmetic, not memory, bounds the pass: the CPU). On the CPU a tensor takes the
unmasked variant and, when its sums show a NaN or an infinity (they propagate through a sum),
the masked one; elsewhere it takes the masked one directly, since reading the result would
synchronise.
"""

from __future__ import annotations

import contextlib
import errno
import re
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .._core.checks import switched_on
from .._core.compat import autocast_enabled
from . import _cpu_kernel
from ._histogram import bucket_keys, count_keys, row_bases, sample_keys, sample_table, tally
from ._state import F64, SHIFT_SAMPLE, empty_states, merge, rows_state, zeros_state

__all__ = [
    "BLOCK_ROWS",
    "CHUNK",
    "ONE_ROW_DEVICES",
    "block_rows",
    "blocks_state",
    "chunks",
    "compile_enabled",
    "compile_status",
    "compiled_only",
    "eager_only",
    "flat_view",
    "native_ready",
    "reset_compiled",
    "row_counts",
    "rows_states",
    "sampled_table",
    "state_row",
    "tensor_state",
    "warm_up",
]

# Eager passes take tensors in pieces of at most this many elements (bounded transient memory).
CHUNK = 2**18
# A flat tensor of at least this many elements runs compiled as BLOCK_ROWS rows, merged in the
# same graph: a single row is reduced by one thread block on a GPU (a 2**24-element state took
# 116 reads of the data on an H100). The number of rows is fixed, so the merge is a reduction of
# known size (a few short kernels), not one of symbolic size (a loop per statistic).
BLOCKED_LENGTH = 2**16
BLOCK_ROWS = 512
# Device types whose compiled graphs reduce one long row well (inductor's C++ loop over a row is
# vectorised and split across threads; as rows it took 2-3 times longer on one CPU thread):
# large tensors are read as one row there.
ONE_ROW_DEVICES: tuple[str, ...] = ("cpu",)
# Rows shorter than this run eagerly: a graph compiled for the long rows of the warm-up would be
# compiled again for them (a length of 1, and a shift sampled at every element, are specialised
# by torch.compile), inside a training step.
MIN_COMPILED_LENGTH = 2 * SHIFT_SAMPLE
# Dtypes the compiled graphs are built for; others (integers, bool) are converted first.
COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_ENV = "LIGHTNING_RECORDER_COMPILE"


def compile_enabled() -> bool:
    """Whether the engine may compile (``LIGHTNING_RECORDER_COMPILE`` is not ``0``/``off``)."""
    return switched_on(_ENV)


# kernel name, device type, dtype, several rows, inference mode, masked
Key = tuple[str, str, torch.dtype, bool, bool, bool]


def blocks_state(x: Tensor, finite: bool = False) -> Tensor:
    """The packed state ``(1, WIDTH)`` of the elements of ``x`` ``(1, L)`` (``L`` a multiple of
    :data:`BLOCK_ROWS`): the states of its :data:`BLOCK_ROWS` rows of ``L / BLOCK_ROWS``
    elements, merged. The same statistic as one row's; compiled, the rows run in parallel."""
    return merge(rows_state(x.view(BLOCK_ROWS, -1), finite)).unsqueeze(0)


_KERNELS: dict[str, Callable[..., Tensor]] = {
    "state": rows_state,
    "blocks": blocks_state,
    "buckets": bucket_keys,
    "keys": sample_keys,
    "table": sample_table,
}


def _own_copy(fn: Any, key: Key) -> Any:
    """``fn`` with a code object of its own: torch compiles and caches graphs per code object
    (and limits how many one may have), so each variant gets its own."""
    name = "_".join([fn.__name__, *(str(part).replace(".", "_") for part in key[1:])])
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _example(key: Key) -> tuple[Any, ...]:
    """Arguments of the shape a variant is called with (its graph is compiled for them)."""
    kernel, device, dtype, several, _, masked = key
    rows = 2 if several else 1
    length = BLOCK_ROWS * 256 if kernel == "blocks" else 4096
    x = torch.zeros(rows, length, dtype=dtype, device=device)
    if kernel in ("state", "blocks"):
        return (x, not masked)
    # sampled histograms: 5 rows of 2 streams, the second with 3 of them (sizes that differ
    # from each other, so that torch.compile gives each its own symbol); ``several``: the graph
    # for streams of several rows (3), else for one row each (a size of 1 is specialised)
    states = empty_states(2, device=device)
    stream = torch.tensor([0, 0, 1, 1, 1], device=device)
    if kernel == "keys":
        return (torch.zeros(5, length, dtype=dtype, device=device), states, stream, 30)
    if kernel == "table":
        weights = torch.ones(5, dtype=F64, device=device)
        owned = [[0, 1, 5], [2, 3, 4]] if several else [[0], [2]]  # 5: no row
        counted = torch.zeros(5, 31, dtype=dtype, device=device)
        rows_of_stream = torch.tensor(owned, device=device)
        return (counted, states, states, weights, rows_of_stream, 30)
    bounds = torch.zeros(rows, dtype=F64, device=device)
    return (x, bounds, bounds + 1, row_bases(rows, 30, x.device), 30)


class _Compiler:
    """The compiled graphs of the kernels, one per variant, and their readiness."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: dict[Key, Any] = {}
        self._ready: set[Key] = set()
        self._pending: set[Key] = set()
        self._failed: str | None = None
        self._threads: list[threading.Thread] = []
        self._native_failed: str | None = None
        self._native_pending = False

    def function(self, key: Key) -> Any:
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = torch.compile(_own_copy(_KERNELS[key[0]], key), dynamic=True)
        return fn

    def ready(self, key: Key | None) -> bool:
        return key is not None and key in self._ready and not getattr(_LOCAL, "eager", False)

    def status(self) -> str:
        if self._native_failed is not None:
            native = f"; CPU kernel not built: {self._native_failed}"
        elif _cpu_kernel.loaded():
            native = "; CPU kernel loaded"
        elif not _cpu_kernel.enabled():
            native = f"; CPU kernel off ({_cpu_kernel.ENV}=0)"
        else:
            native = ""  # not built yet
        if not compile_enabled():
            return f"off ({_ENV}=0){native}"
        if self._failed is not None:
            return f"failed: {self._failed}{native}"
        if not self._ready:
            return f"{'compiling, none ready yet' if self._pending else 'not compiled yet'}{native}"
        done = ", ".join(sorted(_describe(k) for k in self._ready)) or "none"
        return f"compiled for {done}" + (" (more compiling)" if self._pending else "") + native

    def warm(self, keys: Iterable[Key], wait: bool, native: bool = False) -> None:
        """Compile the graphs of ``keys`` in a background thread (``native``: first build the
        CPU kernel, and skip the graphs it replaces). Graphs compiled before are run there
        again, so that one dropped by ``torch.compiler.reset()`` compiles there, not in a
        step."""
        compiling = compile_enabled() and self._failed is None
        with self._lock:
            if (
                native and _cpu_kernel.loaded()
            ):  # built already: the graphs it replaces are not needed
                keys = [k for k in keys if not _replaced_by_native(k)]
            native = native and self._wants_native()
            keys = list(dict.fromkeys(keys))
            if compiling:
                # a graph made before is run again here, off the steps (a cache hit, unless
                # torch.compiler.reset() dropped it since: then it compiles in this thread,
                # and the steps run the kernel eagerly meanwhile)
                self._ready.difference_update(keys)
            todo = [k for k in keys if k not in self._pending] if compiling else []
            self._pending.update(todo)
            self._native_pending = self._native_pending or native
        if todo or native:
            thread = threading.Thread(
                target=self._compile, args=(todo, native), name="lightning_recorder-compile"
            )
            self._threads.append(thread)
            thread.start()
        if wait:
            for thread in list(self._threads):
                thread.join()

    def _wants_native(self) -> bool:
        return (
            _cpu_kernel.enabled()
            and not _cpu_kernel.loaded()
            and self._native_failed is None
            and not self._native_pending
        )

    def _build_native(self) -> bool:
        """Build and load the CPU kernel; on failure, one warning and ``False``."""
        try:
            _cpu_kernel.build()
        except Exception as err:  # no compiler, no ninja, a failed build: say so once
            with self._lock:
                self._native_pending = False
            if threading.main_thread().is_alive():
                self._native_failed = _reason(err)
                warnings.warn(
                    "lightning_recorder could not build its CPU statistics kernel "
                    f"({self._native_failed}); statistics on the CPU run through torch.compile "
                    "or eagerly. The values are the same; a logged step costs more (about a "
                    f"hundred microseconds per monitored output). {_native_needs(err)}; set "
                    "LIGHTNING_RECORDER_NATIVE=0 to skip it and this warning.",
                    UserWarning,
                    stacklevel=2,
                )
            return False
        with self._lock:
            self._native_pending = False
        return True

    def _compile(self, keys: Sequence[Key], native: bool = False) -> None:
        if native and self._build_native():
            replaced = [k for k in keys if _replaced_by_native(k)]
            with self._lock:
                self._pending.difference_update(replaced)
            keys = [k for k in keys if not _replaced_by_native(k)]
        for index, key in enumerate(keys):
            if not threading.main_thread().is_alive():  # the process is exiting: the graph
                with self._lock:  # being compiled was finished, the others are not begun
                    self._pending.difference_update(keys[index:])
                return
            try:
                with torch.inference_mode(key[4]):
                    example = _example(key)
                    with _plain(example[0]):
                        self.function(key)(*example)
            except Exception as err:  # any failure of the compiler: stay eager, say so once
                if threading.main_thread().is_alive():  # not a process that is exiting
                    self.fail(err)
                return
            finally:
                with self._lock:
                    self._pending.discard(key)
            with self._lock:
                self._ready.add(key)

    def fail(self, err: BaseException) -> None:
        with self._lock:
            if self._failed is not None:
                return
            self._failed = _reason(err)
            self._ready.clear()
        way_out = (
            "Inductor needs a writable cache directory: set TORCHINDUCTOR_CACHE_DIR to one, or "
            f"set {_ENV}=0"
            if _unwritable(err)
            else f"Set {_ENV}=0"
        )
        kept = (
            "; float32 and float64 outputs on the CPU still take the CPU kernel, one pass each"
            if _cpu_kernel.loaded()
            else ""
        )
        warnings.warn(
            "lightning_recorder computes feature statistics eagerly: torch.compile failed "
            f"({self._failed}). The values are the same; a logged step costs more (several "
            f"passes over each monitored output instead of one{kept}). {way_out} to skip "
            "compiling and this warning.",
            UserWarning,
            stacklevel=2,
        )

    def reset(self) -> None:
        for thread in list(self._threads):
            thread.join()
        with self._lock:
            self._ready.clear()
            self._pending.clear()
            self._failed = None
            self._threads = []
            self._native_failed = None
            self._native_pending = False


def _unwritable(err: BaseException) -> bool:
    """Whether ``err`` says that a directory cannot be written (a cache directory that is
    read-only, a file, or not the user's), not that a program is missing."""
    return isinstance(err, (PermissionError, NotADirectoryError, IsADirectoryError)) or (
        isinstance(err, OSError) and err.errno == errno.EROFS
    )


def _native_needs(err: BaseException) -> str:
    """What building the CPU kernel needs, for the warning of its failure ``err``."""
    if _unwritable(err):
        return (
            "It needs a writable directory for torch's extension cache: set "
            "TORCH_EXTENSIONS_DIR to one"
        )
    return "It needs a C++ compiler and ninja on PATH (pip install ninja)"


# A line of a failed build's output that says why it failed (the compiler's or the shell's).
_SAYS_WHY = re.compile(r"error|not found|no such file|permission denied|cannot", re.IGNORECASE)


def _reason(err: BaseException) -> str:
    """What a warning and :func:`compile_status` quote of an error: its type and the first line
    of its message (an error without a message, such as a bare ``assert`` of the compiler's,
    by its type alone). A failed build of torch's extension builder starts with the compile
    command, and the line that says why comes later (``c++: not found``, the compiler's
    ``error:``): that line is quoted after the builder's own words instead."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if first.startswith("Error building extension"):
        why = next(
            (
                line
                for line in lines[1:]
                if _SAYS_WHY.search(line)
                and not line.startswith(("[", "FAILED:"))
                and "-DTORCH_EXTENSION_NAME" not in line  # the compile command, echoed
            ),
            None,
        )
        if why is not None:
            first = f"{first.split(':', 1)[0]}: {why}"
    first = first[:300]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _replaced_by_native(key: Key) -> bool:
    """Whether the CPU kernel computes what the graph of ``key`` would."""
    kernel, device, dtype, *_ = key
    return kernel in ("state", "blocks") and device == "cpu" and dtype in _cpu_kernel.DTYPES


_COMPILER = _Compiler()
# ``eager``: this thread runs every kernel eagerly (eager_only); ``no_native``: not the CPU
# kernel (compiled_only)
_LOCAL = threading.local()


@contextlib.contextmanager
def eager_only() -> Iterator[None]:
    """Run every kernel of this thread eagerly, op by op: no compiled graph, no CPU kernel (to
    compare the paths)."""
    before = getattr(_LOCAL, "eager", False), getattr(_LOCAL, "no_native", False)
    _LOCAL.eager = _LOCAL.no_native = True
    try:
        yield
    finally:
        _LOCAL.eager, _LOCAL.no_native = before


@contextlib.contextmanager
def compiled_only() -> Iterator[None]:
    """Run the kernels of this thread compiled (where their graphs are ready), never by the
    CPU kernel (to compare the paths)."""
    before = getattr(_LOCAL, "no_native", False)
    _LOCAL.no_native = True
    try:
        yield
    finally:
        _LOCAL.no_native = before


def native_ready(x: Tensor) -> bool:
    """Whether the CPU kernel computes the state of ``x`` (a CPU tensor of a dtype it reads, the
    kernel loaded, not turned off in this thread)."""
    return (
        _cpu_kernel.loaded()
        and x.is_cpu
        and x.dtype in _cpu_kernel.DTYPES
        and not getattr(_LOCAL, "no_native", False)
    )


def _describe(key: Key) -> str:
    kernel, device, dtype, several, inference, masked = key
    name = str(dtype).removeprefix("torch.")
    extra = (" masked" * masked) + (" rows" * several) + (" inference" * inference)
    return f"{kernel} {device} {name}{extra}"


def _masked_by_default(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the masked state directly (no host read)."""
    return device.type != "cpu"


def warm_up(
    device: torch.device | str,
    dtypes: Iterable[torch.dtype],
    *,
    wait: bool = False,
    native: bool = True,
) -> None:
    """Compile the graphs that statistics and histograms of ``dtypes`` on ``device`` use, in a
    background thread (``wait``: and wait for it). On the CPU (``native``) the thread first
    builds the CPU kernel and skips the graphs it replaces (``native=False``: compile them
    too). Until then, and if compiling fails (one warning), the same kernels run eagerly.
    Graphs compiled before are run again in that thread: one that ``torch.compiler.reset()``
    dropped since compiles there, not in a training step."""
    device = torch.device(device)
    masked = _masked_by_default(device)
    chosen = [d for d in dtypes if d in COMPILED_DTYPES]
    staged = {F64 if d == F64 else torch.float32 for d in chosen}  # the samples' dtypes
    keys: list[Key] = []
    for inference in (False, True):  # tensors made under inference mode (evaluation)
        for several in (False, True):
            keys += [("state", device.type, d, several, inference, masked) for d in chosen]
        if device.type not in ONE_ROW_DEVICES:
            keys += [("blocks", device.type, d, False, inference, masked) for d in chosen]
    for d in sorted(staged, key=str):
        keys += [("buckets", device.type, d, True, False, False), ("keys", *_sampled(device, d))]
    keys += [("table", *_sampled(device, torch.int64, several)) for several in (False, True)]
    _COMPILER.warm(keys, wait, native=native and device.type == "cpu")


def _sampled(
    device: torch.device, dtype: torch.dtype, several: bool = True
) -> tuple[str, torch.dtype, bool, bool, bool]:
    """The rest of the key of a sampled histogram's kernel on ``dtype`` (training tensors;
    ``several``: the table's graph for streams of several rows)."""
    return (device.type, dtype, several, False, False)


def compile_status() -> str:
    """How the statistics run in this process: compiled, eager, and why.

    Returns:
        ``"off (LIGHTNING_RECORDER_COMPILE=0)"``, ``"failed: <the compiler's error>"``, ``"not
        compiled yet"``, ``"compiling, none ready yet"`` (a background compile runs, no graph is
        ready), or ``"compiled for <kernel device dtype ...>, ..."`` (with ``" (more
        compiling)"`` while a background compile runs); then, for the CPU kernel,
        ``"; CPU kernel loaded"``, ``"; CPU kernel not built: <the builder's error>"``,
        ``"; CPU kernel off (LIGHTNING_RECORDER_NATIVE=0)"``, or nothing (not built yet).

    Examples:
        >>> from lightning_recorder.stats import compile_status
        >>> compile_status().startswith(("off", "failed", "not compiled", "compil"))
        True
    """
    return _COMPILER.status()


def reset_compiled() -> None:
    """Forget which graphs are ready and any failure (tests)."""
    _COMPILER.reset()


def flat_view(x: Tensor) -> Tensor | None:
    """The elements of ``x`` as a flat view of its memory, in memory order, or ``None`` when
    they are not one dense block (a slice with gaps). Statistics do not depend on the order:
    a channels-last or transposed tensor is read as it lies."""
    x = x.detach()
    if x.is_contiguous():
        return x.reshape(-1)
    sizes_strides = sorted((s, n) for n, s in zip(x.shape, x.stride(), strict=True) if n != 1)
    expected = 1
    for stride, size in sizes_strides:
        if stride != expected:
            return None
        expected *= size
    return torch.as_strided(x, (x.numel(),), (1,), x.storage_offset())


def _plain(x: Tensor) -> contextlib.AbstractContextManager[Any]:
    """No autograd and no autocast around a kernel: the same global state in every thread (the
    graphs are compiled in one and run in another), and no graph recorded. (Nothing to enter,
    the common case, costs nothing.)"""
    grad = torch.is_grad_enabled()
    autocast = autocast_enabled(x.device)
    if not (grad or autocast):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    if grad:
        stack.enter_context(torch.no_grad())
    if autocast:
        stack.enter_context(torch.autocast(x.device.type, enabled=False))
    return stack


def _key(kernel: str, x: Tensor, several: bool, masked: bool) -> Key | None:
    """The variant that runs ``x``: under inference mode (evaluation) the tensors are inference
    tensors too, and that pair has graphs of its own; a mixed pair has none (eager)."""
    inference = torch.is_inference_mode_enabled()
    if inference != x.is_inference():
        return None
    return (kernel, x.device.type, x.dtype, several, inference, masked)


def _compiled(key: Key, x: Tensor, *args: Any) -> Tensor | None:
    """The compiled graph of ``key`` on ``x`` (and ``args``), or ``None`` where it fails at run
    time (reported once; every kernel stays eager from then on)."""
    try:
        return _COMPILER.function(key)(x, *args)
    except Exception as err:
        _COMPILER.fail(err)
        return None


def _run(kernel: str, x: Tensor, *args: Any, masked: bool = False) -> Tensor:
    """A kernel on the 2-d tensor ``x`` (and ``args``): compiled when the graph of its variant
    is ready and the rows are not short, else eagerly, a few rows at a time when ``x`` is
    large (a single long row in pieces of :data:`CHUNK`: bounded memory)."""
    key = _key(kernel, x, x.shape[0] > 1, masked)
    fn = _KERNELS[kernel]
    with _plain(x):
        if key is not None and x.shape[1] >= MIN_COMPILED_LENGTH and _COMPILER.ready(key):
            found = _compiled(key, x, *args)
            if found is not None:
                return found
        if x.numel() <= CHUNK:
            return fn(x, *args)
        if x.shape[0] == 1:  # one long row (a compiled graph failed on it): in pieces
            if kernel == "state":
                return _merged_pieces(x[0].split(CHUNK), lambda piece: fn(piece, *args), x.device)
            return torch.cat([fn(piece, *args) for piece in x.split(CHUNK, 1)], 1)
        step = max(1, CHUNK // x.shape[1])
        pieces = [
            fn(x[i : i + step], *(a[i : i + step] if isinstance(a, Tensor) else a for a in args))
            for i in range(0, x.shape[0], step)
        ]
        return torch.cat(pieces)


def rows_states(x: Tensor) -> Tensor:
    """The packed states ``(R, WIDTH)`` of the rows of a 2-d tensor (any real dtype)."""
    x = x.detach()
    if x.dtype not in COMPILED_DTYPES:
        x = x.to(F64)
    if x.numel() == 0:
        return empty_states(x.shape[0], device=x.device)
    if native_ready(x):
        return _cpu_kernel.rows_state(x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous())
    if _masked_by_default(x.device):
        return _run("state", x, False, masked=True)
    states = _run("state", x, True)
    # A NaN or an infinity in a row shows in its unmasked sums and extremes (they propagate);
    # such rows take the masked variant. On the CPU, reading the result is free.
    if not bool(torch.isfinite(states).all()):
        bad = ~torch.isfinite(states).all(1)
        states[bad] = _run("state", x[bad], False, masked=True)
    return states


def is_plain(x: Tensor) -> bool:
    """Whether ``x`` is an ordinary dense tensor (strided, not nested, not quantized): one that
    the kernels read as it is; others are read through :func:`stored_parts`."""
    return x.layout == torch.strided and not x.is_nested and not x.is_quantized


def stored_parts(x: Tensor) -> tuple[list[Tensor], int]:
    """The ordinary dense tensors that hold the values of a tensor that is not
    (:func:`is_plain`), and how many of its elements are implicit zeros: a sparse tensor's
    stored values (COO coalesced first, so that each element counts once) and the rest of its
    elements as zeros; a nested tensor's components (its packed values, jagged layout); a
    quantized tensor's values, dequantized. ``[x], 0`` for an ordinary tensor."""
    if x.is_quantized:
        return stored_parts(x.dequantize())
    if x.is_nested:
        if x.layout == torch.strided:
            return list(x.unbind()), 0
        return [x.values()], 0
    if x.layout == torch.sparse_coo:
        values = x.coalesce().values()
    elif x.layout != torch.strided:  # compressed sparse layouts (CSR, CSC, BSR, BSC)
        values = x.values()
    else:
        return [x], 0
    return [values], x.numel() - values.numel()


def tensor_state(x: Tensor) -> Tensor:
    """The packed state ``(WIDTH,)`` of all elements of ``x`` (any shape and real dtype; sparse,
    nested and quantized tensors through their stored values: :func:`stored_parts`).

    The CPU kernel, or compiled: one pass over the whole tensor. Eager (and for memory that is
    not one dense block): pieces of at most :data:`CHUNK` elements, merged.
    """
    x = x.detach()
    if not is_plain(x):
        parts, zeros = stored_parts(x)
        states = [tensor_state(part) for part in parts]
        if zeros:
            states.append(zeros_state(zeros, x.device))
        return merge(torch.stack(states), 0) if states else empty_states(device=x.device)
    return state_row(x, flat_view(x))[0]


def state_row(x: Tensor, flat: Tensor | None, native: bool | None = None) -> Tensor:
    """:func:`tensor_state` as one row ``(1, WIDTH)``, given ``x`` detached and its
    :func:`flat_view` (and :func:`native_ready`, if known: a caller that needs them too computes
    them once)."""
    n = x.numel()
    if n == 0:
        return empty_states(1, device=x.device)
    if flat is not None and (native_ready(x) if native is None else native):
        return _cpu_kernel.rows_state(flat.view(1, n))
    if flat is not None and x.dtype in COMPILED_DTYPES:
        masked = _masked_by_default(x.device)
        if _read_as_blocks(x) and _COMPILER.ready(_key("blocks", x, False, masked)):
            state = _blocked(flat, masked)
            if state is not None:
                return state
        key = _key("state", x, False, masked)
        if n <= CHUNK or _COMPILER.ready(key):
            return rows_states(flat.view(1, n))
    # pieces of at most CHUNK elements: views of one block, else copies made one at a time
    return _merged_pieces(chunks(x, flat), rows_states, x.device)


def block_rows(x: Tensor, flat: Tensor | None, native: bool) -> tuple[Tensor, Tensor | None] | None:
    """The states of a large tensor read as :data:`BLOCK_ROWS` rows, not merged: ``(rows,
    rest)``, the states ``(BLOCK_ROWS, WIDTH)`` of the rows of its first ``n - n % BLOCK_ROWS``
    elements and the state ``(1, WIDTH)`` of the others (``None`` if none), whose merge is the
    tensor's state; ``None`` where :func:`state_row` would not read ``x`` as blocks, or the
    compiled graph of the rows is not ready.

    For a caller that collects the states of many tensors: it merges the rows of several
    tensors at once, a few kernels for them all, where the compiled ``blocks`` graph merges the
    rows of each tensor in kernels of its own (on CUDA, 5 of its 7 kernels; each launch costs
    the host more than the kernel costs the GPU). ``x`` detached, ``flat`` its
    :func:`flat_view`, ``native`` its :func:`native_ready`, as :func:`state_row` takes them.
    """
    if flat is None or native or x.dtype not in COMPILED_DTYPES or not _read_as_blocks(x):
        return None
    n = x.numel()
    body = n - n % BLOCK_ROWS
    rows = flat[:body].view(BLOCK_ROWS, -1)
    if not _COMPILER.ready(_key("state", rows, True, _masked_by_default(x.device))):
        return None
    rest = rows_states(flat[body:].view(1, -1)) if body < n else None
    return rows_states(rows), rest


def _read_as_blocks(x: Tensor) -> bool:
    """Whether a tensor whose compiled state is taken is read as :data:`BLOCK_ROWS` rows (large,
    on a device that reduces one long row badly), by :func:`state_row` and :func:`block_rows`."""
    return x.numel() >= BLOCKED_LENGTH and x.device.type not in ONE_ROW_DEVICES


#: the states of a tensor's pieces held before they are merged into one
_PIECES_HELD = 64


def _merged_pieces(
    pieces: Iterable[Tensor], states: Callable[[Tensor], Tensor], device: torch.device
) -> Tensor:
    """The state ``(1, WIDTH)`` of a tensor from ``states`` of its 1-d ``pieces`` (each read as
    ``(1, length)``), merged: bounded transient memory. The pieces' states go to one buffer
    allocated first (merged into its first row when it is full): small results left between
    the pieces' freed temporaries (copies, where the tensor is not one block of memory) would
    pin them apart, and the transient memory would grow with the tensor."""
    found = empty_states(_PIECES_HELD, device=device)
    used = 0
    for piece in pieces:
        if used == _PIECES_HELD:
            found[0] = merge(found)
            used = 1
        found[used] = states(piece.view(1, -1))[0]
        used += 1
    return merge(found[:used]).unsqueeze(0)


def _blocked(flat: Tensor, masked: bool) -> Tensor | None:
    """The state ``(1, WIDTH)`` of the flat tensor ``flat`` by the compiled ``blocks`` graph
    (ready: the caller checked): its elements as :data:`BLOCK_ROWS` rows, the rest (fewer than
    :data:`BLOCK_ROWS`) apart, merged. ``None`` where an unmasked state shows a NaN or an
    infinity (the CPU), or the graph failed (reported once): the caller reads it in chunks."""
    n = flat.shape[0]
    body = n - n % BLOCK_ROWS
    x = flat[:body].view(1, body)
    key = _key("blocks", x, False, masked)
    if key is None:
        return None
    with _plain(x):
        state = _compiled(key, x, not masked)
    if state is None:
        return None
    if not masked and not bool(torch.isfinite(state).all()):
        return None
    if body < n:
        state = merge(torch.cat([state, rows_states(flat[body:].view(1, -1))])).unsqueeze(0)
    return state


def row_counts(values: Tensor, lo: Tensor, hi: Tensor, bins: int) -> Tensor:
    """Integer bucket counts ``(R, bins)`` of the finite values of each row of ``values`` ``(R,
    S)`` (float32 or float64; pad rows with NaN) over its row's range ``[lo, hi]`` (``(R,)``,
    ``float64``): :func:`~._histogram.bucket_keys`, then :func:`~._histogram.tally`. Values
    outside a row's range are not counted. ``values`` is made contiguous (a sample: small), so
    that one graph serves the rows of any staging buffer (a compiled graph is specialised for
    contiguous rows)."""
    bases = row_bases(values.shape[0], bins, values.device)
    keys = _run("buckets", values.contiguous(), lo.contiguous(), hi.contiguous(), bases, bins)
    return tally(keys, bins)


def sampled_table(
    values: Tensor,
    every: Tensor,
    states: Tensor,
    stream: Tensor,
    weights: Tensor,
    rows_of_stream: Tensor,
    bins: int,
) -> Tensor:
    """The histogram table ``(m, 2 * bins + 6)`` (:func:`~._histogram.stream_table`) of ``m``
    streams from sample rows ``values`` ``(R, S)`` (float32 or float64, padded with NaN): row
    ``r`` belongs to stream ``stream[r]`` and each of its values stands for ``weights[r]``
    elements; ``rows_of_stream`` ``(m, k)`` lists each stream's rows (``R`` pads). Ranges and
    summaries from ``every`` (the streams' states over every rank), counts scaled to this rank's
    ``states``.

    Two kernels of the engine around one integer count (:func:`~._histogram.sample_keys`,
    :func:`~._histogram.count_keys`, :func:`~._histogram.sample_table`): compiled, the whole
    table is two graph calls and a ``bincount`` (on the CPU; an integer ``index_add_``
    elsewhere), where op by op it is some forty calls. Eager for one stream or one row, short
    rows, or before the graphs are ready (the same functions); streams of several rows (a
    module called twice) have a table graph of their own."""
    rows, length = values.shape
    compiled = every.shape[0] > 1 and rows > 1 and length >= MIN_COMPILED_LENGTH
    several = rows_of_stream.shape[1] > 1
    values, every, states = values.contiguous(), every.contiguous(), states.contiguous()
    with _plain(values):
        keys = _sampled_call("keys", values, compiled, True, every, stream, bins)
        counted = count_keys(keys.reshape(-1), rows * (bins + 1)).view(rows, bins + 1)
        return _sampled_call(
            "table", counted, compiled, several, every, states, weights, rows_of_stream, bins
        )


def _sampled_call(kernel: str, x: Tensor, compiled: bool, several: bool, *args: Any) -> Tensor:
    """A kernel of :func:`sampled_table` on ``x`` and ``args``: its graph (the variant for
    ``several`` rows per stream) where ``compiled`` allows it and it is ready, else eagerly."""
    key = _key(kernel, x, several, False) if compiled else None
    if key is not None and _COMPILER.ready(key):
        found = _compiled(key, x, *args)
        if found is not None:
            return found
    return _KERNELS[kernel](x, *args)


def chunks(x: Tensor, flat: Tensor | None) -> Iterable[Tensor]:
    """The elements of ``x`` in flat pieces of at most :data:`CHUNK` (views where its memory is
    one block, else contiguous copies of at most that size: a compiled graph is specialised
    for contiguous rows)."""
    if flat is not None:
        yield from flat.split(CHUNK)
    elif x.numel() <= CHUNK:
        yield x.reshape(-1).contiguous()  # a strided 1-d tensor reshapes to itself
    elif x[0].numel() > CHUNK:
        for part in x.unbind(0):
            yield from chunks(part, flat_view(part))
    else:
        for part in x.split(CHUNK // x[0].numel()):
            yield part.reshape(-1).contiguous()
