// The decode step of a Gated DeltaNet linear-attention layer (Qwen3.5, Qwen3-Next) for B sequences
// of one new token each, after the layer's input projections and before its output projection: the
// depthwise causal conv1d over the last K inputs (its state shifted in place), SiLU, q and k
// L2-normalised, the gated delta rule on each value head's recurrent state (in place), and the gated
// RMSNorm of the heads' outputs. HF transformers' Qwen3_5GatedDeltaNet with causal_conv1d_update and
// torch_recurrent_gated_delta_rule, in one call instead of ~40 torch ops.
//
// The math is float32, in HF's order, and rounds to the model's dtype T where HF's module hands a T
// tensor on (nowhere for float32): the conv's sum and its SiLU, sigmoid(b), the heads' outputs, the
// normalised output and its product with the weight, the result. The recurrent state is float32.
//
// One task per (sequence, key head): the channels of its q and k heads and of the Hv / Hk value
// heads that share them are the task's own, so it runs their conv and shifts their conv state, then
// its value heads' updates, without a second parallel pass or a race. A value head's state S [Dk,
// Dv] is updated 32 columns at a time (each column's kv_mem, delta and output need that column
// alone): a pass down the column block decays it and sums kv_mem in registers, a second (the block,
// 16 KB at Dk = 128, still in L1) writes the decayed state plus k delta^T and sums the output; S is
// read once and written once. AVX2 paths where the build has them (AVX-512 builds take them too),
// plain loops for the tails and elsewhere.
#include <torch/csrc/utils/pybind.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// x rounded to T and widened again: what a torch op with a T output hands to the next one
template <typename T>
inline float rounded(float x) { return static_cast<float>(static_cast<T>(x)); }

// torch's float formulas: silu(x) = x / (1 + exp(-x)), sigmoid(x) = 1 / (1 + exp(-x)),
// softplus(x) = x above the threshold 20, else log1p(exp(x))
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

#ifdef TWOSTEP_AVX2
inline __m256 silu8(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
#endif

// x[i] rounded to T in place (nothing for float32)
template <typename T>
void round_row(float* x, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    int64_t i = 0;
#ifdef TWOSTEP_AVX2
    if constexpr (std::is_same_v<T, at::BFloat16>)
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, widen_bf16(to_bf16(_mm256_loadu_ps(x + i))));
#endif
    for (; i < n; ++i) x[i] = rounded<T>(x[i]);
  }
}

// x[i] = silu(x[i]) in place
void silu_row(float* x, int64_t n) {
  int64_t i = 0;
#ifdef TWOSTEP_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, silu8(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = silu(x[i]);
}

#ifdef TWOSTEP_AVX2
// The [8 channels, 4 taps] block of a conv weight at w as 4 vectors of 8 channels, one per tap: a
// 4x4 transpose in each half (channels 0 2 4 6 | 1 3 5 7), then the channels put in order.
template <typename T>
inline void taps4(const T* w, __m256 tap[4]) {
  const __m256 r0 = load8(w), r1 = load8(w + 8), r2 = load8(w + 16), r3 = load8(w + 24);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  tap[0] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), order);
  tap[1] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)), order);
  tap[2] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), order);
  tap[3] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)), order);
}

template <typename T>
inline __m256 rounded8(__m256 v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) return widen_bf16(to_bf16(v));
  return v;
}
#endif

// The conv of channels c0 .. c0 + n of one sequence: y[i] = silu(sum_{j < K-1} w[c, j] state[j][c] +
// w[c, K-1] x[c]) for c = c0 + i, the sum and the SiLU each rounded to T (HF's conv1d and silu in
// T); then the state's rows move up one and x becomes its newest (row K-2). state: [K-1, C] of one
// slot, time-major; w: [C, K]. K = 4 (Qwen's) takes 8 channels at a time where the build has AVX2.
template <typename T>
void conv_channels(const T* x, T* state, const T* w, int64_t C, int64_t K, int64_t c0, int64_t n, float* y) {
  int64_t i = 0;
#ifdef TWOSTEP_AVX2
  if (K == 4)
    for (; i + 8 <= n; i += 8) {
      const int64_t c = c0 + i;
      __m256 tap[4];
      taps4(w + c * 4, tap);
      __m256 acc = _mm256_mul_ps(tap[0], load8(state + c));
      acc = _mm256_fmadd_ps(tap[1], load8(state + C + c), acc);
      acc = _mm256_fmadd_ps(tap[2], load8(state + 2 * C + c), acc);
      acc = _mm256_fmadd_ps(tap[3], load8(x + c), acc);
      _mm256_storeu_ps(y + i, rounded8<T>(silu8(rounded8<T>(acc))));
    }
#endif
  for (; i < n; ++i) {
    const int64_t c = c0 + i;
    float acc = 0.0f;
    for (int64_t j = 0; j + 1 < K; ++j) acc += as_float(w[c * K + j]) * as_float(state[j * C + c]);
    acc += as_float(w[c * K + K - 1]) * as_float(x[c]);
    y[i] = rounded<T>(silu(rounded<T>(acc)));
  }
  for (int64_t j = 0; j + 2 < K; ++j) std::memcpy(state + j * C + c0, state + (j + 1) * C + c0, n * sizeof(T));
  std::memcpy(state + (K - 2) * C + c0, x + c0, n * sizeof(T));
}

// x *= scale / sqrt(sum(x^2) + 1e-6): HF's l2norm (and the query's Dk^-0.5 with it)
void l2_normalise(float* x, int64_t n, float scale) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

// The delta rule on columns [0, n) of a value head's state S (row stride ld, Dk rows), n <= kBlock:
// S *= decay; kv = k^T S; delta = (v - kv) beta; S += k delta^T; o = q^T S. Plain loops.
constexpr int64_t kBlock = 32;

void update_columns(float* S, int64_t dk, int64_t ld, int64_t n, const float* q, const float* k,
                    const float* v, float decay, float beta, float* o) {
  float kv[kBlock] = {}, delta[kBlock], out[kBlock] = {};
  for (int64_t r = 0; r < dk; ++r) {
    const float* row = S + r * ld;
    for (int64_t j = 0; j < n; ++j) kv[j] += row[j] * decay * k[r];
  }
  for (int64_t j = 0; j < n; ++j) delta[j] = (v[j] - kv[j]) * beta;
  for (int64_t r = 0; r < dk; ++r) {
    float* row = S + r * ld;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = row[j] * decay + k[r] * delta[j];
      out[j] += row[j] * q[r];
    }
  }
  for (int64_t j = 0; j < n; ++j) o[j] = out[j];
}

#ifdef TWOSTEP_AVX2
// The same on 8 NV columns, the sums in registers: 4 vectors' chains of fused multiply-adds keep the
// two FMA pipes busy, and the 11 live vectors of the second pass fit AVX2's 16 registers. The first
// pass waits on memory (a state comes from L3 or DRAM): the second asks for the next block's rows
// (`next`, the same rows' next columns or the next head's state; null: none) into L2.
template <int NV>
void update_columns8(float* S, int64_t dk, int64_t ld, const float* q, const float* k, const float* v,
                     float decay, float beta, float* o, const float* next) {
  const __m256 dec = _mm256_set1_ps(decay);
  __m256 acc[NV], delta[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t r = 0; r < dk; ++r) {
    const float* row = S + r * ld;
    const __m256 kr = _mm256_set1_ps(k[r]);
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(row + 8 * j), dec), kr, acc[j]);
  }
  const __m256 b = _mm256_set1_ps(beta);
  for (int j = 0; j < NV; ++j) {
    delta[j] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + 8 * j), acc[j]), b);
    acc[j] = _mm256_setzero_ps();                 // now the output's sums
  }
  for (int64_t r = 0; r < dk; ++r) {
    float* row = S + r * ld;
    if (next != nullptr)
      for (int j = 0; j < NV; j += 2) _mm_prefetch(reinterpret_cast<const char*>(next + r * ld + 8 * j), _MM_HINT_T1);
    const __m256 kr = _mm256_set1_ps(k[r]), qr = _mm256_set1_ps(q[r]);
    for (int j = 0; j < NV; ++j) {
      const __m256 s = _mm256_fmadd_ps(kr, delta[j], _mm256_mul_ps(_mm256_loadu_ps(row + 8 * j), dec));
      _mm256_storeu_ps(row + 8 * j, s);
      acc[j] = _mm256_fmadd_ps(s, qr, acc[j]);
    }
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(o + 8 * j, acc[j]);
}
#endif

// One value head's state S [dk, dv] updated in place, its output at o [dv]; next: the state updated
// after this one (or null), asked for ahead.
void update_head(float* S, int64_t dk, int64_t dv, const float* q, const float* k, const float* v, float decay,
                 float beta, float* o, const float* next) {
  int64_t c = 0;
#ifdef TWOSTEP_AVX2
  for (; c + 32 <= dv; c += 32)
    update_columns8<4>(S + c, dk, dv, q, k, v + c, decay, beta, o + c, c + 64 <= dv ? S + c + 32 : next);
  for (; c + 8 <= dv; c += 8) update_columns8<1>(S + c, dk, dv, q, k, v + c, decay, beta, o + c, nullptr);
#else
  (void)next;
#endif
  for (; c < dv; c += kBlock)
    update_columns(S + c, dk, dv, std::min(kBlock, dv - c), q, k, v + c, decay, beta, o + c);
}

// out = o * rsqrt(mean(o^2) + eps) (rounded to T), times the weight (rounded to T where the weight
// is T, as HF's weight * x), times silu(z) in float32, rounded to T. o is first rounded to T (the
// delta rule's output in T). gate: scratch of dv floats.
template <typename T>
void gated_norm(float* o, const T* z, const float* weight, bool round_product, float eps, int64_t dv, float* gate,
                T* out) {
  round_row<T>(o, dv);
  float sum = 0.0f;
  for (int64_t i = 0; i < dv; ++i) sum += o[i] * o[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dv) + eps);
  for (int64_t i = 0; i < dv; ++i) o[i] *= inv;
  round_row<T>(o, dv);
  for (int64_t i = 0; i < dv; ++i) o[i] *= weight[i];
  if (round_product) round_row<T>(o, dv);
  int64_t i = 0;
#ifdef TWOSTEP_AVX2
  for (; i + 8 <= dv; i += 8) _mm256_storeu_ps(gate + i, load8(z + i));
#endif
  for (; i < dv; ++i) gate[i] = as_float(z[i]);
  silu_row(gate, dv);
  for (i = 0; i < dv; ++i) out[i] = static_cast<T>(o[i] * gate[i]);
}

struct Shape {
  int64_t batch, hk, hv, dk, dv, channels, k_size;
};

template <typename T>
void run(const Shape& s, const T* qkv, int64_t qkv_stride, const T* z, int64_t z_stride, const T* a, int64_t a_stride,
         const T* b, int64_t b_stride, T* conv_state, float* recurrent, const int64_t* slots, const T* conv_weight,
         const float* a_log, const float* dt_bias, const float* norm_weight, bool round_product, float eps, T* out) {
  const int64_t group = s.hv / s.hk, C = s.channels, K = s.k_size;
  const int64_t key_dim = s.hk * s.dk, head_state = s.dk * s.dv;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(s.dk));
  at::parallel_for(0, s.batch * s.hk, 1, [&](int64_t t0, int64_t t1) {
    // the task's conv outputs: its q head, its k head, its value heads; then one head's output and gate
    std::vector<float> scratch(2 * s.dk + group * s.dv + 2 * s.dv);
    float *q = scratch.data(), *k = q + s.dk, *v = k + s.dk, *o = v + group * s.dv, *gate = o + s.dv;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t seq = t / s.hk, kh = t % s.hk, slot = slots[seq];
      const T* x = qkv + seq * qkv_stride;
      T* state = conv_state + slot * (K - 1) * C;
      auto conv = [&](int64_t c0, int64_t n, float* y) { conv_channels(x, state, conv_weight, C, K, c0, n, y); };
      conv(kh * s.dk, s.dk, q);
      conv(key_dim + kh * s.dk, s.dk, k);
      conv(2 * key_dim + kh * group * s.dv, group * s.dv, v);
      l2_normalise(q, s.dk, q_scale);
      l2_normalise(k, s.dk, 1.0f);
      for (int64_t i = 0; i < group; ++i) {
        const int64_t h = kh * group + i;
        const float g = -std::exp(a_log[h]) * softplus(as_float(a[seq * a_stride + h]) + dt_bias[h]);
        const float beta = rounded<T>(sigmoid(as_float(b[seq * b_stride + h])));
        // the state this thread updates next: the group's next head, or the next task's first
        const float* next = i + 1 < group ? recurrent + (slot * s.hv + h + 1) * head_state
                            : t + 1 < t1 ? recurrent + (slots[(t + 1) / s.hk] * s.hv + ((t + 1) % s.hk) * group) * head_state
                                         : nullptr;
        update_head(recurrent + (slot * s.hv + h) * head_state, s.dk, s.dv, q, k, v + i * s.dv, std::exp(g), beta, o,
                    next);
        gated_norm(o, z + seq * z_stride + h * s.dv, norm_weight, round_product, eps, s.dv, gate,
                   out + (seq * s.hv + h) * s.dv);
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && (cols <= 1 || t.stride(1) == 1),
              name, ": [", rows, ", ", cols, "] with its last dimension contiguous");
}

// A small parameter as contiguous float32 of n values (a copy where it is another dtype).
at::Tensor floats(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.numel() == n && at::isFloatingType(t.scalar_type()), name,
              ": ", n, " floating-point values on the CPU");
  return t.reshape({n}).to(at::kFloat).contiguous();
}

// mixed_qkv [B, C] (q Hk*Dk | k Hk*Dk | v Hv*Dv, C = 2 Hk Dk + Hv Dv), z [B, Hv*Dv], a, b [B, Hv]: the
// model's dtype (float32 or bf16), each row's values contiguous. conv_state [S, K-1, C] (that dtype,
// time-major: row K-2 the newest input) and recurrent [S, Hv, Dk, Dv] (float32): contiguous, the
// rows slots[i] of sequence i read and written in place (slots: int64 [B], distinct). conv_weight
// [C, K] (the model's dtype), A_log, dt_bias [Hv] and norm_weight [Dv] (any float dtype). -> [B,
// Hv*Dv] in the model's dtype.
at::Tensor gated_delta_decode(const at::Tensor& mixed_qkv, const at::Tensor& z, const at::Tensor& a,
                              const at::Tensor& b, at::Tensor conv_state, at::Tensor recurrent,
                              const at::Tensor& slots, const at::Tensor& conv_weight, const at::Tensor& A_log,
                              const at::Tensor& dt_bias, const at::Tensor& norm_weight, double eps,
                              int64_t num_k_heads, int64_t head_k_dim, int64_t head_v_dim) {
  RECORD_FUNCTION("twostep::gated_delta_decode", c10::ArrayRef<c10::IValue>({}));
  const auto dtype = mixed_qkv.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "mixed_qkv: float32 or bfloat16");
  TORCH_CHECK(num_k_heads > 0 && head_k_dim > 0 && head_v_dim > 0, "head counts and sizes must be positive");
  TORCH_CHECK(mixed_qkv.dim() == 2, "mixed_qkv: [B, conv_dim]");
  Shape s;
  s.batch = mixed_qkv.size(0);
  s.hk = num_k_heads, s.dk = head_k_dim, s.dv = head_v_dim;
  s.channels = mixed_qkv.size(1);
  const int64_t value_dim = s.channels - 2 * s.hk * s.dk;
  TORCH_CHECK(value_dim > 0 && value_dim % s.dv == 0, "mixed_qkv: 2 * num_k_heads * head_k_dim + Hv * head_v_dim channels");
  s.hv = value_dim / s.dv;
  TORCH_CHECK(s.hv % s.hk == 0, "the value heads (", s.hv, ") must be a multiple of the key heads (", s.hk, ")");
  check_rows(mixed_qkv, "mixed_qkv", s.batch, s.channels);
  check_rows(z, "z", s.batch, value_dim);
  check_rows(a, "a", s.batch, s.hv);
  check_rows(b, "b", s.batch, s.hv);
  for (const at::Tensor* t : {&z, &a, &b, static_cast<const at::Tensor*>(&conv_state), &conv_weight})
    TORCH_CHECK(t->scalar_type() == dtype, "z, a, b, conv_state and conv_weight: mixed_qkv's dtype");
  TORCH_CHECK(conv_weight.device().is_cpu() && conv_weight.dim() == 2 && conv_weight.size(0) == s.channels &&
              conv_weight.size(1) >= 2, "conv_weight: [conv_dim, K], K >= 2");
  s.k_size = conv_weight.size(1);
  TORCH_CHECK(conv_state.device().is_cpu() && conv_state.is_contiguous() && conv_state.dim() == 3 &&
              conv_state.size(1) == s.k_size - 1 && conv_state.size(2) == s.channels,
              "conv_state: contiguous [slots, K-1, conv_dim]");
  const int64_t n_slots = conv_state.size(0);
  TORCH_CHECK(recurrent.device().is_cpu() && recurrent.scalar_type() == at::kFloat && recurrent.is_contiguous() &&
              recurrent.dim() == 4 && recurrent.size(0) == n_slots && recurrent.size(1) == s.hv &&
              recurrent.size(2) == s.dk && recurrent.size(3) == s.dv,
              "recurrent: contiguous float32 [slots, Hv, head_k_dim, head_v_dim], as many slots as conv_state");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
              slots.size(0) == s.batch, "slots: int64 [B]");
  const auto slot_ids = slots.contiguous();
  std::vector<int64_t> sorted(slot_ids.data_ptr<int64_t>(), slot_ids.data_ptr<int64_t>() + s.batch);
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK(sorted.empty() || (sorted.front() >= 0 && sorted.back() < n_slots), "a slot out of range [0, ", n_slots, ")");
  TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "slots must be distinct");
  const auto weight = conv_weight.contiguous();
  const auto a_log = floats(A_log, "A_log", s.hv), bias = floats(dt_bias, "dt_bias", s.hv);
  const auto norm = floats(norm_weight, "norm_weight", s.dv);
  // HF's weight * x rounds to T where the weight is T (a float32 weight keeps the float32 product)
  const bool round_product = norm_weight.scalar_type() == dtype;
  auto out = at::empty({s.batch, value_dim}, mixed_qkv.options());
  auto call = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    run<T>(s, mixed_qkv.data_ptr<T>(), mixed_qkv.stride(0), z.data_ptr<T>(), z.stride(0), a.data_ptr<T>(),
           a.stride(0), b.data_ptr<T>(), b.stride(0), conv_state.data_ptr<T>(), recurrent.data_ptr<float>(),
           slot_ids.data_ptr<int64_t>(), weight.data_ptr<T>(), a_log.data_ptr<float>(), bias.data_ptr<float>(),
           norm.data_ptr<float>(), round_product, static_cast<float>(eps), out.data_ptr<T>());
  };
  if (dtype == at::kFloat)
    call(static_cast<float*>(nullptr));
  else
    call(static_cast<at::BFloat16*>(nullptr));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(twostep, m) {
  m.def("gated_delta_decode(Tensor mixed_qkv, Tensor z, Tensor a, Tensor b, Tensor(a!) conv_state, "
        "Tensor(b!) recurrent, Tensor slots, Tensor conv_weight, Tensor A_log, Tensor dt_bias, Tensor norm_weight, "
        "float eps, int num_k_heads, int head_k_dim, int head_v_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(twostep, CPU, m) { m.impl("gated_delta_decode", &gated_delta_decode); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gated_delta_decode", &gated_delta_decode,
        "a Gated DeltaNet layer's decode step for B sequences of one token: conv, delta rule, gated RMSNorm; "
        "conv_state and recurrent updated in place at the sequences' slots",
        pybind11::arg("mixed_qkv"), pybind11::arg("z"), pybind11::arg("a"), pybind11::arg("b"),
        pybind11::arg("conv_state"), pybind11::arg("recurrent"), pybind11::arg("slots"), pybind11::arg("conv_weight"),
        pybind11::arg("A_log"), pybind11::arg("dt_bias"), pybind11::arg("norm_weight"), pybind11::arg("eps"),
        pybind11::arg("num_k_heads"), pybind11::arg("head_k_dim"), pybind11::arg("head_v_dim"));
}
