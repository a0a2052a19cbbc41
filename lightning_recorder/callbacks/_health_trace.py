"""The hooks that write a :class:`~._health_verdict.Timeline` of one forward and backward.

A :class:`Trace` hooks every submodule of a model but scripted ones (``torch.jit.script``,
which take no hooks) — a forward pre-hook and a forward hook, put *before* any other hook so
that they see what the module itself received and returned. It records, with their
NaN/+inf/-inf counts:

* forward: each call's inputs (before the call, so before an in-place module such as
  ``ReLU(inplace=True)`` changes them) and outputs (before the next module changes them), and
  at a module's first call, its own parameters (one that an earlier update made non-finite is
  named as such, not the module that passed it on);
* backward, in the order autograd computes them: the gradient of each module output, each
  call's *share* of the gradient of each input — the input is handed to the module as a
  ``view_as`` of itself whose gradient hook sees only this call's share, so that a residual input
  used by two submodules has two shares; and, given after the backward
  (:meth:`Trace.parameter_grads`: no hook on the parameters, whose hooks cost the backward more
  than all the rest), each parameter's gradient.

Tensors are told apart by identity and version (an in-place change makes a new value); they are
held weakly unless ``keep`` (the replay keeps them for the evidence). Names for ``exclude``
(glob patterns): ``"<module>.output[.<path>]"``, ``"<module>.input.<argument>[.<path>]"`` and
``"batch[.<path>]"``; an excluded output stays excluded where it is passed on (an attention mask
holding ``-inf`` on purpose).

A ``DTensor`` (tensor parallelism) is counted by this rank's part of it, without a collective;
an entry of a sharded one keeps that part's shape (``Entry.shard``), which the event reports.

Counting costs a few passes over each tensor. On the CPU a clean tensor is settled by one
``isfinite(...).all()``; on a GPU the counts stay on the device (no synchronisation) until the
timeline is resolved, all at once.
"""

from __future__ import annotations

import fnmatch
import inspect
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._core.compat import current_autograd_node, in_functorch
from .._core.hooks import HookSet
from .._core.names import canonical_name, named_modules
from .._core.structures import modified, shape_of, snapshot
from ._health_verdict import ZERO, Call, Entry, Timeline, Value, quick_counts, shard_shape

__all__ = ["Trace", "tensor_paths"]


def tensor_paths(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in a nest of tuples, lists, mappings (dicts, and
    Hugging Face's ``BatchEncoding`` / ``BatchFeature`` batches) and dataclasses (paths joined by
    ``"."``: ``"0"``, ``"logits"``, ``"hidden.2"``; ``""`` for the value)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
        return
    if isinstance(value, (tuple, list)):
        items: Any = enumerate(value)
    elif isinstance(value, Mapping):
        items = value.items()
    elif hasattr(value, "__dataclass_fields__"):
        items = ((name, getattr(value, name, None)) for name in value.__dataclass_fields__)
    else:
        return
    for key, item in items:
        yield from tensor_paths(item, f"{prefix}.{key}" if prefix else str(key))


# weakly: a class defined anew (a notebook cell run again) lets the old one go
_ARGUMENT_NAMES: weakref.WeakKeyDictionary[type, list[str]] = weakref.WeakKeyDictionary()


def _argument_names(module: nn.Module) -> list[str]:
    """The positional parameter names of the class's ``forward`` (without ``self``)."""
    cls = type(module)
    names = _ARGUMENT_NAMES.get(cls)
    if names is None:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]
        except (TypeError, ValueError):
            params = []
        simple = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = _ARGUMENT_NAMES[cls] = [p.name for p in params if p.kind in simple]
    return names


class Trace:
    """Hooks on every submodule and parameter of ``model`` that write a :class:`Timeline`.

    Args:
        model: the model (its submodules are hooked, not the model itself).
        exclude: glob patterns of tensor names to leave out (see the module documentation).
        keep: keep every recorded tensor alive with the timeline (for the evidence of a
            replay); without it tensors are followed through weak references only.
        owner: the hooks' owner in :func:`~lightning_recorder._core.hooks.live_hooks`.
    """

    def __init__(
        self, model: nn.Module, exclude: Sequence[str] = (), keep: bool = False, owner: str = ""
    ) -> None:
        self.model, self.keep = model, keep
        self.patterns = tuple(exclude)
        self.hooks = HookSet(owner or "HealthMonitor trace")
        self._excluded_names: dict[str, bool] = {}
        self._argnames: dict[int, list[str]] = {}
        self.active = False
        self.begin()
        self.active = False

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        """Hook every submodule and parameter (idempotent)."""
        if self.hooks:
            return
        for name, module in named_modules(self.model).items():
            # torch refuses hooks on a scripted module (torch.jit.script) and on its submodules
            if not name or isinstance(module, torch.jit.ScriptModule):
                continue
            self._argnames[id(module)] = _argument_names(module)
            pre, post = partial(self._pre, name), partial(self._post, name)
            self.hooks.add(
                partial(module.register_forward_pre_hook, pre, with_kwargs=True, prepend=True)
            )
            self.hooks.add(
                partial(module.register_forward_hook, post, with_kwargs=True, prepend=True)
            )

    def remove(self) -> None:
        """Remove every hook (idempotent) and drop the timeline."""
        self.active = False
        self.hooks.remove_all()
        self.begin()
        self.active = False

    def begin(self, batch: Any = None) -> Timeline:
        """Start recording into a fresh timeline (gradient hooks of older ones go quiet);
        ``batch`` is checked for non-finite tensors (cheap on the CPU, no wait on a GPU)."""
        self.timeline = Timeline()
        self._stack: list[int] = []
        self._values: dict[int, Value] = {}
        self._weighed: set[str] = set()  # the modules whose own parameters are counted
        self.active = True
        if batch is not None:
            named = [(f"batch.{p}" if p else "batch", t) for p, t in tensor_paths(batch)]
            kept = [(name, t) for name, t in named if not self._excluded(name)]
            self.timeline.batch = [(name, quick_counts(t)) for name, t in kept]
            self.timeline.batch_types = {name: (str(t.dtype), shape_of(t)) for name, t in kept}
        return self.timeline

    def end_forward(self, loss: torch.Tensor | None) -> None:
        """Mark the end of the forward (the first call counts); ``loss`` is counted."""
        line = self.timeline
        if line.forward_end < 0:
            line.forward_end = len(line.entries)
            line.loss_counts = quick_counts(loss) if loss is not None else ZERO

    def finish(self) -> Timeline:
        """Stop recording; the timeline is returned."""
        self.active = False
        return self.timeline

    # ------------------------------------------------------------------ naming
    def _excluded(self, name: str) -> bool:
        if not self.patterns:
            return False
        found = self._excluded_names.get(name)
        if found is None:
            found = any(fnmatch.fnmatchcase(name, p) for p in self.patterns)
            self._excluded_names[name] = found
        return found

    def _value(self, t: torch.Tensor) -> Value | None:
        value = self._values.get(id(t))
        if value is None:
            return None
        held = value.ref if self.keep else value.ref()
        if held is not t or modified(t, value.version):
            return None
        return value

    # ------------------------------------------------------------------ forward hooks
    def _pre(
        self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        # a checkpoint re-run, or a call inside torch.func transforms (vmap, grad), whose
        # tensors are one sample's views that cannot be counted or hooked: not traced
        if not self.active or current_autograd_node() is not None or in_functorch():
            return None
        line = self.timeline
        parent = self._stack[-1] if self._stack else -1
        call = Call(len(line.calls), name, type(module).__name__, parent, len(self._stack))
        line.calls.append(call)
        self._stack.append(call.index)
        if name not in self._weighed:
            self._weighed.add(name)
            self._weights(line, name, module)
        names = self._argnames.get(id(module), ())
        new_args: list[Any] | None = None
        for i, item in enumerate(args):
            share = self._inputs(line, call, names[i] if i < len(names) else f"args.{i}", item)
            if share is not item:
                new_args = list(args) if new_args is None else new_args
                new_args[i] = share
        new_kwargs: dict[str, Any] | None = None
        for key, item in kwargs.items():
            share = self._inputs(line, call, key, item)
            if share is not item:
                new_kwargs = dict(kwargs) if new_kwargs is None else new_kwargs
                new_kwargs[key] = share
        if new_args is None and new_kwargs is None:
            return None
        return (tuple(new_args) if new_args is not None else args), (
            new_kwargs if new_kwargs is not None else kwargs
        )

    def _weights(self, line: Timeline, name: str, module: nn.Module) -> None:
        """Count the module's own parameters (not its submodules') as its call finds them: a
        sharded one (``DTensor``) by this rank's shard, without a collective; a lazy module's
        before its first call made them (nothing to count yet) not at all."""
        for local, param in module.named_parameters(recurse=False):
            if is_lazy(param) or not (param.is_floating_point() or param.is_complex()):
                continue
            counts = quick_counts(param)  # a DTensor: this rank's part (local_part)
            line.weights.append((name, local, param.dtype, shape_of(param), counts))
            line.held.append((weakref.ref(param), snapshot(param)))

    def _inputs(self, line: Timeline, call: Call, label: str, item: Any) -> Any:
        """Record the tensors of one argument; a tensor argument that needs a gradient is
        returned as a view of itself whose gradient hook sees this call's share."""
        pairs = (("", item),) if isinstance(item, torch.Tensor) else tensor_paths(item)
        share = item
        for path, t in pairs:
            if not (t.is_floating_point() or t.is_complex()):
                continue
            full = f"input.{label}.{path}" if path else f"input.{label}"
            value = self._value(t)
            excluded = (value is not None and value.excluded) or (
                bool(self.patterns) and self._excluded(f"{call.name}.{full}")
            )
            counts = ZERO if excluded else quick_counts(t)
            entry = Entry("input", call.index, full, t.dtype, shape_of(t), counts, excluded)
            entry.shard = shard_shape(t)
            line.entries.append(entry)
            if value is not None:
                value.consumers.append((call.index, full))
            if self.keep:
                entry.tensor, entry.version = t, snapshot(t)
                call.tensors.append((full, t))
            needs = not path and t.requires_grad and not t.is_leaf  # a leaf: a parameter
            if needs and torch.is_grad_enabled():
                share = t.view_as(t)
                hook = partial(self._grad_share, line, call.index, full, value, excluded)
                share.register_hook(hook)
        return share

    def _post(
        self, name: str, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any
    ) -> None:
        if (
            not self.active
            or current_autograd_node() is not None
            or in_functorch()
            or not self._stack
        ):
            return
        line = self.timeline
        call = line.calls[self._stack.pop()]
        pairs = (("", output),) if isinstance(output, torch.Tensor) else tensor_paths(output)
        for path, t in pairs:
            if not (t.is_floating_point() or t.is_complex()):
                continue
            full = f"output.{path}" if path else "output"
            value = self._value(t)
            excluded = (value is not None and value.excluded) or (
                bool(self.patterns) and self._excluded(f"{call.name}.{full}")
            )
            counts = ZERO if excluded else quick_counts(t)
            entry = Entry("output", call.index, full, t.dtype, shape_of(t), counts, excluded)
            entry.shard = shard_shape(t)
            line.entries.append(entry)
            if self.keep:
                entry.tensor, entry.version = t, snapshot(t)
                call.tensors.append((full, t))
            if value is None:
                value = Value(t if self.keep else weakref.ref(t), snapshot(t))
                self._values[id(t)] = value
                if t.requires_grad:
                    t.register_hook(partial(self._grad_output, line, value, full))
            value.producers.append(call.index)
            value.excluded = value.excluded or excluded
            entry.value = value

    # ------------------------------------------------------------------ gradient hooks
    def _grad_output(self, line: Timeline, value: Value, path: str, grad: torch.Tensor) -> None:
        if value.producers:
            counts = ZERO if value.excluded else quick_counts(grad)
            entry = Entry("grad_output", value.producers[-1], path, grad.dtype, grad.shape, counts)
            entry.excluded, entry.value, entry.shard = value.excluded, value, shard_shape(grad)
            if self.keep:  # the evidence holds a non-finite one (Timeline.resolve)
                entry.tensor, entry.version = grad, snapshot(grad)
            line.entries.append(entry)

    def _grad_share(
        self,
        line: Timeline,
        call: int,
        path: str,
        value: Value | None,
        excluded: bool,
        grad: torch.Tensor,
    ) -> None:
        if value is not None:
            value.shares_seen.add(call)
        counts = ZERO if excluded else quick_counts(grad)
        entry = Entry("grad_input", call, path, grad.dtype, grad.shape, counts, excluded)
        entry.shard = shard_shape(grad)
        if self.keep:
            entry.tensor, entry.version = grad, snapshot(grad)
        line.entries.append(entry)

    def parameter_grads(self, named: Iterable[tuple[str, torch.Tensor | None]]) -> None:
        """Count the parameters' gradients of the backward just traced (``(name, grad)``)."""
        for name, grad in named:
            if grad is not None:
                owner, _, local = canonical_name(name).rpartition(".")
                self.timeline.params.append(
                    (owner, local, grad.dtype, grad.shape, quick_counts(grad))
                )
                if self.keep:
                    self.timeline.param_grads[len(self.timeline.params) - 1] = grad
