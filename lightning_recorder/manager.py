"""`RecorderManager`: named recorders built from plain config dicts, used as one context.

Example:
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

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from types import MappingProxyType, TracebackType
from typing import Any, TypeVar, overload

from torch import nn

from ._group import add_named, apply_all, get_named, named_items
from ._names import check_keys, suggestion
from .base import BaseRecorder, RecordStream
from .errors import (
    DuplicateNameError,
    RecorderConfigError,
    RecorderStateError,
    UnknownRecorderTypeError,
)

__all__ = ["RecorderManager", "build_recorder", "recorder_types", "register_recorder"]

R = TypeVar("R", bound=type[BaseRecorder])

_REGISTRY: dict[str, type[BaseRecorder]] = {}


def _names_for(cls: type[BaseRecorder], name: str | None) -> list[str]:
    full = name or cls.__name__
    names = [full]
    short = cls.short_name or full.removesuffix("Recorder")
    if short != full:
        names.append(short)
    return names


@overload
def register_recorder(cls: R, *, name: str | None = None, replace: bool = False) -> R: ...
@overload
def register_recorder(
    cls: None = None, *, name: str | None = None, replace: bool = False
) -> Callable[[R], R]: ...
def register_recorder(
    cls: R | None = None, *, name: str | None = None, replace: bool = False
) -> R | Callable[[R], R]:
    """Register a recorder class so config dicts can name it in ``type``.

    The class is registered under its class name and its ``short_name`` (or the class name
    without the ``Recorder`` suffix). Use as a decorator, with or without arguments.

    Args:
        cls: a :class:`~lightning_recorder.BaseRecorder` subclass.
        name: the full name to register (default: the class name).
        replace: allow replacing an existing registration of the same name.

    Raises:
        DuplicateNameError: the name is taken and ``replace`` is false.
        RecorderConfigError: ``cls`` is not a BaseRecorder subclass.

    Example:
        >>> from lightning_recorder import ModuleOutputsRecorder, register_recorder
        >>> @register_recorder
        ... class SignRecorder(ModuleOutputsRecorder):
        ...     short_name = "Sign"
        >>> "Sign" in recorder_types()
        True
    """

    def apply(klass: R) -> R:
        if not (isinstance(klass, type) and issubclass(klass, BaseRecorder)):
            raise RecorderConfigError(
                f"Expected a BaseRecorder subclass to register but got {klass!r}."
            )
        keys = _names_for(klass, name)
        for key in keys:
            if key in _REGISTRY and _REGISTRY[key] is not klass and not replace:
                raise DuplicateNameError(
                    f"A recorder type named {key!r} is already registered "
                    f"({_REGISTRY[key].__module__}.{_REGISTRY[key].__qualname__}); pass "
                    "replace=True to replace it, or choose another name."
                )
        for key in keys:
            _REGISTRY[key] = klass
        return klass

    return apply if cls is None else apply(cls)


def recorder_types() -> Mapping[str, type[BaseRecorder]]:
    """Every registered recorder type, by full and short name."""
    return MappingProxyType(_REGISTRY)


def _option_names(cls: type[BaseRecorder]) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for p in inspect.signature(init).parameters.values():
            keyword = p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            if keyword and p.name != "self" and p.name not in names:
                names.append(p.name)
    return names


def build_recorder(config: Mapping[str, Any] | BaseRecorder, name: str = "") -> BaseRecorder:
    """Build a recorder from ``{"type": ..., "source": ..., **options}`` (or pass one through).

    Raises:
        UnknownRecorderTypeError: ``type`` is missing or names no registered recorder.
        RecorderConfigError: an option is unknown or invalid.
    """
    if isinstance(config, BaseRecorder):
        return config
    where = f"recorder {name!r}" if name else "recorder config"
    if not isinstance(config, Mapping):
        raise RecorderConfigError(
            f"Expected {where} to be a mapping such as {{'type': 'ModuleOutputs', 'source': "
            f"'conv1'}} or a recorder instance but got {type(config).__name__}."
        )
    options = dict(config)
    type_name = options.pop("type", None)
    valid = sorted(_REGISTRY)
    if type_name is None:
        raise UnknownRecorderTypeError(
            f"Expected {where} to have a 'type' key; valid types: {', '.join(valid)}."
        )
    cls = _REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise UnknownRecorderTypeError(
            f"Unknown recorder type {type_name!r} in {where}. "
            f"{suggestion(str(type_name), valid, 'types')} Valid types: {', '.join(valid)}."
        )
    check_keys(options, _option_names(cls), f"{type_name} {where}", "option")
    if "source" not in options:
        raise RecorderConfigError(f"Expected {where} to have a 'source' key.")
    return cls(**options)


class RecorderManager:
    """Several named recorders, initialized, entered and released together.

    Args:
        recorders: ``{name: config}`` where each config is a mapping with ``type`` (short or full
            class name, e.g. ``"ModuleOutputs"`` or ``"ModuleOutputsRecorder"``), ``source`` and
            options — or a recorder instance. An iterable of ``(name, config)`` pairs also works.

    Raises:
        DuplicateNameError: a name appears twice.
        UnknownRecorderTypeError, RecorderConfigError: a config is wrong.
    """

    def __init__(
        self,
        recorders: Mapping[str, Mapping[str, Any] | BaseRecorder]
        | Iterable[tuple[str, Mapping[str, Any] | BaseRecorder]]
        | None = None,
    ) -> None:
        self._recorders: dict[str, BaseRecorder] = {}
        for name, config in named_items(recorders):
            self.add_recorder(name, config)

    def add_recorder(self, name: str, config: Mapping[str, Any] | BaseRecorder) -> BaseRecorder:
        """Add one recorder (built from ``config``) under ``name`` and return it."""
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
        return get_named(self._recorders, name, "recorder")

    def streams(self) -> Iterator[tuple[str, RecordStream]]:
        """``(recorder name, stream)`` for every stream of every initialized recorder."""
        for name, recorder in self._recorders.items():
            for stream in recorder.streams.values():
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
        """Start every recorder (idempotent); if one cannot start, none is left recording."""
        idle = [r for r in self._recorders.values() if not r.recording]
        apply_all(idle, BaseRecorder.start, BaseRecorder.stop)

    def suspend(self) -> None:
        """Remove the hooks of every idle recorder until :meth:`start` reinstalls them.

        Patches of functions and methods stay in place; see :meth:`BaseRecorder.suspend`.
        """
        for recorder in self._recorders.values():
            recorder.suspend()

    def stop(self) -> None:
        """Stop every recorder (idempotent); records stay readable."""
        for recorder in reversed(list(self._recorders.values())):
            recorder.stop()

    def reset_data_buffer(self) -> None:
        """Forget every record of every recorder."""
        for recorder in self._recorders.values():
            recorder.reset_data_buffer()

    def __enter__(self) -> RecorderManager:
        for recorder in self._recorders.values():
            if recorder.recording:
                raise RecorderStateError(
                    f"{recorder!r} is already recording: manager contexts do not nest."
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

    def __contains__(self, name: object) -> bool:
        return name in self._recorders

    def __len__(self) -> int:
        return len(self._recorders)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._recorders.items())
        return f"RecorderManager({inner})"
