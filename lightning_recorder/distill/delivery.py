"""Deliveries: record what a function returns in the teacher's pass, replay it in the student's.

Some distillation recipes need both networks to see the *same* value from code that is not
deterministic: a random augmentation, a sampled mask, a set of anchor flags. A delivery patches
the function (or method) by its dotted path, the way the function recorders do. In *record* mode
(``override_data=False``) each call runs and its result is appended to a bounded FIFO queue; in
*replay* mode (``override_data=True``) each call returns the oldest queued result instead of
running. The semantics follow MMRazor's deliveries: a full queue and an empty queue are errors,
because either means the two passes did not call the function the same number of times.

As with the function recorders, the path names the module that *uses* the function
(``"mypkg.data.random_crop"`` where ``mypkg/data.py`` calls ``random_crop``).

Examples:
    >>> import random
    >>> delivery = FunctionOutputsDelivery("random.random", max_keep_data=2)
    >>> with delivery:  # record mode: the function runs, its outputs are kept
    ...     first, second = random.random(), random.random()
    >>> delivery.override_data = True
    >>> with delivery:  # replay mode: the same values come back, in order
    ...     replayed = [random.random(), random.random()]
    >>> replayed == [first, second]
    True
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from functools import partial
from types import MappingProxyType, TracebackType
from typing import Any, ClassVar, Literal

from .._core import patching as _patching
from .._core.compat import current_autograd_node
from .._core.registry import (
    Registry,
    add_named,
    apply_all,
    build_from_config,
    get_named,
    named_items,
)
from ..errors import (
    NoRecordError,
    RecorderConfigError,
    RecorderStateError,
)

__all__ = [
    "DistillDelivery",
    "DistillDeliveryManager",
    "FunctionOutputsDelivery",
    "MethodOutputsDelivery",
    "build_delivery",
]


class DistillDelivery:
    """Base class of deliveries: a patched callable and a bounded FIFO queue of its outputs.

    Args:
        source: the dotted path of the callable to deliver.
        max_keep_data: how many outputs the queue holds (a positive int).

    Raises:
        RecorderConfigError: ``max_keep_data`` is not a positive int.
        InvalidSourceError: ``source`` does not resolve to a callable of the right kind.
    """

    #: Short type name used in config dicts (``"FunctionOutputs"``).
    short_name: ClassVar[str] = ""
    _want: ClassVar[Literal["function", "method"]] = "function"

    def __init__(self, source: str, max_keep_data: int = 1) -> None:
        if type(self) is DistillDelivery:
            raise RecorderConfigError(
                "Expected a concrete delivery (FunctionOutputsDelivery or MethodOutputsDelivery) "
                "but got the base class DistillDelivery (a config dict names its kind with a "
                "'type' key, e.g. {'type': 'FunctionOutputs', 'source': 'pkg.module.func'})."
            )
        if (
            not isinstance(max_keep_data, int)
            or isinstance(max_keep_data, bool)
            or max_keep_data < 1
        ):
            raise RecorderConfigError(
                f"Expected `max_keep_data` to be a positive int but got {max_keep_data!r}."
            )
        self.source = source
        self.max_keep_data = max_keep_data
        self.data_queue: deque[Any] = deque(maxlen=max_keep_data)
        self._target = _patching.resolve(source, self._want)
        self._sink = _patching.Sink(before=self._before, after=self._after, replace=self._replace)
        self._override_data = False
        self._active = False
        self._installed = False
        self._temporary = False

    # ------------------------------------------------------------------ mode
    @property
    def override_data(self) -> bool:
        """``False``: calls run and their outputs are queued; ``True``: calls return them."""
        return self._override_data

    @override_data.setter
    def override_data(self, override: bool) -> None:
        if not isinstance(override, bool):
            raise RecorderConfigError(
                f"Expected `override_data` to be a bool but got {type(override).__name__}."
            )
        self._override_data = override

    # ------------------------------------------------------------------ lifecycle
    def initialize(self) -> DistillDelivery:
        """Install the patch now (inert outside the context) and keep it until :meth:`release`.

        Entering the context also installs it, for the duration of the context only; installing
        once up front avoids re-patching at every step.

        Returns:
            The delivery itself.
        """
        if not self._installed:
            _patching.acquire(self._target, self._sink)
            self._installed = True
        self._temporary = False
        return self

    def release(self) -> None:
        """Stop delivering and restore the original callable. Safe to call any number of times."""
        self._active = False
        if self._installed:
            _patching.release(self._target, self._sink)
        self._installed = False
        self._temporary = False

    @property
    def initialized(self) -> bool:
        """Whether the patch is installed."""
        return self._installed

    @property
    def active(self) -> bool:
        """Whether the delivery acts on calls now (inside its context)."""
        return self._active

    def reset(self) -> None:
        """Forget every queued output."""
        self.data_queue.clear()

    def __enter__(self) -> DistillDelivery:
        if self._active:
            raise RecorderStateError(f"{self!r} is already active: delivery contexts do not nest.")
        if not self._installed:
            self.initialize()
            self._temporary = True
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._active = False
        if self._temporary:
            self.release()

    # ------------------------------------------------------------------ the patch
    def _before(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._active or self._override_data or current_autograd_node() is not None:
            return
        if len(self.data_queue) >= self.max_keep_data:
            raise RecorderStateError(
                f"Expected the queue of {self!r} to have room for another output but it is full "
                f"(max_keep_data={self.max_keep_data}): the recording pass called {self.source!r} "
                "more often than the queue holds. Raise `max_keep_data`, or replay (and so empty) "
                "the queue between recording passes."
            )

    def _after(self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        if not self._active or self._override_data or current_autograd_node() is not None:
            return
        self.data_queue.append(result)

    def _replace(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._active or not self._override_data or current_autograd_node() is not None:
            return _patching.CALL_ORIGINAL
        if not self.data_queue:
            raise NoRecordError(
                f"Expected a queued output of {self.source!r} to replay but the queue of {self!r} "
                "is empty: the replaying pass called it more often than the recording pass did "
                "(or nothing was recorded: enter the delivery with override_data=False first)."
            )
        return self.data_queue.popleft()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source!r}, max_keep_data={self.max_keep_data})"

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (pickled to a worker process, deep-copied) is a fresh, uninstalled delivery.
        return (
            type(self),
            (self.source, self.max_keep_data),
            {"_override_data": self._override_data},
        )

    def __del__(self) -> None:
        try:
            if self._installed:
                _patching.release(self._target, self._sink)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class FunctionOutputsDelivery(DistillDelivery):
    """Deliver the outputs of a function: ``"pkg.module.func"``, the module that *uses* it.

    Args:
        source: the function's dotted path.
        max_keep_data: how many outputs the queue holds.
        func_path: MMRazor's keyword for ``source`` (give one of the two).

    Examples:
        >>> import random
        >>> delivery = FunctionOutputsDelivery("random.randint", max_keep_data=1)
        >>> with delivery:
        ...     drawn = random.randint(0, 10**9)
        >>> delivery.override_data = True
        >>> with delivery:
        ...     random.randint(0, 10**9) == drawn
        True
    """

    short_name = "FunctionOutputs"

    def __init__(
        self, source: str | None = None, max_keep_data: int = 1, *, func_path: str | None = None
    ) -> None:
        super().__init__(_one_path(source, func_path, "func_path"), max_keep_data)


class MethodOutputsDelivery(DistillDelivery):
    """Deliver the outputs of a method, on any instance: ``"pkg.module.Class.method"``.

    Args:
        source: the method's dotted path (plain, static and class methods).
        max_keep_data: how many outputs the queue holds.
        method_path: MMRazor's keyword for ``source`` (give one of the two).

    Examples:
        >>> import random
        >>> delivery = MethodOutputsDelivery("random.Random.random")
        >>> rng = random.Random(0)
        >>> with delivery:
        ...     value = rng.random()
        >>> delivery.override_data = True
        >>> with delivery:
        ...     random.Random(1).random() == value  # another instance, the same value
        True
    """

    short_name = "MethodOutputs"
    _want = "method"

    def __init__(
        self, source: str | None = None, max_keep_data: int = 1, *, method_path: str | None = None
    ) -> None:
        super().__init__(_one_path(source, method_path, "method_path"), max_keep_data)


def _one_path(source: Any, path: Any, keyword: str) -> Any:
    """``source``, or MMRazor's ``func_path`` / ``method_path`` keyword for it (not both)."""
    if source is not None and path is not None:
        raise RecorderConfigError(
            f"Expected either `source` or `{keyword}` (MMRazor's name for it) but got both: "
            f"{source!r} and {path!r}."
        )
    if source is None and path is None:
        raise RecorderConfigError(
            f"Expected `source` (or `{keyword}`) to be the dotted path of the callable to "
            "deliver but got neither."
        )
    return path if source is None else source


#: Delivery types by class name and short name (``"FunctionOutputs"``).
DELIVERIES: Registry[type[DistillDelivery]] = Registry("delivery")
for _cls in (FunctionOutputsDelivery, MethodOutputsDelivery):
    DELIVERIES.register(_cls, [_cls.__name__, _cls.short_name])
# MMRazor's config keys for the path.
_PATH_ALIASES = {"func_path": "source", "method_path": "source"}


def build_delivery(config: Mapping[str, Any] | DistillDelivery, name: str = "") -> DistillDelivery:
    """Build a delivery from ``{"type": ..., "source": ..., "max_keep_data": ...}``.

    ``type`` is ``"FunctionOutputs"`` or ``"MethodOutputs"`` (with or without the ``Delivery``
    suffix); MMRazor's ``func_path`` / ``method_path`` keys are accepted for ``source``.

    Raises:
        UnknownRecorderTypeError: ``type`` is missing or names no delivery type.
        RecorderConfigError: a key or a value is wrong.
    """
    if isinstance(config, DistillDelivery):
        return config
    where = f"delivery {name!r}" if name else "delivery config"
    if not isinstance(config, Mapping):
        raise RecorderConfigError(
            f"Expected {where} to be a mapping such as {{'type': 'FunctionOutputs', 'source': "
            f"'pkg.module.func'}} or a delivery instance but got {type(config).__name__}."
        )
    return build_from_config(DELIVERIES, config, where, renames=_PATH_ALIASES)


def _checked_pairs(deliveries: Any) -> Any:
    """``None``, a mapping, or the list of an iterable's ``(name, config)`` pairs."""
    if deliveries is None or isinstance(deliveries, Mapping):
        return deliveries
    if isinstance(deliveries, (str, bytes)) or not isinstance(deliveries, Iterable):
        raise RecorderConfigError(
            "Expected `deliveries` to be a mapping {name: config} or an iterable of "
            f"(name, config) pairs but got {type(deliveries).__name__} {deliveries!r}."
        )
    pairs = list(deliveries)
    for number, item in enumerate(pairs):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise RecorderConfigError(
                "Expected `deliveries` to be a mapping {name: config} or an iterable of "
                f"(name, config) pairs but item {number} is {item!r}, not a (name, config) pair."
            )
    return pairs


class DistillDeliveryManager:
    """Several named deliveries, switched and entered together.

    Args:
        deliveries: ``{name: config}`` where each config is a mapping such as
            ``{"type": "FunctionOutputs", "source": "pkg.data.random_crop", "max_keep_data": 1}``
            or a delivery instance (an iterable of ``(name, config)`` pairs works too).

    Raises:
        DuplicateNameError: a name appears twice.
        RecorderConfigError: a config is wrong.

    Examples:
        >>> import random
        >>> manager = DistillDeliveryManager(
        ...     {"coin": {"type": "FunctionOutputs", "source": "random.random"}}
        ... )
        >>> with manager:  # the teacher's pass
        ...     teacher_sees = random.random()
        >>> manager.override_data = True
        >>> with manager:  # the student's pass
        ...     student_sees = random.random()
        >>> student_sees == teacher_sees
        True
    """

    def __init__(
        self,
        deliveries: Mapping[str, Mapping[str, Any] | DistillDelivery]
        | Iterable[tuple[str, Mapping[str, Any] | DistillDelivery]]
        | None = None,
    ) -> None:
        self._deliveries: dict[str, DistillDelivery] = {}
        self._override_data = False
        for name, config in named_items(_checked_pairs(deliveries)):
            add_named(self._deliveries, name, partial(build_delivery, config, name), "delivery")

    @property
    def deliveries(self) -> Mapping[str, DistillDelivery]:
        """The deliveries by name (read-only)."""
        return MappingProxyType(self._deliveries)

    def get_delivery(self, name: str) -> DistillDelivery:
        """The delivery named ``name``.

        Raises:
            RecorderConfigError: no such name (the message lists the closest names).
        """
        return get_named(self._deliveries, name, "delivery")

    @property
    def override_data(self) -> bool:
        """The mode of every delivery: ``False`` records, ``True`` replays."""
        return self._override_data

    @override_data.setter
    def override_data(self, override: bool) -> None:
        for delivery in self._deliveries.values():
            delivery.override_data = override
        self._override_data = override

    def initialize(self) -> None:
        """Install every patch until :meth:`release` (see :meth:`DistillDelivery.initialize`)."""
        apply_all(self._deliveries.values(), DistillDelivery.initialize, DistillDelivery.release)

    def release(self) -> None:
        """Restore every patched callable, newest first."""
        for delivery in reversed(list(self._deliveries.values())):
            delivery.release()

    def reset(self) -> None:
        """Empty every queue."""
        for delivery in self._deliveries.values():
            delivery.reset()

    def __enter__(self) -> DistillDeliveryManager:
        apply_all(
            self._deliveries.values(),
            DistillDelivery.__enter__,
            lambda delivery: delivery.__exit__(None, None, None),
        )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for delivery in reversed(list(self._deliveries.values())):
            delivery.__exit__(exc_type, exc, tb)

    def __len__(self) -> int:
        return len(self._deliveries)

    def __contains__(self, name: object) -> bool:
        return name in self._deliveries

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._deliveries.items())
        return f"DistillDeliveryManager({inner})"
