"""Connectors: small learnable adapters that map student features to the teacher's shape.

FitNets-style feature matching needs the student's features in the teacher's shape.
:func:`build_connector` builds the adapter from the two shapes (a 1x1 convolution for feature
maps, a linear layer for vectors and tokens, an identity when nothing differs);
:func:`resolve_connector` turns what a user configured (``"auto"``, a module, a factory) into a
module. Only the non-batch dims matter: a connector built from one batch works for any batch size.

Examples:
    >>> import torch
    >>> from lightning_recorder import build_connector
    >>> _ = torch.manual_seed(0)
    >>> connector = build_connector((8, 64, 16, 16), (8, 256, 8, 8), resize=True)
    >>> [name for name, _ in connector.named_children()]
    ['resize', 'proj']
    >>> connector.resize
    _Resize(size=(8, 8), mode='bilinear', align_corners=False, antialias='when downsampling')
    >>> connector.proj
    Conv2d(64, 256, kernel_size=(1, 1), stride=(1, 1), bias=False)
    >>> connector(torch.randn(2, 64, 16, 16)).shape
    torch.Size([2, 256, 8, 8])
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._core.checks import check_bool, suggestion
from .._core.compat import autocast_enabled
from ..errors import RecorderConfigError, RecorderError
from .losses import default_channel_dim

__all__ = ["ConnectorSpec", "build_connector", "resolve_connector"]

ConnectorFactory: TypeAlias = Callable[[torch.Size, torch.Size], nn.Module]
ConnectorSpec: TypeAlias = Literal["auto", "identity"] | nn.Module | ConnectorFactory | None
"""What :func:`resolve_connector` accepts: ``None``/``"auto"``, ``"identity"``, a module, or a
factory ``factory(student_shape, teacher_shape) -> nn.Module``."""

_SPEC_NAMES = ("auto", "identity")


class _Resize(nn.Module):
    """Bilinear interpolation of ``(N, C, H, W)`` maps to a fixed ``(H, W)``, antialiased where
    the map shrinks (in either dim), as torchvision's ``Resize``: without it a downsampled map
    aliases its high-frequency features."""

    def __init__(self, size: tuple[int, int]) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: Tensor) -> Tensor:
        shrinks = x.shape[-2] > self.size[0] or x.shape[-1] > self.size[1]
        # the antialiased kernel has no half-precision form on the CPU: float32, cast back
        half = x.dtype in (torch.float16, torch.bfloat16) and x.device.type != "cuda"
        y = F.interpolate(
            x.float() if shrinks and half else x,
            size=self.size,
            mode="bilinear",
            align_corners=False,
            antialias=shrinks,
        )
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        # whether it antialiases is decided at each call, by the input's size: say when
        return (
            f"size={self.size}, mode='bilinear', align_corners=False, antialias='when downsampling'"
        )


def _as_shape(name: str, shape: object) -> tuple[int, ...]:
    if isinstance(shape, Tensor) or not isinstance(shape, Sequence):
        raise RecorderConfigError(
            f"Expected `{name}` to be a sequence of ints such as `features.shape` but got "
            f"{type(shape).__name__}."
        )
    dims = tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims) or (
        0 in dims[1:]
    ):
        raise RecorderConfigError(
            f"Expected `{name}` to hold a batch size and positive sizes but got {dims}."
        )
    return dims


def build_connector(
    student_shape: Sequence[int], teacher_shape: Sequence[int], *, resize: bool = False
) -> nn.Module:
    """Build a module that maps features of ``student_shape`` to ``teacher_shape``.

    | features                      | connector                                           |
    |-------------------------------|-----------------------------------------------------|
    | same non-batch shape          | `torch.nn.Identity`                                 |
    | ``(N, C, H, W)``, C differs   | 1x1 `torch.nn.Conv2d` without bias (FitNets)        |
    | ``(N, C)``, C differs         | `torch.nn.Linear` without bias                      |
    | ``(N, L, C)``, C differs      | `torch.nn.Linear` without bias, on the last dim     |
    | ``(N, C, H, W)``, H, W differ | ``resize=True`` only: bilinear resize (+ 1x1 conv)  |

    With ``resize=True`` the student map is interpolated to the teacher's ``(H, W)``
    (``mode="bilinear"``, ``align_corners=False``, and ``antialias=True`` where the map shrinks,
    as torchvision's ``Resize``). When a map is both resized and projected, the convolution
    runs on the smaller of the two maps (the operations commute); the children are named
    ``resize`` and ``proj`` so the state dict keys do not depend on that order.

    Weights use PyTorch's default initialisation, so the result is deterministic given
    :func:`torch.manual_seed`. Parameters are created outside inference mode (a connector first
    built during ``validate()`` can still be trained) on the CPU, in the default dtype; move the
    connector with ``.to()``.

    Args:
        student_shape: shape of the student features, batch dim first (``tensor.shape``).
        teacher_shape: shape of the teacher features; the batch sizes need not match.
        resize: interpolate student feature maps whose ``(H, W)`` differ from the teacher's.

    Returns:
        The connector module.

    Raises:
        RecorderConfigError: the ranks differ, the rank is not 2, 3 or 4, the spatial sizes
            differ without ``resize=True``, or the token counts of 3-D features differ (each
            message names both shapes).

    Examples:
        >>> build_connector((32, 128), (32, 512))
        Linear(in_features=128, out_features=512, bias=False)
        >>> build_connector((2, 64, 8, 8), (2, 256, 8, 8))
        Conv2d(64, 256, kernel_size=(1, 1), stride=(1, 1), bias=False)
        >>> build_connector((4, 196, 384), (1, 196, 384))  # only non-batch dims matter
        Identity()
    """
    check_bool(resize, "resize")
    s = _as_shape("student_shape", student_shape)
    t = _as_shape("teacher_shape", teacher_shape)
    shapes = f"student {s} and teacher {t}"
    if len(s) != len(t):
        raise RecorderConfigError(
            f"Expected the student and teacher features to have the same rank but got {shapes}."
        )
    if len(s) not in (2, 3, 4):
        raise RecorderConfigError(
            "Expected 2-D (N, C), 3-D (N, L, C) or 4-D (N, C, H, W) features but got "
            f"{shapes}. Pass your own connector module for other layouts."
        )
    if len(s) == 3 and s[1] != t[1]:
        raise RecorderConfigError(
            f"Expected the student and teacher tokens to have the same length L but got {shapes}."
            " Token sequences are not resized; pass your own connector module."
        )
    if len(s) == 4 and s[2:] != t[2:] and not resize:
        raise _spatial_size_error(shapes)
    with torch.inference_mode(False):
        return _build(s, t)


def _spatial_size_error(shapes: str) -> RecorderConfigError:
    return RecorderConfigError(
        "Expected the student and teacher feature maps to have the same spatial size (H, W) "
        f"but got {shapes}. Pass `resize=True` to interpolate the student map to the "
        "teacher's size inside the connector."
    )


def is_auto(spec: object) -> bool:
    """Whether ``spec`` asks for the automatic connector (``None`` or ``"auto"``)."""
    return spec is None or (isinstance(spec, str) and spec.strip().lower() == "auto")


def position_connector(
    student_shape: Sequence[int], teacher_shape: Sequence[int], *, resize: bool = False
) -> nn.Module:
    """The automatic connector, without parameters, of a loss that compares positions whatever
    the channel counts (attention transfer): an identity, or for ``(N, C, H, W)`` maps whose
    ``(H, W)`` differ, with ``resize=True``, the bilinear resize of :func:`build_connector`.

    Raises:
        RecorderConfigError: maps of different ``(H, W)`` without ``resize=True`` (the error of
            :func:`build_connector`). Other shapes the loss cannot compare are left to it.
    """
    check_bool(resize, "resize")
    s = _as_shape("student_shape", student_shape)
    t = _as_shape("teacher_shape", teacher_shape)
    if len(s) == len(t) == 4 and s[2:] != t[2:]:
        if not resize:
            raise _spatial_size_error(f"student {s} and teacher {t}")
        return _Resize((t[2], t[3]))
    return nn.Identity()


def _build(s: tuple[int, ...], t: tuple[int, ...]) -> nn.Module:
    d = default_channel_dim(len(s))
    c_s, c_t = s[d], t[d]
    proj: nn.Module | None = None
    if c_s != c_t:
        proj = nn.Conv2d(c_s, c_t, 1, bias=False) if len(s) == 4 else nn.Linear(c_s, c_t, False)
    if len(s) != 4 or s[2:] == t[2:]:
        return proj if proj is not None else nn.Identity()
    resize = _Resize((t[2], t[3]))
    if proj is None:
        return resize
    # 1x1 conv and bilinear interpolation commute: run the conv on the smaller map.
    layers = [("resize", resize), ("proj", proj)]
    if s[2] * s[3] < t[2] * t[3]:
        layers.reverse()
    return nn.Sequential(OrderedDict(layers))


def resolve_connector(
    spec: ConnectorSpec,
    student_feature: Tensor,
    teacher_feature: Tensor,
    *,
    resize: bool = False,
) -> nn.Module:
    """Turn a connector specification into a module, given one student and one teacher tensor.

    Args:
        spec: ``None`` or ``"auto"``: :func:`build_connector` from the two tensors' shapes;
            ``"identity"``: no connector (:class:`torch.nn.Identity`), e.g. for attention
            transfer, which compares maps with different channel counts (features of different
            ranks, or vectors of different widths, are rejected); an
            :class:`torch.nn.Module`: used as is; any other callable: a factory called as
            ``spec(student_feature.shape, teacher_feature.shape)`` that returns a module
            (:func:`build_connector` itself, or a class whose constructor takes two shapes).
        student_feature: an example of the student features (only its shape, device and
            dtype are used).
        teacher_feature: an example of the teacher features (only its shape is used).
        resize: passed to :func:`build_connector` for ``None``/``"auto"``; ignored otherwise.

    Returns:
        The connector, on ``student_feature``'s device and, unless ``spec`` is a module (used
        as it is), in its floating-point dtype: a student cast with ``.double()`` or
        ``.to(torch.bfloat16)`` has features that a connector of the default dtype cannot
        take. Under autocast on that device (mixed precision) the connector stays in the
        default dtype: autocast casts.

    Raises:
        RecorderConfigError: an unknown name (with the closest one), a factory that raises
            when called with the two shapes (a module class such as ``torch.nn.Linear``, whose
            constructor takes sizes) or does not return a module, a spec of another type, or the
            errors of :func:`build_connector`.

    Examples:
        >>> import torch
        >>> s, t = torch.randn(2, 16, 8, 8), torch.randn(2, 32, 8, 8)
        >>> resolve_connector("auto", s, t)(s).shape
        torch.Size([2, 32, 8, 8])
        >>> resolve_connector(None, t, t)
        Identity()
        >>> def factory(s_shape, t_shape):
        ...     return torch.nn.Conv2d(s_shape[1], t_shape[1], 3, padding=1)
        >>> resolve_connector(factory, s, t)
        Conv2d(16, 32, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    """
    check_bool(resize, "resize")
    for name, value in (("student_feature", student_feature), ("teacher_feature", teacher_feature)):
        if not isinstance(value, Tensor):
            raise RecorderConfigError(
                f"Expected `{name}` to be a torch.Tensor but got {type(value).__name__}."
            )
    with torch.inference_mode(False):
        module = _resolve(spec, student_feature.shape, teacher_feature.shape, resize)
        device = student_feature.device
        # under autocast (mixed precision) on that device the connector stays in the default
        # dtype: autocast casts
        cast = not autocast_enabled(device) and not isinstance(spec, nn.Module)
        if student_feature.is_floating_point() and cast:
            return module.to(device=device, dtype=student_feature.dtype)
        return module.to(device)


def check_connector_spec(spec: object, name: str = "connectors") -> None:
    """Raise unless ``spec`` is something :func:`resolve_connector` accepts (checked early)."""
    if spec is None or isinstance(spec, nn.Module):
        return
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key in _SPEC_NAMES:
            return
        hint = " " + suggestion(key, _SPEC_NAMES, "names")
    elif callable(spec):
        return
    else:
        hint = ""
    raise RecorderConfigError(
        f"Expected `{name}` to be one of {', '.join(map(repr, _SPEC_NAMES))}, None, an nn.Module "
        f"or a factory callable(student_shape, teacher_shape) but got {spec!r}.{hint}"
    )


def _resolve(spec: object, s: torch.Size, t: torch.Size, resize: bool) -> nn.Module:
    if spec is None:
        return build_connector(s, t, resize=resize)
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key == "auto":
            return build_connector(s, t, resize=resize)
        if key == "identity":
            # Maps and tokens may differ in channels (attention transfer compares them);
            # vectors of different widths, or features of different ranks, never fit.
            if tuple(s[1:]) != tuple(t[1:]) and (len(s) != len(t) or len(s) < 3):
                raise RecorderConfigError(
                    "Expected the student and teacher features to have the same shape for "
                    f"connector 'identity' but got {tuple(s)} and {tuple(t)}; use 'auto' to learn "
                    "a projection."
                )
            return nn.Identity()
        raise RecorderConfigError(
            f"Expected the connector to be one of {', '.join(map(repr, _SPEC_NAMES))}, None, an "
            f"nn.Module or a factory but got {spec!r}. {suggestion(key, _SPEC_NAMES, 'names')}"
        )
    if isinstance(spec, nn.Module):
        return spec
    if callable(spec):
        try:
            module = spec(s, t)
        except (RecorderError, torch.OutOfMemoryError):
            raise
        except Exception as err:  # a module class (torch.nn.Linear) takes sizes, not shapes
            name = getattr(spec, "__qualname__", None) or repr(spec)
            raise RecorderConfigError(
                f"Expected the connector factory {name} to build a module from the student and "
                f"teacher feature shapes, called as {name}({tuple(s)}, {tuple(t)}), but it raised "
                f"{type(err).__name__}: {err}. A factory takes (student_shape, teacher_shape); "
                "for a module class whose constructor takes other arguments (the sizes of "
                "torch.nn.Linear or torch.nn.Conv2d), pass a module built for these shapes, or "
                "'auto'."
            ) from err
        if not isinstance(module, nn.Module):
            raise RecorderConfigError(
                "Expected the connector factory to return an nn.Module but got "
                f"{type(module).__name__}."
            )
        return module
    raise RecorderConfigError(
        "Expected the connector to be None, 'auto', 'identity', an nn.Module or a factory "
        f"callable(student_shape, teacher_shape) but got {type(spec).__name__}."
    )
