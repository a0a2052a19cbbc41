// The packed states of the rows of a 2-d float32 or float64 tensor on the CPU, in one read.
//
// The CPU kernel of the custom op `lightning_recorder::rows_state` (schema, fake implementation
// and build: lightning_recorder/stats/_cpu_kernel.py). It computes what the torch function
// `rows_state` of lightning_recorder/stats/_state.py defines -- that function is the definition
// and the reference the tests hold this kernel to -- with the layout of the packed state
// (COUNT, MEAN, M2, MIN, MAX, ABS_SUM, ZEROS, NAN, POSINF, NEGINF, NUMEL):
//
// * the shift of a row is the mean of its finite values among x[0], x[step], x[2 step], ...
//   with step = max(length / 64, 1);
// * one pass sums, in float64, the deviations d = x - shift, their squares and |x|, takes the
//   min and max and counts the zeros, assuming finite values (a NaN or an infinity propagates
//   into the sums);
// * a row whose sums are not finite is read again, counting NaN, +inf and -inf apart and
//   leaving them out of the other statistics.
//
// Every value is converted to float64 as it is read; the sums run in 2 x 4 float64 lanes
// (float32 rows take their extremes and zeros on 8 float32 lanes, where they are exact)
// (GCC vector extensions: AVX2 where the CPU has it, chosen at load time by target_clones, SSE2
// elsewhere), so the result differs from torch's only in the order of the float64 additions.
//
// Given a `sample` (a 1-d tensor of the row's dtype; one row only), the op also copies the
// row's elements 0, stride, 2 stride, ... into it, right after reading the row (still in the
// cache): the strided histogram sample the monitor takes of each output, without a second
// pass over the output and a second call.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>

namespace {

constexpr int64_t kWidth = 11;
constexpr int64_t kShiftSample = 64;
constexpr int64_t kBlock = 4096;  // a multiple of 8
constexpr double kInf = std::numeric_limits<double>::infinity();

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int64_t v4i __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#define LR_INLINE static inline __attribute__((always_inline))

LR_INLINE v4d load(const float* p) {
  v4f f;
  std::memcpy(&f, p, sizeof f);
  return __builtin_convertvector(f, v4d);
}

LR_INLINE v4d load(const double* p) {
  v4d d;
  std::memcpy(&d, p, sizeof d);
  return d;
}

LR_INLINE v8f load8(const float* p) {
  v8f f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

// |v| by clearing the sign bit (one instruction; |-0.0| is +0.0, which adds the same).
LR_INLINE v4d abs(v4d v) {
  const v4i magnitude = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};
  return (v4d)((v4i)v & magnitude);
}

// Four lanes of the sums of one row.
struct Lanes {
  v4d sum, squares, abs_sum, low, high;
  v4i zeros;
};

LR_INLINE void start(Lanes& a) {
  const v4d zero = {0.0, 0.0, 0.0, 0.0};
  a.sum = a.squares = a.abs_sum = zero;
  a.low = v4d{kInf, kInf, kInf, kInf};
  a.high = -a.low;
  a.zeros = v4i{0, 0, 0, 0};
}

// The sums of one value's lanes: its deviation d = v - shift, d^2 and |v|.
LR_INLINE void add_sums(Lanes& a, v4d v, v4d shift) {
  const v4d d = v - shift;
  a.sum += d;
  a.squares += d * d;
  a.abs_sum += abs(v);
}

LR_INLINE void add(Lanes& a, v4d v, v4d shift) {
  const v4d zero = {0.0, 0.0, 0.0, 0.0};
  add_sums(a, v, shift);
  a.low = v < a.low ? v : a.low;
  a.high = v > a.high ? v : a.high;
  a.zeros -= (v == zero);  // a comparison is -1 where true
}

// The finite-data sums of a row as they are gathered: sum d, sum d^2, sum |x|, min, max, zeros.
struct Sums {
  double total = 0.0, squares = 0.0, abs_sum = 0.0, low = kInf, high = -kInf, zeros = 0.0;
};

// Add the sums of a block's lanes to the row's and start the lanes' sums afresh.
LR_INLINE void end_block(Lanes& a, Lanes& b, Sums& row) {
  const v4d zero = {0.0, 0.0, 0.0, 0.0};
  const v4d block_sum = a.sum + b.sum, block_squares = a.squares + b.squares;
  const v4d block_abs = a.abs_sum + b.abs_sum;
  for (int j = 0; j < 4; ++j) {
    row.total += block_sum[j];
    row.squares += block_squares[j];
    row.abs_sum += block_abs[j];
  }
  a.sum = a.squares = a.abs_sum = b.sum = b.squares = b.abs_sum = zero;
}

// The values after the last whole group of 8, one at a time; then the sums in `out`.
template <typename T>
LR_INLINE void end_row(const T* x, int64_t i, int64_t n, double shift, Sums& row, double* out) {
  for (; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    const double d = v - shift;
    row.total += d;
    row.squares += d * d;
    row.abs_sum += std::fabs(v);
    row.low = v < row.low ? v : row.low;
    row.high = v > row.high ? v : row.high;
    row.zeros += v == 0.0;
  }
  const double found[6] = {row.total, row.squares, row.abs_sum, row.low, row.high, row.zeros};
  std::memcpy(out, found, sizeof found);
}

// The finite-data sums of a row into `out`. The sums are taken block by block (lanes within a
// block, then the blocks' sums added), so that no running sum grows much beyond a block's: the
// rounding error stays near that of a pairwise sum.
template <typename T>
LR_INLINE void finite_sums(const T* x, int64_t n, double shift, double* out) {
  Lanes a, b;
  start(a);
  start(b);
  const v4d s = {shift, shift, shift, shift};
  Sums row;
  int64_t i = 0;
  while (i + 8 <= n) {
    const int64_t end = std::min(n, i + kBlock);
    for (; i + 8 <= end; i += 8) {
      add(a, load(x + i), s);
      add(b, load(x + i + 4), s);
    }
    end_block(a, b, row);
  }
  for (int j = 0; j < 4; ++j) {
    row.zeros += static_cast<double>(a.zeros[j] + b.zeros[j]);
    row.low = std::min({row.low, a.low[j], b.low[j]});
    row.high = std::max({row.high, a.high[j], b.high[j]});
  }
  end_row(x, i, n, shift, row, out);
}

// float32 rows: the extremes and the zeros, exact in float32, taken on 8 float32 lanes; the
// sums on 2 x 4 float64 lanes, as above (fewer instructions per value than converting first).
LR_INLINE void finite_sums(const float* x, int64_t n, double shift, double* out) {
  Lanes a, b;
  start(a);
  start(b);
  const v4d s = {shift, shift, shift, shift};
  const float inf = std::numeric_limits<float>::infinity();
  v8f low = {inf, inf, inf, inf, inf, inf, inf, inf};
  v8f high = -low;
  const v8f zero8 = {0, 0, 0, 0, 0, 0, 0, 0};
  Sums row;
  int64_t i = 0;
  while (i + 8 <= n) {
    const int64_t end = std::min(n, i + kBlock);
    v8i block_zeros = {0, 0, 0, 0, 0, 0, 0, 0};  // at most kBlock / 8 per lane
    for (; i + 8 <= end; i += 8) {
      const v8f f = load8(x + i);
      low = f < low ? f : low;
      high = f > high ? f : high;
      block_zeros -= (f == zero8);  // a comparison is -1 where true
      add_sums(a, load(x + i), s);
      add_sums(b, load(x + i + 4), s);
    }
    end_block(a, b, row);
    for (int j = 0; j < 8; ++j) {
      row.zeros += static_cast<double>(block_zeros[j]);
    }
  }
  for (int j = 0; j < 8; ++j) {
    row.low = std::min(row.low, static_cast<double>(low[j]));
    row.high = std::max(row.high, static_cast<double>(high[j]));
  }
  end_row(x, i, n, shift, row, out);
}

// The same sums of the finite values of a row, and its counts of finite values, NaN, +inf and
// -inf (the rare row whose finite-data sums are not finite; block by block, as above).
template <typename T>
LR_INLINE void masked_sums(const T* x, int64_t n, double shift, double* out, double* counts) {
  double total = 0.0, squares = 0.0, abs_sum = 0.0, zeros = 0.0, low = kInf, high = -kInf;
  double count = 0.0, nan = 0.0, posinf = 0.0, neginf = 0.0;
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t end = std::min(n, begin + kBlock);
    double block_total = 0.0, block_squares = 0.0, block_abs = 0.0;
    for (int64_t i = begin; i < end; ++i) {
      const double v = static_cast<double>(x[i]);
      if (std::isnan(v)) {
        nan += 1.0;
      } else if (std::isinf(v)) {
        (v > 0.0 ? posinf : neginf) += 1.0;
      } else {
        const double d = v - shift;
        count += 1.0;
        block_total += d;
        block_squares += d * d;
        block_abs += std::fabs(v);
        low = std::min(low, v);
        high = std::max(high, v);
        zeros += v == 0.0;
      }
    }
    total += block_total;
    squares += block_squares;
    abs_sum += block_abs;
  }
  const double found[6] = {total, squares, abs_sum, low, high, zeros};
  std::memcpy(out, found, sizeof found);
  const double seen[4] = {count, nan, posinf, neginf};
  std::memcpy(counts, seen, sizeof seen);
}

template <typename T>
LR_INLINE void row_state(const T* x, int64_t n, double* out) {
  const int64_t step = std::max<int64_t>(n / kShiftSample, 1);
  double seen_sum = 0.0, seen = 0.0;
  for (int64_t i = 0; i < n; i += step) {
    const double v = static_cast<double>(x[i]);
    if (std::isfinite(v)) {
      seen_sum += v;
      seen += 1.0;
    }
  }
  const double shift = seen > 0.0 ? seen_sum / seen : 0.0;
  double sums[6];
  finite_sums(x, n, shift, sums);
  double counts[4] = {static_cast<double>(n), 0.0, 0.0, 0.0};  // finite, NaN, +inf, -inf
  if (!(std::isfinite(sums[0]) && std::isfinite(sums[1]) && std::isfinite(sums[2]))) {
    masked_sums(x, n, shift, sums, counts);
  }
  const double count = counts[0];
  // as state_from_sums: mean = shift + sum(d) / n, M2 = sum(d^2) - sum(d)^2 / n (at least 0)
  const double total = sums[0];
  const double n_seen = std::max(count, 1.0);
  const bool any = count > 0.0;
  const double state[kWidth] = {
      count,
      any ? shift + total / n_seen : 0.0,
      any ? std::max(sums[1] - total * (total / n_seen), 0.0) : 0.0,
      sums[3],
      sums[4],
      sums[2],
      sums[5],
      counts[1],
      counts[2],
      counts[3],
      static_cast<double>(n)};
  std::memcpy(out, state, sizeof state);
}

__attribute__((target_clones("avx2", "default"))) void rows_f32(
    const float* x, int64_t rows, int64_t n, int64_t stride, double* out) {
  for (int64_t r = 0; r < rows; ++r) {
    row_state(x + r * stride, n, out + r * kWidth);
  }
}

__attribute__((target_clones("avx2", "default"))) void rows_f64(
    const double* x, int64_t rows, int64_t n, int64_t stride, double* out) {
  for (int64_t r = 0; r < rows; ++r) {
    row_state(x + r * stride, n, out + r * kWidth);
  }
}

template <typename T>
void strided_copy(const T* x, int64_t stride, T* out, int64_t length) {
  for (int64_t k = 0; k < length; ++k) {
    out[k] = x[k * stride];
  }
}

at::Tensor rows_state_cpu(const at::Tensor& x, const std::optional<at::Tensor>& sample,
                          int64_t stride) {
  TORCH_CHECK(x.dim() == 2, "lightning_recorder::rows_state takes a 2-d tensor, got ", x.dim(),
              " dimensions");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1,
              "lightning_recorder::rows_state takes rows that are contiguous (stride 1), got "
              "strides ",
              x.strides());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "lightning_recorder::rows_state takes float32 or float64, got ", x.scalar_type());
  const bool sampled = sample.has_value() && sample->defined();
  if (sampled) {
    const at::Tensor& s = *sample;
    TORCH_CHECK(x.size(0) == 1, "lightning_recorder::rows_state samples one row, got ",
                x.size(0), " rows");
    TORCH_CHECK(s.dim() == 1 && s.is_contiguous() && s.scalar_type() == x.scalar_type() &&
                    s.device() == x.device(),
                "lightning_recorder::rows_state takes a contiguous 1-d sample of the row's dtype "
                "and device, got ",
                s.sizes(), " ", s.scalar_type(), " on ", s.device());
    TORCH_CHECK(stride >= 1 && (s.numel() == 0 || (s.numel() - 1) * stride < x.size(1)),
                "lightning_recorder::rows_state: a sample of ", s.numel(), " elements at stride ",
                stride, " does not fit in a row of ", x.size(1));
  }
  at::Tensor out = at::empty({x.size(0), kWidth}, x.options().dtype(at::kDouble));
  double* o = out.mutable_data_ptr<double>();
  if (x.scalar_type() == at::kFloat) {
    rows_f32(x.const_data_ptr<float>(), x.size(0), x.size(1), x.stride(0), o);
    if (sampled) {
      strided_copy(x.const_data_ptr<float>(), stride, sample->mutable_data_ptr<float>(),
                   sample->numel());
    }
  } else {
    rows_f64(x.const_data_ptr<double>(), x.size(0), x.size(1), x.stride(0), o);
    if (sampled) {
      strided_copy(x.const_data_ptr<double>(), stride, sample->mutable_data_ptr<double>(),
                   sample->numel());
    }
  }
  return out;
}

at::Tensor rows_state_plain(const at::Tensor& x) { return rows_state_cpu(x, std::nullopt, 1); }

at::Tensor rows_state_sampled(const at::Tensor& x, at::Tensor& sample, int64_t stride) {
  return rows_state_cpu(x, sample, stride);
}

}  // namespace

TORCH_LIBRARY_IMPL(lightning_recorder, CPU, m) {
  m.impl("rows_state", &rows_state_plain);
  m.impl("rows_state.sampled", &rows_state_sampled);
}
