"""The pieces of a flagged step that are not Lightning wiring: ranks agreeing, the event, the
evidence.

* :func:`all_reduce_max` / :func:`gather` — every rank calls them at the same point of the
  same step (the monitor only does on steps that every rank agreed were flagged), so they never
  hang; without a process group they return their input.
* :func:`choose` — under DDP every rank replays its own batch; the event is about the rank
  whose finding says most (a module or a bad batch, then any finding of its own, then one read
  from the parameters' gradients, which DDP's all-reduce makes alike on every rank, then none;
  among equals one whose own loss was non-finite; under tensor parallelism, the one found
  earliest in the step), the lowest such rank; :func:`seen_on` names
  the ranks whose own batch showed the values.
* :func:`make_event` — a :class:`HealthEvent` from a finding (or from the check alone).
* :func:`write_evidence` — the bundle of this rank (see :mod:`._health_evidence`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._core.compat import distributed_active
from ._health_event import COUNT_KEYS, HealthEvent, describe
from ._health_evidence import Evidence, batch_tensors, describe_batch
from ._health_replay import MicroBatch
from ._health_verdict import Finding

__all__ = [
    "Check",
    "all_reduce_max",
    "choose",
    "gather",
    "make_event",
    "seen_on",
    "write_evidence",
]


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of ``values`` over all ranks (``values`` itself alone)."""
    if distributed_active():
        values = values.float().clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` alone)."""
    if not distributed_active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _priority(found: dict[str, Any]) -> int:
    if not found.get("reproduced"):
        return 3
    if found.get("from_parameters"):  # all-reduced gradients: they say nothing of this rank
        return 2
    return 0 if found.get("module") or found.get("bad_batch") else 1


def _own(found: dict[str, Any]) -> bool:
    """Whether a rank's finding (with its check's loss counts, ``"check_loss"``) is of its own
    batch: a finding of its own, or its own loss non-finite (not the all-reduced gradients)."""
    return _priority(found) < 2 or any(found.get("check_loss", {}).values())


def choose(findings: Sequence[dict[str, Any]]) -> int:
    """The rank whose finding the event is about (among equals, one whose own loss was
    non-finite). Under tensor parallelism (a finding about a ``DTensor`` shard), where the ranks
    run one forward and a collective passes one rank's values on to the others, among equals
    the one found earliest in the step: the rank whose shard held them first."""
    sharded = any(found.get("shard") for found in findings)

    def order(found: dict[str, Any]) -> int:
        at = found.get("order")
        return 0 if not sharded else at if at is not None else 1 << 62

    return min(
        range(len(findings)),
        key=lambda r: (_priority(findings[r]), not _own(findings[r]), order(findings[r]), r),
    )


def seen_on(findings: Sequence[dict[str, Any]]) -> list[int]:
    """The ranks whose own batch showed the non-finite values."""
    return [r for r, found in enumerate(findings) if _own(found)]


@dataclass
class Check:
    """What the always-on check found on a step: element counts of the losses and gradients,
    the losses' counts, and the parameters whose gradient is not finite."""

    counts: dict[str, int]
    loss: dict[str, int]
    parameters: list[str] = field(default_factory=list)

    @property
    def loss_bad(self) -> bool:
        return any(self.loss.values())


def make_event(
    step: int,
    micro: MicroBatch | None,
    rank: int,
    check: Check,
    found: dict[str, Any] | None,
    replayed: bool,
    kind: str = "nonfinite",
) -> HealthEvent:
    """The event of a flagged step; ``found`` is a chosen :meth:`Finding.plain` (or ``None``
    when nothing was localised). The message is set by :func:`finish_event`."""
    event = HealthEvent(
        kind,
        step=step,
        batch_idx=micro.batch_idx if micro is not None else None,
        rank=rank,
        counts=dict(check.counts),
        parameters=tuple(check.parameters[:16]),
        direction="loss" if check.loss_bad else None,
    )
    if kind != "nonfinite":
        return event
    if found is not None and found.get("reproduced"):
        event.module = found.get("module")
        event.direction = found.get("direction")
        event.path = found.get("path")
        event.counts = {k: int(found.get("counts", {}).get(k, 0)) for k in COUNT_KEYS}
        event.dtype = found.get("dtype")
        shape = found.get("shape")
        event.shape = tuple(shape) if shape is not None else None
        event.producer = found.get("producer")
        event.batch_idx = found.get("batch_idx", event.batch_idx)
        if found.get("submodule"):
            event.details["submodule"] = found["submodule"]
        if found.get("shard"):  # a DTensor's counts: the event's rank's part of it
            event.details["shard"] = list(found["shard"])
    if replayed:
        event.reproduced = bool(found and found.get("reproduced"))
    if found is not None and found.get("error"):
        event.details["replay_error"] = found["error"]
    return event


def finish_event(event: HealthEvent, action: str | None, evidence: str | None) -> HealthEvent:
    """Set what was done and where the evidence is, and write the message."""
    event.action, event.evidence = action, evidence
    event.message = describe(event)
    return event


def write_evidence(
    evidence: Evidence,
    path: Any,
    event: HealthEvent,
    micro: MicroBatch | None,
    finding: Finding | None,
    check: Check,
    extra: dict[str, Any],
) -> str | None:
    """Write this rank's bundle for ``event``; its directory, or ``None``."""
    if path is None:
        return None
    tensors: dict[str, tuple[str, torch.Tensor]] = {}
    if finding is not None and finding.module is not None:
        for name, t in finding.tensors:
            tensors[f"{finding.module}.{name}"] = ("module", t)
    if micro is not None:
        tensors.update(batch_tensors(micro.batch))
        if micro.cpu_rng.numel():
            tensors["rng.cpu"] = ("rng", micro.cpu_rng)
        for device, state in micro.cuda_rng.items():
            tensors[f"rng.cuda.{device}"] = ("rng", state)
    meta = {
        "event": event.to_dict(),
        "step": event.step,
        "batch_idx": micro.batch_idx if micro is not None else None,
        "rank": extra.get("rank", event.rank),
        "finding_on_this_rank": finding.plain() if finding is not None else None,
        "check": {"counts": check.counts, "loss": check.loss, "parameters": check.parameters},
        "batch": describe_batch(micro.batch) if micro is not None else None,
        "summary": finding.summary if finding is not None else [],
        **extra,
    }
    written = evidence.write(path, tensors, meta)
    return str(written) if written is not None else None
