// The panel layout's matrix-vector product for a few rows (up to kPanelCallRows a call) of int16
// activation codes: per panel of 8 weight rows, passes of up to 4 rows (8 with AVX-512's 32
// registers) whose sums are the panel's 8 output columns in the 8 lanes of a vector.
#include "codes.h"
#include "products.h"

#include <ATen/Parallel.h>

namespace twostep::quant {

#ifdef TWOSTEP_AVX2
namespace {

// The int32 sums of M rows' activations (quads[m], from the first chunk pair's quad) against `pairs`
// chunk pairs of a panel's 8-bit block from `chunks`: total[m]'s lane j for the panel's row j. A
// independent sums each of lo and hi a row (two at one row), so that four to eight multiply-add
// chains are in flight.
template <int M, int A>
inline void quad_sums(const uint8_t* chunks, int pairs, const int16_t* const quads[M], __m256i total[M]) {
  __m256i lo_sums[M][A], hi_sums[M][A];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < A; ++i) lo_sums[m][i] = hi_sums[m][i] = _mm256_setzero_si256();
  for (int p0 = 0; p0 < pairs; p0 += A) {
#pragma GCC unroll 2
    for (int i = 0; i < A; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * (p0 + i)));
      const __m256i lo = _mm256_srai_epi16(_mm256_unpacklo_epi8(v, v), 8);
      const __m256i hi = _mm256_srai_epi16(_mm256_unpackhi_epi8(v, v), 8);
      for (int m = 0; m < M; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quads[m] + 16 * (p0 + i)));
        lo_sums[m][i] = dot16(lo_sums[m][i], lo, x);
        hi_sums[m][i] = dot16(hi_sums[m][i], hi, x);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    __m256i lo = lo_sums[m][0], hi = hi_sums[m][0];
    for (int i = 1; i < A; ++i) lo = _mm256_add_epi32(lo, lo_sums[m][i]), hi = _mm256_add_epi32(hi, hi_sums[m][i]);
    // a lane of lo and hi per chunk: rows 0-3 are lo's two lanes summed, rows 4-7 hi's (extracts and
    // an insert: vperm2i128 is 8 micro-ops on a Zen 1)
    const __m128i rows0 = _mm_add_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
    const __m128i rows4 = _mm_add_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    total[m] = _mm256_inserti128_si256(_mm256_castsi128_si256(rows0), rows4, 1);
  }
}

// activations m0.. (M rows) against one panel: result[m][j] for the panel's 8 rows. Per block, the
// codes of a chunk widened to int16 once for all M rows; each multiplies a broadcast pair of
// activations into int32 sums, A independent sums a row so that about eight multiply-add chains
// are in flight (a chain waits ~4 cycles a step and the core issues up to ~1.6 a cycle; four chains,
// as 4 rows with one sum each had, reach ~60% of that); then per group in the block (G16: two) and row one
// conversion and two FMAs with the eight rows' scales, the zero point entering through the
// activations' half-block sums, the mins once per group through the group sums.
template <int BITS, int M, bool G16>
inline void panel_dot(const Planes& p, int64_t panel, const QuantizedActivations& a, int64_t m0,
                      float result[][kPanel]) {
  constexpr int A = kWidePass ? (M <= 2 ? 4 : M <= 4 ? 2 : 1) : (M == 1 ? 4 : M == 2 ? 2 : 1);
  constexpr int kChunks = qs_bytes(BITS) * kPanel / 16, kHalves = G16 ? 2 : 1;
  const int64_t k = p.k, nb = k / kBlock, groups = p.groups_row(), per_group = G16 ? 1 : p.group / kBlock;
  const uint8_t* qs = p.qs + panel * nb * panel_block(BITS);
  const at::Half* scales = p.scales + panel * groups * kPanel;
  const __m256i nibble = _mm256_set1_epi16(0x0F);
  const float zero = static_cast<float>(p.zero);
  const float* x32[M];            // the int16 codes read as pairs (one float-sized load a pair)
  const int16_t* quad_rows[M];    // or as quads (kQuadPasses, 8-bit)
  __m256 acc[M];
  for (int m = 0; m < M; ++m) {
    x32[m] = reinterpret_cast<const float*>(a.q.data() + (m0 + m) * k);
    quad_rows[m] = BITS == 8 && kQuadPasses ? a.quads.data() + (m0 + m) * (k / 4) * 16 : nullptr;
    acc[m] = _mm256_setzero_ps();
  }
  int64_t g_block = 0, left = per_group;   // the block's group (no division a block: an idiv is
                                           // ~40 cycles on a Zen 1, in a block of ~80)
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = qs + b * panel_block(BITS);
    prefetch_ahead(block, panel_block(BITS));
    for (int h = 0; h < kHalves; ++h) {
      __m256i total[M];
      __m256i sums[M][A];
      for (int m = 0; m < M; ++m)
        for (int i = 0; i < A; ++i) sums[m][i] = _mm256_setzero_si256();
      if constexpr (BITS == 8 && kQuadPasses) {
        constexpr int kPairs = kChunks / kHalves / 2;
        const int16_t* quads[M];
        for (int m = 0; m < M; ++m) quads[m] = quad_rows[m] + (b * (kBlock / 4) + h * kPairs) * 16;
        quad_sums<M, M == 1 ? 2 : 1>(block + 32 * h * kPairs, kPairs, quads, total);
      } else if constexpr (BITS == 8) {
        // (AVX-512 builds) A chunks a step, one to each sum: unrolled whole (as below), GCC ran the
        // 4-row pass's products ahead of their adds and spilled them to the stack (AVX2, before it
        // took the quads)
        for (int i0 = 0; i0 < kChunks / kHalves; i0 += A) {
#pragma GCC unroll 4
          for (int i = 0; i < A; ++i) {
            const int c = h * (kChunks / kHalves) + i0 + i;
            const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * c)));
            for (int m = 0; m < M; ++m) {
              const __m256i x = _mm256_castps_si256(_mm256_broadcast_ss(x32[m] + b * 16 + c));
              sums[m][i] = dot16(sums[m][i], w, x);
            }
          }
        }
      } else {
        __m256i high = _mm256_setzero_si256();
        // the half's chunks unrolled, so the sums' indices and the shifts are constants (registers, immediates)
#pragma GCC unroll 16
        for (int i = 0; i < kChunks / kHalves; ++i) {
          const int c = h * (kChunks / kHalves) + i;
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * c));
          const __m256i v = _mm256_cvtepu8_epi16(raw);
          __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_srli_epi16(v, 4);
          if constexpr (BITS > 4) {
            constexpr int P = high_chunks(BITS);
            if (i % P == 0)       // (a half starts a vector: i % P is c % P, known once unrolled)
              high = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kNibbleChunks + 16 * (c / P))));
            add_high<BITS>(i % P, lo, hi, high, high_mask16<BITS>());
          }
          for (int m = 0; m < M; ++m) {
            const __m256i x0 = _mm256_castps_si256(_mm256_broadcast_ss(x32[m] + b * 16 + 2 * c));
            const __m256i x1 = _mm256_castps_si256(_mm256_broadcast_ss(x32[m] + b * 16 + 2 * c + 1));
            sums[m][(2 * i) % A] = dot16(sums[m][(2 * i) % A], lo, x0);
            sums[m][(2 * i + 1) % A] = dot16(sums[m][(2 * i + 1) % A], hi, x1);
          }
        }
      }
      const int64_t g = G16 ? 2 * b + h : g_block;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + g * kPanel)));
      if constexpr (!(BITS == 8 && kQuadPasses))
        for (int m = 0; m < M; ++m) {
          total[m] = sums[m][0];
          for (int i = 1; i < A; ++i) total[m] = _mm256_add_epi32(total[m], sums[m][i]);
        }
      for (int m = 0; m < M; ++m) {
        const int64_t at = (m0 + m) * nb + b;
        // sum_i (q_i - zero) x_i = xd * sum_i q_i xq_i - zero * (the half blocks' sums of x); without
        // a zero point (8-bit codes, formats with mins) the product alone, the same value (~6% of an 8-row
        // Q8_0 pass)
        const __m256 integer = _mm256_cvtepi32_ps(total[m]), scale = _mm256_set1_ps(a.scale[at]);
        __m256 dot;
        if (p.zero == 0) {
          dot = _mm256_mul_ps(integer, scale);
        } else {
          const float xsum = G16 ? a.half_sums[2 * at + h] : a.half_sums[2 * at] + a.half_sums[2 * at + 1];
          dot = _mm256_fmsub_ps(integer, scale, _mm256_set1_ps(zero * xsum));
        }
        acc[m] = _mm256_fmadd_ps(d, dot, acc[m]);
      }
    }
    if (--left == 0) ++g_block, left = per_group;
  }
  if (p.mins) {
    const at::Half* mins = p.mins + panel * groups * kPanel;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g * kPanel)));
      for (int m = 0; m < M; ++m)
        acc[m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.group_sums[(m0 + m) * groups + g]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(result[m], acc[m]);
}

template <int BITS, bool G16, typename out_t>
void gemv_panels(const Planes& p, int64_t n, int64_t m, const QuantizedActivations& a, out_t* out, int64_t stride) {
  at::parallel_for(0, n / kPanel, 2, [&](int64_t begin, int64_t end) {
    float r[kPanelCallRows][kPanel];
    for (int64_t panel = begin; panel < end; ++panel) {
      // 8 rows in one pass where the registers hold their sums (AVX-512's 32); else, and for the
      // last 1-7 rows, passes of up to 4 over the panel, all but the first from L1 (or L2)
      for (int64_t m0 = 0; m0 < m;) {
        const int64_t rows = m - m0 >= 8 && kWidePass ? 8 : std::min<int64_t>(4, m - m0);
        switch (rows) {
          case 1: panel_dot<BITS, 1, G16>(p, panel, a, m0, r + m0); break;
          case 2: panel_dot<BITS, 2, G16>(p, panel, a, m0, r + m0); break;
          case 3: panel_dot<BITS, 3, G16>(p, panel, a, m0, r + m0); break;
          case 4: panel_dot<BITS, 4, G16>(p, panel, a, m0, r + m0); break;
          default: if constexpr (kWidePass) panel_dot<BITS, 8, G16>(p, panel, a, m0, r + m0); break;
        }
        m0 += rows;
      }
      for (int64_t row = 0; row < m; ++row) store_rounded(r[row], out + row * stride + panel * kPanel, kPanel);
    }
  });
}

template <typename out_t>
void gemv_panel_formats(const Planes& p, int64_t n, int64_t m, const QuantizedActivations& a, out_t* out,
                        int64_t stride) {
  with_format(p, [&](auto bits, auto g16) {
    gemv_panels<decltype(bits)::value, decltype(g16)::value>(p, n, m, a, out, stride);
  });
}

}  // namespace

template <typename out_t>
void panels_gemv(const Planes& p, int64_t n, int64_t m, const QuantizedActivations& a, out_t* out, int64_t stride) {
  gemv_panel_formats(p, n, m, a, out, stride);
}

#else
template <typename out_t>
void panels_gemv(const Planes&, int64_t, int64_t, const QuantizedActivations&, out_t*, int64_t) {}   // (ops.cpp refuses the panel layout without AVX2)
#endif

#define TWOSTEP_PANELS_GEMV(T) \
  template void panels_gemv<T>(const Planes&, int64_t, int64_t, const QuantizedActivations&, T*, int64_t);
TWOSTEP_FOR_OUTPUTS(TWOSTEP_PANELS_GEMV)

}  // namespace twostep::quant
