"""`HealthEvent`: one finding of a :class:`~lightning_recorder.HealthMonitor`, and its sentence.

An event says *what* was found (``kind``), *when* (``step``, ``batch_idx``, ``rank``), *where*
(``module``, ``direction``, ``path``, ``dtype``, ``shape``) and *how much* (``counts``), whether
the module made the values or passed them on (``producer``), whether a replay of the step saw
the same (``reproduced``), what the monitor did (``action``) and where the evidence is
(``evidence``); ``message`` says all of it in one sentence (and, for a non-finite event, what
to do next). Events are plain data: ``to_dict()`` gives JSON-ready values, so that an event can
be written, sent to an alert or compared.

``kind`` is ``"nonfinite"`` for NaN/Inf found in the loss, the gradients or a replay,
``"amp_skipped"`` for a step that the AMP grad scaler skipped itself (not an alarm), or the name
of a :class:`~lightning_recorder.callbacks.health.HealthRule` for the rules' findings.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from .._core.checks import listing

__all__ = ["COUNT_KEYS", "Direction", "HealthEvent", "describe", "format_counts"]

Direction = Literal["forward", "backward", "loss", "parameter"]
"""Where non-finite values were found: a module's forward output (or the code between its
submodules), a gradient computed by its backward, the loss, or a parameter itself."""

COUNT_KEYS = ("nan", "posinf", "neginf")
"""The keys of :attr:`HealthEvent.counts`, in this order."""


def _zero_counts() -> dict[str, int]:
    return dict.fromkeys(COUNT_KEYS, 0)


@dataclass
class HealthEvent:
    """One finding of :class:`~lightning_recorder.HealthMonitor`, appended to its ``events``.

    Attributes:
        kind: ``"nonfinite"``, ``"amp_skipped"`` or the name of the rule that found it.
        step: Lightning's global step (optimizer steps done before this one).
        batch_idx: the batch index of the step (the micro-batch that showed it, with gradient
            accumulation); ``None`` when not known.
        rank: the global rank where it was found (under DDP, the rank whose batch produced it).
        module: the qualified name of the module to blame (as in ``named_modules()`` of the
            LightningModule), or ``None`` when no module is to blame (a bad batch, the loss
            computed outside any module, or nothing localised).
        direction: ``"forward"``, ``"backward"``, ``"loss"`` or ``"parameter"``; ``None`` when
            not localised.
        counts: ``{"nan": ..., "posinf": ..., "neginf": ...}`` in the offending tensor.
        producer: whether ``module`` made the values from finite ones (its inputs, or backward
            its output's gradient, were finite) rather than passed them on; ``None`` when no
            module is named.
        reproduced: whether the replay of the step saw non-finite values too (``None`` without a
            replay).
        message: one readable sentence: what, where, when, and the evidence path; for a
            non-finite event, then one sentence on what to do about it and one on how to
            load the evidence bundle.
        path: the offending tensor relative to ``module``: ``"output"``, ``"output.0"``,
            ``"output.logits"``, ``"input.x"`` (backward: the gradient sent to input ``x``),
            ``"weight"`` (a parameter or its gradient), or a submodule's input such as
            ``"conv2.input.input"`` when the code between submodules made it.
        dtype: the offending tensor's dtype, e.g. ``"torch.float32"``.
        shape: the offending tensor's shape.
        action: what the monitor did: ``"warned"``, ``"skipped"``, ``"raised"`` or ``None``.
        evidence: the directory of the evidence bundle, or ``None`` when none was written.
        parameters: the parameters whose gradient the always-on check found non-finite (at most
            the first 16), by their names in the LightningModule; a ``FeatureDistillation``
            connector's as ``"FeatureDistillation.connectors['<pair>'].<name>"``.
        details: anything more a rule wants to say (plain values). A non-finite event read
            lazily on a GPU after some gradients were freed or changed in place lists those
            parameters under ``"counted_at_least"``: each counts as one value, a lower bound.
            An event of the code between submodules names, under ``"submodule"``, the
            submodule whose input held the values (``"output"`` for ``"output.input.x"``), or
            backward whose output's gradient (``"input_layernorm"`` for
            ``"input_layernorm.output"``). A skipped step whose forward left non-finite values
            in floating-point buffers (BatchNorm's running statistics) names them under
            ``"nonfinite_buffers"``: a skip discards the update, not what the forward wrote.
            Under DDP, ``"ranks"`` lists the ranks whose own batch showed non-finite values
            (its own loss or a finding of its own, not only the all-reduced gradients); the
            message names those other than ``rank``.
            A skipped step noticed (a warning on rank zero) after skipped steps that were not,
            as skip notices are rate-limited, counts those under ``"skipped_since_notice"``.
            Evidence that could not be written (a full disk, a folder made read-only or
            removed) is named by its error, ``"OSError: [Errno 28] No space left on device"``:
            this rank's bundle under ``"evidence_error"`` (``evidence`` is then ``None``), the
            checkpoint before the update under ``"checkpoint_error"``.

    Examples:
        >>> event = HealthEvent("nonfinite", step=3, batch_idx=3, rank=0, module="net.2",
        ...                     direction="forward", counts={"nan": 4, "posinf": 0, "neginf": 0})
        >>> event.total, event.to_dict()["module"]
        (4, 'net.2')
    """

    kind: str
    step: int
    batch_idx: int | None
    rank: int = 0
    module: str | None = None
    direction: Direction | None = None
    counts: dict[str, int] = field(default_factory=_zero_counts)
    producer: bool | None = None
    reproduced: bool | None = None
    message: str = ""
    path: str | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    action: str | None = None
    evidence: str | None = None
    parameters: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """The number of non-finite values counted (NaN, +inf and -inf together)."""
        return sum(self.counts.get(key, 0) for key in COUNT_KEYS)

    def to_dict(self) -> dict[str, Any]:
        """The event as JSON-ready plain values."""
        out = dataclasses.asdict(self)
        out["shape"] = list(self.shape) if self.shape is not None else None
        out["parameters"] = list(self.parameters)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HealthEvent:
        """The event written by :meth:`to_dict` (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        if values.get("shape") is not None:
            values["shape"] = tuple(values["shape"])
        values["parameters"] = tuple(values.get("parameters") or ())
        return cls(**values)


def format_counts(counts: dict[str, int]) -> str:
    """``"3 NaN, 0 +inf, 1 -inf"``."""
    return (
        f"{counts.get('nan', 0)} NaN, {counts.get('posinf', 0)} +inf, "
        f"{counts.get('neginf', 0)} -inf"
    )


_ACTIONS = {
    "warned": "training goes on with this update",
    "skipped": "the update was skipped",
    "raised": "training stopped",
}


def _tensor(event: HealthEvent) -> str:
    parts = [format_counts(event.counts)]
    if event.details.get("counted_at_least"):  # gradients gone before a lazy read counted them
        parts.insert(0, "at least")
    if event.dtype is not None:
        shape = list(event.shape) if event.shape is not None else "?"
        parts.append(f"in a {event.dtype.removeprefix('torch.')} tensor of shape {shape}")
    if event.details.get("shard"):  # tensor parallelism: counted on the event's rank alone
        parts.append(f"(counted in this rank's shard, of shape {list(event.details['shard'])})")
    return " ".join(parts)


def _where(event: HealthEvent) -> str:
    """The finding, as the subject of the sentence."""
    module, path = event.module, event.path or ""
    if event.kind == "amp_skipped":
        return "The AMP grad scaler skipped a step whose gradients overflowed (not an alarm)"
    if event.kind != "nonfinite":
        return f"Rule {event.kind!r} fired" + (f" on `{module}`" if module else "")
    if event.direction == "parameter":
        return f"The parameter `{module}.{path}` was already non-finite before the forward"
    if module is None:
        if event.direction == "forward" and event.producer is False:
            where = f" (`{path}`)" if path else ""
            return f"The batch itself holds non-finite values{where}, before any module ran"
        if event.direction == "forward":
            return (
                f"Code of `training_step` outside any module made non-finite values "
                f"(first seen at `{path}`)"
            )
        if event.direction == "loss" and event.path == "loss":
            return "The loss computed outside any module was non-finite (the outputs were finite)"
        if event.direction == "backward":
            return (
                f"The backward of code outside any module made non-finite gradients "
                f"(first seen at `{path}`)"
            )
        return _unlocalised(event)
    own = "from finite inputs" if event.direction == "forward" else "from a finite output gradient"
    made = "made" if event.producer else "passed on"
    source = own if event.producer else "it received"
    if event.direction == "forward":
        # a submodule's input (the code between submodules), even of one named "output..."
        if path.startswith("output") and "submodule" not in event.details:
            return f"`{module}` {made} non-finite values in its forward {path} ({source})"
        return f"Code of `{module}` between its submodules {made} non-finite values at `{path}`"
    if path.startswith("input.") and "submodule" not in event.details:  # not `input_layernorm`
        what = f"the gradient of its {path.replace('input.', 'input `', 1)}`"
    elif path.startswith("output") or "." in path:
        what = f"the gradient of `{path}`"
    else:
        what = f"the gradient of its parameter `{path}`"
    return f"`{module}` {made} non-finite values in its backward, in {what} ({source})"


def _unlocalised(event: HealthEvent) -> str:
    """What the always-on check saw, when no module was named."""
    parts = ["the loss"] if event.direction == "loss" else []
    if event.parameters:
        parts.append(f"the gradients of {listing([f'`{p}`' for p in event.parameters], 3)}")
    what = " and ".join(parts) or "the loss or the gradients"
    sentence = f"{what[0].upper()}{what[1:]} were non-finite"
    if event.reproduced is False:
        error = event.details.get("replay_error")
        if error:  # the replay stopped with an exception: it could not have reproduced it
            return sentence + f" and the replay that looks for the module failed ({error})"
        return sentence + " but the replay did not reproduce it"
    return sentence + " (not localised)"


def _buffers(event: HealthEvent) -> str:
    """What a skipped step could not undo: the buffers its forward left non-finite."""
    names = event.details.get("nonfinite_buffers")
    if not names:
        return ""
    listed = listing([f"`{name}`" for name in names], 3)
    return (
        f", but its forward left non-finite values in the buffers {listed}, which "
        "evaluation reads: reset them (BatchNorm's `reset_running_stats()`) or load a checkpoint "
        "from before this step"
    )


_LOW_PRECISION = {
    "torch.float16": "float16 overflows above 65504",
    "torch.bfloat16": "bfloat16 rounds small values to 0 before a log or a division",
}
_EPS = "clamp them or add an eps"


def _forward_hint(event: HealthEvent) -> str:
    """What to look at when a module's forward (or the code between its submodules) made the
    values."""
    module, path = event.module, event.path or ""
    if event.dtype in _LOW_PRECISION:  # autocast ran it in half precision
        return (
            f"Run `{module}` in float32 (under `torch.autocast(..., enabled=False)`, its inputs "
            f"`.float()`): {_LOW_PRECISION[event.dtype]}."
        )
    if not event.producer:
        return f"Look at what feeds `{module}`: its {path} was non-finite already."
    if path.startswith("output") and "submodule" not in event.details:
        return (
            f"Look for a log, sqrt, division or exp of the inputs in the forward of `{module}` "
            f"and {_EPS} (`torch.log_softmax`, not the log of a softmax)."
        )
    return (
        f"Look for a log, sqrt, division or exp in the code of `{module}` that makes `{path}` "
        f"and {_EPS}."
    )


def _backward_hint(event: HealthEvent) -> str:
    """What to look at when a module's backward made the gradients (its forward was finite)."""
    module = event.module
    if event.dtype == "torch.float16":
        return (
            "Scale the loss so that float16 gradients do not overflow (`precision='16-mixed'` "
            "has a grad scaler), or train in `bf16-mixed`."
        )
    if not event.producer:
        return f"Look at the backward of what reads the output of `{module}`."
    return (
        f"The derivative of `{module}` is infinite where its forward is finite (a sqrt, pow or "
        "norm at 0, a log or division near 0): add an eps inside, e.g. `(x + 1e-12).sqrt()`."
    )


def next_step(event: HealthEvent) -> str:
    """One sentence: what to do about a non-finite event, by what it found ("" for another
    kind)."""
    if event.kind != "nonfinite":
        return ""
    if event.direction == "parameter":
        restore = ""
        if event.action == "skipped":  # the weight stays as it is: restore it first
            restore = " restore the weights from a checkpoint saved before this step, then"
        return (
            f"The optimizer step before (or the checkpoint loaded) made it:{restore} lower the "
            "learning rate, clip gradients (`Trainer(gradient_clip_val=1.0)`) or raise Adam's "
            "`eps`."
        )
    if event.module is not None:
        return _backward_hint(event) if event.direction == "backward" else _forward_hint(event)
    if event.direction == "forward" and event.producer is False:
        batch = f" of batch {event.batch_idx}" if event.batch_idx is not None else ""
        return (
            f"Check the data pipeline: find the samples{batch} whose `{event.path}` is not finite."
        )
    if event.direction == "forward":
        return f"Look for a log, sqrt, division or exp in `training_step` before `{event.path}`."
    if event.direction == "loss" and event.path == "loss":
        return (
            "Compute the loss from logits with its stable form (`F.cross_entropy`, "
            "`F.binary_cross_entropy_with_logits`), or clamp what it takes the log of or "
            "divides by."
        )
    if event.direction == "backward":
        return (
            f"Look for a sqrt, pow or norm at 0 in `training_step` before `{event.path}` (an "
            "infinite derivative) and add an eps inside."
        )
    if event.details.get("replay_error"):
        return "Fix what stopped the replay, or pass `localize='always'` to check the step itself."
    if event.reproduced is False:  # not deterministic: check the step itself
        return "Pass `localize='always'` to check every module on the step itself."
    return (
        "No module is named here: with `localize='replay'` (the default) or `'always'`, the "
        "first step of a run of non-finite steps names the one that made them."
    )


def describe(event: HealthEvent) -> str:
    """The event in one sentence: what, where (module, direction), when (step, batch, rank),
    how much, what was done and where the evidence is; for a non-finite event, one sentence
    on what to do, and one on how to read the evidence bundle."""
    when = f"at step {event.step}"
    if event.batch_idx is not None:
        when += f", batch {event.batch_idx}"
    when += f", rank {event.rank}"
    others = [r for r in event.details.get("ranks", ()) if r != event.rank]
    if others:  # under DDP, several ranks' batches showed non-finite values
        ranks = "ranks" if len(others) > 1 else "rank"
        when += f" (also on {ranks} {listing([str(r) for r in others])})"
    sentence = f"{_where(event)} {when}"
    if event.total or event.dtype is not None:
        sentence += f": {_tensor(event)}"
    tail = []
    if event.action in _ACTIONS:
        tail.append(_ACTIONS[event.action] + _buffers(event))
    if event.action == "skipped" and event.direction == "parameter":
        tail.append(
            "skipping will not recover from this, as the weight itself is non-finite: every "
            "later step will be skipped until `max_consecutive_skips` raises"
        )
    unnoticed = event.details.get("skipped_since_notice")
    if unnoticed:
        steps = "step" if unnoticed == 1 else "steps"
        tail.append(f"{unnoticed} {steps} skipped since the last notice (logged at DEBUG)")
    if event.evidence:
        tail.append(f"evidence in {event.evidence}")
    elif event.kind == "nonfinite":
        error = event.details.get("evidence_error")
        could_not = f": the bundle could not be written ({error})" if error else ""
        tail.append(f"no evidence written{could_not}")
    if event.details.get("checkpoint_error"):
        tail.append(
            "the checkpoint before the update could not be written "
            f"({event.details['checkpoint_error']})"
        )
    sentence += ("; " + "; ".join(tail) if tail else "") + "."
    hint = next_step(event)
    if hint:
        sentence += f" {hint}"
    if event.evidence and event.kind == "nonfinite":
        tensors = os.path.join(event.evidence, "tensors.safetensors")
        sentence += (
            f" Read the bundle with `safetensors.torch.load_file({tensors!r})` and its "
            "`event.json`."
        )
    return sentence
