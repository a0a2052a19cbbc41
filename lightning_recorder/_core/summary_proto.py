"""TensorBoard ``Summary`` entries of whole tables of scalars and histograms, encoded in C.

A monitor's logging step writes about ten scalars and one histogram per module. Built through
protobuf's Python API, a histogram costs a message, two ``extend`` calls and the collapsing of its
empty buckets in Python (about 10 µs a module), and a scalar a few Python operations.
:func:`histogram_entries` and :func:`scalar_entries` write the wire bytes of every
``Summary.value`` entry of a table in one call instead (the same fields, the same collapsed
buckets, the same float32 rounding); the caller parses them into the ``Summary``
(``Summary.FromString``), so the event is still built and written by TensorBoard's own classes.
Built like the other kernels (:mod:`lightning_recorder._core.native`); ``None``-returning where
they cannot be built, callers then taking the Python path.

The wire format (tensorboard/compat/proto/summary.proto): ``Summary.value`` is field 1; a
``Value`` holds ``tag`` (field 1) and either ``simple_value`` (field 2, a float32) or ``histo``
(field 5); a ``HistogramProto`` holds ``min``, ``max``, ``num``, ``sum``, ``sum_squares`` (fields
1-5, doubles) and the packed doubles ``bucket_limit`` (6) and ``bucket`` (7).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import native

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static int varint_size(uint64_t v) {
    int n = 1;
    while (v >= 0x80) { v >>= 7; n++; }
    return n;
}

static uint8_t *varint(uint8_t *p, uint64_t v) {
    while (v >= 0x80) { *p++ = (uint8_t)(v | 0x80); v >>= 7; }
    *p++ = (uint8_t)v;
    return p;
}

static uint8_t *fixed64(uint8_t *p, uint8_t key, double v) {
    *p++ = key;
    memcpy(p, &v, 8);
    return p + 8;
}

/* The Summary.value entries of the histograms of the rows of table (m rows of 2 * bins + 6
   doubles: num, sum, sum of squares, min, max, the bins + 1 edges, the bins counts), row i
   tagged tags[offsets[i] : offsets[i + 1]], written to out; rows with num == 0 are left out.
   The buckets are (edges, [0, *counts]) with every run of two or more empty buckets written as
   its last one (collapse_empty_buckets); num is written truncated, as int() does. Returns the
   number of bytes written; out holds offsets[m] + m * (128 + 16 * (bins + 1)) bytes. */
int64_t lr_histogram_entries(const double *table, int64_t m, int32_t bins, const uint8_t *tags,
                             const int64_t *offsets, uint8_t *out) {
    const int64_t size = (int64_t)bins + 1, width = 2 * (int64_t)bins + 6;
    uint8_t *p = out;
    for (int64_t i = 0; i < m; i++) {
        const double *row = table + width * i, *edges = row + 5, *counts = row + 5 + size;
        if (row[0] == 0) continue;
        /* bucket j counts counts[j - 1] (bucket 0: nothing); an empty one is kept when it is
           the last bucket or the next is not empty */
        int64_t kept = 0;
        for (int64_t j = 0; j < size; j++) {
            const double c = j ? counts[j - 1] : 0.0;
            kept += c != 0.0 || j == size - 1 || counts[j] != 0.0;
        }
        const uint64_t packed = 8 * (uint64_t)kept;
        const uint64_t histo = 5 * 9 + 2 * (1 + varint_size(packed) + packed);
        const uint64_t tag = (uint64_t)(offsets[i + 1] - offsets[i]);
        const uint64_t value = 1 + varint_size(tag) + tag + 1 + varint_size(histo) + histo;
        *p++ = 0x0a;
        p = varint(p, value);
        *p++ = 0x0a;
        p = varint(p, tag);
        memcpy(p, tags + offsets[i], tag);
        p += tag;
        *p++ = 0x2a;
        p = varint(p, histo);
        p = fixed64(p, 0x09, row[3]);
        p = fixed64(p, 0x11, row[4]);
        p = fixed64(p, 0x19, trunc(row[0]));
        p = fixed64(p, 0x21, row[1]);
        p = fixed64(p, 0x29, row[2]);
        *p++ = 0x32;
        p = varint(p, packed);
        for (int64_t j = 0; j < size; j++) {
            const double c = j ? counts[j - 1] : 0.0;
            if (c != 0.0 || j == size - 1 || counts[j] != 0.0) {
                memcpy(p, edges + j, 8);
                p += 8;
            }
        }
        *p++ = 0x3a;
        p = varint(p, packed);
        for (int64_t j = 0; j < size; j++) {
            const double c = j ? counts[j - 1] : 0.0;
            if (c != 0.0 || j == size - 1 || counts[j] != 0.0) {
                memcpy(p, &c, 8);
                p += 8;
            }
        }
    }
    return (int64_t)(p - out);
}

/* The Summary.value entries of the scalars values[i] (as simple_value: rounded to float32, to
   an infinity beyond its range), tagged tags[offsets[i] : offsets[i + 1]], written to out.
   Returns the number of bytes written; out holds offsets[m] + 32 * m bytes. */
int64_t lr_scalar_entries(const double *values, int64_t m, const uint8_t *tags,
                          const int64_t *offsets, uint8_t *out) {
    uint8_t *p = out;
    for (int64_t i = 0; i < m; i++) {
        const uint64_t tag = (uint64_t)(offsets[i + 1] - offsets[i]);
        const float value = (float)values[i];
        *p++ = 0x0a;
        p = varint(p, 1 + varint_size(tag) + tag + 5);
        *p++ = 0x0a;
        p = varint(p, tag);
        memcpy(p, tags + offsets[i], tag);
        p += tag;
        *p++ = 0x15;
        memcpy(p, &value, 4);
        p += 4;
    }
    return (int64_t)(p - out);
}
"""

_P = ctypes.c_void_p
_SIGNATURES = {
    "lr_histogram_entries": (
        ctypes.c_int64,
        (_P, ctypes.c_int64, ctypes.c_int32, ctypes.c_char_p, _P, _P),
    ),
    "lr_scalar_entries": (ctypes.c_int64, (_P, ctypes.c_int64, ctypes.c_char_p, _P, _P)),
}

LIBRARY = "lightning_recorder_summary_proto"


def _library() -> Any:
    return native.load(LIBRARY, SOURCE, _SIGNATURES)


def available() -> bool:
    """Whether the C encoder runs here (built, or loaded from the cache)."""
    return _library() is not None


class Tags:
    """Tags as one byte string and its offsets (what the encoders read)."""

    __slots__ = ("data", "offsets")

    def __init__(self, tags: Sequence[str]) -> None:
        encoded = [tag.encode() for tag in tags]
        self.data = b"".join(encoded)
        ends = [0]
        for name in encoded:
            ends.append(ends[-1] + len(name))
        self.offsets = torch.tensor(ends, dtype=torch.int64)


def histogram_entries(table: Tensor, bins: int, tags: Tags) -> bytes:
    """The serialized ``Summary.value`` entries of the histograms of ``table`` (call only where
    :func:`available`): a contiguous ``(m, 2 * bins + 6)`` float64 CPU tensor laid out as
    :func:`~lightning_recorder.stats._kernels.raw_table`'s rows, row ``i`` tagged ``tags``'s
    ``i``-th; a row without data (``num == 0``) is left out, as TensorBoard cannot show it."""
    m, count = table.shape[0], tags.offsets.numel() - 1
    if table.shape != (m, 2 * bins + 6) or count != m:
        raise ValueError(
            f"histogram_entries: a table of shape {tuple(table.shape)} and {count} tags; "
            f"expected (m, {2 * bins + 6}) with m tags"
        )
    if table.dtype != torch.float64 or not table.is_cpu or not table.is_contiguous():
        raise ValueError("histogram_entries: the table must be contiguous float64 on the CPU")
    out = ctypes.create_string_buffer(len(tags.data) + m * (128 + 16 * (bins + 1)))
    n = _library().lr_histogram_entries(
        table.data_ptr(), m, bins, tags.data, tags.offsets.data_ptr(), out
    )
    return ctypes.string_at(out, n)


def scalar_entries(values: Sequence[float], tags: Tags) -> bytes:
    """The serialized ``Summary.value`` entries of the scalars ``values`` (``simple_value``,
    rounded to float32 as protobuf rounds it), the ``i``-th tagged ``tags``'s ``i``-th (call only
    where :func:`available`)."""
    m = len(values)
    if tags.offsets.numel() != m + 1:
        raise ValueError(f"scalar_entries: {m} values and {tags.offsets.numel() - 1} tags")
    array = np.fromiter(values, dtype=np.float64, count=m)
    out = ctypes.create_string_buffer(len(tags.data) + 32 * m)
    n = _library().lr_scalar_entries(array.ctypes.data, m, tags.data, tags.offsets.data_ptr(), out)
    return ctypes.string_at(out, n)
