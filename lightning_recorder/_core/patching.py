"""One shared patch per (owner, attribute), reference-counted, restored by the last user.

Several recorders may record the same function or method. Each adds a *sink* to the one patch
installed on the owner; the original is restored when the last sink leaves, so recorders can be
released in any order.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import InvalidSourceError, RecorderStateError
from .checks import suggestion

_MISSING = object()

Kind = Literal["function", "method", "staticmethod", "classmethod"]


#: Returned by a :attr:`Sink.replace` callable to let the original run.
CALL_ORIGINAL: Any = object()


@dataclass
class Sink:
    """What a recorder wants to see of each call: arguments before, result after.

    ``replace`` (optional, used by deliveries) runs after every ``before`` and may return the
    call's result instead of running the original, or :data:`CALL_ORIGINAL` to run it. The first
    sink that replaces wins; ``after`` sinks then see the result either way.
    """

    before: Callable[[tuple[Any, ...], dict[str, Any]], None] | None = None
    after: Callable[[tuple[Any, ...], dict[str, Any], Any], None] | None = None
    replace: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None


@dataclass
class Patch:
    owner: Any
    attr: str
    original: Any  # the raw attribute in owner.__dict__, or _MISSING if inherited
    installed: Any
    sinks: tuple[Sink, ...] = field(default_factory=tuple)
    replacers: tuple[Callable[[tuple[Any, ...], dict[str, Any]], Any], ...] = ()

    def set_sinks(self, sinks: tuple[Sink, ...]) -> None:
        self.sinks = sinks
        self.replacers = tuple(s.replace for s in sinks if s.replace is not None)


_ACTIVE: dict[tuple[int, str], Patch] = {}


@dataclass(frozen=True)
class Target:
    """A resolved function or method path."""

    path: str
    owner: Any
    attr: str
    raw: Any  # the raw attribute (function, staticmethod, classmethod, descriptor)
    func: Callable[..., Any]  # the callable to invoke
    kind: Kind


def _import_prefix(path: str) -> tuple[types.ModuleType, list[str]]:
    parts = path.split(".")
    last_error: Exception | None = None
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        try:
            return importlib.import_module(name), parts[i:]
        except ModuleNotFoundError as err:
            missing = err.name or ""
            if not (name == missing or name.startswith(missing + ".")):
                raise InvalidSourceError(
                    f"Importing {name!r} for source {path!r} failed: {err}"
                ) from err
            last_error = err
        except Exception as err:  # an error raised by the module's own import code
            raise InvalidSourceError(
                f"Importing {name!r} for source {path!r} failed: {err}"
            ) from err
    raise InvalidSourceError(
        f"Expected `source` {path!r} to start with an importable module (as in "
        f"'pkg.module.func'), but no prefix of it imports: {last_error}"
    )


def _get(owner: Any, attr: str, path: str, what: str) -> Any:
    try:
        return inspect.getattr_static(owner, attr)
    except AttributeError:
        names = [n for n in dir(owner) if not n.startswith("__")]
        where = getattr(owner, "__name__", repr(owner))
        raise InvalidSourceError(
            f"Source {path!r}: {where} has no {what} {attr!r}. {suggestion(attr, names, 'names')}"
        ) from None


def resolve(path: Any, want: Literal["function", "method"]) -> Target:
    """Resolve ``"pkg.module.func"`` or ``"pkg.module.Class.method"``.

    Raises:
        InvalidSourceError: the path has no dot, does not import, or names something else.
    """
    example = "'pkg.module.func'" if want == "function" else "'pkg.module.Class.method'"
    if not isinstance(path, str) or "." not in path:
        raise InvalidSourceError(
            f"Expected `source` to be a dotted path such as {example} but got {path!r}."
        )
    module, rest = _import_prefix(path)
    if want == "function":
        if len(rest) != 1:
            # A misspelt module ('torch.nn.functionall.relu') is missing here: say so.
            first = _get(module, rest[0], path, "module or attribute")
            hint = (
                " To record a method use MethodOutputsRecorder / MethodInputsRecorder."
                if len(rest) == 2 and isinstance(first, type)
                else ""
            )
            raise InvalidSourceError(
                f"Expected `source` {path!r} to name a function directly inside module "
                f"{module.__name__!r} (as in {example}).{hint}"
            )
        raw = _get(module, rest[0], path, "function")
        if isinstance(raw, (type, types.ModuleType)) or not callable(raw):
            hint = (
                f" To record a method of the class use 'MethodOutputs' with '{path}.<method>'."
                if isinstance(raw, type)
                else ""
            )
            raise InvalidSourceError(
                f"Expected {path!r} to be a function but it is a {type(raw).__name__}.{hint}"
            )
        return Target(path, module, rest[0], raw, raw, "function")
    if len(rest) < 2:
        raise InvalidSourceError(
            f"Expected `source` {path!r} to name a method of a class (as in {example}); "
            "to record a function use FunctionOutputsRecorder / FunctionInputsRecorder."
        )
    owner: Any = module
    for depth, attr in enumerate(rest[:-1]):
        parent, owner = owner, getattr(owner, attr, _MISSING)
        if owner is _MISSING:
            _get(parent, attr, path, "class" if depth == len(rest) - 2 else "module or class")
    if not isinstance(owner, type):
        raise InvalidSourceError(
            f"Expected {'.'.join([module.__name__, *rest[:-1]])!r} to be a class but it is a "
            f"{type(owner).__name__}; to record a function use FunctionOutputsRecorder."
        )
    if _immutable(owner):
        raise _immutable_error(path, owner)
    raw = _get(owner, rest[-1], path, "method")
    if isinstance(raw, staticmethod):
        return Target(path, owner, rest[-1], raw, raw.__func__, "staticmethod")
    if isinstance(raw, classmethod):
        return Target(path, owner, rest[-1], raw, raw.__func__, "classmethod")
    if isinstance(raw, (property, type)) or not callable(raw):
        raise InvalidSourceError(
            f"Expected {path!r} to be a method but it is a {type(raw).__name__}."
        )
    return Target(path, owner, rest[-1], raw, raw, "method")


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE (Python >= 3.10)


def _immutable(cls: type) -> bool:
    """Whether the attributes of ``cls`` cannot be set (a builtin or C extension type)."""
    return bool(cls.__flags__ & _IMMUTABLE_TYPE) or not hasattr(cls, "__dict__")


def _immutable_error(path: str, owner: Any) -> InvalidSourceError:
    name = getattr(owner, "__qualname__", repr(owner))
    return InvalidSourceError(
        f"Expected `source` {path!r} to name a method of a Python class, but {name} is a builtin "
        "(C) type whose methods cannot be patched; record the Python function or module that "
        "calls it instead."
    )


def _make_wrapper(target: Target, patch_box: list[Patch]) -> Any:
    func = target.func

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        patch = patch_box[0]
        sinks = patch.sinks
        if not sinks:
            return func(*args, **kwargs)
        for sink in sinks:
            if sink.before is not None:
                sink.before(args, kwargs)
        result = CALL_ORIGINAL
        for replace in patch.replacers:
            result = replace(args, kwargs)
            if result is not CALL_ORIGINAL:
                break
        if result is CALL_ORIGINAL:
            result = func(*args, **kwargs)
        for sink in sinks:
            if sink.after is not None:
                sink.after(args, kwargs, result)
        return result

    if target.kind == "staticmethod":
        return staticmethod(wrapper)
    if target.kind == "classmethod":
        return classmethod(wrapper)
    return wrapper


def acquire(target: Target, sink: Sink) -> None:
    """Add ``sink`` to the patch on ``target``, installing the patch if it is the first."""
    key = (id(target.owner), target.attr)
    patch = _ACTIVE.get(key)
    if patch is None:
        if inspect.getattr_static(target.owner, target.attr, _MISSING) is not target.raw:
            raise RecorderStateError(
                f"Expected {target.path!r} to be the code found when the recorder was "
                "initialized, but it was replaced since (a module reloaded, a notebook cell "
                "defining it again, another library's patch): recording would run the old code "
                "in its place. Call release() and then initialize() on the recorder (or its "
                "manager) to record the new one."
            )
        original = target.owner.__dict__.get(target.attr, _MISSING)
        box: list[Patch] = []
        installed = _make_wrapper(target, box)
        patch = Patch(target.owner, target.attr, original, installed)
        box.append(patch)
        try:
            setattr(target.owner, target.attr, installed)
        except TypeError as err:  # an immutable type resolve() did not recognise
            raise _immutable_error(target.path, target.owner) from err
        _ACTIVE[key] = patch
    patch.set_sinks((*patch.sinks, sink))


def release(target: Target, sink: Sink) -> None:
    """Remove ``sink``; restore the original when no sink is left. Idempotent."""
    key = (id(target.owner), target.attr)
    patch = _ACTIVE.get(key)
    if patch is None or sink not in patch.sinks:
        return
    patch.set_sinks(tuple(s for s in patch.sinks if s is not sink))
    if patch.sinks:
        return
    del _ACTIVE[key]
    current = patch.owner.__dict__.get(patch.attr, _MISSING)
    if current is not patch.installed:
        warnings.warn(
            f"{target.path!r} was replaced by other code while it was being recorded; the "
            "replacement is left in place (the recording wrapper inside it is now inert).",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    if patch.original is _MISSING:
        delattr(patch.owner, patch.attr)
    else:
        setattr(patch.owner, patch.attr, patch.original)


def active_patches() -> list[str]:
    """``owner.attr`` for every patch currently installed by this package."""
    return sorted(
        f"{getattr(p.owner, '__name__', repr(p.owner))}.{p.attr}" for p in _ACTIVE.values()
    )
