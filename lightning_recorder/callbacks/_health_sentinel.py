"""The always-on check: the loss and every parameter gradient, NaN/Inf, in a few fused launches.

**One read, no host synchronisation.** The gradients are grouped by (device, dtype) and each
group's L2 norms are computed by one fused multi-tensor call (torch's ``_foreach_norm``, read
through :func:`lightning_recorder._core.compat.foreach_norm`: one
kernel per group on a GPU, no per-tensor launch and no ``.item()``); the step's loss values and
the norms go into one float32 vector. A NaN anywhere makes its norm NaN, an infinity makes it
infinite, so the vector is finite exactly when every value is — or, in one case, not: a norm
that overflows float32 (gradients around 1e19) is not finite either. :func:`step_counts` counts
NaN/+inf/-inf element by element on the steps the vector flags, so that such a step is not
called non-finite where it is decided before the optimizer step. Half-precision gradients are
normed in float32 (their own range would overflow at 65504).

**Reading it.** :meth:`Reading.bad` reads the vector at once (one synchronisation on a GPU,
nothing on the CPU). :meth:`Reading.later` starts a non-blocking copy into pinned host memory
and records a CUDA event, so that the next step can look at the result without waiting for it
(:meth:`Reading.ready`); on the CPU the copy is the vector itself.

**Counting.** A flagged step's values are counted element by element, whenever the flag is
read: :meth:`Reading.counts` runs :func:`step_counts` over the losses and the gradients that
were checked. A reading that waits to be read lazily holds its gradients by weak reference
with their version counters, so that it keeps no gradient alive and sees one changed in place
since: on the CPU it is read before the optimizer step, with every gradient as it was; on a GPU
a gradient freed (the next ``zero_grad``) or changed (gradient clipping) before the copy
arrived counts as one NaN or +inf, as its norm says — a lower bound, and :meth:`Reading.counts`
names those parameters.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.compat import foreach_norm
from .._core.structures import Versions, modified, snapshot
from ._health_event import COUNT_KEYS
from ._health_verdict import exact_counts, local_part

__all__ = ["Reading", "Sentinel", "nonfinite_parameters", "step_counts", "to_host_later"]

_HALF = (torch.float16, torch.bfloat16)


def grouped_norms(
    tensors: Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """The L2 norm of every tensor as one float32 vector on ``device``, and the order: entry
    ``j`` is the norm of ``tensors[order[j]]`` (grouped by device and dtype; of a ``DTensor``,
    this rank's shard's, without a collective)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(k)
    parts: list[torch.Tensor] = []
    order: list[int] = []
    for (_, dtype), indices in groups.items():
        dense = [local_part(tensors[k]) for k in indices]  # a DTensor: this rank's shard
        if any(t.is_sparse for t in dense):
            dense = [t.coalesce().values() if t.is_sparse else t for t in dense]
        norms = foreach_norm(dense, torch.float32 if dtype in _HALF else None)
        parts.append(torch.stack(norms).float().to(device, non_blocking=True))
        order.extend(indices)
    if not parts:
        return torch.zeros(0, device=device), order
    return torch.cat(parts), order


Counted = tuple[dict[str, int], dict[str, int], list[tuple[str, dict[str, int]]]]
"""Element counts of a step: all of them, the losses', and each non-finite gradient's
``(parameter, counts)``."""


@dataclass
class Reading:
    """One step's check: ``values`` holds the loss values then the gradient norms; ``grads``
    the gradients checked, by parameter (weak references with their versions once
    :meth:`later` made the reading lazy)."""

    values: torch.Tensor
    losses: list[torch.Tensor]
    names: list[str]  # the parameter of each norm
    grads: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    host: torch.Tensor | None = None
    event: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    kept: list[tuple[str, weakref.ref[torch.Tensor], Versions]] = field(default_factory=list)
    about: list[Any] = field(default_factory=list)  # what each loss was computed on

    def flag(self) -> torch.Tensor:
        """A 0-dim bool tensor on the device: whether anything is not finite."""
        return torch.isfinite(self.values).logical_not().any()

    def bad(self) -> bool:
        """Whether anything is not finite (reads the device: one synchronisation)."""
        return bool(self.flag())

    def later(self) -> Reading:
        """Start reading without waiting: a non-blocking copy to pinned host memory, and an
        event that says when it (and every copy started before it) has arrived. The gradients
        are held from now on by weak reference, with their version counters."""
        self.host = to_host_later(self.values)
        self.kept = [(name, weakref.ref(grad), snapshot(grad)) for name, grad in self.grads]
        self.grads = []
        if self.values.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()
        return self

    def ready(self) -> bool:
        """Whether :meth:`later`'s copy has arrived (never waits)."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Wait for :meth:`later`'s copy (at the end of training)."""
        if self.event is not None:
            self.event.synchronize()

    def host_bad(self) -> bool:
        """Whether the copied values hold a non-finite one (after :meth:`ready`)."""
        assert self.host is not None
        return not bool(torch.isfinite(self.host).all())

    def about_first_bad_loss(self) -> Any:
        """What the first loss whose values are not all finite was computed on (:attr:`about`),
        or ``None`` (reads the host copy once :meth:`later` made one)."""
        values = self.host if self.host is not None else self.values
        bad = torch.isfinite(values[: len(self.losses)]).logical_not().nonzero().flatten()
        return self.about[int(bad[0])] if bad.numel() and self.about else None

    def counts(self) -> tuple[Counted, list[str]]:
        """The element counts of the step (:func:`step_counts` over the losses and the checked
        gradients), and the parameters whose gradient a lazy read found freed or changed in
        place since the check: each of those counts as one NaN or one +inf, as its norm says
        (a lower bound)."""
        if not self.kept:
            return step_counts(self.losses, self.grads), []
        live: list[tuple[str, torch.Tensor]] = []
        gone: list[str] = []
        for name, ref, versions in self.kept:
            grad = ref()
            if grad is None or modified(grad, versions):
                gone.append(name)
            else:
                live.append((name, grad))
        total, loss, grads = step_counts(self.losses, live)
        if not gone:
            return (total, loss, grads), []
        values = (self.host if self.host is not None else self.values).tolist()
        norms = dict(zip(self.names, values[len(self.losses) :], strict=True))
        rows = dict(grads)
        missed = []
        for name in gone:
            norm = norms[name]
            if math.isfinite(norm):
                continue
            key = "nan" if math.isnan(norm) else "posinf"  # a norm cannot tell +inf from -inf
            total[key] += 1
            rows[name] = {**dict.fromkeys(COUNT_KEYS, 0), key: 1}
            missed.append(name)
        ordered = [(name, rows[name]) for name, _, _ in self.kept if name in rows]
        return (total, loss, ordered), missed

    def gradient(self, name: str) -> torch.Tensor | None:
        """The checked gradient of parameter ``name`` (``None``: freed since, or unknown)."""
        for key, grad in self.grads:
            if key == name:
                return grad
        for key, ref, _ in self.kept:
            if key == name:
                return ref()
        return None


def to_host_later(t: torch.Tensor) -> torch.Tensor:
    """A copy of a CUDA tensor in pinned host memory, started without waiting (read it after a
    CUDA event recorded later has completed); a CPU tensor itself."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class Sentinel:
    """The losses of the current optimizer step and the check before it."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.about: list[Any] = []  # what each loss was computed on (its micro-batch)

    def add_loss(self, loss: torch.Tensor, about: Any = None) -> None:
        """Note a loss about to be back-propagated (one per micro-batch or manual backward),
        and what it was computed on."""
        self.losses.append(loss.detach())
        self.about.append(about)

    def reset(self) -> None:
        self.losses, self.about = [], []

    def read(self, named: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> Reading:
        """Check the noted losses and the gradients of ``named`` parameters (those with one)."""
        with_grad = [(n, p.grad) for n, p in named if p.grad is not None]
        grads = [g for _, g in with_grad]
        if grads:
            device = grads[0].device
        norms, order = grouped_norms(grads, device)
        losses = [
            loss.float().sum().reshape(1).to(device, non_blocking=True) for loss in self.losses
        ]
        values = torch.cat([*losses, norms])
        names = [with_grad[k][0] for k in order]
        return Reading(values, list(self.losses), names, with_grad, about=list(self.about))


def step_counts(
    losses: Sequence[torch.Tensor], grads: Sequence[tuple[str, torch.Tensor]]
) -> Counted:
    """Element counts of a flagged step (one read per device): all of them, the losses', and
    each non-finite gradient's ``(parameter, counts)``; ``grads`` are ``(parameter, gradient)``.
    """
    tensors = [*losses, *(grad for _, grad in grads)]
    names = [name for name, _ in grads]
    rows = exact_counts(tensors)
    keys = COUNT_KEYS
    total = {k: sum(r[i] for r in rows) for i, k in enumerate(keys)}
    loss = {k: sum(r[i] for r in rows[: len(losses)]) for i, k in enumerate(keys)}
    found = [
        (name, dict(zip(keys, row, strict=True)))
        for name, row in zip(names, rows[len(losses) :], strict=True)
        if any(row)
    ]
    return total, loss, found


def nonfinite_parameters(
    named: Sequence[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor, dict[str, int]]]:
    """The parameters that hold non-finite values themselves, with their counts (one fused norm
    per group, then element counts of the few that are flagged)."""
    tensors = [p.detach() for _, p in named]
    if not tensors:
        return []
    norms, order = grouped_norms(tensors, tensors[0].device)
    flagged = sorted(
        order[j] for j in torch.isfinite(norms).logical_not().nonzero().flatten().tolist()
    )
    keys = COUNT_KEYS
    found = []
    rows = exact_counts([tensors[k] for k in flagged])
    for k, row in zip(flagged, rows, strict=True):
        if any(row):
            found.append((named[k][0], named[k][1], dict(zip(keys, row, strict=True))))
    return found
