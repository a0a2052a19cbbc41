"""The parameter statistics of :class:`~lightning_recorder.FeatureStatsMonitor`: norms, gradient
norms and update ratios, each of the optimizer step that owns the parameter.

At each optimizer step of a logged training step (``on_before_optimizer_step``), the monitored
parameters that *this optimizer* updates and that have a gradient get their gradient norm and a
copy of their value (one foreach copy; the buffers are kept from one logged step to the next on
the CPU, where allocating them again costs page faults, and freed after each logged step on an
accelerator, whose caching allocator gives them back at once: no memory is held between logged
steps there). With several optimizers (a GAN's
discriminator and generator, Lightning's manual optimization) each parameter's figures are
those of its own optimizer's step, never another optimizer's gradient left over from an earlier
backward; a parameter stepped twice in a batch keeps its last step. An optimizer that calls its
closure several times in one step (``torch.optim.LBFGS``; Lightning calls
``on_before_optimizer_step`` after each of those backwards) keeps the copy of the first call, the
value before the step, and the gradient norm of the last (a step post-hook on the optimizer, held
in logged batches only, says when its step is over: :class:`._optimizer_steps.StepsInProgress`).
The copies' norms ``||before||`` are taken with the gradients' in one foreach norm right after
the copy, while the copies are still in the cache. At the batch's end, one foreach norm over the
parameters, an in-place foreach difference and one more norm give ``||p||`` and ``||Δp||``,
still on the device.

A step that updated nothing has no update ratio: a step the AMP grad scaler skipped (its
optimizer never stepped, or, ``fused=True``, stepped with the scaler's ``found_inf`` flag set;
the flag is read with the norms, in the same copy to the host), as the ratio of a parameter
whose norm before the step was 0, which is undefined.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from .._core.compat import foreach_copy_, foreach_norm, foreach_sub_
from ..stats.norms import norm_values
from ..stats.sharded import full_values
from ._optimizer_steps import StepsInProgress

__all__ = ["ParameterStats"]


def upcast(tensors: list[Tensor]) -> list[Tensor]:
    """Tensors below float32 converted to it, as :func:`~lightning_recorder.stats.tensor_norm`."""
    return [t if t.dtype in (torch.float32, torch.float64) else t.float() for t in tensors]


def norms(tensors: list[Tensor]) -> list[Tensor]:
    """The L2 norm of each tensor (at least in float32), in one foreach call."""
    return foreach_norm(upcast(tensors)) if tensors else []


def unscaled(grad_norms: list[Tensor], grad_scale: Tensor | None) -> list[Tensor]:
    """Gradient norms with the scale an AMP grad scaler left on the gradients divided out."""
    if grad_scale is None:
        return grad_norms
    return [norm / grad_scale.to(norm.device) for norm in grad_norms]


class ParameterStats:
    """Norms, gradient norms and update ratios of ``params`` (``DTensor`` s if ``sharded``:
    their norms are collectives, every rank computes them in the same order)."""

    def __init__(self, params: dict[str, nn.Parameter], sharded: bool) -> None:
        self.params, self.sharded = params, sharded
        self._before: dict[str, Tensor] = {}  # copies of the values before the step
        # id(optimizer) -> the sizes of its parameter groups and the monitored names it steps
        self._owned: dict[int, tuple[tuple[int, ...], list[str]]] = {}
        # the optimizers copied from in an unfinished step, with step post-hooks held in
        # logged batches only
        self._steps = StepsInProgress()
        self.clear()

    def close(self) -> None:
        """Remove the step post-hooks from the optimizers (idempotent)."""
        self._steps.release()

    def clear(self) -> None:
        """Forget this batch's gradient norms and copies (the buffers of CPU copies are kept
        for the next logged step; others are freed)."""
        self._grad_norms: dict[str, Tensor] = {}
        self._before_norms: dict[str, Tensor] = {}
        # an ordered set (a lookup per name, not a scan), with the id of the optimizer that
        # stepped each name
        self._stepped: dict[str, int] = {}
        self.close()  # the batch's steps are over
        self._before = {name: copy for name, copy in self._before.items() if copy.is_cpu}

    def _names_of(self, optimizer: torch.optim.Optimizer) -> list[str]:
        # a group added during the run (BaseFinetuning unfreezing a backbone) is looked up anew
        sizes = tuple(len(group["params"]) for group in optimizer.param_groups)
        found = self._owned.get(id(optimizer))
        if found is None or found[0] != sizes:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            found = self._owned[id(optimizer)] = (
                sizes,
                [name for name, p in self.params.items() if id(p) in ids],
            )
        return found[1]

    def before_step(
        self, optimizer: torch.optim.Optimizer, grad_scale: Tensor | None = None
    ) -> None:
        """Record the gradient norms and values of the parameters ``optimizer`` is about to
        update (those with a gradient). ``grad_scale``: the scale the gradients still carry
        (an AMP grad scaler with an optimizer that unscales them in its own step), divided
        out of their norms."""
        names = [n for n in self._names_of(optimizer) if self.params[n].grad is not None]
        if not names:
            return
        with torch.no_grad():
            # a sparse gradient (nn.Embedding(sparse=True)): its stored values, the same norm
            grads = [norm_values(cast(Tensor, self.params[name].grad)) for name in names]
            if self._steps.inside(optimizer) and all(n in self._before_norms for n in names):
                # the closure called again inside the same step (LBFGS): the values before the
                # step are those copied at its first call; the gradient is the last one
                found = norms(grads)
                if self.sharded:
                    found = full_values(found)  # collectives, on every rank in the same order
                self._grad_norms.update(zip(names, unscaled(found, grad_scale), strict=True))
                return
            self._steps.enter(optimizer)
            buffers = []
            for name in names:
                param = self.params[name]
                buffer = self._before.get(name)
                if buffer is None or buffer.shape != param.shape or buffer.device != param.device:
                    dtype = param.dtype if param.dtype == torch.float64 else torch.float32
                    buffer = self._before[name] = torch.empty_like(param, dtype=dtype)
                buffers.append(buffer)
            params: list[Tensor] = [self.params[n] for n in names]
            if self.sharded:  # DTensor has no sharding rule for the foreach copy
                for dst, src in zip(buffers, params, strict=True):
                    dst.copy_(src)
            else:
                foreach_copy_(buffers, params)
            # the copies' norms read while the copies are still in the cache (after the step
            # they are read once more, for the change)
            found = norms([*grads, *buffers])
            if self.sharded:
                found = full_values(found)  # collectives, on every rank in the same order
            k = len(names)
            self._grad_norms.update(zip(names, unscaled(found[:k], grad_scale), strict=True))
            self._before_norms.update(zip(names, found[k:], strict=True))
        self._stepped.update(dict.fromkeys(names, id(optimizer)))

    def tensors(self) -> tuple[list[str], list[Tensor]]:
        """The names of the stepped parameters and, on the device: the norm of every monitored
        parameter, then of each stepped one's value before its step and of its change, then
        its gradient norm, then, where some step may have updated nothing (under an AMP grad
        scaler), a flag for each stepped one, nonzero where its step updated nothing. Resets
        the batch."""
        stepped = list(self._stepped)
        skipped = self._skipped(stepped)
        before = [self._before[name] for name in stepped]
        with torch.no_grad():
            found = norms(list(self.params.values()))
            foreach_sub_(before, upcast([self.params[name] for name in stepped]))
            found = [*found, *norms(before)]  # ||before - after|| = ||change||
            if self.sharded:
                found = full_values(found)  # collectives, on every rank in the same order
        k = len(self.params)
        before_norms = [self._before_norms[name] for name in stepped]
        grad_norms = [self._grad_norms[name] for name in stepped]
        self.clear()
        return stepped, [*found[:k], *before_norms, *found[k:], *grad_norms, *skipped]

    def _skipped(self, stepped: list[str]) -> list[Tensor]:
        """For each stepped parameter, a 0-d flag nonzero where its optimizer's step updated
        nothing (skipped by the AMP grad scaler), on the device; none when every step ran."""
        steps = self._steps
        flags: dict[int, Tensor | None] = {}  # None: never stepped (skipped by the scaler)
        for key in dict.fromkeys(self._stepped.values()):
            found_inf = steps.found_inf(key)
            if steps.unfinished(key):
                flags[key] = None
            elif found_inf is not None:
                flags[key] = found_inf.reshape(())
        if not flags:
            return []
        like = self._before_norms[stepped[0]]
        zero, one = like.new_zeros(()), like.new_ones(())
        found = [flags.get(self._stepped[name], zero) for name in stepped]
        return [one if flag is None else flag for flag in found]

    def values(
        self, stepped: list[str], values: list[float]
    ) -> tuple[dict[str, float], dict[str, tuple[float, float | None]]]:
        """From the host values of :meth:`tensors`: the norm of each parameter, and the gradient
        norm and update ratio ``||Δp|| / (||p|| + 1e-12)`` of each stepped one (``||p||``
        before the step). The ratio is ``None`` where ``||p||`` was 0 (a bias initialised to
        zeros): undefined there, not ``||Δp|| / 1e-12``; and where the step updated nothing
        (the AMP grad scaler skipped it): no update to measure."""
        names = list(self.params)
        k, n = len(names), len(stepped)
        sizes, changes = values[k : k + n], values[k + n : k + 2 * n]
        grads, skipped = values[k + 2 * n : k + 3 * n], values[k + 3 * n :] or [0.0] * n
        norm_of = dict(zip(names, values[:k], strict=True))
        stepped_of = {
            name: (grad, None if size == 0 or skip else change / (size + 1e-12))
            for name, size, change, grad, skip in zip(
                stepped, sizes, changes, grads, skipped, strict=True
            )
        }
        return norm_of, stepped_of
