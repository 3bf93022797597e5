// y = x W^T (+ bias) for a bfloat16 weight W [N, K] and few rows of x [M, K] (batch-1 decode),
// reading W once in its stored row-major layout. Decode is bound by how fast the weights stream
// from memory, so each path below streams W's 2 bytes a weight once:
// - x in bfloat16: 32-element dot products accumulated in float32 with AVX512-BF16
//   (_mm512_dpbf16_ps), output rounded to bfloat16; ~1.3x oneDNN's pre-packed GEMV here
//   (benchmarks/bench_linear.py). Built without AVX512-BF16, has_bf16_dot() is false and callers
//   keep oneDNN.
// - x in float32 (a float32 model whose weights are bf16 values, platforms/cpu/bf16_weights.py):
//   the weights widened to float32 in registers (a bf16 is the top half of a float32: exact) and
//   multiplied with fused multiply-adds, output float32. AVX2+FMA where the CPU has them, plain C++
//   elsewhere: half the bytes of the float32 weight, on CPUs without native bf16 too.
#include <torch/csrc/utils/pybind.h>
#include <ATen/Functions.h>
#include <ATen/record_function.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TWOSTEP_HAVE_BF16_DOT 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define TWOSTEP_HAVE_AVX2 1
#endif
#if defined(TWOSTEP_HAVE_BF16_DOT) || defined(TWOSTEP_HAVE_AVX2)
#include <immintrin.h>
#endif

namespace {

#ifdef TWOSTEP_HAVE_BF16_DOT

constexpr int64_t MAX_M = 4;           // rows of x per pass over a row of W
constexpr int64_t PREFETCH = 4096;     // bytes

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// out[m] = dot(x[m], w) for m < NM; K elements each. Two accumulators per row of x (even and odd
// 32-element chunks) halve the dependency chain of the fused multiply-adds.
template <int64_t NM>
inline void dot_row(const uint16_t* x, int64_t K, const uint16_t* w, float* out) {
  __m512 even[NM], odd[NM];
  for (int64_t m = 0; m < NM; ++m) even[m] = odd[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    // Ask for the weight 4 KB ahead (into L2): ~6% more bandwidth than the hardware prefetcher alone.
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + PREFETCH, _MM_HINT_T2);
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + PREFETCH + 64, _MM_HINT_T2);
    const __m512bh w0 = load_bf16(w + k), w1 = load_bf16(w + k + 32);
    for (int64_t m = 0; m < NM; ++m) {
      even[m] = _mm512_dpbf16_ps(even[m], load_bf16(x + m * K + k), w0);
      odd[m] = _mm512_dpbf16_ps(odd[m], load_bf16(x + m * K + k + 32), w1);
    }
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (K - k)) - 1);
    const __m512bh w0 = load_bf16(w + k, mask);
    for (int64_t m = 0; m < NM; ++m) even[m] = _mm512_dpbf16_ps(even[m], load_bf16(x + m * K + k, mask), w0);
  }
  for (int64_t m = 0; m < NM; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
}

inline void dot_row(const uint16_t* x, int64_t nm, int64_t K, const uint16_t* w, float* out) {
  switch (nm) {
    case 4: dot_row<4>(x, K, w, out); break;
    case 3: dot_row<3>(x, K, w, out); break;
    case 2: dot_row<2>(x, K, w, out); break;
    default: dot_row<1>(x, K, w, out); break;
  }
}

// Each thread streams a contiguous range of W's rows, one row at a time: one sequential stream per
// thread is what the hardware prefetcher follows best (interleaving several rows measured slower).
void linear_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                 int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    float out[MAX_M];
    for (int64_t n = n0; n < n1; ++n) {
      const float b = bias ? static_cast<float>(c10::BFloat16(bias[n], c10::BFloat16::from_bits())) : 0.0f;
      for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {   // later passes find the row in cache
        const int64_t nm = std::min(MAX_M, M - m0);
        dot_row(x + m0 * K, nm, K, w + n * K, out);
        for (int64_t m = 0; m < nm; ++m) y[(m0 + m) * N + n] = c10::BFloat16(out[m] + b).x;
      }
    }
  });
}

#endif  // TWOSTEP_HAVE_BF16_DOT

// ---- float32 activations ----------------------------------------------------------------------

constexpr int64_t MAX_M_F32 = 4;     // rows of x per pass over a row of W
constexpr int64_t CHUNK = 16;        // weights per step: one 256-bit load of bf16

inline float widen(uint16_t bits) { return c10::BFloat16(bits, c10::BFloat16::from_bits()); }

// x's rows laid out for the widening below: within each chunk of 16, the 8 even-indexed elements
// then the 8 odd ones (a tail shorter than a chunk stays in order).
void split_even_odd(const float* x, int64_t M, int64_t K, float* out) {
  const int64_t whole = K / CHUNK * CHUNK;
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float* dst = out + m * K;
    for (int64_t k = 0; k < whole; k += CHUNK) {
      for (int64_t i = 0; i < CHUNK / 2; ++i) {
        dst[k + i] = row[k + 2 * i];
        dst[k + CHUNK / 2 + i] = row[k + 2 * i + 1];
      }
    }
    for (int64_t k = whole; k < K; ++k) dst[k] = row[k];
  }
}

// out[m] = dot(x[m], w) for m < NM, x split as above. Sixteen bf16 weights are eight 32-bit words:
// the even-indexed weights are their low halves (shifted up 16 bits they are float32), the odd ones
// their high halves (the low 16 bits cleared). Two instructions widen 16 weights, and no shuffle.
// U chunks a step, each into its own accumulators: enough independent multiply-adds to cover their
// latency (one row: 8 chains).
template <int64_t NM>
inline void dot_row_f32(const float* xs, int64_t K, const uint16_t* w, float* out) {
  const int64_t whole = K / CHUNK * CHUNK;
  float tail[NM] = {};
#ifdef TWOSTEP_HAVE_AVX2
  constexpr int64_t U = NM == 1 ? 4 : NM == 2 ? 2 : 1;
  __m256 acc[NM][2 * U];
  for (int64_t m = 0; m < NM; ++m)
    for (int64_t u = 0; u < 2 * U; ++u) acc[m][u] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t k = 0;
  for (; k + U * CHUNK <= whole; k += U * CHUNK) {
    for (int64_t u = 0; u < U; ++u) {
      const int64_t c = k + u * CHUNK;
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      for (int64_t m = 0; m < NM; ++m) {
        acc[m][2 * u] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + m * K + c), we, acc[m][2 * u]);
        acc[m][2 * u + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + m * K + c + CHUNK / 2), wo, acc[m][2 * u + 1]);
      }
    }
  }
  for (; k < whole; k += CHUNK) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
    for (int64_t m = 0; m < NM; ++m) {
      acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + m * K + k), we, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + m * K + k + CHUNK / 2), wo, acc[m][1]);
    }
  }
  for (int64_t m = 0; m < NM; ++m) {
    __m256 sum = acc[m][0];
    for (int64_t u = 1; u < 2 * U; ++u) sum = _mm256_add_ps(sum, acc[m][u]);
    const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    tail[m] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
  }
#else
  for (int64_t k = 0; k < whole; k += CHUNK) {
    for (int64_t i = 0; i < CHUNK / 2; ++i) {
      const float we = widen(w[k + 2 * i]), wo = widen(w[k + 2 * i + 1]);
      for (int64_t m = 0; m < NM; ++m) {
        tail[m] += xs[m * K + k + i] * we + xs[m * K + k + CHUNK / 2 + i] * wo;
      }
    }
  }
#endif
  for (int64_t k = whole; k < K; ++k) {
    const float wk = widen(w[k]);
    for (int64_t m = 0; m < NM; ++m) tail[m] += xs[m * K + k] * wk;
  }
  for (int64_t m = 0; m < NM; ++m) out[m] = tail[m];
}

inline void dot_row_f32(const float* xs, int64_t nm, int64_t K, const uint16_t* w, float* out) {
  switch (nm) {
    case 4: dot_row_f32<4>(xs, K, w, out); break;
    case 3: dot_row_f32<3>(xs, K, w, out); break;
    case 2: dot_row_f32<2>(xs, K, w, out); break;
    default: dot_row_f32<1>(xs, K, w, out); break;
  }
}

void linear_rows_f32(const float* xs, const uint16_t* w, const float* bias, float* y,
                     int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    float out[MAX_M_F32];
    for (int64_t n = n0; n < n1; ++n) {
      const float b = bias ? bias[n] : 0.0f;
      for (int64_t m0 = 0; m0 < M; m0 += MAX_M_F32) {   // later passes find the row in cache
        const int64_t nm = std::min(MAX_M_F32, M - m0);
        dot_row_f32(xs + m0 * K, nm, K, w + n * K, out);
        for (int64_t m = 0; m < nm; ++m) y[(m0 + m) * N + n] = out[m] + b;
      }
    }
  });
}

// Built for the machine it runs on, but a cached build can meet another CPU: ask this one too.
bool has_bf16_dot() {
#ifdef TWOSTEP_HAVE_BF16_DOT
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

bool has_float32_path() {
#ifdef TWOSTEP_HAVE_AVX2
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return true;   // plain C++
#endif
}

const char* float32_path() {
#ifdef TWOSTEP_HAVE_AVX2
  return "AVX2";
#else
  return "plain C++";
#endif
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias) {
  RECORD_FUNCTION("twostep::linear_bf16", c10::ArrayRef<c10::IValue>({}));
  TORCH_CHECK(x.is_cpu() && w.is_cpu(), "CPU tensors only");
  TORCH_CHECK(w.dtype() == at::kBFloat16, "the weight must be bfloat16");
  const bool bf16_x = x.dtype() == at::kBFloat16;
  TORCH_CHECK(bf16_x || x.dtype() == at::kFloat, "the input must be bfloat16 or float32");
  TORCH_CHECK(bf16_x ? has_bf16_dot() : has_float32_path(),
              bf16_x ? "bfloat16 inputs need a build with AVX512-BF16" : "float32 inputs need AVX2 and FMA here");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous [N, K] matrix");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K > 0, "weight has no columns");
  TORCH_CHECK(x.size(-1) == K, "input has ", x.size(-1), " features, weight ", K);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_cpu() && bias->dtype() == x.dtype() && bias->numel() == N,
                "bias must be a CPU tensor [N] in the input's dtype");
    bias_c = bias->contiguous();
  }
  const auto* weight = reinterpret_cast<const uint16_t*>(w.data_ptr());
  if (M == 0) return y.view(sizes);
  if (!bf16_x) {
    std::vector<float> split(static_cast<size_t>(M * K));
    split_even_odd(x2.data_ptr<float>(), M, K, split.data());
    linear_rows_f32(split.data(), weight, bias_c.defined() ? bias_c.data_ptr<float>() : nullptr,
                    y.data_ptr<float>(), M, N, K);
    return y.view(sizes);
  }
#ifdef TWOSTEP_HAVE_BF16_DOT
  linear_rows(reinterpret_cast<const uint16_t*>(x2.data_ptr()), weight,
              bias_c.defined() ? reinterpret_cast<const uint16_t*>(bias_c.data_ptr()) : nullptr,
              reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K);
#endif
  return y.view(sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(twostep, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(twostep, CPU, m) { m.impl("linear_bf16", &linear_bf16); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_bf16_dot", &has_bf16_dot, "whether bfloat16 inputs run here (the AVX512-BF16 path)");
  m.def("has_float32_path", &has_float32_path, "whether float32 inputs run here");
  m.def("float32_path", &float32_path, "the float32 inputs' path: AVX2 or plain C++");
  m.def("linear_bf16", &linear_bf16, "y = x W^T + b for a bf16 weight W, few rows of x (bf16 or float32)");
}
