// gemm_f32: what gemm_bf16 is to bf16 rows, for the float32 rows of CPUs without native bf16 (AVX2
// alone: Zen 1-3, older Intel; AVX-512 without BF16: Ice Lake), where the other way is dequantized
// tiles through MKL's float32 GEMM: oneDNN's float brgemm on weights dequantized 64 rows x 1024
// weights at a time.
#include "brgemm.h"
#include "codes.h"
#include "products.h"

#include <ATen/Parallel.h>

#include <memory>

namespace twostep::quant {

#if defined(TWOSTEP_AVX2) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define TWOSTEP_F32_GEMM 1
#endif

#ifdef TWOSTEP_F32_GEMM
namespace {

constexpr int64_t kF32Columns = 64;    // weight rows (output columns) a task dequantizes
constexpr int64_t kF32Rows = 256;      // rows of x a task multiplies
constexpr int64_t kF32Depth = 1024;    // weights (of k) dequantized and multiplied at a time: 256 KB of floats

// Block b of one panel as floats in the layout brgemm multiplies ([k][columns]): weight i's 8 rows
// at dst + i * stride. pair_halves gives a step pair's code pairs (16-bit lane j: row j's codes
// 2c, 2c + 1); a byte shuffle puts each code's 8 rows side by side, widened and scaled 8 at a time.
// d[h], o[h]: the scales and offsets (min - zero * scale) of the block's half h.
template <int BITS>
inline void dequantize_block_columns(const uint8_t* block, const __m256 d[2], const __m256 o[2], float* dst,
                                     int64_t stride) {
  const __m256i by_code = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int p = 0; p < 4; ++p) {
    __m256i halves[2];                      // codes 4s, 4s + 1 | 4s + 2, 4s + 3 (steps s = 2p, 2p + 1)
    pair_halves<BITS>(block, p, halves[0], halves[1]);
    const int h = p / 2;                    // the half block of codes 8p .. 8p + 7
    for (int f = 0; f < 2; ++f) {
      const __m256i v = _mm256_shuffle_epi8(halves[f], by_code);
      for (int lane = 0; lane < 2; ++lane) {
        const __m128i codes = lane ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
        for (int u = 0; u < 2; ++u) {
          const __m128i eight = u ? _mm_srli_si128(codes, 8) : codes;
          const __m256i ints = BITS == 8 ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
          const int i = 4 * (2 * p + lane) + 2 * f + u;
          _mm256_storeu_ps(dst + i * stride, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), d[h], o[h]));
        }
      }
    }
  }
}

// Weight rows n0 .. n0 + cols (whole panels, at most kF32Columns), weights k0 .. k0 + depth, as
// floats [depth][kF32Columns] (a narrower tail keeps the stride: one leading dimension for brgemm)
template <int BITS>
void dequantize_columns(const Planes& p, int64_t n0, int64_t cols, int64_t k0, int64_t depth, float* w) {
  const int64_t nb = p.k / kBlock;
  for (int64_t q = 0; q < cols / kPanel; ++q) {
    const int64_t panel = n0 / kPanel + q;
    const uint8_t* qs = p.qs + panel * nb * panel_block(BITS);
    for (int64_t b = k0 / kBlock; b < (k0 + depth) / kBlock; ++b) {
      __m256 d[2], o[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t at = p.scale_at(panel * kPanel, p.group_of(b * kBlock + 16 * h));
        d[h] = load8(p.scales + at);
        o[h] = _mm256_fnmadd_ps(_mm256_set1_ps(static_cast<float>(p.zero)), d[h],
                                p.mins ? load8(p.mins + at) : _mm256_setzero_ps());
      }
      dequantize_block_columns<BITS>(qs + b * panel_block(BITS), d, o,
                                     w + (b * kBlock - k0) * kF32Columns + q * kPanel, kF32Columns);
    }
  }
}

// out[m, n] (rows out_stride apart) = x[m] . w[n] for the panel layout: tasks of kF32Columns weight
// rows x kF32Rows rows of x; per kF32Depth weights a task dequantizes its columns into its buffer
// (in L2) and multiplies its rows against them with brgemm, adding into out
template <int BITS>
void gemm_f32_panels(const Planes& p, int64_t n, int64_t m, const float* x, int64_t x_stride, float* out,
                     int64_t out_stride) {
  const int64_t k = p.k, row_blocks = (m + kF32Rows - 1) / kF32Rows;
  const int64_t tasks = (n + kF32Columns - 1) / kF32Columns * row_blocks;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> w(new float[kF32Depth * kF32Columns]);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task / row_blocks * kF32Columns, m0 = task % row_blocks * kF32Rows;
      const int64_t cols = std::min(kF32Columns, n - n0), rows = std::min(kF32Rows, m - m0);
      for (int64_t k0 = 0; k0 < k; k0 += kF32Depth) {
        const int64_t depth = std::min(kF32Depth, k - k0);
        dequantize_columns<BITS>(p, n0, cols, k0, depth, w.get());
        // as gemm_bf16: from 64 rows the rows rounded down to 16, then the rest (brgemm's kernels
        // are compiled and cached per shape)
        for (int64_t r0 = 0, piece; r0 < rows; r0 += piece) {
          piece = rows - r0 >= 64 ? (rows - r0) / 16 * 16 : rows - r0;
          at::native::cpublas::brgemm(piece, cols, depth, x_stride, kF32Columns, out_stride, k0 > 0,
                                      x + (m0 + r0) * x_stride + k0, w.get(), out + (m0 + r0) * out_stride + n0);
        }
      }
    }
    at::native::cpublas::brgemm_release(false);
  });
}

}  // namespace

// whether torch's float brgemm runs here (oneDNN's, where its CPU check passes; else torch's own loop)
bool brgemm_f32_runs() { return brgemm_runs<float>(); }

void panels_gemm_f32(const Planes& p, int64_t n, int64_t m, const float* x, int64_t x_stride, float* out,
                     int64_t out_stride) {
  with_bits(p.bits, [&](auto b) { gemm_f32_panels<decltype(b)::value>(p, n, m, x, x_stride, out, out_stride); });
}
#else
bool brgemm_f32_runs() { return false; }
void panels_gemm_f32(const Planes&, int64_t, int64_t, const float*, int64_t, float*, int64_t) {}
#endif

}  // namespace twostep::quant
