"""Private machinery of the bulk collectors: subrecorders, their hooks, module selection.

A collector holds one :class:`SubRecorder` per chosen module; its hooks are
:class:`~lightning_recorder._core.hooks.WeakHook` s bound to the subrecorder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from .._core.hooks import GradSink, HookSet, WeakHook
from .._core.names import resolve_type
from .._core.structures import (
    Binder,
    Versions,
    copied_snapshot,
    follow_path,
    iter_tensors,
    map_tensors,
    modified,
    snapshot,
)
from ..errors import RecorderConfigError, RecorderStateError, UnknownSourceError

Condition = Callable[[], bool]
Reduction = Callable[[Any, Any], Any]
ModuleTypes = type[nn.Module] | str | Iterable[type[nn.Module] | str]

NOTHING: Any = object()  # the fold of a reducing subrecorder before its first sample


class Options(NamedTuple):
    """What every subrecorder of one collector shares."""

    condition: Condition | None
    reduction: Reduction | None
    transform: Callable[[Any], Any] | None
    track: bool  # check samples for in-place modification when read


def _owned_copy(value: Any) -> Any:
    return map_tensors(value, torch.clone)


class SubRecorder:
    """One subrecorder: the module it watches, its data, its sample count and its hooks."""

    __slots__ = (
        "__weakref__",
        "active",
        "data",
        "data_method",
        "hooks",
        "name",
        "options",
        "samples",
        "tracked",
        "type_name",
    )

    def __init__(self, options: Options, owner: str, name: str, module: nn.Module) -> None:
        self.options = options
        self.name = name
        cls = type(module)
        self.type_name = f"{cls.__module__}.{cls.__qualname__}"
        self.hooks = HookSet(f"{owner}({name or '<root>'})")
        self.data: Any = NOTHING if options.reduction is not None else []
        self.samples = 0
        self.active = True
        #: torchfunc's ``data_method``: ``"sample"``, ``"batch"`` or ``None`` (the default pick).
        self.data_method: str | None = None
        self.tracked: list[tuple[Any, Versions]] = []  # (value, version counters) to check

    def __getstate__(self) -> dict[str, Any]:
        # Copied tensors count their versions afresh (a deep copy, an unpickled collector):
        # the copy keeps which samples were modified in place, and snapshots the others again.
        state = {slot: getattr(self, slot) for slot in self.__slots__ if slot != "__weakref__"}
        state["tracked"] = [(value, modified(value, versions)) for value, versions in self.tracked]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)
        self.tracked = [(value, copied_snapshot(value, was)) for value, was in state["tracked"]]

    def offer(self, value: Any) -> None:
        condition, reduction, transform, track = self.options
        if condition is not None and not condition():
            return
        if transform is not None:
            value = transform(value)
        if reduction is None:
            if not isinstance(self.data, list):
                raise RecorderStateError(
                    f"Expected the data of subrecorder {self.name!r} to be a list to append to, "
                    f"but `apply` replaced it with a {type(self.data).__name__}; call `reset()` "
                    "before recording again."
                )
            self.data.append(value)
            if track:
                self.tracked.append((value, snapshot(value)))
        else:
            # The first sample is copied so that a fold never writes into a model's tensor.
            self.data = _owned_copy(value) if self.data is NOTHING else reduction(self.data, value)
            if track:
                self.tracked = [(self.data, snapshot(self.data))]
        self.samples += 1


class SubRecorderHook(WeakHook["SubRecorder"]):
    """A module hook bound weakly to its subrecorder; inert in a copied or pickled model."""

    __slots__ = ("_path",)

    def __init__(self, slot: SubRecorder, path: Any) -> None:
        super().__init__(slot)
        self._path = path

    def _slot(self) -> SubRecorder | None:
        slot = self.live()  # None when released or in a forward re-run by checkpointing
        return slot if slot is not None and slot.active else None

    def on_grad(self, owner: SubRecorder, grad: torch.Tensor, key: Any) -> None:
        if owner.active:
            # torchfunc's "batch" records the grad_output tuple, "sample" its first item.
            owner.offer((grad,) if owner.data_method == "batch" else grad)


def pick(value: Any, path: Any, where: str) -> Any:
    """The value a path names, or (no path) the value itself or its first tensor."""
    if path is not None:
        return follow_path(value, path, where)
    if isinstance(value, torch.Tensor):
        return value
    return next(iter_tensors(value), None)


class InputsHook(SubRecorderHook):
    __slots__ = ("_binder",)

    def __init__(self, slot: SubRecorder, path: Any, binder: Binder) -> None:
        super().__init__(slot, path)
        self._binder = binder

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        slot = self._slot()
        if slot is None:
            return
        if slot.data_method == "batch":
            value: Any = args  # torchfunc: the inputs tuple
        elif self._path is None and args:
            value = args[0]  # the common case, without binding
        else:
            bound = self._binder(args, kwargs)  # signature order: m(x=t) is recorded as m(t)
            if self._path is not None:
                value = follow_path(bound, self._path, slot.name or "<root>")
            elif bound:
                value = bound[0]
            else:
                return
        if value is not None:  # an optional argument left out: no sample, as for outputs
            slot.offer(value)


class OutputsHook(SubRecorderHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        slot = self._slot()
        if slot is not None:
            if slot.data_method == "batch":
                value = output  # torchfunc: the whole output
            elif slot.data_method == "sample":
                value = output[0]  # torchfunc: its first item (a tensor's first row)
            else:
                value = pick(output, self._path, slot.name or "<root>")
            if value is not None:
                slot.offer(value)


class OutputGradsHook(SubRecorderHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        slot = self.live_for_grads()  # also in a reentrant checkpoint's re-run
        if slot is None or not slot.active:
            return
        tensor = pick(output, self._path, slot.name or "<root>")
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(GradSink(self))


DATA_METHODS = ("sample", "batch")


def check_data_method(data_method: Any) -> str | None:
    """torchfunc's ``data_method``: ``"sample"``, ``"batch"`` or ``None`` (this package's pick)."""
    if data_method is not None and data_method not in DATA_METHODS:
        raise RecorderConfigError(
            "Expected `data_method` to be 'sample' (the first item of the data) or 'batch' (all "
            f"of it), as in torchfunc, or None for the default, but got {data_method!r}."
        )
    return data_method


def as_types(types: ModuleTypes | None) -> tuple[type, ...] | None:
    if types is None:
        return None
    if not isinstance(types, (type, str, Iterable)):
        raise RecorderConfigError(
            f"Expected `types` to be nn.Module classes (or their names) but got {types!r}."
        )
    items = [types] if isinstance(types, (type, str)) else list(types)
    resolved = tuple(resolve_type(t) if isinstance(t, str) else t for t in items)
    if not resolved or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in resolved):
        raise RecorderConfigError(
            f"Expected `types` to be nn.Module classes (or their names) but got {types!r}."
        )
    return resolved


def choose(
    entries: list[tuple[str, nn.Module]],
    how: str,
    types: ModuleTypes | None,
    indices: Iterable[int] | None,
) -> list[tuple[str, nn.Module]]:
    """The entries kept by ``types`` and ``indices`` (both must hold when both are given)."""
    wanted = as_types(types)
    if not entries:  # only children() can yield nothing: modules() yields the model itself
        raise UnknownSourceError(
            f"Expected model.{how}() to yield modules to choose from but it yields none: the "
            "model has no child modules. Use modules() to record the model itself."
        )
    positions: set[int] | None = None
    if indices is not None:
        if isinstance(indices, bool) or not isinstance(indices, (int, Iterable)):
            raise RecorderConfigError(
                "Expected `indices` to be an int or an iterable of ints but got "
                f"{type(indices).__name__} {indices!r}."
            )
        items = [indices] if isinstance(indices, int) else list(indices)
        if not items:
            raise RecorderConfigError(
                f"Expected `indices` to hold at least one position in [0, {len(entries)}) of "
                f"model.{how}(), or None for all, but got {indices!r}."
            )
        positions = set()
        for index in items:
            if isinstance(index, bool) or not isinstance(index, int):
                raise RecorderConfigError(
                    f"Expected `indices` to hold ints but got {type(index).__name__} {index!r}."
                )
            if not 0 <= index < len(entries):
                raise UnknownSourceError(
                    f"Expected `indices` to hold positions in [0, {len(entries)}) of "
                    f"model.{how}() but got {index}. {listing(entries, how)}"
                )
            positions.add(index)
    chosen = [
        entry
        for position, entry in enumerate(entries)
        if (positions is None or position in positions)
        and (wanted is None or isinstance(entry[1], wanted))
    ]
    if not chosen:
        asked = " and ".join(
            part
            for part in (
                wanted and "types " + ", ".join(t.__name__ for t in wanted),
                positions is not None and f"indices {sorted(positions)}",
            )
            if part
        )
        raise UnknownSourceError(
            f"No module of model.{how}() matches {asked}. {listing(entries, how)}"
        )
    return chosen


def listing(entries: list[tuple[str, nn.Module]], how: str) -> str:
    shown = ", ".join(f"{i} {type(m).__name__}" for i, (_, m) in enumerate(entries[:12]))
    more = f" (and {len(entries) - 12} more)" if len(entries) > 12 else ""
    return f"model.{how}() yields: {shown}{more}."


def release_all(slots: list[SubRecorder]) -> None:
    for slot in slots:
        slot.active = False
        slot.hooks.remove_all()
