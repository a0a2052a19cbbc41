"""The traced forward behind :class:`~lightning_recorder.inspector.Inspector`: rows and table.

One forward with a pre-hook and a hook on every module lists the calls in call order. Rows are
labelled ``depth-idx`` as torchinfo labels them: ``depth`` is the module's depth in the module tree
(the network itself is 0), ``idx`` counts the rows of that depth from 1, in call order; containers
that are never called themselves (``nn.ModuleList``) get a row where torchinfo shows one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._core.checks import inputs_taken, parse_device, suggestion
from .._core.hooks import HookSet
from .._core.structures import iter_tensors, shape_of
from ..errors import RecorderConfigError, RecorderStateError

Label = tuple[int, int]
Shape = tuple[int, ...]
Mode = Literal["eval", "train", "same"]


@dataclass(frozen=True)
class LayerRow:
    """One row of an inspector's summary: one call of a module (or a container never called).

    Attributes:
        label: ``(depth, idx)``; shown as ``"depth-idx"``.
        name: the module's name in ``net.named_modules()`` (``""`` for the network).
        type_name: the module's class name.
        call: which call of this module the row is (0 for the first).
        called: ``False`` for a container that is never called itself (no activation).
        input_shapes: the shapes of the tensors among the call's arguments.
        output_shapes: the shapes of the tensors in its output.
        params: parameters counted on this row: the module's own (not its children's), on the
            first row that shows them. A parameter shared by several modules (tied weights) is
            counted once, on the row of the first of them in ``net.named_parameters()`` order.
        shared: the names, as in ``net.named_parameters()``, of the module's own parameters that
            are counted on another module's row (tied weights), on the module's first row.
    """

    label: Label
    name: str
    type_name: str
    call: int
    called: bool
    input_shapes: tuple[Shape, ...]
    output_shapes: tuple[Shape, ...]
    params: int
    shared: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The label as text, e.g. ``"1-3"``."""
        return f"{self.label[0]}-{self.label[1]}"


def label_text(label: Label) -> str:
    return f"{label[0]}-{label[1]}"


def parse_label(value: Any) -> Label:
    """``(1, 3)``, ``[1, 3]`` or ``"1-3"`` as ``(1, 3)``."""
    if isinstance(value, str):
        depth, sep, idx = value.strip().partition("-")
        if sep and depth.strip().isdigit() and idx.strip().isdigit():
            return int(depth), int(idx)
    elif (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        return int(value[0]), int(value[1])
    raise RecorderConfigError(
        f"Expected a layer label such as (1, 3) or '1-3' but got {type(value).__name__} {value!r}."
    )


def _shapes(value: Any) -> tuple[Shape, ...]:
    return tuple(shape_of(t) for t in iter_tensors(value))


class _Call:
    __slots__ = ("inputs", "module", "name", "outputs")

    def __init__(self, module: nn.Module, name: str, inputs: tuple[Shape, ...]) -> None:
        self.module = module
        self.name = name
        self.inputs = inputs
        self.outputs: tuple[Shape, ...] = ()


def example_inputs(
    net: nn.Module,
    input_size: Sequence[int] | Sequence[Sequence[int]] | None,
    input_data: Any,
    dtypes: Sequence[torch.dtype] | None,
    device: torch.device | str | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments of the traced forward."""
    if (input_size is None) == (input_data is None):
        given = "both" if input_size is not None else "neither"
        raise RecorderConfigError(
            "Expected exactly one of `input_size` (e.g. (1, 5)) or `input_data` (a tensor, a tuple "
            f"of arguments or a dict of keyword arguments) but got {given}."
        )
    if input_data is not None:
        for name, value, to in (("dtypes", dtypes, "dtype"), ("device", device, "device")):
            if value is not None:
                raise RecorderConfigError(
                    f"Expected `{name}` only with `input_size` but got {name}={value!r} with "
                    "`input_data`, whose tensors are used as they are; leave it out, or "
                    f"convert `input_data` first (`x.to({to}=...)`)."
                )
        if isinstance(input_data, torch.Tensor):
            return (input_data,), {}
        if isinstance(input_data, Mapping):
            return (), dict(input_data)
        if isinstance(input_data, (tuple, list)):
            return tuple(input_data), {}
        raise RecorderConfigError(
            "Expected `input_data` to be a tensor, a tuple or list of positional arguments, or a "
            f"dict of keyword arguments but got {type(input_data).__name__}."
        )
    assert input_size is not None  # for mypy: checked above
    sizes = _parse_sizes(input_size)
    if dtypes is not None and (isinstance(dtypes, str) or not isinstance(dtypes, Sequence)):
        raise RecorderConfigError(
            f"Expected `dtypes` to be {len(sizes)} torch.dtype(s), one per input, but got "
            f"{type(dtypes).__name__} {dtypes!r}."
        )
    device = _available_device(device)
    kinds = list(dtypes) if dtypes is not None else [torch.float32] * len(sizes)
    if len(kinds) != len(sizes) or not all(isinstance(d, torch.dtype) for d in kinds):
        raise RecorderConfigError(
            f"Expected `dtypes` to be {len(sizes)} torch.dtype(s), one per input, but got "
            f"{dtypes!r}."
        )
    if device is None:
        first = next(iter([*net.parameters(), *net.buffers()]), None)
        device = first.device if first is not None else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)  # the global random state is left alone
    tensors = [
        torch.rand(size, generator=generator).to(device=device, dtype=kind)
        if kind.is_floating_point
        else torch.zeros(size, dtype=kind, device=device)
        for size, kind in zip(sizes, kinds, strict=True)
    ]
    return tuple(tensors), {}


def _available_device(device: Any) -> torch.device | None:
    """``device`` parsed, and checked to exist on this machine."""
    dev = parse_device(device)
    if dev is None or dev.type in ("cpu", "meta"):
        return dev
    backend = getattr(torch, dev.type, None)
    available = backend is not None and getattr(backend, "is_available", lambda: False)()
    if available and dev.index is not None:
        available = dev.index < backend.device_count()  # type: ignore[union-attr]
    if not available:
        raise RecorderConfigError(
            f"Expected `device` to be an available device but got {str(dev)!r}: "
            f"{dev.type.upper()} is not available here (torch.{dev.type}.is_available() is False, "
            "or the index is out of range); use 'cpu' or leave device=None."
        )
    return dev


def _is_shape(value: Any) -> bool:
    return isinstance(value, Sequence) and all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value
    )


def _parse_sizes(input_size: Any) -> list[Shape]:
    if isinstance(input_size, Sequence) and not isinstance(input_size, str) and input_size:
        if _is_shape(input_size):
            return [tuple(input_size)]
        if all(_is_shape(s) and not isinstance(s, str) for s in input_size):
            return [tuple(s) for s in input_size]
    raise RecorderConfigError(
        "Expected `input_size` to be a shape such as (1, 5), batch dimension included, with "
        f"positive sizes, or a list of such shapes (one per positional input) but got "
        f"{input_size!r}."
    )


def trace(
    net: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mode: Mode
) -> list[LayerRow]:
    """Run one forward of ``net`` and list its rows; the network is left as it was found."""
    names = {id(m): n for n, m in net.named_modules(remove_duplicate=False)}  # last name wins
    calls: list[_Call] = []
    open_calls: dict[int, list[_Call]] = {}

    def pre(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        call = _Call(module, names[id(module)], _shapes((a, kw)))
        calls.append(call)
        open_calls.setdefault(id(module), []).append(call)

    def post(module: nn.Module, a: Any, output: Any) -> None:
        open_calls[id(module)].pop().outputs = _shapes(output)

    hooks = HookSet("Inspector trace")
    try:
        inputs = "`input_size`/`input_data`"
        with inputs_taken(net, inputs, forward="the traced forward"), _as_found(net):
            for module in net.modules():
                if isinstance(module, torch.jit.ScriptModule):  # torch allows it no hooks
                    continue
                hooks.add(module.register_forward_pre_hook(pre, with_kwargs=True))
                hooks.add(module.register_forward_hook(post))
            if mode != "same":
                net.train(mode == "train")
            with torch.no_grad():
                net(*args, **kwargs)
    finally:
        hooks.remove_all()
    return _rows(net, calls)


@contextmanager
def _as_found(net: nn.Module) -> Iterator[None]:
    """Leave every module's training flag, every buffer and the global random state as found."""
    training = [(m, m.training) for m in net.modules()]
    saved: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
    done: set[int] = set()

    def save(module: nn.Module, *args: Any) -> None:
        if id(module) in done:  # a lazy module called again: its values before the first call
            return
        done.add(id(module))
        saved.extend(
            (module, name, buffer, buffer.detach().clone())
            for name, buffer in module.named_buffers(recurse=False)
        )

    # A lazy module's buffers get their first value in its first forward: saved then.
    lazy = HookSet("Inspector lazy buffers")
    for module in net.modules():
        if any(is_lazy(b) for b in module.buffers(recurse=False)):
            lazy.add(module.register_forward_pre_hook(save))
        else:
            save(module)
    devices = sorted(
        {b.device.index or 0 for b in [*net.parameters(), *net.buffers()] if b.is_cuda}
    )
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        lazy.remove_all()
        with torch.no_grad():
            for module, name, buffer, value in saved:  # e.g. BatchNorm statistics (train mode)
                buffer.copy_(value)
                if getattr(module, name, None) is not buffer:  # `self.steps = self.steps + 1`
                    setattr(module, name, buffer)
        for module, flag in training:
            module.training = flag


def _rows(net: nn.Module, calls: list[_Call]) -> list[LayerRow]:
    modules = dict(net.named_modules(remove_duplicate=False))
    ordered: list[tuple[str, _Call | None]] = []
    current: dict[int, nn.Module] = {}
    for call in calls:
        parts = call.name.split(".") if call.name else []
        for d in range(1, len(parts)):  # containers torchinfo shows without a call of their own
            ancestor = modules[".".join(parts[:d])]
            if current.get(d) is not ancestor:
                ordered.append((".".join(parts[:d]), None))
                current[d] = ancestor
        ordered.append((call.name, call))
        current[len(parts)] = call.module
        deeper = len(parts) + 1
        while deeper in current:
            del current[deeper]
            deeper += 1
    owners = _owners(net, {id(modules[name]) for name, _ in ordered})
    counts: dict[int, int] = {}
    calls_of: dict[str, int] = {}
    counted: set[int] = set()
    shown: set[int] = set()
    rows = []
    for name, found in ordered:
        module = modules[name]
        depth = len(name.split(".")) if name else 0
        counts[depth] = counts.get(depth, 0) + 1
        mine = list(module.parameters(recurse=False))
        own = [p for p in mine if owners[id(p)][0] is module and id(p) not in counted]
        counted.update(id(p) for p in own)
        elsewhere = [owners[id(p)][1] for p in mine if owners[id(p)][0] is not module]
        shared = tuple(dict.fromkeys(elsewhere)) if id(module) not in shown else ()
        shown.add(id(module))
        number = calls_of.get(name, 0)
        if found is not None:
            calls_of[name] = number + 1
        rows.append(
            LayerRow(
                label=(depth, counts[depth]),
                name=name,
                type_name=type(module).__name__,
                call=number,
                called=found is not None,
                input_shapes=found.inputs if found else (),
                output_shapes=found.outputs if found else (),
                params=sum(p.numel() for p in own),
                shared=shared,
            )
        )
    return rows


def _owners(net: nn.Module, with_rows: set[int]) -> dict[int, tuple[nn.Module, str]]:
    """For each parameter of a module with a row: the module whose row counts it, and its name.

    A parameter shared by several modules (tied weights) counts towards the first of them in
    ``net.named_parameters()`` order, as torch names it, that has a row (a scripted submodule has
    none), so that the rows add up to ``net.parameters()``, each tensor once.
    """
    owners: dict[int, tuple[nn.Module, str]] = {}
    for prefix, module in net.named_modules(remove_duplicate=False):
        if id(module) in with_rows:
            for name, param in module.named_parameters(recurse=False):
                owners.setdefault(id(param), (module, f"{prefix}.{name}" if prefix else name))
    return owners


def not_called(net: nn.Module, rows: Sequence[LayerRow]) -> tuple[int, list[str]]:
    """The parameters counted on no row because no module holding them was called, and the
    outermost modules without a row that hold them, in ``net.named_parameters()`` order.

    A scripted submodule's parameters are left out: it takes no hooks, so whether the forward
    called it is not known (they count in the totals only).
    """
    modules = dict(net.named_modules(remove_duplicate=False))
    with_rows = {id(modules[row.name]) for row in rows if row.name in modules}
    counted = {
        id(p) for m in modules.values() if id(m) in with_rows for p in m.parameters(recurse=False)
    }
    found: dict[str, int] = {}
    for name, param in net.named_parameters():  # each tensor once, under its first name
        if id(param) in counted:
            continue
        path = name.split(".")[:-1]
        chain = [(".".join(path[:d]), modules[".".join(path[:d])]) for d in range(len(path) + 1)]
        if any(isinstance(m, torch.jit.ScriptModule) for _, m in chain):
            continue
        outer = next((n for n, m in chain if id(m) not in with_rows), chain[-1][0])
        found[outer] = found.get(outer, 0) + param.numel()
    return sum(found.values()), list(found)


def _first(items: Sequence[str], k: int) -> str:
    """The first ``k`` of ``items``, then "…" if there are more."""
    return ", ".join(items[:k]) + (", …" if len(items) > k else "")


def _fmt_shapes(shapes: tuple[Shape, ...]) -> str:
    if not shapes:
        return "--"
    return _first([str(list(s)) for s in shapes], 2)


#: torchinfo's columns that this package's table shows, in its order.
COLUMNS = ("input_size", "output_size", "num_params", "params_percent")
#: torchinfo's options passed to torchinfo only (the summary attribute).
_TORCHINFO_ONLY = ("col_width", "row_settings", "verbose", "batch_dim", "cache_forward_pass")
#: scio's defaults for torchinfo.summary.
_SCIO_DEFAULTS: dict[str, Any] = {
    "col_names": COLUMNS,
    "depth": math.inf,
    "row_settings": ("var_names", "depth"),
    "verbose": 0,
}


def table_options(options: Mapping[str, Any]) -> tuple[tuple[str, ...], float]:
    """The table's columns and depth from torchinfo's options; an unknown option is an error."""
    for key in options:
        if key not in ("col_names", "depth", *_TORCHINFO_ONLY):
            known = suggestion(key, ["col_names", "depth", *_TORCHINFO_ONLY], "torchinfo options")
            raise TypeError(f"Inspector() got an unexpected keyword argument {key!r}. {known}")
    columns = options.get("col_names", COLUMNS)
    if isinstance(columns, str) or not isinstance(columns, Sequence):
        columns = (columns,)
    for column in columns:
        if column not in COLUMNS:
            raise RecorderConfigError(
                f"Expected `col_names` to hold some of {', '.join(map(repr, COLUMNS))} (the "
                f"columns of the inspector's table) but got {column!r}. "
                f"{suggestion(str(column), COLUMNS, 'columns')}"
            )
    depth = options.get("depth", math.inf)
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or depth < 0:
        raise RecorderConfigError(
            f"Expected `depth` to be a non-negative int (or math.inf) but got {depth!r}."
        )
    return tuple(columns), float(depth)


def check_static_flow(net: nn.Module) -> None:
    """scio's check: ``torch.fx`` can trace ``net`` symbolically (its control flow is static)."""
    import torch.fx

    try:
        torch.fx.symbolic_trace(net)
    except Exception as err:
        raise RecorderStateError(
            f"Expected the control flow of {type(net).__name__} to be static but "
            f"torch.fx.symbolic_trace could not trace it ({type(err).__name__}: {err}). Use the "
            "inspector at your own risk with `force_static_flow=False`: labels follow the traced "
            "forward's calls, and a recorded layer that does not run is reported."
        ) from err


def model_statistics(
    net: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mode: Mode, options: Any
) -> Any:
    """torchinfo's ``ModelStatistics`` of ``net`` on these inputs, with scio's defaults."""
    try:
        import torchinfo
    except ImportError:
        raise RecorderConfigError(
            "Expected torchinfo to be installed for `summary` (torchinfo's ModelStatistics) but "
            'it is not: `pip install torchinfo` (or `pip install "lightning-recorder[summary]"`), '
            "or read this package's table with "
            "`summary_text()` or `print(inspector)`."
        ) from None
    settings = {**_SCIO_DEFAULTS, **options}
    data: Any = dict(kwargs) if kwargs and not args else list(args)
    flags = [(m, m.training) for m in net.modules()]

    def same_mode(module: nn.Module, args: Any) -> None:
        for each, flag in flags:  # undo torchinfo's net.eval() as the forward starts
            each.training = flag

    hooks = HookSet("Inspector summary")
    try:
        # torchinfo sets every module's flag to the network's afterwards, and keeps buffers changed
        with _as_found(net):
            if mode == "same":  # torchinfo knows "train" and "eval" only
                hooks.add(net.register_forward_pre_hook(same_mode))
            shown = "eval" if mode == "same" else mode
            statistics = torchinfo.summary(net, input_data=data, mode=shown, **settings)
    finally:
        hooks.remove_all()
    clear = getattr(getattr(torchinfo, "torchinfo", None), "clear_cached_forward_pass", None)
    if clear is not None:
        clear()
    return statistics


def render(
    title: str,
    rows: Sequence[LayerRow],
    recording: Sequence[Label],
    net: nn.Module,
    columns: Sequence[str] = COLUMNS,
    max_depth: float = math.inf,
) -> str:
    """The summary table (``columns``: torchinfo's names of the columns to show)."""
    total = sum(p.numel() for p in net.parameters())
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    recorded = set(recording)
    shown_columns = [0, *(1 + COLUMNS.index(c) for c in COLUMNS if c in columns), 5]
    header = (
        "Layer (type (var_name): depth-idx)",
        "Input Shape",
        "Output Shape",
        "Param #",
        "Param %",
        "Recorded",
    )
    table: list[tuple[str, ...]] = [header]
    for row in rows:
        depth = row.label[0]
        if depth > max_depth:
            continue
        prefix = "" if depth == 0 else "│    " * (depth - 1) + "├─"
        var = row.name.rsplit(".", 1)[-1] if row.name else row.type_name
        if row.params:
            params, share = f"{row.params:,}", f"{100 * row.params / max(total, 1):.2f}%"
        else:
            params, share = ("(recursive)" if row.call else "--"), "--"
        if row.shared:  # tied weights, counted on their owner's row
            marker = f"(shared: {_first(row.shared, 2)})"
            params = f"{params} {marker}" if row.params else marker
        table.append(
            (
                f"{prefix}{row.type_name} ({var}): {row.text}",
                _fmt_shapes(row.input_shapes) if row.called else "(not called)",
                _fmt_shapes(row.output_shapes) if row.called else "--",
                params,
                share,
                "✓" if row.label in recorded else "",
            )
        )
    table = [tuple(line[i] for i in shown_columns) for line in table]
    widths = [max(len(line[i]) for line in table) for i in range(len(shown_columns))]
    right = tuple(i in (3, 4) for i in shown_columns)  # numbers right-aligned
    lines = [
        "  ".join(
            cell.rjust(w) if r else cell.ljust(w)
            for cell, w, r in zip(line, widths, right, strict=True)
        ).rstrip()
        for line in table
    ]
    rule = "=" * max(len(line) for line in lines)
    shown = ", ".join(label_text(label) for label in recording) or "None"
    unused, holders = not_called(net, rows)
    footer = []
    if unused:  # in no row: with them, the rows add up to the total
        share = f"{100 * unused / max(total, 1):.2f}%"
        footer.append(f"Params of modules not called: {unused:,} ({share}): {_first(holders, 3)}")
    return "\n".join(
        [
            title,
            rule,
            lines[0],
            rule,
            *lines[1:],
            rule,
            f"Total params: {total:,}",
            f"Trainable params: {trainable:,}",
            f"Non-trainable params: {total - trainable:,}",
            *footer,
            rule,
            f"Currently recording: {shown}",
            rule,
        ]
    )
