"""Structured values: call arguments in signature order, paths into outputs, tensor transforms.

Everything here runs inside hooks, so the common case (a plain tensor, no options) is kept to a
couple of ``isinstance`` checks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from ..errors import NoRecordError, RecorderConfigError
from .checks import suggestion, with_article
from .compat import torch_op_signatures


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``t`` as ints; for a nested tensor (whose ragged dimensions have no size, or
    a symbolic one), its number of components and each dimension its components share, ``-1``
    where they differ (``(3, -1, 4)``: three components of four features)."""
    if not t.is_nested:
        return tuple(t.shape)  # ints (symbolic sizes stay symbolic: no specialisation in a trace)
    sizes = [part.shape for part in t.unbind()]
    if not sizes:
        return (0,)
    dims = zip(*sizes, strict=True)  # the components have the same number of dimensions
    return (len(sizes), *(int(d[0]) if len(set(d)) == 1 else -1 for d in dims))


def iter_tensors(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor inside a nested structure of tuples, lists, dicts and dataclasses; of a
    ``PackedSequence`` (an RNN's packed input or output), its data only: its other fields are
    the packing's layout (batch sizes and orders), not values."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, PackedSequence):
        yield obj.data
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for field in obj.__dataclass_fields__:
            yield from iter_tensors(getattr(obj, field, None))


PathKey = int | str
Path = tuple[PathKey, ...]


class Arguments(tuple):
    """The arguments of one call, in the callee's signature order.

    A tuple (so ``data_idx`` indexes it as in MMRazor) whose items also have names:
    ``args["mask"]`` or ``args.as_dict()``. ``f(1, 2)``, ``f(1, b=2)`` and ``f(b=2, a=1)`` all give
    ``Arguments((1, 2), names=("a", "b"))``. Defaults are filled in; ``*args`` items are named
    ``args[0]``, ``args[1]`` …; extra ``**kwargs`` follow, sorted by name.

    Examples:
        >>> a = Arguments((1, 2), ("a", "b"))
        >>> a[1], a["b"], a.as_dict()
        (2, 2, {'a': 1, 'b': 2})
    """

    names: tuple[str, ...]

    def __new__(cls, values: Sequence[Any], names: Sequence[str]) -> Arguments:
        obj = super().__new__(cls, values)
        obj.names = tuple(names)
        if len(obj.names) != len(obj):
            raise RecorderConfigError(
                f"Expected `names` to hold one name per value ({len(obj)}) but got "
                f"{len(obj.names)}: {obj.names!r}."
            )
        return obj

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            try:
                return tuple.__getitem__(self, self.names.index(key))
            except ValueError:
                # NoRecordError is an IndexError (a LookupError), as for a missing position.
                raise NoRecordError(
                    f"No argument named {key!r}; arguments are {', '.join(self.names)}. "
                    f"{suggestion(key, self.names, 'argument names')}"
                ) from None
        return tuple.__getitem__(self, key)

    def as_dict(self) -> dict[str, Any]:
        """The arguments as ``{name: value}`` in signature order."""
        return dict(zip(self.names, self, strict=True))

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={v!r}" for n, v in zip(self.names, self, strict=True))
        return f"Arguments({inner})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Arguments, (tuple(self), self.names))


_EMPTY = inspect.Parameter.empty
_VAR_POS = inspect.Parameter.VAR_POSITIONAL
_VAR_KW = inspect.Parameter.VAR_KEYWORD
_SIMPLE_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Binder:
    """Normalises ``(args, kwargs)`` of calls to one callable into :class:`Arguments`.

    The order and names come from ``inspect.signature``; for a torch C function or ``Tensor``
    method (``torch.relu``, ``F.linear``), which has none, from its ATen schemas, trying each
    overload in turn. A call no signature accepts (or a callable with none) is recorded as
    ``args[0]``, ``args[1]`` … then keyword arguments sorted by name.

    Args:
        fn: the callable whose signature orders the arguments.
        drop_first: drop the first parameter (``self`` / ``cls``) from the signature.
    """

    __slots__ = ("_all_kinds", "_fast_names", "_kinds", "_sigs", "from_python")

    def __init__(self, fn: Callable[..., Any], drop_first: bool = False) -> None:
        #: Whether the signature is the callable's own (``inspect.signature``), not taken from
        #: ATen schemas, which do not cover every spelling a torch function's binding accepts.
        self.from_python = True
        try:
            sigs: tuple[inspect.Signature, ...] = (inspect.signature(fn),)
        except (TypeError, ValueError):
            sigs = torch_op_signatures(fn)
            self.from_python = False
        if drop_first:
            sigs = tuple(sig.replace(parameters=list(sig.parameters.values())[1:]) for sig in sigs)
        self._sigs = sigs
        self._all_kinds: tuple[dict[str, Any], ...] = tuple(
            {p.name: p.kind for p in sig.parameters.values()} for sig in sigs
        )
        #: The parameter kinds of the first signature, by name (read by the module recorders).
        self._kinds: dict[str, Any] = self._all_kinds[0] if sigs else {}
        # Fast path: one signature, every parameter positional, all of them passed.
        if len(sigs) == 1 and all(p.kind in _SIMPLE_KINDS for p in sigs[0].parameters.values()):
            self._fast_names: tuple[str, ...] | None = tuple(sigs[0].parameters)
        else:
            self._fast_names = None

    @property
    def signature(self) -> inspect.Signature | None:
        """The callable's (first) signature, or ``None`` when it has none."""
        return self._sigs[0] if self._sigs else None

    def check_key(self, key: PathKey, owner: str, where: str, *, items: bool = True) -> None:
        """Raise unless some call can give a record that ``key`` (a ``path``'s first item) indexes.

        ``items``: whether ``*args`` items count by their record names (``"args[0]"``).

        Raises:
            RecorderConfigError: no signature has such an argument name or position; the
                message names ``owner`` (the recorder) and ``where`` (the callable).
        """
        if not self._sigs:
            return  # recorded as the call was made: any key may exist
        names: list[str] = []
        positions = 0
        for sig in self._sigs:
            params = list(sig.parameters.values())
            kinds = {p.kind for p in params}
            named = [p.name for p in params if p.kind not in (_VAR_POS, _VAR_KW)]
            var_pos = next((p.name for p in params if p.kind is _VAR_POS), None)
            if isinstance(key, int) and (kinds & {_VAR_POS, _VAR_KW} or key < len(named)):
                return
            if isinstance(key, str) and (
                key in named
                or _VAR_KW in kinds
                or (items and var_pos is not None and _is_item(key, var_pos))
            ):
                return
            names += named + ([f"{var_pos}[0]"] if items and var_pos is not None else [])
            positions = max(positions, len(named))
        if isinstance(key, int):
            raise RecorderConfigError(
                f"Expected `path` of {owner} to start with a position below {positions} (the "
                f"arguments of {where}) but got {key!r}."
            )
        raise RecorderConfigError(
            f"Expected `path` of {owner} to start with an argument of {where} but got {key!r}. "
            f"{suggestion(key, dict.fromkeys(names), 'argument names')}"
        )

    def __call__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Arguments:
        fast = self._fast_names
        if fast is not None and not kwargs and len(args) == len(fast):
            return Arguments(args, fast)
        for sig, kinds in zip(self._sigs, self._all_kinds, strict=True):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                continue
            return self._ordered(bound, kinds)
        return self._fallback(args, kwargs)

    @staticmethod
    def _ordered(bound: inspect.BoundArguments, kinds: dict[str, Any]) -> Arguments:
        bound.apply_defaults()
        values: list[Any] = []
        names: list[str] = []
        for name, value in bound.arguments.items():
            kind = kinds[name]
            if kind is _VAR_POS:
                for i, item in enumerate(value):
                    values.append(item)
                    names.append(f"{name}[{i}]")
            elif kind is _VAR_KW:
                for key in sorted(value):
                    values.append(value[key])
                    # A key may repeat a positional-only parameter's name: keep names unique.
                    names.append(key if key not in kinds else f"{name}[{key!r}]")
            else:
                values.append(value)
                names.append(name)
        return Arguments(values, names)

    @staticmethod
    def _fallback(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Arguments:
        names = [f"args[{i}]" for i in range(len(args))] + sorted(kwargs)
        values = list(args) + [kwargs[k] for k in sorted(kwargs)]
        return Arguments(values, names)


def parse_path(path: PathKey | Sequence[PathKey] | None) -> Path | None:
    """Normalise a path option: ``0``, ``"logits"``, ``"hidden_states.2"`` or ``("a", 0)``."""
    if path is None:
        return None
    if isinstance(path, bool):
        raise RecorderConfigError(
            f"Expected `path` to be an int, a str or a sequence but got {path!r}."
        )
    if isinstance(path, int):
        return (path,)
    if isinstance(path, str):
        if not path:
            raise RecorderConfigError(
                "Expected `path` to be a non-empty string but got ''; leave `path` out (None) "
                "to take the whole value."
            )
        parts = path.split(".")
        if "" in parts:
            raise RecorderConfigError(
                f"Expected `path` to be keys or indices joined by single dots, such as "
                f"'hidden_states.2', but got {path!r}, which has an empty item."
            )
        return tuple(int(p) if p.lstrip("-").isdigit() else p for p in parts)
    if isinstance(path, Sequence) and not isinstance(path, (bytes, bytearray)):
        keys = tuple(path)
        if not keys:  # as '' is refused: no key names no part of the value
            raise RecorderConfigError(
                f"Expected `path` to name at least one key or index but got {path!r}; leave "
                "`path` out (None) to take the whole value."
            )
        for key in keys:
            if isinstance(key, bool) or not isinstance(key, (int, str)):
                raise RecorderConfigError(
                    f"Expected every `path` item to be an int or a str but got {key!r}."
                )
        return keys
    raise RecorderConfigError(
        f"Expected `path` to be an int, a str or a sequence of them but got {type(path).__name__}."
    )


def _describe(obj: Any) -> str:
    """What ``obj`` is, with its article, for messages ("a tuple of length 2")."""
    if isinstance(obj, Arguments):
        return f"the call's arguments ({', '.join(obj.names)})"
    if isinstance(obj, Mapping):
        what = f"{type(obj).__name__} with keys {', '.join(repr(k) for k in obj)}"
    elif isinstance(obj, (tuple, list)):
        what = f"{type(obj).__name__} of length {len(obj)}"
    elif dataclasses.is_dataclass(obj):
        fields = ", ".join(f.name for f in dataclasses.fields(obj))
        what = f"{type(obj).__name__} with fields {fields}"
    elif isinstance(obj, torch.Tensor):
        what = f"Tensor of shape {shape_of(obj)}"
    else:
        what = type(obj).__name__
    return with_article(what)


def _is_item(key: str, var_pos: str) -> bool:
    """Whether ``key`` names an item of ``*var_pos`` as records do (``"args[0]"``)."""
    index = key.removeprefix(f"{var_pos}[").removesuffix("]")
    return key == f"{var_pos}[{index}]" and index.isdigit()


def follow_path(value: Any, path: Path, where: str) -> Any:
    """Follow ``path`` into ``value``: an index, a mapping key, a field or other attribute (an
    instance's own, such as a Hugging Face cache's ``layers``), or an argument name.

    Raises:
        RecorderConfigError: a key does not exist; the message shows what does.
    """
    current = value
    for depth, key in enumerate(path):
        try:
            if (
                isinstance(current, Arguments)
                or (isinstance(current, Mapping) and not isinstance(key, int))
                or (isinstance(current, (tuple, list)) and isinstance(key, int))
            ):
                container: Any = current
                current = container[key]
            elif isinstance(key, str) and (
                dataclasses.is_dataclass(current) or hasattr(current, key)
            ):
                current = getattr(current, key)
            elif isinstance(current, Mapping):
                current = current[key]
            else:
                raise LookupError(key)
        except (LookupError, AttributeError):
            walked = ".".join(str(k) for k in path[:depth])
            walked = f"`{walked}`" if walked else "the recorded value"
            hint = ""
            if isinstance(current, torch.Tensor):  # nothing to choose inside a tensor
                hint = (
                    "; a tensor has no items: end `path` before it"
                    if depth
                    else "; a tensor has no items: leave `path` out to take the whole output"
                )
            raise RecorderConfigError(
                f"{where}: `path` item {key!r} does not exist in {walked}, which is "
                f"{_describe(current)}{hint}."
            ) from None
    return current


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Arguments):
        return Arguments([map_tensors(v, fn) for v in value], value.names)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, Mapping):
        items = {k: map_tensors(v, fn) for k, v in value.items()}
        factory: Any = type(value)
        try:
            return factory(**items) if dataclasses.is_dataclass(value) else factory(items)
        except TypeError:
            return items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: map_tensors(getattr(value, f.name), fn)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    return value


# ``t.detach()`` as one C call (a subclass's own ``detach`` is still the one called).
_detach: Callable[[torch.Tensor], torch.Tensor] = operator.methodcaller("detach")


def _detach_clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def make_tensor_transform(
    detach: bool, clone: bool, device: torch.device | None, dtype: torch.dtype | None
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The transform of one tensor for these options, or ``None`` when it is the identity.

    The common cases are one C call, or one small function: a hook applies it to every record.
    """
    if device is None and dtype is None:
        if detach and clone:
            return _detach_clone
        if detach:
            return _detach
        return _clone if clone else None
    # A partial of module-level functions, not a closure: a recorder (or a model holding one)
    # stays picklable, for ddp_spawn and other worker processes.
    return functools.partial(_convert, detach, clone, device, dtype)


def _convert(
    detach: bool,
    clone: bool,
    device: torch.device | None,
    dtype: torch.dtype | None,
    t: torch.Tensor,
) -> torch.Tensor:
    out = t.detach() if detach else t
    if device is not None or (dtype is not None and out.is_floating_point()):
        out = out.to(device=device, dtype=dtype if out.is_floating_point() else None, copy=clone)
        return out
    return out.clone() if clone else out


def _map_with(one: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    return map_tensors(value, one)


def make_transform(
    detach: bool, clone: bool, device: torch.device | None, dtype: torch.dtype | None
) -> Callable[[Any], Any] | None:
    """The per-record transform for these options, or ``None`` when it is the identity."""
    one = make_tensor_transform(detach, clone, device, dtype)
    if one is None:
        return None
    return functools.partial(_map_with, one)


Versions = int | list[tuple[torch.Tensor, int]] | None


def snapshot(value: Any) -> Versions:
    """The version counters of the tensors in ``value`` (``None`` when it holds none).

    Inference tensors (made under ``torch.inference_mode()``) have no version counter and are
    left out: their in-place changes cannot be detected.
    """
    if isinstance(value, torch.Tensor):
        # An inference tensor has no version counter; asking first is cheaper than the error.
        return None if value.is_inference() else value._version
    pairs = [(t, t._version) for t in iter_tensors(value) if not t.is_inference()]
    return pairs or None


def modified(value: Any, versions: Versions) -> bool:
    """Whether a tensor in ``value`` was modified in place since :func:`snapshot`."""
    if versions is None:
        return False
    if isinstance(versions, int):
        return bool(value._version != versions)
    return any(t._version != v for t, v in versions)


def copied_snapshot(value: Any, was_modified: bool) -> Versions:
    """:func:`snapshot` of a copy of a record (a deep copy, an unpickled one): a copied tensor
    counts its versions afresh, so the copy is snapshot again; a record that was modified in
    place before it was copied gets counters it never matches, so it still reads as modified."""
    versions = snapshot(value)
    if not was_modified or versions is None:
        return versions
    if isinstance(versions, int):
        return -1
    return [(t, -1) for t, _ in versions]
