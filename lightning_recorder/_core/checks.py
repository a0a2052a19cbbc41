"""The checks and messages every room shares: closest names, options, numbers, tensors.

One voice for every configuration mistake: *what* was wrong (the option, in backticks), *what was
expected*, and the closest valid names where names are involved. Every check here raises
:class:`~lightning_recorder.errors.RecorderConfigError` (a ``ValueError``); :func:`switched_on`
reads an on/off environment variable, the one way every switch of the package is read.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal, get_args

import torch

from ..errors import RecorderConfigError, RecorderError

Stage = Literal["train", "val", "test", "predict"]
"""A loop of the Trainer, as it appears in tags and in an activation row's provenance:
``train``, ``val``, ``test`` or ``predict``."""

STAGES: tuple[Stage, ...] = get_args(Stage)

_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")
_TOLD: set[tuple[str, str]] = set()  # (variable, value) pairs already warned about


def switched_on(variable: str) -> bool:
    """Whether the environment variable ``variable`` leaves a switch on: unset, or anything but
    ``0``, ``off``, ``false`` or ``no`` (any case, spaces ignored). A value that is neither one
    of those nor ``1``, ``on``, ``true``, ``yes`` (a typo such as ``of``) counts as on, with one
    warning that says so.

    >>> switched_on("LIGHTNING_RECORDER_SWITCH_NOBODY_SETS")
    True
    """
    flag = os.environ.get(variable, "1").strip().lower()
    if flag in _OFF:
        return False
    if flag not in _ON and (variable, flag) not in _TOLD:
        _TOLD.add((variable, flag))
        warnings.warn(
            f"{variable}={os.environ[variable]!r} is neither on ({', '.join(_ON)}) nor off "
            f"({', '.join(_OFF)}); lightning_recorder takes it as on. Set {variable}=0 to turn "
            "it off.",
            UserWarning,
            stacklevel=2,
        )
    return True


def installed(module: str) -> bool:
    """Whether the top-level package ``module`` can be imported (found without importing it;
    ``None`` in ``sys.modules``, as a test that hides a package sets it, counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # a module without a spec in sys.modules
        return False


def with_article(what: str) -> str:
    """``what`` after its indefinite article, for messages: ``"an int"``, ``"a tuple"``.

    >>> with_article("int"), with_article("Tensor of shape (2,)")
    ('an int', 'a Tensor of shape (2,)')
    """
    return ("an " if what[:1].lower() in "aeiou" else "a ") + what


def closest(name: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    """The candidates most similar to ``name``: close spellings first, then shared pieces.

    >>> closest("conv1", ["conv1", "conv2", "fc"])
    ['conv1', 'conv2']
    """
    if not isinstance(name, str):
        return []
    pool = [c for c in candidates if isinstance(c, str) and c]
    matches = difflib.get_close_matches(name, pool, n=n, cutoff=0.5)
    if len(matches) < n:
        tail = name.rsplit(".", 1)[-1]
        for cand in pool:
            if cand not in matches and (tail and (tail in cand or cand in name)):
                matches.append(cand)
            if len(matches) >= n:
                break
    return matches


def listing(items: Sequence[str], shown: int = 5) -> str:
    """``items`` (as written) joined by commas, the first ``shown`` of them and how many more.

    >>> listing(["'a'", "'b'", "'c'"], shown=2)
    "'a', 'b' and 1 more"
    """
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def suggestion(name: str, candidates: Iterable[str], what: str) -> str:
    """A sentence that lists close matches for ``name`` (or a few valid names if none).

    >>> suggestion("conv", ["conv1", "fc"], "module names")
    "Closest module names: 'conv1'."
    """
    pool = sorted({c for c in candidates if c})
    near = closest(name, pool)
    if near:
        return "Closest " + what + ": " + ", ".join(repr(c) for c in near) + "."
    if not pool:
        return f"There are no {what}."
    shown = ", ".join(repr(c) for c in pool[:8])
    more = f" (and {len(pool) - 8} more)" if len(pool) > 8 else ""
    return f"Valid {what} include: {shown}{more}."


def closest_hint(name: object, candidates: Iterable[str], what: str) -> str:
    """``" Closest <what>: ..."`` for a misspelt ``name`` with close matches, else ``""`` (for a
    message that already lists every valid value).

    >>> closest_hint("stdd", ["std", "mean"], "names")
    " Closest names: 'std'."
    """
    if not isinstance(name, str):
        return ""
    near = suggestion(name, candidates, what)
    return f" {near}" if near.startswith("Closest") else ""


def check_option(
    name: str, value: object, allowed: Iterable[object], owner: str | None = None
) -> None:
    """Raise a uniform message when an option is not one of the allowed values (naming the
    class or function ``owner`` it is an option of, where given)."""
    allowed = list(allowed)
    if value not in allowed:
        of = f" of {owner}" if owner else ""
        raise RecorderConfigError(
            f"Expected `{name}`{of} to be one of {', '.join(repr(a) for a in allowed)} "
            f"but got {value!r}."
        )


def check_keys(given: Iterable[str], allowed: Sequence[str], where: str, what: str) -> None:
    """Reject keys outside ``allowed``, naming the closest valid ones and listing all of them.

    Raises:
        RecorderConfigError: ``Unknown {what}(s) ... in {where}. Closest {what}s: ...``.
    """
    unknown = [k for k in given if k not in allowed]
    if unknown:
        # close matches first; without one, the full list below says it (not a part twice)
        pool = sorted(set(allowed))
        hints = "".join(
            suggestion(k, allowed, what + "s") + " " for k in unknown if closest(k, pool)
        )
        raise RecorderConfigError(
            f"Unknown {what}(s) {', '.join(repr(k) for k in unknown)} in {where}. {hints}"
            f"Valid {what}s: {', '.join(allowed)}."
        )


def _of(owner: str) -> str:
    return f" of {owner}" if owner else ""


def check_bool(value: object, name: str, owner: str = "") -> bool:
    """``value`` if it is a bool, else an error naming the option."""
    if not isinstance(value, bool):
        raise RecorderConfigError(
            f"Expected `{name}`{_of(owner)} to be a bool but got {type(value).__name__} {value!r}."
        )
    return value


def check_int(
    value: object, name: str, owner: str = "", *, minimum: int = 1, allow_none: bool = False
) -> None:
    """Raise unless ``value`` is an int ``>= minimum`` (or ``None`` when allowed).

    ``minimum=1`` reads as "a positive int", ``minimum=0`` as "a non-negative int".
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")
        extra = " or None" if allow_none else ""
        raise RecorderConfigError(
            f"Expected `{name}`{_of(owner)} to be {kind}{extra} but got {value!r}."
        )


def check_positive_int(
    value: object, name: str, owner: str = "", *, allow_none: bool = False
) -> None:
    """Raise unless ``value`` is a positive int (or ``None`` when allowed)."""
    check_int(value, name, owner, minimum=1, allow_none=allow_none)


def check_number(
    value: object, name: str, owner: str = "", *, positive: bool = False, allow_zero: bool = True
) -> float:
    """``value`` as a finite float; ``positive`` rejects negatives (and zero unless allowed)."""
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    ok = number is not None and math.isfinite(number)
    if ok and positive and number is not None:
        ok = number > 0 or (allow_zero and number == 0)
    if not ok:
        kind = "a finite number"
        if positive:
            kind = "a finite non-negative number" if allow_zero else "a finite positive number"
        raise RecorderConfigError(f"Expected `{name}`{_of(owner)} to be {kind} but got {value!r}.")
    return float(number)  # type: ignore[arg-type]


def check_name(value: object, owner: str) -> str | None:
    """``value`` if it is ``None`` or a string with a visible character, else an error: the
    ``name`` of a callback tells two instances apart in checkpoints, and an empty or blank one
    tells nothing while it looks given."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise RecorderConfigError(f"Expected `name` of {owner} to be a str but got {value!r}.")
    if not value.strip():
        raise RecorderConfigError(
            f"Expected `name` of {owner} to be a non-empty str or None but got {value!r}: the "
            "name tells two instances apart in checkpoints, and a blank one tells nothing; pass "
            "a name with a visible character, such as 'probe', or leave `name` out (None)."
        )
    return value


@contextmanager
def inputs_taken(
    model: object, inputs: str | Callable[[], str], fix: str = "", forward: str = "the forward"
) -> Iterator[None]:
    """Run a forward of ``model`` on inputs the user gave (``inputs`` names them, or makes the
    name when needed): an exception it raises becomes a :class:`RecorderConfigError` naming the
    model and the inputs, with the forward's own exception as its cause (``forward`` names the
    call, ``fix``, if given, ends the message); the package's own errors pass as they are."""
    try:
        yield
    except RecorderError:
        raise
    except Exception as err:
        named = inputs if isinstance(inputs, str) else inputs()
        raise RecorderConfigError(
            f"Expected {named} to be valid inputs of {type(model).__name__} but {forward} "
            f"raised {type(err).__name__}: {err}{fix}"
        ) from err


def check_tensor(value: object, name: str, *, real: bool = False) -> torch.Tensor:
    """``value`` if it is a tensor (with a real dtype when ``real``), else an error."""
    if not isinstance(value, torch.Tensor):
        raise RecorderConfigError(
            f"Expected `{name}` to be a torch.Tensor but got {type(value).__name__}."
        )
    if real and value.is_complex():
        raise RecorderConfigError(
            f"Expected `{name}` to have a real dtype but got {value.dtype}; pass its magnitude "
            f"(`{name}.abs()`) or its real and imaginary parts (`torch.view_as_real({name})`)."
        )
    return value


def check_callable(value: object, name: str, what: str) -> None:
    """Raise unless ``value`` is callable or ``None``."""
    if value is not None and not callable(value):
        raise RecorderConfigError(
            f"Expected `{name}` to be {what} or None but got {type(value).__name__} {value!r}."
        )


def dtype_of(dtype: object, what: str = "`dtype`") -> torch.dtype:
    """The ``torch.dtype`` ``dtype`` is or names (``"float16"``, ``"torch.bfloat16"``), else an
    error about ``what`` (the option, as the message names it) with the closest dtype names."""
    value = dtype
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
    if isinstance(value, torch.dtype):
        return value
    names = [k for k, v in vars(torch).items() if isinstance(v, torch.dtype)]
    raise RecorderConfigError(
        f"Expected {what} to be a torch.dtype or its name (e.g. 'float16') but got {dtype!r}."
        + closest_hint(dtype, names, "dtype names")
    )


def parse_dtype(dtype: torch.dtype | str | None, name: str = "dtype") -> torch.dtype | None:
    """A floating-point ``torch.dtype`` from a dtype or its name (``"float16"``,
    ``"torch.bfloat16"``): the dtype recorded floating-point tensors are cast to."""
    if dtype is None:
        return None
    value = dtype_of(dtype, f"`{name}`")
    if value.is_floating_point:
        return value
    raise RecorderConfigError(
        f"Expected `{name}` to be a floating-point dtype such as 'float16' or 'bfloat16' "
        f"(recorded floating-point tensors are cast to it) but got {value}."
    )


def parse_device(device: torch.device | str | None, name: str = "device") -> torch.device | None:
    """A ``torch.device`` from a device or a device string (``"cpu"``, ``"cuda:0"``)."""
    if device is None:
        return None
    if not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise RecorderConfigError(
                f"Expected `{name}` to be a torch.device or a device string such as 'cpu' but "
                f"got {device!r}."
            ) from err
    check_device_available(device, name)
    return device


def check_device_available(device: torch.device, name: str = "device") -> None:
    """Raise unless ``device`` exists on this machine (``cpu`` and ``meta`` always do).

    A device type without a ``torch.<type>`` backend module (``xla`` …) is not checked.
    """
    if device.type in ("cpu", "meta"):
        return
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if not callable(is_available):
        return
    if not is_available():
        raise RecorderConfigError(
            f"Expected `{name}` to be an available device but got {str(device)!r}: "
            f"{device.type.upper()} is not available here (torch.{device.type}.is_available() is "
            "False); use 'cpu' or leave the device unset."
        )
    count = getattr(backend, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise RecorderConfigError(
            f"Expected `{name}` to be an available device but got {str(device)!r}: only "
            f"{count()} {device.type} device(s) are available here."
        )
