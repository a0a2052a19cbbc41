"""The layer-by-step heat map of :class:`~lightning_recorder.HealthMonitor`, drawn with numpy.

One image per statistic: a row per layer in model order, a column per logged step (the oldest
on the left), each cell coloured by the statistic's value with a viridis-like colour map
(dark blue low, yellow high; grey: no value). Fractions (``zero_fraction``) are drawn on a
fixed 0–1 scale, magnitudes (``std``, ``grad_norm``, ``update_ratio`` …) on a log10 scale over
the values shown, others on a linear one. fastai's ``ActivationStats`` "colorful dimension"
(a histogram-over-time image per layer) is the model; here every layer is in one image.

Where Pillow is installed (TensorBoard needs it), the image carries its text: the statistic
and its scale, the layer names, the first and last step, and the rule findings in force beside
their layer (in red). Without Pillow the cells alone are drawn.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import cache, lru_cache
from typing import Any, Literal

import numpy as np

__all__ = ["Scale", "colorize", "render", "scale_of"]

Scale = Literal["unit", "log", "linear"]

# Nine colours of matplotlib's viridis, at 0, 1/8, ..., 1 (interpolated in between).
_ANCHORS = np.array(
    [
        [68, 1, 84],
        [72, 40, 120],
        [62, 73, 137],
        [49, 104, 142],
        [38, 130, 142],
        [31, 158, 137],
        [53, 183, 121],
        [109, 205, 89],
        [253, 231, 37],
    ],
    dtype=np.float64,
)
_MISSING = np.array([150, 150, 150], dtype=np.uint8)
_TEXT = (30, 30, 30)
_ALARM = (200, 0, 0)
_UNIT_STATS = frozenset({"zero_fraction"})
_LOG_STATS = frozenset({"std", "abs_mean", "grad_norm", "norm", "update_ratio", "numel"})
_CELL_H = 14
_MAX_LABEL = 260
_MAX_NOTE = 420


def scale_of(stat: str) -> Scale:
    """How the values of ``stat`` are mapped to colours."""
    if stat in _UNIT_STATS:
        return "unit"
    return "log" if stat in _LOG_STATS else "linear"


def _normalised(values: np.ndarray, scale: Scale) -> tuple[np.ndarray, float, float]:
    """Values in [0, 1] (NaN where missing), and the low and high ends of the scale."""
    finite = np.isfinite(values)
    if scale == "unit":
        return np.clip(values, 0.0, 1.0), 0.0, 1.0
    if scale == "log":
        positive = finite & (values > 0)
        logs = np.full(values.shape, np.nan)
        logs[positive] = np.log10(values[positive])
        if not positive.any():
            return np.where(finite, 0.0, np.nan), 0.0, 0.0
        low, high = float(np.nanmin(logs)), float(np.nanmax(logs))
        logs[finite & ~positive] = low  # zeros: the bottom of the scale
        span = high - low if high > low else 1.0
        return (logs - low) / span, 10.0**low, 10.0**high
    if not finite.any():
        return values, 0.0, 0.0
    low, high = float(values[finite].min()), float(values[finite].max())
    span = high - low if high > low else 1.0
    return (values - low) / span, low, high


def colorize(values: np.ndarray, scale: Scale) -> tuple[np.ndarray, float, float]:
    """``(rows, cols, 3)`` uint8 colours of ``values`` (grey where NaN), and the scale's ends."""
    unit, low, high = _normalised(np.asarray(values, dtype=np.float64), scale)
    missing = ~np.isfinite(unit)
    position = np.where(missing, 0.0, unit) * (len(_ANCHORS) - 1)
    index = np.clip(np.floor(position).astype(np.int64), 0, len(_ANCHORS) - 2)
    frac = (position - index)[..., None]
    rgb = _ANCHORS[index] * (1 - frac) + _ANCHORS[index + 1] * frac
    out = np.rint(rgb).astype(np.uint8)
    out[missing] = _MISSING
    return out, low, high


@cache
def _font() -> Any:
    """Pillow's default font, or ``None`` without Pillow."""
    try:
        from PIL import ImageFont
    except ImportError:  # pragma: no cover - Pillow comes with TensorBoard
        return None
    try:
        return ImageFont.load_default(size=11)
    except TypeError:  # Pillow < 10.1: the bitmap font, one size
        return ImageFont.load_default()


@lru_cache(maxsize=1024)
def _glyphs(text: str, width: int) -> np.ndarray:
    """The coverage (0-255) of ``text`` drawn in the default font, at most ``width`` pixels wide
    (shortened from the left, "…tail"); cached: layer names are drawn at every refresh."""
    from PIL import Image, ImageDraw

    font = _font()
    draw = ImageDraw.Draw(Image.new("L", (1, 1)))
    if draw.textlength(text, font=font) > width:
        while len(text) > 1 and draw.textlength("…" + text, font=font) > width:
            text = text[1:]
        text = "…" + text
    size = max(1, math.ceil(draw.textlength(text, font=font)))
    image = Image.new("L", (size, _CELL_H), 0)
    ImageDraw.Draw(image).text((0, 0), text, fill=255, font=font)
    return np.asarray(image)


def _text_width(text: str, width: int = 10_000) -> int:
    return int(_glyphs(text, width).shape[1])


def _write(canvas: np.ndarray, x: int, y: int, text: str, colour: Any, width: int = 10_000) -> None:
    """Draw ``text`` on ``canvas`` (``(H, W, 3)`` uint8) at ``(x, y)``, in place."""
    mask = _glyphs(text, width)
    h = min(mask.shape[0], canvas.shape[0] - y)
    w = min(mask.shape[1], canvas.shape[1] - x)
    if h <= 0 or w <= 0:
        return
    alpha = mask[:h, :w, None].astype(np.float32) / 255.0
    region = canvas[y : y + h, x : x + w].astype(np.float32)
    blended = region * (1 - alpha) + np.asarray(colour, dtype=np.float32) * alpha
    canvas[y : y + h, x : x + w] = np.rint(blended).astype(np.uint8)


def _number(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else "-"


def render(
    values: np.ndarray,
    stat: str,
    rows: Sequence[str],
    steps: Sequence[int],
    notes: Mapping[int, str] | None = None,
    footer: str = "",
) -> np.ndarray:
    """The heat map of ``values`` (``(len(rows), len(steps))``) as an ``(H, W, 3)`` uint8 image.

    Args:
        values: the statistic of each row (layer) at each column (logged step); NaN: no value.
        stat: the statistic's name (its scale, and the title).
        rows: the row labels (layers, in model order).
        steps: the step of each column.
        notes: text to write beside some rows (the findings in force), by row index.
        footer: text to write under the map, after the steps (findings of no layer).

    Examples:
        >>> import numpy as np
        >>> image = render(np.array([[0.1, 0.9], [np.nan, 0.5]]), "zero_fraction", ["a", "b"],
        ...                [9, 19])
        >>> image.dtype, image.shape[2]
        (dtype('uint8'), 3)
    """
    scale = scale_of(stat)
    cells, low, high = colorize(values, scale)
    n_rows, n_cols = cells.shape[:2]
    cell_w = int(min(12, max(3, 600 // max(n_cols, 1))))
    grid = np.repeat(np.repeat(cells, _CELL_H, axis=0), cell_w, axis=1)
    if _font() is None or n_rows == 0:
        return grid
    label_w = min(_MAX_LABEL, max(_text_width(r) for r in rows)) + 8
    notes = dict(notes or {})
    note_w = min(_MAX_NOTE, max((_text_width(n) for n in notes.values()), default=0))
    note_w = note_w + 12 if notes else 0
    top, bottom = 34, 16 + (_CELL_H if footer else 0)
    width = max(label_w + grid.shape[1] + note_w + 4, 360)
    if footer:
        width = max(width, label_w + min(_MAX_NOTE, _text_width(footer)) + 8)
    height = top + grid.shape[0] + bottom
    canvas = np.full((height, width, 3), 255, dtype=np.uint8)
    canvas[top : top + grid.shape[0], label_w : label_w + grid.shape[1]] = grid
    # the colour bar, under the title
    bar = colorize(np.linspace(0.0, 1.0, 120)[None, :], "unit")[0]
    canvas[20:28, label_w : label_w + 120] = np.repeat(bar, 8, axis=0)
    kind = {"unit": "0 to 1", "log": "log scale", "linear": "linear scale"}[scale]
    _write(
        canvas,
        4,
        2,
        f"{stat}: rows are layers in model order, columns logged steps ({kind})",
        _TEXT,
    )
    _write(canvas, label_w + 126, 17, f"{_number(low)} … {_number(high)}", _TEXT)
    for i, label in enumerate(rows):
        y = top + i * _CELL_H
        colour = _ALARM if i in notes else _TEXT
        _write(canvas, 4, y, label, colour, label_w - 8)
        if i in notes:
            _write(canvas, label_w + grid.shape[1] + 6, y, notes[i], _ALARM, note_w - 10)
    if steps:
        y = top + grid.shape[0] + 2
        _write(canvas, label_w, y, f"step {steps[0]}", _TEXT)
        last = f"step {steps[-1]}"
        x = label_w + grid.shape[1] - _text_width(last)
        if x > label_w + 60:
            _write(canvas, x, y, last, _TEXT)
    if footer:
        _write(canvas, label_w, top + grid.shape[0] + 16, footer, _ALARM, width - label_w - 4)
    return canvas
