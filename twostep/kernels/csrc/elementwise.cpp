// The small per-layer ops of a decoder step as one call each: RMSNorm (alone, or after the residual
// add), rotary embedding (q and k in place), SiLU-and-multiply, and the K/V cache write; and the
// greedy sampler's argmax over a row of logits. In a batch-1 decode step each torch op costs
// microseconds of dispatch for a few KB of work (more where the step's weight stream has just
// evicted the caches' code and data), and these are chains of 3-12 ops per layer. They round where
// the PyTorch code they replace rounds (layers/norm.py, layers/rotary.py, layers/activation.py):
// rotary and the cache write are bit-identical to it;
// RMSNorm sums its squares in another order and SiLU's exp is a polynomial here, so those two may
// differ from torch in the last bit of a float32 (the tests bound it).
//
// Each is registered as a torch custom op (torch.ops.twostep.*, so the profiler and torch.compile
// see it) and also exposed to Python directly, which costs a microsecond less per call.
#include <torch/csrc/utils/pybind.h>
#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>

#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

#ifdef TWOSTEP_AVX2
using twostep::simd::exp8;
using twostep::simd::load8;
using twostep::simd::to_bf16;
using twostep::simd::widen_bf16;
#endif

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

// x rounded to T the way a torch op with a T output rounds its float result
template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensors only");
}

#ifdef TWOSTEP_AVX2

// 8 values of T as float32 and back (bf16 rounded as c10 rounds), and a float32 result rounded to T
// and widened again: what a torch op with a T output hands to the next one.
inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }
inline void store8(at::BFloat16* o, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(o), to_bf16(v)); }
template <typename T>
constexpr bool vec8 = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
template <typename T>
inline __m256 rounded8(__m256 v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) return widen_bf16(to_bf16(v));
  return v;
}
#endif

// res += x, each sum rounded to T (torch's add)
template <typename T>
void add_to(const T* x, T* res, int64_t dim) {
  int64_t d = 0;
#ifdef TWOSTEP_AVX2
  if constexpr (vec8<T>)
    for (; d + 8 <= dim; d += 8) store8(res + d, _mm256_add_ps(load8(x + d), load8(res + d)));
#endif
  for (; d < dim; ++d) res[d] = round_to<T>(as_float(x[d]) + as_float(res[d]));
}

// sum of x[d]^2, each square a float32 product, summed in double: the mean of the squares rounded
// once, as exact as torch's (the order of the double sums differs; the float32 mean almost never)
template <typename T>
double sum_of_squares(const T* x, int64_t dim) {
  double sum = 0.0;
  int64_t d = 0;
#ifdef TWOSTEP_AVX2
  if constexpr (vec8<T>) {
    __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
    for (; d + 8 <= dim; d += 8) {
      const __m256 v = load8(x + d), squares = _mm256_mul_ps(v, v);
      low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(squares)));
      high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(squares, 1)));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(low, high));
    sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
#endif
  for (; d < dim; ++d) sum += static_cast<double>(as_float(x[d]) * as_float(x[d]));
  return sum;
}

// out[t] = weight * T(x[t] / sqrt(mean(x[t]^2) + eps)), the normalisation in float32 (as HF).
template <typename T>
void rms_norm_row(const T* xr, const T* weight, T* o, int64_t dim, float eps) {
  const float inv = 1.0f / std::sqrt(static_cast<float>(sum_of_squares(xr, dim) / static_cast<double>(dim)) + eps);
  int64_t d = 0;
#ifdef TWOSTEP_AVX2
  if constexpr (vec8<T>) {
    const __m256 scale = _mm256_set1_ps(inv);
    for (; d + 8 <= dim; d += 8)
      store8(o + d, _mm256_mul_ps(load8(weight + d), rounded8<T>(_mm256_mul_ps(load8(xr + d), scale))));
  }
#endif
  for (; d < dim; ++d) o[d] = round_to<T>(as_float(weight[d]) * as_float(round_to<T>(as_float(xr[d]) * inv)));
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(x.dtype() == weight.dtype(), "x and weight must share a dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) > 0 && x.size(-1) == weight.size(0),
              "weight must be [hidden] with x's last dimension");
}

// out = rms_norm(x) row by row; with a residual, residual += x first (rounded to T, as torch's add)
// and the norm is of the sum.
at::Tensor norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  if (residual != nullptr)
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() && residual->dtype() == x.dtype(),
                "residual: contiguous, with x's shape and dtype");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t dim = weight.size(0), rows = xc.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = xc.data_ptr<scalar_t>(), *wp = wc.data_ptr<scalar_t>();
    scalar_t* rp = residual != nullptr ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* row = xp + r * dim;
        if (rp != nullptr) {
          add_to(row, rp + r * dim, dim);
          row = rp + r * dim;
        }
        rms_norm_row(row, wp, op + r * dim, dim, static_cast<float>(eps));
      }
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("twostep::rms_norm", c10::ArrayRef<c10::IValue>({}));
  return norm_rows(x, nullptr, weight, eps);
}

// residual += x in place, then the RMSNorm of the sum (vLLM's fused_add_rms_norm): one pass over
// the row instead of an add and a norm.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                           double eps) {
  RECORD_FUNCTION("twostep::add_rms_norm", c10::ArrayRef<c10::IValue>({}));
  return norm_rows(x, &residual, weight, eps);
}

// silu(g) = g / (1 + exp(-g)) in float32, rounded to T, times u (rounded to T): F.silu(g) * u.
template <typename T>
inline void silu_mul_scalar(const T* g, const T* u, T* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = as_float(g[i]);
    o[i] = round_to<T>(as_float(round_to<T>(x / (1.0f + std::exp(-x)))) * as_float(u[i]));
  }
}

#ifdef TWOSTEP_AVX512
// exp8, to_bf16 and the loads above for 16 floats: the same operations lane by lane, so the same
// bits. SiLU-and-mul takes them (bf16 at 4,864 columns: 2.8 us a call warm against 5.2 in vectors of 8)
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }
inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
inline void store16(at::BFloat16* o, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), to_bf16(v)); }
template <typename T>
inline __m512 rounded16(__m512 v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) return widen_bf16(to_bf16(v));
  return v;
}
#endif

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
#ifdef TWOSTEP_AVX512
  if constexpr (vec8<T>)
    for (; i + 16 <= n; i += 16) {
      const __m512 x = load16(g + i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
      const __m512 s = rounded16<T>(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
      store16(o + i, _mm512_mul_ps(s, load16(u + i)));
    }
#endif
#ifdef TWOSTEP_AVX2
  if constexpr (vec8<T>)
    for (; i + 8 <= n; i += 8) {
      const __m256 x = load8(g + i);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
      const __m256 s = rounded8<T>(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
      store8(o + i, _mm256_mul_ps(s, load8(u + i)));
    }
#endif
  silu_mul_scalar(g + i, u + i, o + i, n - i);
}

// x [..., 2 I] (gate, then up) -> silu(gate) * up [..., I]
at::Tensor silu_and_mul(const at::Tensor& x) {
  RECORD_FUNCTION("twostep::silu_and_mul", c10::ArrayRef<c10::IValue>({}));
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "x: last dimension 2 * intermediate size");
  auto xc = x.contiguous();
  const int64_t width = x.size(-1), half = width / 2, rows = width ? xc.numel() / width : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = half;
  auto out = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t chunk = 256;                     // columns per task: a batch-1 row is split too
    const int64_t per_row = (half + chunk - 1) / chunk;
    at::parallel_for(0, rows * per_row, 128, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / per_row, c = (i % per_row) * chunk, n = std::min(chunk, half - c);
        silu_mul_row(xp + r * width + c, xp + r * width + half + c, op + r * half + c, n);
      }
    });
  });
  return out;
}

// x [T, H, D] (any strides between tokens and heads, D contiguous) -> x * cos + rotate_half(x) * sin
// with cos/sin [T, D], each product and the sum rounded to T as three torch ops would. out may be x.
template <typename T>
void rotate(const T* x, int64_t token_stride, int64_t head_stride, const T* cos, const T* sin,
            T* out, int64_t out_token_stride, int64_t out_head_stride, int64_t tokens, int64_t heads,
            int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens * heads, 64, [&](int64_t i0, int64_t i1) {
    std::vector<T> copy(dim);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      std::memcpy(copy.data(), x + t * token_stride + h * head_stride, dim * sizeof(T));
      const T* xi = copy.data();
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      T* o = out + t * out_token_stride + h * out_head_stride;
      for (int64_t d = 0; d < dim; ++d) {
        const float rotated = d < half ? -as_float(xi[d + half]) : as_float(xi[d - half]);
        const T a = round_to<T>(as_float(xi[d]) * as_float(c[d]));
        const T b = round_to<T>(rotated * as_float(s[d]));
        o[d] = round_to<T>(as_float(a) + as_float(b));
      }
    }
  });
}

void check_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_cpu(x, "x");
  check_cpu(cos, "cos");
  check_cpu(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim], head_dim contiguous");
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  const int64_t tokens = x.size(0), dim = x.size(2);
  TORCH_CHECK(cos.size(-1) == dim && sin.size(-1) == dim && cos.numel() == tokens * dim &&
              sin.numel() == tokens * dim, "cos/sin must be [tokens, 1, head_dim]");
  TORCH_CHECK(cos.dtype() == x.dtype() && sin.dtype() == x.dtype(), "cos/sin must have x's dtype");
}

void run_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  auto c = cos.reshape({tokens, dim}).contiguous();
  auto s = sin.reshape({tokens, dim}).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rotary", [&] {
    rotate<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), c.data_ptr<scalar_t>(),
                     s.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), out.stride(0), out.stride(1),
                     tokens, heads, dim);
  });
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  RECORD_FUNCTION("twostep::rotary", c10::ArrayRef<c10::IValue>({}));
  check_rotary(x, cos, sin);
  auto out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  run_rotary(x, cos, sin, out);
  return out;
}

// The same rotation written back into x: q and k heads side by side in the qkv projection's
// output are one [T, H + Hkv, D] view, rotated in one call.
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  RECORD_FUNCTION("twostep::rotary_", c10::ArrayRef<c10::IValue>({}));
  check_rotary(x, cos, sin);
  run_rotary(x, cos, sin, x);
}

// k, v [T, Hkv, D] (any token stride, heads and D contiguous) to the cache's slots: values
// [2, blocks, block_size, Hkv, D] of the same dtype; the two index_copy_ calls of the PyTorch code.
void write_kv(at::Tensor values, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  RECORD_FUNCTION("twostep::write_kv", c10::ArrayRef<c10::IValue>({}));
  check_cpu(values, "values");
  TORCH_CHECK(values.dim() == 5 && values.is_contiguous(), "values: contiguous [2, blocks, block_size, Hkv, D]");
  TORCH_CHECK(k.dtype() == values.dtype() && v.dtype() == values.dtype(), "k, v: the cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots: contiguous int64 [T]");
  const int64_t tokens = slots.size(0), heads = values.size(3), dim = values.size(4);
  const int64_t capacity = values.size(1) * values.size(2), row = heads * dim;
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == heads && t->size(2) == dim,
                "k, v: [T, Hkv, D] matching the cache");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == dim, "k, v: heads and head_dim contiguous");
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "slot ", sp[t], " out of range");
  const int64_t bytes = row * values.element_size();
  char* base = static_cast<char*>(values.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(base + sp[t] * bytes, kp + t * ks, bytes);
    std::memcpy(base + (capacity + sp[t]) * bytes, vp + t * vs, bytes);
  }
}

// The index of the first maximum of x[0, n) as torch.argmax takes it: NaN counts as the largest
// value (the first NaN wins), ties go to the first. One pass for the maximum (and whether there is
// a NaN), one for its first position.
inline int64_t first_max_index(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef TWOSTEP_AVX2
  if (n >= 32) {              // four running maxima, so the loop is not one chain of dependent maxes
    __m256 m[4], unordered = _mm256_setzero_ps();
    for (auto& v : m) v = _mm256_set1_ps(best);
    for (; i + 32 <= n; i += 32)
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
        m[j] = _mm256_max_ps(m[j], v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
    nan = _mm256_movemask_ps(unordered) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    for (float v : lanes) best = v > best ? v : best;
  }
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = x[i] > best ? x[i] : best;
  }
  i = 0;
#ifdef TWOSTEP_AVX2
  const __m256 target = _mm256_set1_ps(best);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hit != 0) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == best) return i;
  return 0;   // not reached: the maximum is one of the values
}

// x [rows, V] float32 -> [rows] int64: each row's first maximum, torch.argmax(x, dim=-1)'s answer
// (the greedy sampler's pick) in one call, where torch's CPU argmax walks a row a value at a time
// with its index (sample/argmax.py's first_argmax takes ~10 torch ops to avoid that).
at::Tensor first_argmax(const at::Tensor& x) {
  RECORD_FUNCTION("twostep::first_argmax", c10::ArrayRef<c10::IValue>({}));
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "x: float32 [rows, V], V > 0");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  auto out = at::empty({rows}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = first_max_index(xp + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(twostep, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv(Tensor(a!) values, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("first_argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(twostep, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
  m.impl("rotary_", &rotary_);
  m.impl("write_kv", &write_kv);
  m.impl("first_argmax", &first_argmax);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of the last dimension, normalised in float32");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of residual");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[..., :I]) * x[..., I:]");
  m.def("rotary", &rotary, "x * cos + rotate_half(x) * sin, rounded as the PyTorch ops round");
  m.def("rotary_", &rotary_, "rotary, written back into x");
  m.def("write_kv", &write_kv, "k and v to the cache's slots");
  m.def("first_argmax", &first_argmax, "each row's first maximum, as torch.argmax(x, dim=-1)");
}
