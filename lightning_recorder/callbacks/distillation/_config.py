"""Argument checks and small helpers of :class:`~lightning_recorder.FeatureDistillation`."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..._core.checks import suggestion
from ..._core.names import is_glob
from ..._core.structures import parse_path
from ...distill.losses import (
    AttentionTransferLoss,
    KLDivLoss,
    LossFn,
    attention_transfer_loss,
    get_loss,
    kl_div_loss,
)
from ...errors import RecorderConfigError

LossSpec: TypeAlias = str | nn.Module | Callable[[Tensor, Tensor], Tensor]
"""A loss name (``"mse"``, ``"l1"``, ``"cosine"``, ``"attention"``, ``"kl"``), the import path of
a loss class or function, a module or a callable taking ``(student, teacher)``."""

TeacherSide: TypeAlias = str | Mapping[str, Any]
"""A pair's teacher side: a module name, or ``{"source": module name, "path": path}`` for one
tensor of a structured output."""


def per_pair(
    value: Any, pairs: Mapping[str, TeacherSide], what: str, default: Any
) -> dict[str, Any]:
    """Expand a single value, or a mapping keyed by (some) student module names, to every pair."""
    if not isinstance(value, Mapping):
        return dict.fromkeys(pairs, value)
    unknown = [k for k in value if k not in pairs]
    if unknown:
        raise RecorderConfigError(
            f"Expected the keys of `{what}` to be student module names from `pairs` but got "
            f"{unknown[0]!r}. {suggestion(str(unknown[0]), pairs, 'pairs')}"
        )
    missing = [p for p in pairs if p not in value]
    if missing and default is None:
        raise RecorderConfigError(
            f"Expected `{what}` to give a value for every pair but {', '.join(map(repr, missing))} "
            "has none."
        )
    return {p: value.get(p, default) for p in pairs}


def check_teacher_side(s_name: object, value: Mapping[Any, Any]) -> None:
    """A pair's teacher side given as ``{"source": name, "path": path}``: only those keys."""
    for key in value:
        if key not in ("source", "path"):
            raise RecorderConfigError(
                f"Expected the keys of the teacher side of pair {s_name!r} in `pairs` to be "
                f"'source' and 'path' but got {key!r}. "
                f"{suggestion(str(key), ['source', 'path'], 'keys')}"
            )
    if "source" not in value:
        raise RecorderConfigError(
            f"Expected the teacher side of pair {s_name!r} in `pairs` to have a 'source' key "
            f"(a teacher module name) but got {dict(value)!r}."
        )
    parse_path(value.get("path"))


def teacher_config(value: TeacherSide) -> dict[str, Any]:
    """The recorder options of a pair's (checked) teacher side: its source, and its path."""
    if isinstance(value, Mapping):
        path = value.get("path")
        return {"source": value["source"]} if path is None else {**value}
    return {"source": value}


def teacher_label(value: TeacherSide) -> str:
    """A pair's teacher side in messages: the module name, then ``/`` and the dotted path."""
    if isinstance(value, Mapping):
        parsed = parse_path(value.get("path"))
        name = str(value["source"])
        return name if parsed is None else f"{name}/{'.'.join(str(k) for k in parsed)}"
    return value


def feature(record: Any, side: str, name: str) -> Tensor:
    """The tensor of a pair's record: the record, or the first item of a tuple or of a Hugging
    Face ``ModelOutput`` (which indexes as a tuple of its set fields)."""
    to_tuple = getattr(type(record), "to_tuple", None)
    if isinstance(record, Mapping) and callable(to_tuple):
        record = to_tuple(record)  # a ModelOutput: ``output[0]``, e.g. last_hidden_state
    if isinstance(record, (tuple, list)) and record and isinstance(record[0], Tensor):
        record = record[0]
    if not isinstance(record, Tensor):
        got = type(record).__name__
        if isinstance(record, (tuple, list)) and record:  # an LSTM's (PackedSequence, (h, c))
            got = f"a {got} whose first item is a {type(record[0]).__name__}"
        fix = (
            "give the teacher side a path: {'source': name, 'path': ...}"
            if side == "teacher"
            else "pair a submodule of the student that returns a tensor (the student side "
            "takes no path)"
        )
        raise RecorderConfigError(
            f"Expected the output of {side} module {name!r} to be a tensor (or a tuple or "
            f"ModelOutput whose first item is one) but got {got}; {fix}."
        )
    if record.is_nested:
        raise RecorderConfigError(
            f"Expected the output of {side} module {name!r} to be a dense tensor but got a nested "
            "tensor of ragged rows, which has no shape to compare: torch's TransformerEncoder "
            "returns those in evaluation (the teacher always runs in eval mode) when it is given "
            "a padding mask (its fast path). Build that encoder with enable_nested_tensor=False "
            "(its outputs then keep the padded positions, as the student's do in training), or "
            "turn the fast path off with torch.backends.mha.set_fastpath_enabled(False)."
        )
    return record


def add_term(output: Any, term: Tensor) -> Any:
    if isinstance(output, Tensor):
        return output + term
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": output["loss"] + term}
    raise RecorderConfigError(
        "Expected `training_step` to return a loss tensor or a dict with a 'loss' tensor, so the "
        f"distillation term can be added to it, but got {type(output).__name__}. Pass "
        "`add_to_loss=False` and add `distillation_loss(self)` to your loss instead."
    )


def with_tied_names(teacher: nn.Module, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` with the names it lacks of tied tensors that it holds under another of their
    names: Hugging Face's ``save_pretrained`` writes a tied weight (``lm_head.weight``, which is
    ``transformer.wte.weight``) once, and a strict load would miss its second name."""
    own = teacher.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for name, tensor in own.items():
        names.setdefault(id(tensor), []).append(name)
    found = dict(state)
    for name, tensor in own.items():
        if name not in found:
            other = next((n for n in names[id(tensor)] if n in state), None)
            if other is not None:
                found[name] = state[other]
    return found


def load_teacher(teacher: nn.Module, path: str | os.PathLike[str]) -> None:
    """Load the teacher's weights from a state dict (or a Lightning checkpoint) saved at ``path``.

    Only tensors and plain containers are loaded (``weights_only=True``); whatever else fails is
    reported as a package error without torch's advice to load the file unsafely.
    """
    where = f"Expected `teacher_checkpoint` {os.fspath(path)!r} to hold the teacher's weights"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        raise RecorderConfigError(f"{where} but it could not be opened: {err}") from None
    except Exception as err:  # unreadable, or unsafe to unpickle: one message
        raise RecorderConfigError(
            f"{where} (a state dict of tensors, or a Lightning checkpoint of the teacher) but it "
            f"could not be read as one ({type(err).__name__}). Only tensors and plain containers "
            "are loaded; save the teacher's state_dict() rather than the module."
        ) from None
    if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise RecorderConfigError(
            f"{where} (a state dict, or a Lightning checkpoint of the teacher) but it holds a "
            f"{type(state).__name__}."
        )
    try:
        teacher.load_state_dict(with_tied_names(teacher, state))
    except (RuntimeError, TypeError, ValueError, AttributeError) as err:
        raise RecorderConfigError(
            f"{where} (a state dict, or a Lightning checkpoint of the teacher) but loading "
            f"failed: {err}"
        ) from err


def check_arguments(
    teacher: object,
    pairs: object,
    flags: Mapping[str, object],
    teacher_input: object,
    optimizer_idx: object,
    connector_lr: object,
    log_prefix: object,
    teacher_checkpoint: object = None,
    loss_options: object = None,
) -> None:
    """Raise a :class:`RecorderConfigError` for the first invalid constructor argument."""
    if not isinstance(teacher, nn.Module):
        raise RecorderConfigError(
            f"Expected `teacher` to be an nn.Module but got {type(teacher).__name__}."
        )
    if not isinstance(pairs, Mapping) or not pairs:
        raise RecorderConfigError(
            "Expected `pairs` to be a non-empty mapping {student module name: teacher module "
            f"name}} but got {pairs!r}."
        )
    for s_name, t_value in pairs.items():
        if isinstance(t_value, Mapping):
            check_teacher_side(s_name, t_value)
        t_name = t_value["source"] if isinstance(t_value, Mapping) else t_value
        if not (isinstance(s_name, str) and s_name and isinstance(t_name, str) and t_name):
            raise RecorderConfigError(
                "Expected `pairs` to map non-empty module names to module names but got "
                f"{s_name!r}: {t_value!r} (the root module itself cannot be paired; a teacher "
                "side may also be {'source': teacher module name, 'path': path})."
            )
    for s_name, t_value in pairs.items():
        t_name = t_value["source"] if isinstance(t_value, Mapping) else t_value
        for side, name in (("student", s_name), ("teacher", t_name)):
            if is_glob(name) or name.startswith("re:"):
                raise RecorderConfigError(
                    f"Expected `pairs` to name one {side} module each but got the pattern "
                    f"{name!r} (in {s_name!r}: {t_name!r}): a pair matches one feature to one "
                    "feature; give each pair an exact module name."
                )
    if "total" in pairs:
        raise RecorderConfigError(
            "Expected no student module named 'total' in `pairs`: its logged name would "
            "collide with the logged total; pair a module inside it instead."
        )
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise RecorderConfigError(f"Expected `{name}` to be a bool but got {flag!r}.")
    if teacher_input is not None and not callable(teacher_input):
        raise RecorderConfigError(
            f"Expected `teacher_input` to be a callable batch -> input but got {teacher_input!r}."
        )
    if not isinstance(optimizer_idx, int) or isinstance(optimizer_idx, bool) or optimizer_idx < 0:
        raise RecorderConfigError(
            f"Expected `optimizer_idx` to be a non-negative int but got {optimizer_idx!r}."
        )
    if connector_lr is not None and (
        isinstance(connector_lr, bool)
        or not isinstance(connector_lr, (int, float))
        or not math.isfinite(connector_lr)
        or connector_lr < 0
    ):
        raise RecorderConfigError(
            "Expected `connector_lr` to be a finite non-negative number or None but got "
            f"{connector_lr!r}."
        )
    if teacher_checkpoint is not None and not isinstance(teacher_checkpoint, (str, os.PathLike)):
        raise RecorderConfigError(
            "Expected `teacher_checkpoint` to be a path (str or os.PathLike) to the teacher's "
            f"state dict, or None, but got {type(teacher_checkpoint).__name__} "
            f"{teacher_checkpoint!r}."
        )
    if loss_options is not None and not isinstance(loss_options, Mapping):
        raise RecorderConfigError(
            "Expected `loss_options` to be a mapping of keyword options such as "
            "{'temperature': 4.0} (or one such mapping per pair) or None, but got "
            f"{type(loss_options).__name__} {loss_options!r}."
        )
    if not isinstance(log_prefix, str) or not log_prefix:
        raise RecorderConfigError(
            f"Expected `log_prefix` to be a non-empty str but got {log_prefix!r}."
        )


def weights_per_pair(weight: object, pairs: Mapping[str, TeacherSide]) -> dict[str, float]:
    """One non-negative float weight per pair."""
    weights: dict[str, float] = {}
    for pair, value in per_pair(weight, pairs, "weight", None).items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise RecorderConfigError(
                f"Expected `weight` of pair {pair!r} to be a finite non-negative number but got "
                f"{value!r}."
            )
        weights[pair] = float(value)
    return weights


def losses_per_pair(
    loss: object, options: Mapping[str, Any] | None, pairs: Mapping[str, TeacherSide]
) -> dict[str, LossFn]:
    """One loss callable per pair.

    ``options`` are keyword options for the *named* losses (and loss classes): either one mapping
    for all of them (``{"temperature": 4.0}``), or one per pair (``{"head": {"temperature":
    4.0}}``). Modules and callables are used as they are; one mapping when no pair's loss is
    named (options that would configure nothing) is an error.
    """
    specs = per_pair(loss, pairs, "loss", None)
    options = dict(options or {})
    if options and all(k in pairs and isinstance(v, Mapping) for k, v in options.items()):
        per = {p: dict(options.get(p, {})) for p in pairs}
    else:
        per = {p: options if isinstance(specs[p], (str, type)) else {} for p in pairs}
        if options and not any(per.values()):  # options no loss takes: an error, not a no-op
            raise RecorderConfigError(
                "Expected `loss_options` for a loss given by its name or class, but the loss of "
                "every pair is a module or a callable, used as it is, so "
                f"{', '.join(map(repr, sorted(options)))} would configure nothing. Configure "
                "the module itself (`KLDivLoss(temperature=4.0)`), or give the options per pair "
                "(`{pair: {option: value}}`) to bind them to a function."
            )
    return {p: get_loss(specs[p], **per[p]) for p in pairs}


def connector_role(
    loss: LossFn,
) -> tuple[Literal["attention", "logits", "cross_entropy"], int | None] | None:
    """What a pair's loss asks of its automatic connector, for the package's losses (as a name,
    a module or a function, options bound or not) and torch's own losses between two
    distributions: ``("attention", None)`` for attention transfer, which compares maps position
    by position whatever their channel counts, so needs no learned connector; ``("logits",
    dim)`` for the KL divergence on logits (also torch's ``nn.KLDivLoss`` and ``F.kl_div``,
    elementwise, whose classes are taken on the package's channel dim), and
    ``("cross_entropy", 1)`` for torch's ``nn.CrossEntropyLoss`` and ``F.cross_entropy`` with
    soft targets (classes on dim 1, as torch takes them), whose classes (on ``dim``, ``None``:
    the default one) must be the same on both sides; ``None`` for any other loss."""
    fn: Any = loss
    options: dict[str, Any] = {}
    while isinstance(fn, functools.partial):
        options = {**fn.keywords, **options}
        fn = fn.func
    if isinstance(fn, AttentionTransferLoss) or fn is attention_transfer_loss:
        return "attention", None
    if isinstance(fn, KLDivLoss):
        return "logits", fn.dim
    if fn is kl_div_loss:
        return "logits", options.get("dim")
    if isinstance(fn, nn.KLDivLoss) or fn is F.kl_div:
        return "logits", None
    if isinstance(fn, nn.CrossEntropyLoss) or fn is F.cross_entropy:
        return "cross_entropy", 1
    return None
