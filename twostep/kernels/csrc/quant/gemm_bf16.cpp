// gemm_bf16: bf16 rows against the panel layout through oneDNN's brgemm (AVX512-BF16 or AMX), the
// prefill product of bf16 models: a thread dequantizes 64 weight rows at a time into the pair
// layout brgemm multiplies (in its L2) and multiplies every row of x against them, at the rate of
// oneDNN on pre-packed bf16 weights (the panel layout's chunks are already pairs of 8 rows).
#include "brgemm.h"
#include "codes.h"
#include "products.h"

#include <ATen/Parallel.h>

#include <memory>

namespace twostep::quant {

// torch's brgemm with add_C (the CPUBLAS_BRGEMM_* macros came with it); older torch keeps the tiles
#if defined(TWOSTEP_AVX2) && defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__) && \
    defined(CPUBLAS_BRGEMM_BF16BF16F32)
#define TWOSTEP_BF16_GEMM 1
#endif

#ifdef TWOSTEP_BF16_GEMM
namespace {

// The blocking (Qwen2.5-0.5B-shape linears, 512 rows, Zen 4, two threads: 0.99-1.00x oneDNN's
// product on pre-packed bf16 weights with these; 64 / 128 / whole depth: 0.97x for k = 4864)
constexpr int64_t kGemmColumns = 64;   // weight rows (output columns) a thread dequantizes at a time
constexpr int64_t kGemmRows = 256;     // rows of x in one brgemm call
constexpr int64_t kGemmDepth = 1024;   // weights (of k) a brgemm call sums over; the next add to its sums

// lanes 2j, 2j + 1 = v[j]: a panel's 8 values, once for each weight of a pair
inline __m512 spread2(__m256 v) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castps256_ps512(v));
}

// A panel's scales and offsets (min - zero * scale) for the group of weight i, spread for its pairs
struct PairScales {
  __m512 d, o;
};
inline PairScales pair_scales(const Planes& p, int64_t panel, int64_t i) {
  const int64_t at = p.scale_at(panel * kPanel, p.group_of(i));
  const __m256 d = load8(p.scales + at);
  const __m256 o = _mm256_fnmadd_ps(_mm256_set1_ps(static_cast<float>(p.zero)), d,
                                    p.mins ? load8(p.mins + at) : _mm256_setzero_ps());
  return {spread2(d), spread2(o)};
}

// a pair of a panel's codes (lanes 2j + u: row j's weight u) as floats, scale * code + offset
template <int BITS>
inline __m512 pair_values(__m128i codes, const PairScales& s) {
  const __m512i ints = BITS == 8 ? _mm512_cvtepi8_epi32(codes) : _mm512_cvtepu8_epi32(codes);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), s.d, s.o);
}

// Block b of two panels (16 weight rows; `second` null: one panel, 8 rows) as bf16 in the pair layout
// brgemm multiplies (B as [k / 2][columns][2]): the block's pair t (weights 2t, 2t + 1) of each row
// at dst + t * pair_stride, 32 (16) values. The panel layout's chunks are already pairs of 8 rows.
// scales[panel][h]: the scales and offsets of the block's half h (its weights 16h ..).
template <int BITS>
inline void dequantize_block_pairs(const uint8_t* first, const uint8_t* second, const PairScales scales[2][2],
                                   at::BFloat16* dst, int64_t pair_stride) {
  for (int s = 0; s < 8; ++s) {
    const int h = s / 4;
    __m128i a0, b0, a1, b1;     // pairs 2s (a) and 2s + 1 (b) of each panel
    panel_pairs<BITS>(first, s, a0, b0);
    const __m512 fa0 = pair_values<BITS>(a0, scales[0][h]), fb0 = pair_values<BITS>(b0, scales[0][h]);
    at::BFloat16* pair = dst + 2 * s * pair_stride;
    if (second == nullptr) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pair), (__m256i)_mm512_cvtneps_pbh(fa0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pair + pair_stride), (__m256i)_mm512_cvtneps_pbh(fb0));
      continue;
    }
    panel_pairs<BITS>(second, s, a1, b1);
    const __m512 fa1 = pair_values<BITS>(a1, scales[1][h]), fb1 = pair_values<BITS>(b1, scales[1][h]);
    _mm512_storeu_si512(pair, (__m512i)_mm512_cvtne2ps_pbh(fa1, fa0));
    _mm512_storeu_si512(pair + pair_stride, (__m512i)_mm512_cvtne2ps_pbh(fb1, fb0));
  }
}

// Weight rows n0 .. n0 + cols (whole panels, at most kGemmColumns) as bf16 in the pair layout,
// [k / 2][kGemmColumns][2] (a narrower tail keeps the stride: one leading dimension for brgemm)
template <int BITS>
void dequantize_pairs(const Planes& p, int64_t n0, int64_t cols, at::BFloat16* w) {
  const int64_t nb = p.k / kBlock, panels = cols / kPanel;
  for (int64_t q = 0; q < panels; q += 2) {
    const bool two = q + 1 < panels;
    const int64_t panel = n0 / kPanel + q;
    const uint8_t* first = p.qs + panel * nb * panel_block(BITS);
    const uint8_t* second = two ? first + nb * panel_block(BITS) : nullptr;
    PairScales scales[2][2];
    for (int64_t b = 0; b < nb; ++b) {
      if (b * kBlock % p.group == 0)
        for (int j = 0; j < (two ? 2 : 1); ++j)
          for (int h = 0; h < 2; ++h) scales[j][h] = pair_scales(p, panel + j, b * kBlock + 16 * h);
      dequantize_block_pairs<BITS>(first + b * panel_block(BITS), two ? second + b * panel_block(BITS) : nullptr,
                                   scales, w + (b * (kBlock / 2) * kGemmColumns + q * kPanel) * 2, 2 * kGemmColumns);
    }
  }
}

// out[m, n] (rows out_stride apart) = x[m] . w[n] for the panel layout: tasks of kGemmColumns
// weight rows x kGemmRows rows of x, a column block's row blocks one after another, so a thread
// dequantizes each column block of its range into its buffer once (k x 128 bytes: in a 1 MB L2 up to
// k ~ 7000) and multiplies its rows against it with brgemm; float32 sums rounded to bf16. (Splitting
// rows too keeps more threads busy than a few column blocks would.)
template <int BITS>
void gemm_bf16_panels(const Planes& p, int64_t n, int64_t m, const at::BFloat16* x, int64_t x_stride,
                      at::BFloat16* out, int64_t out_stride) {
  const int64_t k = p.k, row_blocks = (m + kGemmRows - 1) / kGemmRows;
  const int64_t tasks = (n + kGemmColumns - 1) / kGemmColumns * row_blocks;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<at::BFloat16[]> w(new at::BFloat16[k * kGemmColumns]);
    std::unique_ptr<float[]> sums(new float[kGemmRows * kGemmColumns]);
    int64_t held = -1;      // the column block w holds
    // the next column block's weights, asked for while brgemm works on this one (Qwen-shape linears
    // on a Zen 5: Q4_0 1.04x at 64 rows, Q8_0 1.02x; 1.00x at 512, where brgemm's time dwarfs the read)
    ChunkAhead ahead;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / row_blocks, n0 = block * kGemmColumns, m0 = task % row_blocks * kGemmRows;
      const int64_t cols = std::min(kGemmColumns, n - n0), rows = std::min(kGemmRows, m - m0);
      if (block != held) {
        dequantize_pairs<BITS>(p, n0, cols, w.get());
        held = block;
        const int64_t next = n0 + kGemmColumns, own = std::min(end, (block + 1) * row_blocks) - task;
        if ((block + 1) * row_blocks < end)        // a slice before each of this block's brgemm calls
          ahead = ChunkAhead(p, BITS, next / kPanel, (std::min(kGemmColumns, n - next) + kPanel - 1) / kPanel,
                             own * ((k + kGemmDepth - 1) / kGemmDepth));
      }
      // from 64 rows, the block's rows rounded down to 16, then the rest: brgemm's kernels (compiled,
      // ~33 KB each, and cached per shape and thread for the process's life) come in 76 row counts,
      // not 256, whatever lengths the prompts have; fewer rows in one call (a second one read the
      // weights' buffer again: 40 rows of down_proj 0.94 -> 1.09 ms)
      for (int64_t r0 = 0, piece; r0 < rows; r0 += piece) {
        piece = rows - r0 >= 64 ? (rows - r0) / 16 * 16 : rows - r0;
        for (int64_t k0 = 0; k0 < k; k0 += kGemmDepth) {  // w's pairs k0 / 2 .. are at w + k0 * kGemmColumns
          ahead.step();                                     // asked for first: it arrives during the call
          at::native::cpublas::brgemm(piece, cols, std::min(kGemmDepth, k - k0), x_stride, kGemmColumns, kGemmColumns,
                                      k0 > 0, x + (m0 + r0) * x_stride + k0, w.get() + k0 * kGemmColumns,
                                      sums.get() + r0 * kGemmColumns);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        store_rounded(sums.get() + r * kGemmColumns, out + (m0 + r) * out_stride + n0, static_cast<int>(cols));
    }
    at::native::cpublas::brgemm_release();
  });
}

}  // namespace

// whether this build has gemm_bf16 and torch's brgemm multiplies bf16 on this CPU (oneDNN's
// ukernel: AVX512-BF16 or AMX)
bool brgemm_bf16_runs() { return brgemm_runs<at::BFloat16>(); }

void panels_gemm_bf16(const Planes& p, int64_t n, int64_t m, const c10::BFloat16* x, int64_t x_stride,
                      c10::BFloat16* out, int64_t out_stride) {
  with_bits(p.bits, [&](auto b) { gemm_bf16_panels<decltype(b)::value>(p, n, m, x, x_stride, out, out_stride); });
}
#else
bool brgemm_bf16_runs() { return false; }
void panels_gemm_bf16(const Planes&, int64_t, int64_t, const c10::BFloat16*, int64_t, c10::BFloat16*, int64_t) {}
#endif

}  // namespace twostep::quant
