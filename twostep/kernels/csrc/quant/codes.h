// The code-level SIMD helpers the products share: a block's codes decoded from either layout,
// integer multiply-adds (VNNI where the build has it), dequantisation of a block, rounding a row of
// sums to the output's type, reading ahead; and what this build's instruction set gives the
// products (the k* constants). Plain C++ equivalents where the build has no AVX2.
#pragma once

#include "../simd.h"
#include "layout.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace twostep::quant {

#ifdef TWOSTEP_AVX2
using simd::fp16;
using simd::hsum;
using simd::load8;

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
inline constexpr bool kDpbusd = true;
inline __m256i dot8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_dpbusd_epi32(acc, u, s);
#endif
}
#else
inline constexpr bool kDpbusd = false;
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
inline constexpr bool kWidePass = true;
#else
inline constexpr bool kWidePass = false;
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
inline constexpr int kPrefetchAhead = TWOSTEP_PREFETCH_AHEAD;
#else
inline constexpr int kPrefetchAhead = 2048;
#endif
inline void prefetch_ahead(const uint8_t* p, int n) {
  for (int line = 0; line < n; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchAhead + line, _MM_HINT_T0);
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

// The 8-bit passes without AVX-512 take two chunks a step in one 256-bit load, widened in place (each
// byte unpacked beside itself, then shifted right: rows 0-3 of both chunks in `lo`, rows 4-7 in `hi`)
// and multiplied against the row's activations as they lie in memory: `quads` holds each four codes
// of q as a vector, the first pair four times in the low lane and the second in the high one (chunk
// c's pair beside chunk c's codes, c + 1's beside c + 1's). No broadcast, and no lane-crossing
// widening (vpmovsxbw), in a loop that Zen 1's one integer-multiply pipe bounds: in L2, one thread,
// 1.07-1.10x / 1.2x / 1.4x the broadcast form's rate at 1 / 2 / 4 rows; the same integer sums.
inline constexpr bool kQuadPasses = !kWidePass;

inline constexpr int64_t kPanelBytes = 32 * kPanel;  // a block of a panel's codes

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

// what this build's products are (ops.cpp reports them)
inline constexpr bool kInt8 = true;     // the int8 product (gemm_int8.cpp, gemv_int8.cpp)
inline constexpr bool kPanels = true;   // the panel layout's products
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(TWOSTEP_WIDE_DOT)
inline constexpr bool kWideDotBuild = true;   // gemv_int8.cpp's 512-bit steps
#else
inline constexpr bool kWideDotBuild = false;
#endif
inline constexpr const char* kPath =
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

template <int BITS>
inline void dequantize_block(const uint8_t* qs, const uint8_t* qh, float d0, float o0, float d1, float o1,
                             float* out) {
  int codes[kBlock];
  decode_codes<BITS>(qs, qh, codes);
  for (int i = 0; i < kBlock; ++i) out[i] = i < 16 ? d0 * codes[i] + o0 : d1 * codes[i] + o1;
}

inline constexpr const char* kPath = "scalar";
inline constexpr bool kInt8 = false;     // no int8 product in plain C++
inline constexpr bool kDpbusd = false;
inline constexpr bool kPanels = false;   // nor the panel layout's matrix-vector product
inline constexpr bool kWideDotBuild = false;
inline constexpr bool kWidePass = false;
inline constexpr bool kQuadPasses = false;

#endif

}  // namespace twostep::quant
