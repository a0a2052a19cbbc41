"""The layer-by-step heat map of :class:`~lightning_recorder.HealthMonitor`, drawn with numpy.

One image per statistic: a row per layer in model order, a column per logged step (the oldest
on the left), each cell coloured by the statistic's value with a viridis-like colour map
(dark blue low, yellow high, an infinite value at its end; grey: no value, or NaN). Fractions
(``zero_fraction``) are drawn on a fixed 0–1 scale, magnitudes (``std``, ``grad_norm``,
``update_ratio`` …) on a log10 scale over the values shown, others on a linear one. fastai's
``ActivationStats`` "colorful dimension" (a histogram-over-time image per layer) is the model;
here every layer is in one image.

The image carries its text: the statistic and its scale (or "no values in this map" where every
cell is grey), the layer names, the first and last step, and the rule findings in force beside
their layer (in red). Pillow draws the text and encodes the image (the package's
``tensorboard`` extra installs it; without it the health view writes no image, and says so once
when the run starts).

**Cost.** A heat map of a deep model is a large image (127 layers: 1,800 x 650 pixels), redrawn
every few logged steps. It is drawn as one byte per pixel, an index into a fixed palette of
256 colours (:data:`PALETTE`: the colour map in 220 steps, grey, white, and the two text colours
in 16 levels of coverage over white), and encoded as a palette PNG (:func:`png`, zlib level 1):
eight times faster than an RGB PNG of the same picture at the default level, a third of the
bytes. The layer labels are drawn once per set of rows and kept (:func:`_label_strip`).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from functools import cache, lru_cache
from typing import Any, Literal

import numpy as np

__all__ = ["PALETTE", "Scale", "png", "render_indexed", "scale_of"]

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
_LEVELS = 220  # colour-map steps in the palette
_TEXT_LEVELS = 16  # coverage levels of a text colour over white
_MISSING_RGB = (150, 150, 150)
_TEXT = (30, 30, 30)
_ALARM = (200, 0, 0)


def _palette() -> np.ndarray:
    position = np.linspace(0.0, 1.0, _LEVELS) * (len(_ANCHORS) - 1)
    index = np.clip(np.floor(position).astype(np.int64), 0, len(_ANCHORS) - 2)
    frac = (position - index)[:, None]
    ramp = _ANCHORS[index] * (1 - frac) + _ANCHORS[index + 1] * frac
    white = np.array([255.0, 255.0, 255.0])
    cover = np.arange(1, _TEXT_LEVELS + 1)[:, None] / _TEXT_LEVELS
    text = white * (1 - cover) + np.asarray(_TEXT, dtype=np.float64) * cover
    alarm = white * (1 - cover) + np.asarray(_ALARM, dtype=np.float64) * cover
    missing = np.asarray([_MISSING_RGB], dtype=np.float64)
    table = np.rint(np.concatenate([ramp, missing, white[None, :], text, alarm])).astype(np.uint8)
    return np.vstack([table, np.zeros((256 - len(table), 3), dtype=np.uint8)])


#: The 256 colours of a heat map's pixels: the colour map, grey, white, the text colours.
PALETTE = _palette()
_MISSING = _LEVELS
_WHITE = _LEVELS + 1
_TEXT_BASE = _LEVELS + 2  # + level - 1, level 1..16
_ALARM_BASE = _TEXT_BASE + _TEXT_LEVELS
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
    """Values in [0, 1] (NaN where missing), and the low and high ends of the scale (of the
    finite values): an infinite value is drawn at its end, a NaN as missing."""
    unit, low, high = _scaled(values, scale)
    unit = np.where(values == np.inf, 1.0, np.where(values == -np.inf, 0.0, unit))
    return unit, low, high


def _scaled(values: np.ndarray, scale: Scale) -> tuple[np.ndarray, float, float]:
    """:func:`_normalised` of the finite values (the others NaN, or clipped on a unit scale)."""
    finite = np.isfinite(values)
    if scale == "unit":
        return np.clip(values, 0.0, 1.0), 0.0, 1.0
    if scale == "log":
        positive = finite & (values > 0)
        if not positive.any():
            return np.where(finite, 0.0, np.nan), 0.0, 0.0
        logs = np.full(values.shape, np.nan)
        shown = logs[positive] = np.log10(values[positive])
        low, high = float(shown.min()), float(shown.max())
        logs[finite & ~positive] = low  # zeros: the bottom of the scale
        span = high - low if high > low else 1.0
        return (logs - low) / span, 10.0**low, 10.0**high
    if not finite.any():
        return values, 0.0, 0.0
    low, high = float(values[finite].min()), float(values[finite].max())
    span = high - low if high > low else 1.0
    return (values - low) / span, low, high


def _indices(unit: np.ndarray) -> np.ndarray:
    """Palette indices of values in [0, 1] (the missing colour where NaN)."""
    missing = ~np.isfinite(unit)
    level = np.rint(np.where(missing, 0.0, unit) * (_LEVELS - 1))
    out = np.clip(level, 0, _LEVELS - 1).astype(np.uint8)
    out[missing] = _MISSING
    return out


@cache
def _font() -> Any:
    """Pillow's default font, or ``None`` without Pillow."""
    try:
        from PIL import ImageFont
    except ImportError:  # pragma: no cover - the health view draws nothing without Pillow
        return None
    try:
        return ImageFont.load_default(size=11)
    except TypeError:  # Pillow < 10.1: the bitmap font, one size
        return ImageFont.load_default()


@lru_cache(maxsize=1024)
def _glyphs(text: str, width: int) -> np.ndarray:
    """The coverage level (0: none, up to 16) of each pixel of ``text`` drawn in the default
    font, at most ``width`` pixels wide (shortened from the left, "…tail"); cached: layer names
    are drawn at every refresh."""
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
    coverage = np.asarray(image).astype(np.int64)
    return ((coverage * _TEXT_LEVELS + 127) // 255).astype(np.uint8)


def _text_width(text: str, width: int = 10_000) -> int:
    return int(_glyphs(text, width).shape[1])


def _write(canvas: np.ndarray, x: int, y: int, text: str, base: int, width: int = 10_000) -> None:
    """Draw ``text`` on ``canvas`` (palette indices, white there) at ``(x, y)``, in place, in
    the text colour starting at palette index ``base``."""
    levels = _glyphs(text, width)
    h = min(levels.shape[0], canvas.shape[0] - y)
    w = min(levels.shape[1], canvas.shape[1] - x)
    if h <= 0 or w <= 0:
        return
    cut = levels[:h, :w]
    region = canvas[y : y + h, x : x + w]
    np.copyto(region, (cut + (base - 1)).astype(np.uint8), where=cut > 0)


@lru_cache(maxsize=32)
def _label_strip(rows: tuple[str, ...], width: int, alarms: frozenset[int]) -> np.ndarray:
    """The layer labels, one per ``_CELL_H`` rows of pixels, ``width`` wide (alarmed rows in
    red), as palette indices; kept: the rows change rarely."""
    strip = np.full((len(rows) * _CELL_H, width), _WHITE, dtype=np.uint8)
    for i, label in enumerate(rows):
        base = _ALARM_BASE if i in alarms else _TEXT_BASE
        _write(strip, 4, i * _CELL_H, label, base, width - 8)
    strip.flags.writeable = False
    return strip


def _number(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else "-"


def _scale_text(cells: np.ndarray, low: float, high: float) -> str:
    """The scale's ends written beside the colour bar, or that no cell has a value (every cell
    grey: the ends of a scale over no value would read ``0 … 0``)."""
    if (cells == _MISSING).all():
        return "no values in this map"
    return f"{_number(low)} … {_number(high)}"


def render_indexed(
    values: np.ndarray,
    stat: str,
    rows: Sequence[str],
    steps: Sequence[int],
    notes: Mapping[int, str] | None = None,
    footer: str = "",
) -> np.ndarray:
    """The heat map of ``values`` (``(len(rows), len(steps))``) as ``(H, W)`` uint8 indices into
    :data:`PALETTE` (``PALETTE[image]`` is the ``(H, W, 3)`` image).

    Args:
        values: the statistic of each row (layer) at each column (logged step); NaN: no value.
        stat: the statistic's name (its scale, and the title).
        rows: the row labels (layers, in model order).
        steps: the step of each column.
        notes: text to write beside some rows (the findings in force), by row index.
        footer: text to write under the map, after the steps (findings of no layer).

    Examples:
        >>> import numpy as np
        >>> image = PALETTE[render_indexed(np.array([[0.1, 0.9], [np.nan, 0.5]]),
        ...                                "zero_fraction", ["a", "b"], [9, 19])]
        >>> image.dtype, image.shape[2]
        (dtype('uint8'), 3)
    """
    unit, low, high = _normalised(np.asarray(values, dtype=np.float64), scale_of(stat))
    cells = _indices(unit)
    n_rows, n_cols = cells.shape[:2]
    cell_w = int(min(12, max(3, 600 // max(n_cols, 1))))
    grid_h, grid_w = n_rows * _CELL_H, n_cols * cell_w
    if _font() is None or n_rows == 0:
        return np.repeat(np.repeat(cells, _CELL_H, axis=0), cell_w, axis=1)
    label_w = min(_MAX_LABEL, max(_text_width(r) for r in rows)) + 8
    notes = dict(notes or {})
    note_w = min(_MAX_NOTE, max((_text_width(n) for n in notes.values()), default=0))
    note_w = note_w + 12 if notes else 0
    top, bottom = 34, 16 + (_CELL_H if footer else 0)
    # room for the colour bar and its range beside the labels, however few the columns
    kind = {"unit": "0 to 1", "log": "log scale", "linear": "linear scale"}[scale_of(stat)]
    title = f"{stat}: rows are layers in model order, columns logged steps ({kind})"
    width = max(label_w + grid_w + note_w + 4, label_w + 240, 360, _text_width(title) + 8)
    if footer:
        width = max(width, label_w + min(_MAX_NOTE, _text_width(footer)) + 8)
    height = top + grid_h + bottom
    canvas = np.full((height, width), _WHITE, dtype=np.uint8)
    grid = canvas[top : top + grid_h, label_w : label_w + grid_w]
    grid.reshape(n_rows, _CELL_H, n_cols, cell_w)[...] = cells[:, None, :, None]
    # the colour bar, under the title
    canvas[20:28, label_w : label_w + 120] = _indices(np.linspace(0.0, 1.0, 120))[None, :]
    _write(canvas, 4, 2, title, _TEXT_BASE)
    _write(canvas, label_w + 126, 17, _scale_text(cells, low, high), _TEXT_BASE)
    strip = _label_strip(tuple(rows), label_w, frozenset(notes))
    canvas[top : top + grid_h, :label_w] = strip
    for i, note in notes.items():
        y = top + i * _CELL_H
        _write(canvas, label_w + grid_w + 6, y, note, _ALARM_BASE, note_w - 10)
    if steps:
        y = top + grid_h + 2
        first, last = f"step {steps[0]}", f"step {steps[-1]}"
        x = label_w + grid_w - _text_width(last)
        fits = x > label_w + _text_width(first) + 12  # the last step under the last column
        if len(steps) > 1 and not fits:  # too few columns for two labels: one for both
            first = f"steps {steps[0]} to {steps[-1]}"
        _write(canvas, label_w, y, first, _TEXT_BASE)
        if len(steps) > 1 and fits:
            _write(canvas, x, y, last, _TEXT_BASE)
    if footer:
        _write(canvas, label_w, top + grid_h + 16, footer, _ALARM_BASE, width - label_w - 4)
    return canvas


def png(indexed: np.ndarray) -> bytes:
    """A heat map of :func:`render_indexed` as PNG bytes (a palette image, zlib level 1).

    Examples:
        >>> import numpy as np
        >>> png(render_indexed(np.ones((2, 3)), "std", ["a", "b"], [1, 2, 3]))[:4]
        b'\\x89PNG'
    """
    from PIL import Image

    image = Image.fromarray(np.ascontiguousarray(indexed, dtype=np.uint8), mode="P")
    image.putpalette(PALETTE.tobytes())
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return out.getvalue()
