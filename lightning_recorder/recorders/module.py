"""Recorders of ``nn.Module`` calls: inputs, outputs, and the gradients flowing through them.

The source is a module name from ``model.named_modules()`` (wrapper prefixes such as ``module.``
or ``_orig_mod.`` are ignored), a glob pattern (``"features.*"``), or a module type
(``torch.nn.Conv2d``, ``"torch.nn.Conv2d"``, ``"Conv2d"``). A pattern or type gives one record
stream per matched module, named after it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from .._core.hooks import GradSink
from .._core.names import (
    as_module_type,
    canonical_name,
    check_regex,
    is_glob,
    named_modules,
    refuse_second_name,
    select,
)
from .._core.structures import Binder, iter_tensors
from ..errors import RecorderConfigError, UnknownSourceError
from ._registry import register_recorder
from .base import BaseRecorder, RecorderHook, RecordStream

__all__ = [
    "ModuleInputGradsRecorder",
    "ModuleInputsRecorder",
    "ModuleOutputGradsRecorder",
    "ModuleOutputsRecorder",
]


class _ModuleRecorder(BaseRecorder):
    """Shared source resolution for module recorders."""

    def __init__(self, source: str | type[nn.Module] | tuple[type[nn.Module], ...], **options: Any):
        if isinstance(source, str) and not source:
            raise RecorderConfigError(
                "Expected `source` to be a module name, a glob pattern or a module type but got "
                "''. The root module itself cannot be recorded: name a submodule."
            )
        if not isinstance(source, (str, type, tuple)):
            raise RecorderConfigError(
                f"Expected `source` to be a module name, a glob pattern or a module type (or a "
                f"tuple of nn.Module types) but got {type(source).__name__} {source!r}."
            )
        if isinstance(source, type) and not issubclass(source, nn.Module):
            raise RecorderConfigError(
                f"Expected `source` to be a module name, a glob pattern or a module type (an "
                f"nn.Module subclass) but got the class {source.__name__}."
            )
        if isinstance(source, tuple) and (
            not source or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in source)
        ):
            raise RecorderConfigError(
                f"Expected `source` to be a module name, a glob pattern or a module type (or a "
                f"non-empty tuple of nn.Module types) but got {source!r}."
            )
        check_regex(source)
        super().__init__(source, **options)
        self._type = as_module_type(source)
        self._hooked: dict[str, nn.Module] = {}
        self._group = self._type is not None or (isinstance(source, str) and is_glob(source))

    @property
    def is_group(self) -> bool:
        return self._group

    def prepare_from_model(self, model: nn.Module | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise RecorderConfigError(
                f"{self!r} records a module: expected `initialize(model)` with an nn.Module but "
                f"got {type(model).__name__}."
            )
        modules = named_modules(model)
        if self._type is not None and not (
            isinstance(self.source, str) and canonical_name(self.source) in modules
        ):
            names = select(modules, self._type, "module")
        else:
            self._group = isinstance(self.source, str) and is_glob(self.source)
            try:
                names = select(modules, self.source, "module")
            except UnknownSourceError:
                refuse_second_name(model, self.source, "module", modules)
                raise
        scripted = [name for name in names if isinstance(modules[name], torch.jit.ScriptModule)]
        if scripted:  # torch refuses hooks on them: say so before any hook is installed
            raise RecorderConfigError(
                f"Expected the modules that the source {self.source!r} selects to take hooks but "
                f"{', '.join(map(repr, scripted[:5]))}{' …' if len(scripted) > 5 else ''} "
                f"{'is a scripted module' if len(scripted) == 1 else 'are scripted modules'} "
                "(torch.jit.script), on which torch allows no hooks. Record the module before "
                "scripting it, or its parent, or give a source that leaves it out."
            )
        for name in names:
            self._install(name, modules[name], self.add_stream(name))
            self._hooked[name] = modules[name]

    @property
    def hooked_modules(self) -> dict[str, nn.Module]:
        """``{stream name: module}``: the module objects the hooks are on (empty once released).

        A module replaced in the model afterwards (``model.body[0] = nn.Linear(...)``) is not
        recorded: its name now points to another object. Compare with ``named_modules()``.
        """
        return dict(self._hooked)

    def _teardown(self) -> None:
        super()._teardown()
        self._hooked = {}

    def _install(self, name: str, module: nn.Module, stream: RecordStream) -> None:
        raise NotImplementedError

    def _check_argument(self, module: nn.Module, binder: Binder, *, items: bool = True) -> None:
        """Raise unless the first ``path`` item names an argument of ``module.forward``
        (``items``: an item of its ``*args`` by its record name, ``"args[0]"``)."""
        key = self.path[0] if self.path else None
        sig = binder.signature
        if key is None or sig is None:
            return
        where = f"{type(module).__name__}.forward({', '.join(sig.parameters)})"
        binder.check_key(key, type(self).__name__, where, items=items)

    def _empty_hint(self) -> str:
        return (
            "Likely reasons: the module was never called by the forward that ran inside the "
            "context (a branch not taken, or a module that is defined but unused); the forward ran "
            "outside `with recorder:`; or the model passed to `initialize` is not the one that "
            "ran."
        )


class _OutputHook(RecorderHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        rec = self.recorder()
        if rec is None:
            return
        if rec.path is not None:
            output = rec._select(output)
        rec.capture(self._stream, output)


class _InputHook(RecorderHook):
    __slots__ = ("_binder",)

    def __init__(self, recorder: BaseRecorder, stream: RecordStream, binder: Binder) -> None:
        super().__init__(recorder, stream)
        self._binder = binder

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rec = self.recorder()
        if rec is None:
            return
        value: Any = self._binder(args, kwargs)
        if rec.path is not None:
            value = rec._select(value)
        rec.capture(self._stream, value)


@register_recorder
class ModuleOutputsRecorder(_ModuleRecorder):
    """Record the output of each forward call of a module.

    Args:
        source: a module name, glob pattern or module type (see the module docs).
        **options: ``detach``, ``clone``, ``device``, ``dtype``, ``keep``, ``path``
            (see :class:`~lightning_recorder.BaseRecorder`).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
        >>> recorder = ModuleOutputsRecorder("0").initialize(model)
        >>> x = torch.randn(2, 3)
        >>> with recorder:
        ...     out = model(x)
        >>> torch.equal(recorder.get_record_data(), model[0](x))
        True
        >>> recorder.release()
    """

    short_name = "ModuleOutputs"

    def _install(self, name: str, module: nn.Module, stream: RecordStream) -> None:
        self.hooks.install(partial(module.register_forward_hook, _OutputHook(self, stream)))


@register_recorder
class ModuleInputsRecorder(_ModuleRecorder):
    """Record the inputs of each forward call of a module, keyword arguments included.

    Each record is an :class:`~lightning_recorder.Arguments` tuple in the order of the module's
    ``forward`` signature, defaults filled in: ``m(x, mask=m)`` and ``m(x, m)`` give the same
    record, and ``data_idx`` (or ``path``) picks one argument by position or name.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4))
        >>> recorder = ModuleInputsRecorder("0").initialize(model)
        >>> x = torch.randn(2, 3)
        >>> with recorder:
        ...     _ = model(x)
        >>> recorder.get_record_data(data_idx=0) is x
        True
        >>> recorder.release()
    """

    short_name = "ModuleInputs"

    def _install(self, name: str, module: nn.Module, stream: RecordStream) -> None:
        binder = Binder(module.forward)
        self._check_argument(module, binder)
        hook = _InputHook(self, stream, binder)
        self.hooks.install(partial(module.register_forward_pre_hook, hook, with_kwargs=True))


# ---------------------------------------------------------------------- gradients
def _single_tensor(value: Any, where: str) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    tensors = list(iter_tensors(value))
    if len(tensors) > 1:
        raise RecorderConfigError(
            f"{where}: expected one tensor to record the gradient of, but the value holds "
            f"{len(tensors)} tensors; choose one with `path` (a tuple index, dict key or field)."
        )
    return tensors[0] if tensors else None


_GRAD_MODIFIED_CAUSE = (
    "a gradient is changed in place when it becomes the `.grad` of a leaf tensor (an input "
    "that requires grad) and a later backward accumulates into it, or `.grad.zero_()` runs."
)


class _OutputGradHook(RecorderHook):
    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        rec = self.grad_recorder()
        if rec is None:
            return
        tensor = _single_tensor(rec._select(output), repr(rec))
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(GradSink(self, rec._session))


class _InputGradHook(RecorderHook):
    __slots__ = ("_names",)

    def __init__(self, recorder: BaseRecorder, stream: RecordStream, names: list[str]) -> None:
        super().__init__(recorder, stream)
        self._names = names

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        rec = self.grad_recorder()
        if rec is None:
            return None
        key: int | str = rec.path[0] if rec.path else 0
        names = self._names
        if isinstance(key, int) and key >= len(args) and key < len(names):
            key = names[key]
        elif isinstance(key, str) and key not in kwargs and key in names:
            position = names.index(key)
            if position < len(args):
                key = position
        if isinstance(key, int):
            if key >= len(args):
                return None
            tensor = args[key]
        elif key in kwargs:
            tensor = kwargs[key]
        else:
            return None
        if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
            return None
        # A private view: its gradient is exactly the part that flows through this module,
        # even when the same tensor also feeds other modules.
        view = tensor.view_as(tensor)
        view.register_hook(GradSink(self, rec._session))
        if isinstance(key, int):
            args = (*args[:key], view, *args[key + 1 :])
        else:
            kwargs = {**kwargs, key: view}
        return args, kwargs


@register_recorder
class ModuleOutputGradsRecorder(_ModuleRecorder):
    """Record the gradient of the loss with respect to a module's output, during backward.

    One record per backward through a recorded call (in the order gradients arrive, so the
    reverse of the call order for a module called several times). The forward and the backward
    must both run inside the context. For a structured output, ``path`` picks the tensor.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
        >>> recorder = ModuleOutputGradsRecorder("0").initialize(model)
        >>> with recorder:
        ...     model(torch.randn(2, 3)).sum().backward()
        >>> recorder.get_record_data().shape
        torch.Size([2, 4])
        >>> recorder.release()
    """

    short_name = "ModuleOutputGrads"

    def _install(self, name: str, module: nn.Module, stream: RecordStream) -> None:
        self.hooks.install(partial(module.register_forward_hook, _OutputGradHook(self, stream)))

    def _empty_hint(self) -> str:
        return (
            super()._empty_hint()
            + " Gradients are recorded during backward: run `loss.backward()` inside the same "
            "context as the forward, and make sure the output requires grad."
        )

    def _modified_cause(self) -> str:
        return _GRAD_MODIFIED_CAUSE


@register_recorder
class ModuleInputGradsRecorder(_ModuleRecorder):
    """Record the gradient of the loss with respect to one input of a module, during backward.

    ``path`` names the input (a position or an argument name; default ``0``, the first). Only
    the gradient that flows through this module is recorded, even when the same tensor also
    feeds other modules. Inputs that do not require grad (e.g. the data) give no record.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
        >>> recorder = ModuleInputGradsRecorder("1").initialize(model)
        >>> with recorder:
        ...     model(torch.randn(2, 3)).sum().backward()
        >>> recorder.get_record_data().shape
        torch.Size([2, 4])
        >>> recorder.release()
    """

    short_name = "ModuleInputGrads"

    def __init__(
        self, source: str | type[nn.Module] | tuple[type[nn.Module], ...], **options: Any
    ) -> None:
        super().__init__(source, **options)
        if self.path is not None and len(self.path) != 1:
            raise RecorderConfigError(
                f"Expected `path` of {type(self).__name__} to name one argument (a position or a "
                f"name) but got {self.path!r}."
            )

    def _install(self, name: str, module: nn.Module, stream: RecordStream) -> None:
        binder = Binder(module.forward)
        # The hook finds an input by position or parameter name, not by a `*args` item's name.
        self._check_argument(module, binder, items=False)
        binder_names = list(binder._kinds)
        hook = _InputGradHook(self, stream, binder_names)
        self.hooks.install(partial(module.register_forward_pre_hook, hook, with_kwargs=True))

    def _empty_hint(self) -> str:
        return (
            super()._empty_hint()
            + " Gradients are recorded during backward: run `loss.backward()` inside the same "
            "context as the forward; an input that does not require grad (such as the data "
            "entering the first layer) has no gradient."
        )

    def _modified_cause(self) -> str:
        return _GRAD_MODIFIED_CAUSE
