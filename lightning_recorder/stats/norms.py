"""Norms of parameters and gradients: one tensor, a set of tensors, an update ratio."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from .._core.checks import check_tensor
from ..errors import RecorderConfigError
from ._engine import is_plain, stored_parts
from ._state import F64

__all__ = ["global_norm", "tensor_norm", "update_ratio"]


def norm_values(t: Tensor) -> Tensor:
    """``t``, or for a tensor that is not an ordinary dense one the values it holds (a sparse
    gradient's stored values, coalesced; a nested tensor's components; a quantized tensor's
    values), which have its L2 norm: implicit zeros add nothing to it."""
    parts = stored_parts(t)[0]
    if len(parts) == 1:
        return parts[0]
    flat = [p.reshape(-1) for p in parts]
    return torch.cat(flat) if flat else torch.zeros(0, device=t.device)


def _norm_input(t: Tensor, name: str, aligned: bool = False) -> Tensor:
    """A real tensor of ``name`` in the precision its norm is taken in: its :func:`norm_values`,
    or where it is compared element by element (``aligned``) its dense form."""
    t = check_tensor(t, name, real=True).detach()
    if not is_plain(t):
        if not aligned:
            t = norm_values(t)
        elif t.is_nested:
            raise RecorderConfigError(
                f"Expected `{name}` to be a tensor with one shape (dense, sparse or quantized) "
                "but got a nested tensor; compare its components one by one."
            )
        else:
            t = t.dequantize() if t.is_quantized else t.to_dense()
    return t.to(F64 if t.dtype == F64 else torch.float32)


def tensor_norm(t: Tensor) -> Tensor:
    """The L2 norm of all elements of ``t``, detached, at least in ``float32``.

    Args:
        t: a tensor of any shape and real dtype (a parameter, a gradient).

    Returns:
        A 0-d tensor on ``t``'s device (``float64`` for ``float64`` input); 0 for an empty tensor,
        non-finite when ``t`` holds a non-finite value.

    Raises:
        RecorderConfigError: if ``t`` is not a real tensor.

    Examples:
        >>> tensor_norm(torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float16)).item()
        5.0
    """
    return torch.linalg.vector_norm(_norm_input(t, "t"))


def global_norm(tensors: Iterable[Tensor]) -> Tensor:
    """The L2 norm of the concatenation of ``tensors`` (the total norm of gradient clipping).

    Args:
        tensors: tensors of any shapes, for instance ``p.grad`` of every parameter that has one.

    Returns:
        A 0-d ``float32`` tensor (``float64`` if any input is), on the first tensor's device;
        0 when there is no tensor (the norm of an empty set, as in
        ``torch.nn.utils.clip_grad_norm_``): ``global_norm(p.grad for p in params if p.grad is
        not None)`` before any backward is 0.

    Raises:
        RecorderConfigError: if ``tensors`` is not an iterable, or an element is not a real
            tensor.

    Examples:
        >>> global_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]).item()
        5.0
    """
    if not isinstance(tensors, Iterable):
        raise RecorderConfigError(
            "Expected `tensors` to be an iterable of tensors (e.g. p.grad for p in "
            f"model.parameters()) but got {type(tensors).__name__} {tensors!r}."
        )
    norms = []
    for idx, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise RecorderConfigError(
                f"Expected `tensors` to hold only tensors (torch.Tensor) but item {idx} is "
                f"{type(t).__name__} {t!r}."
            )
        norms.append(torch.linalg.vector_norm(_norm_input(t, f"tensors[{idx}]")))
    if not norms:
        return torch.zeros(())
    dtype = F64 if any(n.dtype == F64 for n in norms) else torch.float32
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device, dtype) for n in norms]))


def update_ratio(before: Tensor, after: Tensor, eps: float = 1e-12) -> Tensor:
    """The update-to-parameter ratio ``||after - before|| / (||before|| + eps)``.

    Take ``before`` as a copy of a parameter before ``optimizer.step()`` and ``after`` as the
    parameter after it; healthy training typically shows ratios around ``1e-3``.

    Args:
        before: the tensor before the update.
        after: the tensor after the update, of the same shape.
        eps: added to the denominator, so a zero ``before`` gives a finite ratio.

    Returns:
        A 0-d tensor, as :func:`tensor_norm`.

    Raises:
        RecorderConfigError: if the shapes or devices differ, an argument is not a real
            tensor, or ``eps`` is negative.

    Examples:
        >>> update_ratio(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])).item()
        0.10000000149011612
    """
    b, a = _norm_input(before, "before", True), _norm_input(after, "after", True)
    if a.shape != b.shape:
        raise RecorderConfigError(
            f"Expected `after` to have the shape of `before`, {tuple(b.shape)}, "
            f"but got {tuple(a.shape)}."
        )
    if a.device != b.device:
        raise RecorderConfigError(
            f"Expected `after` on the device of `before`, {b.device}, but got {a.device}; move "
            "the copy taken before the step there (`before.to(after.device)`)."
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise RecorderConfigError(f"Expected `eps` to be a non-negative number but got {eps!r}.")
    return torch.linalg.vector_norm(a - b) / (torch.linalg.vector_norm(b) + eps)
