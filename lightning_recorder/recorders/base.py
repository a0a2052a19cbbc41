"""`BaseRecorder`: the lifecycle, options and buffers every recorder shares.

A recorder names a *source* (a module, a function, a parameter …), is *initialized* once (hooks or
patches installed, gated by a flag), and *records* only while its context is active::

    recorder.initialize(model)
    with recorder:          # a fresh buffer; the flag is on
        model(x)            # every call of the source appends one record
    recorder.data_buffer    # still readable
    recorder.release()      # hooks removed, patches restored
"""

from __future__ import annotations

import abc
import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import Any, ClassVar, Literal

import torch
from torch.compiler import is_compiling

from .._core.checks import check_bool, parse_device, parse_dtype, suggestion
from .._core.compat import current_autograd_node, reentrant_rerun
from .._core.hooks import HookSet, WeakHook
from .._core.structures import (
    Path,
    PathKey,
    Versions,
    copied_snapshot,
    follow_path,
    iter_tensors,
    make_tensor_transform,
    make_transform,
    map_tensors,
    modified,
    parse_path,
    snapshot,
)
from ..errors import (
    NoRecordError,
    NotInitializedError,
    RecorderConfigError,
    RecorderStateError,
    RecordModifiedError,
)

Keep = Literal["all", "first", "last"] | int
"""Which calls a recorder keeps in one context: ``"all"``, the ``"first"``, the ``"last"``, or at
most ``n`` (a positive int)."""

get_ident = threading.get_ident

# Guards the check-then-start of a recording context, so that two threads entering the same
# recorder (or manager) at once cannot both succeed. Module level: recorders stay picklable.
_CONTEXT_LOCK = threading.RLock()


def _this_thread() -> tuple[int, str]:
    thread = threading.current_thread()
    return thread.ident or 0, thread.name


# Every recorder that started recording, held weakly (those recording now have ``_recording``
# set): a call of a source made in another thread is not reported as unrecorded where that
# thread records the same source with a recorder of its own.
_STARTED: weakref.WeakSet[BaseRecorder] = weakref.WeakSet()


def held_elsewhere(recorder: BaseRecorder) -> str | None:
    """The name of another thread recording with ``recorder`` now, else ``None``."""
    holder = recorder._holder
    if recorder._recording and holder is not None and holder[0] != threading.get_ident():
        return holder[1]
    return None


_MODIFIED_CAUSE = (
    "an in-place operation such as ReLU(inplace=True) after the recorded module is the usual cause."
)


def _no_owner() -> None:
    """The recorder of a stream copied without it: none."""
    return None


def _without_graph(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached from the graph that made it (a leaf as it is)."""
    return t if t.grad_fn is None else t.detach()


class RecordStream:
    """The records of one source, in call order.

    A recorder with an exact source has one stream; a pattern or type source has one stream per
    matched module or parameter, each named after it.
    """

    __slots__ = ("_label", "_owner", "_records", "_versions", "name", "num_calls")

    def __init__(self, name: str, owner: BaseRecorder) -> None:
        self.name = name
        # A weak reference: hooks hold streams, and must not keep their recorder alive.
        self._owner: Callable[[], BaseRecorder | None] = weakref.ref(owner)
        self._label = repr(owner)
        self._records: list[Any] = []
        self._versions: list[Versions] = []
        self.num_calls = 0

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deep copy, pickle) leaves its recorder out: the copied recorder takes its
        # copied streams back (BaseRecorder.__setstate__); a stream copied alone has none.
        # Copied tensors count their versions afresh: the copy keeps which records were
        # modified in place, and snapshots the others again.
        state = {slot: getattr(self, slot) for slot in self.__slots__ if slot != "_owner"}
        # A graph cannot be copied: a record with one (a forward with gradients) is copied
        # detached, with its values.
        state["_records"] = [
            map_tensors(record, _without_graph)
            if any(t.grad_fn is not None for t in iter_tensors(record))
            else record
            for record in self._records
        ]
        state["_versions"] = [
            modified(record, versions)
            for record, versions in zip(self._records, self._versions, strict=True)
        ]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)
        self._versions = [
            copied_snapshot(record, was_modified)
            for record, was_modified in zip(self._records, state["_versions"], strict=True)
        ]
        self._owner = _no_owner

    def _reset(self) -> None:
        self._records = []
        self._versions = []
        self.num_calls = 0

    def _check(self) -> None:
        records = self._records
        for idx, versions in enumerate(self._versions):
            if versions is not None and modified(records[idx], versions):
                owner = self._owner()  # None: the recorder is gone; the stream outlived it
                cause = _MODIFIED_CAUSE if owner is None else owner._modified_cause()
                raise RecordModifiedError(
                    f"Record {idx} of {self._label} (source {self.name!r}) was modified in place "
                    f"after it was recorded, so it no longer holds what the source produced; "
                    f"{cause} Pass clone=True to record a copy."
                )

    @property
    def data_buffer(self) -> list[Any]:
        """The records, oldest first (checked for in-place modification)."""
        self._check()
        return self._records

    def __len__(self) -> int:
        return len(self._records)

    def get_record_data(self, record_idx: int = 0, data_idx: int | str | None = None) -> Any:
        """One record; ``data_idx`` indexes into a tuple, list or arguments record."""
        records = self._records
        if not records:
            owner = self._owner()  # None: the recorder is gone; the stream outlived it
            why = (
                f"{self._label} recorded nothing for {self.name!r}."
                if owner is None
                else owner._why_empty(self.name)
            )
            raise NoRecordError(why)
        if isinstance(record_idx, bool) or not isinstance(record_idx, int):
            raise RecorderConfigError(
                f"Expected `record_idx` to be an int (negative counts from the end) but got "
                f"{type(record_idx).__name__} {record_idx!r}."
            )
        if not -len(records) <= record_idx < len(records):
            raise NoRecordError(
                f"Expected `record_idx` in [-{len(records)}, {len(records) - 1}] but got "
                f"{record_idx}: {self._label} holds {len(records)} record(s) for {self.name!r}."
            )
        if modified(records[record_idx], self._versions[record_idx]):
            self._check()
        record = records[record_idx]
        if data_idx is None:
            return record
        try:
            if isinstance(record, torch.Tensor) and not isinstance(data_idx, int):
                raise TypeError  # a tensor is indexed by position only (no deprecated x[seq])
            return record[data_idx]
        except (IndexError, KeyError, TypeError):
            size = f" of length {len(record)}" if hasattr(record, "__len__") else ""
            raise NoRecordError(
                f"Expected `data_idx` to index record {record_idx} of {self._label}, a "
                f"{type(record).__name__}{size}, but got {data_idx!r}.{_valid_data_idx(record)}"
            ) from None

    def __repr__(self) -> str:
        return f"RecordStream({self.name!r}, records={len(self._records)})"


def _valid_data_idx(record: Any) -> str:
    """What indexes ``record`` as a `data_idx`: its positions, and its names or keys."""
    if isinstance(record, Mapping):
        return f" Valid keys: {', '.join(repr(k) for k in record)}."
    if isinstance(record, torch.Tensor) and record.dim() == 0:
        return " A 0-d tensor has no index: leave `data_idx` out."
    if not hasattr(record, "__len__") or len(record) == 0:
        return ""
    valid = f" Valid: an int in [-{len(record)}, {len(record) - 1}]"
    names = getattr(record, "names", None)  # an Arguments record
    if isinstance(names, tuple):
        valid += f" or an argument name, {', '.join(repr(n) for n in names)}"
    return f"{valid}."


class RecorderHook(WeakHook["BaseRecorder"]):
    """Base class of the hooks recorders install: weakly bound to a recorder, writing one stream.

    A custom recorder's hook subclasses it and starts with ``rec = self.recorder()``.

    Args:
        recorder: the owning recorder (held weakly).
        stream: the stream this hook writes to.
    """

    __slots__ = ("_stream",)

    def __init__(self, recorder: BaseRecorder, stream: RecordStream) -> None:
        super().__init__(recorder)
        self._stream = stream

    def recorder(self) -> BaseRecorder | None:
        """The recorder when it is recording now in this thread, else ``None`` (also in
        checkpoint re-runs)."""
        # WeakHook.live() spelled out, cheapest test first: this runs for every call of every
        # hooked module, recording or not.
        rec = self._ref()
        if rec is None or not rec._recording or current_autograd_node() is not None:
            return None
        holder = rec._holder
        # is_compiling() first: under torch.compile the thread lookup would break the graph
        if holder is None or is_compiling() or holder[0] == get_ident():
            return rec
        return rec if rec.records_this_thread() else None

    def grad_recorder(self) -> BaseRecorder | None:
        """:meth:`recorder` for a hook that registers gradient sinks: also in the forward a
        reentrant checkpoint re-runs during backward (see :meth:`WeakHook.live_for_grads`),
        which the autograd engine may run in a thread of its own."""
        if not reentrant_rerun():
            return self.recorder()
        rec = self.live_for_grads()
        return rec if rec is not None and rec._recording else None

    def on_grad(self, owner: BaseRecorder, grad: torch.Tensor, key: Any) -> None:
        """Record a gradient that arrived for the recording session ``key``."""
        if owner._recording and owner._session == key:
            owner.capture(self._stream, grad)


def _parse_keep(keep: Keep) -> tuple[int | None, bool]:
    """(maximum number of calls kept, whether only the latest call is kept)."""
    if keep == "all":
        return None, False
    if keep == "first":
        return 1, False
    if keep == "last":
        return None, True
    if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1:
        return keep, False
    raise RecorderConfigError(
        f"Expected `keep` to be 'all', 'first', 'last' or a positive int but got {keep!r}."
    )


class BaseRecorder(abc.ABC):
    """Base class of every recorder.

    **Writing a recorder.** A subclass overrides :meth:`prepare_from_model` (MMRazor's name):
    find the source in the model, create one stream per recorded name with :meth:`add_stream`,
    and install hooks through :attr:`hooks` (a :class:`HookSet`; ``hooks.install(make)`` for
    hooks that may be suspended between recorded steps, ``hooks.add(handle)`` otherwise). Its
    hooks subclass :class:`RecorderHook` and hand each value to :meth:`capture`, which applies
    ``detach``/``clone``/``device``/``dtype``/``keep`` and the in-place check. Optionally
    override :meth:`_empty_hint` to explain an empty record. Register it with
    :func:`~lightning_recorder.register_recorder` to name it in config dicts.

    Args:
        source: what to record; its meaning depends on the recorder.
        detach: record ``tensor.detach()`` (no autograd graph kept alive by the record).
            Default ``False``: records stay attached so a loss can back-propagate through them.
        clone: record a copy, immune to later in-place changes of the original.
        device: move recorded tensors to this device (e.g. ``"cpu"``).
        dtype: cast recorded floating-point tensors to this floating-point dtype (e.g.
            ``"float16"``); other tensors keep theirs.
        keep: ``"all"`` calls (default), only the ``"first"``, only the ``"last"``, or at most
            ``N`` calls (the first N; later calls are counted in ``num_calls`` but not kept).
        path: a path into a structured value: a tuple index, a dict key, a dataclass or
            ``ModelOutput`` field, another object's attribute, an argument name, or a dotted
            chain such as ``"hidden_states.2"``.
    """

    #: Short type name used in config dicts; set by subclasses (e.g. ``"ModuleOutputs"``).
    short_name: ClassVar[str] = ""

    def __init__(
        self,
        source: Any,
        *,
        detach: bool = False,
        clone: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        keep: Keep = "all",
        path: PathKey | Sequence[PathKey] | None = None,
    ) -> None:
        check_bool(detach, "detach")
        check_bool(clone, "clone")
        self.source = source
        self.detach = detach
        self.clone = clone
        self.device = parse_device(device)
        self.dtype = parse_dtype(dtype)
        self.keep = keep
        self.path: Path | None = parse_path(path)
        self._limit, self._last = _parse_keep(keep)
        self._transform = make_transform(detach, clone, self.device, self.dtype)
        # The same for a record that is one tensor (the common case), without the tree walk.
        self._one = make_tensor_transform(detach, clone, self.device, self.dtype)
        self._track = not clone
        #: The hooks this recorder owns (removed by :meth:`release`).
        self.hooks = HookSet(repr(self))
        self._streams: dict[str, RecordStream] = {}
        self._recording = False
        self._initialized = False
        self._entered = 0
        self._session = 0
        self._stops = 0  # stop() calls, so that paused() does not undo one
        self._holder: tuple[int, str] | None = None  # (ident, name) of the recording thread
        self._warned_thread = False
        self._model: torch.nn.Module | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A deep copy or an unpickled recorder: its copied streams are its own.
        self.__dict__.update(state)
        for stream in self._streams.values():
            stream._owner = weakref.ref(self)

    # ------------------------------------------------------------------ lifecycle
    def initialize(self, model: torch.nn.Module | None = None) -> BaseRecorder:
        """Find the source and install what records it (inactive until the context is entered).

        Initializing again for the same model does nothing; for another model, the recorder
        moves to it. If preparing fails, nothing is left installed.

        Returns:
            The recorder itself.
        """
        if self._initialized and model is self._model:
            return self
        if self._initialized:
            self.release()
        self._streams = {}
        try:
            self.prepare_from_model(model)
            self._model = model
            self._initialized = True
            self._after_initialize()  # ParameterRecorder's first records (its `path` applied)
        except BaseException:
            self._teardown()
            self._streams = {}
            self._initialized = False
            self._model = None
            raise
        return self

    @abc.abstractmethod
    def prepare_from_model(self, model: torch.nn.Module | None = None) -> None:
        """Locate the source, create streams with :meth:`add_stream`, install hooks.

        Called by :meth:`initialize`; if it raises, everything installed so far is removed.
        """

    def add_stream(self, name: str) -> RecordStream:
        """Create the record stream of one recorded source name (call from
        :meth:`prepare_from_model`)."""
        stream = RecordStream(name, self)
        self._streams[name] = stream
        return stream

    def _after_initialize(self) -> None:
        """Called once streams exist (ParameterRecorder records here)."""

    def _teardown(self) -> None:
        """Remove everything installed by :meth:`prepare_from_model`."""
        self.hooks.remove_all()

    def release(self) -> None:
        """Stop recording, remove every hook and restore every patch. Records stay readable.

        Safe to call any number of times; :meth:`initialize` may be called again afterwards.
        """
        self._recording = False
        self._stops += 1
        self._teardown()
        self._initialized = False
        self._model = None

    @property
    def initialized(self) -> bool:
        """Whether the recorder is initialized (hooks or patches installed)."""
        return self._initialized

    @property
    def recording(self) -> bool:
        """Whether the recorder is recording now (inside its context)."""
        return self._recording

    @property
    def suspended(self) -> bool:
        """Whether the hooks are removed by :meth:`suspend` until the next :meth:`start`."""
        return self.hooks.suspended

    def suspend(self) -> None:
        """Remove the module and gradient hooks until the next :meth:`start` reinstalls them.

        An idle hook still costs its module PyTorch's slow call path on every call; a loop that
        records only some steps suspends the recorder between them. Records stay readable.
        Does nothing while recording. Hooks that ``torch.compile`` has already traced should
        stay installed: removing and reinstalling them makes dynamo recompile.
        """
        if self._initialized and not self._recording:
            self.hooks.suspend()

    def start(self) -> None:
        """Start recording into fresh buffers. Does nothing if already recording.

        A recording belongs to the thread that started it: starting (or entering) the recorder
        from another thread while it records raises, so that two threads never write their
        records into one buffer.

        Raises:
            NotInitializedError: :meth:`initialize` was not called.
            RecorderStateError: another thread is recording with this recorder.
        """
        with _CONTEXT_LOCK:
            self._check_thread()
            self._start_as(_this_thread())

    def _start_as(self, holder: tuple[int, str]) -> None:
        """:meth:`start` once the thread is checked (under ``_CONTEXT_LOCK``), ``holder`` the
        current thread (a manager looks it up once for all its recorders)."""
        if not self._initialized:
            raise NotInitializedError(
                f"{self!r} is not initialized: call `initialize(model)` before recording."
            )
        if not self._recording:
            self._holder = holder
            _STARTED.add(self)
            self._start()

    def _check_thread(self) -> None:
        other = held_elsewhere(self)
        if other is not None:
            raise RecorderStateError(
                f"{self!r} is recording in thread {other!r}: a recorder records for one thread "
                "at a time, so that records of two threads never mix. Give each thread its own "
                "recorder (or manager), or wait until the other thread leaves the context."
            )

    def _start(self) -> None:
        self.hooks.resume()
        self._session += 1
        self._entered += 1
        for stream in self._streams.values():
            stream._reset()
        self._recording = True
        self._on_start()

    def _on_start(self) -> None:
        """Called when recording starts (ParameterRecorder records here)."""

    def records_this_thread(self) -> bool:
        """Whether a call in the current thread belongs to the recording (call while recording).

        A call of the source from a thread other than the one that started the recording is not
        recorded, and reported once with a warning: records of two threads never mix. It is not
        reported where that thread records the same source with a recorder of its own (each
        thread its own recorder): the call is recorded there. (Inside ``torch.compile`` the
        check is left out: the traced graph runs in the caller's thread.)
        """
        holder = self._holder
        if holder is None or is_compiling() or holder[0] == get_ident():
            return True
        if not self._warned_thread and not self._recorded_here_by_another():
            self._warned_thread = True
            warnings.warn(
                f"{self!r} records for thread {holder[1]!r}; a call of its source in thread "
                f"{threading.current_thread().name!r} was not recorded (reported once). Record "
                "in the thread that runs the model (nn.DataParallel runs replicas in worker "
                "threads: use DistributedDataParallel).",
                RuntimeWarning,
                stacklevel=2,
            )
        return False

    def _recorded_here_by_another(self) -> bool:
        """Whether the current thread records this recorder's source with another recorder of
        its own (see :meth:`_same_source`)."""
        me = get_ident()
        with _CONTEXT_LOCK:
            started = list(_STARTED)
        return any(
            other is not self
            and other._recording
            and other._holder is not None
            and other._holder[0] == me
            and self._same_source(other)
            for other in started
        )

    def _same_source(self, other: BaseRecorder) -> bool:
        """Whether ``other`` records what this recorder records: the same kind of record of the
        same source of the same model."""
        return (
            type(other) is type(self)
            and other.source == self.source
            and (other._model is self._model)
        )

    def stop(self) -> None:
        """Stop recording; records stay readable. Does nothing if not recording."""
        self._recording = False
        self._stops += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record no call of the source inside; recording goes on after, into the same records.

        For calls that are not part of what is recorded, such as a second forward pass inside a
        step (``HealthMonitor`` replays a flagged step this way). Does nothing when not
        recording.
        """
        was, session, stops = self._recording, self._session, self._stops
        self._recording = False
        try:
            yield
        finally:
            # A stop() or a new start() inside stands: recording resumes only if neither ran.
            if was and self._session == session and self._stops == stops:
                self._recording = True

    def __enter__(self) -> BaseRecorder:
        with _CONTEXT_LOCK:
            self._check_thread()
            if self._recording:
                raise RecorderStateError(
                    f"{self!r} is already recording: recorder contexts do not nest."
                )
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ records
    def capture(self, stream: RecordStream, value: Any) -> None:
        """Store one record in ``stream`` (hot path: called from hooks while recording).

        Applies the recorder's options: the ``keep`` cap, ``detach``/``clone``/``device``/
        ``dtype``, and a version snapshot for in-place detection.
        """
        calls = stream.num_calls
        stream.num_calls = calls + 1
        if self._limit is not None and calls >= self._limit:
            return
        versions: Versions
        if isinstance(value, torch.Tensor):  # snapshot() and the transform, for one tensor
            one = self._one
            if one is not None:
                value = one(value)
            # An inference tensor has no version counter (see snapshot).
            versions = value._version if self._track and not value.is_inference() else None
        else:
            if self._transform is not None:
                value = self._transform(value)
            versions = snapshot(value) if self._track else None
        if self._last:
            stream._records = [value]
            stream._versions = [versions]
        else:
            stream._records.append(value)
            stream._versions.append(versions)

    def _select(self, value: Any) -> Any:
        """Apply the ``path`` option to a raw value."""
        path = self.path
        return value if path is None else follow_path(value, path, repr(self))

    @property
    def streams(self) -> Mapping[str, RecordStream]:
        """One :class:`RecordStream` per recorded source name (read-only mapping)."""
        self._require_initialized_once()
        return MappingProxyType(self._streams)

    @property
    def is_group(self) -> bool:
        """Whether the source is a pattern or a type (one stream per match)."""
        return False

    def _require_initialized_once(self) -> None:
        if not self._initialized and not self._streams:
            raise NotInitializedError(
                f"{self!r} has not been initialized: call `initialize(model)` first, then record "
                "inside `with recorder:`."
            )

    def _single_stream(self, source: str | None = None) -> RecordStream:
        self._require_initialized_once()
        if source is not None and not isinstance(source, str):
            names = ", ".join(repr(n) for n in self._streams)
            raise RecorderConfigError(
                f"Expected `source` to be the name of a stream of {self!r} (a str: {names}) but "
                f"got {type(source).__name__} {source!r}."
            )
        if source is not None:
            try:
                return self._streams[source]
            except KeyError:
                raise RecorderConfigError(
                    f"{self!r} has no stream {source!r}. "
                    f"{suggestion(source, self._streams, 'streams')}"
                ) from None
        if len(self._streams) == 1 and not self.is_group:
            return next(iter(self._streams.values()))
        names = ", ".join(repr(n) for n in self._streams)
        count = len(self._streams)
        raise RecorderStateError(
            f"{self!r} records {count} source{'' if count == 1 else 's'} ({names}); read one with "
            "`recorder.streams[name]` or `get_record_data(..., source=name)`."
        )

    @property
    def data_buffer(self) -> list[Any]:
        """The records of the (single) source, oldest first."""
        return self._single_stream().data_buffer

    def reset_data_buffer(self) -> None:
        """Forget every record (the recorder stays initialized)."""
        for stream in self._streams.values():
            stream._reset()

    def get_record_data(
        self, record_idx: int = 0, data_idx: int | str | None = None, *, source: str | None = None
    ) -> Any:
        """One record of the source.

        Args:
            record_idx: which call (``0`` the first, ``-1`` the latest).
            data_idx: an index (or argument name) into a tuple, list or arguments record.
            source: the stream to read when the recorder's source is a pattern or type.

        Raises:
            NotInitializedError: the recorder was never initialized.
            NoRecordError: nothing was recorded, or an index is out of range.
            RecordModifiedError: the record was modified in place after it was taken.
        """
        return self._single_stream(source).get_record_data(record_idx, data_idx)

    def _why_empty(self, name: str) -> str:
        if self._entered == 0:
            return (
                f"{self!r} has recorded nothing for {name!r} yet: records are taken only inside "
                "`with recorder:` (or between `start()` and `stop()`)."
            )
        return f"{self!r} recorded nothing for {name!r} in its last context. {self._empty_hint()}"

    def _empty_hint(self) -> str:
        return "The source was never reached inside the context."

    def _modified_cause(self) -> str:
        """The usual cause of a record changed in place, for :class:`RecordModifiedError`."""
        return _MODIFIED_CAUSE

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source!r})"

    def __del__(self) -> None:
        # A recorder dropped without release() must not leave hooks on a live model.
        try:
            if self._initialized:
                self._teardown()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
