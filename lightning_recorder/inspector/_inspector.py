"""`Inspector`, its label map and its layer hooks."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from .._core.checks import check_bool, check_option, suggestion
from .._core.hooks import HookSet, WeakHook
from .._core.structures import Versions, map_tensors, modified, snapshot
from ..errors import (
    RecorderConfigError,
    RecorderStateError,
    RecordModifiedError,
    UnknownSourceError,
)
from ._trace import (
    Label,
    LayerRow,
    Mode,
    check_static_flow,
    example_inputs,
    label_text,
    model_statistics,
    parse_label,
    render,
    table_options,
    trace,
)

__all__ = ["Inspector", "LayerRow", "Postprocessor"]

Postprocessor = Callable[[Any], Any]
"""A per-layer post-processing function: ``output -> replacement or None`` (``None`` keeps the
output)."""


class LabelMap(Mapping[Label, Any]):
    """A read-only mapping keyed by layer labels; ``m[(1, 3)]`` and ``m["1-3"]`` are the same.
    ``m["x"]`` raises :class:`~lightning_recorder.RecorderConfigError` (no label), while
    ``"x" in m`` is ``False`` and ``m.get("x")`` is ``None``, as for any mapping.

    ``versions``: the version counters of recorded outputs, checked on every read.
    """

    __slots__ = ("_items", "_versions")

    def __init__(self, items: dict[Label, Any], versions: dict[Label, Versions] | None = None):
        self._items = items
        self._versions = versions or {}

    def __getitem__(self, key: Any) -> Any:
        label = parse_label(key)
        try:
            value = self._items[label]
        except KeyError:
            held = ", ".join(label_text(k) for k in self._items) or "none"
            raise KeyError(f"No entry for layer {label_text(label)}; entries: {held}.") from None
        if modified(value, self._versions.get(label)):
            raise RecordModifiedError(
                f"The activation of layer {label_text(label)} was modified in place after it was "
                "recorded, so it no longer holds what the layer returned; an in-place operation "
                "such as ReLU(inplace=True) after the layer is the usual cause. Record the layer "
                "that makes the change instead, or pass `activation_postproc=torch.clone`: the "
                "rest of the forward then uses a copy and the record stays intact."
            )
        return value

    def _held(self, key: object) -> Label | None:
        """``key``'s label when the map holds it (a key that is no label is not held: a
        Mapping's ``in`` and ``get`` answer for any key)."""
        try:
            label = parse_label(key)
        except RecorderConfigError:
            return None
        return label if label in self._items else None

    def __contains__(self, key: object) -> bool:
        return self._held(key) is not None

    def get(self, key: Any, default: Any = None) -> Any:
        label = self._held(key)
        return default if label is None else self[label]

    def __iter__(self) -> Iterator[Label]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"LabelMap({self._items!r})"


class _Pass:
    """What one forward through the inspector needs and finds."""

    __slots__ = ("found", "open", "postproc", "queue", "record", "seen", "starts", "versions")

    def __init__(
        self,
        record: bool,
        postproc: Postprocessor | None,
        queue: list[Postprocessor] | None,
        found: dict[Label, Any],
    ) -> None:
        self.record = record
        self.postproc = postproc  # one callable for every recorded layer
        self.queue = queue  # or one per recorded layer, taken as each finishes (scio's order)
        self.starts: dict[str, int] = {}  # calls started, per module name
        self.open: dict[str, list[int]] = {}  # calls not yet finished, per module name
        self.found = found
        self.versions: dict[Label, Versions] = {}  # of each record, after its post-processor
        self.seen: set[Label] = set()


class _LayerHook(WeakHook["Inspector"]):
    """Hooks of one recorded module: weakly bound to the inspector, inert when copied."""

    __slots__ = ("_labels", "_name")

    def __init__(self, inspector: Inspector, name: str, labels: tuple[Label, ...]) -> None:
        super().__init__(inspector)
        self._name = name
        self._labels = labels  # the label of each call of the module, in call order

    def _pass(self) -> _Pass | None:
        inspector = self.live()
        return None if inspector is None else inspector._pass


class _StartHook(_LayerHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any) -> None:
        state = self._pass()
        if state is not None:
            number = state.starts.get(self._name, 0)
            state.starts[self._name] = number + 1
            state.open.setdefault(self._name, []).append(number)


class _EndHook(_LayerHook):
    __slots__ = ("_detach", "_recorded")

    def __init__(
        self,
        inspector: Inspector,
        name: str,
        labels: tuple[Label, ...],
        recorded: frozenset[Label],
    ) -> None:
        super().__init__(inspector, name, labels)
        self._recorded = recorded
        self._detach = inspector.detach

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        state = self._pass()
        if state is None or not state.open.get(self._name):
            return None
        number = state.open[self._name].pop()
        if number >= len(self._labels) or self._labels[number] not in self._recorded:
            return None
        label = self._labels[number]
        state.seen.add(label)
        if state.record:
            # every tensor of a structured output too (an LSTM's tuple, a ModelOutput)
            detached = map_tensors(output, torch.Tensor.detach) if self._detach else output
            state.found[label] = detached
        postproc = state.postproc
        if postproc is None and state.queue:
            postproc = state.queue.pop(0)
        replacement = None if postproc is None else postproc(output)
        if state.record:  # a post-processor's own in-place change is part of the record
            state.versions[label] = snapshot(state.found[label])
        return replacement


class Inspector(nn.Module):
    """Wrap a network: a labelled summary, recording of chosen layers, on-the-fly post-processing.

    The structure comes from one traced forward at construction, on ``input_data`` or on random
    inputs of ``input_size``; it runs in ``mode`` (``"eval"`` by default, as torchinfo does) under
    ``torch.no_grad()``, and the network's training flags, buffers and the global random state
    are restored afterwards. Labels are torchinfo's ``depth-idx``: ``depth`` is the depth in the
    module tree (the network itself is ``0-1``), ``idx`` counts that depth's rows from 1 in call
    order. A module called several times gets one label per call.

    Recording assumes the control flow of later forwards matches the traced one: the ``n``-th
    call of a module in a forward gets the label of its ``n``-th traced call. A recorded layer
    that does not run raises an error naming it. Only forwards through the inspector record;
    calling ``inspector.net`` directly does not.

    Args:
        net: the network to wrap (also available as ``inspector.net``).
        input_size: the shape of the traced forward's input, batch dimension included
            (e.g. ``(1, 5)``), or a list of shapes, one per positional input.
        input_data: the traced forward's input instead: a tensor, a tuple of positional
            arguments, or a dict of keyword arguments.
        dtypes: with ``input_size``, one dtype per input (default ``float32``; integer dtypes
            give zeros, e.g. token ids).
        device: with ``input_size``, where the inputs are made (default: the network's).
            ``dtypes`` or ``device`` with ``input_data`` raises
            :class:`~lightning_recorder.RecorderConfigError`: its tensors are used as they are.
        mode: ``"eval"``, ``"train"`` or ``"same"`` (the network's current mode) for the trace.
        detach: store detached activations (default ``False``: they keep their autograd graph,
            so a loss may use them).
        force_static_flow: first check, as scio does, that ``torch.fx.symbolic_trace`` can trace
            the network, i.e. that its control flow does not depend on the data; a network it
            cannot trace is refused. Default ``False``: any network is accepted, and a recorded
            layer that does not run in a later forward is reported then.
        **summary_kwargs: torchinfo's display options. ``col_names`` (among
            ``"input_size"``, ``"output_size"``, ``"num_params"``, ``"params_percent"``) and
            ``depth`` (rows deeper than it are hidden) shape this package's table too;
            ``col_width``, ``row_settings``, ``verbose``, ``batch_dim`` and
            ``cache_forward_pass`` are passed to torchinfo only (see :attr:`summary`).

    Raises:
        RecorderConfigError: bad arguments, a scripted network (``torch.jit.script``: a
            scripted submodule gets no row), or the traced forward failed.
        RecorderStateError: ``force_static_flow=True`` and the network's control flow is not
            static.
        TypeError: an unknown keyword argument.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> toynet = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3), nn.ReLU())
        >>> inspector = Inspector(toynet, input_size=(1, 5))
        >>> inspector.record((0, 1), (1, 3))
        >>> x = torch.rand(1, 5)
        >>> out = inspector(x)
        >>> torch.equal(inspector.activations[(1, 3)], toynet[2](toynet[1](toynet[0](x))))
        True
        >>> inspector.recording
        ((0, 1), (1, 3))
        >>> inspector.release()
    """

    def __init__(
        self,
        net: nn.Module,
        /,
        *,
        input_size: Sequence[int] | Sequence[Sequence[int]] | None = None,
        input_data: Any = None,
        dtypes: Sequence[torch.dtype] | None = None,
        device: torch.device | str | None = None,
        mode: Mode = "eval",
        detach: bool = False,
        force_static_flow: bool = False,
        **summary_kwargs: Any,
    ) -> None:
        super().__init__()
        if not isinstance(net, nn.Module):
            raise RecorderConfigError(
                f"Expected `net` to be an nn.Module but got {type(net).__name__}."
            )
        if isinstance(net, torch.jit.ScriptModule):
            raise RecorderConfigError(
                f"Expected `net` to take module hooks but got a scripted module "
                f"({type(net).__name__}, torch.jit.script), on which torch allows none; inspect "
                "the network before scripting it."
            )
        check_option("mode", mode, ("eval", "train", "same"))
        check_bool(detach, "detach")
        check_bool(force_static_flow, "force_static_flow")
        table = table_options(summary_kwargs)
        args, kwargs = example_inputs(net, input_size, input_data, dtypes, device)
        if force_static_flow:
            check_static_flow(net)
        self.net = net
        self.detach = detach
        self._mode = mode
        self._example = (args, kwargs)
        self._summary_kwargs = dict(summary_kwargs)
        self._table = table
        self._statistics: Any = None
        self._layers = tuple(trace(net, args, kwargs, mode))
        self._rows = {row.label: row for row in self._layers}
        calls: dict[str, list[Label]] = {}
        for row in self._layers:
            if row.called:
                calls.setdefault(row.name, []).append(row.label)
        self._calls = {name: tuple(labels) for name, labels in calls.items()}  # in call order
        self._recording: tuple[Label, ...] = ()
        self._activations: dict[Label, Any] = {}
        self._versions: dict[Label, Versions] = {}
        self._hooked: dict[str, weakref.ref[nn.Module]] = {}  # the modules record() hooked
        self._pass: _Pass | None = None
        self._start_hooks()

    def _start_hooks(self) -> None:
        self._hooks = HookSet(f"Inspector({type(self.net).__name__})")
        weakref.finalize(self, self._hooks.remove_all)  # no hook outlives a dropped inspector

    # ------------------------------------------------------------------ choosing layers
    def record(self, *labels: Label | str) -> None:
        """Record the outputs of these layers from now on (replacing the previous choice).

        Args:
            *labels: ``(depth, idx)`` tuples or ``"depth-idx"`` strings; order and duplicates
                do not matter. No label stops recording.

        Raises:
            UnknownSourceError: a label names no layer (the message lists the closest ones).
            RecorderConfigError: a label is malformed, or names a container that is never
                called itself (it has no output to record).
        """
        if len(labels) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
            first, second = labels
            raise RecorderConfigError(
                f"Expected a layer label such as (1, 3) or '1-3' but got int {first!r}. Did you "
                f"mean `rnet.record(({first}, {second}))`?"
            )
        chosen = {self._row(label).label for label in labels}
        recording = tuple(sorted(chosen))
        self._hooks.remove_all()
        self._recording = ()
        self._hooked = {}
        recorded = frozenset(recording)
        try:
            for name in dict.fromkeys(self._rows[label].name for label in recording):
                module = self.net.get_submodule(name)
                self._hooked[name] = weakref.ref(module)
                calls = self._calls.get(name, ())
                self._hooks.add(module.register_forward_pre_hook(_StartHook(self, name, calls)))
                end = _EndHook(self, name, calls, recorded)
                self._hooks.add(module.register_forward_hook(end))
        except BaseException:
            self._hooks.remove_all()
            raise
        self._recording = recording

    def _row(self, label: Any) -> LayerRow:
        key = parse_label(label)
        row = self._rows.get(key)
        if row is None:
            names = [r.text for r in self._layers]
            raise UnknownSourceError(
                f"No layer labelled {label_text(key)} in {type(self.net).__name__}. "
                f"{suggestion(label_text(key), names, 'layer labels')} See `print(inspector)`."
            )
        if not row.called:
            raise RecorderConfigError(
                f"Expected a layer that runs but {row.text} ({row.type_name} {row.name!r}) is a "
                "container that is never called itself, so it has no output; record the layers "
                "inside it instead."
            )
        return row

    def release(self) -> None:
        """Stop recording and remove every hook. Safe to call any number of times."""
        self._hooks.remove_all()
        self._recording = ()

    def __enter__(self) -> Inspector:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        *args: Any,
        activation_postproc: Postprocessor | Sequence[Postprocessor] | None = None,
        dont_record: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Run the network, recording the chosen layers and post-processing their outputs.

        Args:
            *args: passed to the network.
            activation_postproc: one callable for every recorded layer, or a list with one per
                recorded layer, given out in the order the layers finish (as scio does: the
                first callable goes to the first recorded layer whose forward returns, so a
                layer's callable comes after those of the layers inside it). Each gets the
                layer's output after it was recorded and returns a replacement, or ``None`` to
                keep it (an in-place change also changes the record). Inside it,
                :attr:`activations` holds this forward's activations so far, its own included.
            dont_record: run without updating :attr:`activations` (post-processing still runs).
            **kwargs: passed to the network.

        Returns:
            The network's output.

        Raises:
            RecorderConfigError: ``activation_postproc`` does not fit the recorded layers.
            RecorderStateError: a recorded layer did not run in this forward.
        """
        check_bool(dont_record, "dont_record")
        postproc, queue = self._postprocs(activation_postproc)
        found: dict[Label, Any] = {}
        state = _Pass(not dont_record, postproc, queue, found)
        if not dont_record:
            self._activations = found  # seen from inside post-processors as layers finish
            self._versions = state.versions
        self._pass = state
        try:
            output = self.net(*args, **kwargs)
        finally:
            self._pass = None
        if not dont_record:
            self._activations = {label: found[label] for label in self._recording if label in found}
        has_postprocs = postproc is not None or queue is not None
        if self._recording and (not dont_record or has_postprocs):
            missing = [label for label in self._recording if label not in state.seen]
            if missing:
                raise RecorderStateError(self._missing_message(missing, state))
        return output

    def _postprocs(
        self, value: Postprocessor | Sequence[Postprocessor] | None
    ) -> tuple[Postprocessor | None, list[Postprocessor] | None]:
        if value is None:
            return None, None
        if callable(value):
            return value, None
        if (
            isinstance(value, Sequence)
            and not isinstance(value, str)
            and len(value) == len(self._recording)
            and all(callable(f) for f in value)
        ):
            return None, list(value)
        shown = ", ".join(label_text(label) for label in self._recording) or "none"
        raise RecorderConfigError(
            "Expected `activation_postproc` to be a callable or a list of "
            f"{len(self._recording)} callables, one per recorded layer ({shown}), but got "
            f"{value!r}."
        )

    def _missing_message(self, missing: list[Label], state: _Pass) -> str:
        details = []
        replaced = []
        for label in missing:
            row = self._rows[label]
            try:
                current: nn.Module | None = self.net.get_submodule(row.name)
            except AttributeError:
                current = None
            hooked = self._hooked.get(row.name)
            if hooked is None or hooked() is not current:
                replaced.append(f"{row.text} ({row.type_name} {row.name!r})")
                continue
            runs = state.starts.get(row.name, 0)
            details.append(
                f"{row.text} is call {row.call + 1} of {row.type_name} {row.name or '<net>'!r}, "
                f"which ran {runs} time(s) in this forward"
            )
        seen = ", ".join(label_text(label) for label in self._recording if label in state.seen)
        if replaced:
            details.append(
                f"the module of {', '.join(replaced)} was replaced in the network after "
                "record() hooked it (call record() again to hook the module there now)"
            )
        flow = (
            " The control flow differs from the traced forward (labels follow the traced calls)."
            if len(replaced) < len(missing)
            else ""
        )
        return (
            f"Expected every recorded layer to run in this forward but {len(missing)} did not: "
            f"{'; '.join(details)}. Recorded layers that ran: {seen or 'none'}.{flow}"
        )

    # ------------------------------------------------------------------ reading
    @property
    def activations(self) -> Mapping[Label, Any]:
        """The outputs of the recorded layers in the latest recording forward (read-only)."""
        return LabelMap(self._activations, self._versions)

    @property
    def recording(self) -> tuple[Label, ...]:
        """The recorded layers' labels, sorted (as scio sorts them)."""
        return self._recording

    @property
    def recorded_modules(self) -> Mapping[Label, nn.Module]:
        """The module of each recorded layer (read-only, keyed by label)."""
        return LabelMap(
            {label: self.net.get_submodule(self._rows[label].name) for label in self._recording}
        )

    @property
    def recorded_params(self) -> dict[str, nn.Parameter]:
        """``net.named_parameters()`` restricted to the recorded modules (and their children)."""
        wanted = {id(p) for m in self.recorded_modules.values() for p in m.parameters()}
        return {name: p for name, p in self.net.named_parameters() if id(p) in wanted}

    @property
    def layers(self) -> tuple[LayerRow, ...]:
        """Every row of the summary, in call order."""
        return self._layers

    def summary_text(self) -> str:
        """The summary table: labels, shapes, parameter counts and shares, recorded layers; under
        it the totals, and a line for the parameters of modules the traced forward did not call
        (in no row) when there are any."""
        title = f"Inspector of {type(self.net).__name__}"
        return render(title, self._layers, self._recording, self.net, *self._table)

    @property
    def summary(self) -> Any:
        """torchinfo's ``ModelStatistics`` of the network, as scio users read it.

        Computed on first read (one more forward, on the inputs given at construction, in its
        ``mode``, under ``torch.no_grad()``; every module's training flag, every buffer and the
        global random state are restored afterwards) with scio's defaults (every column,
        unlimited depth, variable names and depths, quiet) and the torchinfo
        options given to the constructor. ``summary.summary_list`` lists torchinfo's
        ``LayerInfo`` rows (``depth``, ``depth_index``, ``module``).

        Raises:
            RecorderConfigError: torchinfo is not installed (this package's own table is
                :meth:`summary_text`, also ``print(inspector)``).
        """
        if self._statistics is None:
            self._statistics = model_statistics(
                self.net, *self._example, self._mode, self._summary_kwargs
            )
        return self._statistics

    def __repr__(self) -> str:
        return self.summary_text()

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        state.update(_hooks=None, _pass=None, _statistics=None, _versions={}, _hooked={})
        # the activations without their autograd graph (``detach=False``), which a copy cannot
        # share: ``copy.deepcopy`` refuses tensors that are not leaves of a graph
        state["_activations"] = {
            label: map_tensors(value, torch.Tensor.detach)
            for label, value in self._activations.items()
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._start_hooks()
        self.record(*self._recording)
