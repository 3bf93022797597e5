// Quantizing a call's activations (activations.h): the products' first step.
#include "activations.h"

#include "codes.h"
#include "products.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace twostep::quant {
namespace {

// Per weight group (16, or a multiple of 32 weights): the activations' sums from the half blocks'.
void sum_groups(QuantizedActivations& a, int64_t rows, int64_t k, int64_t group) {
  const int64_t halves = k / 16, per = group / 16, groups = k / group;
  a.group_sums = Buffer<float>(rows * groups);
  for (int64_t m = 0; m < rows; ++m) {
    const float* half = a.half_sums.data() + m * halves;
    float* out = a.group_sums.data() + m * groups;
    float sum = 0.f;
    for (int64_t h = 0, left = per; h < halves; ++h) {   // a group's halves in order, no division
      sum += half[h];
      if (--left == 0) *out++ = sum, sum = 0.f, left = per;
    }
  }
}

#ifdef TWOSTEP_AVX2

// A block's 32 activations as float32 into v, and the largest magnitude among them
template <typename scalar_t>
inline float load_block(const scalar_t* xb, __m256 v[4]) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(xb + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

template <typename scalar_t>
inline void quantize_block(const scalar_t* xb, int16_t* q, float& d, int sums[2]) {
  __m256 v[4];
  d = load_block(xb, v) / 32767.f;
  const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h], id));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h + 1], id));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);   // back in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * h), packed);
    const __m256i s = _mm256_madd_epi16(packed, ones);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    sums[h] = _mm_cvtsi128_si32(t);
  }
}
#endif

template <typename scalar_t>
QuantizedActivations to_int16(const scalar_t* x, int64_t rows, int64_t k, int64_t stride) {
  const int64_t nb = k / kBlock;
  QuantizedActivations a{Buffer<int16_t>(rows * k), Buffer<float>(rows * nb), Buffer<float>(rows * nb * 2)};
  for (int64_t m = 0; m < rows; ++m) {
    int16_t* q = a.q.data() + m * k;
    float* scale = a.scale.data() + m * nb;
    float* half = a.half_sums.data() + m * nb * 2;
    for (int64_t b = 0; b < nb; ++b) {
      const scalar_t* xb = x + m * stride + b * kBlock;
#ifdef TWOSTEP_AVX2
      {
        int sums[2];
        float d;
        quantize_block(xb, q + b * kBlock, d, sums);
        scale[b] = d;
        half[2 * b] = d * sums[0];
        half[2 * b + 1] = d * sums[1];
        continue;
      }
#endif
      float v[kBlock];
      float amax = 0.f;
      for (int i = 0; i < kBlock; ++i) {
        v[i] = static_cast<float>(xb[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float d = amax / 32767.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      int16_t* qb = q + b * kBlock;
      int sums[2] = {0, 0};
      for (int i = 0; i < kBlock; ++i) {
        qb[i] = static_cast<int16_t>(std::nearbyint(v[i] * id));
        sums[i / 16] += qb[i];
      }
      scale[b] = d;
      half[2 * b] = d * sums[0];
      half[2 * b + 1] = d * sums[1];
    }
  }
  return a;
}

#ifdef TWOSTEP_AVX2
// a.quads from a.q, [rows, k / 4, 16]
void expand_quads(QuantizedActivations& a, int64_t rows, int64_t k) {
  const int64_t quads = rows * k / 4;
  a.quads = Buffer<int16_t>(quads * 16);
  const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const int16_t* q = a.q.data();
  int16_t* out = a.quads.data();
  for (int64_t i = 0; i < quads; ++i) {
    const __m256i two_pairs = _mm256_castsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 4 * i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * i), _mm256_permutevar8x32_epi32(two_pairs, lanes));
  }
}

// The int32 sums of M rows' activations (quads[m], from the first chunk pair's quad) against `pairs`
// chunk pairs of a panel's 8-bit block from `chunks`: total[m]'s lane j for the panel's row j. A
// independent sums each of lo and hi a row (two at one row), so that four to eight multiply-add

template <typename scalar_t>
Int8Activations to_int8(const scalar_t* x, int64_t rows, int64_t k, int64_t stride, int64_t group) {
  const int64_t nb = k / kBlock, groups = k / group;
  Int8Activations a{Buffer<int8_t>(rows * k), Buffer<float>(rows * nb), Buffer<float>(rows * groups),
                    Buffer<int32_t>(rows * 2 * nb)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    const int64_t per_group = group == 16 ? 1 : group / kBlock;
    for (int64_t m = begin; m < end; ++m) {
      // the row's arrays through local pointers (stores through a.q's would make the compiler
      // reload the others after each), a group's sum in a register until its last block
      int8_t* q = a.q.data() + m * k;
      float* scale = a.scale.data() + m * nb;
      int32_t* half = a.half_sums.data() + m * 2 * nb;
      float* group_sum = a.group_sums.data() + m * groups;
      float sum = 0.f;
      for (int64_t b = 0, left = per_group; b < nb; ++b) {
        __m256 v[4];
        const float d = load_block(x + m * stride + b * kBlock, v) / 127.f;
        const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
        __m256i i32[4];
        for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
        const __m256i codes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3])), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), codes);
        scale[b] = d;
        // sums of the codes of each half block (lanes 0-3: codes 0-15; 4-7: 16-31)
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, codes), ones16);
        __m128i lo = _mm256_castsi256_si128(s), hi = _mm256_extracti128_si256(s, 1);
        lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4E));
        lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0xB1));
        hi = _mm_add_epi32(hi, _mm_shuffle_epi32(hi, 0x4E));
        hi = _mm_add_epi32(hi, _mm_shuffle_epi32(hi, 0xB1));
        const int32_t low_sum = _mm_cvtsi128_si32(lo), high_sum = _mm_cvtsi128_si32(hi);
        half[2 * b] = low_sum;
        half[2 * b + 1] = high_sum;
        // (the FMAs written out: the sums' rounding is not left to what the compiler contracts)
        if (group == 16) {             // the halves' own groups, 2b and 2b + 1
          group_sum[2 * b] = d * low_sum;
          group_sum[2 * b + 1] = d * high_sum;
        } else {                       // group b / per_group, summed in block order
          sum = std::fma(d, static_cast<float>(low_sum), sum);
          sum = std::fma(d, static_cast<float>(high_sum), sum);
          if (--left == 0) *group_sum++ = sum, sum = 0.f, left = per_group;
        }
      }
    }
  });
  return a;
}
#endif

}  // namespace

template <typename scalar_t>
QuantizedActivations quantize_int16(const scalar_t* x, int64_t rows, int64_t k, int64_t stride, int64_t group,
                                    bool group_sums, bool quads) {
  QuantizedActivations a = to_int16<scalar_t>(x, rows, k, stride);
  if (group_sums) sum_groups(a, rows, k, group);
#ifdef TWOSTEP_AVX2
  if (quads) expand_quads(a, rows, k);
#else
  (void)quads;
#endif
  return a;
}

template <typename scalar_t>
Int8Activations quantize_int8(const scalar_t* x, int64_t rows, int64_t k, int64_t stride, int64_t group) {
#ifdef TWOSTEP_AVX2
  return to_int8<scalar_t>(x, rows, k, stride, group);
#else
  (void)x, (void)rows, (void)k, (void)stride, (void)group;
  return {};
#endif
}

#define TWOSTEP_ACTIVATIONS(T)                                                                       \
  template QuantizedActivations quantize_int16<T>(const T*, int64_t, int64_t, int64_t, int64_t, bool, bool); \
  template Int8Activations quantize_int8<T>(const T*, int64_t, int64_t, int64_t, int64_t);
TWOSTEP_FOR_OUTPUTS(TWOSTEP_ACTIVATIONS)

}  // namespace twostep::quant
