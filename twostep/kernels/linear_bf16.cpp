// y = x W^T (+ bias) for bfloat16 x [M, K] and W [N, K] with few rows M (batch-1 decode), reading W
// once in its stored row-major layout: 32-element dot products accumulated in float32 with
// AVX512-BF16 (_mm512_dpbf16_ps), output rounded to bfloat16. Decode is bound by how fast the
// weights stream from memory; this path streams them at ~1.3x oneDNN's pre-packed GEMV here
// (benchmarks/bench_linear.py). Built without AVX512-BF16, available() is false and callers keep
// oneDNN.
#include <torch/extension.h>
#include <ATen/record_function.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TWOSTEP_HAVE_BF16_DOT 1
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

// Built for the machine it runs on, but a cached build can meet another CPU: ask this one too.
bool available() {
#ifdef TWOSTEP_HAVE_BF16_DOT
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w,
                          const c10::optional<torch::Tensor>& bias) {
  RECORD_FUNCTION("twostep::linear_bf16", c10::ArrayRef<c10::IValue>({}));
  TORCH_CHECK(available(), "built without AVX512-BF16");
  TORCH_CHECK(x.is_cpu() && w.is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && w.dtype() == torch::kBFloat16, "bfloat16 only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous [N, K] matrix");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K > 0, "weight has no columns");
  TORCH_CHECK(x.size(-1) == K, "input has ", x.size(-1), " features, weight ", K);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_cpu() && bias->dtype() == torch::kBFloat16 && bias->numel() == N,
                "bias must be a bf16 CPU tensor [N]");
    bias_c = bias->contiguous();
    b = reinterpret_cast<const uint16_t*>(bias_c.data_ptr());
  }
#ifdef TWOSTEP_HAVE_BF16_DOT
  linear_rows(reinterpret_cast<const uint16_t*>(x2.data_ptr()),
              reinterpret_cast<const uint16_t*>(w.data_ptr()), b,
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
  m.def("available", &available, "whether this build has the AVX512-BF16 path");
  m.def("linear_bf16", &linear_bf16, "y = x W^T + b for bf16, few rows of x");
}
