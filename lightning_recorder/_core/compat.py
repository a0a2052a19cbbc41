"""Every read of PyTorch's private state, in one file: a change in torch touches only this one.

* :func:`current_autograd_node` — set while the autograd engine runs a backward node, which is
  how a forward re-run by activation checkpointing is told apart from a real call.
* :func:`is_compiled` — whether ``torch.compile`` compiles a module or a part of it.
* :func:`distributed_active` — the one "is a process group running" test.
* :func:`foreach_norm`, :func:`foreach_sub`, :func:`foreach_sub_`, :func:`foreach_copy_` —
  torch's private multi-tensor kernels, one call for many tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:  # Set while the autograd engine runs a backward node (e.g. checkpoint recomputation).
    current_autograd_node = torch._C._current_autograd_node
except AttributeError:  # pragma: no cover - very old torch

    def current_autograd_node() -> Any:
        return None


def _optimized_module() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without dynamo
        return None
    return OptimizedModule


def is_compiled(module: nn.Module) -> bool:
    """Whether ``torch.compile`` compiles ``module`` or a part of it.

    True for a LightningModule passed to ``fit`` as ``torch.compile(model)`` (Lightning unwraps
    it and marks it with ``_compiler_ctx``), one holding an ``OptimizedModule``, or one with a
    submodule compiled in place by ``nn.Module.compile()``.
    """
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    optimized = _optimized_module()
    return any(
        (optimized is not None and isinstance(m, optimized))
        or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


def distributed_active(group: Any = None) -> bool:
    """Whether a ``torch.distributed`` process group is running with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor, in one call (torch's private ``_foreach_norm``)."""
    return list(torch._foreach_norm(tensors))


def foreach_sub(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    """``a[i] - b[i]`` for every ``i``, in one call (torch's private ``_foreach_sub``)."""
    return list(torch._foreach_sub(a, b))


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every ``i``, in one call (torch's ``_foreach_copy_``)."""
    if dst:
        torch._foreach_copy_(dst, src)


def foreach_sub_(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """``a[i] -= b[i]`` for every ``i``, in place, in one call (torch's ``_foreach_sub_``)."""
    if a:
        torch._foreach_sub_(a, b)
