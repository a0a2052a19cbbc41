"""The collectors (inputs, outputs, output gradients) and their saved form."""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeGuard

import torch
from torch import nn
from typing_extensions import Self

from .._core.checks import check_callable, parse_device, parse_dtype
from .._core.names import canonical_name
from .._core.structures import Binder, PathKey, make_transform, modified, parse_path
from ..errors import NoRecordError, RecorderConfigError, RecorderStateError, RecordModifiedError
from ._subrecorders import (
    NOTHING,
    Condition,
    InputsHook,
    ModuleTypes,
    Options,
    OutputGradsHook,
    OutputsHook,
    Reduction,
    SubRecorder,
    check_data_method,
    choose,
    release_all,
)

# A dot-file, so that globbing the folder (``*``, ``*.pt``) sees the tensor files only, as in
# torchfunc; ``index.json`` is the name older versions wrote, still read.
_INDEX_FILE = ".index.json"
_OLD_INDEX_FILES = ("index.json",)
_FORMAT = "lightning_recorder.bulk"

__all__ = [
    "BackwardOutput",
    "CollectedRecord",
    "ForwardInputsCollector",
    "ForwardOutput",
    "ForwardOutputsCollector",
    "ForwardPre",
    "OutputGradsCollector",
    "load_collected",
]


@dataclass(frozen=True)
class CollectedRecord:
    """One subrecorder read back by :func:`load_collected`.

    Attributes:
        index: the subrecorder's index (its file is ``{index}.pt``).
        name: the module's name in ``model.named_modules()`` (``""`` for the model itself);
            ``None`` for a folder saved without its index (``save(..., index=False)``).
        type: the module's class, fully qualified (e.g. ``"torch.nn.modules.linear.Linear"``);
            ``None`` without the index.
        samples: how many samples were recorded; without the index, the length of a list of
            samples, else ``None``.
        data: the list of samples, their fold, or what ``apply`` made of them.
    """

    index: int
    name: str | None
    type: str | None
    samples: int | None
    data: Any


class _Collector:
    """Shared machinery of the bulk collectors; options as listed in the module docs."""

    def __init__(
        self,
        condition: Condition | None = None,
        reduction: Reduction | None = None,
        *,
        detach: bool = True,
        clone: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        path: PathKey | tuple[PathKey, ...] | None = None,
        data_method: Literal["sample", "batch"] | None = None,
    ) -> None:
        check_callable(condition, "condition", "a zero-argument callable")
        check_data_method(data_method)
        if data_method is not None and path is not None:
            raise RecorderConfigError(
                f"Expected either `path` or `data_method` but got both: {path!r} and "
                f"{data_method!r}."
            )
        check_callable(reduction, "reduction", "a two-argument callable")
        for flag_name, flag in (("detach", detach), ("clone", clone)):
            if not isinstance(flag, bool):
                raise RecorderConfigError(
                    f"Expected `{flag_name}` to be a bool but got {type(flag).__name__} {flag!r}."
                )
        self.condition = condition
        self.reduction = reduction
        self.detach = detach
        self.clone = clone
        self.path = parse_path(path)
        transform = make_transform(detach, clone, parse_device(device), parse_dtype(dtype))
        self._options = Options(condition, reduction, transform, not clone)
        self.data_method = data_method
        self._slots: list[SubRecorder] = []
        # A collector dropped without release() must not leave hooks on a live model.
        weakref.finalize(self, release_all, self._slots)

    # ------------------------------------------------------------------ registration
    def modules(
        self,
        model: nn.Module,
        types: ModuleTypes | None = None,
        indices: Iterable[int] | None = None,
    ) -> Self:
        """Register subrecorders on modules of ``model.modules()`` (recursive, model first).

        Args:
            model: the network.
            types: keep modules of these classes (a class, class names, or several of them).
            indices: keep modules at these positions of ``model.modules()`` (``0`` is ``model``).
                With ``types`` too, a module must satisfy both; with neither, all are kept.

        Returns:
            The collector itself.

        Raises:
            RecorderConfigError: a bad ``types`` or ``indices`` value, or (inputs) a ``path``
                naming no argument of a chosen module's ``forward``.
            UnknownSourceError: an index out of range, or nothing matches.
        """
        return self._register(model, "modules", types, indices)

    def children(
        self,
        model: nn.Module,
        types: ModuleTypes | None = None,
        indices: Iterable[int] | None = None,
    ) -> Self:
        """Register subrecorders on modules of ``model.children()`` (direct children only).

        Arguments, return value and errors as in :meth:`modules`.
        """
        return self._register(model, "children", types, indices)

    def _register(
        self, model: nn.Module, how: str, types: ModuleTypes | None, indices: Iterable[int] | None
    ) -> Self:
        if not isinstance(model, nn.Module):
            raise RecorderConfigError(
                f"Expected `model` to be an nn.Module but got {type(model).__name__}."
            )
        entries = list(model.named_modules() if how == "modules" else model.named_children())
        added: list[SubRecorder] = []
        try:
            for name, module in choose(entries, how, types, indices):
                slot = SubRecorder(self._options, type(self).__name__, canonical_name(name), module)
                slot.data_method = self.data_method
                added.append(slot)
                self._install(slot, module)
        except BaseException:
            release_all(added)
            raise
        self._slots.extend(added)
        return self

    def _install(self, slot: SubRecorder, module: nn.Module) -> None:
        raise NotImplementedError

    def set_data_method(self, data_method: Literal["sample", "batch"]) -> None:
        """Switch every subrecorder to torchfunc's ``data_method`` (``None``: the default pick).

        Raises:
            RecorderConfigError: not ``"sample"``, ``"batch"`` or ``None``, or ``path`` is set.
        """
        check_data_method(data_method)
        if data_method is not None and self.path is not None:
            raise RecorderConfigError(
                f"Expected no `data_method` on a collector with `path` {self.path!r} but got "
                f"{data_method!r}."
            )
        self.data_method = data_method
        for slot in self._slots:
            slot.data_method = data_method

    # ------------------------------------------------------------------ reading
    def _read(self, index: int) -> Any:
        slot = self._slots[self._position(index)]
        for value, versions in slot.tracked:
            if modified(value, versions):
                raise RecordModifiedError(
                    f"A sample of subrecorder {index} ({slot.name or '<root>'!r}) of {self!r} was "
                    "modified in place after it was recorded (e.g. by ReLU(inplace=True)); pass "
                    "clone=True to record copies."
                )
        return None if slot.data is NOTHING else slot.data

    def _position(self, index: int) -> int:
        count = len(self._slots)
        if not count:
            raise NoRecordError(
                f"Expected a subrecorder index but got {index!r} on {self!r}, which has no "
                "subrecorder: register modules with children() or modules() first."
            )
        if isinstance(index, bool) or not isinstance(index, int) or not -count <= index < count:
            raise NoRecordError(
                f"Expected a subrecorder index in [-{count}, {count - 1}] but got {index!r}: "
                f"{self!r} has {count} subrecorder(s)."
            )
        return index % count

    def __getitem__(self, index: int) -> Any:
        return self._read(index)

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[Any]:
        return (self._read(i) for i in range(len(self._slots)))

    @property
    def data(self) -> list[Any]:
        """The data of every subrecorder (a list of samples, or their fold; ``None`` if none)."""
        return list(self)

    @property
    def names(self) -> tuple[str, ...]:
        """The module name of each subrecorder (``""`` for the model itself; wrapper prefixes
        such as ``module.`` are dropped)."""
        return tuple(slot.name for slot in self._slots)

    def samples(self, index: int) -> int:
        """How many samples subrecorder ``index`` recorded (calls that met ``condition``)."""
        return self._slots[self._position(index)].samples

    def iter_samples(self) -> Iterator[int]:
        """The sample count of each subrecorder, in index order."""
        return (slot.samples for slot in list(self._slots))

    # ------------------------------------------------------------------ changing
    def apply(self, fn: Callable[[Any], Any]) -> None:
        """Replace the data of each subrecorder that recorded something by ``fn(data)``."""
        _check_fn(fn, "a callable fn(data)")
        self._apply(lambda data, samples: fn(data))

    def apply_sample(self, fn: Callable[[Any, int], Any]) -> None:
        """Replace the data of each subrecorder that recorded something by ``fn(data, samples)``.

        Example: ``collector.apply_sample(lambda total, n: total / n)`` turns sums into means.
        """
        _check_fn(fn, "a callable fn(data, samples)")
        self._apply(fn)

    def _apply(self, fn: Callable[[Any, int], Any]) -> None:
        results = [
            (slot, fn(self._read(i), slot.samples))
            for i, slot in enumerate(self._slots)
            if slot.samples
        ]
        for slot, result in results:  # all-or-nothing: nothing changes if fn raises
            slot.data = result
            slot.tracked = []

    def reset(self) -> None:
        """Forget every sample; the subrecorders stay registered."""
        for slot in self._slots:
            slot.data = NOTHING if self.reduction is not None else []
            slot.samples = 0
            slot.tracked = []

    def remove(self, index: int) -> Any:
        """Unregister subrecorder ``index`` and return its data; later indices shift down by one."""
        data = self._read(index)
        slot = self._slots.pop(self._position(index))
        slot.active = False
        slot.hooks.remove_all()
        return data

    def release(self) -> None:
        """Remove every hook. The data stays readable. Safe to call any number of times."""
        release_all(self._slots)

    def __enter__(self) -> Self:
        if self._slots and not any(slot.active for slot in self._slots):
            # A second `with` would look like it records again, yet no hook is left.
            raise RecorderStateError(
                f"Expected a collector with registered hooks on entering `with` but {self!r} was "
                "released (by release() or the end of an earlier `with` block), so nothing "
                "would be recorded; register modules again with children() or modules(), or "
                "use a new collector."
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def save(
        self,
        directory: str | os.PathLike[str],
        mkdir: bool | None = None,
        *args: Any,
        index: bool = True,
        **kwargs: Any,
    ) -> Path:
        """Write ``{index}.pt`` per subrecorder and a hidden ``.index.json`` naming their modules.

        Read it back with :func:`load_collected`.

        Args:
            directory: the folder to write to.
            mkdir: ``None`` (default) creates the folder and its parents if missing; ``True``
                calls ``Path(directory).mkdir(*args, **kwargs)`` as torchfunc does (an existing
                folder is an error unless ``exist_ok=True`` is passed); ``False`` requires an
                existing folder.
            *args: passed to ``Path.mkdir`` when ``mkdir`` is ``True``.
            index: write ``.index.json`` (module names, types, sample counts). ``False`` leaves
                only the tensor files, torchfunc's exact layout; ``load_collected`` then reads
                them without names. Either way, a save into a folder that holds an earlier
                save (with its index) replaces it: the earlier index, and the files it lists
                that this save does not rewrite, are removed.
            **kwargs: passed to ``Path.mkdir`` when ``mkdir`` is ``True``.

        Returns:
            The directory.

        Raises:
            RecorderConfigError: ``directory`` is not a path, is a file, or (``mkdir=False``)
                does not exist, or could not be created (a parent is a file).
            RecordModifiedError: a sample was changed in place after it was recorded (nothing
                is written).
        """
        root = _as_path(directory, "a folder to save into")
        # Read every subrecorder first: a sample changed in place raises before anything is
        # created or written, instead of leaving the files of the subrecorders before it.
        data = [self._read(number) for number in range(len(self._slots))]
        if mkdir is not None and not isinstance(mkdir, bool):
            raise RecorderConfigError(
                f"Expected `mkdir` to be a bool or None but got {type(mkdir).__name__} {mkdir!r}."
            )
        if root.exists() and not root.is_dir():
            raise RecorderConfigError(
                f"Expected `directory` to be a directory (created if missing) but {str(root)!r} "
                "is a file."
            )
        if mkdir:
            try:
                root.mkdir(*args, **kwargs)
            except OSError as err:
                raise RecorderConfigError(
                    f"Expected `directory` {str(root)!r} to be created by mkdir=True but "
                    f"Path.mkdir failed: {err}. Pass exist_ok=True to reuse a folder, or "
                    "mkdir=None to create it only if missing."
                ) from err
        elif mkdir is None:
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as err:  # a parent is a file, no permission …
                raise RecorderConfigError(
                    f"Expected `directory` {str(root)!r} to be a folder that can be created "
                    f"(mkdir=None creates it and its parents) but it could not be: {err}."
                ) from err
        elif not root.is_dir():
            raise RecorderConfigError(
                f"Expected `directory` {str(root)!r} to exist (mkdir=False) but it does not; "
                "pass mkdir=True or leave mkdir=None to create it."
            )
        earlier = _earlier_save(root)  # replaced: what this save does not rewrite goes
        records = []
        for number, (slot, value) in enumerate(zip(self._slots, data, strict=True)):
            torch.save(value, root / f"{number}.pt")
            records.append(
                {
                    "file": f"{number}.pt",
                    "name": slot.name,
                    "type": slot.type_name,
                    "samples": slot.samples,
                }
            )
        if index:
            index_doc = {
                "format": _FORMAT,
                "version": 1,
                "collector": type(self).__name__,
                "reduced": self.reduction is not None,
                "records": records,
            }
            text = json.dumps(index_doc, indent=2) + "\n"
            (root / _INDEX_FILE).write_text(text, encoding="utf-8")
        kept = {record["file"] for record in records} | ({_INDEX_FILE} if index else set())
        for path in earlier:
            if path.name not in kept:
                path.unlink(missing_ok=True)
        return root

    def __repr__(self) -> str:
        shown = ", ".join(repr(n or "<root>") for n in self.names[:6])
        more = ", …" if len(self._slots) > 6 else ""
        return f"{type(self).__name__}([{shown}{more}])"


class ForwardInputsCollector(_Collector):
    """Record what enters the chosen modules, before their forward runs.

    A sample is the first argument of the call: ``inputs[0]`` as in torchfunc, or, for a call
    with keyword arguments only, the first one in the order of ``forward``'s signature
    (``m(x=t)`` records ``t``). ``path`` picks another argument by position or name
    (``path="mask"``). A call that passes ``None`` there (an optional argument left out) makes no
    sample. Alias: :data:`ForwardPre`.

    Takes the options listed in the module docs (``condition``, ``reduction``, ``detach``,
    ``clone``, ``device``, ``dtype``, ``path``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> x = torch.randn(5, 3)
        >>> with ForwardInputsCollector().children(model, types=nn.Linear) as inputs:
        ...     _ = model(x)
        >>> torch.equal(inputs[0][0], x), inputs[1][0].shape, inputs.names
        (True, torch.Size([5, 4]), ('0', '2'))
    """

    def _install(self, slot: SubRecorder, module: nn.Module) -> None:
        binder = Binder(module.forward)
        self._check_argument(slot, module, binder)
        hook = InputsHook(slot, self.path, binder)
        slot.hooks.add(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _check_argument(self, slot: SubRecorder, module: nn.Module, binder: Binder) -> None:
        """Raise at registration unless ``path`` starts with an argument of ``module.forward``
        (a name it has, an item of its ``*args`` by its record name, or a position below its
        count), instead of in the middle of a forward."""
        sig = binder.signature
        if not self.path or sig is None:
            return
        where = (
            f"{type(module).__name__}.forward({', '.join(sig.parameters)}) of module "
            f"{slot.name or '<root>'!r}"
        )
        binder.check_key(self.path[0], type(self).__name__, where)


class ForwardOutputsCollector(_Collector):
    """Record what the chosen modules return, after their forward runs.

    A sample is the output itself when it is a tensor, else its first tensor (e.g. the output
    sequence of an ``nn.LSTM``); ``path`` picks another part (a position, key or field). Alias:
    :data:`ForwardOutput`.

    Takes the options listed in the module docs (``condition``, ``reduction``, ``detach``,
    ``clone``, ``device``, ``dtype``, ``path``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
        >>> a, b = torch.randn(2, 3), torch.randn(2, 3)
        >>> expected = model[0](a) + model[0](b)
        >>> collector = ForwardOutputsCollector(reduction=lambda acc, x: acc + x)
        >>> _ = collector.modules(model, indices=[1])   # model.modules(): 0 is the model itself
        >>> _ = model(a), model(b)
        >>> torch.allclose(collector[0], expected), collector.samples(0)
        (True, 2)
        >>> collector.release()
    """

    def _install(self, slot: SubRecorder, module: nn.Module) -> None:
        slot.hooks.add(module.register_forward_hook(OutputsHook(slot, self.path)))


class OutputGradsCollector(_Collector):
    """Record the gradient of the loss with respect to the chosen modules' outputs.

    A tensor hook is attached to the output (or its first tensor, or ``path``) of each forward
    call that requires grad; the sample arrives during backward. This replaces torchfunc's
    ``register_backward_hook``, which is deprecated and wrong with in-place operations. Samples
    arrive in backward order (the reverse of the forward order for repeated calls);
    ``condition`` is asked when the gradient arrives. Alias: :data:`BackwardOutput`.

    Takes the options listed in the module docs (``condition``, ``reduction``, ``detach``,
    ``clone``, ``device``, ``dtype``, ``path``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
        >>> with OutputGradsCollector().children(model, indices=[0]) as grads:
        ...     model(torch.randn(2, 3)).sum().backward()
        >>> torch.allclose(grads[0][0], model[1].weight.expand(2, 4))
        True
    """

    def _install(self, slot: SubRecorder, module: nn.Module) -> None:
        slot.hooks.add(module.register_forward_hook(OutputGradsHook(slot, self.path)))


ForwardPre = ForwardInputsCollector
"""torchfunc's name for :class:`ForwardInputsCollector`."""
ForwardOutput = ForwardOutputsCollector
"""torchfunc's name for :class:`ForwardOutputsCollector`."""
BackwardOutput = OutputGradsCollector
"""torchfunc's name for :class:`OutputGradsCollector`."""


def load_collected(
    directory: str | os.PathLike[str],
    *,
    map_location: torch.device | str | None = None,
    weights_only: bool = True,
) -> list[CollectedRecord]:
    """Read back what :meth:`~ForwardOutputsCollector.save` wrote, in subrecorder order.

    Args:
        directory: the directory given to ``save``.
        map_location: passed to :func:`torch.load` (e.g. ``"cpu"``).
        weights_only: passed to :func:`torch.load`; set ``False`` only for trusted files whose
            data ``apply`` turned into objects other than tensors and containers.

    Returns:
        One :class:`CollectedRecord` per subrecorder.

    Raises:
        RecorderConfigError: the directory holds no index written by ``save`` (nor ``0.pt``),
            the index is damaged, or a file is missing.

    Examples:
        >>> import tempfile, torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4))
        >>> with ForwardOutputsCollector().modules(model, types=nn.Linear) as outputs:
        ...     _ = model(torch.randn(2, 3))
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = outputs.save(tmp)
        ...     [(r.name, r.samples, len(r.data)) for r in load_collected(tmp)]
        [('0', 1, 1)]
    """
    root = _as_path(directory, "a folder saved with `save()`")
    index_path = next(
        (root / name for name in (_INDEX_FILE, *_OLD_INDEX_FILES) if (root / name).is_file()),
        None,
    )
    if index_path is None:
        return _load_without_index(root, map_location, weights_only)
    try:
        index_doc = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RecorderConfigError(
            f"Expected `directory` to hold a collector saved with `save()` but could not read "
            f"{index_path.name!r} in {str(root)!r}: {err}"
        ) from err
    if not isinstance(index_doc, dict) or index_doc.get("format") != _FORMAT:
        raise RecorderConfigError(
            f"Expected `directory` to hold a collector saved with `save()` but {index_path.name!r} "
            f"in {str(root)!r} is not its index (format {_FORMAT!r}): {str(index_doc)[:80]!r}."
        )
    records = index_doc.get("records")
    if not isinstance(records, list):
        raise RecorderConfigError(
            f"Expected {index_path.name!r} in {str(root)!r} to list its subrecorders under "
            f"'records' but got {type(records).__name__} {records!r:.80}; the index is damaged."
        )
    loaded = []
    for number, entry in enumerate(records):
        fields = ("file", "name", "type", "samples")
        if not isinstance(entry, dict) or not all(key in entry for key in fields):
            raise RecorderConfigError(
                f"Expected record {number} of {index_path.name!r} in {str(root)!r} to be an "
                f"object with {', '.join(map(repr, fields))} but got {entry!r:.80}; the index "
                "is damaged."
            )
        file = entry["file"]
        if not _plain_file_name(file):
            raise RecorderConfigError(
                f"Expected record {number} of {index_path.name!r} in {str(root)!r} to name a file "
                f"inside that folder (such as '{number}.pt') but got {file!r}; the index is "
                "damaged."
            )
        path = root / file
        if not path.is_file():
            raise RecorderConfigError(
                f"Expected {entry['file']!r} (subrecorder {number}, module {entry['name']!r}) in "
                f"{str(root)!r} but it does not exist."
            )
        data = torch.load(path, map_location=map_location, weights_only=weights_only)
        loaded.append(CollectedRecord(number, entry["name"], entry["type"], entry["samples"], data))
    return loaded


def _plain_file_name(file: object) -> TypeGuard[str]:
    """Whether an index names a file inside its own folder (``"0.pt"``, no path)."""
    return isinstance(file, str) and Path(file).name == file and file not in ("", ".", "..")


def _earlier_save(root: Path) -> list[Path]:
    """The index files of an earlier ``save`` into ``root`` and the files they list (none for
    a folder without such an index, whose files are not known to be a save's)."""
    found: list[Path] = []
    for name in (_INDEX_FILE, *_OLD_INDEX_FILES):
        path = root / name
        try:
            doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            continue
        found.append(path)
        records = doc.get("records")
        for entry in records if isinstance(records, list) else ():
            file = entry.get("file") if isinstance(entry, dict) else None
            if _plain_file_name(file):
                found.append(root / file)
    return found


def _load_without_index(
    root: Path, map_location: torch.device | str | None, weights_only: bool
) -> list[CollectedRecord]:
    """The ``0.pt``, ``1.pt`` … of a folder saved with ``index=False`` (or by torchfunc)."""
    numbers = (
        sorted(
            int(path.stem) for path in root.glob("*.pt") if path.stem.isdigit() and path.is_file()
        )
        if root.is_dir()
        else []
    )
    if not numbers:
        raise RecorderConfigError(
            f"Expected `directory` to hold a collector saved with `save()` but {str(root)!r} "
            f"{'holds no index and no 0.pt' if root.is_dir() else 'is not a folder'}."
        )
    if numbers != list(range(len(numbers))):
        raise RecorderConfigError(
            f"Expected `directory` to hold a collector saved with `save()` (files 0.pt to "
            f"{len(numbers) - 1}.pt) but {str(root)!r} has {', '.join(f'{n}.pt' for n in numbers)}."
        )
    loaded = []
    for number in numbers:
        data = torch.load(
            root / f"{number}.pt", map_location=map_location, weights_only=weights_only
        )
        samples = len(data) if isinstance(data, list) else None
        loaded.append(CollectedRecord(number, None, None, samples, data))
    return loaded


def _as_path(directory: Any, what: str) -> Path:
    if not isinstance(directory, (str, os.PathLike)):
        raise RecorderConfigError(
            f"Expected `directory` to be a path (str or os.PathLike) to {what} but got "
            f"{type(directory).__name__} {directory!r}."
        )
    return Path(directory)


def _check_fn(fn: Any, what: str) -> None:
    if not callable(fn):
        raise RecorderConfigError(f"Expected `fn` to be {what} but got {type(fn).__name__} {fn!r}.")
