"""Sharded tensors (``DTensor``: FSDP2, tensor parallelism) seen as the full tensors they stand for.

Under ``fully_shard`` a parameter (and its gradient) is a ``DTensor`` whose rank-local part is a
shard; its norm computed by torch is a *partial* ``DTensor`` that becomes the full tensor's norm
only after a reduction across the shards — a collective that every rank of the mesh must run, in
the same order. :func:`any_sharded` tells whether a set of tensors needs that (then every rank
computes, not rank 0 alone), and :func:`full_values` performs it.

Module outputs that are ``DTensor`` s (tensor parallelism with ``use_local_output=False``) are
described by :func:`shard_for_stats`: the rank-local part, when the placements shard it across the
ranks (the statistics merged over ranks then describe the full tensor), or the whole tensor on one
rank of each replica group when it is replicated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor

from .._core.compat import dtensor_type

__all__ = ["any_sharded", "full_values", "is_sharded", "shard_for_stats"]


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a ``DTensor``."""
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def any_sharded(tensors: Iterable[object]) -> bool:
    """Whether any of ``tensors`` is a ``DTensor`` (its reductions are collectives)."""
    cls = dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def full_values(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Plain tensors holding the full values of ``tensors``: a ``DTensor`` (a partial norm, a
    shard) is reduced across its mesh with ``full_tensor()`` — a collective: every rank of the
    mesh calls this with the same list, in the same order. Plain tensors pass through."""
    return [t.full_tensor() if is_sharded(t) else t for t in tensors]  # type: ignore[attr-defined]


def shard_for_stats(t: Tensor) -> Tensor | None:
    """The part of a recorded ``DTensor`` this rank contributes to statistics merged over ranks.

    Sharded placements: the local shard (the shards of all ranks make up the full tensor).
    Replicated (or partial) placements on a mesh dimension: the local tensor on the first rank
    along that dimension only (``None`` elsewhere), so that no element is counted twice; partial
    values are made whole first. Plain tensors pass through.
    """
    if not is_sharded(t):
        return t
    placements = t.placements  # type: ignore[attr-defined]
    mesh = t.device_mesh  # type: ignore[attr-defined]
    if any(p.is_partial() for p in placements):
        t = t.redistribute(  # type: ignore[attr-defined]
            mesh, [p if p.is_shard() else _replicate() for p in placements]
        )
        placements = t.placements  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank holds no part of the tensor
        return None
    for dim, placement in enumerate(placements):
        if placement.is_replicate() and coordinate[dim] != 0:
            return None
    local: Tensor = t.to_local()  # type: ignore[attr-defined]
    return local


def _replicate() -> object:
    from torch.distributed.tensor import Replicate

    return Replicate()
