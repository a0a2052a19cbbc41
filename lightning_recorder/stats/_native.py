"""Fused CPU kernels for float32 data: one pass where torch needs several.

* :func:`moments` — for :func:`~lightning_recorder.stats._kernels.native_state`: the sum and
  the sum of squares of the deviations from a shift, the sum of ``|x|``, the minimum, the maximum
  and the number of zeros of a tensor, in one read (torch needs four passes: ``aminmax``, a sum,
  a sum of squares, and a sign count or an absolute sum); a strided sample for the histogram on
  the way. :func:`bucket` counts that sample's histogram, :func:`buckets` the samples of many
  tensors in one call.
* :func:`segment_states` / :func:`segment_table` — the packed states of many small tensors laid
  end to end (segments of one buffer), and their whole histogram table (ranges, edges, counts
  and sums), one call each; :func:`segment_buckets` the counts alone, over ranges given.
* :func:`copy_sumsq` / :func:`diff_sumsq` — for the monitor's parameter statistics: the copy
  of a parameter before the optimizer step together with its squared norm (and its gradient's),
  and, after the step, the squared norms of the parameter and of its change, without writing the
  difference anywhere.

Sums run in float32 vector lanes over rows of :data:`ROW` elements (each lane adds at most 32
terms, or 64 without AVX), and the rows' sums in float64: within about ``1e-7`` (relative) of
the exact sums, below what TensorBoard stores (a float32). The sum of the deviations from the
shift is unbiased: the shift has 8 significant bits, so that ``x - shift`` is exact wherever the
two are close, and its rounding elsewhere follows the varying low bits of ``x``, not those of the
shift. Minimum, maximum and the count of zeros are exact. A NaN or an infinity makes the sums
non-finite, which callers test for: they then take the exact float64 path, which counts them.
The kernels are built by :mod:`lightning_recorder._core.native` on first use; where that is not
possible (:func:`available` is false), callers use torch.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from .._core import native

ROW = 256

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define WIDTH 64
#elif defined(__AVX__)
#define WIDTH 32
#else
#define WIDTH 16
#endif
#define LANES (WIDTH / 4)
#define ROW 256  /* = ROW in Python */

typedef float vf __attribute__((vector_size(WIDTH)));
typedef int32_t vi __attribute__((vector_size(WIDTH)));
static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
/* vmin(v, m) = v < m ? v : m, vmax(v, m) = v > m ? v : m: one instruction on x86 */
#if defined(__AVX512F__) && defined(__clang__)
#define vmin(v, m) __builtin_ia32_minps512(v, m, 4)
#define vmax(v, m) __builtin_ia32_maxps512(v, m, 4)
#elif defined(__AVX512F__)
#define vmin(v, m) __builtin_ia32_minps512_mask(v, m, v, (uint16_t)-1, 4)
#define vmax(v, m) __builtin_ia32_maxps512_mask(v, m, v, (uint16_t)-1, 4)
#elif defined(__AVX__)
#define vmin(v, m) __builtin_ia32_minps256(v, m)
#define vmax(v, m) __builtin_ia32_maxps256(v, m)
#elif defined(__SSE__)
#define vmin(v, m) __builtin_ia32_minps(v, m)
#define vmax(v, m) __builtin_ia32_maxps(v, m)
#else
#define vmin(v, m) pick((v) < (m), v, m)
#define vmax(v, m) pick((v) > (m), v, m)
#endif
static inline vf splat(float x) { vf v; for (int j = 0; j < LANES; j++) v[j] = x; return v; }
static inline double total(vf v) {
    double s = 0;
    for (int j = 0; j < LANES; j++) s += v[j];
    return s;
}
/* float lanes to double lanes: the two halves of v, widened and added (LANES / 2 doubles) */
typedef double vd __attribute__((vector_size(WIDTH)));
static inline vd widen(vf v) {
    vd low, high;
    for (int j = 0; j < LANES / 2; j++) { low[j] = v[j]; high[j] = v[j + LANES / 2]; }
    return low + high;
}
static inline double dtotal(vd v) {
    double s = 0;
    for (int j = 0; j < LANES / 2; j++) s += v[j];
    return s;
}

/* A shift for the sums of deviations: the mean of up to 8 finite evenly spaced elements,
   rounded to 8 significant bits. The kernels subtract it in float32: a shift of few bits keeps
   x - k exact far more often, and where it is not, the rounding follows the low bits of x
   (which vary) rather than those of k (which would bias every difference alike). */
double lr_shift_f32(const float *x, int64_t n) {
    double s = 0; int k = 0, e;
    for (int i = 0; i < 8; i++) {
        float v = x[(n - 1) * i / 7];
        if (isfinite(v)) { s += v; k++; }
    }
    if (!k || s == 0 || !isfinite(s)) return 0.0;
    double m = frexp(s / k, &e);
    return ldexp(nearbyint(ldexp(m, 8)), e - 8);
}

/* x[first], x[first + stride], ... below end copied to out; returns how many. Strides 1 to 3
   are loops of a constant stride, which the compiler vectorizes (a scalar loop stores one
   element a cycle: about 6 us for a 16 Ki-element sample). */
static int64_t take(float *restrict out, const float *restrict x, int64_t first, int64_t end,
                    int64_t stride) {
    if (first >= end) return 0;
    const int64_t count = (end - first + stride - 1) / stride;
    const float *p = x + first;
    if (stride == 1) memcpy(out, p, (size_t)count * sizeof(float));
    else if (stride == 2) for (int64_t k = 0; k < count; k++) out[k] = p[2 * k];
    else if (stride == 3) for (int64_t k = 0; k < count; k++) out[k] = p[3 * k];
    else for (int64_t k = 0; k < count; k++) out[k] = p[k * stride];
    return count;
}

/* out = [sum(x - k), sum((x - k)^2), sum|x|, min, max, zeros] of x[0:n]; if sample is not
   NULL, x[first], x[first + stride], ... are copied to sample[0], sample[1], ... on the way. */
void lr_moments_f32(const float *x, int64_t n, double k, double *out,
                    float *sample, int64_t first, int64_t stride) {
    /* A tensor that stays in cache (256 KiB) is sampled after the pass, in a tight loop; a
       larger one row by row, while each row is in cache. */
    const int after = sample && n <= 65536;
    int64_t next = sample && !after ? first : n, taken = 0;
    const float kf = (float)k;
    const vf kv = splat(kf), inf = splat(INFINITY), zero = splat(0.0f);
    const vi magnitude = (vi)splat(-0.0f);
    vf lo = inf, hi = -inf;
    vd sd = {0}, qd = {0}, ad = {0};  /* the rows' sums, lane by lane, in float64 */
    int64_t z = 0, i = 0;
    const int64_t whole = n / LANES * LANES;
    while (i < whole) {
        int64_t end = i + ROW < whole ? i + ROW : whole;
        vf sv = zero, qv = zero, av = zero;
        vi zv = (vi)zero;
        /* two vectors a step, combined before they reach the accumulators: each accumulator
           waits on one add per two vectors, and few registers are live */
        for (; i + 2 * LANES <= end; i += 2 * LANES) {
            vf v = load(x + i), w = load(x + i + LANES);
            vf d = v - kv, e = w - kv;
            sv += d + e;
            qv += d * d + e * e;
            av += (vf)((vi)v & ~magnitude) + (vf)((vi)w & ~magnitude);
            zv -= (v == zero) + (w == zero);
            lo = vmin(vmin(v, w), lo);
            hi = vmax(vmax(v, w), hi);
        }
        for (; i < end; i += LANES) {
            vf v = load(x + i);
            vf d = v - kv;
            sv += d;
            qv += d * d;
            av += (vf)((vi)v & ~magnitude);
            zv -= (v == zero);
            lo = vmin(v, lo);
            hi = vmax(v, hi);
        }
        sd += widen(sv); qd += widen(qv); ad += widen(av);
        for (int j = 0; j < LANES; j++) z += zv[j];
        if (next < end) {
            const int64_t count = take(sample + taken, x, next, end, stride);
            taken += count;
            next += count * stride;
        }
    }
    double s = dtotal(sd), q = dtotal(qd), a = dtotal(ad);
    float mn = INFINITY, mx = -INFINITY;
    for (int j = 0; j < LANES; j++) { if (lo[j] < mn) mn = lo[j]; if (hi[j] > mx) mx = hi[j]; }
    for (; i < n; i++) {
        float v = x[i]; float d = v - kf;
        s += d; q += (double)d * d; a += fabsf(v); z += v == 0.0f;
        if (v < mn) mn = v;
        if (v > mx) mx = v;
    }
    if (next < n) taken += take(sample + taken, x, next, n, stride);
    if (after) take(sample + taken, x, first, n, stride);
    out[0] = s; out[1] = q; out[2] = a; out[3] = mn; out[4] = mx; out[5] = (double)z;
}

/* out = [shift, then lr_moments_f32's six values] of x[0:n], the shift chosen here, and
   x[0], x[stride], ... copied into sample on the way if it is not NULL: one call for the
   common case of a whole tensor. */
void lr_row_f32(const float *x, int64_t n, double *out, float *sample, int64_t stride) {
    out[0] = lr_shift_f32(x, n);
    lr_moments_f32(x, n, out[0], out + 1, sample, 0, stride);
}

/* The packed state (n, mean, M2, min, max, mean |x|, zeros, 0, n) of x[0:n] (n > 0), from
   lr_row_f32 (the sample copied on the way if it is not NULL). Returns 0; 1 where the sums are
   not finite; 2 where M2 = sum(d^2) - sum(d)^2 / n keeps less than sum(d^2) / cancel. The
   caller computes the state another way in the last two cases. */
int32_t lr_state_f32(const float *x, int64_t n, double cancel, double *state, float *sample,
                     int64_t stride) {
    double r[7];
    lr_row_f32(x, n, r, sample, stride);
    const double total = r[1], squares = r[2], count = (double)n;
    const double m2 = squares - total * total / count;
    state[0] = count; state[1] = r[0] + total / count; state[2] = m2; state[3] = r[4];
    state[4] = r[5]; state[5] = r[3] / count; state[6] = r[6]; state[7] = 0; state[8] = count;
    if (!(isfinite(total) && isfinite(squares))) return 1;
    return m2 * cancel >= squares ? 0 : 2;
}

/* counts[i] += the number of finite v with floor((v - lo) * scale) == i, positions (in
   float32, as bucket_native's for float32 data) clamped to [0, bins]. counts holds
   8 * (bins + 1) zeros; its first 4 * (bins + 2) serve as four tallies (element i counted in
   tally i % 4, so that no increment waits on the one before; index bins + 1 of each takes
   the NaNs and infinities), summed into counts[0 : bins + 1] at the end. The positions of a
   block of BLOCK values are computed in vector registers first, then tallied. */
#define BLOCK 256
void lr_bucket_f32(const float *v, int64_t n, double lo, double scale, int32_t bins,
                   int64_t *counts) {
    const int64_t size = (int64_t)bins + 2;
    const vf lov = splat((float)lo), sv = splat((float)scale), top = splat((float)bins);
    const vf zero = splat(0.0f);
    vi trash;
    for (int j = 0; j < LANES; j++) trash[j] = bins + 1;
    int32_t index[BLOCK];
    int64_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK) {
        for (int k = 0; k < BLOCK; k += LANES) {
            vf x = load(v + i + k);
            /* NaN positions become 0 (max returns its second operand), then go to the trash */
            vf position = vmin(vmax((x - lov) * sv, zero), top);
            vi finite = (x - x) == zero;  /* -1 where finite, 0 for NaN and infinities */
            vi at = (__builtin_convertvector(position, vi) & finite) | (trash & ~finite);
            memcpy(index + k, &at, sizeof at);
        }
        for (int k = 0; k < BLOCK; k += 4) {
            counts[index[k]]++;
            counts[size + index[k + 1]]++;
            counts[2 * size + index[k + 2]]++;
            counts[3 * size + index[k + 3]]++;
        }
    }
    for (; i < n; i++) {
        float x = v[i];
        if (!isfinite(x)) continue;
        float position = (x - (float)lo) * (float)scale;
        position = position > 0 ? position : 0;
        position = position < bins ? position : (float)bins;
        counts[(int64_t)position]++;
    }
    for (int64_t j = 0; j < size - 1; j++)
        counts[j] += counts[size + j] + counts[2 * size + j] + counts[3 * size + j];
}

/* The packed states (n, mean, M2, min, max, mean |x|, zeros, 0, n) of the segments
   x[offsets[i]:offsets[i + 1]] (i < m), 9 doubles each; an empty segment gets the state of no
   data. redo[i] is 1 where the segment's sums are not finite (a NaN, an infinity or an
   overflow), 2 where M2 = sum(d^2) - sum(d)^2 / n keeps less than sum(d^2) / cancel (lost to
   cancellation), 0 otherwise: the caller recomputes those. Returns the number flagged. */
int64_t lr_segment_states_f32(const float *x, const int64_t *offsets, int64_t m, double cancel,
                              double *states, int8_t *redo) {
    int64_t flagged = 0;
    for (int64_t i = 0; i < m; i++) {
        const int64_t n = offsets[i + 1] - offsets[i];
        double *row = states + 9 * i;
        if (n <= 0) {
            for (int j = 0; j < 9; j++) row[j] = 0;
            row[3] = INFINITY; row[4] = -INFINITY;
            redo[i] = 0;
            continue;
        }
        redo[i] = (int8_t)lr_state_f32(x + offsets[i], n, cancel, row, 0, 1);
        flagged += redo[i] != 0;
    }
    return flagged;
}

/* The head of a histogram table row from a packed state st (9 doubles): [num, sum, sum of
   squares, min, max, the bins + 1 edges], as raw_table lays it out, and the range [lo, hi] of
   the buckets: [min, max], [0, 1] without data, +-0.5 around one value. The edges are
   linspace's (lo + step * i in the first half, hi - step * (bins - i) in the second, each
   product rounded apart: volatile keeps the compiler from fusing it into the sum). */
static void table_head(const double *st, int32_t bins, double *row, double *lo_out,
                       double *hi_out) {
    const int64_t size = (int64_t)bins + 1, half = size / 2;
    double *edges = row + 5;
    const double count = st[0], mean = st[1], vmin = st[3], vmax = st[4];
    const int seen = vmax >= vmin;
    double lo = seen ? vmin : 0.0, hi = seen ? vmax : 1.0;
    if (lo == hi) { lo -= 0.5; hi += 0.5; }
    volatile double product;
    row[0] = count;
    row[1] = count * mean;
    product = count * (mean * mean);
    row[2] = st[2] + product;
    row[3] = vmin; row[4] = vmax;
    const double step = (hi - lo) / (double)(bins > 1 ? bins : 1);
    for (int64_t j = 0; j < size; j++) {
        if (j < half) { product = step * (double)j; edges[j] = lo + product; }
        else { product = step * (double)(bins - j); edges[j] = hi - product; }
    }
    *lo_out = lo;
    *hi_out = hi;
}

/* The histogram table of the segments over the ranges of their states (9 doubles each), for
   one process: per segment table_head's row, then the bins counts (2 * bins + 6 doubles); the
   buckets are lr_bucket_f32's, the last one closed. scratch: 8 * (bins + 1) int64 of any
   content. */
void lr_segment_table_f32(const float *x, const int64_t *offsets, int64_t m,
                          const double *states, int32_t bins, double *table, int64_t *scratch) {
    const int64_t size = (int64_t)bins + 1, width = 2 * (int64_t)bins + 6;
    for (int64_t i = 0; i < m; i++) {
        double *row = table + width * i, *counts = row + 5 + size, lo, hi;
        table_head(states + 9 * i, bins, row, &lo, &hi);
        memset(scratch, 0, 8 * size * sizeof *scratch);
        lr_bucket_f32(x + offsets[i], offsets[i + 1] - offsets[i], lo, bins / (hi - lo), bins,
                      scratch);
        scratch[bins - 1] += scratch[bins];
        for (int64_t j = 0; j < bins; j++) counts[j] = (double)scratch[j];
    }
}

/* Whether [lo, hi] is wide enough, relative to its magnitude, for float64 positions: the rule
   of arithmetic_64 in Python (false for an infinite or NaN span). */
static int arithmetic_64(double lo, double hi, int32_t bins) {
    const double span = hi - lo, reach = fabs(lo) > fabs(hi) ? fabs(lo) : fabs(hi);
    return span > (double)bins * reach * 0x1p-40 && span > 0x1p-900 && span < 0x1p1000;
}

/* The histogram table of m sets of float32 arrays for one process, rows as
   lr_segment_table_f32's: array j (data[j], n[j] elements) is in set set[j] (non-decreasing)
   and each of its values stands for weight[j] values. A set's counts are the weighted sums of
   its arrays' lr_bucket_f32 counts over the set's range, scaled to its count of finite values
   where a weight is not 1 (a sample), the last bucket closed. Returns 0, or 1 (the table left
   unfinished) where a range is too narrow for arithmetic positions (arithmetic_64). scratch:
   8 * (bins + 1) int64, summed: bins + 1 doubles, both of any content. */
int32_t lr_sets_table_f32(const int64_t *data, const int64_t *n, const int64_t *set,
                          const double *weight, int64_t k, int64_t m, const double *states,
                          int32_t bins, double *table, int64_t *scratch, double *summed) {
    const int64_t size = (int64_t)bins + 1, width = 2 * (int64_t)bins + 6;
    int64_t j = 0;
    for (int64_t i = 0; i < m; i++) {
        double *row = table + width * i, *counts = row + 5 + size, lo, hi;
        table_head(states + 9 * i, bins, row, &lo, &hi);
        if (!arithmetic_64(lo, hi, bins)) return 1;
        const double scale = bins / (hi - lo);
        int sampled = 0;
        for (int64_t b = 0; b < size; b++) summed[b] = 0.0;
        for (; j < k && set[j] == i; j++) {
            memset(scratch, 0, 8 * size * sizeof *scratch);
            lr_bucket_f32((const float *)(intptr_t)data[j], n[j], lo, scale, bins, scratch);
            for (int64_t b = 0; b < size; b++) summed[b] += (double)scratch[b] * weight[j];
            sampled |= weight[j] != 1.0;
        }
        if (sampled) {
            double found = 0.0;
            for (int64_t b = 0; b < size; b++) found += summed[b];
            if (found > 0) {
                const double factor = states[9 * i] / found;
                for (int64_t b = 0; b < size; b++) summed[b] *= factor;
            }
        }
        summed[bins - 1] += summed[bins];
        for (int64_t b = 0; b < bins; b++) counts[b] = summed[b];
    }
    return 0;
}

/* lr_bucket_f32 of k tensors (data[j]: the address of n[j] floats) over the range of their set
   (lo[set[j]], scale[set[j]]): counts holds k * (bins + 1) results; scratch 8 * (bins + 1)
   int64 of any content. */
void lr_buckets_f32(const int64_t *data, const int64_t *n, const int64_t *set, int64_t k,
                    const double *lo, const double *scale, int32_t bins, int64_t *counts,
                    int64_t *scratch) {
    const int64_t size = (int64_t)bins + 1;
    for (int64_t j = 0; j < k; j++) {
        memset(scratch, 0, 8 * size * sizeof *scratch);
        lr_bucket_f32((const float *)(intptr_t)data[j], n[j], lo[set[j]], scale[set[j]], bins,
                      scratch);
        memcpy(counts + j * size, scratch, size * sizeof *counts);
    }
}

/* dst = src; out[0] += sum(src^2); if g: out[1] += sum(g^2). */
void lr_copy_sumsq_f32(float *dst, const float *src, const float *g, int64_t n, double *out) {
    const vf zero = splat(0.0f);
    double p = 0, r = 0;
    int64_t i = 0;
    const int64_t whole = n / LANES * LANES;
    while (i < whole) {
        int64_t end = i + ROW < whole ? i + ROW : whole;
        vf pv = zero, gv = zero;
        if (g) {
            for (; i < end; i += LANES) {
                vf v = load(src + i), w = load(g + i);
                store(dst + i, v);
                pv += v * v; gv += w * w;
            }
        } else {
            for (; i < end; i += LANES) {
                vf v = load(src + i);
                store(dst + i, v);
                pv += v * v;
            }
        }
        p += total(pv); r += total(gv);
    }
    for (; i < n; i++) {
        dst[i] = src[i]; p += (double)src[i] * src[i];
        if (g) r += (double)g[i] * g[i];
    }
    out[0] += p; out[1] += r;
}

/* out[0] += sum((a - b)^2); out[1] += sum(a^2). */
void lr_diff_sumsq_f32(const float *a, const float *b, int64_t n, double *out) {
    const vf zero = splat(0.0f);
    double d2 = 0, a2 = 0;
    int64_t i = 0;
    const int64_t whole = n / LANES * LANES;
    while (i < whole) {
        int64_t end = i + ROW < whole ? i + ROW : whole;
        vf dv = zero, av = zero;
        for (; i < end; i += LANES) {
            vf u = load(a + i), d = u - load(b + i);
            dv += d * d; av += u * u;
        }
        d2 += total(dv); a2 += total(av);
    }
    for (; i < n; i++) {
        double u = a[i], d = (double)(a[i] - b[i]);
        d2 += d * d; a2 += u * u;
    }
    out[0] += d2; out[1] += a2;
}
"""

_P = ctypes.c_void_p
_N = ctypes.c_int64
_SIGNATURES = {
    "lr_shift_f32": (ctypes.c_double, (_P, _N)),
    "lr_moments_f32": (None, (_P, _N, ctypes.c_double, _P, _P, _N, _N)),
    "lr_bucket_f32": (None, (_P, _N, ctypes.c_double, ctypes.c_double, ctypes.c_int32, _P)),
    "lr_row_f32": (None, (_P, _N, _P, _P, _N)),
    "lr_state_f32": (ctypes.c_int32, (_P, _N, ctypes.c_double, _P, _P, _N)),
    "lr_copy_sumsq_f32": (None, (_P, _P, _P, _N, _P)),
    "lr_segment_states_f32": (_N, (_P, _P, _N, ctypes.c_double, _P, _P)),
    "lr_segment_table_f32": (None, (_P, _P, _N, _P, ctypes.c_int32, _P, _P)),
    "lr_diff_sumsq_f32": (None, (_P, _P, _N, _P)),
    "lr_buckets_f32": (None, (_P, _P, _P, _N, _P, _P, ctypes.c_int32, _P, _P)),
    "lr_sets_table_f32": (
        ctypes.c_int32,
        (_P, _P, _P, _P, _N, _N, _P, ctypes.c_int32, _P, _P, _P),
    ),
}


LIBRARY = "lightning_recorder_stats"


def _library() -> Any:
    return native.load(LIBRARY, SOURCE, _SIGNATURES)


def available() -> bool:
    """Whether the fused kernels run here (built, or loaded from the cache)."""
    return _library() is not None


def usable(x: Tensor) -> bool:
    """Whether ``x`` can be handed to the kernels: a contiguous float32 CPU tensor, not a
    subclass (a ``DTensor``'s storage is its shard)."""
    return (
        (type(x) is Tensor or type(x) is _PARAMETER)
        and x.dtype is _F32
        and x.is_cpu
        and x.layout is _STRIDED
        and x.is_contiguous()
    )


_PARAMETER, _F32, _STRIDED = torch.nn.Parameter, torch.float32, torch.strided


# Large tensors are split across threads (the kernels release the GIL) when torch itself runs
# on several: below this many elements one thread is faster than the hand-off.
PARALLEL_MIN = 2**20
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def _parts(n: int) -> list[tuple[int, int]]:
    if n < PARALLEL_MIN:
        return [(0, n)]
    threads = torch.get_num_threads()
    if threads <= 1:
        return [(0, n)]
    count = min(threads, n // (PARALLEL_MIN // 2))
    step = -(-n // count)
    step += -step % 64  # parts start on a cache line
    return [(start, min(n, start + step)) for start in range(0, n, step)]


def _run(calls: list[Any]) -> None:
    global _POOL, _POOL_SIZE
    if len(calls) == 1:
        calls[0]()
        return
    if _POOL is None or len(calls) > _POOL_SIZE:
        _POOL = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="lr-stats")
        _POOL_SIZE = len(calls)
    for future in [_POOL.submit(call) for call in calls]:
        future.result()


def moments(
    x: Tensor, sample: Tensor | None = None, stride: int = 1
) -> tuple[float, float, float, float, float, float, float]:
    """``(shift, sum(x - shift), sum((x - shift)**2), sum|x|, min, max, zeros)`` of a flat
    tensor that is :func:`usable` (the caller checks :func:`available` first); with ``sample``
    (float32, ``ceil(numel / stride)`` elements), ``x[::stride]`` is copied into it on the way."""
    lib = _library()
    n = x.numel()
    base = x.data_ptr()
    kept = sample.data_ptr() if sample is not None else None
    if n < PARALLEL_MIN:  # the common case: one call, without the bookkeeping of parts
        row = (ctypes.c_double * 7)()
        lib.lr_row_f32(base, n, row, kept, stride)
        shift, total, squares, abs_sum, low, high, zeros = row
        return shift, total, squares, abs_sum, low, high, zeros
    shift = lib.lr_shift_f32(base, n)
    parts = _parts(n)
    if len(parts) == 1:
        one = (ctypes.c_double * 6)()
        lib.lr_moments_f32(base, n, shift, one, kept, 0, stride)
        return (shift, *one)
    out = (ctypes.c_double * (6 * len(parts)))()
    address = ctypes.addressof(out)
    calls = []
    for j, (start, end) in enumerate(parts):
        first = -(-start // stride) * stride  # the first sampled index in the part
        target = None if kept is None else kept + 4 * (first // stride)
        calls.append(
            lambda start=start, end=end, j=j, first=first, target=target: lib.lr_moments_f32(
                base + 4 * start,
                end - start,
                shift,
                address + 48 * j,
                target,
                first - start,
                stride,
            )
        )
    _run(calls)
    rows = [out[6 * j : 6 * j + 6] for j in range(len(parts))]
    return (
        shift,
        sum(r[0] for r in rows),
        sum(r[1] for r in rows),
        sum(r[2] for r in rows),
        min(r[3] for r in rows),
        max(r[4] for r in rows),
        sum(r[5] for r in rows),
    )


def state_row(
    x: Tensor, sample: Tensor | None, stride: int, cancel_bits: int
) -> tuple[list[float], int]:
    """The packed state of a :func:`usable` tensor of fewer than :data:`PARALLEL_MIN` elements
    as a host list of 9 floats, from one pass (``sample`` as in :func:`moments`), and a flag: 0,
    or 1 where the sums are not finite, 2 where more than ``cancel_bits`` bits of ``M2`` were
    lost to cancellation (the caller then computes them another way)."""
    state = (ctypes.c_double * 9)()
    kept = sample.data_ptr() if sample is not None else None
    flag = _library().lr_state_f32(x.data_ptr(), x.numel(), 2.0**cancel_bits, state, kept, stride)
    return list(state), flag


def bucket(x: Tensor, lo: float, hi: float, bins: int) -> list[int]:
    """The counts (``bins + 1``, the last for values at ``hi``) of the finite values of a
    :func:`usable` flat tensor, bucket ``floor((v - lo) * bins / (hi - lo))`` in float32,
    clamped into ``[0, bins]``."""
    counts = (ctypes.c_int64 * (8 * (bins + 1)))()
    _library().lr_bucket_f32(x.data_ptr(), x.numel(), lo, bins / (hi - lo), bins, counts)
    return counts[: bins + 1]


def segment_states(
    values: Tensor, offsets: Tensor, cancel_bits: int
) -> tuple[Tensor, Tensor | None]:
    """The ``(m, 9)`` packed float64 states of the segments of a :func:`usable` flat tensor
    (``offsets``: contiguous int64 CPU) in one call, and a ``(m,)`` int8 tensor of the segments
    to recompute: 1 where the sums are not finite, 2 where more than ``cancel_bits`` bits of
    ``M2`` were lost to cancellation; ``None`` when there is none."""
    m = offsets.numel() - 1
    states = torch.empty(m, 9, dtype=torch.float64)
    redo = torch.empty(m, dtype=torch.int8)
    flagged = _library().lr_segment_states_f32(
        values.data_ptr(),
        offsets.data_ptr(),
        m,
        2.0**cancel_bits,
        states.data_ptr(),
        redo.data_ptr(),
    )
    return states, (redo if flagged else None)


def segment_table(values: Tensor, offsets: Tensor, states: Tensor, bins: int) -> Tensor:
    """The histogram rows of the segments over the ranges of ``states`` (``(m, 9)`` contiguous
    float64), for one process, in one call: ``(m, 2 * bins + 6)`` float64 rows laid out as
    :func:`~lightning_recorder.stats._kernels.raw_table`'s."""
    m = offsets.numel() - 1
    table = torch.empty(m, 2 * bins + 6, dtype=torch.float64)
    scratch = torch.empty(8 * (bins + 1), dtype=torch.int64)
    _library().lr_segment_table_f32(
        values.data_ptr(),
        offsets.data_ptr(),
        m,
        states.data_ptr(),
        bins,
        table.data_ptr(),
        scratch.data_ptr(),
    )
    return table


def segment_buckets(
    values: Tensor, offsets: Tensor, lo: Tensor, scale: Tensor, bins: int
) -> Tensor:
    """:func:`bucket` of each segment over its own range (``lo``, ``scale``: float64 CPU, one
    per segment), in one call: ``(m, bins + 1)`` int64 counts."""
    bounds = offsets.tolist()
    segments = [values[a:b] for a, b in itertools.pairwise(bounds)]
    return buckets(segments, torch.arange(len(segments)), lo, scale, bins)


def buckets(
    tensors: Sequence[Tensor], sets: Tensor, lo: Tensor, scale: Tensor, bins: int
) -> Tensor:
    """:func:`bucket` of each of ``k`` :func:`usable` tensors over the range of its set
    (``sets``: ``(k,)`` int64 indices into ``lo`` and ``scale``, float64 CPU), in one call:
    ``(k, bins + 1)`` int64 counts."""
    k = len(tensors)
    data = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    sizes = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    counts = torch.empty(k, bins + 1, dtype=torch.int64)
    scratch = torch.empty(8 * (bins + 1), dtype=torch.int64)
    _library().lr_buckets_f32(
        data.data_ptr(),
        sizes.data_ptr(),
        sets.data_ptr(),
        k,
        lo.data_ptr(),
        scale.data_ptr(),
        bins,
        counts.data_ptr(),
        scratch.data_ptr(),
    )
    return counts


def sets_table(
    tensors: Sequence[Tensor],
    sets: Sequence[int],
    weights: Sequence[float],
    states: Tensor,
    bins: int,
) -> Tensor | None:
    """The histogram table of ``m`` sets of :func:`usable` tensors over the ranges of their
    states (``(m, 9)`` contiguous float64), for one process, in one call: ``(m, 2 * bins + 6)``
    float64 rows laid out as :func:`~lightning_recorder.stats._kernels.raw_table`'s. Tensor
    ``j`` is in set ``sets[j]`` (non-decreasing) and each of its values stands for
    ``weights[j]`` values; a set with a weight other than 1 has its counts scaled to its count
    of finite values. ``None`` where a range is too narrow for arithmetic bucketing."""
    m, k = states.shape[0], len(tensors)
    table = torch.empty(m, 2 * bins + 6, dtype=torch.float64)
    # the arrays of the call as ctypes arrays: a few µs less than a tensor each
    data = (ctypes.c_int64 * k)(*(t.data_ptr() for t in tensors))
    sizes = (ctypes.c_int64 * k)(*(t.numel() for t in tensors))
    index = (ctypes.c_int64 * k)(*sets)
    scale = (ctypes.c_double * k)(*weights)
    tallies = (ctypes.c_int64 * (8 * (bins + 1)))()
    sums = (ctypes.c_double * (bins + 1))()
    declined = _library().lr_sets_table_f32(
        data, sizes, index, scale, k, m, states.data_ptr(), bins, table.data_ptr(), tallies, sums
    )
    return None if declined else table


def copy_sumsq(
    destinations: list[Tensor], sources: list[Tensor], grads: Sequence[Tensor | None]
) -> tuple[list[float], list[float]]:
    """Copy each source into its destination (all :func:`usable`, same sizes); return the squared
    norms of the sources and of the gradients (``nan`` where a gradient is ``None``)."""
    lib = _library()
    norms, grad_norms = [], []
    out = (ctypes.c_double * 2)()
    for dst, src, grad in zip(destinations, sources, grads, strict=True):
        out[0] = out[1] = 0.0
        g = grad.data_ptr() if grad is not None else None
        lib.lr_copy_sumsq_f32(dst.data_ptr(), src.data_ptr(), g, src.numel(), out)
        norms.append(out[0])
        grad_norms.append(out[1] if grad is not None else float("nan"))
    return norms, grad_norms


def diff_sumsq(after: list[Tensor], before: list[Tensor]) -> tuple[list[float], list[float]]:
    """The squared norms of ``after - before`` and of ``after``, tensor by tensor (all
    :func:`usable`, same sizes), the difference written nowhere."""
    lib = _library()
    changes, norms = [], []
    out = (ctypes.c_double * 2)()
    for a, b in zip(after, before, strict=True):
        out[0] = out[1] = 0.0
        lib.lr_diff_sumsq_f32(a.data_ptr(), b.data_ptr(), a.numel(), out)
        changes.append(out[0])
        norms.append(out[1])
    return changes, norms
