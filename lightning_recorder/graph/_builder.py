"""The machinery behind :class:`~lightning_recorder.graph.GraphRecorder`.

Two phases, neither of which touches the model's tensors:

1. *While the forward runs*, a forward-pre hook and a forward hook on every module note each call
   (its nesting, the tensors it received and returned) and read the autograd clock: every autograd
   node carries a per-thread sequence number that grows as nodes are created, so the numbers read
   when a call starts and ends bracket the operations that ran inside it.
2. *After the forward*, a walk along ``grad_fn.next_functions`` from every recorded tensor finds the
   operations, the parameters (``AccumulateGrad`` nodes) and the edges between them, and gives each
   operation to the innermost call whose bracket holds its sequence number.

Where autograd sees nothing (tensors that do not require grad, work under ``torch.no_grad``,
modules that return their input), an edge goes from the tensor to the innermost call that received
it, and from the innermost call that returned a tensor to that tensor.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import inspect
import re
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._core.hooks import HookSet
from .._core.names import canonical_name, named_modules
from .._core.structures import shape_of

_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")
_UNBOUNDED = 1 << 64  # larger than any sequence number (AccumulateGrad nodes use 2**64 - 1)


@functools.cache
def _probe_leaf() -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor even if first asked for in that mode
        return torch.zeros((), requires_grad=True, device="cpu")


def autograd_clock() -> int | None:
    """The sequence number of a throwaway autograd node (later nodes get larger numbers).

    The probe is a view of a private leaf: it never touches the model's tensors and is freed at
    once. ``None`` under ``torch.inference_mode``, where no autograd node can be created.
    """
    with torch.enable_grad():
        probe = _probe_leaf().view(())
    fn = probe.grad_fn
    return None if fn is None else int(fn._sequence_nr())


def leaves(obj: object, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in nested tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from leaves(value, f"{path}[{i}]")
    elif hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        for name in obj.__dataclass_fields__:
            yield from leaves(getattr(obj, name, None), f"{path}.{name}")


def _arguments(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list:
    """``(name, value)`` of a call's arguments, named after ``forward``'s signature if it binds."""
    try:
        signature = inspect.signature(module.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    named: list[tuple[str, Any]] = []
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.extend(value.items())
        else:
            named.append((name, value))
    return named


def _shape_text(shape: tuple[int, ...], dtype: str) -> str:
    text = str(shape)
    return text if dtype == "float32" else f"{text} {dtype}"


@dataclass(eq=False)
class Call:
    """One call of one module."""

    module: nn.Module
    name: str
    type: str
    index: int
    depth: int
    parent: Call | None
    start: int | None
    stop: int | None = None
    inputs: set[int] = field(default_factory=set)

    @property
    def id(self) -> str:
        base = "module:" + (self.name or "<root>")
        return base if self.index == 1 else f"{base}#{self.index}"

    @property
    def label(self) -> str:
        title = self.name or self.type
        if self.index > 1:
            title += f" #{self.index}"
        return f"{title}\n{self.type}" if self.name else title

    def suffix(self) -> str:
        return "" if self.index == 1 else f"#{self.index}"

    def within(self, ancestor: Call) -> bool:
        call: Call | None = self
        while call is not None:
            if call is ancestor:
                return True
            call = call.parent
        return False


@dataclass(eq=False)
class TensorRecord:
    """A tensor seen at a module boundary (or an unregistered leaf found by the walk)."""

    key: tuple[Any, ...]
    ref: weakref.ref[torch.Tensor] | None
    shape: tuple[int, ...]
    dtype: str
    parent: Call | None
    fn: Any = None  # grad_fn of a non-leaf tensor that requires grad
    top_input: str | None = None
    top_output: str | None = None
    first_output: str | None = None
    first_input: str | None = None
    consumers: list[Call] = field(default_factory=list)
    producers: list[Call] = field(default_factory=list)

    @property
    def name(self) -> str:
        return (
            self.top_input or self.top_output or self.first_output or self.first_input or "tensor"
        )


@dataclass(eq=False)
class ParamRecord:
    name: str
    label: str
    shape: tuple[int, ...]
    dtype: str
    call: Call


@dataclass(eq=False)
class OpRecord:
    name: str
    seq: int
    call: Call


Record = Call | TensorRecord | ParamRecord | OpRecord


class GraphBuilder:
    """Holds the state of one recording: hooks in, calls noted, graph built at the end."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = named_modules(model)
        self.module_names: dict[int, str] = {}
        self.owners: dict[int, set[int]] = {}
        self.param_names: dict[int, str] = {}
        for mname, module in self.modules.items():
            self.module_names.setdefault(id(module), mname)
            for pname, param in module.named_parameters(recurse=False):
                self.owners.setdefault(id(param), set()).add(id(module))
                qualified = f"{mname}.{pname}" if mname else pname
                self.param_names.setdefault(id(param), canonical_name(qualified))
        self.calls: list[Call] = []
        self.stack: list[Call] = []
        self.counts: dict[int, int] = {}
        self.tensors: dict[tuple[Any, ...], TensorRecord] = {}
        self.tensor_order: list[TensorRecord] = []

    # ------------------------------------------------------------------ hooks
    def attach(self, hooks: HookSet) -> None:
        # Under torch.compile the hooks run eagerly (a graph break) instead of being traced.
        enter, leave = torch.compiler.disable(self._enter), torch.compiler.disable(self._leave)
        for module in {id(m): m for m in self.modules.values()}.values():
            if isinstance(module, torch.jit.ScriptModule):  # torch allows it no hooks
                continue
            hooks.add(module.register_forward_pre_hook(enter, with_kwargs=True))
            hooks.add(module.register_forward_hook(leave, with_kwargs=True, always_call=True))

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        parent = self.stack[-1] if self.stack else None
        index = self.counts[id(module)] = self.counts.get(id(module), 0) + 1
        call = Call(
            module=module,
            name=self.module_names.get(id(module), type(module).__name__),
            type=type(module).__name__,
            index=index,
            depth=0 if parent is None else parent.depth + 1,
            parent=parent,
            start=autograd_clock(),
        )
        self.calls.append(call)
        self.stack.append(call)
        for argname, value in _arguments(module, args, kwargs):
            for path, tensor in leaves(value, argname):
                rec = self._tensor(tensor, parent)
                if id(rec) not in call.inputs:
                    call.inputs.add(id(rec))
                    rec.consumers.append(call)
                if parent is None:
                    rec.top_input = rec.top_input or path + call.suffix()
                else:
                    rec.first_input = rec.first_input or f"{call.name}{call.suffix()}:{path}"

    def _leave(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if not self.stack or self.stack[-1].module is not module:
            return  # our pre-hook did not run for this call (an earlier pre-hook raised)
        call = self.stack.pop()
        call.stop = autograd_clock()
        for path, tensor in leaves(output, ""):
            rec = self._tensor(tensor, call.parent)
            if rec.parent is not None and rec.parent.within(call):
                rec.parent = call.parent  # the tensor escapes the call
            if id(rec) not in call.inputs and call not in rec.producers:
                rec.producers.append(call)
            if call.parent is None:
                rec.top_output = rec.top_output or "output" + path + call.suffix()
            else:
                rec.first_output = rec.first_output or f"{call.name}{call.suffix()}:out{path}"

    def _tensor(self, tensor: torch.Tensor, parent: Call | None) -> TensorRecord:
        """The record of ``tensor``, created in scope ``parent`` if it is new."""
        fn = tensor.grad_fn
        if fn is not None:
            key: tuple[Any, ...] = ("fn", fn, tensor.output_nr)
        elif tensor.requires_grad:
            key = ("leaf", id(tensor))
        else:
            try:
                version = tensor._version
            except RuntimeError:  # inference tensors have no version counter
                version = 0
            key = ("value", id(tensor), version)
        rec = self.tensors.get(key)
        if rec is not None and (rec.ref is None or rec.ref() is tensor):
            return rec
        dtype = str(tensor.dtype).removeprefix("torch.")
        rec = TensorRecord(
            key=key,
            ref=None if fn is not None else weakref.ref(tensor),
            shape=shape_of(tensor),
            dtype=dtype,
            parent=parent,
            fn=fn,
        )
        self.tensors[key] = rec
        self.tensor_order.append(rec)
        return rec

    # ------------------------------------------------------------------ build
    def build(self) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        """Walk autograd from every recorded tensor; return node fields and edges."""
        timed = [c for c in self.calls if c.start is not None]
        starts = [c.start or 0 for c in timed]
        ops: dict[Any, OpRecord] = {}
        params: dict[tuple[int, int], ParamRecord] = {}
        extra_leaves: dict[int, TensorRecord] = {}
        edges: dict[tuple[int, int], tuple[Record, Record]] = {}
        pending: deque[Any] = deque()

        def edge(src: Record, dst: Record) -> None:
            edges.setdefault((id(src), id(dst)), (src, dst))

        def owner(seq: int) -> Call | None:
            i = bisect.bisect_left(starts, seq) - 1
            call: Call | None = timed[i] if i >= 0 else None
            while call is not None:
                start = call.start if call.start is not None else _UNBOUNDED
                stop = call.stop if call.stop is not None else _UNBOUNDED
                if start < seq < stop:
                    return call
                call = call.parent
            return None

        def op_of(fn: Any) -> OpRecord | None:
            if fn in ops:
                return ops[fn]
            call = owner(int(fn._sequence_nr()))
            if call is None:
                return None  # created before or outside every recorded call
            ops[fn] = op = OpRecord(name=fn.name(), seq=int(fn._sequence_nr()), call=call)
            pending.append(fn)
            return op

        leaf_recs = {k[1]: t for k, t in self.tensors.items() if k[0] == "leaf"}
        for rec in self.tensor_order:
            if rec.fn is not None and (op := op_of(rec.fn)) is not None:
                edge(op, rec)
        while pending:
            fn = pending.popleft()
            consumer = ops[fn]
            for nxt, nr in fn.next_functions:
                if nxt is None:
                    continue
                src: Record | None
                if type(nxt).__name__ == "AccumulateGrad" and hasattr(nxt, "variable"):
                    src = self._leaf(nxt.variable, consumer.call, leaf_recs, params, extra_leaves)
                else:
                    src = self.tensors.get(("fn", nxt, nr)) or op_of(nxt)
                if src is not None:
                    edge(src, consumer)
        self._boundary_edges(edges)
        return self._emit(ops, params, extra_leaves, edges)

    def _leaf(
        self,
        var: torch.Tensor,
        call: Call,
        leaf_recs: dict[int, TensorRecord],
        params: dict[tuple[int, int], ParamRecord],
        extra: dict[int, TensorRecord],
    ) -> Record:
        rec = leaf_recs.get(id(var))
        if rec is not None and rec.ref is not None and rec.ref() is var:
            return rec
        if id(var) not in self.param_names:
            if id(var) not in extra:
                extra[id(var)] = TensorRecord(
                    key=("leaf", id(var)),
                    ref=None,
                    shape=shape_of(var),
                    dtype=str(var.dtype).removeprefix("torch."),
                    parent=call,
                    first_input=f"{call.name}{call.suffix()}:leaf".lstrip(":"),
                )
            return extra[id(var)]
        owners = self.owners.get(id(var), set())
        home: Call | None = call
        while home is not None and id(home.module) not in owners:
            home = home.parent
        home = home or call
        key = (id(var), id(home))
        if key not in params:
            name = self.param_names[id(var)]
            prefix = home.name + "." if home.name else ""
            params[key] = ParamRecord(
                name=name,
                label=name.removeprefix(prefix) if name.startswith(prefix) else name,
                shape=shape_of(var),
                dtype=str(var.dtype).removeprefix("torch."),
                call=home,
            )
        return params[key]

    def _boundary_edges(self, edges: dict[tuple[int, int], tuple[Record, Record]]) -> None:
        """Edges autograd cannot see: tensor -> call that received it, call -> tensor it returned.

        Added for the innermost calls only, and only where no edge already links the tensor
        to something inside the call.
        """
        outgoing: dict[int, list[Record]] = {}
        incoming: dict[int, list[Record]] = {}
        for src, dst in edges.values():
            outgoing.setdefault(id(src), []).append(dst)
            incoming.setdefault(id(dst), []).append(src)

        def inside(rec: Record, call: Call) -> bool:
            home = rec if isinstance(rec, Call) else getattr(rec, "call", None)
            return isinstance(home, Call) and home.within(call)

        for rec in self.tensor_order:
            for call in sorted(rec.consumers, key=lambda c: -c.depth):
                targets = outgoing.setdefault(id(rec), [])
                if not any(inside(t, call) for t in targets):
                    edges.setdefault((id(rec), id(call)), (rec, call))
                    targets.append(call)
            for call in sorted(rec.producers, key=lambda c: -c.depth):
                sources = incoming.setdefault(id(rec), [])
                if not any(inside(s, call) for s in sources):
                    edges.setdefault((id(call), id(rec)), (call, rec))
                    sources.append(call)

    def _emit(
        self,
        ops: dict[Any, OpRecord],
        params: dict[tuple[int, int], ParamRecord],
        extra_leaves: dict[int, TensorRecord],
        edges: dict[tuple[int, int], tuple[Record, Record]],
    ) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        ids: dict[int, str] = {}
        nodes: list[dict[str, Any]] = []

        def add(rec: Record, node: dict[str, Any]) -> None:
            ids[id(rec)] = node["id"]
            nodes.append(node)

        for call in self.calls:
            parent = call.parent.id if call.parent else None
            add(call, dict(id=call.id, kind="module", name=call.name, label=call.label,
                           depth=call.depth, parent=parent, type=call.type))  # fmt: skip
        for i, rec in enumerate([*self.tensor_order, *extra_leaves.values()]):
            top = rec.top_input or rec.top_output
            shape = _shape_text(rec.shape, rec.dtype)
            add(rec, dict(id=f"tensor:{i}", kind="tensor", name=rec.name,
                          label=f"{top}\n{shape}" if top else shape,
                          depth=0 if rec.parent is None else rec.parent.depth + 1,
                          parent=rec.parent.id if rec.parent else None,
                          type="Tensor", shape=rec.shape, dtype=rec.dtype))  # fmt: skip
        seen: dict[str, int] = {}
        by_name = {name: i for i, name in enumerate(self.param_names.values())}
        by_call = {id(c): i for i, c in enumerate(self.calls)}
        for param in sorted(params.values(), key=lambda p: (by_call[id(p.call)], by_name[p.name])):
            seen[param.name] = seen.get(param.name, 0) + 1
            pid = f"param:{param.name}" + ("" if seen[param.name] == 1 else f"#{seen[param.name]}")
            add(param, dict(id=pid, kind="parameter", name=param.name,
                            label=f"{param.label}\n{_shape_text(param.shape, param.dtype)}",
                            depth=param.call.depth + 1, parent=param.call.id, type="Parameter",
                            shape=param.shape, dtype=param.dtype))  # fmt: skip
        for i, op in enumerate(sorted(ops.values(), key=lambda o: o.seq)):
            label = _BACKWARD_SUFFIX.sub("", op.name) or op.name
            add(op, dict(id=f"op:{i}", kind="op", name=op.name, label=label,
                         depth=op.call.depth + 1, parent=op.call.id, type=op.name))  # fmt: skip
        links = [(ids[id(src)], ids[id(dst)]) for src, dst in edges.values()]
        rank = _flow_order([n["id"] for n in nodes], links)
        return nodes, sorted(links, key=lambda e: (rank[e[0]], rank[e[1]]))


def _flow_order(ids: list[str], edges: list[tuple[str, str]]) -> dict[str, int]:
    """A topological rank of every node (ties broken by list order), for a readable edge order."""
    position = {node: i for i, node in enumerate(ids)}
    indegree = dict.fromkeys(ids, 0)
    successors: dict[str, list[str]] = {}
    for src, dst in edges:
        indegree[dst] += 1
        successors.setdefault(src, []).append(dst)
    ready = [(position[n], n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    rank: dict[str, int] = {}
    while ready:
        _, node = heapq.heappop(ready)
        rank[node] = len(rank)
        for nxt in successors.get(node, []):
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                heapq.heappush(ready, (position[nxt], nxt))
    for node in ids:  # only reached on a cycle, which the recording does not produce
        rank.setdefault(node, len(rank))
    return rank
