"""Recorders of plain functions and of methods, by dotted path.

For a function the source is the module that *uses* it: if ``mypkg/heads.py`` does
``from mypkg.utils import anchor_flags`` and calls ``anchor_flags(...)``, record
``"mypkg.heads.anchor_flags"``, not ``"mypkg.utils.anchor_flags"``. For a method the source is
``"pkg.module.Class.method"``; every instance's calls are seen (static and class methods too).

By default the function is patched when the context is entered and restored when it exits, as in
MMRazor: outside ``with recorder:`` the module attribute is the original function again, and
:meth:`initialize` only resolves and checks the path. With ``persistent=True`` the patch is
installed once at :meth:`initialize` (it does nothing outside a context) and restored at
:meth:`release`; choose it for a model compiled with ``torch.compile``, which would otherwise see
the patched name change at every step and recompile. Several recorders can share one function.

A copy of a recorder (``copy.deepcopy``, ``pickle``, an EMA or teacher copy of a model holding
one) is a fresh recorder with the same source and options and empty records: initialized when the
original is initialized and not persistent (it installs nothing until its context is entered),
uninitialized when persistent (call :meth:`initialize` on the copy to install its own patch).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Literal

import torch

from .._core import patching as _patching
from .._core.checks import check_bool
from .._core.compat import current_autograd_node
from .._core.structures import Binder
from ..errors import RecorderConfigError
from ._registry import register_recorder
from .base import BaseRecorder

__all__ = [
    "FunctionInputsRecorder",
    "FunctionOutputsRecorder",
    "MethodInputsRecorder",
    "MethodOutputsRecorder",
]


class _CallableRecorder(BaseRecorder):
    """Shared machinery: resolve the path, patch it, turn calls into records."""

    _want: Literal["function", "method"] = "function"
    _record: Literal["inputs", "outputs"] = "outputs"

    def __init__(self, source: str, *, persistent: bool = False, **options: Any) -> None:
        if not isinstance(source, str):
            raise RecorderConfigError(
                f"Expected `source` to be a dotted path string but got {type(source).__name__}."
            )
        check_bool(persistent, "persistent")
        super().__init__(source, **options)
        self.persistent = persistent
        self._options = dict(options)
        self._target: _patching.Target | None = None
        self._sink: _patching.Sink | None = None
        self._binder: Binder | None = None
        self._patched = False

    def prepare_from_model(self, model: torch.nn.Module | None = None) -> None:
        target = _patching.resolve(self.source, self._want)
        stream = self.add_stream(self.source)
        drops_first = target.kind in ("method", "classmethod")
        # The patch is global: it holds the recorder weakly, so a recorder dropped without
        # release() is collected and its __del__ restores the function.
        ref = weakref.ref(self)
        if self._record == "inputs":
            self._binder = Binder(target.func, drop_first=drops_first)
            binder = self._binder
            if self.path:  # a typo fails here, not inside the model's call
                self._check_argument(binder)

            def before(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                rec = ref()
                if (
                    rec is None
                    or not rec._recording
                    or current_autograd_node() is not None
                    or not rec.records_this_thread()
                ):
                    return
                value: Any = binder(args[1:] if drops_first else args, kwargs)
                if rec.path is not None:
                    value = rec._select(value)
                rec.capture(stream, value)

            sink = _patching.Sink(before=before)
        else:

            def after(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
                rec = ref()
                if (
                    rec is None
                    or not rec._recording
                    or current_autograd_node() is not None
                    or not rec.records_this_thread()
                ):
                    return
                if rec.path is not None:
                    result = rec._select(result)
                rec.capture(stream, result)

            sink = _patching.Sink(after=after)
        self._target, self._sink = target, sink
        if self.persistent:
            self._patch()

    def _same_source(self, other: BaseRecorder) -> bool:
        # the patch is global: the same function or method, whatever model each was given
        return type(other) is type(self) and other.source == self.source

    def _check_argument(self, binder: Binder) -> None:
        """Raise unless the first ``path`` item names an argument of the function.

        Only for a Python signature: a call that does not bind to it fails anyway, while a torch
        C function's schema does not cover every spelling its Python binding accepts (such a call
        is recorded as it was made, ``args[0]`` …).
        """
        sig = binder.signature
        if self.path and sig is not None and binder.from_python:
            where = f"{self.source}({', '.join(sig.parameters)})"
            binder.check_key(self.path[0], type(self).__name__, where)

    def _patch(self) -> None:
        if not self._patched and self._target is not None and self._sink is not None:
            _patching.acquire(self._target, self._sink)
            self._patched = True

    def _unpatch(self) -> None:
        if self._patched and self._target is not None and self._sink is not None:
            _patching.release(self._target, self._sink)
        self._patched = False

    def _on_start(self) -> None:
        # Called by BaseRecorder.start (also when a manager starts its recorders).
        if not self.persistent:
            try:
                self._patch()
            except BaseException:
                self._recording = False
                raise

    def stop(self) -> None:
        """Stop recording; outside ``persistent`` mode this restores the original."""
        super().stop()
        if not self.persistent:
            self._unpatch()

    def _teardown(self) -> None:
        super()._teardown()
        self._unpatch()
        self._target = self._sink = None

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (deep copy, pickle: EMA and teacher copies of a model holding the recorder)
        # is a fresh recorder with the same source and options; see the module docstring.
        state = {"_copy_initialized": self._initialized and not self.persistent}
        return (
            _rebuild,
            (type(self), self.source, self.persistent, self._options),
            state,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state.get("_copy_initialized"):
            self.initialize()

    def _empty_hint(self) -> str:
        owner, _, attr = self.source.rpartition(".")
        if self._want == "function":
            held = _held_elsewhere(self._target.func, owner) if self._target is not None else []
            found = (
                f" Loaded modules that hold it under their own name: {', '.join(held)}."
                if held
                else ""
            )
            return (
                f"The name {attr!r} was patched in module {owner!r}. If the code that runs "
                f"imported the function into another module (`from {owner} import {attr}` "
                "elsewhere), it calls that module's own reference: record "
                f"'<that module>.{attr}' — the module that uses the function.{found} Also check "
                "that the call happened inside the context."
            )
        return (
            f"The method {attr!r} was patched on class {owner!r}. Calls through a subclass that "
            "overrides it, or through a bound method captured before `initialize`, are not "
            "seen; also check that the call happened inside the context."
        )


def _held_elsewhere(func: Any, owner: str, limit: int = 5) -> list[str]:
    """Quoted dotted paths (at most ``limit``) under which loaded modules other than ``owner``
    hold ``func``: the sources that would see calls made through those references."""
    found: list[str] = []
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if name == owner or not isinstance(namespace, dict):
            continue
        found += [f"'{name}.{key}'" for key, value in list(namespace.items()) if value is func]
        if len(found) >= limit:
            break
    return found[:limit]


def _rebuild(
    cls: type[_CallableRecorder], source: str, persistent: bool, options: dict[str, Any]
) -> _CallableRecorder:
    return cls(source, persistent=persistent, **options)


@register_recorder
class FunctionOutputsRecorder(_CallableRecorder):
    """Record the return value of each call of a function.

    Args:
        source: ``"pkg.module.func"`` — the module that *uses* the function.
        **options: ``detach``, ``clone``, ``device``, ``dtype``, ``keep``, ``path``.

    Examples:
        >>> import math
        >>> recorder = FunctionOutputsRecorder("math.sqrt").initialize()
        >>> with recorder:
        ...     _ = math.sqrt(16.0)
        >>> recorder.data_buffer
        [4.0]
        >>> recorder.release()
    """

    short_name = "FunctionOutputs"


@register_recorder
class FunctionInputsRecorder(_CallableRecorder):
    """Record the arguments of each call of a function, in signature order.

    Each record is an :class:`~lightning_recorder.Arguments` tuple; ``f(1, 2)``, ``f(1, b=2)``
    and ``f(b=2, a=1)`` give the same record.

    Examples:
        >>> import math
        >>> recorder = FunctionInputsRecorder("math.pow").initialize()
        >>> with recorder:
        ...     _ = math.pow(2.0, 3.0)
        >>> tuple(recorder.get_record_data())
        (2.0, 3.0)
        >>> recorder.release()
    """

    short_name = "FunctionInputs"
    _record = "inputs"


@register_recorder
class MethodOutputsRecorder(_CallableRecorder):
    """Record the return value of each call of a method, on any instance.

    Args:
        source: ``"pkg.module.Class.method"``.
        **options: ``detach``, ``clone``, ``device``, ``dtype``, ``keep``, ``path``.

    Examples:
        >>> from fractions import Fraction
        >>> recorder = MethodOutputsRecorder("fractions.Fraction.limit_denominator").initialize()
        >>> with recorder:
        ...     _ = Fraction(3, 7).limit_denominator(2)
        >>> recorder.data_buffer
        [Fraction(1, 2)]
        >>> recorder.release()
    """

    short_name = "MethodOutputs"
    _want = "method"


@register_recorder
class MethodInputsRecorder(_CallableRecorder):
    """Record the arguments (without ``self``) of each call of a method, in signature order.

    Examples:
        >>> from fractions import Fraction
        >>> recorder = MethodInputsRecorder("fractions.Fraction.limit_denominator").initialize()
        >>> with recorder:
        ...     _ = Fraction(3, 7).limit_denominator(max_denominator=2)
        >>> recorder.get_record_data().as_dict()
        {'max_denominator': 2}
        >>> recorder.release()
    """

    short_name = "MethodInputs"
    _want = "method"
    _record = "inputs"
