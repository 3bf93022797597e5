// Rows of a quantized matrix as floats (the embedding lookup, and the tiles a matrix product hands
// to oneDNN / MKL where no quantized product applies): either layout, float32, bf16 or fp16 out.
#include "codes.h"
#include "products.h"

#include <ATen/Parallel.h>

namespace twostep::quant {
namespace {

#ifdef TWOSTEP_AVX2
// The 8 rows of a panel's block as floats, row j at out + j * stride: scale * code + offset, with
// d0 / o0 for the block's first 16 weights and d1 / o1 for the rest (one row's value each)
template <int BITS, typename scalar_t>
inline void dequantize_panel_block(const uint8_t* block, const float* d0, const float* o0, const float* d1,
                                   const float* o1, scalar_t* out, int64_t stride) {
  __m256i c[kPanel], rows[kPanel];
  panel_quads<BITS>(block, c);
  transpose8(c, rows);
  float buffer[kBlock];
  for (int j = 0; j < kPanel; ++j) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      dequantize_codes<BITS>(rows[j], d0[j], o0[j], d1[j], o1[j], out + j * stride);
    } else {
      dequantize_codes<BITS>(rows[j], d0[j], o0[j], d1[j], o1[j], buffer);
      store_rounded(buffer, out + j * stride, kBlock);
    }
  }
}
#endif

// Rows of the panel layout: a whole panel asked in order (a tile of consecutive rows) decoded
// eight rows a block at once where the build has vectors, any other row code by code
template <int BITS, typename scalar_t>
void dequantize_panels_into(const Planes& p, const int64_t* ids, int64_t count, scalar_t* out) {
  const int64_t k = p.k, nb = k / kBlock;
  // row n's scale and offset (min - zero * scale) for its weight i
  auto scale = [&](int64_t n, int64_t i) { return half_to_float(p.scales[p.scale_at(n, p.group_of(i))]); };
  auto offset = [&](int64_t n, int64_t i, float d) {
    return (p.mins ? half_to_float(p.mins[p.scale_at(n, p.group_of(i))]) : 0.f) - p.zero * d;
  };
  at::parallel_for(0, count, kPanel, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end;) {
      const int64_t n = ids[r], panel = n / kPanel;
      const uint8_t* qs = p.qs + panel * nb * panel_block(BITS);
#ifdef TWOSTEP_AVX2
      bool whole = n % kPanel == 0 && r + kPanel <= end;
      for (int j = 1; whole && j < kPanel; ++j) whole = ids[r + j] == n + j;
      if (whole) {
        float d[2][kPanel], o[2][kPanel];       // the block's two halves (one group, or two of 16)
        for (int64_t b = 0; b < nb; ++b) {
          if (b * kBlock % p.group == 0) {
            for (int h = 0; h < 2; ++h)
              for (int j = 0; j < kPanel; ++j) {
                d[h][j] = scale(n + j, b * kBlock + 16 * h);
                o[h][j] = offset(n + j, b * kBlock + 16 * h, d[h][j]);
              }
          }
          dequantize_panel_block<BITS>(qs + b * panel_block(BITS), d[0], o[0], d[1], o[1], out + r * k + b * kBlock, k);
        }
        r += kPanel;
        continue;
      }
#endif
      const int j = static_cast<int>(n % kPanel);
      for (int64_t half = 0; half < 2 * nb; ++half) {
        const float d = scale(n, 16 * half), o = offset(n, 16 * half, d);
        const uint8_t* block = qs + (half / 2) * panel_block(BITS);
        for (int i = 16 * (half % 2); i < 16 * (half % 2) + 16; ++i)
          out[r * k + (half / 2) * kBlock + i] = static_cast<scalar_t>(d * panel_code<BITS>(block, j, i) + o);
      }
      ++r;
    }
  });
}

template <int BITS, typename scalar_t>
void dequantize_into(const Planes& p, const int64_t* ids, int64_t count, scalar_t* out) {
  if (p.panels) return dequantize_panels_into<BITS>(p, ids, count, out);
  const int64_t k = p.k, nb = k / kBlock;
  at::parallel_for(0, count, 4, [&](int64_t begin, int64_t end) {
    float buffer[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = ids[r];
      const uint8_t* qs = p.qs + n * p.qs_row();
      const uint8_t* qh = p.qh ? p.qh + n * p.qh_row() : nullptr;
      const at::Half* scales = p.scales + n * p.groups_row();
      const at::Half* mins = p.mins ? p.mins + n * p.groups_row() : nullptr;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t g0 = p.group_of(b * kBlock), g1 = p.group_of(b * kBlock + 16);
        const float d0 = half_to_float(scales[g0]), d1 = half_to_float(scales[g1]);
        const float o0 = (mins ? half_to_float(mins[g0]) : 0.f) - p.zero * d0;
        const float o1 = (mins ? half_to_float(mins[g1]) : 0.f) - p.zero * d1;
        scalar_t* dst = out + r * k + b * kBlock;
        if constexpr (std::is_same_v<scalar_t, float>) {
          dequantize_block<BITS>(qs + b * qs_bytes(BITS), qh ? qh + b * qh_bytes(BITS) : nullptr, d0, o0, d1, o1, dst);
        } else {
          dequantize_block<BITS>(qs + b * qs_bytes(BITS), qh ? qh + b * qh_bytes(BITS) : nullptr, d0, o0, d1, o1,
                                 buffer);
          for (int i = 0; i < kBlock; ++i) dst[i] = static_cast<scalar_t>(buffer[i]);
        }
      }
    }
  });
}

}  // namespace

template <typename out_t>
void dequantize_planes(const Planes& p, const int64_t* ids, int64_t count, out_t* out) {
  with_bits(p.bits, [&](auto bits) { dequantize_into<decltype(bits)::value>(p, ids, count, out); });
}

#define TWOSTEP_DEQUANTIZE(T) template void dequantize_planes<T>(const Planes&, const int64_t*, int64_t, T*);
TWOSTEP_FOR_OUTPUTS(TWOSTEP_DEQUANTIZE)

}  // namespace twostep::quant
