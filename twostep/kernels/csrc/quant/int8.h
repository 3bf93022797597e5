// What the int8 product's two kernels share (gemm_int8.cpp for tiles of rows, gemv_int8.cpp for a
// few rows): the vectors of one or two panels, the zero point's and the mins' terms, and the
// storing of a row's sums. Both add the same terms in the same order, so a row's result does not
// depend on how many rows share its call (a decode row's logits do not depend on its batch).
#pragma once

#include "activations.h"
#include "codes.h"

namespace twostep::quant {

#ifdef TWOSTEP_AVX2
// The int8 product's vectors for P panels side by side (P * 8 output columns): a panel in 256 bits,
// or, where AVX-512 VNNI is, two panels in 512 bits, so that one broadcast of a row's activations
// serves both (kernel alone, Zen 4, 32 rows: 1.1-1.4x one panel at a time). `next`: the distance to
// the second panel's codes / floats.
template <int P>
struct PanelLanes;

template <>
struct PanelLanes<1> {
  using I = __m256i;
  using V = __m256;
  static I zero() { return _mm256_setzero_si256(); }
  static V zero_floats() { return _mm256_setzero_ps(); }
  static I codes(const uint8_t* w, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
  static I join(__m256i first, __m256i) { return first; }
  static I dot(I acc, I w, int32_t four) { return dot8(acc, w, _mm256_set1_epi32(four)); }
  static I minus(I v, int32_t x) { return _mm256_sub_epi32(v, _mm256_set1_epi32(x)); }
  static V floats(const float* v, int64_t) { return _mm256_loadu_ps(v); }
  static V join_floats(__m256 first, __m256) { return first; }
  static V to_floats(I v) { return _mm256_cvtepi32_ps(v); }
  static V splat(float x) { return _mm256_set1_ps(x); }
  static V times(V v, float x) { return _mm256_mul_ps(v, splat(x)); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static void store(float* out, V v) { _mm256_storeu_ps(out, v); }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline constexpr bool kPanelPairs = true;
template <>
struct PanelLanes<2> {
  using I = __m512i;
  using V = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static V zero_floats() { return _mm512_setzero_ps(); }
  static I codes(const uint8_t* w, int64_t next) {
    return join(PanelLanes<1>::codes(w, 0), PanelLanes<1>::codes(w + next, 0));
  }
  static I join(__m256i first, __m256i second) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
  }
  static I dot(I acc, I w, int32_t four) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(four)); }
  static I minus(I v, int32_t x) { return _mm512_sub_epi32(v, _mm512_set1_epi32(x)); }
  static V floats(const float* v, int64_t next) { return join_floats(_mm256_loadu_ps(v), _mm256_loadu_ps(v + next)); }
  static V join_floats(__m256 first, __m256 second) {
    const __m256d lo = _mm256_castps_pd(first), hi = _mm256_castps_pd(second);
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
  }
  static V to_floats(I v) { return _mm512_cvtepi32_ps(v); }
  static V splat(float x) { return _mm512_set1_ps(x); }
  static V times(V v, float x) { return _mm512_mul_ps(v, splat(x)); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static void store(float* out, V v) { _mm512_storeu_ps(out, v); }
};
#else
inline constexpr bool kPanelPairs = false;
#endif

// zero x the sum of each row's codes in each block (G16: half block), [m, blocks, halves]: what
// the zero point (and 8-bit codes' 128) takes off a block's integer sum, sum (q - z) x = sum q x -
// z sum x, exact in int32; read from memory as one broadcast a row and block. Empty for zero 0.
inline Buffer<int32_t> zero_terms_of(const Int8Activations& a, int64_t m, int64_t nb, int32_t zero, bool g16) {
  if (zero == 0) return {};
  Buffer<int32_t> out(m * nb * (g16 ? 2 : 1));
  for (int64_t i = 0; i < m * nb; ++i) {
    const int32_t* s = a.half_sums.data() + 2 * i;
    if (g16) out[2 * i] = zero * s[0], out[2 * i + 1] = zero * s[1];
    else out[i] = zero * (s[0] + s[1]);
  }
  return out;
}

// cols sums of a tile's row into out: whole panels rounded 8 at a time (a bf16 output's scalar
// conversions took 13% of a 1-row product)
template <typename out_t>
inline void store_sums(const float* sums, out_t* out, int cols) {
  const int whole = cols / kPanel * kPanel;
  store_rounded(sums, out, whole);
  for (int j = whole; j < cols; ++j) out[j] = static_cast<out_t>(sums[j]);
}

// The offsets' term of R rows' sums, sum_g offsets(g) * (row r's group sum g), added to acc: four
// chains of FMAs (groups g % 4) summed pairwise at the end, so that a row's result does not wait
// on one FMA's latency per group (one chain took a fifth of a 1-row Q4_0 product). Every path of
// the int8 product adds them so, for the same sums whatever the number of rows.
template <typename L, int R, typename Offsets>
inline void add_offsets(typename L::V acc[R], const Offsets& offsets, const float* group_sums, int64_t m0,
                        int64_t groups) {
  typename L::V chains[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) chains[r][c] = L::zero_floats();
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {      // (unrolled: the chains' index a constant, they stay in registers)
      const int64_t g = g0 + c;
      if (g >= groups) break;
      const typename L::V o = offsets(g);
      for (int r = 0; r < R; ++r) chains[r][c] = L::fmadd(o, L::splat(group_sums[(m0 + r) * groups + g]), chains[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    acc[r] = L::add(acc[r], L::add(L::add(chains[r][0], chains[r][1]), L::add(chains[r][2], chains[r][3])));
}

// out[r, j] for R rows from m0 and P panels' 8 P columns (the second panel's codes code_next bytes
// after the first's, its scales and offsets float_next floats after). Without VNNI (one panel):
// F steps of 4 codes the int16 sums take before they could overflow (2 * F * max code * 128 <=
#endif

}  // namespace twostep::quant
