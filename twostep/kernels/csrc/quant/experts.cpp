// A mixture-of-experts layer's experts over a step's rows (layers/moe.py, platforms/cpu/experts.py):
// the (row, slot) pairs grouped by the expert they chose, then each chosen expert once over its rows:
// its gate and up products, the activation, its down product; last, each row's weighted sum of its
// experts' outputs in slot order. The experts' weights are stacked, [E * n, k] per projection (checked
// planes): an expert is a window of rows into them, so only the chosen experts' rows are read.
//
// Threads: where the step chose at least two experts per thread (batch-1 decode chooses top-k),
// each thread runs whole experts, the products inside it serially (at::parallel_for runs inline in a
// parallel region): one parallel region a layer, and both cores stream their own experts' weights.
// Fewer experts: one after another, each product split over the threads as the dense products are.
// With `gemm` (a prompt's rows, never a decode batch's: a decode row's sums stay those of the passes
// whatever its batch), an expert with more float32 rows than the passes' crossover with the dense
// layers' gemm_f32 (quant_linear.py's F32_GEMM_GEMV_MAX_ROWS) multiplies them through oneDNN's brgemm
// against its panels, as a dense prompt's rows are.
#include "ops.h"

#include "codes.h"
#include "layout.h"
#include "products.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace twostep::quant {
namespace {

enum ExpertAct : int64_t { kSilu = 0, kSwigluOai = 2 };

struct ExpertWeight {
  Planes p;
  int64_t rows;          // an expert's rows (its output features)
  bool int8;             // the int8 product (where this build takes the code width)
  const float* bias;     // [E * rows] float32, or none
};

ExpertWeight expert_weight(const at::Tensor& checked, int64_t experts, bool int8, const OptionalTensor& bias,
                           const char* name) {
  TORCH_CHECK(checked.scalar_type() == at::kByte && checked.numel() == static_cast<int64_t>(sizeof(CheckedPlanes)),
              name, ": the planes as checked_planes gives them");
  CheckedPlanes c;
  std::memcpy(&c, checked.data_ptr(), sizeof c);
  TORCH_CHECK(c.n % experts == 0, name, ": ", c.n, " rows are not ", experts, " experts' worth");
  const int64_t rows = c.n / experts;
  TORCH_CHECK(!c.p.panels || rows % kPanel == 0, name, ": an expert's rows must be whole panels of ", kPanel);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == c.n),
              name, ": a float32 bias of every expert's rows");
  const bool takes_int8 = kInt8 && (c.p.bits != 8 || kDpbusd);
  return {c.p, rows, int8 && takes_int8, has_bias ? bias->data_ptr<float>() : nullptr};
}

// the planes of the rows first_row.. of w (first_row a multiple of 8 in the panel layout)
Planes rows_from(const Planes& w, int64_t first_row) {
  Planes p = w;
  if (p.panels) {
    p.qs += (first_row / kPanel) * (p.k / kBlock) * panel_block(p.bits);
  } else {
    p.qs += first_row * p.qs_row();
    if (p.qh != nullptr) p.qh += first_row * p.qh_row();
  }
  p.scales += first_row * p.groups;
  if (p.mins != nullptr) p.mins += first_row * p.groups;
  return p;
}

// Rows quantized once for every product that reads them alike: gate and up share their input, and
// at batch 1 every chosen expert does (the products quantize their input themselves otherwise)
struct RowCodes {
  bool int8;
  Int8Activations i8;
  QuantizedActivations i16;
};

bool quads(const ExpertWeight& w) { return w.p.panels && w.p.bits == 8 && kQuadPasses; }

// whether a and b read their input quantized the same way (so one quantization serves both)
bool same_codes(const ExpertWeight& a, const ExpertWeight& b) {
  return a.int8 == b.int8 && a.p.group == b.p.group && (a.p.mins != nullptr) == (b.p.mins != nullptr) &&
         quads(a) == quads(b);
}

// whether m rows of x take oneDNN's brgemm against w (a prompt's many float32 rows; see the top)
bool takes_brgemm(const ExpertWeight& w, int64_t m, const at::Tensor& x, bool gemm) {
  return gemm && !w.int8 && w.p.panels && x.scalar_type() == at::kFloat && m > (w.p.bits == 8 ? 16 : 8) &&
         brgemm_f32_runs();
}

// whether m rows of x take one call of w's integer products (the int8 product any; the int16
// passes their rows), so that codes quantized once serve the call
bool one_call(const ExpertWeight& w, int64_t m, const at::Tensor& x, bool gemm) {
  return !takes_brgemm(w, m, x, gemm) && (w.int8 || m <= (w.p.panels ? panel_call_rows() : 8));
}

template <typename T>
void quantize_rows(const ExpertWeight& w, const at::Tensor& x, RowCodes& c) {
  const T* xs = x.data_ptr<T>();
  if (w.int8) {
    c.i8 = quantize_int8(xs, x.size(0), w.p.k, x.stride(0), w.p.group);
  } else {
    c.i16 = quantize_int16(xs, x.size(0), w.p.k, x.stride(0), w.p.group, w.p.mins != nullptr, quads(w));
  }
}

// x's rows quantized as w's products read them (the engine's float types: the quantizers' builds)
RowCodes row_codes(const ExpertWeight& w, const at::Tensor& x) {
  RowCodes c{w.int8, {}, {}};
  switch (x.scalar_type()) {
    case at::kFloat: quantize_rows<float>(w, x, c); break;
    case at::kBFloat16: quantize_rows<c10::BFloat16>(w, x, c); break;
    case at::kHalf: quantize_rows<c10::Half>(w, x, c); break;
    default: TORCH_CHECK(false, "experts: float32, bf16 or fp16 rows");
  }
  return c;
}

// out [m, rows] (float32) = x [m, k] . expert e's rows^T + its bias; codes: x already quantized for w
void expert_product(const ExpertWeight& w, int64_t e, const at::Tensor& x, at::Tensor& out, bool gemm,
                    const RowCodes* codes = nullptr) {
  const Planes p = rows_from(w.p, e * w.rows);
  const int64_t m = x.size(0);
  float* o = out.data_ptr<float>();
  if (codes != nullptr) {
    if (codes->int8) {
      p.panels && m < kSmallRows ? gemv_int8_panels(p, w.rows, m, codes->i8, o, out.stride(0))
                                 : gemm_int8_tiles(p, w.rows, m, codes->i8, o, out.stride(0));
    } else {
      p.panels ? panels_gemv(p, w.rows, m, codes->i16, o, out.stride(0)) : rows_gemv(p, w.rows, m, codes->i16, o, out.stride(0));
    }
  } else if (takes_brgemm(w, m, x, gemm)) {
    panels_gemm_f32(p, w.rows, x.size(0), x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), out.stride(0));
  } else if (w.int8) {
    gemm_int8_planes(p, w.rows, x, out);
  } else {
    const int64_t step = p.panels ? panel_call_rows() : 8, m = x.size(0);
    for (int64_t r = 0; r < m; r += step) {
      at::Tensor part = out.narrow(0, r, std::min(step, m - r));
      gemv_planes(p, w.rows, x.narrow(0, r, part.size(0)), part);
    }
  }
  if (w.bias == nullptr) return;
  const float* b = w.bias + e * w.rows;
  for (int64_t i = 0; i < out.size(0); ++i)
    for (int64_t j = 0; j < w.rows; ++j) o[i * w.rows + j] += b[j];
}

// gate = act(gate, up), in place, float32
void activate(at::Tensor& gate, const at::Tensor& up, int64_t act, float alpha, float limit) {
  float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  const int64_t n = gate.numel();
  if (act == kSwigluOai) {
    for (int64_t i = 0; i < n; ++i) {
      const float x = std::min(g[i], limit), y = std::min(std::max(u[i], -limit), limit);
      g[i] = (y + 1.0f) * (x / (1.0f + std::exp(-alpha * x)));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

}  // namespace

void experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& gate,
             const at::Tensor& up, const at::Tensor& down, int64_t num_experts, int64_t act, double alpha,
             double limit, const OptionalTensor& gate_bias, const OptionalTensor& up_bias,
             const OptionalTensor& down_bias, bool int8, bool gemm, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_experts", std::vector<c10::IValue>({x}));
  TORCH_CHECK(act == kSilu || act == kSwigluOai, "experts: activation 0 (SiLU) or 2 (clamped SwiGLU)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.sizes() == x.sizes() && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(), "experts: x and out [T, hidden], contiguous, one dtype");
  const int64_t t = x.size(0), hidden = x.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == t && ids.scalar_type() == at::kLong && ids.is_contiguous() &&
                  weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "experts: ids (int64) and weights (float32) [T, k], contiguous");
  const ExpertWeight g = expert_weight(gate, num_experts, int8, gate_bias, "gate"),
                     u = expert_weight(up, num_experts, int8, up_bias, "up"),
                     d = expert_weight(down, num_experts, int8, down_bias, "down");
  TORCH_CHECK(g.p.k == hidden && u.p.k == hidden && u.rows == g.rows && d.p.k == g.rows && d.rows == hidden,
              "experts: gate and up [E * I, hidden], down [E * hidden, I]");
  const int64_t k = ids.size(1), pairs = t * k;
  const int64_t* id = ids.data_ptr<int64_t>();
  // the pairs grouped by expert (a counting sort: pair order kept within an expert)
  std::vector<int64_t> start(num_experts + 1, 0), order(pairs), slot_of(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_experts, "experts: expert id ", id[i], " out of range");
    ++start[id[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1), active;
  for (int64_t i = 0; i < pairs; ++i) {
    slot_of[i] = next[id[i]]++;
    order[slot_of[i]] = i;
  }
  for (int64_t e = 0; e < num_experts; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  at::Tensor rows = at::empty({pairs}, at::kLong);
  for (int64_t i = 0; i < pairs; ++i) rows.data_ptr<int64_t>()[i] = order[i] / k;
  const at::Tensor xs = x.index_select(0, rows);                 // each expert's rows, together
  at::Tensor ys = at::empty({pairs, hidden}, x.options().dtype(at::kFloat));
  // gate and up read their rows quantized alike where they can take them in one call each (not
  // brgemm's float rows); one row (batch 1): every expert's, quantized once for the layer
  const bool shared = same_codes(g, u);
  const bool one_row = t == 1 && shared && one_call(g, 1, x, gemm);
  RowCodes layer_codes;
  if (one_row) layer_codes = row_codes(g, x);
  auto run = [&](int64_t a) {
    const int64_t e = active[a], first = start[e], m = start[e + 1] - first;
    const at::Tensor xe = one_row ? x : xs.narrow(0, first, m);
    at::Tensor h = at::empty({m, g.rows}, at::kFloat), hu = at::empty({m, g.rows}, at::kFloat);
    if (shared && one_call(g, m, xe, gemm)) {
      const RowCodes own = one_row ? RowCodes{} : row_codes(g, xe);
      const RowCodes& codes = one_row ? layer_codes : own;
      expert_product(g, e, xe, h, gemm, &codes);
      expert_product(u, e, xe, hu, gemm, &codes);
    } else {
      expert_product(g, e, xe, h, gemm);
      expert_product(u, e, xe, hu, gemm);
    }
    activate(h, hu, act, static_cast<float>(alpha), static_cast<float>(limit));
    at::Tensor ye = ys.narrow(0, first, m);
    expert_product(d, e, h, ye, gemm);
  };
  const int64_t n_active = static_cast<int64_t>(active.size());
  if (n_active >= 2 * at::get_num_threads()) {
    at::parallel_for(0, n_active, 1, [&](int64_t begin, int64_t end) {
      for (int64_t a = begin; a < end; ++a) run(a);
    });
  } else {
    for (int64_t a = 0; a < n_active; ++a) run(a);
  }
  // each row: its experts' outputs times their weights, in slot order, in float32
  const float* y = ys.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "experts_sum", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(hidden);
      for (int64_t r = begin; r < end; ++r) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < k; ++j) {
          const float* yr = y + slot_of[r * k + j] * hidden;
          const float wj = w[r * k + j];
          for (int64_t c = 0; c < hidden; ++c) acc[c] += wj * yr[c];
        }
        for (int64_t c = 0; c < hidden; ++c) o[r * hidden + c] = static_cast<scalar_t>(acc[c]);
      }
    });
  });
}

int64_t experts_address() { return reinterpret_cast<int64_t>(&experts); }

}  // namespace twostep::quant
