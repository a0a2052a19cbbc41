"""Recorders of parameters and of their accumulated gradients.

The source is a parameter name from ``model.named_parameters()`` (wrapper prefixes ignored) or a
glob pattern such as ``"*.weight"`` (one stream per matched parameter).

**Pruned parameters.** ``torch.nn.utils.prune`` replaces a parameter ``weight`` by a parameter
``weight_orig`` and a buffer ``weight_mask``; the module's ``weight`` becomes their product. The
name ``"fc.weight"`` (and a pattern such as ``"*.weight"``) still selects it: a
:class:`ParameterRecorder` records the *effective* weight ``weight_orig * weight_mask`` (what the
forward uses, so its norm is the pruned network's), a :class:`ParameterGradRecorder` records
``weight_orig.grad``, which is the effective weight's gradient with the pruned entries zero.
``"fc.weight_orig"`` names the raw, unmasked parameter.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from .._core.names import (
    check_regex,
    is_glob,
    named_modules,
    named_parameters,
    refuse_second_name,
    select,
)
from ..errors import RecorderConfigError, UnknownSourceError
from ._registry import register_recorder
from .base import BaseRecorder, RecorderHook, RecordStream

__all__ = ["ParameterGradRecorder", "ParameterRecorder"]


def _pruned(model: nn.Module, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """``{"m.weight": mask}`` for every parameter pruned by ``torch.nn.utils.prune``."""
    masks: dict[str, torch.Tensor] = {}
    for prefix, module in named_modules(model).items():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if not buffer_name.endswith("_mask"):
                continue
            base = buffer_name[: -len("_mask")]
            full = f"{prefix}.{base}" if prefix else base
            if f"{full}_orig" in params and full not in params:
                masks[full] = buffer
    return masks


class _ParameterSource(BaseRecorder):
    def __init__(self, source: str, **options: Any) -> None:
        if not isinstance(source, str) or not source:
            raise RecorderConfigError(
                f"Expected `source` to be a parameter name or glob pattern but got {source!r}."
            )
        check_regex(source)
        super().__init__(source, **options)
        self._params: dict[str, nn.Parameter] = {}
        self._masks: dict[str, torch.Tensor] = {}  # pruned: the mask of each selected name

    @property
    def is_group(self) -> bool:
        return is_glob(self.source)

    def _resolve(self, model: nn.Module | None) -> dict[str, nn.Parameter]:
        if not isinstance(model, nn.Module):
            raise RecorderConfigError(
                f"{self!r} records a parameter: expected `initialize(model)` with an nn.Module but "
                f"got {type(model).__name__}."
            )
        params = named_parameters(model)
        masks = _pruned(model, params)
        choices = {**params, **{name: params[f"{name}_orig"] for name in masks}}
        try:
            names = select(choices, self.source, "parameter")
        except UnknownSourceError:
            refuse_second_name(model, self.source, "parameter", choices)
            raise
        self._masks = {name: masks[name] for name in names if name in masks}
        return {name: choices[name] for name in names}

    def _teardown(self) -> None:
        super()._teardown()
        self._params = {}
        self._masks = {}


@register_recorder
class ParameterRecorder(_ParameterSource):
    """Record a parameter.

    As in MMRazor, the record is the parameter itself, available right after
    :meth:`initialize`; each context entry records it again (into a fresh buffer). By default
    the record *is* the live parameter, so it reflects later optimizer steps; pass
    ``clone=True`` for a snapshot taken when the context is entered.

    Examples:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> recorder = ParameterRecorder("0.weight").initialize(model)
        >>> recorder.data_buffer[0] is model[0].weight
        True
        >>> recorder.release()
    """

    short_name = "Parameter"

    def __init__(self, source: str, **options: Any) -> None:
        super().__init__(source, **options)
        self._track = False  # the live parameter changes by design (optimizer steps)

    def prepare_from_model(self, model: nn.Module | None = None) -> None:
        self._params = self._resolve(model)
        for name in self._params:
            self.add_stream(name)

    def _snap(self) -> None:
        for name, param in self._params.items():
            stream = self._streams[name]
            stream._reset()
            mask = self._masks.get(name)
            value: Any = param if mask is None else param * mask  # pruned: the effective weight
            value = self._select(value) if self.path is not None else value
            self.capture(stream, value)

    def _after_initialize(self) -> None:
        self._snap()

    def _on_start(self) -> None:
        self._snap()


class _AccumulateHook(RecorderHook):
    __slots__ = ()

    def __call__(self, param: torch.Tensor) -> None:
        rec = self._ref()  # no checkpoint guard: gradients arrive during backward by design
        if rec is None or not rec._recording or param.grad is None:
            return
        rec.capture(self._stream, param.grad)


@register_recorder
class ParameterGradRecorder(_ParameterSource):
    """Record a parameter's accumulated ``.grad`` after each backward that reaches it.

    One record per backward inside the context (with gradient accumulation, each record holds
    the sum so far). A pattern source skips frozen parameters (``requires_grad=False``: they
    never get a gradient); a frozen parameter named exactly, or a pattern matching only frozen
    ones, is an error. ``clone`` defaults to ``True`` here because ``.grad`` is accumulated in
    place: without a copy, every record would be the same, changing tensor.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 1))
        >>> recorder = ParameterGradRecorder("0.weight").initialize(model)
        >>> with recorder:
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> torch.equal(recorder.get_record_data(), model[0].weight.grad)
        True
        >>> recorder.release()
    """

    short_name = "ParameterGrad"

    def __init__(self, source: str, *, clone: bool = True, **options: Any) -> None:
        super().__init__(source, clone=clone, **options)

    def _trainable(self, params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
        """The parameters that can get a gradient: a pattern skips frozen ones, a name must not
        be frozen."""
        frozen = sorted(name for name, param in params.items() if not param.requires_grad)
        if not frozen:
            return params
        if not self.is_group:
            raise RecorderConfigError(
                f"Expected `source` {self.source!r} to be a trainable parameter but it is frozen "
                "(requires_grad=False), so it never gets a gradient; unfreeze it or record its "
                "value with ParameterRecorder."
            )
        if len(frozen) == len(params):
            raise RecorderConfigError(
                f"Expected `source` {self.source!r} to match a trainable parameter but it "
                f"matches only frozen ones (requires_grad=False): "
                f"{', '.join(repr(n) for n in frozen)}."
            )
        return {name: param for name, param in params.items() if param.requires_grad}

    def prepare_from_model(self, model: nn.Module | None = None) -> None:
        self._params = self._trainable(self._resolve(model))
        for name, param in self._params.items():
            stream: RecordStream = self.add_stream(name)
            hook = _AccumulateHook(self, stream)
            self.hooks.install(partial(param.register_post_accumulate_grad_hook, hook))

    def _empty_hint(self) -> str:
        return (
            "No backward reached the parameter inside the context: run `loss.backward()` inside "
            "`with recorder:`, and check that the parameter requires grad and is used."
        )
