"""A timeline of one forward and backward, and the verdict on where non-finite values began.

The :class:`~lightning_recorder.callbacks._health_trace.Trace` hooks write a :class:`Timeline`:
module calls (pre-order, with their parent and depth) and entries in the order they happened —
each call's inputs and outputs in the forward, then, in the order autograd computed them, the
gradients of module outputs, each call's share of the gradient of each of its inputs, and the
parameters' gradients — each with its NaN/+inf/-inf counts.

:meth:`Timeline.verdict` takes the first entry with non-finite values (excluded tensors aside):

* **a forward output** — its call had finite inputs (they came earlier), so that module made
  them: ``producer=True``; unless one of the module's own parameters was non-finite when the
  module was called (an earlier update, or a checkpoint, made it: ``direction="parameter"``);
* **a forward input**, already non-finite when the call started — the code of the enclosing
  module between its submodules made it (``producer=True``); at the top level it came with the
  batch (``module=None``, ``producer=False``) or from ``training_step``'s own code;
* **the loss**, the outputs finite — the loss computed outside any module;
* **a call's share of an input gradient** — that module's backward made it; ``producer`` says
  whether the gradients that reached its outputs were finite;
* **the gradient of an output** whose consumers' shares were all finite — the enclosing code
  that used the output (outside any submodule) made it; a consumer whose share was not seen
  (its input changed in place, which detaches the share from the graph) is blamed instead;
* nothing, but **a parameter's gradient** is non-finite — made where that weight's gradient is
  computed (it flows nowhere else): the module the forward called last among those whose
  parameter gradients are non-finite (its backward ran first).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.compat import dtensor_type
from .._core.structures import modified
from ..stats.norms import norm_values
from ._health_event import COUNT_KEYS

__all__ = [
    "Counts",
    "Finding",
    "Timeline",
    "as_dict",
    "exact_counts",
    "quick_counts",
    "resolve_counts",
]

Counts = tuple[int, int, int] | torch.Tensor
ZERO: tuple[int, int, int] = (0, 0, 0)


_HALF = (torch.float16, torch.bfloat16)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (tensor parallelism), else ``t``: counted without a
    collective, each rank its own part."""
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return t
    local: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
    return local


def shard_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    """The shape of this rank's part of a ``DTensor`` that is not replicated (sharded, or
    partial sums), whose counts are then this part's; ``None`` for any other tensor."""
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return None
    if all(p.is_replicate() for p in t.placements):  # type: ignore[attr-defined]
        return None  # the local part is the whole tensor
    return tuple(local_part(t).shape)


def quick_counts(t: torch.Tensor) -> Counts:
    """``(nan, posinf, neginf)`` of a tensor without waiting for a device.

    One reduction: the sum (in float32 for half precision) is finite exactly when every value
    is, unless it overflows. On the CPU a non-finite sum is followed by an exact count (so the
    answer is exact); elsewhere the sum stays on the device as a 1-element *flag*, read later by
    :func:`resolve_counts` as "at least one" NaN/+inf/-inf (a kept tensor is counted exactly by
    :meth:`Timeline.resolve`). A ``DTensor`` is counted by this rank's part
    (:func:`local_part`), without a collective.
    """
    t = norm_values(local_part(t.detach()))  # a nested or sparse tensor: the values it holds
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point() or t.numel() == 0:
        return ZERO
    total = t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum()
    if t.device.type == "cpu":  # reading a CPU tensor waits for nothing
        return ZERO if math.isfinite(float(total)) else exact_counts([t])[0]
    return total.reshape(1)


def exact_counts(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """``(nan, posinf, neginf)`` of each tensor, element by element (one read per device)."""
    rows: list[Any] = []
    for t in tensors:
        t = norm_values(local_part(t.detach()))
        if t.is_complex():
            t = torch.view_as_real(t)
        if not t.is_floating_point() or t.numel() == 0:
            rows.append(ZERO)
        else:
            rows.append(torch.stack((t.isnan().sum(), t.isposinf().sum(), t.isneginf().sum())))
    return resolve_counts(rows)


def _at_least(flag: float) -> tuple[int, int, int]:
    """What a flag (a sum) tells: nothing, or at least one NaN, +inf or -inf."""
    if math.isfinite(flag):
        return ZERO
    return (1, 0, 0) if math.isnan(flag) else (0, 1, 0) if flag > 0 else (0, 0, 1)


def resolve_counts(counts: Sequence[Counts]) -> list[tuple[int, int, int]]:
    """Every count as ints, reading the device ones with one transfer per device (a flag of
    :func:`quick_counts` becomes a lower bound)."""
    out: list[Any] = list(counts)
    by_device: dict[tuple[torch.device, int], list[int]] = {}
    for k, value in enumerate(out):
        if isinstance(value, torch.Tensor):
            by_device.setdefault((value.device, value.numel()), []).append(k)
    for (_, width), indices in by_device.items():
        rows = torch.stack([out[k].reshape(-1).double() for k in indices]).tolist()
        for k, row in zip(indices, rows, strict=True):
            out[k] = _at_least(row[0]) if width == 1 else _triple(row)
    return out


def _triple(row: Sequence[Any]) -> tuple[int, int, int]:
    return int(row[0]), int(row[1]), int(row[2])


def as_dict(counts: Counts) -> dict[str, int]:
    """``{"nan": ..., "posinf": ..., "neginf": ...}``."""
    values = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    return {k: int(v) for k, v in zip(COUNT_KEYS, values, strict=True)}


@dataclass(slots=True)
class Value:
    """One autograd value that modules passed around (a tensor at one version)."""

    ref: Any  # the tensor (kept) or a weak reference to it
    version: Any
    producers: list[int] = field(default_factory=list)  # calls that returned it, inner first
    consumers: list[tuple[int, str]] = field(default_factory=list)  # (call, input path)
    shares_seen: set[int] = field(default_factory=set)  # consumers whose share's hook fired
    excluded: bool = False


@dataclass(slots=True)
class Entry:
    kind: str  # input, output, grad_output, grad_input, grad_param
    call: int  # index into calls; -1 for a parameter
    path: str  # relative to the module: "input.x", "output.0"
    dtype: torch.dtype
    shape: tuple[int, ...]
    counts: Counts
    excluded: bool = False
    value: Value | None = None
    module: str = ""  # a parameter's module
    tensor: torch.Tensor | None = None  # kept (replay): recounted exactly if still unchanged
    version: Any = None
    shard: tuple[int, ...] | None = None  # a DTensor's: the shape of the part counted here


@dataclass(slots=True)
class Call:
    index: int
    name: str
    type: str
    parent: int
    depth: int
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # kept (replay), after resolving: the non-finite gradients of its inputs and outputs
    grads: list[tuple[str, torch.Tensor]] = field(default_factory=list)


@dataclass
class Finding:
    """Where the first non-finite values were (``reproduced=False``: none were seen).

    ``module`` is ``None`` when no module is to blame; ``bad_batch`` marks the batch itself;
    ``submodule`` names the submodule of ``module`` whose input held the values when the code
    between its submodules made them (``path`` is then that input's: ``"output.input.x"`` for a
    submodule named ``output``), or backward whose output's gradient; ``tensors`` holds the
    blamed call's inputs and outputs when the trace kept them; ``from_parameters`` marks a
    finding read from the parameters' gradients alone (under DDP, all-reduced: alike on every
    rank, whichever rank's batch made them); ``shard``: the shape of this rank's part of a
    sharded ``DTensor`` (tensor parallelism), the part ``counts`` are of; ``order``: the
    position in the timeline of the entry found (``None`` for the loss at the end, or the
    parameters' gradients).
    """

    reproduced: bool
    module: str | None = None
    direction: str | None = None
    path: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    producer: bool | None = None
    bad_batch: bool = False
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    submodule: str | None = None
    from_parameters: bool = False
    shard: tuple[int, ...] | None = None
    order: int | None = None

    def plain(self) -> dict[str, Any]:
        """The finding without tensors and summary (to send to other ranks)."""
        return {k: v for k, v in vars(self).items() if k not in ("tensors", "summary")}


@dataclass
class Timeline:
    """The calls and entries of one traced forward and backward (see the module docs)."""

    calls: list[Call] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    forward_end: int = -1  # entries before it are the forward's; the loss comes there
    loss_counts: Counts = ZERO
    batch: list[tuple[str, Counts]] = field(default_factory=list)  # the batch's tensors
    # the batch's tensors' dtypes and shapes, by name
    batch_types: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    # the parameters' gradients: (module, name, dtype, shape, counts)
    params: list[tuple[str, str, torch.dtype, tuple[int, ...], Counts]] = field(
        default_factory=list
    )
    # kept (replay): the gradients of ``params`` by position; after resolving, the non-finite
    param_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    # each called module's own parameters as its first call found them: (module, name, dtype,
    # shape, counts), and each one's weak reference and version then (``held``)
    weights: list[tuple[str, str, torch.dtype, tuple[int, ...], Counts]] = field(
        default_factory=list
    )
    held: list[tuple[weakref.ref[torch.Tensor], Any]] = field(default_factory=list)

    # ------------------------------------------------------------------ counts
    def counts(self) -> list[Counts]:
        """Every count: the entries', the batch's, the parameters' gradients', the modules' own
        parameters', the loss's last."""
        return [
            *(e.counts for e in self.entries),
            *(c for _, c in self.batch),
            *(p[-1] for p in self.params),
            *(w[-1] for w in self.weights),
            self.loss_counts,
        ]

    def pack(self) -> torch.Tensor | None:
        """The flags of :func:`quick_counts` still on a device, as one vector (``None`` when
        every count is an int already)."""
        found = [c.reshape(1).double() for c in self.counts() if isinstance(c, torch.Tensor)]
        return torch.cat(found) if found else None

    def unpack(self, flags: list[float] | None) -> None:
        """Put the values of :meth:`pack` (read on the host) back in place, as lower bounds."""
        values = self.counts()
        if flags is not None:
            it = iter(flags)
            values = [_at_least(next(it)) if isinstance(c, torch.Tensor) else c for c in values]
        self._set(values)

    def resolve(self) -> None:
        """Turn every count into ints (one read per device); a kept tensor whose flag fired,
        and that was not changed in place since, is counted exactly."""
        flagged = [
            e for e in self.entries
            if isinstance(e.counts, torch.Tensor) and e.counts.numel() == 1 and e.tensor is not None
        ]  # fmt: skip
        self._set(resolve_counts(self.counts()))
        recount = [e for e in flagged if any(e.counts) and not modified(e.tensor, e.version)]
        for entry, row in zip(recount, exact_counts([e.tensor for e in recount]), strict=True):  # type: ignore[misc]
            entry.counts = row if any(row) else entry.counts
        for entry in self.entries:
            grad, entry.tensor = entry.tensor, None
            if grad is not None and entry.kind.startswith("grad") and any(entry.counts):
                self.calls[entry.call].grads.append((f"grad.{entry.path}", grad))
        self.param_grads = {k: t for k, t in self.param_grads.items() if any(self.params[k][-1])}

    def _set(self, values: Sequence[Counts]) -> None:
        for entry, counts in zip(self.entries, values, strict=False):
            entry.counts = counts
        n = len(self.entries)
        self.batch = [(name, values[n + k]) for k, (name, _) in enumerate(self.batch)]
        n += len(self.batch)
        self.params = [(*p[:-1], values[n + k]) for k, p in enumerate(self.params)]
        n += len(self.params)
        self.weights = [(*w[:-1], values[n + k]) for k, w in enumerate(self.weights)]
        self.loss_counts = values[-1]

    @property
    def bad_batch(self) -> list[str]:
        """The names of the batch's tensors that hold non-finite values (after resolving)."""
        return [name for name, counts in self.batch if any(counts)]

    # ------------------------------------------------------------------ verdict
    def verdict(self) -> Finding:
        """Where the first non-finite values were (resolves the counts first)."""
        self.resolve()
        end = self.forward_end if self.forward_end >= 0 else len(self.entries)
        for k, entry in enumerate(self.entries):
            if k == end and any(self.loss_counts):
                found = self._loss()
            elif entry.excluded or not any(entry.counts):
                continue
            elif entry.kind == "output":
                found = self._own_weight(entry.call) or self._finding(
                    entry.call, "forward", entry, producer=True
                )
            elif entry.kind == "input":
                found = self._upstream(self.calls[entry.call], entry)
            else:
                found = self._backward(entry)
            found.order = k
            return found
        if end >= len(self.entries) and any(self.loss_counts):
            return self._loss()
        return self._parameters()

    def _own_weight(self, call: int) -> Finding | None:
        """The first own parameter of ``call``'s module that was non-finite when the module was
        called (the module only passed it on), as the evidence while it is unchanged since."""
        name = self.calls[call].name
        for k, (module, local, dtype, shape, counts) in enumerate(self.weights):
            if module != name or not any(counts):
                continue
            found = Finding(True, module, "parameter", local, as_dict(counts), str(dtype), shape)
            ref, version = self.held[k]
            param = ref()
            if param is not None and not modified(param, version):  # not updated since
                found.tensors = [(local, param.detach())]
            return found
        return None

    def _parameters(self) -> Finding:
        """A gradient non-finite only in parameters (made where a weight's gradient is
        computed, passed on nowhere): the module whose backward ran first, i.e. that the
        forward called last."""
        last = {c.name: c.index for c in self.calls}
        bad = [k for k, p in enumerate(self.params) if any(p[-1])]
        if not bad:
            return Finding(False)
        k = max(bad, key=lambda k: last.get(self.params[k][0], -1))
        owner, local, dtype, shape, counts = self.params[k]
        call = last.get(owner, -1)
        producer = self._outputs_finite(call) if call >= 0 else None
        entry = Entry("grad_param", call, local, dtype, shape, counts)
        found = self._finding(call, "backward", entry, producer)
        found.module = owner or None
        found.from_parameters = True
        if k in self.param_grads:  # the non-finite gradient itself, with the call's tensors
            found.tensors.append((f"grad.{local}", self.param_grads[k]))
        return found

    def _loss(self) -> Finding:
        if self.bad_batch:  # the loss took values of the batch that no module saw (a target)
            name = self.bad_batch[0]
            dtype, shape = self.batch_types.get(name, (None, None))
            counts = as_dict(dict(self.batch)[name])
            return Finding(True, None, "forward", name, counts, dtype, shape, False, True)
        return Finding(True, None, "loss", "loss", as_dict(self.loss_counts))

    def _finding(
        self, call: int, direction: str, entry: Entry, producer: bool | None, path: str = ""
    ) -> Finding:
        found = self.calls[call] if call >= 0 else None
        return Finding(
            True,
            found.name if found is not None else None,
            direction,
            path or entry.path,
            as_dict(entry.counts),
            str(entry.dtype),
            tuple(entry.shape),
            producer,
            # a backward fault's evidence: the call's tensors and its non-finite gradients
            tensors=[*found.tensors, *(found.grads if direction == "backward" else [])]
            if found is not None
            else [],
            shard=entry.shard,
        )

    def _upstream(self, call: Call, entry: Entry) -> Finding:
        """An input already non-finite when ``call`` started: made by the enclosing code."""
        if call.parent >= 0:
            parent = self.calls[call.parent]
            local = call.name.removeprefix(parent.name + ".")
            found = self._finding(parent.index, "forward", entry, True, f"{local}.{entry.path}")
            found.submodule = local
            return found
        found = self._finding(-1, "forward", entry, None, f"{call.name}.{entry.path}")
        if self.bad_batch:  # it came with the batch: no module made it
            found.bad_batch, found.producer, found.path = True, False, self.bad_batch[0]
        return found

    def _backward(self, entry: Entry) -> Finding:
        if entry.kind == "grad_input":
            return self._finding(entry.call, "backward", entry, self._outputs_finite(entry.call))
        value = entry.value  # the gradient of an output: whose share was it?
        assert value is not None
        unseen = [(c, p) for c, p in value.consumers if c not in value.shares_seen]
        if unseen:
            call, path = max(unseen, key=lambda cp: (self.calls[cp[0]].depth, cp[0]))
            share = Entry("grad_input", call, path, entry.dtype, entry.shape, entry.counts)
            share.shard = entry.shard
            return self._finding(call, "backward", share, self._outputs_finite(call))
        outer = min(value.producers, key=lambda c: self.calls[c].depth)
        parent = self.calls[outer].parent
        path = f"{self.calls[outer].name}.{entry.path}"
        if parent < 0:
            return self._finding(-1, "backward", entry, None, path)
        local = path.removeprefix(self.calls[parent].name + ".")
        found = self._finding(parent, "backward", entry, True, local)
        found.submodule = self.calls[outer].name.removeprefix(self.calls[parent].name + ".")
        return found

    def _outputs_finite(self, call: int) -> bool:
        """Whether every gradient that reached ``call``'s outputs was finite."""
        return not any(
            e.kind == "grad_output"
            and any(e.counts)
            and e.value is not None
            and call in e.value.producers
            for e in self.entries
        )

    def summary(self) -> list[dict[str, Any]]:
        """One row per recorded tensor, in order: the evidence's per-module summary."""
        end = self.forward_end if self.forward_end >= 0 else len(self.entries)
        rows = []
        for k, e in enumerate(self.entries):
            rows.append(
                {
                    "order": k,
                    "phase": "forward" if e.kind in ("input", "output") else "backward",
                    "module": self.calls[e.call].name if e.call >= 0 else e.module,
                    "call": e.call,
                    "kind": e.kind,
                    "path": e.path,
                    "dtype": str(e.dtype),
                    "shape": list(e.shape),
                    "excluded": e.excluded,
                    **as_dict(e.counts),
                }
            )
            if k + 1 == end:
                rows.append(
                    {"order": k, "phase": "loss", "kind": "loss", **as_dict(self.loss_counts)}
                )
        return rows
