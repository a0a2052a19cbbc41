"""What is written of one source: a token subset, a mean over dimensions, a function, a dtype.

The options of a source, applied in this order to each recorded tensor (rows along dim 0):

* ``tokens``: keep these positions of dimension 1 (an int keeps one and drops the dimension,
  e.g. ``0`` for a CLS token or ``-1`` for the last one; a list keeps several);
* ``mean``: average over these dimensions (an int or a list; never dimension 0, the rows),
  integer and bool activations in float32 (a mask's mean is the fraction of its true values);
* ``transform``: any function from tensor to tensor that keeps the rows;
* ``dtype``: cast to this dtype (e.g. ``"float16"``); values are otherwise written as recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._core.checks import closest_hint
from ..errors import RecorderConfigError
from ._format import STORABLE, STORABLE_NAMES

OPTIONS = ("tokens", "mean", "transform", "dtype")
_DTYPE_NAMES = sorted(str(d).removeprefix("torch.") for d in STORABLE)


def parse_dtype(value: object, where: str) -> torch.dtype | None:
    """The dtype of the ``dtype`` option (``None``: none), one the shard format stores: a cast to
    another would only fail when the first batch is written."""
    if value is None:
        return None
    found = value
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):  # a misspelt name: the closest first, then all
        raise RecorderConfigError(
            f"Expected `dtype` of {where} to be a torch.dtype or its name (e.g. 'float16') but "
            f"got {value!r}.{closest_hint(value, _DTYPE_NAMES, 'dtype names')} The shard "
            f"format stores {STORABLE_NAMES}."
        )
    if found not in STORABLE:
        raise RecorderConfigError(
            f"Expected `dtype` of {where} to be a dtype the shard format stores "
            f"({STORABLE_NAMES}) but got {found}."
        )
    return found


def _dims(value: object, where: str, name: str) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else value
    if (
        not isinstance(items, Sequence)
        or not items
        or any(isinstance(d, bool) or not isinstance(d, int) for d in items)
    ):
        raise RecorderConfigError(
            f"Expected `{name}` of {where} to be an int or a non-empty list of ints but got "
            f"{value!r}."
        )
    return tuple(items)


class SourceSpec:
    """The per-source options, validated once; :meth:`apply` runs them on a batch's tensor."""

    __slots__ = ("dtype", "mean", "tokens", "transform", "where")

    def __init__(self, options: Mapping[str, Any], where: str) -> None:
        if not isinstance(options, Mapping):
            raise RecorderConfigError(
                f"Expected the options of {where} to be a dict such as {{'dtype': 'float16'}} "
                f"(among {', '.join(OPTIONS)}) but got {options!r}."
            )
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise RecorderConfigError(
                f"Expected the options of {where} to be among {', '.join(OPTIONS)} but got "
                f"{', '.join(map(repr, unknown))}."
            )
        self.where = where
        tokens = options.get("tokens")
        self.tokens: int | tuple[int, ...] | None = None
        if tokens is not None:
            self.tokens = tokens if isinstance(tokens, int) else _dims(tokens, where, "tokens")
            if isinstance(tokens, bool):
                _dims(tokens, where, "tokens")
        mean = options.get("mean")
        self.mean = None if mean is None else _dims(mean, where, "mean")
        if self.mean is not None and 0 in self.mean:
            raise RecorderConfigError(
                f"Expected `mean` of {where} to name dimensions other than 0 (the rows) but got "
                f"{mean!r}."
            )
        transform = options.get("transform")
        if transform is not None and not callable(transform):
            raise RecorderConfigError(
                f"Expected `transform` of {where} to be a callable from tensor to tensor but got "
                f"{transform!r}."
            )
        self.transform: Callable[[torch.Tensor], torch.Tensor] | None = transform
        self.dtype = parse_dtype(options.get("dtype"), where)

    @property
    def identity(self) -> bool:
        return self.tokens is None and self.mean is None and self.transform is None

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tokens is not None:
            if tensor.dim() < 2:
                raise RecorderConfigError(
                    f"Expected the activations of {self.where} to have a dimension 1 for `tokens` "
                    f"but got shape {tuple(tensor.shape)}."
                )
            index = self.tokens if isinstance(self.tokens, int) else list(self.tokens)
            size = 0 if tensor.is_nested else tensor.size(1)  # a nested tensor: torch's error
            wanted = [index] if isinstance(index, int) else index
            outside = [t for t in wanted if size and not -size <= t < size]
            if outside:
                raise RecorderConfigError(
                    f"Expected `tokens` of {self.where} to be positions of dimension 1 of its "
                    f"activations, of size {size} (shape {tuple(tensor.shape)}), so from "
                    f"{-size} to {size - 1}, but got {outside[0]}."
                )
            tensor = tensor[:, index]
        if self.mean is not None:
            dims = tensor.dim()
            outside = [d for d in self.mean if not tensor.is_nested and not -dims <= d < dims]
            if outside:
                raise RecorderConfigError(
                    f"Expected `mean` of {self.where} to name dimensions of its activations, "
                    f"which have {dims} (shape {tuple(tensor.shape)}), but got {outside[0]}."
                )
            to_rows = [d for d in self.mean if not tensor.is_nested and d % dims == 0]
            if to_rows:  # a negative dim that counts back to the rows (-1 of a vector)
                raise RecorderConfigError(
                    f"Expected `mean` of {self.where} to name dimensions other than 0 (the rows) "
                    f"but {to_rows[0]} is dimension 0 of its activations of shape "
                    f"{tuple(tensor.shape)}; record an output with dimensions beyond the rows, or "
                    "leave `mean` out for it."
                )
            if not (tensor.is_floating_point() or tensor.is_complex()):
                tensor = tensor.float()  # torch takes no mean of integers (a mask: a fraction)
            tensor = tensor.mean(dim=self.mean)
        if self.transform is not None:
            rows = tensor.size(0)  # a nested tensor has no shape, but has its rows
            tensor = self.transform(tensor)
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or len(tensor) != rows:
                raise RecorderConfigError(
                    f"Expected `transform` of {self.where} to return a tensor with {rows} rows "
                    f"(dimension 0 kept) but got {_describe(tensor)}."
                )
        if self.dtype is not None and tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
        return tensor


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
