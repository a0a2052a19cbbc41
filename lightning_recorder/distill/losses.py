"""Distillation losses between student and teacher features: functions and modules.

Every loss takes ``(student, teacher)`` and returns a scalar. The teacher side is a target: it is
detached inside the loss, so no gradient ever reaches the teacher. Features of two dtypes are
compared in the promoted one, and float16 and bfloat16 features (mixed or half precision) in
float32, also under autocast: the loss is a ``float32`` scalar then. Integer and bool features
(an argmax, a mask) are refused with a :class:`~lightning_recorder.errors.RecorderConfigError`,
and so are complex features by the losses that have no complex form (``mse_loss``,
``cosine_loss``, ``kl_div_loss``; ``l1_loss`` and ``attention_transfer_loss`` compare magnitudes)
and features on two devices (a teacher left on the CPU).
Each loss exists twice, as a function (``mse_loss``) and as an :class:`torch.nn.Module` that
calls it (``MSELoss``), and :func:`get_loss` turns a short name, a module or a callable into a
loss. Features without a sample (a batch dim of size 0: an empty batch) give every loss ``0``,
with a zero gradient, where a mean over nothing would be NaN.

Which dimension holds the channels (or classes) depends on the rank of the features:

| features           | layout           | channel dim  |
|--------------------|------------------|--------------|
| 2-D                | ``(N, C)``       | 1            |
| 3-D (tokens)       | ``(N, L, C)``    | 2 (the last) |
| 4-D (feature maps) | ``(N, C, H, W)`` | 1            |

:func:`cosine_loss` and :func:`kl_div_loss` take ``dim`` to override this.

Examples:
    >>> import torch
    >>> from lightning_recorder import get_loss
    >>> student = torch.randn(4, 10, requires_grad=True)
    >>> teacher = torch.randn(4, 10)
    >>> loss = get_loss("kl", temperature=4.0)
    >>> value = loss(student, teacher)
    >>> value.backward()
    >>> student.grad.shape
    torch.Size([4, 10])
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, Literal, TypeAlias, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._core.checks import check_option, check_tensor, suggestion
from .._core.names import import_object
from .._core.registry import Registry
from ..errors import RecorderConfigError

__all__ = [
    "AttentionTransferLoss",
    "CosineLoss",
    "KLDivLoss",
    "L1Loss",
    "LossFn",
    "LossName",
    "MSELoss",
    "attention_transfer_loss",
    "cosine_loss",
    "get_loss",
    "kl_div_loss",
    "l1_loss",
    "mse_loss",
]

LossFn: TypeAlias = Callable[[Tensor, Tensor], Tensor]
"""A distillation loss: ``loss(student, teacher) -> scalar tensor``."""

LossName: TypeAlias = Literal["mse", "l1", "cosine", "attention", "kl"]
"""The short names accepted by :func:`get_loss` (aliases are accepted too)."""

_CONNECTOR_HINT = (
    "Map the student features to the teacher's shape with a connector "
    "(`lightning_recorder.build_connector`)."
)


# --------------------------------------------------------------------------- helpers


def _shape(x: Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


# Features of these dtypes are compared in float32: a softmax, a norm or a cosine in half
# precision loses the small differences a distillation loss is made of (a KL divergence of
# bfloat16 logits came out negative), and CPU autocast leaves those ops in half precision.
_HALF = (torch.float16, torch.bfloat16)


def _prepare(
    student: object, teacher: object, real_only: str | None = None
) -> tuple[Tensor, Tensor]:
    """Check both are floating-point tensors (real ones for the loss ``real_only`` names, which
    has no complex form) on one device, detach the teacher, bring both to one dtype (float32
    for float16 and bfloat16 features)."""
    student = check_tensor(student, "student")
    teacher = check_tensor(teacher, "teacher").detach()
    for name, x in (("student", student), ("teacher", teacher)):
        if not (x.is_floating_point() or x.is_complex()):
            raise RecorderConfigError(
                f"Expected the {name} features to have a floating-point dtype but got "
                f"{x.dtype}: an integer or bool output (an argmax, a mask) has no gradient and "
                "no distance to learn from. Pair modules whose outputs are features or logits."
            )
        if real_only and x.is_complex():
            raise RecorderConfigError(
                f"Expected real {name} features for {real_only} but got {x.dtype}: it has no "
                "complex form. Compare their real and imaginary parts (`torch.view_as_real(x)`) "
                "or their magnitude (`x.abs()`), or use l1_loss."
            )
    if student.device != teacher.device:
        raise RecorderConfigError(
            f"Expected the student and teacher features on one device but got student on "
            f"{student.device} and teacher on {teacher.device}; move the teacher model to the "
            "student's device, or its features with `teacher.to(student.device)`."
        )
    dtype = torch.promote_types(student.dtype, teacher.dtype)
    if dtype in _HALF:
        dtype = torch.float32
    if student.dtype != dtype:
        student = student.to(dtype)
    if teacher.dtype != dtype:
        teacher = teacher.to(dtype)
    return student, teacher


def _same_shape(student: Tensor, teacher: Tensor, hint: str = _CONNECTOR_HINT) -> None:
    if student.shape != teacher.shape:
        raise RecorderConfigError(
            "Expected the student and teacher features to have the same shape but got student "
            f"{_shape(student)} and teacher {_shape(teacher)}. {hint}"
        )


def _check_dim(dim: object) -> None:
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise RecorderConfigError(
            f"Expected `dim` to be an int or None but got {type(dim).__name__} {dim!r}."
        )


def default_channel_dim(ndim: int) -> int:
    """The channel (class) dim of features of ``ndim`` dims (2 or more): 1 for (N, C) and
    (N, C, H, W), the last for tokens (N, L, C)."""
    return 2 if ndim == 3 else 1


def _channel_dim(x: Tensor, dim: int | None, loss: str) -> int:
    """The channel (class) dim: :func:`default_channel_dim`, or ``dim`` checked."""
    if x.ndim < 2:
        raise RecorderConfigError(
            f"Expected {loss} features with a batch dim and a channel dim (2-D or more) but got "
            f"shape {_shape(x)}."
        )
    if dim is None:
        return default_channel_dim(x.ndim)
    _check_dim(dim)
    if not -x.ndim <= dim < x.ndim:
        raise RecorderConfigError(
            f"Expected `dim` to be in [{-x.ndim}, {x.ndim - 1}] for features of shape "
            f"{_shape(x)} but got {dim}."
        )
    return dim % x.ndim


def no_samples(features: Tensor) -> bool:
    """Whether ``features`` hold no sample: a batch dim of size 0."""
    return features.ndim > 0 and features.shape[0] == 0


def zero_loss(student: Tensor) -> Tensor:
    """The loss of a batch without samples: 0 with a zero gradient, where a mean over nothing
    is NaN (one empty batch would make the student's loss NaN and poison its weights); real,
    and float32 for half-precision features, as the losses give."""
    if student.is_complex():
        student = student.abs()
    if student.dtype in (torch.float16, torch.bfloat16):
        student = student.float()
    return student.sum()


def _check_positive(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise RecorderConfigError(f"Expected `{name}` to be a positive number but got {value!r}.")
    return float(value)


# --------------------------------------------------------------------------- functional


def mse_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """Mean squared error between student and teacher features (FitNets feature matching).

    Args:
        student: student features of any shape.
        teacher: teacher features of the same shape (detached inside).

    Returns:
        The mean of ``(student - teacher) ** 2`` over every element.

    Raises:
        RecorderConfigError: the shapes differ (the message names both) or an input is not a
            floating-point tensor.

    Examples:
        >>> import torch
        >>> float(mse_loss(torch.zeros(2, 3), torch.full((2, 3), 2.0)))
        4.0
    """
    student, teacher = _prepare(student, teacher, "mse_loss")
    _same_shape(student, teacher)
    if no_samples(student):
        return zero_loss(student)
    return F.mse_loss(student, teacher)


def l1_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """Mean absolute error between student and teacher features.

    Args:
        student: student features of any shape.
        teacher: teacher features of the same shape (detached inside).

    Returns:
        The mean of ``|student - teacher|`` over every element.

    Raises:
        RecorderConfigError: the shapes differ (the message names both) or an input is not a
            floating-point tensor.

    Examples:
        >>> import torch
        >>> float(l1_loss(torch.zeros(2, 3), torch.full((2, 3), -2.0)))
        2.0
    """
    student, teacher = _prepare(student, teacher)
    _same_shape(student, teacher)
    if no_samples(student):
        return zero_loss(student)
    return F.l1_loss(student, teacher)


def cosine_loss(student: Tensor, teacher: Tensor, dim: int | None = None) -> Tensor:
    """One minus the cosine similarity over the channel dim, averaged over every other position.

    For ``(N, C)`` that is one similarity per sample, for ``(N, C, H, W)`` one per pixel, for
    ``(N, L, C)`` one per token. The result lies in ``[0, 2]`` and ignores the features' scale.

    Args:
        student: student features, 2-D or more.
        teacher: teacher features of the same shape (detached inside).
        dim: the dim holding the channels; by default 1, or the last dim for 3-D features.

    Returns:
        ``mean(1 - cos(student, teacher))``.

    Raises:
        RecorderConfigError: the shapes differ, the features are 1-D or have one channel (the
            cosine of two numbers is -1 or 1, with no gradient), or ``dim`` is out of range.

    Examples:
        >>> import torch
        >>> s = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
        >>> t = torch.tensor([[0.0, 3.0], [2.0, 2.0]])
        >>> float(cosine_loss(s, t))  # orthogonal (1) and parallel (0) rows
        0.5
    """
    student, teacher = _prepare(student, teacher, "cosine_loss")
    _same_shape(student, teacher)
    d = _channel_dim(student, dim, "cosine_loss")
    if student.shape[d] < 2:  # the cosine of two numbers is their signs' agreement
        raise RecorderConfigError(
            f"Expected cosine_loss features with at least 2 channels on dim {d} but got shape "
            f"{_shape(student)}: the cosine of two numbers is -1 or 1, so the loss would be 0 or "
            "2 with no gradient and train nothing. Compare one channel with mse_loss or "
            "l1_loss, or pass `dim` to name the channel dim."
        )
    if no_samples(student):
        return zero_loss(student)
    return (1.0 - F.cosine_similarity(student, teacher, dim=d)).mean()


def _attention_map(x: Tensor, p: float) -> Tensor:
    """``mean_c |x|^p`` flattened per sample and L2-normalised: (N, positions)."""
    c = default_channel_dim(x.ndim)
    magnitude = x.abs()
    if p < 1:
        # |x|^p has an infinite slope at 0 for p < 1, which made the gradient of every zero
        # feature (a ReLU's) NaN: a zero feature gets a zero gradient, as |x| has at 0
        nonzero = magnitude != 0  # a NaN feature stays NaN
        powered = torch.where(nonzero, torch.where(nonzero, magnitude, 1.0).pow(p), 0.0)
    else:
        powered = magnitude.pow(p)
    return F.normalize(powered.mean(dim=c).flatten(1), dim=1)


def attention_transfer_loss(
    student: Tensor,
    teacher: Tensor,
    p: float = 2.0,
    distance: Literal["mse", "l2"] = "mse",
) -> Tensor:
    """Attention transfer (Zagoruyko & Komodakis, 2017) between two feature maps.

    The attention map of features ``f`` is ``mean over channels of |f| ** p``, flattened per
    sample and divided by its L2 norm. Only the positions must match: the student and the
    teacher may have different channel counts, so no connector is needed; with
    :class:`~lightning_recorder.FeatureDistillation`, ``connectors="auto"`` gives a pair of this
    loss none (an identity, or with ``resize=True`` a bilinear resize of the student map to the
    teacher's ``(H, W)``), no learned parameters.

    Args:
        student: student features ``(N, C_s, H, W)`` or tokens ``(N, L, C_s)``.
        teacher: teacher features ``(N, C_t, H, W)`` or ``(N, L, C_t)`` (detached inside).
        p: the exponent applied to ``|f|`` (2 in the paper). For ``p < 1``, whose slope is
            infinite at 0, a zero feature (a ReLU's) gets a zero gradient.
        distance: ``"mse"`` averages the squared differences of the maps over samples and
            positions (the authors' code); ``"l2"`` averages the per-sample L2 norm of the
            difference (the paper's formula).

    Returns:
        The distance between the normalised attention maps.

    Raises:
        RecorderConfigError: the features are not 3-D or 4-D-or-more, the ranks, batch sizes or
            spatial sizes differ (the message names both shapes), a sample has one position
            (pooled ``(N, C, 1, 1)`` maps, one token: its normalised map is 1), ``p`` is not
            positive, or ``distance`` is unknown.

    Examples:
        >>> import torch
        >>> s = torch.tensor([[[[1.0, 1.0]]]])  # (1, 1, 1, 2): map [1, 1] / sqrt(2)
        >>> t = torch.tensor([[[[1.0, 0.0]], [[1.0, 0.0]]]])  # (1, 2, 1, 2): map [1, 0]
        >>> round(float(attention_transfer_loss(s, t)), 4)  # (2 - sqrt(2)) / 2
        0.2929
    """
    p = _check_positive("p", p)
    check_option("distance", distance, ("mse", "l2"))
    student, teacher = _prepare(student, teacher)
    if student.ndim < 3 or student.ndim != teacher.ndim:
        raise RecorderConfigError(
            "Expected attention transfer features of the same rank, (N, C, H, W) or tokens "
            f"(N, L, C), but got student {_shape(student)} and teacher {_shape(teacher)}."
        )
    # Positions are (N, L) for tokens and (N, H, W, ...) for maps; channels may differ.
    if student.ndim == 3:
        s_key, t_key = student.shape[:2], teacher.shape[:2]
    else:
        s_key = student.shape[:1] + student.shape[2:]
        t_key = teacher.shape[:1] + teacher.shape[2:]
    if s_key != t_key:
        raise RecorderConfigError(
            "Expected the student and teacher features to have the same batch and spatial size "
            f"but got student {_shape(student)} and teacher {_shape(teacher)}. Attention "
            "transfer compares maps position by position: pair layers of the same resolution "
            "or resize one of them (torch.nn.functional.interpolate)."
        )
    positions = math.prod(s_key[1:])
    if positions < 2:  # one position's normalised map is 1: nothing to compare or learn
        raise RecorderConfigError(
            "Expected attention transfer features with at least 2 positions per sample but got "
            f"student {_shape(student)} and teacher {_shape(teacher)}: the attention map of one "
            "position is 1 once normalised, so the loss would be 0 with no gradient and train "
            "nothing. Pair layers with a spatial size (or several tokens) rather than pooled "
            "features, or compare pooled features with mse_loss or cosine_loss."
        )
    if no_samples(student):
        return zero_loss(student)
    diff = _attention_map(student, p) - _attention_map(teacher, p)
    if distance == "mse":
        return diff.pow(2).mean()
    return diff.norm(dim=1).mean()


def kl_div_loss(
    student: Tensor, teacher: Tensor, temperature: float = 1.0, dim: int | None = None
) -> Tensor:
    """Hinton's distillation loss on logits: ``KL(softmax(t/T) || softmax(s/T)) * T**2``.

    The KL divergence is summed over the classes and averaged over every distribution: the rows
    of ``(N, C)`` logits (``reduction="batchmean"``), every token of ``(N, L, C)`` logits, every
    pixel of ``(N, C, H, W)`` logits. Multiplying by ``T**2`` keeps the gradients' scale
    independent of the temperature. Unlike :class:`torch.nn.KLDivLoss`, both inputs are raw
    logits. A class the teacher gives no probability (a logit of ``-inf``: a masked vocabulary)
    adds nothing (``0 * log 0 = 0``), also where the student masks it too.

    Student and teacher must give logits over the same classes: with
    :class:`~lightning_recorder.FeatureDistillation`, ``connectors="auto"`` builds no projection
    between different class counts (the first step raises a
    :class:`~lightning_recorder.errors.RecorderConfigError`); give the pair a connector of its
    own when the mapping is deliberate.

    Args:
        student: student logits, 2-D or more.
        teacher: teacher logits of the same shape (detached inside).
        temperature: the softmax temperature ``T`` (> 0).
        dim: the class dim; by default 1, or the last dim for 3-D logits.

    Returns:
        The temperature-scaled KL divergence.

    Raises:
        RecorderConfigError: the shapes differ, the logits are 1-D or have fewer than 2 classes
            (one logit per sample: give the two classes' logits, ``[0, x]``, whose softmax is
            ``1 - sigmoid(x), sigmoid(x)``), ``dim`` is out of range or ``temperature`` is not
            positive.

    Examples:
        >>> import torch
        >>> logits = torch.tensor([[2.0, 0.5, -1.0]])
        >>> float(kl_div_loss(logits, logits, temperature=4.0))
        0.0
        >>> float(kl_div_loss(torch.zeros(1, 2), torch.tensor([[0.0, 100.0]])))  # KL = log 2
        0.6931471824645996
    """
    t_ = _check_positive("temperature", temperature)
    student, teacher = _prepare(student, teacher, "kl_div_loss")
    _same_shape(student, teacher, "Both must be logits over the same classes.")
    d = _channel_dim(student, dim, "kl_div_loss")
    classes = student.shape[d]
    if classes < 2:  # a softmax over one class is 1: the loss would be 0, with no gradient
        raise RecorderConfigError(
            f"Expected kl_div_loss logits with at least 2 classes on dim {d} but got shape "
            f"{_shape(student)}: a softmax over one class is 1 whatever the logit, so the loss "
            "would be 0 and train nothing. For one logit per sample (a binary classifier), give "
            f"both classes' logits, `torch.cat([torch.zeros_like(x), x], dim={d})` (their "
            "softmax is 1 - sigmoid(x), sigmoid(x)), or pass `dim` to name the class dim."
        )
    if no_samples(student):
        return zero_loss(student)
    log_s = F.log_softmax(student.movedim(d, -1).reshape(-1, classes) / t_, dim=-1)
    log_t = F.log_softmax(teacher.movedim(d, -1).reshape(-1, classes) / t_, dim=-1)
    # sum p_t * (log p_t - log p_s), with 0 * log 0 = 0: a class the teacher gives no
    # probability (a logit of -inf, a masked vocabulary) adds nothing, where F.kl_div made the
    # whole loss NaN; a NaN logit still gives NaN
    p_t = log_t.exp()
    terms = torch.where(p_t == 0, 0.0, p_t * (log_t - log_s))
    return terms.sum() / log_s.shape[0] * (t_ * t_)


# --------------------------------------------------------------------------- modules


class MSELoss(nn.Module):
    """Module form of :func:`mse_loss`.

    Examples:
        >>> import torch
        >>> float(MSELoss()(torch.zeros(2, 3), torch.ones(2, 3)))
        1.0
    """

    def __init__(self) -> None:  # explicit: the loss takes no options
        super().__init__()

    def forward(self, student: Tensor, teacher: Tensor) -> Tensor:
        """Return :func:`mse_loss` of ``student`` and ``teacher``."""
        return mse_loss(student, teacher)


class L1Loss(nn.Module):
    """Module form of :func:`l1_loss`.

    Examples:
        >>> import torch
        >>> float(L1Loss()(torch.zeros(2, 3), torch.ones(2, 3)))
        1.0
    """

    def __init__(self) -> None:  # explicit: the loss takes no options
        super().__init__()

    def forward(self, student: Tensor, teacher: Tensor) -> Tensor:
        """Return :func:`l1_loss` of ``student`` and ``teacher``."""
        return l1_loss(student, teacher)


class CosineLoss(nn.Module):
    """Module form of :func:`cosine_loss`.

    Args:
        dim: the channel dim; by default 1, or the last dim for 3-D features.

    Examples:
        >>> import torch
        >>> round(float(CosineLoss()(torch.ones(2, 3), torch.full((2, 3), 5.0))), 6)
        0.0
    """

    def __init__(self, dim: int | None = None) -> None:
        _check_dim(dim)
        super().__init__()
        self.dim = dim

    def forward(self, student: Tensor, teacher: Tensor) -> Tensor:
        """Return :func:`cosine_loss` of ``student`` and ``teacher``."""
        return cosine_loss(student, teacher, dim=self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class AttentionTransferLoss(nn.Module):
    """Module form of :func:`attention_transfer_loss`.

    Args:
        p: the exponent applied to ``|f|`` before averaging over channels (> 0).
        distance: ``"mse"`` (the authors' code) or ``"l2"`` (the paper's formula).

    Raises:
        RecorderConfigError: ``p`` is not positive or ``distance`` is unknown.

    Examples:
        >>> import torch
        >>> loss = AttentionTransferLoss(p=2.0)
        >>> s, t = torch.randn(2, 8, 4, 4), torch.randn(2, 32, 4, 4)  # channels may differ
        >>> loss(s, t).shape
        torch.Size([])
    """

    def __init__(self, p: float = 2.0, distance: Literal["mse", "l2"] = "mse") -> None:
        super().__init__()
        self.p = _check_positive("p", p)
        check_option("distance", distance, ("mse", "l2"))
        self.distance: Literal["mse", "l2"] = distance

    def forward(self, student: Tensor, teacher: Tensor) -> Tensor:
        """Return :func:`attention_transfer_loss` of ``student`` and ``teacher``."""
        return attention_transfer_loss(student, teacher, p=self.p, distance=self.distance)

    def extra_repr(self) -> str:
        return f"p={self.p}, distance={self.distance!r}"


class KLDivLoss(nn.Module):
    """Module form of :func:`kl_div_loss` (raw logits in, unlike :class:`torch.nn.KLDivLoss`).

    Args:
        temperature: the softmax temperature ``T`` (> 0); the loss is multiplied by ``T**2``.
        dim: the class dim; by default 1, or the last dim for 3-D logits.

    Raises:
        RecorderConfigError: ``temperature`` is not positive.

    Examples:
        >>> import torch
        >>> loss = KLDivLoss(temperature=2.0)
        >>> loss
        KLDivLoss(temperature=2.0, dim=None)
        >>> float(loss(torch.zeros(3, 5), torch.zeros(3, 5)))
        0.0
    """

    def __init__(self, temperature: float = 1.0, dim: int | None = None) -> None:
        _check_dim(dim)
        super().__init__()
        self.temperature = _check_positive("temperature", temperature)
        self.dim = dim

    def forward(self, student: Tensor, teacher: Tensor) -> Tensor:
        """Return :func:`kl_div_loss` of ``student`` and ``teacher`` logits."""
        return kl_div_loss(student, teacher, temperature=self.temperature, dim=self.dim)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, dim={self.dim}"


# --------------------------------------------------------------------------- resolver

# Keys are compared after lower-casing and dropping "_", "-", spaces and a trailing "loss".
_ALIASES: dict[str, str] = {
    "l2": "mse",
    "fitnet": "mse",
    "fitnets": "mse",
    "mae": "l1",
    "cos": "cosine",
    "cosinesimilarity": "cosine",
    "at": "attention",
    "attentiontransfer": "attention",
    "kldiv": "kl",
    "kld": "kl",
    "kldivergence": "kl",
    "kd": "kl",
}


def _normalise(name: str) -> str:
    key = "".join(ch for ch in name.strip().lower() if ch not in "_- ")
    if key.endswith("loss") and len(key) > 4:
        key = key[:-4]
    return _ALIASES.get(key, key)


#: Loss types by short name; spellings are normalised (case, ``_``, a trailing ``loss``, aliases).
LOSSES: Registry[type[nn.Module]] = Registry("loss", normalise=_normalise)
for _name, _cls in (
    ("attention", AttentionTransferLoss),
    ("cosine", CosineLoss),
    ("kl", KLDivLoss),
    ("l1", L1Loss),
    ("mse", MSELoss),
):
    LOSSES.register(_cls, [_name])


def _check_options(target: Callable[..., Any], options: dict[str, Any], what: str) -> None:
    """Raise a readable error when ``options`` do not fit ``target``'s signature."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        signature.bind_partial(**options)
    except TypeError as err:
        valid = [
            n
            for n, prm in signature.parameters.items()
            if prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY)
        ]
        unknown = sorted(set(options) - set(valid)) or sorted(options)
        if not valid:
            raise RecorderConfigError(
                f"Expected no options for {what} but got {', '.join(map(repr, unknown))}."
            ) from err
        hint = suggestion(unknown[0], valid, "options")
        raise RecorderConfigError(
            f"Expected the options of {what} to be among {', '.join(map(repr, valid))} but got "
            f"{', '.join(map(repr, unknown))}. {hint}"
        ) from err


def get_loss(spec: str | nn.Module | type[nn.Module] | LossFn, **options: Any) -> LossFn:
    """Turn a loss specification into a callable ``loss(student, teacher) -> Tensor``.

    Args:
        spec: one of

            * a short name, case-insensitive: ``"mse"`` (aliases ``"l2"``, ``"fitnets"``),
              ``"l1"`` (``"mae"``), ``"cosine"`` (``"cos"``), ``"attention"``
              (``"at"``, ``"attention_transfer"``), ``"kl"`` (``"kl_div"``, ``"kd"``);
              a trailing ``"loss"`` is ignored, so ``"MSELoss"`` works too;
            * the import path of a loss class or function, ``"my_project.losses.feature_loss"``
              (the form a YAML config of ``LightningCLI`` gives them), taken as the class or
              function itself;
            * an :class:`torch.nn.Module` instance, returned as is;
            * an :class:`torch.nn.Module` subclass, instantiated with ``options``;
            * any other callable taking ``(student, teacher)``, returned as is (or with
              ``options`` bound as keyword arguments).
        **options: keyword arguments for the loss, e.g. ``temperature=4.0`` for ``"kl"``.

    Returns:
        A loss module for names and classes, the callable otherwise.

    Raises:
        UnknownRecorderTypeError: an unknown name (the message lists the valid names and the
            closest ones).
        RecorderConfigError: options the loss does not take, options given with a module
            instance, an invalid option value, or a spec of another type.

    Examples:
        >>> import torch
        >>> get_loss("KL", temperature=4.0)
        KLDivLoss(temperature=4.0, dim=None)
        >>> get_loss("at")
        AttentionTransferLoss(p=2.0, distance='mse')
        >>> loss = get_loss(lambda s, t: (s - t).abs().max())
        >>> float(loss(torch.zeros(2), torch.tensor([1.0, -3.0])))
        3.0
    """
    if isinstance(spec, str) and "." in spec:  # the form a YAML config gives a class or function
        what = "a loss class or a function taking (student, teacher)"
        return get_loss(cast(LossFn, import_object(spec, what, "callables", callable)), **options)
    if isinstance(spec, str):
        cls = LOSSES.resolve(
            spec,
            "`loss` (a loss name, the import path of a loss class or function such as "
            "'my_project.losses.feature_loss', an nn.Module, or a callable taking (student, "
            "teacher))",
        )
        _check_options(cls, options, f"the {_normalise(spec)!r} loss")
        return cls(**options)
    if isinstance(spec, nn.Module):
        if options:
            raise RecorderConfigError(
                "Expected no options with an nn.Module loss (configure the module itself) but got "
                f"{', '.join(map(repr, sorted(options)))}."
            )
        return spec
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise RecorderConfigError(
                f"Expected a loss class to subclass torch.nn.Module but got {spec.__name__}."
            )
        _check_options(spec, options, spec.__name__)
        return spec(**options)
    if callable(spec):
        if not options:
            return spec
        _check_options(spec, options, getattr(spec, "__name__", "the loss"))
        return functools.partial(spec, **options)
    raise RecorderConfigError(
        "Expected the loss to be a name, an nn.Module or a callable taking (student, teacher) but "
        f"got {type(spec).__name__}."
    )
