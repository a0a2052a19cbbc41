r"""Module and parameter names: wrapper prefixes, glob and regex patterns, module types.

**How a string source selects** (recorders, callbacks, the monitor, bulk ``types=``):

* an exact name from ``named_modules()`` / ``named_parameters()`` of the model (the
  LightningModule in a callback: ``net.layer1`` when the network is ``self.net``);
* a glob pattern (``fnmatch``): ``*`` matches any run of characters *including dots*, so
  ``"layer*.0"`` also matches ``layer2.0.downsample.0``; ``[!.]`` matches one character that is
  not a dot;
* ``"re:<regex>"``: a regular expression that must match the *whole* name (``re.fullmatch``),
  for one-level selections such as ``r"re:layer\d\.0"``;
* a class: a type, a dotted path (``"transformers.models.bert.modeling_bert.BertLayer"``), or a
  bare class name. A bare name of a ``torch.nn`` class (``"Conv2d"``) means that class; any other
  capitalised bare name (``"BertLayer"``, ``"Bottleneck"``) selects the modules whose class, or
  one of its base classes, has that name, wherever it is defined. When several different classes
  in the model share the name, all of their modules are selected: give the dotted path to pick
  one. A module whose *name* equals the string wins over a class of that name.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import cast

from torch import nn

from ..errors import RecorderConfigError, UnknownSourceError
from .checks import closest_hint, suggestion, with_article

# Attribute names that wrappers (DDP, torch.compile, FSDP, activation checkpointing, Lightning
# Fabric's ``fabric.setup``) insert between a model and its submodules. A user names ``conv1``,
# not ``module._orig_mod.conv1``.
WRAPPER_PREFIXES = (
    "module",
    "_orig_mod",
    "_fsdp_wrapped_module",
    "_checkpoint_wrapped_module",
    "_forward_module",
)
_WRAPPER_SET = frozenset(WRAPPER_PREFIXES)
_GLOB_CHARS = frozenset("*?[")
REGEX_PREFIX = "re:"


def canonical_name(name: str) -> str:
    """Drop wrapper components (``module.``, ``_orig_mod.`` …) from a dotted module name.

    >>> canonical_name("module._orig_mod.features.0")
    'features.0'
    """
    if not name:
        return name
    parts = [p for p in name.split(".") if p not in _WRAPPER_SET]
    return ".".join(parts)


def named_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``model.named_modules()`` keyed by canonical names (wrapper prefixes removed).

    When the model is wrapped, the root entry ``""`` is the innermost wrapped module (the
    user's model), so that hooks never land on a DDP or compile wrapper.
    """
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=True):
        key = canonical_name(name)
        # Prefer the innermost module for the root (the unwrapped model).
        if key == "" or key not in found:
            found[key] = module
    return found


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``model.named_parameters()`` keyed by canonical names."""
    return {canonical_name(n): p for n, p in model.named_parameters(remove_duplicate=True)}


def refuse_second_name(
    model: nn.Module, source: object, what: str, items: Mapping[str, object]
) -> None:
    """Raise when ``source``, a name or pattern that :func:`select` did not find in ``items``
    (the deduplicated names of ``what``, ``"module"`` or ``"parameter"``), names only objects
    that ``items`` list under another name: a tied parameter or a module registered twice, which
    ``named_modules()`` / ``named_parameters()`` list once.

    Raises:
        UnknownSourceError: the message names the listed name to record instead.
    """
    if not isinstance(source, str):
        return
    every = (
        model.named_parameters(remove_duplicate=False)
        if what == "parameter"
        else model.named_modules(remove_duplicate=False)
    )
    if not is_glob(source):
        key = canonical_name(source)
        if key in items:
            return
        shared = next((obj for name, obj in every if canonical_name(name) == key), None)
        listed = next((name for name, obj in items.items() if obj is shared), None)
        if shared is not None and listed is not None:
            raise UnknownSourceError(
                f"No {what} named {source!r} in named_{what}s(): {source!r} is a second name of "
                f"the {what} {listed!r} (shared or tied, the same object), which named_{what}s() "
                f"lists once. Record {listed!r}."
            )
        return
    matches = _matcher(source)
    if any(matches(name) for name in items if name):
        return
    listed_as = {id(obj): name for name, obj in items.items()}
    seconds = {
        key: listed_as[id(obj)]
        for key, obj in ((canonical_name(name), obj) for name, obj in every)
        if key and matches(key) and key not in items and id(obj) in listed_as
    }
    if seconds:
        shown = ", ".join(
            f"{second!r} (listed as {first!r})" for second, first in list(seconds.items())[:5]
        ) + (" …" if len(seconds) > 5 else "")
        raise UnknownSourceError(
            f"The pattern {source!r} matches no name in named_{what}s(), only second names of "
            f"{what}s listed once under another name (shared or tied, the same object): "
            f"{shown}. Select them by the names listed."
        )


def _matcher(source: str) -> Callable[[str], bool]:
    """Whether a name matches a glob pattern or a ``"re:"`` regular expression (whole name)."""
    if is_regex(source):
        pattern = _compile(source)
        return lambda name: pattern.fullmatch(name) is not None
    key = canonical_name(source)
    return lambda name: fnmatch.fnmatchcase(name, key)


def is_regex(source: object) -> bool:
    """Whether a source is a ``"re:"`` regular expression over names."""
    return isinstance(source, str) and source.startswith(REGEX_PREFIX)


def is_glob(source: str) -> bool:
    r"""Whether a name is a pattern: it holds glob characters (``*``, ``?``, ``[``) or is a
    ``"re:"`` regular expression.

    >>> is_glob("layer*.conv1"), is_glob("layer1.conv1"), is_glob(r"re:layer\d")
    (True, False, True)
    """
    return is_regex(source) or any(ch in _GLOB_CHARS for ch in source)


def is_pattern(source: object) -> bool:
    """Whether a module source selects by pattern or type rather than one exact name."""
    if isinstance(source, str):
        return is_glob(source)
    return isinstance(source, type) or (
        isinstance(source, tuple) and all(isinstance(t, type) for t in source)
    )


def _compile(source: str) -> re.Pattern[str]:
    try:
        return re.compile(source[len(REGEX_PREFIX) :])
    except re.error as err:
        raise RecorderConfigError(
            f"Expected {source!r} to hold a valid regular expression after 're:' but it does "
            f"not: {err}."
        ) from err


def check_regex(source: object) -> None:
    """Raise now, when a source is given, if it is a ``"re:"`` regular expression that does not
    compile (instead of when the run starts and the source is first matched).

    Raises:
        RecorderConfigError: the regular expression is invalid; the message says where.
    """
    if isinstance(source, str) and is_regex(source):
        _compile(source)


def is_class_name(source: object) -> bool:
    """Whether a string may be a bare class name: a capitalised identifier.

    Module attribute names are not capitalised by convention, class names are.
    """
    return isinstance(source, str) and source.isidentifier() and source[:1].isupper()


class _ClassNameMeta(type):
    """Metaclass of :class:`ClassNamed` types: instance checks compare class names."""

    class_name: str

    def __instancecheck__(cls, obj: object) -> bool:
        return cls.class_name in (c.__name__ for c in type(obj).__mro__)

    def __repr__(cls) -> str:
        return f"<class named {cls.class_name!r}>"


_CLASS_NAMED: dict[str, type] = {}


def class_named(name: str) -> type[nn.Module]:
    """A stand-in type for a bare class name: ``isinstance(m, class_named("BertLayer"))`` is
    true when the class of ``m`` or one of its bases is named ``BertLayer``, wherever defined.

    It subclasses :class:`torch.nn.Module`, so code that selects modules by type takes it as is.
    """
    found = _CLASS_NAMED.get(name)
    if found is None:
        found = _ClassNameMeta(name, (nn.Module,), {"class_name": name, "__module__": "<any>"})
        _CLASS_NAMED[name] = found
    return found


def _module_subclasses() -> Iterable[type]:
    """Every subclass of :class:`torch.nn.Module` defined so far (the stand-ins excluded)."""
    seen: set[type] = set()
    todo = [nn.Module]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen and not isinstance(sub, _ClassNameMeta):
                seen.add(sub)
                todo.append(sub)
    return seen


def class_names(modules: Iterable[object]) -> set[str]:
    """The names of the classes (and their module base classes) of ``modules``."""
    names: set[str] = set()
    for module in modules:
        for cls in type(module).__mro__:
            if cls is nn.Module:
                break
            names.add(cls.__name__)
    return names


def resolve_type(spec: str | type) -> type:
    """Turn ``"torch.nn.Conv2d"``, ``"Conv2d"`` (from ``torch.nn``) or a bare class name defined
    elsewhere (``"BertLayer"``: a :func:`class_named` stand-in) into a class."""
    if isinstance(spec, type):
        return spec
    if "." not in spec:
        obj = getattr(nn, spec, None)
        if isinstance(obj, type):
            return obj
        if any(cls.__name__ == spec for cls in _module_subclasses()):
            return class_named(spec)
        valid = [k for k, v in vars(nn).items() if isinstance(v, type)]
        others = {cls.__name__ for cls in _module_subclasses()} - set(valid)
        raise RecorderConfigError(
            f"Expected a module type such as 'torch.nn.Conv2d' but got {spec!r}, which is not a "
            f"class in torch.nn nor the name of a module class defined so far. "
            f"{suggestion(spec, valid, 'torch.nn classes')}"
            + closest_hint(spec, others, "module classes defined")
        )
    return cast(type, import_object(spec, "a class", "classes", lambda v: isinstance(v, type)))


def import_object(spec: str, what: str, kinds: str, kind: Callable[[object], bool]) -> object:
    """The object that the import path ``"pkg.module.name"`` names, one that ``kind`` is true
    of: ``what`` (``"a class"``) in the messages; for a missing name, the closest of the
    module's ``kinds`` (those ``kind`` is true of)."""
    module_name, _, attr = spec.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RecorderConfigError(
            f"Expected {spec!r} to name {what} but could not import {module_name!r}: {err}"
        ) from err
    if not hasattr(module, attr):
        names = [k for k, v in vars(module).items() if kind(v)]
        raise RecorderConfigError(
            f"Expected {spec!r} to name {what} but {module_name!r} has no attribute {attr!r}. "
            f"{suggestion(attr, names, f'{kinds} in {module_name}')}"
        )
    found = getattr(module, attr)
    if not kind(found):
        raise RecorderConfigError(
            f"Expected {spec!r} to name {what} but {spec} is {with_article(type(found).__name__)}."
        )
    return found


def _relative_hint(source: str, names: list[str]) -> str:
    """A sentence for a name that exists deeper in the model (``layer1`` for ``net.layer1``)."""
    deeper = [n for n in names if n.endswith("." + source)][:3]
    if not deeper:
        return ""
    return (
        " Names are relative to the LightningModule (in a callback) or to the model given to "
        f"`initialize`: did you mean {', '.join(map(repr, deeper))}?"
    )


def _unknown(source: str, items: Mapping[str, object], names: list[str], what: str) -> str:
    """The message for a source that selects nothing: closest names (and class names)."""
    if is_regex(source):
        head = f"The regular expression {source!r} matches no whole {what} name in the model."
    elif is_glob(source):
        head = f"The pattern {source!r} matches no {what} in the model."
    elif what == "module" and is_class_name(source):
        head = f"No module named {source!r}, nor of a class named {source!r}, in the model."
    else:
        head = f"No {what} named {source!r} in the model."
    text = f"{head} {suggestion(source, names, what + ' names')}"
    if what == "module" and not is_glob(source):
        classes = class_names(items[n] for n in names)
        text += closest_hint(source.rsplit(".", 1)[-1], classes, "class names")
    if not is_glob(source):
        text += _relative_hint(canonical_name(source), names)
    return text


def select(
    items: Mapping[str, object],
    source: str | type | tuple[type, ...],
    what: str,
    *,
    allow_root: bool = False,
) -> list[str]:
    """Names in ``items`` selected by an exact name, a glob pattern, a ``"re:"`` regular
    expression (whole names), a type / types, or a bare class name (see the module's docs).

    Raises:
        UnknownSourceError: nothing matches; the message lists the closest names (and, for
            modules, the closest class names present).
        RecorderConfigError: a ``"re:"`` source is not a valid regular expression.
    """
    names = [n for n in items if allow_root or n]
    if isinstance(source, str) and is_glob(source):
        matches = _matcher(source)
        matched = [n for n in names if matches(n)]
        if not matched:
            raise UnknownSourceError(_unknown(source, items, names, what))
        return matched
    if isinstance(source, str):
        key = canonical_name(source)
        if key in items and (key or allow_root):
            return [key]
        if what == "module" and is_class_name(source):
            matched = [n for n in names if isinstance(items[n], class_named(source))]
            if matched:
                return matched
        raise UnknownSourceError(_unknown(source, items, names, what))
    types = source if isinstance(source, tuple) else (source,)
    matched = [n for n in names if isinstance(items[n], types)]
    if not matched:
        by_name = [t.class_name for t in types if isinstance(t, _ClassNameMeta)]
        if len(by_name) == len(types) == 1:
            raise UnknownSourceError(_unknown(by_name[0], items, names, what))
        present = sorted({type(items[n]).__name__ for n in names})
        wanted = ", ".join(t.__name__ for t in types)
        raise UnknownSourceError(
            f"No {what} of type {wanted} in the model. Types present: {', '.join(present)}."
        )
    return matched


def absent_module_type(source: object, modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``source`` names module classes (a class, a tuple of classes, or a string that
    resolves to one, as :func:`as_module_type` reads it) of which ``modules`` (from
    :func:`named_modules`) hold no instance, the root left out as :func:`select` leaves it out.

    A name or pattern is never absent in this sense, nor is a bare class name that is not one of
    ``torch.nn``'s (a :func:`class_named` stand-in): those may be typos.
    """
    if isinstance(source, str) and canonical_name(source) in modules:
        return False
    wanted = as_module_type(source)
    if wanted is None or isinstance(wanted, _ClassNameMeta):
        return False
    return not any(isinstance(module, wanted) for name, module in modules.items() if name)


def as_module_type(source: object) -> type | tuple[type, ...] | None:
    """The module type(s) a source names, or ``None`` when it names modules by name/pattern.

    Accepts a class, a tuple of classes, a dotted path such as ``"torch.nn.Conv2d"``, a bare
    ``torch.nn`` class name such as ``"Conv2d"``, or any other capitalised bare name (a
    :func:`class_named` stand-in, resolved against the model's modules when selecting). Module
    attribute names are not capitalised, class names are.
    """
    if isinstance(source, type):
        return source
    if isinstance(source, tuple) and source and all(isinstance(t, type) for t in source):
        return source
    if not isinstance(source, str) or not source or is_pattern(source):
        return None
    last = source.rsplit(".", 1)[-1]
    if not last[:1].isupper():
        return None
    if "." not in source:
        found = getattr(nn, source, None)
        if isinstance(found, type) and issubclass(found, nn.Module):
            return found
        return class_named(source) if source.isidentifier() else None
    try:
        found = resolve_type(source)
    except RecorderConfigError:
        return None
    return found if issubclass(found, nn.Module) else None
