"""A teacher sharded with FSDP2 (``fully_shard``), for a teacher too large for one device.

``FeatureDistillation(shard_teacher=True)`` shards the teacher over the data-parallel dimension
of the strategy's device mesh (Lightning's ``ModelParallelStrategy``) when fitting starts:
``fully_shard`` on every submodule that holds parameters of its own, deepest first, then on the
teacher itself, so a forward gathers the parameters layer by layer. A callable
``shard_teacher(teacher, mesh)`` applies a policy of the user's own. A teacher the user has
already sharded is used as it is. Either way the outermost FSDP units free their gathered
parameters after each forward of the teacher (FSDP2 would keep a root's gathered for a backward
that a teacher never runs).

Every rank runs the teacher at the same points of every step (it runs on the inputs of the
student's forward, which every rank calls), so the gathers of a sharded teacher line up across
ranks as the student's do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torch import nn

from ..._core.compat import dtensor_type
from ...errors import RecorderConfigError

ShardTeacher = bool | Callable[[nn.Module, Any], Any]
"""``shard_teacher``: ``False``, ``True`` (the default policy) or ``(teacher, mesh) -> None``."""


def check_shard_teacher(value: object) -> None:
    """Raise a :class:`RecorderConfigError` unless ``value`` is a bool or a callable."""
    if not isinstance(value, bool) and not callable(value):
        raise RecorderConfigError(
            "Expected `shard_teacher` to be a bool or a callable (teacher, mesh) -> None that "
            f"applies fully_shard, but got {type(value).__name__} {value!r}."
        )


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: no public FSDP2
        return None
    return FSDPModule


def is_sharded(teacher: nn.Module) -> bool:
    """Whether ``teacher`` holds FSDP2 modules or ``DTensor`` parameters."""
    fsdp = _fsdp_module_type()
    if fsdp is not None and any(isinstance(m, fsdp) for m in teacher.modules()):
        return True
    dtensor = dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in teacher.parameters())


def _data_parallel_mesh(trainer: pl.Trainer) -> Any:
    strategy = trainer.strategy
    name = type(strategy).__name__
    try:
        mesh = strategy.device_mesh  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        mesh = None
    if mesh is None:
        raise RecorderConfigError(
            "Expected a strategy with a device mesh (Lightning's ModelParallelStrategy) with "
            f"`shard_teacher`, but the trainer runs {name}: the teacher is sharded over the "
            "mesh's data-parallel dimension. Use ModelParallelStrategy(...), or leave "
            "`shard_teacher=False`."
        )
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["data_parallel"] if "data_parallel" in names else mesh


def default_policy(teacher: nn.Module, mesh: Any) -> None:
    """``fully_shard`` every submodule holding parameters of its own (deepest first), then the
    teacher; modules already sharded are left as they are."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    modules = [m for m in teacher.modules() if m is not teacher]
    for module in reversed(modules):  # pre-order reversed: children before their parents
        own = next(module.parameters(recurse=False), None)
        if own is not None and not isinstance(module, FSDPModule):
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
    if not isinstance(teacher, FSDPModule):
        fully_shard(teacher, mesh=mesh, reshard_after_forward=True)


def reshard_after_forward(teacher: nn.Module) -> None:
    """Make the outermost FSDP units of a sharded teacher free their gathered parameters after
    each forward. FSDP2 keeps a root's parameters gathered after the forward, for the backward
    that follows in training; a teacher never runs one, so they would stay gathered for good."""
    fsdp = _fsdp_module_type()
    if fsdp is None:
        return
    inner: set[int] = set()
    for module in teacher.modules():
        if isinstance(module, fsdp) and id(module) not in inner:
            unit: Any = module  # an FSDPModule (the isinstance above does not narrow a type)
            unit.set_reshard_after_forward(True, recurse=False)
            inner.update(id(m) for m in module.modules() if m is not module)


def shard(teacher: nn.Module, option: ShardTeacher, trainer: pl.Trainer) -> None:
    """Shard ``teacher`` as ``option`` says (nothing for ``False``, nor for a teacher already
    sharded, by the user or by an earlier fit), then check that it can run."""
    if option is not False and not is_sharded(teacher):
        mesh = _data_parallel_mesh(trainer)
        if _fsdp_module_type() is None:
            raise RecorderConfigError(
                "Expected torch >= 2.6 (torch.distributed.fsdp.fully_shard) with "
                "`shard_teacher`, but this torch has no public FSDP2."
            )
        if option is True:
            default_policy(teacher, mesh)
        else:
            option(teacher, mesh)
    if is_sharded(teacher) and not (dist.is_available() and dist.is_initialized()):
        raise RecorderConfigError(
            "Expected a distributed run (Lightning's ModelParallelStrategy) for a teacher "
            "sharded with fully_shard (its parameters are DTensors), but no process group is "
            f"running (the trainer runs {type(trainer.strategy).__name__}): pass an unsharded "
            "teacher, or shard it with `shard_teacher=True` under ModelParallelStrategy."
        )
    if is_sharded(teacher):
        reshard_after_forward(teacher)
