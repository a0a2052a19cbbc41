"""The registry of recorder types: what a config dict's ``type`` may name.

Every built-in recorder registers itself when its module is imported (``recorders/__init__``
imports them all), so any import of the recorders fills the registry before a manager reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

from .._core.checks import check_bool
from .._core.registry import Registry, build_from_config
from ..errors import RecorderConfigError
from .base import BaseRecorder

R = TypeVar("R", bound=type[BaseRecorder])

#: Recorder types by full class name and short name.
RECORDERS: Registry[type[BaseRecorder]] = Registry("recorder")


def _names_for(cls: type[BaseRecorder], name: str | None) -> list[str]:
    full = name or cls.__name__
    names = [full]
    # The class's own short name: one inherited from a registered parent is the parent's.
    short = cls.__dict__.get("short_name") or full.removesuffix("Recorder")
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

    The class is registered under its class name and its own ``short_name`` (or, when it
    defines none, the class name without the ``Recorder`` suffix; a parent's is not reused).
    Use as a decorator, with or without arguments.

    Args:
        cls: a :class:`~lightning_recorder.BaseRecorder` subclass.
        name: the full name to register (default: the class name).
        replace: allow replacing an existing registration of the same name.

    Raises:
        DuplicateNameError: the name is taken and ``replace`` is false.
        RecorderConfigError: ``cls`` is not a BaseRecorder subclass, ``name`` is not a non-empty
            str, or ``replace`` is not a bool.

    Examples:
        >>> from lightning_recorder import ModuleOutputsRecorder, register_recorder
        >>> @register_recorder
        ... class SignRecorder(ModuleOutputsRecorder):
        ...     short_name = "Sign"
        >>> "Sign" in recorder_types()
        True
    """

    if name is not None and (not isinstance(name, str) or not name):
        raise RecorderConfigError(
            f"Expected `name` of register_recorder to be a non-empty str (the type name configs "
            f"use) or None (the class name) but got {name!r}."
        )
    check_bool(replace, "replace", "register_recorder")

    def apply(klass: R) -> R:
        if not (isinstance(klass, type) and issubclass(klass, BaseRecorder)):
            raise RecorderConfigError(
                f"Expected a BaseRecorder subclass to register but got {klass!r}."
            )
        RECORDERS.register(klass, _names_for(klass, name), replace=replace)
        return klass

    return apply if cls is None else apply(cls)


def recorder_types() -> Mapping[str, type[BaseRecorder]]:
    """Every registered recorder type, by full and short name."""
    return RECORDERS.mapping()


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
    return build_from_config(RECORDERS, config, where, name_errors=bool(name))
