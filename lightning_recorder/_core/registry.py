"""Named things: one registry of types for every config ``type``, and named groups.

* :class:`Registry` maps names (a class name, a short name, aliases) to classes, and is the one
  resolver behind recorder, delivery and loss ``type`` names: a misspelt type raises the same
  :class:`~lightning_recorder.errors.UnknownRecorderTypeError` wherever it is written, with the
  closest valid names.
* :func:`option_names` and :func:`build_from_config` turn ``{"type": ..., **options}`` into an
  instance, rejecting unknown options with the closest valid ones.
* :func:`add_named`, :func:`get_named` and :func:`apply_all` give managers unique names, helpful
  lookups and all-or-nothing actions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from ..errors import DuplicateNameError, RecorderConfigError, UnknownRecorderTypeError
from .checks import check_keys, closest, suggestion

T = TypeVar("T")
C = TypeVar("C", bound=type)


class Registry(Generic[C]):
    """Names of the types of one kind (recorders, deliveries, losses).

    Args:
        what: the kind, for messages (``"recorder"``).
        normalise: turns a user's spelling into a key (default: unchanged); lookups and
            registrations both go through it.

    Examples:
        >>> reg = Registry("shape")
        >>> _ = reg.register(int, ["Int", "I"])
        >>> reg.resolve("I", "shape config")
        <class 'int'>
    """

    def __init__(self, what: str, normalise: Callable[[str], str] | None = None) -> None:
        self.what = what
        self._normalise = normalise or (lambda name: name)
        self._types: dict[str, C] = {}

    def register(self, cls: C, names: Iterable[str], *, replace: bool = False) -> C:
        """Register ``cls`` under every name in ``names`` (all or none).

        Raises:
            DuplicateNameError: a name is taken by another class and ``replace`` is false.
        """
        keys = [self._normalise(n) for n in names]
        for key in keys:
            taken = self._types.get(key)
            if taken is not None and taken is not cls and not replace:
                raise DuplicateNameError(
                    f"A {self.what} type named {key!r} is already registered "
                    f"({taken.__module__}.{taken.__qualname__}); pass replace=True to replace "
                    "it, or choose another name."
                )
        for key in keys:
            self._types[key] = cls
        return cls

    def mapping(self) -> Mapping[str, C]:
        """Every registered name (read-only)."""
        return MappingProxyType(self._types)

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self._types)

    def get(self, name: str) -> C | None:
        """The class registered as ``name``, or ``None``."""
        return self._types.get(self._normalise(name))

    def resolve(self, name: object, where: str) -> C:
        """The class registered as ``name``.

        Raises:
            UnknownRecorderTypeError: ``name`` is missing, not a str, or unknown; the message
                gives the closest names and every valid one.
        """
        valid = self.names()
        if name is None:
            raise UnknownRecorderTypeError(
                f"Expected {where} to have a 'type' key; valid {self.what} types: "
                f"{', '.join(valid)}."
            )
        found = self.get(name) if isinstance(name, str) else None
        if found is None:
            # close matches first; without one, the full list below says it (not a part twice)
            near = suggestion(str(name), valid, "types") + " " if closest(str(name), valid) else ""
            raise UnknownRecorderTypeError(
                f"Unknown {self.what} type {name!r} in {where}. {near}"
                f"Valid {self.what} types: {', '.join(valid)}."
            )
        return found


def option_names(cls: type) -> list[str]:
    """The keyword options of ``cls``'s constructors, subclass first, without duplicates."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # pragma: no cover - a C constructor
            continue
        for p in params:
            keyword = p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            if keyword and p.name != "self" and p.name not in names:
                names.append(p.name)
    return names


def build_from_config(
    registry: Registry[Any],
    config: Mapping[str, Any],
    where: str,
    *,
    required: Sequence[str] = ("source",),
    renames: Mapping[str, str] | None = None,
    name_errors: bool = False,
) -> Any:
    """Build ``registry``'s type named by ``config["type"]`` with the other keys as options.

    Args:
        registry: the registry that resolves ``type``.
        config: ``{"type": ..., **options}``.
        where: how messages name the config (``"recorder 'conv'"``).
        required: keys that must be present.
        renames: other spellings of option names (``{"func_path": "source"}``).
        name_errors: start the message of a :class:`RecorderConfigError` that the type's
            constructor raises (an invalid option value) with ``where``, so that the config at
            fault is named among several.

    Raises:
        UnknownRecorderTypeError: ``type`` is missing or unknown.
        RecorderConfigError: an option is unknown (closest names given) or a required key is
            missing.
    """
    options = dict(config)
    cls = registry.resolve(options.pop("type", None), where)
    for alias, target in (renames or {}).items():
        if alias in options:
            if target in options:
                raise RecorderConfigError(
                    f"Expected one of {target!r} and {alias!r} in {where} but got both."
                )
            options[target] = options.pop(alias)
    check_keys(options, option_names(cls), f"{cls.__name__} {where}", "option")
    for key in required:
        if key not in options:
            raise RecorderConfigError(f"Expected {where} to have a {key!r} key.")
    if not name_errors:
        return cls(**options)
    try:
        return cls(**options)
    except RecorderConfigError as err:
        raise type(err)(f"In {where}: {err}") from None


def named_items(items: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> Iterable[Any]:
    """``(name, value)`` pairs from a mapping, an iterable of pairs, or ``None``."""
    return items.items() if isinstance(items, Mapping) else (items or ())


def add_named(group: dict[str, T], name: object, build: Callable[[], T], what: str) -> T:
    """Add ``build()`` to ``group`` under ``name``, a new non-empty str.

    Raises:
        RecorderConfigError: ``name`` is not a non-empty str.
        DuplicateNameError: ``name`` is taken.
    """
    if not isinstance(name, str) or not name:
        raise RecorderConfigError(f"Expected a non-empty str {what} name but got {name!r}.")
    if name in group:
        raise DuplicateNameError(
            f"A {what} named {name!r} already exists in this manager; names must be unique."
        )
    group[name] = value = build()
    return value


def get_named(group: Mapping[str, T], name: str, what: str) -> T:
    """``group[name]``, or an error that lists the closest names."""
    try:
        return group[name]
    except KeyError:
        near = suggestion(name, group, f"{what} names")
        raise RecorderConfigError(f"No {what} named {name!r}. {near}") from None


def apply_all(items: Iterable[T], do: Callable[[T], object], undo: Callable[[T], object]) -> None:
    """Call ``do`` on every item; if one raises, ``undo`` the ones done (newest first) and re-raise.

    Examples:
        >>> done = []
        >>> apply_all([1, 2], done.append, done.remove)
        >>> done
        [1, 2]
    """
    done: list[T] = []
    try:
        for item in items:
            do(item)
            done.append(item)
    except BaseException:
        for item in reversed(done):
            undo(item)
        raise
