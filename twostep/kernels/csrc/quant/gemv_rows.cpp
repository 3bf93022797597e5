// The row layout's matrix-vector product: one weight row at a time against 1 to 8 activation
// rows of int16 codes (activations.h). The zero point is subtracted from the codes (shared by the
// rows); a min per group adds min * (the group's sum of activations) after the loop.
#include "codes.h"
#include "products.h"

#include <ATen/Parallel.h>

namespace twostep::quant {
namespace {

#ifdef TWOSTEP_AVX2
// sum_i mins[i] * sums[i] over a row's groups (a format's min term), 8 groups at a time
inline float min_term(const at::Half* mins, const float* sums, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g)));
    acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(sums + g), acc);
  }
  float total = hsum(acc);
  for (; g < groups; ++g) total += fp16(mins, g) * sums[g];
  return total;
}

// One weight row against M activation rows. The zero point is subtracted from the codes (shared
// by the M rows); a min per group adds min * (sum of the group's activations) after the loop.
template <int BITS, int M>
void row_dot(const Planes& p, int64_t n, const QuantizedActivations& a, float* result) {
  const int64_t nb = p.k / kBlock, groups = p.groups_row();
  const uint8_t* qs = p.qs + n * p.qs_row();
  const uint8_t* qh = p.qh ? p.qh + n * p.qh_row() : nullptr;
  const at::Half* scales = p.scales + n * groups;
  const int16_t* xq = a.q.data();
  const float* xd = a.scale.data();
  const bool centred = BITS != 8 && p.zero != 0;
  const __m256i zero = _mm256_set1_epi16(static_cast<int16_t>(p.zero));
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  auto codes = [&](int64_t b, __m256i& lo, __m256i& hi) {
    widen_block<BITS>(qs + b * qs_bytes(BITS), qh ? qh + b * qh_bytes(BITS) : nullptr, lo, hi);
    if (centred) {
      lo = _mm256_sub_epi16(lo, zero);
      hi = _mm256_sub_epi16(hi, zero);
    }
  };
  if (p.group == 16) {
    for (int64_t b = 0; b < nb; ++b) {
      __m256i lo, hi;
      codes(b, lo, hi);
      const __m256 d0 = _mm256_set1_ps(fp16(scales, 2 * b)), d1 = _mm256_set1_ps(fp16(scales, 2 * b + 1));
      for (int m = 0; m < M; ++m) {
        const int16_t* x = xq + m * p.k + b * kBlock;
        const __m256 s = _mm256_set1_ps(xd[m * nb + b]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(madd16(lo, load16(x))), _mm256_mul_ps(d0, s), acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(madd16(hi, load16(x + 16))), _mm256_mul_ps(d1, s), acc[m]);
      }
    }
  } else if (p.group == kBlock) {
    // the common case (GGUF's 32-weight types): a scale per block. Eight blocks at a time, each
    // block's integer dot product summed across its lanes in a tree of hadds shared by the eight,
    // so the conversion to float and the scaling are one instruction per eight blocks, with the
    // eight scales read and widened together (1.17x at batch 1 on AVX2, measured; from 4 rows even);
    // the rest two blocks per iteration
    __m256 acc2[M];
    for (int m = 0; m < M; ++m) acc2[m] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; M <= 2 && b + 8 <= nb; b += 8) {        // more rows: the sums would not fit in registers
      __m256i quads[M][2];                           // block sums 0-3 and 4-7, in 128-bit halves
      for (int quad = 0; quad < 2; ++quad) {
        __m256i pairs[M][2];
        for (int pair = 0; pair < 2; ++pair) {
          const int64_t b0 = b + 4 * quad + 2 * pair;
          __m256i lo0, hi0, lo1, hi1;
          codes(b0, lo0, hi0);
          codes(b0 + 1, lo1, hi1);
          for (int m = 0; m < M; ++m) {
            const int16_t* x = xq + m * p.k + b0 * kBlock;
            const __m256i d0 = _mm256_add_epi32(madd16(lo0, load16(x)), madd16(hi0, load16(x + 16)));
            const __m256i d1 = _mm256_add_epi32(madd16(lo1, load16(x + 32)), madd16(hi1, load16(x + 48)));
            pairs[m][pair] = _mm256_hadd_epi32(d0, d1);
          }
        }
        for (int m = 0; m < M; ++m) quads[m][quad] = _mm256_hadd_epi32(pairs[m][0], pairs[m][1]);
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b)));
      for (int m = 0; m < M; ++m) {
        // low halves: blocks 0-3 of the first quad's lanes; high: 4-7
        const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(quads[m][0], quads[m][1], 0x20),
                                              _mm256_permute2x128_si256(quads[m][0], quads[m][1], 0x31));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_loadu_ps(xd + m * nb + b)),
                                 acc[m]);
      }
    }
    for (; b + 2 <= nb; b += 2) {
      __m256i lo0, hi0, lo1, hi1;
      codes(b, lo0, hi0);
      codes(b + 1, lo1, hi1);
      const __m256 d0 = _mm256_set1_ps(fp16(scales, b)), d1 = _mm256_set1_ps(fp16(scales, b + 1));
      for (int m = 0; m < M; ++m) {
        const int16_t* x = xq + m * p.k + b * kBlock;
        const __m256i p0 = _mm256_add_epi32(madd16(lo0, load16(x)), madd16(hi0, load16(x + 16)));
        const __m256i p1 = _mm256_add_epi32(madd16(lo1, load16(x + 32)), madd16(hi1, load16(x + 48)));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(d0, _mm256_set1_ps(xd[m * nb + b])), acc[m]);
        acc2[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(d1, _mm256_set1_ps(xd[m * nb + b + 1])),
                                  acc2[m]);
      }
    }
    for (; b < nb; ++b) {
      __m256i lo, hi;
      codes(b, lo, hi);
      const __m256 d = _mm256_set1_ps(fp16(scales, b));
      for (int m = 0; m < M; ++m) {
        const int16_t* x = xq + m * p.k + b * kBlock;
        const __m256i dp = _mm256_add_epi32(madd16(lo, load16(x)), madd16(hi, load16(x + 16)));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_mul_ps(d, _mm256_set1_ps(xd[m * nb + b])), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) acc[m] = _mm256_add_ps(acc[m], acc2[m]);
  } else {
    const int64_t per_group = p.group / kBlock;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 d = _mm256_set1_ps(fp16(scales, g));
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
        __m256i lo, hi;
        codes(b, lo, hi);
        for (int m = 0; m < M; ++m) {
          const int16_t* x = xq + m * p.k + b * kBlock;
          const __m256i dp = _mm256_add_epi32(madd16(lo, load16(x)), madd16(hi, load16(x + 16)));
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_mul_ps(d, _mm256_set1_ps(xd[m * nb + b])), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    result[m] = hsum(acc[m]);
    if (p.mins) result[m] += min_term(p.mins + n * groups, a.group_sums.data() + m * groups, groups);
  }
}

#else  // plain C++

template <int BITS, int M>
void row_dot(const Planes& p, int64_t n, const QuantizedActivations& a, float* result) {
  const int64_t k = p.k, nb = k / kBlock;
  const uint8_t* qs = p.qs + n * p.qs_row();
  const uint8_t* qh = p.qh ? p.qh + n * p.qh_row() : nullptr;
  const at::Half* scales = p.scales + n * p.groups_row();
  const at::Half* mins = p.mins ? p.mins + n * p.groups_row() : nullptr;
  for (int m = 0; m < M; ++m) result[m] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int codes[kBlock];
    decode_codes<BITS>(qs + b * qs_bytes(BITS), qh ? qh + b * qh_bytes(BITS) : nullptr, codes);
    for (int half = 0; half < 2; ++half) {
      const int64_t g = p.group_of(b * kBlock + half * 16);
      const float d = half_to_float(scales[g]);
      const float o = (mins ? half_to_float(mins[g]) : 0.f) - p.zero * d;
      for (int m = 0; m < M; ++m) {
        const int16_t* x = a.q.data() + m * k + b * kBlock + half * 16;
        int dot = 0;
        for (int i = 0; i < 16; ++i) dot += codes[half * 16 + i] * x[i];
        result[m] += d * a.scale[m * nb + b] * dot + o * a.half_sums[(m * nb + b) * 2 + half];
      }
    }
  }
}
#endif

// the float32 sums stored in out's dtype (bf16 / fp16 rounded to nearest even, as Tensor.to rounds)
template <int BITS, int M, typename out_t>
void gemv_rows(const Planes& p, int64_t n, const QuantizedActivations& a, out_t* out, int64_t out_stride) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float r[M];
    for (int64_t row = begin; row < end; ++row) {
      row_dot<BITS, M>(p, row, a, r);
      for (int m = 0; m < M; ++m) out[m * out_stride + row] = static_cast<out_t>(r[m]);
    }
  });
}

template <int BITS, typename out_t>
void gemv_bits(const Planes& p, int64_t n, int64_t m, const QuantizedActivations& a, out_t* out, int64_t stride) {
  switch (m) {
    case 1: return gemv_rows<BITS, 1>(p, n, a, out, stride);
    case 2: return gemv_rows<BITS, 2>(p, n, a, out, stride);
    case 3: return gemv_rows<BITS, 3>(p, n, a, out, stride);
    case 4: return gemv_rows<BITS, 4>(p, n, a, out, stride);
    case 5: return gemv_rows<BITS, 5>(p, n, a, out, stride);
    case 6: return gemv_rows<BITS, 6>(p, n, a, out, stride);
    case 7: return gemv_rows<BITS, 7>(p, n, a, out, stride);
    case 8: return gemv_rows<BITS, 8>(p, n, a, out, stride);
    default: return;   // no rows: nothing to compute (ops.cpp refuses more than 8)
  }
}

}  // namespace

template <typename out_t>
void rows_gemv(const Planes& p, int64_t n, int64_t m, const QuantizedActivations& a, out_t* out, int64_t stride) {
  with_bits(p.bits, [&](auto bits) { gemv_bits<decltype(bits)::value>(p, n, m, a, out, stride); });
}

#define TWOSTEP_ROWS_GEMV(T) \
  template void rows_gemv<T>(const Planes&, int64_t, int64_t, const QuantizedActivations&, T*, int64_t);
TWOSTEP_FOR_OUTPUTS(TWOSTEP_ROWS_GEMV)

}  // namespace twostep::quant
