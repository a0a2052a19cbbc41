"""A part of the batch that a callback reads: a key or position of the batch, or a function.

``ActivationWriter(sample_index=...)`` and ``FeatureDistillation(token_mask=...)`` take it in
the same forms: a key or position of the batch, a function ``(batch, batch_idx) -> value`` or
``(batch) -> value``, or the function's import path (the form a YAML config gives a function; a
dotted string that does not import as a function is a batch key).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .._core.names import import_object
from ..errors import RecorderConfigError

# A batch position or key before the function: LightningCLI (jsonargparse) tries the members in
# this order, to parse `--sample_index=1` as the position 1 and to write a key or a position
# back into a saved config (a function first made both a string it could not write back).
BatchPart = int | str | Callable[..., Any] | None


def batch_part(value: object, owner: str, option: str, returns: str) -> Any:
    """``value`` checked as a :data:`BatchPart` of ``owner``'s ``option`` (a dotted string: the
    function it names where it imports as one); ``returns`` names what a function returns."""
    if isinstance(value, str) and "." in value:
        value = _function_or_key(value)
    valid = value is None or (
        not isinstance(value, bool) and (isinstance(value, (str, int)) or callable(value))
    )
    if not valid:
        raise RecorderConfigError(
            f"Expected `{option}` of {owner} to be None, a batch key or position, or a "
            f"function (batch, batch_idx) -> {returns} but got {value!r}."
        )
    return value


def read_batch_part(how: Any, batch: Any, batch_idx: int, option: str, what: str) -> Any:
    """What ``how`` (a :data:`BatchPart`, not None) gives for ``batch``; ``what`` names it in
    messages."""
    if isinstance(how, (str, int)):
        return _pick(batch, how, option, what)
    return how(batch, batch_idx) if _takes_batch_idx(how) else how(batch)


def _pick(batch: Any, key: str | int, option: str, what: str) -> Any:
    try:
        return batch[key]
    except (KeyError, IndexError, TypeError) as err:
        dotted = isinstance(key, str) and "." in key
        raise RecorderConfigError(
            f"Expected the batch to hold {what} at `{option}`={key!r} but it "
            f"does not ({type(batch).__name__})."
            + (" A function is given by its import path, which must import." if dotted else "")
        ) from err


def _takes_batch_idx(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes ``(batch, batch_idx)`` (else ``(batch)``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the two-argument form
        return True
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return len(positional) >= 2 or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def _function_or_key(name: str) -> Any:
    """A dotted string: the function it names where it imports as one (the form a YAML config
    gives a function), else the batch key it is."""
    try:
        return import_object(name, "a function", "functions", _is_function)
    except RecorderConfigError:
        return name


def _is_function(value: object) -> bool:
    return callable(value) and not isinstance(value, type)
