// The int8 product for a few rows (1 to kSmallRows - 1) of the panel layout: one user's decode.
//
// The same sums as panel_tile (bit for bit: the int32 sum of a block or half block, then per row one
// conversion and one FMA with the scales times the row's block scale, and the offsets per group at
// the end), so a decode row's logits do not depend on how many other rows share its step. What
// differs is how the codes reach the products. A step pair (two 16-byte chunks, codes 4s .. 4s + 7
// of the panel's eight rows) is decoded in 256-bit vectors as the two chunks lie (pair_halves), against a
// copy of the activations laid out to match:
//  - VNNI: the halves interleaved into quads, rows 0-3 of both steps in one vector and rows 4-7 in
//    the other, each against the step pair's two quads repeated four times, and the two steps'
//    halves added once per block. Per pair of steps, four instructions of nibble decoding and two
//    products, where panel_quad's 128-bit decoding takes seven a step and one chain a row waits on
//    every product: in cache, Qwen2.5-0.5B-shape Q4_0 linears, Zen 4, one thread: 1.45x the int16
//    matrix-vector passes' rate (43 against 30 GB/s), 2x the panel tile's.
//  - AVX2: no interleaving: vpmaddubsw multiplies each half as it is, a code pair of each row in
//    each 16-bit lane, against its activation pair repeated eight times (a step a 128-bit lane),
//    so the two halves' products add in int16 lanes that are the panel's rows, summed over as many
//    step pairs as cannot overflow and then widened: the rows' int32 sums in order, with no
//    shuffle (on Zen 1 the product is bound by micro-ops, not by its multiplies, and the two
//    unpacks a pair and the two lane-crossing permutes a block took a fifth of them).
#include "int8.h"
#include "products.h"

#include <ATen/Parallel.h>

namespace twostep::quant {

#ifdef TWOSTEP_AVX2
namespace {

// The activations' int8 codes as pair_quads multiplies them: per row and block, four 32-byte
// vectors, pair p's = quad 2p four times, then quad 2p + 1 four times
Buffer<int8_t> pair_layout(const Int8Activations& a, int64_t rows, int64_t k) {
  Buffer<int8_t> out(rows * k * 4);
  const __m256i spread[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                             _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  const int8_t* codes = a.q.data();
  int8_t* to = out.data();
  for (int64_t i = 0; i < rows * k / kBlock; ++i) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i * kBlock));
    for (int p = 0; p < 4; ++p)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + (4 * i + p) * 32), _mm256_permutevar8x32_epi32(q, spread[p]));
  }
  return out;
}

// The same for AVX2's products of pair_halves: per row, block and step pair p, two 32-byte vectors,
// codes 8p, 8p + 1 eight times then 8p + 4, 8p + 5 eight times (against `first`), and 8p + 2, 8p + 3
// then 8p + 6, 8p + 7 (against `second`)
Buffer<int8_t> half_pair_layout(const Int8Activations& a, int64_t rows, int64_t k) {
  Buffer<int8_t> out(rows * k * 8);
  const __m256i first = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                         4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5);
  const __m256i second = _mm256_add_epi8(first, _mm256_set1_epi8(2));
  const int8_t* codes = a.q.data();
  int8_t* to = out.data();
  for (int64_t i = 0; i < rows * k / 8; ++i) {      // a step pair's eight codes at a time
    int64_t eight;
    std::memcpy(&eight, codes + 8 * i, 8);
    const __m256i v = _mm256_set1_epi64x(eight);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 64 * i), _mm256_shuffle_epi8(v, first));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 64 * i + 32), _mm256_shuffle_epi8(v, second));
  }
  return out;
}

// The activations' copy the small-row product reads: per row and block, 128 bytes (VNNI) or 256
constexpr int64_t kPairBytes = kDpbusd ? 128 : 256;
Buffer<int8_t> small_row_layout(const Int8Activations& a, int64_t rows, int64_t k) {
  return kDpbusd ? pair_layout(a, rows, k) : half_pair_layout(a, rows, k);
}

// The panel's 8 rows' sums in order from pair_quads' two sums (rows 0-3 in each 128-bit lane of s0,
// rows 4-7 in s1's): each row's two lanes added
inline __m256i rows_in_order(__m256i s0, __m256i s1) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

// Where the CPU runs 512-bit vectors at full width (the build's -DTWOSTEP_WIDE_DOT, set by
// kernels/__init__.py), the small-row product takes two step pairs a vector: pair_quads' q0 of pairs
// 2i and 2i + 1 side by side, against 64 bytes of pair_layout as they lie (4 and 8-bit codes in
// groups of 32 or more; 5 and 6-bit codes and groups of 16 keep the 256-bit steps). The same int32
// sums in other lanes: the same bits. On a Zen 5 (AVX512-VNNI, two threads, Q4_0 / Q4_1 / Q4_K /
// Q8_0, 1, 2 and 4 rows, two runs): 1.09-1.22x the 256-bit steps on a layer's four linears in
// cache, 0.99-1.10x on a step's 97 streamed from memory (memory-bound there, more so at 1 row); a
// Zen 4 runs 512-bit vectors as two halves, where a microbenchmark found them 0.87x.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(TWOSTEP_WIDE_DOT)
template <int BITS, bool G16>
constexpr bool kWideDot = (BITS == 4 || BITS == 8) && !G16;

// Step pairs 2i and 2i + 1 of a block as pair_quads gives each, q0 of both in q0 and q1 of both in q1
template <int BITS>
inline void wide_quads(const uint8_t* block, int i, __m512i& q0, __m512i& q1) {
  __m512i first, second;
  if constexpr (BITS == 8) {
    const __m512i v0 = _mm512_loadu_si512(block + 128 * i), v1 = _mm512_loadu_si512(block + 128 * i + 64);
    first = _mm512_shuffle_i64x2(v0, v1, 0x88);    // 128-bit lanes 0 and 2 of v0, then of v1
    second = _mm512_shuffle_i64x2(v0, v1, 0xDD);   // lanes 1 and 3
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(block + 64 * i);
    first = _mm512_and_si512(v, nibble);
    second = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
  q0 = unsigned_code<BITS>(_mm512_unpacklo_epi16(first, second));
  q1 = unsigned_code<BITS>(_mm512_unpackhi_epi16(first, second));
}
#else
template <int BITS, bool G16>
constexpr bool kWideDot = false;
template <int BITS>
inline void wide_quads(const uint8_t*, int, __m512i&, __m512i&) {}   // never called
#endif

// M rows from m0 against one panel, into result[m][j]
template <int BITS, int M, bool G16>
inline void panel_dot_int8(const Planes& p, int64_t panel, const Int8Activations& a, const int8_t* pairs,
                           int64_t m0, bool offset, const int32_t* zero_terms, float result[][kPanel]) {
  constexpr int kHalves = G16 ? 2 : 1, kPairs = 4 / kHalves;
  constexpr int C = M <= 2 && kPairs > 2 ? 2 : 1;   // chains a row and vector: about eight products in flight
  const int64_t k = p.k, nb = k / kBlock, groups = p.groups_row(), per_group = G16 ? 1 : p.group / kBlock;
  const uint8_t* qs = p.qs + panel * nb * panel_block(BITS);
  const at::Half* scales = p.scales + panel * groups * kPanel;   // the panel's 8 per group
  const float* xd[M];
  const int8_t* x[M];
  __m256 acc[M];
  for (int m = 0; m < M; ++m) {
    xd[m] = a.scale.data() + (m0 + m) * nb;
    x[m] = pairs + (m0 + m) * nb * kPairBytes;
    acc[m] = _mm256_setzero_ps();
  }
  int64_t g = 0, left = per_group;          // the block's group (no division a block)
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = qs + b * panel_block(BITS);
    prefetch_ahead(block, panel_block(BITS));
    for (int h = 0; h < kHalves; ++h) {
      __m256i sum[M];             // the rows' int32 sums of the half, the panel's 8 rows in order
      if constexpr (kWideDot<BITS, G16>) {
        __m512i s0[M], s1[M];
        for (int m = 0; m < M; ++m) s0[m] = s1[m] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int i = 0; i < kPairs / 2; ++i) {
          __m512i q0, q1;
          wide_quads<BITS>(block, i, q0, q1);
          for (int m = 0; m < M; ++m) {
            const __m512i xv = _mm512_loadu_si512(x[m] + b * kPairBytes + i * 64);
            s0[m] = _mm512_dpbusd_epi32(s0[m], q0, xv);
            s1[m] = _mm512_dpbusd_epi32(s1[m], q1, xv);
          }
        }
        for (int m = 0; m < M; ++m) {     // each 128-bit lane holds rows 0-3 (s0) or 4-7 (s1): added
          const __m256i t0 = _mm256_add_epi32(_mm512_castsi512_si256(s0[m]), _mm512_extracti64x4_epi64(s0[m], 1));
          const __m256i t1 = _mm256_add_epi32(_mm512_castsi512_si256(s1[m]), _mm512_extracti64x4_epi64(s1[m], 1));
          sum[m] = rows_in_order(t0, t1);
        }
      } else if constexpr (kDpbusd) {
        __m256i s0[M][C], s1[M][C];
        for (int m = 0; m < M; ++m)
          for (int c = 0; c < C; ++c) s0[m][c] = s1[m][c] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int i = 0; i < kPairs; ++i) {
          __m256i q0, q1;
          pair_quads<BITS>(block, h * kPairs + i, q0, q1);
          for (int m = 0; m < M; ++m) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[m] + b * kPairBytes + (h * kPairs + i) * 32));
            s0[m][i % C] = dot8(s0[m][i % C], q0, xv);
            s1[m][i % C] = dot8(s1[m][i % C], q1, xv);
          }
        }
        for (int m = 0; m < M; ++m) {
          for (int c = 1; c < C; ++c) s0[m][0] = _mm256_add_epi32(s0[m][0], s0[m][c]), s1[m][0] = _mm256_add_epi32(s1[m][0], s1[m][c]);
          sum[m] = rows_in_order(s0[m][0], s1[m][0]);
        }
      } else {
        // W step pairs summed in int16 before they could overflow (each adds two products a lane,
        // each at most 2 x max code x 128: 4 W max code 128 <= 32767), then widened and added
        constexpr int W = std::max(1, 32767 / (4 * ((1 << BITS) - 1) * 128));
        __m256i t[M];
        for (int m = 0; m < M; ++m) sum[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int i = 0; i < kPairs; ++i) {
          __m256i first, second;
          pair_halves<BITS>(block, h * kPairs + i, first, second);
          for (int m = 0; m < M; ++m) {
            const int8_t* xv = x[m] + b * kPairBytes + (h * kPairs + i) * 64;
            const __m256i both = _mm256_add_epi16(
                _mm256_maddubs_epi16(first, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xv))),
                _mm256_maddubs_epi16(second, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xv + 32))));
            t[m] = i % W == 0 ? both : _mm256_add_epi16(t[m], both);
            if (i % W == W - 1 || i == kPairs - 1)     // the two steps' lanes widened and added
              sum[m] = _mm256_add_epi32(sum[m], _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(t[m])),
                                                                 _mm256_cvtepi16_epi32(_mm256_extracti128_si256(t[m], 1))));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + (G16 ? 2 * b + h : g) * kPanel)));
      for (int m = 0; m < M; ++m) {
        if (zero_terms) sum[m] = _mm256_sub_epi32(sum[m], _mm256_set1_epi32(zero_terms[((m0 + m) * nb + b) * kHalves + h]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), _mm256_mul_ps(d, _mm256_set1_ps(xd[m][b])), acc[m]);
      }
    }
    if (--left == 0) ++g, left = per_group;
  }
  if (offset) {                     // the mins, as Packed::offset reads them
    const at::Half* mins = p.mins + panel * groups * kPanel;
    add_offsets<PanelLanes<1>, M>(acc, [&](int64_t gi) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + gi * kPanel)));
    }, a.group_sums.data(), m0, groups);
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(result[m], acc[m]);
}

template <int BITS, bool G16, typename out_t>
void gemv_int8_bits(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride) {
  const Buffer<int8_t> pairs = small_row_layout(a, m, p.k);
  const bool offset = p.mins != nullptr;               // the mins' term (the zero point is in the sums)
  const Buffer<int32_t> zeros = zero_terms_of(a, m, p.k / kBlock, p.zero + kCodeBias<BITS>, G16);
  const int32_t* zero = zeros.empty() ? nullptr : zeros.data();
  at::parallel_for(0, n / kPanel, 2, [&](int64_t begin, int64_t end) {
    float r[kPanel][kPanel];
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t m0 = 0; m0 < m;) {       // up to 4 rows a pass (their sums fill the registers)
        const int64_t rows = std::min<int64_t>(4, m - m0);
        switch (rows) {
          case 1: panel_dot_int8<BITS, 1, G16>(p, panel, a, pairs.data(), m0, offset, zero, r + m0); break;
          case 2: panel_dot_int8<BITS, 2, G16>(p, panel, a, pairs.data(), m0, offset, zero, r + m0); break;
          case 3: panel_dot_int8<BITS, 3, G16>(p, panel, a, pairs.data(), m0, offset, zero, r + m0); break;
          default: panel_dot_int8<BITS, 4, G16>(p, panel, a, pairs.data(), m0, offset, zero, r + m0); break;
        }
        m0 += rows;
      }
      for (int64_t row = 0; row < m; ++row) store_sums(r[row], out + row * stride + panel * kPanel, kPanel);
    }
  });
}

template <typename out_t>
void gemv_int8_formats(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride) {
  with_format(p, [&](auto bits, auto g16) {
    constexpr int BITS = decltype(bits)::value;
    // 8-bit codes (groups of 32 or more) only with VNNI: ops.cpp refuses them otherwise
    if constexpr (BITS != 8 || kDpbusd) gemv_int8_bits<BITS, BITS != 8 && decltype(g16)::value>(p, n, m, a, out, stride);
  });
}

}  // namespace

template <typename out_t>
void gemv_int8_panels(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride) {
  gemv_int8_formats(p, n, m, a, out, stride);
}

#else
template <typename out_t>
void gemv_int8_panels(const Planes&, int64_t, int64_t, const Int8Activations&, out_t*, int64_t) {}   // (ops.cpp refuses the int8 product without AVX2)
#endif

#define TWOSTEP_GEMV_INT8_PANELS(T) \
  template void gemv_int8_panels<T>(const Planes&, int64_t, int64_t, const Int8Activations&, T*, int64_t);
TWOSTEP_FOR_OUTPUTS(TWOSTEP_GEMV_INT8_PANELS)

}  // namespace twostep::quant
