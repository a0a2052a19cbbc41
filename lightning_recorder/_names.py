"""Name handling shared by every recorder: wrapper prefixes, suggestions, pattern selection."""

from __future__ import annotations

import difflib
import fnmatch
import importlib
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .errors import RecorderConfigError, UnknownSourceError

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


def closest(name: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    """The candidates most similar to ``name``: close spellings first, then shared pieces."""
    pool = [c for c in candidates if c]
    matches = difflib.get_close_matches(name, pool, n=n, cutoff=0.5)
    if len(matches) < n:
        tail = name.rsplit(".", 1)[-1]
        for cand in pool:
            if cand not in matches and (tail and (tail in cand or cand in name)):
                matches.append(cand)
            if len(matches) >= n:
                break
    return matches


def suggestion(name: str, candidates: Iterable[str], what: str) -> str:
    """A sentence that lists close matches for ``name`` (or a few valid names if none)."""
    pool = sorted({c for c in candidates if c})
    near = closest(name, pool)
    if near:
        return "Closest " + what + ": " + ", ".join(repr(c) for c in near) + "."
    if not pool:
        return f"The model has no {what}."
    shown = ", ".join(repr(c) for c in pool[:8])
    more = f" (and {len(pool) - 8} more)" if len(pool) > 8 else ""
    return f"Valid {what} include: {shown}{more}."


def is_pattern(source: object) -> bool:
    """Whether a module source selects by glob pattern or type rather than one exact name."""
    if isinstance(source, str):
        return any(ch in _GLOB_CHARS for ch in source)
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


def iter_tensors(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor inside a nested structure of tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for field in obj.__dataclass_fields__:
            yield from iter_tensors(getattr(obj, field, None))


def check_option(name: str, value: object, allowed: Iterable[object]) -> None:
    """Raise a uniform message when an option is not one of the allowed values."""
    allowed = list(allowed)
    if value not in allowed:
        raise RecorderConfigError(
            f"Expected `{name}` to be one of {', '.join(repr(a) for a in allowed)} "
            f"but got {value!r}."
        )


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


def check_keys(given: Iterable[str], allowed: Sequence[str], where: str, what: str) -> None:
    """Reject keys outside ``allowed``, naming the closest valid ones and listing all of them.

    Raises:
        RecorderConfigError: ``Unknown {what}(s) ... in {where}. Closest {what}s: ...``.
    """
    unknown = [k for k in given if k not in allowed]
    if unknown:
        hints = " ".join(suggestion(k, allowed, what + "s") for k in unknown)
        raise RecorderConfigError(
            f"Unknown {what}(s) {', '.join(repr(k) for k in unknown)} in {where}. {hints} "
            f"Valid {what}s: {', '.join(allowed)}."
        )
