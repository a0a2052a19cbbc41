"""Every read of PyTorch's private state, in one file: a change in torch touches only this one.

Torch 2.13 offers no public way to these facts; its own public utilities read the same kind of
state (``torch.utils.module_tracker`` asks ``torch._C._current_graph_task_id`` whether a backward
runs).

* :func:`current_autograd_node` — set while the autograd engine runs a backward node, which is
  how a forward re-run by activation checkpointing is told apart from a real call.
* :func:`reentrant_rerun` — whether that node is a reentrant checkpoint's backward
  (``torch.utils.checkpoint.CheckpointFunction``), whose re-run alone carries gradients.
* :func:`is_compiled` — whether ``torch.compile`` compiles a module or a part of it;
  :func:`uncompiled` — the module a ``torch.compile`` wrapper holds.
* :func:`torch_op_signatures` — argument names of torch C functions, from their ATen schemas
  (the public ``torch.overrides.get_testing_overrides()`` has one signature per function, some
  of them short: ``torch.add`` without ``alpha``, ``torch.sum`` without ``keepdim``).
* :func:`foreach_norm`, :func:`foreach_sub`, :func:`foreach_sub_`, :func:`foreach_copy_` —
  torch's multi-tensor kernels (``torch._foreach_*``), one call for many tensors.
* :func:`in_functorch`, :func:`functorch_values`, :func:`functorch_off` — whether a
  ``torch.func`` transform (``vmap``, ``grad``) runs, the tensor its wrapper holds (the whole
  batch of a ``vmap``), and a context in which its interpreters do not see torch operations.
* :func:`pending_grad_scale` — the scale an AMP grad scaler left on the gradients of an
  optimizer that unscales them in its own step (``fused=True``), as a tensor (``get_scale()``
  would synchronise with the device).

Three helpers read nothing private and live here to be found with them:
:func:`distributed_active` (the one "is a process group running" test), :func:`dtensor_type`
and :func:`autocast_enabled` (the one "does autocast cast on this device" test).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:  # Set while the autograd engine runs a backward node (e.g. checkpoint recomputation).
    current_autograd_node = torch._C._current_autograd_node
except AttributeError:  # pragma: no cover - very old torch

    def current_autograd_node() -> Any:
        return None


# The name (torch.autograd.graph.Node.name) of the backward node of a reentrant checkpoint,
# torch.utils.checkpoint.CheckpointFunction.
_REENTRANT_BACKWARD = "CheckpointFunctionBackward"


def reentrant_rerun() -> bool:
    """Whether the autograd engine is re-running a forward for a reentrant checkpoint
    (``checkpoint(..., use_reentrant=True)``): its first run has no autograd graph, so the
    gradients of the tensors made inside reach only the tensors of this re-run."""
    node = current_autograd_node()
    return node is not None and node.name() == _REENTRANT_BACKWARD


def _optimized_module() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without dynamo
        return None
    return OptimizedModule


def is_compiled(module: nn.Module) -> bool:
    """Whether ``torch.compile`` compiles ``module`` or a part of it: ``module`` is or holds an
    ``OptimizedModule``, or has a submodule compiled in place by ``nn.Module.compile()``.

    (A LightningModule that Lightning unwrapped from ``torch.compile(model)`` is told by
    ``callbacks._lightning.is_compiled``, from the wrappers Lightning leaves on its methods,
    and then by this.)
    """
    optimized = _optimized_module()
    return any(
        (optimized is not None and isinstance(m, optimized))
        or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


def uncompiled(module: nn.Module) -> nn.Module:
    """The module an ``OptimizedModule`` (``torch.compile(module)``) wraps, or ``module`` itself
    (torch keeps it in the wrapper's ``_orig_mod``)."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


def distributed_active(group: Any = None) -> bool:
    """Whether a ``torch.distributed`` process group is running with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def autocast_enabled(device: torch.device) -> bool:
    """Whether autocast is on for ``device``'s type: any device type autocast supports (CPU,
    CUDA, MPS, XPU, ...), ``False`` for one it does not (``meta``), where torch would raise."""
    kind = device.type
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


def foreach_norm(
    tensors: list[torch.Tensor], dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """The L2 norm of each tensor, in one call (torch's private ``_foreach_norm``), computed and
    returned in ``dtype`` when it is given (float32 norms of float16 gradients, say)."""
    if dtype is None:
        return list(torch._foreach_norm(tensors))
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=dtype))
    except TypeError:  # a torch whose _foreach_norm takes no dtype: convert first
        return list(torch._foreach_norm([t.to(dtype) for t in tensors]))


def foreach_sub(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    """``a[i] - b[i]`` for every ``i``, in one call (torch's private ``_foreach_sub``)."""
    return list(torch._foreach_sub(a, b))


def dtensor_type() -> type | None:
    """``DTensor`` (``torch.distributed.tensor``, ``torch.distributed._tensor`` before 2.4)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def torch_op_signatures(fn: Any) -> tuple[inspect.Signature, ...]:
    """Python signatures of a torch C function or ``Tensor`` method, from its ATen schemas.

    ``inspect.signature`` fails on ``torch.relu`` or ``torch.nn.functional.linear``; their
    arguments are named by the operator's schemas (torch's private
    ``_jit_get_schemas_for_operator``). One signature per overload, ``out=`` overloads last; the
    schema's ``self`` is named ``input`` for functions, as torch's Python binding accepts it.
    Empty when ``fn`` is not torch's or has no schema.
    """
    objclass = getattr(fn, "__objclass__", None)
    is_method = objclass is not None and objclass.__name__ == "TensorBase"
    module = getattr(fn, "__module__", None) or ""
    if not (is_method or module == "torch" or module.startswith("torch.")):
        return ()
    name = getattr(fn, "__name__", None)
    get_schemas = getattr(torch._C, "_jit_get_schemas_for_operator", None)
    if not isinstance(name, str) or get_schemas is None:
        return ()
    try:
        schemas = list(get_schemas(f"aten::{name}"))
    except Exception:  # an unknown operator name, or a torch whose binding changed
        return ()
    signatures = []
    for schema in sorted(schemas, key=lambda s: "out" in s.overload_name):
        params = []
        try:
            for arg in schema.arguments:
                arg_name = "input" if arg.name == "self" and not is_method else arg.name
                kind = (
                    inspect.Parameter.KEYWORD_ONLY
                    if arg.kwarg_only
                    else inspect.Parameter.POSITIONAL_OR_KEYWORD
                )
                default = arg.default_value if arg.has_default_value() else inspect.Parameter.empty
                params.append(inspect.Parameter(arg_name, kind, default=default))
            signatures.append(inspect.Signature(params))
        except (AttributeError, ValueError, TypeError):  # an unusual schema: skip it
            continue
    return tuple(signatures)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every ``i``, in one call (torch's ``_foreach_copy_``)."""
    if dst:
        torch._foreach_copy_(dst, src)


def foreach_sub_(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """``a[i] -= b[i]`` for every ``i``, in place, in one call (torch's ``_foreach_sub_``)."""
    if a:
        torch._foreach_sub_(a, b)


def functorch_values(tensor: torch.Tensor) -> torch.Tensor:
    """The values of a tensor made inside ``torch.func`` transforms: a ``vmap``ped one's of the
    whole batch (its batch dimension first), a ``grad`` one's tensor; any other as it is. Inside
    the transform a hook sees one sample's view, whose in-place copy is an error."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(tensor):
        bdim = functorch.maybe_get_bdim(tensor) if functorch.is_batchedtensor(tensor) else -1
        tensor = functorch.get_unwrapped(tensor)
        if bdim > 0:
            tensor = tensor.movedim(bdim, 0)
    return tensor


def in_functorch() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jvp`` …) runs."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def functorch_off() -> Any:
    """A context in which the ``torch.func`` transforms do not see torch operations (work on
    unwrapped tensors the transformed function does not use)."""
    return torch._C._DisableFuncTorch()


def pending_grad_scale(optimizer: Any, scaler: Any) -> torch.Tensor | None:
    """The scale the gradients of ``optimizer`` still carry before its step, or ``None`` when
    they carry none.

    A ``torch.amp.GradScaler`` unscales the gradients before the step (``scaler.unscale_``,
    which Lightning calls before ``on_before_optimizer_step``) except for an optimizer that
    unscales them inside its own step (``Adam``/``AdamW``/``SGD``/``Adagrad`` with
    ``fused=True``: torch marks it ``_step_supports_amp_scaling``, as Lightning reads it):
    there the gradients seen before the step are multiplied by the scale. Returned as the
    scaler's own tensor, on its device, so that no synchronisation is needed.
    """
    if scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
        return None
    state = scaler._per_optimizer_states.get(id(optimizer))  # .get: creates no entry
    if state is not None and state.get("stage") is torch.amp.grad_scaler.OptState.UNSCALED:
        return None  # the user unscaled them (scaler.unscale_(optimizer))
    return scaler._get_scale_async()
