// Decode attention over the paged KV cache, reading K/V blocks where they are (no gather, no
// padding, no conversion copies). One task per (sequence, KV head); each task handles the G query
// heads that share that KV head, for each of the sequence's new tokens (1, or 1 + k drafts under a
// causal limit). Scores, softmax and the weighted sum of V are computed in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// Calls fn(j, x) for each position j < len of one sequence's K (or V) head h, x being its vector
// converted to float, walking the block table: the cache is read where it lies.
template <typename T, typename Fn>
inline void for_each_position(const T* cache, const int64_t* table, int64_t len, int64_t block_size,
                              int64_t token_stride, int64_t h, int64_t dim, float* x, Fn fn) {
  for (int64_t j0 = 0; j0 < len; j0 += block_size) {
    const T* block = cache + table[j0 / block_size] * block_size * token_stride + h * dim;
    const int64_t n = std::min(block_size, len - j0);
    for (int64_t t = 0; t < n; ++t) {
      const T* p = block + t * token_stride;
      for (int64_t d = 0; d < dim; ++d) x[d] = to_float(p[d]);
      fn(j0 + t, x);
    }
  }
}

// DIM > 0: the head size known at compile time (the loops over it unroll and vectorise fully);
// DIM == 0: any head size, given at run time.
template <typename T, int64_t DIM>
void decode_attention(const float* q, const int64_t* q_index, const int64_t* q_lens, int64_t max_q,
                      const T* k_cache, const T* v_cache, const int64_t* tables, int64_t table_stride,
                      const int64_t* seq_lens, int64_t batch, int64_t heads, int64_t kv_heads,
                      int64_t run_dim, int64_t block_size, float scale, float* out) {
  const int64_t dim = DIM > 0 ? DIM : run_dim;
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;             // between tokens in a block
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, key(dim);
    std::vector<const float*> queries;
    std::vector<float*> outs;
    std::vector<int64_t> limits;                           // the last key each row may see
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t len = seq_lens[b], nq = q_lens[b], rows = nq * group;
      scores.resize(rows * len);                           // every entry is written below
      queries.resize(rows);
      outs.resize(rows);
      limits.resize(rows);
      for (int64_t r = 0; r < rows; ++r) {                 // row r: query token r / group, head h * group + r % group
        const int64_t i = r / group, head = h * group + r % group;
        queries[r] = q + (q_index[b * max_q + i] * heads + head) * dim;
        outs[r] = out + ((b * max_q + i) * heads + head) * dim;
        limits[r] = len - nq + i;
      }
      const int64_t* table = tables + b * table_stride;
      // scores = q . k over every key
      for_each_position(k_cache, table, len, block_size, token_stride, h, dim, key.data(),
                        [&](int64_t j, const float* k) {
        for (int64_t r = 0; r < rows; ++r) {
          const float* qp = queries[r];
          float s = 0.0f;
          for (int64_t d = 0; d < dim; ++d) s += qp[d] * k[d];
          scores[r * len + j] = j <= limits[r] ? s * scale : -std::numeric_limits<float>::infinity();
        }
      });
      for (int64_t r = 0; r < rows; ++r) {                 // softmax over the keys a row may see
        float* s = scores.data() + r * len;
        const int64_t n = limits[r] + 1;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) { s[j] = std::exp(s[j] - m); sum += s[j]; }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; ++j) s[j] *= inv;
        for (int64_t j = n; j < len; ++j) s[j] = 0.0f;
      }
      // out = sum_j p_j v_j
      for_each_position(v_cache, table, len, block_size, token_stride, h, dim, key.data(),
                        [&](int64_t j, const float* v) {
        for (int64_t r = 0; r < rows; ++r) {
          const float p = scores[r * len + j];
          float* o = outs[r];
          for (int64_t d = 0; d < dim; ++d) o[d] += p * v[d];
        }
      });
    }
  });
}

}  // namespace

// q [T, H, D] float32; q_index [B, Q] int64 (rows of q, padded with the last); q_lens, seq_lens [B]
// int64; cache [2, num_blocks, block_size, Hkv, D] float32 or bfloat16; tables [B, n] int64.
// Returns [B, Q, H, D] float32 (rows past a sequence's q_len are zeros).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor q_index, torch::Tensor q_lens,
                                     torch::Tensor cache, torch::Tensor tables, torch::Tensor seq_lens,
                                     double scale) {
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == torch::kFloat, "q: contiguous float32");
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5, "cache: contiguous [2, blocks, bs, Hkv, D]");
  TORCH_CHECK(tables.is_contiguous() && q_index.is_contiguous(), "tables, q_index: contiguous");
  const int64_t batch = q_index.size(0), max_q = q_index.size(1), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = cache.size(2), kv_heads = cache.size(3);
  auto out = torch::zeros({batch, max_q, heads, dim}, q.options());
  const int64_t half = cache.size(1) * block_size * kv_heads * dim;
  auto run = [&](auto* base) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(base)>>;
    auto kernel = dim == 64 ? decode_attention<T, 64> : dim == 128 ? decode_attention<T, 128>
                                                                    : decode_attention<T, 0>;
    kernel(q.data_ptr<float>(), q_index.data_ptr<int64_t>(), q_lens.data_ptr<int64_t>(), max_q,
                     base, base + half, tables.data_ptr<int64_t>(), tables.size(1),
                     seq_lens.data_ptr<int64_t>(), batch, heads, kv_heads, dim, block_size,
                     static_cast<float>(scale), out.data_ptr<float>());
  };
  if (cache.scalar_type() == torch::kFloat) {
    run(cache.data_ptr<float>());
  } else {
    TORCH_CHECK(cache.scalar_type() == torch::kBFloat16, "cache: float32 or bfloat16");
    run(cache.data_ptr<at::BFloat16>());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}
