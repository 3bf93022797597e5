// The int8 product for many rows (prefill, large decode batches): activations quantized per block
// of 32 to int8 (activations.h), a panel of 8 weight rows' codes unpacked to bytes for every row
// of x, and u8 x s8 multiply-adds: with VNNI vpdpbusd straight into int32 (8-bit codes too, as
// code + 128 with the 128 taken back through the activations' sums; on AVX-512 8 rows a tile and
// two panels a 512-bit register); without it vpmaddubsw summed in int16 for as many steps as
// cannot overflow, then in int32. Per block, in float with the two scales.
#include "int8.h"
#include "products.h"

#include <ATen/Parallel.h>

namespace twostep::quant {

#ifdef TWOSTEP_AVX2
namespace {

// A panel of 8 weight rows (output columns) n0.. as bytes, block by block: block b's bytes
// 32 s + 4 j .. +3 are codes 4 s .. 4 s + 3 of column j; its scales and offsets (the mins: the
// zero point comes off the blocks' integer sums) per group, 8 floats each. Columns past n are zeros.
template <int BITS>
void unpack_panel(const Planes& p, int64_t n, int64_t n0, uint8_t* codes, float* scales, float* offsets) {
  const int64_t nb = p.k / kBlock, groups = p.groups_row();
  const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - n0));
  for (int64_t b = 0; p.panels && b < nb; ++b) {       // the panel layout: its chunks, interleaved
    __m256i c[kPanel];
    panel_quads<BITS>(p.qs + ((n0 / kPanel) * nb + b) * panel_block(BITS), c);
    unsigned_codes<BITS>(c);
    for (int s = 0; s < 8; ++s) _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kPanelBytes + 32 * s), c[s]);
  }
  for (int64_t b = 0; !p.panels && b < nb; ++b) {
    __m256i c[kPanel], t[kPanel];
    for (int j = 0; j < kPanel; ++j) {
      if (j < cols) {
        const int64_t row = n0 + j;
        c[j] = decode_block<BITS>(p.qs + row * p.qs_row() + b * qs_bytes(BITS),
                                  p.qh ? p.qh + row * p.qh_row() + b * qh_bytes(BITS) : nullptr);
      } else {
        c[j] = _mm256_setzero_si256();
      }
    }
    transpose8(c, t);
    unsigned_codes<BITS>(t);
    for (int s = 0; s < 8; ++s) _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kPanelBytes + 32 * s), t[s]);
  }
  for (int64_t g = 0; p.panels && g < groups; ++g) {   // the panel layout: a group's 8 scales side by side
    const int64_t at = p.scale_at(n0, g);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.scales + at)));
    const __m256 min = p.mins ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.mins + at)))
                              : _mm256_setzero_ps();
    _mm256_storeu_ps(scales + g * kPanel, d);
    _mm256_storeu_ps(offsets + g * kPanel, min);
  }
  for (int64_t g = 0; !p.panels && g < groups; ++g) {
    for (int j = 0; j < kPanel; ++j) {
      const int64_t at = p.scale_at(n0 + j, g);
      const float d = j < cols ? fp16(p.scales, at) : 0.f;
      scales[g * kPanel + j] = d;
      offsets[g * kPanel + j] = j < cols && p.mins ? fp16(p.mins, at) : 0.f;
    }
  }
}

// Where a tile's codes, scales and offsets come from, for P panels side by side: a chunk unpacked
// into memory, which every row tile of the chunk passes over again (Unpacked; the second panel's
// codes code_next bytes after the first's, its scales and offsets float_next floats after), or the
// panel layout itself, decoded step by step in registers as the tile multiplies (Packed): with a
// single row tile nothing is reused, and the weights' read overlaps the multiplies instead of
// preceding them (a chunk's unpacking, which is the read from memory, took 41% of an 8-row product)
template <int BITS, int P>
struct Unpacked {
  using L = PanelLanes<P>;
  const uint8_t* codes_;
  int64_t code_next;
  const float* scales_;
  const float* offsets_;
  int64_t float_next;
  typename L::I codes(int64_t b, int s) const { return L::codes(codes_ + b * kPanelBytes + 32 * s, code_next); }
  typename L::V scales(int64_t g) const { return L::floats(scales_ + g * kPanel, float_next); }
  typename L::V offsets(int64_t g) const { return L::floats(offsets_ + g * kPanel, float_next); }
};

template <int BITS, int P>
struct Packed {
  using L = PanelLanes<P>;
  const Planes& p;
  int64_t panel;                  // the first of the P panels
  const uint8_t* block(int i, int64_t b) const {
    return p.qs + ((panel + i) * (p.k / kBlock) + b) * panel_block(BITS);
  }
  __m256 halves(const at::Half* h, int i, int64_t g) const {    // panel i's 8 values of group g
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + p.scale_at((panel + i) * kPanel, g))));
  }
  __m256 offset(int i, int64_t g) const { return halves(p.mins, i, g); }   // (the min: the zero point is in the sums)
  typename L::I codes(int64_t b, int s) const {
    return L::join(unsigned_code<BITS>(panel_quad<BITS>(block(0, b), s)),
                   P > 1 ? unsigned_code<BITS>(panel_quad<BITS>(block(1, b), s)) : __m256i{});
  }
  typename L::V scales(int64_t g) const {
    return L::join_floats(halves(p.scales, 0, g), P > 1 ? halves(p.scales, 1, g) : __m256{});
  }
  typename L::V offsets(int64_t g) const { return L::join_floats(offset(0, g), P > 1 ? offset(1, g) : __m256{}); }
};

// out[r, j] for R rows from m0 and P panels' 8 P columns (the second panel's codes code_next bytes
// after the first's, its scales and offsets float_next floats after). Without VNNI (one panel):
// F steps of 4 codes the int16 sums take before they could overflow (2 * F * max code * 128 <=
// 32767). A group of 16 changes scale mid-block.
template <int BITS, int R, bool G16, int P, typename Source, typename out_t>
inline void panel_tile(const Source& src, const Int8Activations& a, int64_t m0, int64_t k, int64_t group,
                       bool offset, const int32_t* zero_terms, out_t* out, int64_t stride, int cols) {
  using L = PanelLanes<P>;
  constexpr int F = BITS == 4 ? 8 : BITS == 5 ? 4 : 2;
  constexpr int kHalves = G16 ? 2 : 1, kSteps = 8 / kHalves;
  const int64_t nb = k / kBlock, groups = k / group, per_group = G16 ? 1 : group / kBlock;
  const int8_t* x[R];
  const float* xd[R];
  typename L::V acc[R];
  for (int r = 0; r < R; ++r) {
    x[r] = a.q.data() + (m0 + r) * k;
    xd[r] = a.scale.data() + (m0 + r) * nb;
    acc[r] = L::zero_floats();
  }
  int64_t g_block = 0, left = per_group;   // the block's group (no division a block)
  for (int64_t b = 0; b < nb; ++b) {
    for (int h = 0; h < kHalves; ++h) {
      typename L::I sum[R];
      for (int r = 0; r < R; ++r) sum[r] = L::zero();
      if constexpr (kDpbusd) {
#pragma GCC unroll 8
        for (int s = h * kSteps; s < (h + 1) * kSteps; ++s) {
          const typename L::I w = src.codes(b, s);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, x[r] + b * kBlock + 4 * s, 4);
            sum[r] = L::dot(sum[r], w, four);
          }
        }
      } else {
        static_assert(P == 1, "panel pairs need VNNI");
        const __m256i ones = _mm256_set1_epi16(1);
        for (int f = 0; f < kSteps; f += F) {
          __m256i t[R];
          for (int r = 0; r < R; ++r) t[r] = _mm256_setzero_si256();
          for (int s = h * kSteps + f; s < h * kSteps + f + F; ++s) {
            const __m256i w = src.codes(b, s);
            for (int r = 0; r < R; ++r) {
              int32_t four;
              std::memcpy(&four, x[r] + b * kBlock + 4 * s, 4);
              t[r] = _mm256_add_epi16(t[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(four)));
            }
          }
          for (int r = 0; r < R; ++r) sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(t[r], ones));
        }
      }
      const int64_t g = G16 ? 2 * b + h : g_block;
      const typename L::V d = src.scales(g);
      for (int r = 0; r < R; ++r) {
        if (zero_terms) sum[r] = L::minus(sum[r], zero_terms[((m0 + r) * nb + b) * kHalves + h]);
        acc[r] = L::fmadd(L::to_floats(sum[r]), L::times(d, xd[r][b]), acc[r]);
      }
    }
    if (--left == 0) ++g_block, left = per_group;
  }
  if (offset) add_offsets<L, R>(acc, [&](int64_t g) { return src.offsets(g); }, a.group_sums.data(), m0, groups);
  // acc indexed by constants alone (an index the compiler cannot resolve keeps every row's sums in
  // memory, stored at each block: the kernel 1.15-1.2x slower at 32 rows)
  float sums[R][P * kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) L::store(sums[r], acc[r]);
  for (int r = 0; r < R; ++r) store_sums(sums[r], out + (m0 + r) * stride, cols);
}

// panel_tile for 1 to R rows
template <int BITS, bool G16, int R, int P, typename Source, typename out_t>
inline void panel_tile_rows(int64_t rows, const Source& src, const Int8Activations& a, int64_t m0, int64_t k,
                            int64_t group, bool offset, const int32_t* zero_terms, out_t* out, int64_t stride, int cols) {
  if constexpr (R > 1) {
    if (rows < R) return panel_tile_rows<BITS, G16, R - 1, P>(rows, src, a, m0, k, group, offset, zero_terms, out, stride, cols);
  }
  panel_tile<BITS, R, G16, P>(src, a, m0, k, group, offset, zero_terms, out, stride, cols);
}

template <int BITS, bool G16, typename out_t>
void gemm_int8_bits(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride) {
  const int64_t k = p.k, nb = k / kBlock, groups = p.groups_row();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const bool offset = p.mins != nullptr;               // the mins' term (the zero point is in the sums)
  const Buffer<int32_t> zeros = zero_terms_of(a, m, p.k / kBlock, p.zero + kCodeBias<BITS>, G16);
  const int32_t* zero = zeros.empty() ? nullptr : zeros.data();
  // rows a tile: with VNNI each row's sum is one chain of vpdpbusd, and AVX-512's 32 registers hold 8
  constexpr int kRows = kDpbusd && kWidePass ? 8 : 4;
  // panels first .. first + count - 1 against every row, in tiles of kRows rows and, where the build
  // has them, pairs of panels; source(i, lanes) is the tile's Source for panel first + i; after_tile()
  // after each tile
  auto tiles = [&](int64_t first, int64_t count, auto&& source, auto&& after_tile) {
    for (int64_t m0 = 0; m0 < m; m0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, m - m0);
      for (int64_t i = 0; i < count;) {
        const int64_t n0 = (first + i) * kPanel;
        if constexpr (kPanelPairs) {
          if (i + 1 < count) {
            const int cols = static_cast<int>(std::min<int64_t>(2 * kPanel, n - n0));
            panel_tile_rows<BITS, G16, kRows, 2>(rows, source(i, std::integral_constant<int, 2>{}), a, m0, k, p.group,
                                                 offset, zero, out + n0, stride, cols);
            after_tile();
            i += 2;
            continue;
          }
        }
        const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - n0));
        panel_tile_rows<BITS, G16, kRows, 1>(rows, source(i, std::integral_constant<int, 1>{}), a, m0, k, p.group,
                                             offset, zero, out + n0, stride, cols);
        after_tile();
        i += 1;
      }
    }
  };
  if (p.panels && m <= kRows) {        // one row tile: the codes decoded in registers
    at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
      tiles(begin, end - begin, [&](int64_t i, auto lanes) { return Packed<BITS, decltype(lanes)::value>{p, begin + i}; },
            [] {});
    });
    return;
  }
  // else a chunk of panels unpacked at once, sized for the L2 cache; every row tile passes over it
  const int64_t code_next = nb * kPanelBytes, float_next = groups * kPanel;   // one panel's codes, floats
  const int64_t per_chunk = std::max<int64_t>(1, (192 << 10) / code_next);
  const int64_t chunks = (panels + per_chunk - 1) / per_chunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> codes(per_chunk * code_next);
    std::vector<float> scales(per_chunk * float_next), offsets(per_chunk * float_next);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * per_chunk, count = std::min(per_chunk, panels - first);
      for (int64_t i = 0; i < count; ++i)
        unpack_panel<BITS>(p, n, (first + i) * kPanel, codes.data() + i * code_next, scales.data() + i * float_next,
                           offsets.data() + i * float_next);
      // while the row tiles pass over this chunk, the next one's weights are read into L2, a slice
      // after each tile, so that unpacking it does not wait on memory
      const int64_t next = c + 1 < end ? std::min(per_chunk, panels - first - per_chunk) : 0;
      const int64_t calls = (m + kRows - 1) / kRows * (kPanelPairs ? (count + 1) / 2 : count);
      ChunkAhead ahead(p, BITS, first + count, next, calls);
      tiles(first, count, [&](int64_t i, auto lanes) {
        return Unpacked<BITS, decltype(lanes)::value>{codes.data() + i * code_next, code_next,
                                                      scales.data() + i * float_next, offsets.data() + i * float_next,
                                                      float_next};
      }, [&] { ahead.step(); });
    }
  });
}

template <typename out_t>
void gemm_int8_formats(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride) {
  with_format(p, [&](auto bits, auto g16) {
    constexpr int BITS = decltype(bits)::value;
    // 8-bit codes (groups of 32 or more) only with VNNI: ops.cpp refuses them otherwise
    if constexpr (BITS != 8 || kDpbusd) gemm_int8_bits<BITS, BITS != 8 && decltype(g16)::value>(p, n, m, a, out, stride);
  });
}

}  // namespace

template <typename out_t>
void gemm_int8_tiles(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride) {
  gemm_int8_formats(p, n, m, a, out, stride);
}

#else
template <typename out_t>
void gemm_int8_tiles(const Planes&, int64_t, int64_t, const Int8Activations&, out_t*, int64_t) {}   // (ops.cpp refuses the int8 product without AVX2)
#endif

#define TWOSTEP_GEMM_INT8_TILES(T) \
  template void gemm_int8_tiles<T>(const Planes&, int64_t, int64_t, const Int8Activations&, T*, int64_t);
TWOSTEP_FOR_OUTPUTS(TWOSTEP_GEMM_INT8_TILES)

}  // namespace twostep::quant
