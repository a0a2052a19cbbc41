"""`RecorderManager`: named recorders built from plain config dicts, used as one context.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.ReLU(), nn.Conv2d(2, 1, 1))
    >>> manager = RecorderManager({
    ...     "first": {"type": "ModuleOutputs", "source": "0"},
    ...     "last": {"type": "ModuleOutputsRecorder", "source": "2", "detach": True},
    ... })
    >>> manager.initialize(model)
    >>> with manager:
    ...     out = model(torch.randn(1, 1, 4, 4))
    >>> torch.equal(manager.get_recorder("last").get_record_data(), out)
    True
    >>> manager.release()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from types import MappingProxyType, TracebackType
from typing import Any

from torch import nn

from .._core.registry import add_named, apply_all, get_named
from ..errors import DuplicateNameError, RecorderConfigError, RecorderStateError
from ._registry import build_recorder
from .base import _CONTEXT_LOCK, BaseRecorder, RecordStream, _this_thread, held_elsewhere

__all__ = ["RecorderManager"]


_EXAMPLE = "{'feat': {'type': 'ModuleOutputs', 'source': 'layer1'}}"


def _pairs(recorders: object) -> list[tuple[str, Any]]:
    """The ``(name, config)`` pairs of the ``recorders`` argument, checked."""
    if recorders is None:
        return []
    if isinstance(recorders, Mapping):
        pairs = list(recorders.items())
    elif isinstance(recorders, Iterable) and not isinstance(recorders, (str, bytes)):
        pairs = list(recorders)
        for idx, item in enumerate(pairs):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise RecorderConfigError(
                    f"Expected `recorders` to be a mapping {{name: config}} or an iterable of "
                    f"(name, config) pairs but item {idx} is {item!r}, not a (name, config) pair."
                )
    else:
        raise RecorderConfigError(
            f"Expected `recorders` to be a mapping {{name: config}} or an iterable of "
            f"(name, config) pairs but got {type(recorders).__name__} {recorders!r}."
        )
    if not pairs:
        raise RecorderConfigError(
            f"Expected `recorders` to be a non-empty mapping such as {_EXAMPLE} but got "
            f"{recorders!r}; leave it out (None) to add recorders later with `add_recorder`."
        )
    return pairs


class RecorderManager:
    """Several named recorders, initialized, entered and released together.

    Args:
        recorders: ``{name: config}`` where each config is a mapping with ``type`` (short or full
            class name, e.g. ``"ModuleOutputs"`` or ``"ModuleOutputsRecorder"``), ``source`` and
            options — or a recorder instance. An iterable of ``(name, config)`` pairs also works.

            ``None`` (the default) starts empty, for :meth:`add_recorder`; an explicitly empty
            mapping or iterable is an error, since it would silently record nothing.

    Raises:
        DuplicateNameError: a name appears twice.
        UnknownRecorderTypeError, RecorderConfigError: a config is wrong, or ``recorders`` is
            empty or not a mapping or an iterable of ``(name, config)`` pairs.

    A manager records for one thread at a time: entering it from a second thread while the first
    records raises :class:`~lightning_recorder.errors.RecorderStateError` naming the first.
    """

    def __init__(
        self,
        recorders: Mapping[str, Mapping[str, Any] | BaseRecorder]
        | Iterable[tuple[str, Mapping[str, Any] | BaseRecorder]]
        | None = None,
    ) -> None:
        self._recorders: dict[str, BaseRecorder] = {}
        for name, config in _pairs(recorders):
            self.add_recorder(name, config)

    def add_recorder(self, name: str, config: Mapping[str, Any] | BaseRecorder) -> BaseRecorder:
        """Add one recorder (built from ``config``) under ``name`` and return it.

        Raises:
            DuplicateNameError: ``name`` is taken, or the recorder instance ``config`` is
                already in this manager under another name.
        """
        taken = next((n for n, r in self._recorders.items() if r is config), None)
        if taken is not None:
            raise DuplicateNameError(
                f"Expected a recorder not yet in this manager under {name!r} but {config!r} is "
                f"already in it as {taken!r}: one recorder under two names would give its streams "
                "twice. Read it by that name, or add a second recorder (a config dict builds one)."
            )
        return add_named(self._recorders, name, partial(build_recorder, config, name), "recorder")

    @property
    def recorders(self) -> Mapping[str, BaseRecorder]:
        """The recorders by name (read-only)."""
        return MappingProxyType(self._recorders)

    def get_recorder(self, name: str) -> BaseRecorder:
        """The recorder named ``name``.

        Raises:
            RecorderConfigError: no such name (the message lists the closest names).
        """
        if not isinstance(name, str):
            names = ", ".join(repr(n) for n in self._recorders) or "none"
            raise RecorderConfigError(
                f"Expected `name` to be a str but got {type(name).__name__} {name!r}. Recorder "
                f"names: {names}."
            )
        return get_named(self._recorders, name, "recorder")

    def streams(self) -> Iterator[tuple[str, RecordStream]]:
        """``(recorder name, stream)`` for every stream of every initialized recorder."""
        for name, recorder in self._recorders.items():
            recorder._require_initialized_once()  # as `recorder.streams` does
            for stream in recorder._streams.values():
                yield name, stream

    def initialize(self, model: nn.Module | None = None) -> None:
        """Initialize every recorder; on failure the ones already done are released."""
        apply_all(self._recorders.values(), lambda r: r.initialize(model), BaseRecorder.release)

    def release(self) -> None:
        """Release every recorder (newest first): hooks removed, patches restored."""
        errors: list[BaseException] = []
        for recorder in reversed(list(self._recorders.values())):
            try:
                recorder.release()
            except Exception as err:  # keep releasing the others
                errors.append(err)
        if errors:
            raise errors[0]

    @property
    def initialized(self) -> bool:
        """Whether every recorder is initialized."""
        return bool(self._recorders) and all(r.initialized for r in self._recorders.values())

    @property
    def recording(self) -> bool:
        """Whether the recorders are recording now."""
        return any(r.recording for r in self._recorders.values())

    def start(self) -> None:
        """Start every recorder (idempotent); if one cannot start, none is left recording.

        Raises:
            RecorderStateError: another thread records with one of the recorders.
        """
        with _CONTEXT_LOCK:
            for recorder in self._recorders.values():
                recorder._check_thread()
            self._start_idle()

    def _start_idle(self) -> None:
        """Start the recorders not recording (threads checked by the caller, under the lock)."""
        holder = _this_thread()  # looked up once for all the recorders
        idle = [r for r in self._recorders.values() if not r._recording]
        apply_all(idle, lambda r: r._start_as(holder), lambda r: r.stop())  # subclasses' stop

    def suspend(self) -> None:
        """Remove the hooks of every idle recorder until :meth:`start` reinstalls them.

        Patches of functions and methods stay in place; see :meth:`BaseRecorder.suspend`.
        """
        for recorder in self._recorders.values():
            recorder.suspend()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Every recorder :meth:`~lightning_recorder.recorders.base.BaseRecorder.paused` inside:
        no call is recorded, and recording goes on after into the same records."""
        with contextlib.ExitStack() as stack:
            for recorder in self._recorders.values():
                stack.enter_context(recorder.paused())
            yield

    def stop(self) -> None:
        """Stop every recorder (idempotent); records stay readable."""
        for recorder in reversed(self._recorders.values()):
            recorder.stop()

    def reset_data_buffer(self) -> None:
        """Forget every record of every recorder."""
        for recorder in self._recorders.values():
            recorder.reset_data_buffer()

    def __enter__(self) -> RecorderManager:
        with _CONTEXT_LOCK:  # the check and the start are one step for other threads
            for recorder in self._recorders.values():
                other = held_elsewhere(recorder)
                if other is not None:
                    raise RecorderStateError(
                        f"{recorder!r} of this manager is recording in thread {other!r}: a "
                        "manager records for one thread at a time, so that records of two threads "
                        "never mix. Give each thread its own manager, or wait until the other "
                        "thread leaves the context."
                    )
                if recorder.recording:
                    raise RecorderStateError(
                        f"{recorder!r} is already recording, inside a context of this manager "
                        "or started on its own (`start()`, `with recorder:`): manager contexts "
                        "do not nest, and a recorder records one context at a time; stop it "
                        "before entering the manager."
                    )
            self._start_idle()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __contains__(self, name: object) -> bool:
        return name in self._recorders

    def __len__(self) -> int:
        return len(self._recorders)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._recorders.items())
        return f"RecorderManager({inner})"
