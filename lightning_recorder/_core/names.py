"""Module and parameter names: wrapper prefixes, glob patterns, module types."""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Mapping

from torch import nn

from ..errors import RecorderConfigError, UnknownSourceError
from .checks import suggestion

# Attribute names that wrappers (DDP, torch.compile, FSDP, activation checkpointing) insert
# between a model and its submodules. A user names ``conv1``, not ``module._orig_mod.conv1``.
WRAPPER_PREFIXES = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_WRAPPER_SET = frozenset(WRAPPER_PREFIXES)
_GLOB_CHARS = frozenset("*?[")


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


def is_glob(source: str) -> bool:
    """Whether a name holds glob characters (``*``, ``?``, ``[``).

    >>> is_glob("layer*.conv1"), is_glob("layer1.conv1")
    (True, False)
    """
    return any(ch in _GLOB_CHARS for ch in source)


def is_pattern(source: object) -> bool:
    """Whether a module source selects by glob pattern or type rather than one exact name."""
    if isinstance(source, str):
        return is_glob(source)
    return isinstance(source, type) or (
        isinstance(source, tuple) and all(isinstance(t, type) for t in source)
    )


def resolve_type(spec: str | type) -> type:
    """Turn ``"torch.nn.Conv2d"`` (or ``"Conv2d"`` from ``torch.nn``) into the class."""
    if isinstance(spec, type):
        return spec
    if "." not in spec:
        obj = getattr(nn, spec, None)
        if isinstance(obj, type):
            return obj
        valid = [k for k, v in vars(nn).items() if isinstance(v, type)]
        raise RecorderConfigError(
            f"Expected a module type such as 'torch.nn.Conv2d' but got {spec!r}, which is not a "
            f"class in torch.nn. {suggestion(spec, valid, 'torch.nn classes')}"
        )
    module_name, _, attr = spec.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RecorderConfigError(
            f"Expected an importable module type but could not import {module_name!r} "
            f"(from {spec!r}): {err}"
        ) from err
    obj = getattr(module, attr, None)
    if not isinstance(obj, type):
        raise RecorderConfigError(
            f"Expected {spec!r} to name a class but {module_name}.{attr} is {type(obj).__name__}."
        )
    return obj


def select(
    items: Mapping[str, object],
    source: str | type | tuple[type, ...],
    what: str,
    *,
    allow_root: bool = False,
) -> list[str]:
    """Names in ``items`` selected by an exact name, a glob pattern, or a type / types.

    Raises:
        UnknownSourceError: nothing matches; the message lists the closest names.
    """
    names = [n for n in items if allow_root or n]
    if isinstance(source, str) and not is_pattern(source):
        key = canonical_name(source)
        if key in items and (key or allow_root):
            return [key]
        raise UnknownSourceError(
            f"No {what} named {source!r} in the model. {suggestion(source, names, what + ' names')}"
        )
    if isinstance(source, str):
        key = canonical_name(source)
        matched = [n for n in names if fnmatch.fnmatchcase(n, key)]
        if not matched:
            raise UnknownSourceError(
                f"The pattern {source!r} matches no {what} in the model. "
                f"{suggestion(source, names, what + ' names')}"
            )
        return matched
    types = source if isinstance(source, tuple) else (source,)
    matched = [n for n in names if isinstance(items[n], types)]
    if not matched:
        present = sorted({type(items[n]).__name__ for n in names})
        wanted = ", ".join(t.__name__ for t in types)
        raise UnknownSourceError(
            f"No {what} of type {wanted} in the model. Types present: {', '.join(present)}."
        )
    return matched


def as_module_type(source: object) -> type | tuple[type, ...] | None:
    """The module type(s) a source names, or ``None`` when it names modules by name/pattern.

    Accepts a class, a tuple of classes, ``"torch.nn.Conv2d"``, or a bare ``torch.nn`` class
    name such as ``"Conv2d"`` (module attribute names are not capitalised, class names are).
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
    try:
        found = resolve_type(source)
    except RecorderConfigError:
        return None
    return found if issubclass(found, nn.Module) else None
