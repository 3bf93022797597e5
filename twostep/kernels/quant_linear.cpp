// Quantized linears: weights in twostep's packed layout (twostep/quantization/packed.py), read in place.
//
// gemv: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m, streaming each weight block once.
//   The activations are quantized per block of 32 to int16 (one float scale per block; a relative
//   error near 2**-16, so the result is the float product of the dequantized weights within float
//   rounding), and a block's dot product is integer multiply-adds of its codes against them:
//     sum_i w_i x_i = sum_groups scale * xd * sum_i q_i xq_i + (min - zero * scale) * xd * sum_i xq_i
//   The second term needs only each block's sum of xq, computed once per call.
//   Paths, chosen where the kernel is built (on the machine that runs it, -march=native):
//   AVX-VNNI / AVX512-VNNI dpwssd, AVX2 madd, and plain C++ as the fallback; without AVX-512, 8-bit
//   codes read the activations in a layout of their own (quads, below).
// gemm_int8 (AVX2 and up, 4 to 6-bit codes, 8-bit too with VNNI; the engine's
//   --cpu-int8-activations, by default in decode batches): any number of rows with the activations quantized per block of 32 to
//   int8, as llama.cpp quantizes them for its products (a step of max|x| / 127 a block: about
//   bf16's precision at best, enough noise to flip a close top token), a panel of 8 weight rows
//   unpacked to bytes once for every row of x, u8 x s8 multiply-adds (VNNI's vpdpbusd in int32,
//   on AVX-512 8 rows a tile and two panels a 512-bit register; AVX2's vpmaddubsw with int16
//   sums). On an AVX2 EPYC: 1.5-2x MKL's float32 GEMM on the dequantized weights at 512 rows,
//   2-3.5x gemv's passes at 8-64 rows; on a Zen 4 (VNNI): 1.2-1.3x the 16-bit passes at 8 rows,
//   2.0-2.1x at 32, 1.25x the bf16 tiles (below) at 512. Below 8 rows (the panel layout) a
//   small-row kernel (one user's decode: 1.38x gemv's rate at 1 row with VNNI on a Zen 4, 1.5x with
//   AVX2's vpmaddubsw on a Zen 1) with the same sums bit for bit, the zero point taken off each
//   block's integer sums.
// gemm_bf16 (AVX512-BF16, or AMX, through torch's oneDNN brgemm): bf16 rows against the panel
//   layout, the prefill product: a thread dequantizes 64 weight rows at a time into the pair layout
//   brgemm multiplies (in its L2) and multiplies every row of x against them; at the rate of oneDNN
//   on pre-packed bf16 weights (the panel layout's chunks are already pairs of 8 rows).
// The panel layout (the SIMD build's, for every format with n a multiple of 8; pack_panels makes it
//   from the row layout at load): kPanel = 8 weight rows stored together block by block, so a 1-8
//   row product gets eight output columns in the eight int32 lanes of its vectors without a
//   horizontal sum, and one vector of eight rows' scales per group.
//   A panel's block starts with 16-byte chunks c; bytes 2j and 2j + 1 of a chunk belong to the
//   panel's row j: bits 8: its codes 2c and 2c + 1; bits 4-6: the low nibbles of codes 4c and 4c + 1
//   in the low nibbles, of 4c + 2 and 4c + 3 in the high ones. Bits 5 and 6 follow with the bits above
//   the nibble in 16-byte vectors, one per P = 4 / w chunks (w = bits - 4): vector c / P's byte
//   2j + u holds, at bit w (2 (c % P) + h), the w high bits of row j's code 4c + 2h + u (the lane
//   order of the chunk's int16 vectors, so one shift and one masked or put a chunk's bits in
//   place). qs is [n / 8, blocks, panel_block(bits)] bytes (no qh plane), scales / mins
//   [n / 8, groups, 8].
// dequantize_rows: rows of w as float32 / bf16 / fp16 (the embedding lookup, and the tiles a
//   matrix-matrix product hands to oneDNN / MKL where gemm_bf16 does not apply).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(TWOSTEP_FORCE_SCALAR)
#define TWOSTEP_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kPanel = 8;      // rows of the panel layout; output columns of the int8 product's panels

// n T's left uninitialised, for a call's scratch arrays that are written before they are read (a
// std::vector zeroes them: with its allocation ~0.8 us of a small call on a Zen 1)
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(int64_t n) : data_(n > 0 ? new T[n] : nullptr) {}
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  T& operator[](int64_t i) { return data_[i]; }
  const T& operator[](int64_t i) const { return data_[i]; }
  bool empty() const { return data_ == nullptr; }

 private:
  std::unique_ptr<T[]> data_;
};

struct Planes {
  const uint8_t* qs;
  const uint8_t* qh;
  const at::Half* scales;
  const at::Half* mins;
  int64_t k;
  int group;
  int zero;
  int64_t qs_row() const { return bits == 8 ? k : k / 2; }
  int64_t qh_row() const { return bits == 5 ? k / 8 : bits == 6 ? k / 4 : 0; }
  int bits;
  bool panels = false;   // the panel layout (above); else row-major planes
  int64_t groups = 0;    // k / group (planes_of sets these two: no division where a loop asks)
  int group_shift = -1;  // log2(group) where group is a power of two
  int64_t groups_row() const { return groups; }
  // the group of weight i of a row: a shift for every GGUF format (an idiv is ~40 cycles on a Zen 1)
  int64_t group_of(int64_t i) const { return group_shift >= 0 ? i >> group_shift : i / group; }
  // where row n's group g's scale (and min) is
  int64_t scale_at(int64_t n, int64_t g) const {
    return panels ? ((n / kPanel) * groups_row() + g) * kPanel + n % kPanel : n * groups_row() + g;
  }
};

// The most rows one call of the panel layout's passes takes: all of them against a panel while it is
// in L1 (L2 for long rows: an 8-bit panel of k = 4,864 is 39 KB), so the weights stream once a call,
// not once per 8 rows (Qwen-shape Q8_0 on a Zen 1, 24-32 rows: 1.02-1.10x the calls of 8 rows)
constexpr int64_t kPanelCallRows = 64;

constexpr int qs_bytes(int bits) { return bits == 8 ? 32 : 16; }
constexpr int qh_bytes(int bits) { return bits == 5 ? 4 : bits == 6 ? 8 : 0; }
// one block of the panel layout: the eight rows' chunks, then their high bits
constexpr int panel_block(int bits) { return (qs_bytes(bits) + qh_bytes(bits)) * kPanel; }
constexpr int kNibbleChunks = 16 * kPanel;   // where a 5 or 6-bit panel block's high bits start
constexpr int high_chunks(int bits) { return 4 / (bits - 4); }   // chunks a vector of high bits covers
// the left shift (negative: right) that moves the high bits of chunk c's half h to bit 4
constexpr int high_shift(int bits, int c, int h) { return 4 - (bits - 4) * (2 * (c % high_chunks(bits)) + h); }

// Code i of the panel's row j in one of its blocks (bytes `block`), in the panel layout
template <int BITS>
inline int panel_code(const uint8_t* block, int j, int i) {
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(block[16 * (i / 2) + 2 * j + i % 2]);
  } else {
    const uint8_t byte = block[16 * (i / 4) + 2 * j + i % 2];
    int code = i % 4 < 2 ? byte & 0xF : byte >> 4;
    if constexpr (BITS > 4) {
      const int c = i / 4, h = i % 4 / 2;
      const uint8_t high = block[kNibbleChunks + 16 * (c / high_chunks(BITS)) + 2 * j + i % 2];
      code |= ((high >> (4 - high_shift(BITS, c, h))) & ((1 << (BITS - 4)) - 1)) << 4;
    }
    return code;
  }
}

// Activations quantized per block of 32: codes, the block's scale, and scale * (sum of the codes)
// for each half block of 16 (a group of 16 needs its own half).
struct QuantizedActivations {
  Buffer<int16_t> q;
  Buffer<float> scale;
  Buffer<float> half_sums;
  Buffer<float> group_sums;   // scale * (sum of the codes) per weight group, [rows, k / group]
  Buffer<int16_t> quads;      // the 8-bit passes' form of q without AVX-512 (expand_quads), [rows, k / 4, 16]
};

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
// activations (float32, bf16 or fp16), 32 at a time in vectors: the same codes as the scalar loop
// below (round to nearest even, as nearbyint in the default rounding mode)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) {   // bf16 is float32's upper half
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline __m256 load8(const at::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
inline __m256 load8(const double* x) {
  return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(x + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(x)));
}

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
QuantizedActivations quantize_activations(const scalar_t* x, int64_t rows, int64_t k, int64_t stride) {
  const int64_t nb = k / kBlock;
  QuantizedActivations a{Buffer<int16_t>(rows * k), Buffer<float>(rows * nb), Buffer<float>(rows * nb * 2)};
  for (int64_t m = 0; m < rows; ++m) {
    int16_t* q = a.q.data() + m * k;
    float* scale = a.scale.data() + m * nb;
    float* half = a.half_sums.data() + m * nb * 2;
    for (int64_t b = 0; b < nb; ++b) {
      const scalar_t* xb = x + m * stride + b * kBlock;
#ifdef TWOSTEP_AVX2
      if constexpr (!std::is_same_v<scalar_t, double>) {
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

inline float half_to_float(at::Half h) { return static_cast<float>(h); }

#ifdef TWOSTEP_AVX2

// The 32 codes of one block, in weight order: unsigned for 4-6 bits, signed bytes for 8.
template <int BITS>
inline __m256i decode_block(const uint8_t* qs, const uint8_t* qh) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nibble), _mm_and_si128(v, nibble));
    if constexpr (BITS == 5) {
      uint32_t h;
      std::memcpy(&h, qh, 4);
      __m256i hv = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(h)),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      hv = _mm256_and_si256(hv, _mm256_set1_epi8(1));
      u = _mm256_or_si256(u, _mm256_slli_epi16(hv, 4));
    } else if constexpr (BITS == 6) {
      uint64_t h;
      std::memcpy(&h, qh, 8);
      __m256i hv = _mm256_srlv_epi64(_mm256_set1_epi64x(static_cast<long long>(h)),
                                     _mm256_setr_epi64x(0, 2, 4, 6));
      hv = _mm256_and_si256(hv, _mm256_set1_epi8(3));
      u = _mm256_or_si256(u, _mm256_slli_epi16(hv, 4));
    }
    return u;
  }
}

// int16 pairs of a and b multiplied and added to acc's 8 int32 lanes
inline __m256i dot16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// int16 pairs -> 8 int32 lanes, lane l = a[2l] b[2l] + a[2l+1] b[2l+1]
inline __m256i madd16(__m256i a, __m256i b) { return dot16(_mm256_setzero_si256(), a, b); }

// VNNI's byte product: u8 x s8 quads multiplied and added to acc's 8 int32 lanes in one instruction
// (vpdpbusd), no int16 sums between; without VNNI the int8 product uses vpmaddubsw (below)
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kDpbusd = true;
inline __m256i dot8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_dpbusd_epi32(acc, u, s);
#endif
}
#else
constexpr bool kDpbusd = false;
inline __m256i dot8(__m256i acc, __m256i, __m256i) { return acc; }   // never called
#endif

// A block's 32 codes as two vectors of 16 int16 (weights 0-15, 16-31).
template <int BITS>
inline void widen_block(const uint8_t* qs, const uint8_t* qh, __m256i& lo, __m256i& hi) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(v, 4);
  } else if constexpr (BITS == 8) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  } else {
    const __m256i u = decode_block<BITS>(qs, qh);
    lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
    hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
  }
}

inline __m256i load16(const int16_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float fp16(const at::Half* h, int64_t i) {
  return _cvtsh_ss(reinterpret_cast<const uint16_t*>(h)[i]);
}

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

// w = scale * code + offset for one block, 32 floats
template <int BITS>
inline void dequantize_codes(__m256i w, float d0, float o0, float d1, float o1, float* out) {
  const __m128i halves[2] = {_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)};
  for (int c = 0; c < 4; ++c) {
    const __m128i bytes = c % 2 ? _mm_srli_si128(halves[c / 2], 8) : halves[c / 2];
    const __m256i ints = BITS == 8 ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    const bool second = c >= 2;
    const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(second ? d1 : d0),
                                     _mm256_set1_ps(second ? o1 : o0));
    _mm256_storeu_ps(out + 8 * c, v);
  }
}

template <int BITS>
inline void dequantize_block(const uint8_t* qs, const uint8_t* qh, float d0, float o0, float d1, float o1,
                             float* out) {
  dequantize_codes<BITS>(decode_block<BITS>(qs, qh), d0, o0, d1, o1, out);
}

// ---- the panel layout's matrix-vector product (a few rows: up to kPanelCallRows a call) ----

// high shifted left by SHIFT (negative: right) in 16-bit lanes
template <int SHIFT>
inline __m256i shifted16(__m256i high) { return SHIFT >= 0 ? _mm256_slli_epi16(high, SHIFT) : _mm256_srli_epi16(high, -SHIFT); }
template <int SHIFT>
inline __m128i shifted16(__m128i high) { return SHIFT >= 0 ? _mm_slli_epi16(high, SHIFT) : _mm_srli_epi16(high, -SHIFT); }

// code | (moved & mask)
inline __m256i or_masked(__m256i code, __m256i moved, __m256i mask) {
#if defined(__AVX512VL__)
  return _mm256_ternarylogic_epi32(code, moved, mask, 0xF8);
#else
  return _mm256_or_si256(code, _mm256_and_si256(moved, mask));
#endif
}
inline __m128i or_masked(__m128i code, __m128i moved, __m128i mask) {
#if defined(__AVX512VL__)
  return _mm_ternarylogic_epi32(code, moved, mask, 0xF8);
#else
  return _mm_or_si128(code, _mm_and_si128(moved, mask));
#endif
}

// The bits above the nibble of each lane of codes (bytes, or bytes widened to 16-bit lanes): a
// vector of ((1 << BITS) - 1) & ~0xF in lanes of that width
template <int BITS>
inline __m256i high_mask16() { return _mm256_set1_epi16(((1 << BITS) - 1) & ~0xF); }
template <int BITS, typename vec>
inline vec high_mask8() {
  constexpr char mask = static_cast<char>(((1 << BITS) - 1) & ~0xF);
  if constexpr (sizeof(vec) == 32) return _mm256_set1_epi8(mask); else return _mm_set1_epi8(mask);
}

// A chunk's two halves (codes 4c + u and 4c + 2 + u of each row) with their high bits put in from
// the chunk's vector `high` (its bytes widened to 16-bit lanes or as they are; `mask` the field's
// bits in a lane: a 16-bit shift carries bits across bytes only below bit 4 or above bit 5, which
// the mask drops), SHIFT moving the half's field to bit 4; within = c % high_chunks(BITS), a
// constant where inlined (the shifts are immediates)
template <int BITS, typename vec>
inline void add_high(int within, vec& lo, vec& hi, vec high, vec mask) {
  switch (within) {
    case 0: lo = or_masked(lo, shifted16<high_shift(BITS, 0, 0)>(high), mask); hi = or_masked(hi, shifted16<high_shift(BITS, 0, 1)>(high), mask); break;
    case 1: lo = or_masked(lo, shifted16<high_shift(BITS, 1, 0)>(high), mask); hi = or_masked(hi, shifted16<high_shift(BITS, 1, 1)>(high), mask); break;
    case 2: lo = or_masked(lo, shifted16<high_shift(BITS, 2, 0)>(high), mask); hi = or_masked(hi, shifted16<high_shift(BITS, 2, 1)>(high), mask); break;
    default: lo = or_masked(lo, shifted16<high_shift(BITS, 3, 0)>(high), mask); hi = or_masked(hi, shifted16<high_shift(BITS, 3, 1)>(high), mask); break;
  }
}

// AVX-512's 32 vector registers hold the int32 sums of 8 rows, or of 4 rows twice over
#if defined(__AVX512VL__)
constexpr bool kWidePass = true;
#else
constexpr bool kWidePass = false;
#endif

// The bytes kPrefetchAhead past [p, p + n) asked for into L1: the panels are one sequential stream
// per thread (a panel's blocks, then the next panel's), and a product that computes as much as the
// 4-bit one leaves the hardware prefetcher behind. Alternating A/B of the two builds in one process
// (21 rounds, the linears of a step at 1 row): Qwen-shape Q4_0 1.07-1.25x, Q4_K 1.08x, SmolLM2 Q4_1
// 1.06x and its Q8_0 head 1.16x, Qwen-shape Q8_0 0.98x (memory-bound either way); 1-4 KB ahead all
// gain, 2 KB the most; into L2 (T2) 0.93-0.99x of this. On a Zen 5, whose memory reads up to 80
// GB/s, 4 KB: the whole Qwen-shape decode step (the distance set at run time, alternating in one
// process) 1.05x (Q4_0) and 1.06x (Q8_0) where memory ran fast, 1.00x (0.99-1.00x) where it ran at
// ~50 GB/s; 8 KB up to 1.13x fast but 0.97x on Q8_0 slow. kernels/__init__.py's prefetch_flags().
#ifdef TWOSTEP_PREFETCH_AHEAD
constexpr int kPrefetchAhead = TWOSTEP_PREFETCH_AHEAD;
#else
constexpr int kPrefetchAhead = 2048;
#endif
inline void prefetch_ahead(const uint8_t* p, int n) {
  for (int line = 0; line < n; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchAhead + line, _MM_HINT_T0);
}

// The 8-bit passes without AVX-512 take two chunks a step in one 256-bit load, widened in place (each
// byte unpacked beside itself, then shifted right: rows 0-3 of both chunks in `lo`, rows 4-7 in `hi`)
// and multiplied against the row's activations as they lie in memory: `quads` holds each four codes
// of q as a vector, the first pair four times in the low lane and the second in the high one (chunk
// c's pair beside chunk c's codes, c + 1's beside c + 1's). No broadcast, and no lane-crossing
// widening (vpmovsxbw), in a loop that Zen 1's one integer-multiply pipe bounds: in L2, one thread,
// 1.07-1.10x / 1.2x / 1.4x the broadcast form's rate at 1 / 2 / 4 rows; the same integer sums.
constexpr bool kQuadPasses = !kWidePass;

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

// n floats (a multiple of 8) into out: float32 as they are, bf16 rounded to nearest even 8 at a time
// where the CPU has AVX512-BF16, else one by one. The instruction gives what the scalar conversion
// gives for zeros and every normal value; it flushes denormals (below 1.2e-38) to zero, which no
// dequantized weight is (a multiple of an fp16 scale plus an fp16 offset). A panel's 8 sums into the
// output row; a dequantized block's 32 weights into a tile.
template <typename out_t>
inline void store_rounded(const float* in, out_t* out, int n) {
  if constexpr (std::is_same_v<out_t, float>) {
    std::memcpy(out, in, n * sizeof(float));
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  } else if constexpr (std::is_same_v<out_t, at::BFloat16>) {
    for (int i = 0; i < n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(in + i)));
#endif
  } else {
    for (int i = 0; i < n; ++i) out[i] = static_cast<out_t>(in[i]);
  }
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
  const bool g16 = p.group == 16;
  switch (p.bits) {
    case 4: return g16 ? gemv_panels<4, true>(p, n, m, a, out, stride) : gemv_panels<4, false>(p, n, m, a, out, stride);
    case 5: return g16 ? gemv_panels<5, true>(p, n, m, a, out, stride) : gemv_panels<5, false>(p, n, m, a, out, stride);
    case 6: return g16 ? gemv_panels<6, true>(p, n, m, a, out, stride) : gemv_panels<6, false>(p, n, m, a, out, stride);
    default: return g16 ? gemv_panels<8, true>(p, n, m, a, out, stride) : gemv_panels<8, false>(p, n, m, a, out, stride);
  }
}

constexpr bool kPanels = true;

// ---- int8 matrix-matrix product (AVX2), for many rows: prefill and large decode batches ----
//
// Activations quantized per block of 32 to int8 (llama.cpp's precision for its matrix products:
// a block's step is max|x| / 127), weights' codes unpacked to bytes for 8 output columns at a
// time, and u8 x s8 multiply-adds: with VNNI vpdpbusd straight into int32 (8-bit codes too, as
// code + 128 with the 128 taken back through the activations' sums); without it vpmaddubsw
// summed in int16 for as many steps as cannot overflow, then in int32. Per block, in float with
// the two scales.

struct Int8Activations {
  Buffer<int8_t> q;          // [m, k]
  Buffer<float> scale;       // [m, k / 32]
  Buffer<float> group_sums;  // [m, k / group]: sum over the group's blocks of scale * (sum of codes)
  Buffer<int32_t> half_sums; // [m, k / 16]: the sum of each half block's codes
};


template <typename scalar_t>
Int8Activations quantize_int8(const scalar_t* x, int64_t rows, int64_t k, int64_t stride, int64_t group) {
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

constexpr int64_t kPanelBytes = 32 * kPanel;  // a block of a panel's codes

// out[s] = the s-th dword of each of c[0..7] (an 8 x 8 transpose of 32-bit elements)
inline void transpose8(const __m256i c[8], __m256i out[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(c[2 * i], c[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(c[2 * i], c[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int s = 0; s < 4; ++s) {
    out[s] = _mm256_permute2x128_si256(u[s], u[4 + s], 0x20);
    out[s + 4] = _mm256_permute2x128_si256(u[s], u[4 + s], 0x31);
  }
}

// Step s of a block of the panel layout as two pairs of codes: the panel's row j's codes 4s, 4s + 1 at
// bytes 2j, 2j + 1 of `first`, codes 4s + 2, 4s + 3 of `second` (4-6-bit: unsigned; 8-bit: signed)
template <int BITS>
inline void panel_pairs(const uint8_t* block, int s, __m128i& first, __m128i& second) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  if constexpr (BITS == 8) {
    first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 * s));
    second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 * s + 16));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * s));
    first = _mm_and_si128(v, nibble);
    second = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
    if constexpr (BITS > 4) {
      constexpr int P = high_chunks(BITS);
      const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kNibbleChunks + 16 * (s / P)));
      add_high<BITS>(s % P, first, second, high, high_mask8<BITS, __m128i>());
    }
  }
}

// Step s of a block of the panel layout as the int8 product takes it: lane j = codes 4s .. 4s + 3 of
// the panel's row j, as bytes
template <int BITS>
inline __m256i panel_quad(const uint8_t* block, int s) {
  __m128i first, second;
  panel_pairs<BITS>(block, s, first, second);
  return _mm256_set_m128i(_mm_unpackhi_epi16(first, second), _mm_unpacklo_epi16(first, second));
}

// A whole block: c[s] = panel_quad(block, s)
template <int BITS>
inline void panel_quads(const uint8_t* block, __m256i c[8]) {
  for (int s = 0; s < 8; ++s) c[s] = panel_quad<BITS>(block, s);
}

// The int8 product multiplies unsigned codes: 8-bit ones shifted by kCodeBias (code + 128), which
// comes off each block's int32 sum with the zero point (128 x the activations' block sum)
template <int BITS>
constexpr int kCodeBias = BITS == 8 ? 128 : 0;

template <int BITS>
inline __m256i unsigned_code(__m256i c) {
  if constexpr (BITS == 8) return _mm256_xor_si256(c, _mm256_set1_epi8(static_cast<char>(0x80)));
  return c;
}
#if defined(__AVX512BW__)
template <int BITS>
inline __m512i unsigned_code(__m512i c) {
  if constexpr (BITS == 8) return _mm512_xor_si512(c, _mm512_set1_epi8(static_cast<char>(0x80)));
  return c;
}
#endif

template <int BITS>
inline void unsigned_codes(__m256i c[8]) {
  for (int s = 0; s < 8; ++s) c[s] = unsigned_code<BITS>(c[s]);
}

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
constexpr bool kPanelPairs = true;
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
constexpr bool kPanelPairs = false;
#endif

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

// zero x the sum of each row's codes in each block (G16: half block), [m, blocks, halves]: what
// the zero point (and 8-bit codes' 128) takes off a block's integer sum, sum (q - z) x = sum q x -
// z sum x, exact in int32; read from memory as one broadcast a row and block. Empty for zero 0.
Buffer<int32_t> zero_terms_of(const Int8Activations& a, int64_t m, int64_t nb, int32_t zero, bool g16) {
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


// ---- the int8 product for a few rows (1 to kSmallRows - 1): one user's decode ----
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

// Step pair p's codes as the chunks hold them: 16-bit lane j of `first` = row j's codes 4s, 4s + 1,
// of `second` its codes 4s + 2, 4s + 3; step s = 2p in the low 128 bits, 2p + 1 in the high
// (unsigned for 4 to 6 bits; signed for 8)
template <int BITS>
inline void pair_halves(const uint8_t* block, int p, __m256i& first, __m256i& second) {
  if constexpr (BITS == 8) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * p));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * p + 32));
    first = _mm256_permute2x128_si256(v0, v1, 0x20);
    second = _mm256_permute2x128_si256(v0, v1, 0x31);
  } else {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * p));
    first = _mm256_and_si256(v, nibble);
    second = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    if constexpr (BITS > 4) {
      // chunks 2p and 2p + 1 share a vector of high bits, the second's fields 2 (BITS - 4) bits
      // above the first's: shifted down in the upper lane, both lanes take the first's shifts
      constexpr int P = high_chunks(BITS), w = BITS - 4;
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kNibbleChunks + 16 * (2 * p / P)));
      const __m256i high = _mm256_srlv_epi32(_mm256_broadcastsi128_si256(h), _mm256_setr_epi32(0, 0, 0, 0, 2 * w, 2 * w, 2 * w, 2 * w));
      add_high<BITS>((2 * p) % P, first, second, high, high_mask8<BITS, __m256i>());
    }
  }
}

// Step pair p's codes as unsigned bytes: lane l < 4 of q0 = row l's codes 8p .. 8p + 3 (step 2p),
// lane l >= 4 = row l - 4's codes 8p + 4 .. 8p + 7 (step 2p + 1); q1 the same for rows 4-7.
template <int BITS>
inline void pair_quads(const uint8_t* block, int p, __m256i& q0, __m256i& q1) {
  __m256i first, second;
  pair_halves<BITS>(block, p, first, second);
  q0 = unsigned_code<BITS>(_mm256_unpacklo_epi16(first, second));
  q1 = unsigned_code<BITS>(_mm256_unpackhi_epi16(first, second));
}

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

// gemm_int8 takes gemv_int8_panels below this many rows
constexpr int64_t kSmallRows = 8;

// Where the CPU runs 512-bit vectors at full width (the build's -DTWOSTEP_WIDE_DOT, set by
// kernels/__init__.py), the small-row product takes two step pairs a vector: pair_quads' q0 of pairs
// 2i and 2i + 1 side by side, against 64 bytes of pair_layout as they lie (4 and 8-bit codes in
// groups of 32 or more; 5 and 6-bit codes and groups of 16 keep the 256-bit steps). The same int32
// sums in other lanes: the same bits. On a Zen 5 (AVX512-VNNI, two threads, Q4_0 / Q4_1 / Q4_K /
// Q8_0, 1, 2 and 4 rows, two runs): 1.09-1.22x the 256-bit steps on a layer's four linears in
// cache, 0.99-1.10x on a step's 97 streamed from memory (memory-bound there, more so at 1 row); a
// Zen 4 runs 512-bit vectors as two halves, where a microbenchmark found them 0.87x.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(TWOSTEP_WIDE_DOT)
constexpr bool kWideDotBuild = true;
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
constexpr bool kWideDotBuild = false;
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
void gemv_int8_panels(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride) {
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

// The panel layout's bytes of panels first .. first + count - 1 (codes, then scales and mins), asked
// for in `steps` even slices (prefetcht0, one a cache line): the next chunk of the int8 product's
// unpacked path, read while the tiles compute on the current one. Without it the unpacking read the
// weights from memory with nothing else in flight (half the samples of a batch-32 Q4_0 product in
// its first loads). On a Zen 5, 97 Qwen-shape linears and the head: Q4_0 1.15-1.16x at 16 and 32
// rows, Q8_0 1.02-1.06x (prefetcht1 0.96-1.0x of that; the whole chunk in the first half of the
// tiles 0.92-0.97x). The row layout is not read ahead.
class ChunkAhead {
 public:
  ChunkAhead() = default;     // nothing to read
  ChunkAhead(const Planes& p, int bits, int64_t first, int64_t count, int64_t steps) {
    if (!p.panels || count <= 0) return;
    const int64_t block = panel_block(bits), nb = p.k / kBlock, floats = count * p.groups_row() * kPanel;
    add(p.qs + first * nb * block, count * nb * block);
    add(p.scales + p.scale_at(first * kPanel, 0), floats * 2);
    if (p.mins) add(p.mins + p.scale_at(first * kPanel, 0), floats * 2);
    for (Range& r : ranges_) r.slice = (r.bytes + steps - 1) / std::max<int64_t>(steps, 1);
  }
  void step() {
    for (Range& r : ranges_) {
      const int64_t n = std::min(r.slice, r.bytes - r.done);
      for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(r.at + r.done + b, 0, 3);
      r.done += n;
    }
  }

 private:
  struct Range {
    const char* at;
    int64_t bytes, done = 0, slice = 0;
  };
  void add(const void* at, int64_t bytes) { ranges_.push_back({static_cast<const char*>(at), bytes}); }
  std::vector<Range> ranges_;
};

template <int BITS, bool G16, typename out_t>
void gemm_int8_bits(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride) {
  const int64_t k = p.k, nb = k / kBlock, groups = p.groups_row();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  if (p.panels && m < kSmallRows) return gemv_int8_panels<BITS, G16>(p, n, m, a, out, stride);
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
void gemm_int8_panels(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride) {
  const bool g16 = p.group == 16;
  switch (p.bits) {
    case 4: return g16 ? gemm_int8_bits<4, true>(p, n, m, a, out, stride) : gemm_int8_bits<4, false>(p, n, m, a, out, stride);
    case 5: return g16 ? gemm_int8_bits<5, true>(p, n, m, a, out, stride) : gemm_int8_bits<5, false>(p, n, m, a, out, stride);
    case 8: if constexpr (kDpbusd) return gemm_int8_bits<8, false>(p, n, m, a, out, stride); else return;
    default: return g16 ? gemm_int8_bits<6, true>(p, n, m, a, out, stride) : gemm_int8_bits<6, false>(p, n, m, a, out, stride);
  }
}

constexpr bool kInt8 = true;

const char* kPath =
#if defined(__AVXVNNI__)
    "avx-vnni";
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    "avx512-vnni";
#else
    "avx2";
#endif

#else  // plain C++

template <int BITS>
inline void decode_codes(const uint8_t* qs, const uint8_t* qh, int* codes) {
  for (int i = 0; i < kBlock; ++i) {
    if constexpr (BITS == 8) {
      codes[i] = static_cast<int8_t>(qs[i]);
    } else {
      int q = i < 16 ? (qs[i] & 0xF) : (qs[i - 16] >> 4);
      if constexpr (BITS == 5) q |= ((qh[i % 4] >> (i / 4)) & 1) << 4;
      if constexpr (BITS == 6) q |= ((qh[i % 8] >> (2 * (i / 8))) & 3) << 4;
      codes[i] = q;
    }
  }
}

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

template <int BITS>
inline void dequantize_block(const uint8_t* qs, const uint8_t* qh, float d0, float o0, float d1, float o1,
                             float* out) {
  int codes[kBlock];
  decode_codes<BITS>(qs, qh, codes);
  for (int i = 0; i < kBlock; ++i) out[i] = i < 16 ? d0 * codes[i] + o0 : d1 * codes[i] + o1;
}

const char* kPath = "scalar";
constexpr bool kInt8 = false;     // no int8 product in plain C++
constexpr bool kDpbusd = false;
constexpr bool kPanels = false;   // nor the panel layout's matrix-vector product
constexpr bool kWideDotBuild = false;
constexpr bool kWidePass = false;


#endif

// weight rows: qs is [n, bytes] in the row layout, [n / 8, blocks, bytes] in the panel layout
int64_t rows_of(const at::Tensor& qs) { return qs.dim() == 3 ? qs.size(0) * kPanel : qs.size(0); }

Planes planes_of(const at::Tensor& qs, const c10::optional<at::Tensor>& qh, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t zero, int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8");
  TORCH_CHECK(k % kBlock == 0 && group > 0 && (group == 16 || group % kBlock == 0) && k % group == 0, "bad k / group");
  TORCH_CHECK(qs.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf, "bad planes");
  // the planes must hold what k and the format say, so no read goes past them
  const bool panels = qs.dim() == 3, has_qh = qh.has_value() && qh->defined();
  const int64_t n = rows_of(qs), groups = k / group;
  if (panels) {
    TORCH_CHECK(!has_qh, "the panel layout keeps the high bits in qs (no qh plane)");
    TORCH_CHECK(qs.size(1) == k / kBlock && qs.size(2) == panel_block(bits), "qs: [n / 8, ", k / kBlock,
                ", ", panel_block(bits), "] bytes for k = ", k, " in the panel layout");
  } else {
    TORCH_CHECK((bits == 5 || bits == 6) == has_qh, "qh plane mismatch");
    TORCH_CHECK(qs.dim() == 2 && qs.size(1) == (bits == 8 ? k : k / 2), "qs: [n, ", bits == 8 ? k : k / 2,
                "] bytes for k = ", k);
  }
  TORCH_CHECK(scales.numel() == n * groups, "scales: one per group of ", group, " weights");
  TORCH_CHECK(!(mins.has_value() && mins->defined()) ||
              (mins->is_contiguous() && mins->scalar_type() == at::kHalf && mins->numel() == n * groups),
              "mins: contiguous float16, one per group");
  TORCH_CHECK(!(qh.has_value() && qh->defined()) ||
              (qh->is_contiguous() && qh->numel() == n * (bits == 5 ? k / 8 : k / 4)), "qh: the high bits of every code");
  Planes p{reinterpret_cast<const uint8_t*>(qs.data_ptr()),
           qh.has_value() && qh->defined() ? qh->data_ptr<uint8_t>() : nullptr,
           scales.data_ptr<at::Half>(),
           mins.has_value() && mins->defined() ? mins->data_ptr<at::Half>() : nullptr,
           k, static_cast<int>(group), static_cast<int>(zero), static_cast<int>(bits), panels, groups};
  if ((group & (group - 1)) == 0) p.group_shift = __builtin_ctzll(group);
  return p;
}

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
    default: TORCH_CHECK(false, "gemv takes 1 to 8 rows");
  }
}

#ifdef TWOSTEP_AVX2
// whether torch's brgemm multiplies T x T -> float here (a 1 x 16 x 32 product of ones), probed once
template <typename T>
bool brgemm_runs() {
  static const bool runs = [] {
    try {
      std::vector<T> a(32, T(1.f)), b(32 * 16, T(1.f));
      std::vector<float> c(16);
      at::native::cpublas::brgemm(1, 16, 32, 32, 16, 16, false, a.data(), b.data(), c.data());
      at::native::cpublas::brgemm_release(!std::is_same_v<T, float>);   // float's brgemm is not VNNI-packed
      return c[0] == 32.f;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return runs;
}
#endif

// ---- gemm_bf16: bf16 rows against the panel layout through oneDNN's brgemm ----
// torch's brgemm with add_C (the CPUBLAS_BRGEMM_* macros came with it); older torch keeps the tiles
#if defined(TWOSTEP_AVX2) && defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__) && \
    defined(CPUBLAS_BRGEMM_BF16BF16F32)
#define TWOSTEP_BF16_GEMM 1
#endif

#ifdef TWOSTEP_BF16_GEMM
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

// whether this build has gemm_bf16 and torch's brgemm multiplies bf16 on this CPU (oneDNN's
// ukernel: AVX512-BF16 or AMX)
bool brgemm_bf16_runs() { return brgemm_runs<at::BFloat16>(); }
#else
bool brgemm_bf16_runs() { return false; }
#endif

// ---- gemm_f32: float32 rows against the panel layout through oneDNN's float brgemm ----
// What gemm_bf16 is to bf16 rows, for the float32 rows of CPUs without native bf16 (AVX2 alone:
// Zen 1-3, older Intel), where the other way is dequantized tiles through MKL's float32 GEMM
#if defined(TWOSTEP_AVX2) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define TWOSTEP_F32_GEMM 1
#endif

#ifdef TWOSTEP_F32_GEMM
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

// whether torch's float brgemm runs here (oneDNN's, where its CPU check passes; else torch's own loop)
bool brgemm_f32_runs() { return brgemm_runs<float>(); }
#else
bool brgemm_f32_runs() { return false; }
#endif

// gemv and gemm_int8 below after their checks of the planes: x [M, p.k] and out [M, n] as they say
void gemv_planes(const Planes& p, int64_t n, const at::Tensor& x, at::Tensor& out) {
  const int64_t k = p.k, m = x.size(0), group = p.group;
  const int bits = p.bits;
  TORCH_CHECK(!p.panels || kPanels, "this build has no product for the panel layout");
  TORCH_CHECK(m <= (p.panels ? kPanelCallRows : 8), "gemv takes 1 to ", p.panels ? kPanelCallRows : 8,
              " rows in this layout; got ", m);
  QuantizedActivations a;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_activations", [&] {
    a = quantize_activations<scalar_t>(x.data_ptr<scalar_t>(), m, k, x.stride(0));
  });
  if (p.mins) sum_groups(a, m, k, group);
#ifdef TWOSTEP_AVX2
  if (p.panels && bits == 8 && kQuadPasses) expand_quads(a, m, k);
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "gemv_out", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
#ifdef TWOSTEP_AVX2
    if (p.panels) return gemv_panel_formats(p, n, m, a, o, out.stride(0));
#endif
    switch (bits) {
      case 4: return gemv_bits<4>(p, n, m, a, o, out.stride(0));
      case 5: return gemv_bits<5>(p, n, m, a, o, out.stride(0));
      case 6: return gemv_bits<6>(p, n, m, a, o, out.stride(0));
      default: return gemv_bits<8>(p, n, m, a, o, out.stride(0));
    }
  });
}

void gemm_int8_planes(const Planes& p, int64_t n, const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(p.bits != 8 || kDpbusd, "this build's int8 product takes 4 to 6-bit codes (8-bit ones need VNNI)");
#ifdef TWOSTEP_AVX2
  const int64_t m = x.size(0);
  if (m == 0) return;
  Int8Activations a;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_int8", [&] {
    a = quantize_int8<scalar_t>(x.data_ptr<scalar_t>(), m, p.k, x.stride(0), p.group);
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "gemm_int8_out", [&] {
    gemm_int8_panels<scalar_t>(p, n, m, a, out.data_ptr<scalar_t>(), out.stride(0));
  });
#else
  (void)p, (void)n, (void)x, (void)out;      // multiplied only with AVX2
  TORCH_CHECK(false, "this build has no int8 product (it needs AVX2)");
#endif
}

void check_rows(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "2-D row-major views");
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == x.scalar_type()) && out.size(0) == x.size(0),
              "out must be [M, n], float32 or x's dtype");
}

// A part's planes, checked once, as the decode stack keeps them (planes_product below)
struct CheckedPlanes {
  Planes p;
  int64_t n;
};

// The ops' checks of x [M, k], the planes and out [M, n]
CheckedPlanes checked_call(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& qh,
                           const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits,
                           int64_t group, int64_t zero, const at::Tensor& out) {
  check_rows(x, out);
  const CheckedPlanes c{planes_of(qs, qh, scales, mins, bits, group, zero, x.size(1)), rows_of(qs)};
  TORCH_CHECK(out.size(1) == c.n, "out has ", out.size(1), " columns for ", c.n, " weight rows");
  return c;
}

}  // namespace

// out[m, :n] = x[m] . w^T for x [M, k], M <= 8 in the row layout, <= kPanelCallRows in the panel
// layout; out is [M, n] with unit column stride, float32 or x's dtype (the sums are float32 either
// way; a bf16 / fp16 out saves the caller a cast). Each row's sums are the same at any M.
void gemv(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& qh, const at::Tensor& scales,
          const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_gemv", c10::ArrayRef<c10::IValue>({}));
  const CheckedPlanes c = checked_call(x, qs, qh, scales, mins, bits, group, zero, out);
  gemv_planes(c.p, c.n, x, out);
}

// The same product for any number of rows through the int8 path (AVX2 builds; 4 to 6-bit codes):
// out [M, n] float32 or x's dtype, unit column stride.
void gemm_int8(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& qh,
               const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group,
               int64_t zero, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_gemm_int8", c10::ArrayRef<c10::IValue>({}));
  const CheckedPlanes c = checked_call(x, qs, qh, scales, mins, bits, group, zero, out);
  gemm_int8_planes(c.p, c.n, x, out);
}

// The decode stack's way to these products (kernels/decode_step.cpp): a part's planes checked once
// at load into bytes it keeps (checked_planes), then each step's call through a plain function
// pointer (planes_product_address) instead of the dispatcher. Through the dispatcher a call read
// each plane's tensor (its impl and storage) and the op's entry, every one of them evicted by the
// step's weight stream: ~0.7 us a call on the Qwen shape, 97 calls a step (a step 1.008x). The same
// products, the same sums: only the way in differs. The caller keeps the planes' tensors alive.
at::Tensor checked_planes(const at::Tensor& qs, const c10::optional<at::Tensor>& qh, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t zero,
                          int64_t k) {
  const CheckedPlanes checked{planes_of(qs, qh, scales, mins, bits, group, zero, k), rows_of(qs)};
  at::Tensor bytes = at::empty({static_cast<int64_t>(sizeof checked)}, at::kByte);
  std::memcpy(bytes.data_ptr(), &checked, sizeof checked);
  return bytes;
}

// out = x . w^T as gemm_int8 (int8) or gemv computes it, for w checked by checked_planes
void planes_product(const void* planes, bool int8, const at::Tensor& x, at::Tensor& out) {
  // (the profiler's shapes as the ops record them: x first; made only while it records shapes)
  RECORD_FUNCTION(int8 ? "twostep::quant_gemm_int8" : "twostep::quant_gemv", std::vector<c10::IValue>({x, out}));
  CheckedPlanes c;
  std::memcpy(&c, planes, sizeof c);
  check_rows(x, out);
  TORCH_CHECK(x.size(1) == c.p.k && out.size(1) == c.n, "x [M, ", c.p.k, "] and out [M, ", c.n, "]");
  int8 ? gemm_int8_planes(c.p, c.n, x, out) : gemv_planes(c.p, c.n, x, out);
}

int64_t planes_product_address() { return reinterpret_cast<int64_t>(&planes_product); }

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

namespace {

// dequantize_rows after its checks of the planes: ids in range, out [ids, p.k] contiguous
void dequantize_rows_planes(const Planes& p, int64_t n, const at::Tensor& ids, at::Tensor& out) {
  const int64_t count = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) TORCH_CHECK(id[r] >= 0 && id[r] < n, "row id out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_rows", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    switch (p.bits) {
      case 4: return dequantize_into<4, scalar_t>(p, id, count, o);
      case 5: return dequantize_into<5, scalar_t>(p, id, count, o);
      case 6: return dequantize_into<6, scalar_t>(p, id, count, o);
      default: return dequantize_into<8, scalar_t>(p, id, count, o);
    }
  });
}

}  // namespace

// out[r] = w[ids[r]] for each id; out [len(ids), k] float32, bf16 or fp16, contiguous.
void dequantize_rows(const at::Tensor& qs, const c10::optional<at::Tensor>& qh, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t zero,
                     const at::Tensor& ids, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_dequantize_rows", c10::ArrayRef<c10::IValue>({}));
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && out.is_contiguous(), "bad ids / out");
  TORCH_CHECK(out.size(0) == ids.numel(), "out rows != ids");
  dequantize_rows_planes(planes_of(qs, qh, scales, mins, bits, group, zero, out.size(1)), rows_of(qs), ids, out);
}

// rows `ids` of a part checked by checked_planes into out [ids, k] (the decode stack's embedding
// lookup, as dequantize_rows computes it)
void planes_rows(const void* planes, const at::Tensor& ids, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_dequantize_rows", c10::ArrayRef<c10::IValue>({}));
  CheckedPlanes c;
  std::memcpy(&c, planes, sizeof c);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && out.is_contiguous(), "bad ids / out");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == ids.numel() && out.size(1) == c.p.k, "out: [ids, ", c.p.k, "]");
  dequantize_rows_planes(c.p, c.n, ids, out);
}

int64_t planes_rows_address() { return reinterpret_cast<int64_t>(&planes_rows); }

// The checks gemm_bf16 and gemm_f32 share (2-D row-major x and out of `type`, the panel layout, a
// brgemm that runs here) and the weight's planes
Planes brgemm_planes(const char* name, at::ScalarType type, bool runs, const at::Tensor& x, const at::Tensor& qs,
                     const c10::optional<at::Tensor>& qh, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t zero,
                     const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "2-D row-major views");
  TORCH_CHECK(x.scalar_type() == type && out.scalar_type() == type, name, ": x and out of ", type);
  const Planes p = planes_of(qs, qh, scales, mins, bits, group, zero, x.size(1));
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == rows_of(qs), "out must be [", x.size(0), ", ", rows_of(qs), "]");
  TORCH_CHECK(p.panels, name, " takes the panel layout");
  TORCH_CHECK(runs, "this build or CPU has no brgemm for ", name);
  return p;
}

// f(std::integral_constant<int, BITS>) for a weight's code width
template <typename F>
void with_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// out [m, n] (unit column stride) = x [m, k] . w^T for bf16 x and w in the panel layout, where
// has_bf16_gemm(): the prefill product, at oneDNN's bf16 rate on weights dequantized 64 rows at a
// time into a thread's buffer (no dequantized tile goes through memory)
void gemm_bf16(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& qh, const at::Tensor& scales,
               const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_gemm_bf16", c10::ArrayRef<c10::IValue>({}));
  const Planes p = brgemm_planes("gemm_bf16", at::kBFloat16, brgemm_bf16_runs(), x, qs, qh, scales, mins, bits,
                                 group, zero, out);
  if (x.size(0) == 0) return;
#ifdef TWOSTEP_BF16_GEMM
  with_bits(bits, [&](auto b) {
    gemm_bf16_panels<decltype(b)::value>(p, out.size(1), x.size(0), x.data_ptr<at::BFloat16>(), x.stride(0),
                          out.data_ptr<at::BFloat16>(), out.stride(0));
  });
#else
  (void)p;
#endif
}

// the same for float32 x and out, where has_f32_gemm(): the prefill product of float32 models,
// oneDNN's float brgemm on weights dequantized 64 rows x 1024 weights at a time
void gemm_f32(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& qh, const at::Tensor& scales,
              const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_gemm_f32", c10::ArrayRef<c10::IValue>({}));
  const Planes p = brgemm_planes("gemm_f32", at::kFloat, brgemm_f32_runs(), x, qs, qh, scales, mins, bits, group,
                                 zero, out);
  if (x.size(0) == 0) return;
#ifdef TWOSTEP_F32_GEMM
  with_bits(bits, [&](auto b) {
    gemm_f32_panels<decltype(b)::value>(p, out.size(1), x.size(0), x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(),
                         out.stride(0));
  });
#else
  (void)p;
#endif
}

// Row j of a panel's block b (bytes `block`) from the row-major planes, BITS a constant so the
// high bits' places (high_chunks, high_shift) are shifts and masks, not divisions (a Q4_K_M file's
// 5-bit tensors: ~6x faster to pack)
template <int BITS>
inline void pack_panel_row(const Planes& p, int64_t row, int64_t b, int j, uint8_t* block) {
  const uint8_t* src = p.qs + row * p.qs_row() + b * qs_bytes(BITS);
  if constexpr (BITS == 8) {      // codes 2c, 2c + 1: two bytes as they are
    for (int c = 0; c < 16; ++c) std::memcpy(block + 16 * c + 2 * j, src + 2 * c, 2);
  } else {
    const uint8_t* hb = BITS > 4 ? p.qh + row * p.qh_row() + b * qh_bytes(BITS) : nullptr;
    int code[kBlock];             // code i of the row, as the row layout stores it (packed.py)
    for (int i = 0; i < kBlock; ++i) {
      code[i] = i < 16 ? src[i] & 0xF : src[i - 16] >> 4;
      if constexpr (BITS == 5) code[i] |= ((hb[i % 4] >> (i / 4)) & 1) << 4;
      if constexpr (BITS == 6) code[i] |= ((hb[i % 8] >> (2 * (i / 8))) & 3) << 4;
    }
    for (int c = 0; c < 8; ++c) {       // codes 4c + u in the low nibbles, 4c + 2 + u in the high ones
      for (int u = 0; u < 2; ++u) {
        block[16 * c + 2 * j + u] = static_cast<uint8_t>((code[4 * c + u] & 0xF) | ((code[4 * c + 2 + u] & 0xF) << 4));
        if constexpr (BITS > 4)         // the high bits of codes 4c + u (h = 0) and 4c + 2 + u (h = 1)
          for (int h = 0; h < 2; ++h) {
            uint8_t& at = block[kNibbleChunks + 16 * (c / high_chunks(BITS)) + 2 * j + u];
            at |= static_cast<uint8_t>((code[4 * c + 2 * h + u] >> 4) << (4 - high_shift(BITS, c, h)));
          }
      }
    }
  }
}

// The panel layout of row-major planes (n a multiple of 8): (qs, scales, mins) as described at the
// top; quantization/packed.py's to_panels is the reference this is tested against.
std::vector<at::Tensor> pack_panels(const at::Tensor& qs, const c10::optional<at::Tensor>& qh, const at::Tensor& scales,
                                    const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group, int64_t k) {
  const Planes p = planes_of(qs, qh, scales, mins, bits, group, 0, k);
  const int64_t n = qs.size(0), nb = k / kBlock, groups = k / group, panels = n / kPanel;
  TORCH_CHECK(!p.panels && n % kPanel == 0, "the panel layout takes row-major planes, rows a multiple of 8");
  const int64_t block_bytes = panel_block(static_cast<int>(bits));
  at::Tensor out = at::zeros({panels, nb, block_bytes}, qs.options());
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr());
  with_bits(bits, [&](auto width) {
    constexpr int BITS = decltype(width)::value;
    at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
      for (int64_t panel = begin; panel < end; ++panel)
        for (int64_t b = 0; b < nb; ++b)
          for (int j = 0; j < kPanel; ++j)
            pack_panel_row<BITS>(p, panel * kPanel + j, b, j, dst + (panel * nb + b) * block_bytes);
    });
  });
  // [n, groups] -> [n / 8, groups, 8]
  auto interleave = [&](const at::Tensor& t) { return t.reshape({panels, kPanel, groups}).transpose(1, 2).contiguous(); };
  return {out, interleave(scales), mins.has_value() && mins->defined() ? interleave(*mins) : at::Tensor()};
}

std::string path() { return kPath; }
// the code widths the int8 product takes here: 8-bit codes need VNNI's u8 x s8 product in int32
std::vector<int64_t> int8_bits() {
  if (!kInt8) return {};
  if (kDpbusd) return {4, 5, 6, 8};
  return {4, 5, 6};
}
bool has_int8() { return !int8_bits().empty(); }
// the fewest rows worth the int8 product: any with the small-row kernel (the panel layout), else 8
int64_t int8_min_rows() { return kPanels ? 1 : 8; }
bool has_panels() { return kPanels; }
bool wide_pass() { return kWidePass; }
bool wide_dot() { return kWideDotBuild; }
bool has_bf16_gemm() { return brgemm_bf16_runs(); }
bool has_f32_gemm() { return brgemm_f32_runs(); }

// Also torch custom ops (torch.ops.twostep.quant_gemv, ...); the portable build of this file, loaded
// beside the native one, registers its own namespace, as does a build with -DTWOSTEP_VARIANT=name
// (a variant of this file A/B-timed against the native build in one process).
#ifdef TWOSTEP_FORCE_SCALAR
#define TWOSTEP_OPS twostep_portable
#elif defined(TWOSTEP_VARIANT)
#define TWOSTEP_OPS TWOSTEP_VARIANT
#else
#define TWOSTEP_OPS twostep
#endif
#define TWOSTEP_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TWOSTEP_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

TWOSTEP_FRAGMENT(TWOSTEP_OPS, m) {
  m.def("quant_gemv(Tensor x, Tensor qs, Tensor? qh, Tensor scales, Tensor? mins, int bits, int group, int zero, "
        "Tensor(a!) out) -> ()");
  m.def("quant_gemm_int8(Tensor x, Tensor qs, Tensor? qh, Tensor scales, Tensor? mins, int bits, int group, "
        "int zero, Tensor(a!) out) -> ()");
  m.def("quant_gemm_bf16(Tensor x, Tensor qs, Tensor? qh, Tensor scales, Tensor? mins, int bits, int group, "
        "int zero, Tensor(a!) out) -> ()");
  m.def("quant_gemm_f32(Tensor x, Tensor qs, Tensor? qh, Tensor scales, Tensor? mins, int bits, int group, "
        "int zero, Tensor(a!) out) -> ()");
  m.def("quant_dequantize_rows(Tensor qs, Tensor? qh, Tensor scales, Tensor? mins, int bits, int group, "
        "int zero, Tensor ids, Tensor(a!) out) -> ()");
}

TWOSTEP_IMPL(TWOSTEP_OPS, m) {
  m.impl("quant_gemv", [](const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& qh,
                          const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits,
                          int64_t group, int64_t zero, at::Tensor out) { gemv(x, qs, qh, scales, mins, bits, group, zero, out); });
  m.impl("quant_gemm_int8", [](const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& qh,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits,
                               int64_t group, int64_t zero, at::Tensor out) {
    gemm_int8(x, qs, qh, scales, mins, bits, group, zero, out);
  });
  m.impl("quant_gemm_bf16", [](const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& qh,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits,
                               int64_t group, int64_t zero, at::Tensor out) {
    gemm_bf16(x, qs, qh, scales, mins, bits, group, zero, out);
  });
  m.impl("quant_gemm_f32", [](const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& qh,
                              const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits,
                              int64_t group, int64_t zero, at::Tensor out) {
    gemm_f32(x, qs, qh, scales, mins, bits, group, zero, out);
  });
  m.impl("quant_dequantize_rows", [](const at::Tensor& qs, const c10::optional<at::Tensor>& qh,
                                     const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits,
                                     int64_t group, int64_t zero, const at::Tensor& ids, at::Tensor out) {
    dequantize_rows(qs, qh, scales, mins, bits, group, zero, ids, out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "quantized matrix-vector product for a few rows (panel_call_rows()), int16 activations");
  m.def("panel_call_rows", [] { return kPanelCallRows; }, "the most rows gemv takes in the panel layout (8 in the row layout)");
  m.def("checked_planes", &checked_planes, "a part's planes checked once, as bytes planes_product reads");
  m.def("planes_rows_address", &planes_rows_address,
        "the address of void planes_rows(const void* planes, const Tensor& ids, Tensor& out)");
  m.def("planes_product_address", &planes_product_address,
        "the address of void planes_product(const void* planes, bool int8, const Tensor& x, Tensor& out)");
  m.def("gemm_int8", &gemm_int8, "quantized matrix product for any rows, int8 activations (AVX2; 4-6-bit codes)");
  m.def("has_int8", &has_int8, "whether this build has the int8 product");
  m.def("int8_bits", &int8_bits, "the code widths this build's int8 product takes");
  m.def("int8_min_rows", &int8_min_rows, "the fewest rows for which the int8 product beats the passes");
  m.def("has_panels", &has_panels, "whether this build multiplies the panel layout");
  m.def("wide_pass", &wide_pass, "whether this build's panel product takes 8 rows in one pass");
  m.def("wide_dot", &wide_dot, "whether this build's small-row int8 product takes 512-bit steps (TWOSTEP_WIDE_DOT)");
  m.def("pack_panels", &pack_panels, "row-major planes in the panel layout: qs (with the high bits), scales, mins");
  m.def("gemm_bf16", &gemm_bf16, "bf16 rows x the panel layout through oneDNN's brgemm (has_bf16_gemm())");
  m.def("has_bf16_gemm", &has_bf16_gemm, "whether this build and CPU have gemm_bf16");
  m.def("gemm_f32", &gemm_f32, "float32 rows x the panel layout through oneDNN's float brgemm (has_f32_gemm())");
  m.def("has_f32_gemm", &has_f32_gemm, "whether this build and CPU have gemm_f32");
  m.def("dequantize_rows", &dequantize_rows, "rows of a quantized matrix as floats");
  m.def("path", &path, "the instruction set this build uses");
}
