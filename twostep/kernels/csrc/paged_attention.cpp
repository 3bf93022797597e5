// Decode attention over the paged KV cache, reading K/V blocks where they are (no gather, no
// padding). One task per (sequence, KV head) and part of the context (past 256 positions a context
// is split, its parts' partial softmaxes merged after); each task handles the G query heads that
// share that KV head, for each of the sequence's new tokens (1, or 1 + k drafts under a causal
// limit). Scores, softmax and the weighted sum of V are computed in float32.
//
// Keys and values are taken 16 positions at a time, each asked for 48 positions ahead: a float32
// cache's vectors where they lie, a 16-bit cache's converted into a float tile (a bf16 cache's keys
// for bf16 queries, with AVX512-BF16, read as they lie by bf16 dot products: tile_scores_bf16). Per
// query row, the 16 scores of a tile come from 16 vectorised dot products whose horizontal sums are
// folded together in one shuffle tree (instead of 16 separate reductions), the softmax runs over
// whole vectors, and the values are accumulated into the outputs of as many rows at once as fit in
// registers (up to 4: tile_accumulate). The head sizes 64, 128 and 256 are compiled as such; with
// AVX-512 their steps are intrinsics (AVX2: the scores, and the accumulation up to 64), otherwise and
// for other head sizes the same steps as plain loops.
//
// A layer's options (attention/options.py), none of which costs anything unset: a sliding window (a
// query at p sees p - window < k <= p: a sequence's context starts at its first query's window, and
// the positions before are never read, their blocks possibly freed; each row masks below its own
// window as it masks above its position), Gemma 2's soft cap on the scores (softcap * tanh(s /
// softcap) over each tile, in a copy of the scoring pass of its own), and gpt-oss's sinks (a logit per
// query head in each softmax's denominator, counted once: in a whole context's softmax, or where a
// split context's parts are merged).
#include <torch/csrc/utils/pybind.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TWOSTEP_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TWOSTEP_AVX2 1
#endif

namespace {

constexpr int64_t TILE = 16;   // positions per tile
constexpr int64_t kAhead = 48; // positions whose vectors are asked for ahead of their use
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// One 16-bit key or value vector to float32 (the bf16 case as the bit shift it is, which vectorises).
inline void to_float(const at::Half* p, float* x, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) x[d] = static_cast<float>(p[d]);
}
inline void to_float(const at::BFloat16* p, float* x, int64_t dim) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(p);
  for (int64_t d = 0; d < dim; ++d) {
    const uint32_t u = static_cast<uint32_t>(bits[d]) << 16;
    std::memcpy(x + d, &u, sizeof u);
  }
}

// A position's place in the cache, walking the block table one position at a time.
struct Cursor {
  int64_t block = 0, offset = 0;              // position = block * block_size + offset
  void advance(int64_t block_size) {
    if (++offset == block_size) { offset = 0; ++block; }
  }
};

// Calls fn(j, n, rows) for positions begin + j, begin + j + 16, ... < end of one sequence's K (or
// V) head h, rows[t] the float32 vector of position begin + j + t for t < n (rows past n repeat the
// first: their scores are never read), walking the block table: a float32 cache is read where it
// lies, a 16-bit one converted into `tile` (a copy a position was 14% of a float32 SmolLM2 decode
// at ~400 positions, libc's memmove called per vector). Each position's vector is prefetched kAhead
// positions ahead (the heads of a position are interleaved, so a head's vectors are strided): one
// tile ahead left a long context waiting on memory. Against one tile, with each layer's cache out of
// the caches (a 2 MB read between layers, 24 layers): SmolLM2's heads 1.09x at 100 positions,
// 1.28-1.35x at 1,500-3,000; Qwen2.5-0.5B's 1.11x (1,000 positions; 8 sequences of 500). 32 and 64
// positions measured a little slower; asking for a whole tile at once (one table lookup a tile)
// 0.6x, and spread over the tile's conversions still slower than this walk.
// kRaw: rows[t] points at the cached vector itself, in the cache's dtype (no tile, no conversion).
template <bool kRaw = false, typename T, typename Fn>
inline void for_each_tile(const T* cache, const int64_t* table, int64_t begin, int64_t end, int64_t block_size,
                          int64_t token_stride, int64_t h, int64_t dim, float* tile, Fn fn) {
  const auto at = [&](const Cursor& c) { return cache + (table[c.block] * block_size + c.offset) * token_stride + h * dim; };
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  Cursor now{begin / block_size, begin % block_size}, ahead = now;
  std::conditional_t<kRaw, const T*, const float*> rows[TILE];
  const auto fetch = [&] {
    const char* next = reinterpret_cast<const char*>(at(ahead));
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(next + b);
    ahead.advance(block_size);
  };
  for (int64_t p = 0; p < std::min(kAhead, end - begin); ++p) fetch();
  for (int64_t j = 0; begin + j < end; j += TILE) {
    const int64_t n = std::min(TILE, end - begin - j);
    for (int64_t t = 0; t < n; ++t) {
      if (begin + j + t + kAhead < end) fetch();
      if constexpr (kRaw || std::is_same_v<T, float>) {
        rows[t] = at(now);
      } else {
        to_float(at(now), tile + t * dim, dim);
        rows[t] = tile + t * dim;
      }
      now.advance(block_size);
    }
    for (int64_t t = n; t < TILE; ++t) rows[t] = rows[0];
    fn(j, n, rows);
  }
}

// e^x for the softmax's x <= 0, branch-free so that loops over it vectorise (std::exp is a scalar
// call): x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf polynomial (about 1 ulp), 2^n put
// straight into the exponent bits. Below -87 (and for -inf), 0.
inline float exp_nonpositive(float x) {
  const float c = std::max(x, -87.0f);
  const float n = std::floor(c * 1.44269504088896341f + 0.5f);
  const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

// The float vectors of the build's paths: W = 16 lanes with AVX-512, 8 with AVX2. sums(v) folds W
// vectors into one vector of their W lane sums, one shuffle tree for all of them; a row of up to
// kRowRegisters vectors is held in registers.
#ifdef TWOSTEP_AVX512
struct Floats {
  using V = __m512;
  static constexpr int64_t W = 16, kRowRegisters = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V splat(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }      // b where a is NaN
  static V sums(const V v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i)           // per 128-bit lane: pair sums of v[2i], v[2i+1]
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                           _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)           // per 128-bit lane L: lane-L sums of v[4i .. 4i+3]
      b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#elif defined(TWOSTEP_AVX2)
struct Floats {
  using V = __m256;
  static constexpr int64_t W = 8, kRowRegisters = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V splat(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }      // b where a is NaN
  static V sums(const V v[8]) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    // lane halves: s0123 = v0..v3's sums of lanes 0-3, then of lanes 4-7; s4567 the same for v4..v7
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
  }
};
#endif
#if defined(TWOSTEP_AVX512) || defined(TWOSTEP_AVX2)
#define TWOSTEP_VECTORS 1
#endif

// scores[t] = scale * q . rows[t] for the 16 positions of a tile
template <int64_t DIM>
inline void tile_scores(const float* q, const float* const* rows, int64_t dim, float scale, float* scores) {
#ifdef TWOSTEP_VECTORS
  if constexpr (DIM > 0 && DIM % Floats::W == 0) {
    using F = Floats;
    for (int64_t t0 = 0; t0 < TILE; t0 += F::W) {      // W positions a pass, their sums in one vector
      // a chunk of q loaded once for the W positions (a load a multiply-add, not two)
      typename F::V acc[F::W];
      const typename F::V q0 = F::load(q);
      for (int64_t t = 0; t < F::W; ++t) acc[t] = F::mul(q0, F::load(rows[t0 + t]));
      for (int64_t c = 1; c < DIM / F::W; ++c) {
        const typename F::V qc = F::load(q + F::W * c);
        for (int64_t t = 0; t < F::W; ++t) acc[t] = F::fmadd(qc, F::load(rows[t0 + t] + F::W * c), acc[t]);
      }
      F::store(scores + t0, F::mul(F::sums(acc), F::splat(scale)));
    }
    return;
  }
#endif
  for (int64_t t = 0; t < TILE; ++t) {
    float s = 0.0f;
    for (int64_t d = 0; d < dim; ++d) s += q[d] * rows[t][d];
    scores[t] = s * scale;
  }
}

// Where the build has AVX512-BF16 (Zen 4 and later, Sapphire Rapids and later), a bf16 cache's scores
// for bf16 queries come from the keys as they lie, two products an instruction (vdpbf16ps): each
// product of two bf16 values is exact in float32 and summed in float32, in pairs of dimensions
// instead of one dimension a lane, so the sums are rounded in another order (and, as the instruction
// does, a subnormal input counts as zero). The keys are not converted into a float tile.
#if defined(TWOSTEP_AVX512) && defined(__AVX512BF16__)
#define TWOSTEP_DOT_BF16 1
constexpr bool kBuildHasDotBf16 = true;
template <int64_t DIM>
inline void tile_scores_bf16(const at::BFloat16* q, const at::BFloat16* const* keys, float scale, float* scores) {
  static_assert(DIM % 32 == 0);
  __m512bh qc[DIM / 32];
  for (int64_t c = 0; c < DIM / 32; ++c) qc[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  __m512 acc[TILE];
  for (int64_t t = 0; t < TILE; ++t) {
    acc[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qc[0], (__m512bh)_mm512_loadu_si512(keys[t]));
    for (int64_t c = 1; c < DIM / 32; ++c)
      acc[t] = _mm512_dpbf16_ps(acc[t], qc[c], (__m512bh)_mm512_loadu_si512(keys[t] + 32 * c));
  }
  Floats::store(scores, Floats::mul(Floats::sums(acc), Floats::splat(scale)));
}
#else
constexpr bool kBuildHasDotBf16 = false;
#endif

// o[i] += sum over t < n of p[i * stride + t] * rows[t] for the R rows i < R of a KV head's group,
// R at once where R rows' sums fit in registers (16 vectors with AVX-512, 8 with AVX2): each value
// vector is loaded once for them, and the sums are R * DIM / W independent chains (one row's
// DIM / W chains of 16 dependent multiply-adds ran at half the multiply-add rate). Each row's sums
// are taken in the same order as alone, so the outputs are the same bit for bit.
#ifdef TWOSTEP_VECTORS
constexpr int64_t kSums = Floats::kRowRegisters;   // sum vectors held at once

template <int64_t DIM, int64_t R>
inline void accumulate_group(float* const* o, const float* p, int64_t stride, const float* const* rows, int64_t n) {
  using F = Floats;
  constexpr int64_t C = DIM / F::W;
  typename F::V ov[R][C];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t c = 0; c < C; ++c) ov[i][c] = F::load(o[i] + F::W * c);
  for (int64_t t = 0; t < n; ++t) {
    typename F::V v[C];
    for (int64_t c = 0; c < C; ++c) v[c] = F::load(rows[t] + F::W * c);
    for (int64_t i = 0; i < R; ++i) {
      const typename F::V pt = F::splat(p[i * stride + t]);
      for (int64_t c = 0; c < C; ++c) ov[i][c] = F::fmadd(pt, v[c], ov[i][c]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t c = 0; c < C; ++c) F::store(o[i] + F::W * c, ov[i][c]);
}

// rows in groups of R, the rest in groups of fewer
template <int64_t DIM, int64_t R>
inline void accumulate_groups(float* const* o, const float* p, int64_t stride, int64_t count,
                              const float* const* rows, int64_t n) {
  int64_t r = 0;
  for (; r + R <= count; r += R) accumulate_group<DIM, R>(o + r, p + r * stride, stride, rows, n);
  if constexpr (R > 1)
    if (r < count) accumulate_groups<DIM, R - 1>(o + r, p + r * stride, stride, count - r, rows, n);
}
#endif

template <int64_t DIM>
inline void tile_accumulate(float* const* o, const float* p, int64_t stride, int64_t count, const float* const* rows,
                            int64_t n, int64_t dim) {
#ifdef TWOSTEP_VECTORS
  if constexpr (DIM > 0 && DIM % Floats::W == 0 && DIM / Floats::W <= kSums) {
    accumulate_groups<DIM, std::min<int64_t>(4, kSums / (DIM / Floats::W))>(o, p, stride, count, rows, n);
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < dim; ++d) o[i][d] += p[i * stride + t] * rows[t][d];
}

// In place: s[from, n) = e^(s - m) with m the largest of s[from, n) and of `floor` (a sink's logit,
// -inf where there is none: then m is the scores' largest, as it always was), s[0, from) and s[n, len)
// = 0 (positions before a sliding window, after a row's own). Returns m and the sum of the
// exponentials (from = n, a row that sees none of these positions: max(-inf, floor) and 0).
struct Exponentials { float max, sum; };

// The largest of s[0, n), NaNs passed over (-inf where none is larger): as a chain of std::max(m,
// s[j]), which the compiler leaves scalar (a NaN makes max order-dependent) and which was a tenth of
// a long context's attention, in vectors: max(s, m) keeps m where s is NaN. (Where the largest is a
// zero, which of +0 and -0 comes back may differ from the chain's: e^(s - m) is the same.) The same
// outputs bit for bit; Qwen2.5-0.5B's heads (14 over 2 KV heads, bf16) 1.06x at 190 positions,
// 1.11-1.12x at 1,000-3,000.
inline float largest(const float* s, int64_t n) {
  float m = NEG_INF;
  int64_t j = 0;
#ifdef TWOSTEP_VECTORS
  using F = Floats;
  if (n >= 4 * F::W) {
    typename F::V acc[4] = {F::splat(NEG_INF), F::splat(NEG_INF), F::splat(NEG_INF), F::splat(NEG_INF)};
    for (; j + 4 * F::W <= n; j += 4 * F::W)
      for (int a = 0; a < 4; ++a) acc[a] = F::max(F::load(s + j + a * F::W), acc[a]);
    float lanes[F::W];
    F::store(lanes, F::max(F::max(acc[0], acc[1]), F::max(acc[2], acc[3])));
    for (float x : lanes) m = std::max(m, x);
  }
#endif
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

inline Exponentials exponentiate(float* s, int64_t from, int64_t n, int64_t len, float floor = NEG_INF) {
  const float m = std::max(largest(s + from, n - from), floor);
  for (int64_t j = from; j < n; ++j) s[j] = exp_nonpositive(s[j] - m);
  float sum = 0.0f;
  for (int64_t j = from; j < n; ++j) sum += s[j];
  std::fill(s, s + from, 0.0f);
  std::fill(s + n, s + len, 0.0f);
  return {m, sum};
}

// In place: s[from, n) = softmax(s[from, n)), the rest of s[0, len) = 0. A sink (gpt-oss: a logit
// per query head, -inf where there is none) joins the denominator and takes no value: e^(sink - m)
// is added to the sum (with none, + 0: the same bits as without).
inline void softmax(float* s, int64_t from, int64_t n, int64_t len, float sink) {
  const Exponentials e = exponentiate(s, from, n, len, sink);
  const float inv = 1.0f / (e.sum + exp_nonpositive(sink - e.max));
  for (int64_t j = from; j < n; ++j) s[j] *= inv;
}

// tanh(x), branch-free so that a tile's loop over it vectorises (std::tanh is a scalar call: it made
// a capped bf16 SmolLM2-shaped layer 2-3.5x the uncapped one's time): Cephes' tanhf, an odd polynomial
// below |x| = 0.625, else (1 - e^-2|x|) / (1 + e^-2|x|) with the sign put back; a few ulp.
inline float tanh_float(float x) {
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float a = std::fabs(x), e = exp_nonpositive(-2.0f * a);
  const float large = std::copysign((1.0f - e) / (1.0f + e), x);
  return a < 0.625f ? small : large;
}

// Gemma 2's soft cap on a tile's scores: s = cap * tanh(s / cap), as HF's eager attention computes it.
inline void cap_scores(float* s, float cap) {
  for (int64_t t = 0; t < TILE; ++t) s[t] = cap * tanh_float(s[t] / cap);
}

// A long context is split into parts of at most kPart positions (flash-decoding): each part is a task
// of its own that leaves its rows' partial results (the sum of e^(score - m) v, m and the sum of the
// exponentials) to be merged after, so that one sequence's few KV heads keep every thread busy (one
// task per (sequence, KV head) gave batch 1 of SmolLM2 three tasks for two threads). The split is a
// function of the length alone (whole tiles, as even as they go), so a sequence's result does not
// depend on the batch it runs in or on the number of threads; up to kPart positions are one part,
// computed as they always were. Under a sliding window the context is the positions the sequence's
// first query sees and after (the blocks before may be freed: never read), split as its length asks.
constexpr int64_t kPart = 256;

struct Part {
  int64_t b, h, begin, end;
  float* partial;   // [rows][dim + 2]: o, m, sum; null where the part is the whole context
};

// A split (sequence, KV head): its parts are parts[first, first + count).
struct Split { int64_t first, count; };

// The earliest position any query of a sequence sees: its first query's (at len - q_len) window's
// first; 0 without a window.
inline int64_t first_visible(int64_t len, int64_t q_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - q_len - window + 1) : 0;
}

// The parts of every (sequence, KV head), in that order, the split pairs among them, and the
// scratch the split parts' partial results go to.
inline std::vector<Part> plan_parts(const int64_t* seq_lens, const int64_t* q_lens, int64_t batch, int64_t kv_heads,
                                    int64_t group, int64_t dim, int64_t window, std::vector<Split>& splits,
                                    std::vector<float>& partials) {
  std::vector<Part> parts;
  std::vector<int64_t> offsets;
  int64_t floats = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = seq_lens[b], start = first_visible(len, q_lens[b], window);
    const int64_t count = (len - start + kPart - 1) / kPart;
    const int64_t size = ((len - start + count - 1) / count + TILE - 1) / TILE * TILE;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t first = static_cast<int64_t>(parts.size());
      for (int64_t begin = start; begin < len; begin += size) {
        parts.push_back({b, h, begin, std::min(len, begin + size), nullptr});
        offsets.push_back(count > 1 ? floats : -1);
        if (count > 1) floats += q_lens[b] * group * (dim + 2);
      }
      if (count > 1) splits.push_back({first, static_cast<int64_t>(parts.size()) - first});
    }
  }
  partials.resize(floats);
  for (size_t i = 0; i < parts.size(); ++i)
    if (offsets[i] >= 0) parts[i].partial = partials.data() + offsets[i];
  return parts;
}

// DIM > 0: the head size known at compile time (the loops over it unroll and vectorise fully);
// DIM == 0: any head size, given at run time. Q: the queries' and the output's dtype (float32, or
// bf16 / fp16 read into float32 rows and written back rounded, as a conversion before and after would;
// except bf16 queries on a bf16 cache under TWOSTEP_DOT_BF16, whose scores are bf16 dot products).
// The layer's options: window > 0, a query at p sees p - window < k <= p (positions before its
// sequence's first query's window are not read); softcap > 0, scores capped by softcap * tanh(s /
// softcap) (only the scoring pass differs, in a copy of its own); sinks, null or a logit per query
// head joining each row's softmax denominator (once: in the whole part's softmax, or at the merge).
template <typename T, int64_t DIM, typename Q>
void decode_attention(const Q* q, const int64_t* q_index, const int64_t* q_lens, int64_t max_q,
                      const T* k_cache, const T* v_cache, const int64_t* tables, int64_t table_stride,
                      const int64_t* seq_lens, int64_t batch, int64_t heads, int64_t kv_heads,
                      int64_t run_dim, int64_t block_size, float scale, int64_t window, float softcap,
                      const float* sinks, Q* out) {
  constexpr bool kFloat = std::is_same_v<Q, float>;
  constexpr bool kDotBf16 = kBuildHasDotBf16 && std::is_same_v<T, at::BFloat16> && std::is_same_v<Q, at::BFloat16> &&
                            DIM > 0 && DIM % 32 == 0;
  const int64_t dim = DIM > 0 ? DIM : run_dim;
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;             // between tokens in a block
  std::vector<Split> splits;
  std::vector<float> partials;
  const std::vector<Part> parts = plan_parts(seq_lens, q_lens, batch, kv_heads, group, dim, window, splits, partials);
  // the sink of row r of KV head h (-inf: none)
  const auto sink_of = [&](int64_t h, int64_t r) { return sinks ? sinks[h * group + r % group] : NEG_INF; };
  // row r of (b, h): query token r / group, head h * group + r % group
  const auto target_of = [&](int64_t b, int64_t h, int64_t r) {
    return out + ((b * max_q + r / group) * heads + h * group + r % group) * dim;
  };
  at::parallel_for(0, static_cast<int64_t>(parts.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, tile(std::is_same_v<T, float> ? 0 : TILE * dim);   // (16-bit caches' vectors)
    std::vector<float> q_rows, out_rows;                   // a 16-bit task's rows in float32
    std::vector<const float*> queries;
    std::vector<const Q*> raw_queries;                     // (as they lie, for the bf16 dot products)
    std::vector<float*> outs;
    std::vector<int64_t> seen, from;                       // the part's positions each row may see: [from, seen)
    for (int64_t task = begin; task < end; ++task) {
      const Part& part = parts[task];
      const int64_t b = part.b, h = part.h, len = seq_lens[b], nq = q_lens[b], rows = nq * group;
      const int64_t span = part.end - part.begin;
      const int64_t stride = (span + TILE - 1) / TILE * TILE;   // a row of scores, whole tiles
      const bool whole = part.partial == nullptr;
      scores.resize(rows * stride);                        // every entry is written below
      queries.resize(rows);
      raw_queries.resize(rows);
      outs.resize(rows);
      seen.resize(rows);
      from.resize(rows);
      if constexpr (!kFloat) {
        q_rows.resize(rows * dim);
        if (whole) out_rows.assign(rows * dim, 0.0f);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r / group;
        const Q* query = q + (q_index[b * max_q + i] * heads + h * group + r % group) * dim;
        raw_queries[r] = query;
        if constexpr (kFloat) {
          queries[r] = query;
          if (whole) {                                     // summed into where it goes
            outs[r] = target_of(b, h, r);
            std::fill(outs[r], outs[r] + dim, 0.0f);
          }
        } else {
          if constexpr (!kDotBf16) to_float(query, q_rows.data() + r * dim, dim);   // (else read as bf16)
          queries[r] = q_rows.data() + r * dim;
          if (whole) outs[r] = out_rows.data() + r * dim;
        }
        if (!whole) {
          outs[r] = part.partial + r * (dim + 2);
          std::fill(outs[r], outs[r] + dim, 0.0f);
        }
        // the last key row r may see is its own position, len - nq + i; the first, under a window, the
        // window's first
        seen[r] = std::clamp<int64_t>(len - nq + i + 1 - part.begin, 0, span);
        from[r] = window > 0 ? std::clamp<int64_t>(len - nq + i - window + 1 - part.begin, 0, seen[r]) : 0;
      }
      const int64_t* table = tables + b * table_stride;
      // the scores, capped or not: a copy of the pass each way, so that no cap costs nothing
      const auto score = [&](auto capped) {
        constexpr bool kCapped = decltype(capped)::value;
#ifdef TWOSTEP_DOT_BF16
        if constexpr (kDotBf16) {
          for_each_tile<true>(k_cache, table, part.begin, part.end, block_size, token_stride, h, dim, nullptr,
                              [&](int64_t j, int64_t, const at::BFloat16* const* keys) {
            for (int64_t r = 0; r < rows; ++r) {
              tile_scores_bf16<DIM>(raw_queries[r], keys, scale, &scores[r * stride + j]);
              if constexpr (kCapped) cap_scores(&scores[r * stride + j], softcap);
            }
          });
          return;
        }
#endif
        for_each_tile(k_cache, table, part.begin, part.end, block_size, token_stride, h, dim, tile.data(),
                      [&](int64_t j, int64_t, const float* const* keys) {
          for (int64_t r = 0; r < rows; ++r) {
            tile_scores<DIM>(queries[r], keys, dim, scale, &scores[r * stride + j]);
            if constexpr (kCapped) cap_scores(&scores[r * stride + j], softcap);
          }
        });
      };
      if (softcap > 0.0f) {
        score(std::true_type{});
      } else {
        score(std::false_type{});
      }
      for (int64_t r = 0; r < rows; ++r) {
        if (whole) {
          softmax(&scores[r * stride], from[r], seen[r], span, sink_of(h, r));
        } else {
          const Exponentials e = exponentiate(&scores[r * stride], from[r], seen[r], span);
          outs[r][dim] = e.max;
          outs[r][dim + 1] = e.sum;
        }
      }
      for_each_tile(v_cache, table, part.begin, part.end, block_size, token_stride, h, dim, tile.data(),
                    [&](int64_t j, int64_t n, const float* const* values) {
        tile_accumulate<DIM>(outs.data(), &scores[j], stride, rows, values, n, dim);
      });
      if constexpr (!kFloat) {
        if (whole)
          for (int64_t r = 0; r < rows; ++r) {
            Q* target = target_of(b, h, r);
            for (int64_t d = 0; d < dim; ++d) target[d] = static_cast<Q>(outs[r][d]);
          }
      }
    }
  });
  // merge each split (sequence, KV head)'s parts: o = sum_p e^(m_p - M) o_p / sum_p e^(m_p - M) sum_p
  // (a pair's merge is a fraction of a microsecond: up to 16 pairs on the calling thread, no fork and join)
  at::parallel_for(0, static_cast<int64_t>(splits.size()), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> weights, merged(dim);
    for (int64_t f = begin; f < end; ++f) {
      const auto [first, count] = splits[f];
      const int64_t b = parts[first].b, h = parts[first].h, rows = q_lens[b] * group;
      weights.resize(count);
      for (int64_t r = 0; r < rows; ++r) {
        // the row's sink joins the denominator here, once (-inf where there is none: + 0)
        const float sink = sink_of(h, r);
        float m = sink, total = 0.0f;
        for (int64_t p = 0; p < count; ++p) m = std::max(m, parts[first + p].partial[r * (dim + 2) + dim]);
        for (int64_t p = 0; p < count; ++p) {
          const float* o = parts[first + p].partial + r * (dim + 2);
          weights[p] = exp_nonpositive(o[dim] - m);
          total += weights[p] * o[dim + 1];
        }
        total += exp_nonpositive(sink - m);
        std::fill(merged.begin(), merged.end(), 0.0f);
        for (int64_t p = 0; p < count; ++p) {
          const float* o = parts[first + p].partial + r * (dim + 2);
          const float w = weights[p] / total;
          for (int64_t d = 0; d < dim; ++d) merged[d] += w * o[d];
        }
        Q* target = target_of(b, h, r);
        for (int64_t d = 0; d < dim; ++d) target[d] = static_cast<Q>(merged[d]);
      }
    }
  });
}

}  // namespace

// Every index the kernel follows, checked before it runs: a bad plan is an error, never a read
// outside the cache. Under a sliding window, the table's entries before the blocks the window reaches
// are not followed (their blocks may be freed), and not checked.
void check_plan(const at::Tensor& q, const at::Tensor& q_index, const at::Tensor& q_lens,
                const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& seq_lens, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q_index.dim() == 2 && tables.dim() == 2, "q [T, H, D], q_index [B, Q], tables [B, n]");
  TORCH_CHECK(q_index.scalar_type() == at::kLong && q_lens.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong && tables.scalar_type() == at::kLong,
              "q_index, q_lens, seq_lens, tables: int64");
  const int64_t batch = q_index.size(0), max_q = q_index.size(1), width = tables.size(1);
  TORCH_CHECK(q_lens.numel() == batch && seq_lens.numel() == batch && tables.size(0) == batch,
              "q_lens, seq_lens, tables: one entry per sequence");
  TORCH_CHECK(q_lens.is_contiguous() && seq_lens.is_contiguous(), "q_lens, seq_lens: contiguous");
  TORCH_CHECK(cache.size(4) == q.size(2) && q.size(1) % cache.size(3) == 0,
              "q's head size and head count must fit the cache's KV heads");
  const int64_t blocks = cache.size(1), block_size = cache.size(2), tokens = q.size(0);
  const int64_t *qi = q_index.data_ptr<int64_t>(), *ql = q_lens.data_ptr<int64_t>();
  const int64_t *sl = seq_lens.data_ptr<int64_t>(), *tb = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(ql[b] >= 1 && ql[b] <= max_q, "sequence ", b, ": q_len ", ql[b], " outside 1..", max_q);
    TORCH_CHECK(sl[b] >= ql[b] && sl[b] <= width * block_size, "sequence ", b, ": seq_len ", sl[b],
                " outside its q_len..", width * block_size, " (the block table's reach)");
    for (int64_t i = 0; i < max_q; ++i)
      TORCH_CHECK(qi[b * max_q + i] >= 0 && qi[b * max_q + i] < tokens, "q_index out of range");
    for (int64_t j = first_visible(sl[b], ql[b], window) / block_size; j < (sl[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tb[b * width + j] >= 0 && tb[b * width + j] < blocks, "block id ", tb[b * width + j], " out of range");
  }
}

// q [T, H, D] float32, bfloat16 or float16; q_index [B, Q] int64 (rows of q, padded with the last); q_lens,
// seq_lens [B] int64; cache [2, num_blocks, block_size, Hkv, D] float32 or bfloat16; tables [B, n]
// int64. Returns [B, Q, H, D] in q's dtype (rows past a sequence's q_len are zeros); the math is
// float32 either way. The layer's options (attention/options.py): window (0: none), softcap (0:
// none), sinks (none, or [H] float32).
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor q_index, at::Tensor q_lens,
                                     at::Tensor cache, at::Tensor tables, at::Tensor seq_lens,
                                     double scale, int64_t window, double softcap, std::optional<at::Tensor> sinks) {
  RECORD_FUNCTION("twostep::paged_decode_attention", c10::ArrayRef<c10::IValue>({}));
  TORCH_CHECK(q.is_contiguous() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
                                     q.scalar_type() == at::kHalf),
              "q: contiguous float32, bfloat16 or float16");
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5, "cache: contiguous [2, blocks, bs, Hkv, D]");
  TORCH_CHECK(tables.is_contiguous() && q_index.is_contiguous(), "tables, q_index: contiguous");
  const int64_t batch = q_index.size(0), max_q = q_index.size(1), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = cache.size(2), kv_heads = cache.size(3);
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window, softcap: 0 (none) or positive");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->numel() == heads),
              "sinks: contiguous float32, one per query head");
  check_plan(q, q_index, q_lens, cache, tables, seq_lens, window);
  const float* sink_logits = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  // rows past a sequence's q_len are zeros; where there are none, every row is written
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const bool padded = std::any_of(ql, ql + batch, [&](int64_t n) { return n != max_q; });
  auto out = padded ? at::zeros({batch, max_q, heads, dim}, q.options())
                    : at::empty({batch, max_q, heads, dim}, q.options());
  const int64_t half = cache.size(1) * block_size * kv_heads * dim;
  auto run = [&](auto* base, auto* queries) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(base)>>;
    using Q = std::remove_pointer_t<decltype(queries)>;
    // 256: Gemma's heads (the size known at compile time: 1.2-1.3x over the run-time size's loops with
    // AVX2, a Gemma 2 2B layer's 8 heads over 4 KV heads at 1,000-2,000 positions)
    auto kernel = dim == 64    ? decode_attention<T, 64, Q>
                  : dim == 128 ? decode_attention<T, 128, Q>
                  : dim == 256 ? decode_attention<T, 256, Q>
                               : decode_attention<T, 0, Q>;
    kernel(queries, q_index.data_ptr<int64_t>(), q_lens.data_ptr<int64_t>(), max_q,
           base, base + half, tables.data_ptr<int64_t>(), tables.size(1),
           seq_lens.data_ptr<int64_t>(), batch, heads, kv_heads, dim, block_size,
           static_cast<float>(scale), window, static_cast<float>(softcap), sink_logits, out.data_ptr<Q>());
  };
  auto with_queries = [&](auto* base) {
    if (q.scalar_type() == at::kFloat) {
      run(base, q.data_ptr<float>());
    } else if (q.scalar_type() == at::kBFloat16) {
      run(base, q.data_ptr<at::BFloat16>());
    } else {
      run(base, q.data_ptr<at::Half>());
    }
  };
  if (cache.scalar_type() == at::kFloat) {
    with_queries(cache.data_ptr<float>());
  } else {
    TORCH_CHECK(cache.scalar_type() == at::kBFloat16, "cache: float32 or bfloat16");
    with_queries(cache.data_ptr<at::BFloat16>());
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(twostep, m) {
  m.def("paged_decode_attention(Tensor q, Tensor q_index, Tensor q_lens, Tensor cache, Tensor tables, "
        "Tensor seq_lens, float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(twostep, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }

// Whether a bf16 cache's scores for bf16 queries take the AVX512-BF16 dot products here.
bool has_bf16_dot() {
#ifdef TWOSTEP_DOT_BF16
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged cache",
        pybind11::arg("q"), pybind11::arg("q_index"), pybind11::arg("q_lens"), pybind11::arg("cache"),
        pybind11::arg("tables"), pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0, pybind11::arg("sinks") = pybind11::none());
  m.def("has_bf16_dot", &has_bf16_dot, "whether bf16 scores take the AVX512-BF16 dot products here");
}
