// A decode step's decoder layers in one call (models/fused_decode.py): a program of instructions
// over three registers that the model's blocks write at load, each block's emit() beside its
// forward() (layers/decoder_layer.py, layers/attention.py, layers/mlp.py, models/causal_lm.py):
// norms (with the residual add), residual adds and scales, linears, the gated activation, the
// attention with its per-layer options, and a mixture of experts (the router, then the quantized
// library's experts kernel through its address). From the step's token ids and positions the program takes
// the embeddings and each rotary table's rows, runs the instructions, and where the step asks for
// every row's logits, the lm_head. Every op is the one the Python layers call (torch.library ops
// looked up once in the dispatcher, or the same ATen ops), with the same arguments in the same
// order, so the results are bit-identical to theirs; what is saved is the interpreter: ~40 Python
// calls, views and tensor wrappers per layer, 1.5-3 ms of a batch-1 step on a 30-layer model.
// No family's layer order is written here: a new block is written once, in Python.
//
// A linear is quantized parts (one quant_gemv each into its columns; with int8 activations, from
// the part's int8 rows, quant_gemm_int8 for the code widths it takes, as the Python layers; both
// called through quant_linear's planes_product, the ops' own functions without the dispatcher), a
// bf16 weight through the bf16 matrix-vector op, or a float weight through at::linear, each with an
// optional bias (added in place, rounded as at::add rounds it).
#include <torch/csrc/utils/pybind.h>
#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  auto handle = c10::Dispatcher::singleton().findSchema({name, ""});
  TORCH_CHECK(handle.has_value(), "operator ", name, " is not registered (its kernel is not loaded)");
  return handle->typed<Signature>();
}

// The ops' C++ signatures exactly as their kernels were registered (the dispatcher checks them).
using AddRmsNorm = Tensor(const Tensor&, Tensor, const Tensor&, double);
using RotaryInPlace = void(Tensor, const Tensor&, const Tensor&);
using WriteKV = void(Tensor, const Tensor&, const Tensor&, const Tensor&);
using PagedAttention = Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, double, int64_t, double,
                              std::optional<Tensor>);
using GatedDelta = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor, Tensor, const Tensor&,
                          const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, int64_t, int64_t, int64_t);

// quant/ops.cpp's planes_product: a part's product from its checked planes, not through the
// dispatcher (read there why)
using PlanesProduct = void (*)(const void* planes, bool int8, const Tensor& x, Tensor& out);
// and its planes_rows: rows of a quantized embedding table
using PlanesRows = void (*)(const void* planes, const Tensor& ids, Tensor& out);
// and its experts: a MoE layer's chosen experts (quant/experts.cpp)
using ExpertsFn = void (*)(const Tensor& x, const Tensor& ids, const Tensor& weights, const Tensor& gate,
                           const Tensor& up, const Tensor& down, int64_t num_experts, int64_t act, double alpha,
                           double limit, const OptTensor& gate_bias, const OptTensor& up_bias,
                           const OptTensor& down_bias, bool int8, bool gemm, Tensor& out);

struct QuantPart {
  Tensor qs, scales;
  OptTensor qh, mins;
  int64_t bits, group, zero;
  int64_t int8_rows;   // from this many rows the int8 product (the widths it takes); 0: never
  Tensor checked;      // the planes as quant_linear's checked_planes gives them
  const void* planes;  // checked's bytes
};

// out += bias in place, each sum rounded to T as at::add rounds it (float32, then to T)
template <typename T>
void add_bias(T* out, const T* bias, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j)
      out[r * n + j] = static_cast<T>(static_cast<float>(out[r * n + j]) + static_cast<float>(bias[j]));
}

class FusedLinear {
 public:
  FusedLinear(int64_t out_features, OptTensor bias) : out_features_(out_features), bias_(std::move(bias)) {
    TORCH_CHECK(!bias_.has_value() || (bias_->dim() == 1 && bias_->is_contiguous() && bias_->size(0) == out_features_),
                "bias: [out_features] contiguous");
  }

  // checked and product_address: the part's checked_planes and quant_linear's planes_product_address()
  void add_quantized(Tensor qs, OptTensor qh, Tensor scales, OptTensor mins, int64_t bits, int64_t group,
                     int64_t zero, int64_t int8_rows, Tensor checked, int64_t product_address) {
    TORCH_CHECK(!weight_.defined(), "a linear is quantized parts or one float weight");
    TORCH_CHECK(product_address != 0 && checked.is_contiguous(), "a part needs its checked planes and product");
    product_ = reinterpret_cast<PlanesProduct>(product_address);
    const void* planes = checked.data_ptr();
    parts_.push_back({std::move(qs), std::move(scales), std::move(qh), std::move(mins), bits, group, zero, int8_rows,
                      std::move(checked), planes});
  }

  void set_weight(Tensor weight, bool bf16_gemv) {
    TORCH_CHECK(parts_.empty(), "a linear is quantized parts or one float weight");
    weight_ = std::move(weight);
    if (bf16_gemv) {
      linear_bf16_ = find_op<Tensor(const Tensor&, const Tensor&, const OptTensor&)>("twostep::linear_bf16");
    }
  }

  // x [t, in] contiguous -> [t, out] in x's dtype, as the layer's LinearMethod computes it
  Tensor operator()(const Tensor& x) const {
    if (linear_bf16_) return linear_bf16_->call(x, weight_, bias_);
    if (weight_.defined()) return at::linear(x, weight_, bias_);
    TORCH_CHECK(!parts_.empty(), "a linear without weights");
    Tensor y = at::empty({x.size(0), out_features_}, x.options());
    int64_t start = 0;
    for (const QuantPart& p : parts_) {
      const int64_t n = p.qs.dim() == 3 ? p.qs.size(0) * 8 : p.qs.size(0);   // the panel layout: [n / 8, ...]
      Tensor columns = parts_.size() == 1 ? y : y.narrow(1, start, n);
      product_(p.planes, p.int8_rows > 0 && x.size(0) >= p.int8_rows, x, columns);
      start += n;
    }
    if (bias_.has_value()) add_bias_to(y);
    return y;
  }

 private:
  // y [t, out] += bias as `y + bias` computes it (in y's dtype; a bias of another dtype through at::add)
  void add_bias_to(Tensor& y) const {
    const Tensor& b = *bias_;
    if (b.scalar_type() != y.scalar_type()) {
      y = y + b;
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "add_bias", [&] {
      add_bias(y.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), y.size(0), out_features_);
    });
  }

  int64_t out_features_;
  OptTensor bias_;
  std::vector<QuantPart> parts_;
  Tensor weight_;
  PlanesProduct product_ = nullptr;
  std::optional<c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const OptTensor&)>> linear_bf16_;
};

// A decode step's attention, as models/../layers/attention.py's Attention.forward computes it: the
// qkv projection, q/k norms (per head or over all heads), rotary over the head or its first dims
// (or none), the K/V write, paged decode attention with the layer's options, o_proj.
struct FusedAttention {
  int64_t heads, kv_heads, dim, rotary_dim;
  int64_t qk_norm;     // 0: none, 1: per head, 2: over all heads
  OptTensor q_norm, k_norm;
  double eps;
  int64_t rope;        // which of the step's rotary tables; -1: none (NoPE)
  double scale, softcap;
  int64_t window;      // 0: none
  OptTensor sinks;
  int64_t cache;       // which layer's K/V cache
  int64_t group;       // its KV-cache group: whose slots and block tables it takes
  bool gated;          // Qwen3.5: o times sigmoid(the gate's rows, after q/k/v in qkv)
  std::shared_ptr<FusedLinear> qkv, o;
};

// A decode step's Gated DeltaNet layer, as layers/gated_deltanet.py's forward computes a batch of
// decodes: its four input projections, the gated_delta_decode kernel (conv, delta rule, gated
// RMSNorm; the layer's conv and recurrent states updated in place at the sequences' slots), out_proj.
struct FusedLinearAttention {
  std::shared_ptr<FusedLinear> qkv, z, b, a, out;
  Tensor conv_weight, A_log, dt_bias, norm_weight;
  double eps;
  int64_t num_k_heads, head_k_dim, head_v_dim;
  int64_t state;       // which layer's states
};

// A decode step's mixture of experts, as layers/moe.py's SparseMoE computes it: the router (a
// linear), its top k as route() picks them (the same ATen ops), then the experts kernel.
struct FusedMoE {
  std::shared_ptr<FusedLinear> router;
  int64_t top_k;
  bool topk_softmax;   // gpt-oss: softmax over the top k logits; else softmax, top k, renormalised or not
  bool renormalise;
  ExpertsFn experts;
  Tensor gate, up, down;   // checked planes
  int64_t num_experts, act;
  double alpha, limit;
  OptTensor gate_bias, up_bias, down_bias;
  int64_t int8_rows;       // from this many rows the int8 products; 0: never
  // Qwen2-MoE, Qwen3.5-MoE, Qwen3-Next: an expert every token takes, times sigmoid(its gate); none: null
  std::shared_ptr<FusedLinear> shared_gate_up, shared_down, shared_gate;
  int64_t shared_act = 0;
};

// What the stack runs: registers X (a layer's output), H (scratch) and R (the residual stream),
// and the instructions the model's blocks emitted at load (each block's emit(), beside its
// forward(), in layers/decoder_layer.py, layers/attention.py, layers/mlp.py, models/causal_lm.py).
enum Op : int64_t { NORM, ADD_NORM, SET_RESIDUAL, ADD_RESIDUAL, SCALE, SCALE_BY, LINEAR, ACT, ATTENTION, MOE,
                    LINEAR_ATTENTION };
enum Act : int64_t { SILU, GELU_TANH };
constexpr int64_t kRegisters = 3;

struct Instruction {
  Op op;
  int64_t dst, src;
  int64_t index;       // a norm's weight, a linear, an attention or the activation
  double value;        // a norm's eps, a scale
};

class DecodeProgram {
 public:
  DecodeProgram()
      : rms_norm_(find_op<Tensor(const Tensor&, const Tensor&, double)>("twostep::rms_norm")),
        add_rms_norm_(find_op<AddRmsNorm>("twostep::add_rms_norm")),
        silu_and_mul_(find_op<Tensor(const Tensor&)>("twostep::silu_and_mul")),
        rotary_(find_op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("twostep::rotary")),
        rotary_inplace_(find_op<RotaryInPlace>("twostep::rotary_")),
        write_kv_(find_op<WriteKV>("twostep::write_kv")),
        attention_(find_op<PagedAttention>("twostep::paged_decode_attention")) {}

  // found when the model has linear-attention layers (its kernel is loaded by then)
  void linear_attention(int64_t dst, int64_t src, std::shared_ptr<FusedLinear> qkv, std::shared_ptr<FusedLinear> z,
                        std::shared_ptr<FusedLinear> b, std::shared_ptr<FusedLinear> a, std::shared_ptr<FusedLinear> out,
                        Tensor conv_weight, Tensor A_log, Tensor dt_bias, Tensor norm_weight, double eps,
                        int64_t num_k_heads, int64_t head_k_dim, int64_t head_v_dim, int64_t state) {
    if (!gated_delta_.has_value()) gated_delta_ = find_op<GatedDelta>("twostep::gated_delta_decode");
    linear_attentions_.push_back({std::move(qkv), std::move(z), std::move(b), std::move(a), std::move(out),
                                  conv_weight.contiguous(), std::move(A_log), std::move(dt_bias), std::move(norm_weight),
                                  eps, num_k_heads, head_k_dim, head_v_dim, state});
    push(LINEAR_ATTENTION, dst, src, static_cast<int64_t>(linear_attentions_.size()) - 1, 0.0);
    num_states_ = std::max(num_states_, state + 1);
  }

  // ---- what the blocks emit -------------------------------------------------------------
  void norm(int64_t dst, int64_t src, Tensor weight, double eps) {
    push(NORM, dst, src, add(weights_, std::move(weight)), eps);
  }
  // R += src; dst = norm(R)
  void add_norm(int64_t dst, int64_t src, Tensor weight, double eps) {
    push(ADD_NORM, dst, src, add(weights_, std::move(weight)), eps);
  }
  void set_residual(int64_t src) { push(SET_RESIDUAL, 2, src, 0, 0.0); }
  void add_residual(int64_t src) { push(ADD_RESIDUAL, 2, src, 0, 0.0); }
  // dst = src * factor (a Python float, as `x * factor`)
  void scale(int64_t dst, int64_t src, double factor) { push(SCALE, dst, src, 0, factor); }
  // dst = src * factor (a 0-dim tensor of src's dtype, as `x * tensor`)
  void scale_by(int64_t dst, int64_t src, Tensor factor) { push(SCALE_BY, dst, src, add(weights_, std::move(factor)), 0.0); }
  void linear(int64_t dst, int64_t src, std::shared_ptr<FusedLinear> linear) {
    linears_.push_back(std::move(linear));
    push(LINEAR, dst, src, static_cast<int64_t>(linears_.size()) - 1, 0.0);
  }
  void act(int64_t dst, int64_t src, int64_t kind) {
    TORCH_CHECK(kind == SILU || kind == GELU_TANH, "an activation the stack has not: ", kind);
    push(ACT, dst, src, kind, 0.0);
  }
  void attention(int64_t dst, int64_t src, int64_t heads, int64_t kv_heads, int64_t dim, int64_t rotary_dim,
                 int64_t qk_norm, OptTensor q_norm, OptTensor k_norm, double eps, int64_t rope, double scale,
                 int64_t window, double softcap, OptTensor sinks, int64_t cache, int64_t group, bool gated,
                 std::shared_ptr<FusedLinear> qkv, std::shared_ptr<FusedLinear> o) {
    TORCH_CHECK(rope < static_cast<int64_t>(cos_tables_.size()), "rotary table ", rope, " not given (set_inputs)");
    TORCH_CHECK(qk_norm == 0 || (q_norm.has_value() && k_norm.has_value()), "q/k norms without their weights");
    attentions_.push_back({heads, kv_heads, dim, rotary_dim, qk_norm, std::move(q_norm), std::move(k_norm), eps, rope,
                           scale, softcap, window, std::move(sinks), cache, group, gated, std::move(qkv), std::move(o)});
    push(ATTENTION, dst, src, static_cast<int64_t>(attentions_.size()) - 1, 0.0);
    num_caches_ = std::max(num_caches_, cache + 1);
    num_groups_ = std::max(num_groups_, group + 1);
  }

  void moe(int64_t dst, int64_t src, std::shared_ptr<FusedLinear> router, int64_t top_k, bool topk_softmax,
           bool renormalise, int64_t experts_address, Tensor gate, Tensor up, Tensor down, int64_t num_experts,
           int64_t act, double alpha, double limit, OptTensor gate_bias, OptTensor up_bias, OptTensor down_bias,
           int64_t int8_rows) {
    TORCH_CHECK(experts_address != 0 && top_k > 0 && top_k <= num_experts, "experts: a kernel and 1..E of them a token");
    moes_.push_back({std::move(router), top_k, topk_softmax, renormalise, reinterpret_cast<ExpertsFn>(experts_address),
                     std::move(gate), std::move(up), std::move(down), num_experts, act, alpha, limit,
                     std::move(gate_bias), std::move(up_bias), std::move(down_bias), int8_rows});
    push(MOE, dst, src, static_cast<int64_t>(moes_.size()) - 1, 0.0);
  }

  // the last mixture of experts' shared expert: gate_up, the activation, down, and its gate
  void moe_shared(std::shared_ptr<FusedLinear> gate_up, std::shared_ptr<FusedLinear> down,
                  std::shared_ptr<FusedLinear> gate, int64_t act) {
    TORCH_CHECK(!moes_.empty() && !program_.empty() && program_.back().op == MOE, "a shared expert follows its moe()");
    FusedMoE& m = moes_.back();
    m.shared_gate_up = std::move(gate_up), m.shared_down = std::move(down), m.shared_gate = std::move(gate);
    m.shared_act = act;
  }

  int64_t num_instructions() const { return static_cast<int64_t>(program_.size()); }

  // The lm_head, so a step that asks for every row's logits gets them from this call too (what
  // CausalLM.compute_logits computes before the family's transform of them)
  void set_head(std::shared_ptr<FusedLinear> lm_head) { lm_head_ = std::move(lm_head); }
  bool has_head() const { return lm_head_ != nullptr; }

  // What the model computes before its layers from a step's token ids and positions: each rotary
  // table's rows (cos / sin [max_positions, 1, rotary dims], in the embeddings' dtype) and the
  // embedding's rows, of a float table (in the tables' dtype) or of a quantized one (its planes
  // checked by quant_linear's checked_planes, read by planes_rows at rows_address; table: none)
  void set_inputs(std::vector<Tensor> cos_tables, std::vector<Tensor> sin_tables, at::ScalarType dtype,
                  OptTensor table, OptTensor checked, int64_t rows_address, int64_t hidden) {
    TORCH_CHECK(cos_tables.size() == sin_tables.size() && table.has_value() != checked.has_value() &&
                    (table.has_value() || rows_address != 0),
                "cos and sin tables in pairs, and a float table or a quantized one's planes");
    cos_tables_ = std::move(cos_tables);
    sin_tables_ = std::move(sin_tables);
    dtype_ = dtype;
    table_ = std::move(table);
    checked_ = std::move(checked);
    rows_ = checked_.has_value() ? reinterpret_cast<PlanesRows>(rows_address) : nullptr;
    table_planes_ = checked_.has_value() ? checked_->data_ptr() : nullptr;
    hidden_ = hidden;
    inputs_set_ = true;
  }

  // ids, positions [t]: the token ids and positions of t sequences decoding one token each;
  // kv_values: each layer's cache values; slots [t] and tables [t, blocks] of each KV-cache group;
  // q_index [t, 1], q_lens, seq_lens: the rest of the paged decode plan; conv_states, recurrent_states:
  // each linear-attention layer's states (another layer's: any tensor), state_slots [t]: each
  // sequence's state slot.
  // -> (X after the program: the final norm's output, and with `logits` float32 logits of every
  // row, as the model's forward and compute_logits return them; else none).
  std::tuple<Tensor, OptTensor> forward(const Tensor& ids, const Tensor& positions,
                                        const std::vector<Tensor>& kv_values, const std::vector<Tensor>& slots,
                                        const Tensor& q_index, const Tensor& q_lens,
                                        const std::vector<Tensor>& tables, const Tensor& seq_lens,
                                        const std::vector<Tensor>& conv_states, const std::vector<Tensor>& recurrent_states,
                                        const OptTensor& state_slots, bool logits) const {
    RECORD_FUNCTION("twostep::decode_layers", c10::ArrayRef<c10::IValue>({}));
    TORCH_CHECK(static_cast<int64_t>(kv_values.size()) >= num_caches_, "one cache per layer: ", kv_values.size(),
                " for ", num_caches_);
    TORCH_CHECK(static_cast<int64_t>(slots.size()) >= num_groups_ && tables.size() == slots.size(),
                "slots and tables for each of the ", num_groups_, " KV-cache groups");
    TORCH_CHECK(inputs_set_, "the stack has no inputs (set_inputs)");
    TORCH_CHECK(num_states_ == 0 || (static_cast<int64_t>(conv_states.size()) >= num_states_ &&
                                     recurrent_states.size() == conv_states.size() && state_slots.has_value()),
                "linear-attention layers: their states and the sequences' slots");
    TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && ids.size(0) == positions.size(0), "ids, positions: [t]");
    at::NoGradGuard no_grad;
    Step step{{}, {}, slots, q_index, q_lens, tables, seq_lens, kv_values, conv_states, recurrent_states, state_slots};
    for (size_t i = 0; i < cos_tables_.size(); ++i) {
      step.cos.push_back(cos_tables_[i].index_select(0, positions));
      step.sin.push_back(sin_tables_[i].index_select(0, positions));
    }
    Tensor r[kRegisters];
    r[0] = embed(ids.to(at::kLong).contiguous());
    for (const Instruction& in : program_) run(in, r, step);
    if (!logits) return {r[0], std::nullopt};
    return {r[0], head(r[0])};
  }

 private:
  struct Step {
    std::vector<Tensor> cos, sin;
    const std::vector<Tensor>& slots;
    const Tensor &q_index, &q_lens;
    const std::vector<Tensor>& tables;
    const Tensor& seq_lens;
    const std::vector<Tensor>& kv;
    const std::vector<Tensor>& conv_states;
    const std::vector<Tensor>& recurrent_states;
    const OptTensor& state_slots;
  };

  template <typename T>
  static int64_t add(std::vector<T>& v, T x) {
    v.push_back(std::move(x));
    return static_cast<int64_t>(v.size()) - 1;
  }

  void push(Op op, int64_t dst, int64_t src, int64_t index, double value) {
    TORCH_CHECK(0 <= dst && dst < kRegisters && 0 <= src && src < kRegisters, "registers are 0..2");
    program_.push_back({op, dst, src, index, value});
  }

  void run(const Instruction& in, Tensor* r, const Step& step) const {
    Tensor& res = r[2];
    switch (in.op) {
      case NORM: r[in.dst] = rms_norm_.call(r[in.src], weights_[in.index], in.value); break;
      case ADD_NORM: r[in.dst] = add_rms_norm_.call(r[in.src], res, weights_[in.index], in.value); break;
      case SET_RESIDUAL: res = r[in.src]; break;
      case ADD_RESIDUAL: res.add_(r[in.src]); break;
      case SCALE: r[in.dst] = r[in.src] * c10::Scalar(in.value); break;
      case SCALE_BY: r[in.dst] = r[in.src] * weights_[in.index]; break;
      case LINEAR: r[in.dst] = (*linears_[in.index])(r[in.src]); break;
      case ACT: r[in.dst] = activation(r[in.src], in.index); break;
      case ATTENTION: r[in.dst] = run_attention(attentions_[in.index], r[in.src], step); break;
      case MOE: r[in.dst] = run_moe(moes_[in.index], r[in.src]); break;
      case LINEAR_ATTENTION: r[in.dst] = run_linear_attention(linear_attentions_[in.index], r[in.src], step); break;
    }
  }

  Tensor run_linear_attention(const FusedLinearAttention& l, const Tensor& h, const Step& step) const {
    const Tensor o = gated_delta_->call((*l.qkv)(h), (*l.z)(h), (*l.a)(h), (*l.b)(h), step.conv_states[l.state],
                                        step.recurrent_states[l.state], *step.state_slots, l.conv_weight, l.A_log,
                                        l.dt_bias, l.norm_weight, l.eps, l.num_k_heads, l.head_k_dim, l.head_v_dim);
    return (*l.out)(o);
  }

  Tensor run_moe(const FusedMoE& m, const Tensor& h) const {
    const Tensor logits = (*m.router)(h);
    Tensor weights, ids;
    if (m.topk_softmax) {
      Tensor top;
      std::tie(top, ids) = at::topk(logits.to(at::kFloat), m.top_k, -1);
      weights = at::softmax(top, -1);
    } else {
      std::tie(weights, ids) = at::topk(at::softmax(logits, -1, at::kFloat), m.top_k, -1);
      if (m.renormalise) weights = weights / weights.sum(-1, true);
    }
    const Tensor x = h.contiguous();
    Tensor out = at::empty_like(x);
    const bool int8 = m.int8_rows > 0 && x.size(0) >= m.int8_rows;
    m.experts(x, ids.contiguous(), weights.contiguous(), m.gate, m.up, m.down, m.num_experts, m.act, m.alpha, m.limit,
              m.gate_bias, m.up_bias, m.down_bias, int8, false, out);
    if (m.shared_down == nullptr) return out;
    const Tensor gate = at::sigmoid((*m.shared_gate)(h));
    return out + gate * (*m.shared_down)(activation((*m.shared_gate_up)(h), m.shared_act));
  }

  // layers/activation.py: silu_and_mul through its op, GELU-tanh as its native torch ops
  Tensor activation(const Tensor& x, int64_t kind) const {
    if (kind == SILU) return silu_and_mul_.call(x);
    const std::vector<Tensor> halves = x.chunk(2, -1);
    return at::gelu(halves[0], "tanh") * halves[1];
  }

  // the embedding's rows [t, hidden] in the model's dtype, as the model's Embedding returns them
  Tensor embed(const Tensor& ids) const {
    if (table_.has_value()) return table_->index_select(0, ids).to(dtype_);
    Tensor rows = at::empty({ids.size(0), hidden_}, at::TensorOptions().dtype(dtype_));
    rows_(table_planes_, ids, rows);
    return rows;
  }

  // float32 logits of every row (named in a profile: step_breakdown counts it under logits)
  Tensor head(const Tensor& hidden) const {
    RECORD_FUNCTION("twostep::decode_head", c10::ArrayRef<c10::IValue>({}));
    TORCH_CHECK(lm_head_ != nullptr, "the stack has no lm_head (set_head)");
    return (*lm_head_)(hidden).to(at::kFloat);
  }

  // rotate the first `dims` dims of heads [t, n, D] in place (the tables' rows are `dims` wide)
  void rotate_in_place(const Tensor& heads, int64_t dims, const Tensor& cos, const Tensor& sin) const {
    rotary_inplace_.call(dims == heads.size(2) ? heads : heads.narrow(2, 0, dims), cos, sin);
  }

  Tensor run_attention(const FusedAttention& a, const Tensor& h, const Step& step) const {
    const int64_t t = h.size(0), q_size = a.heads * a.dim, kv_size = a.kv_heads * a.dim;
    const bool rope = a.rope >= 0, partial = a.rotary_dim < a.dim;
    const Tensor no_table;
    const Tensor& cos = rope ? step.cos[a.rope] : no_table;
    const Tensor& sin = rope ? step.sin[a.rope] : no_table;
    Tensor qkv = (*a.qkv)(h);
    Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, a.kv_heads, a.dim});
    if (a.qk_norm == 2) {            // over all heads, then the heads rotated in place
      q = rms_norm_.call(q, *a.q_norm, a.eps).view({t, a.heads, a.dim});
      k = rms_norm_.call(k, *a.k_norm, a.eps).view({t, a.kv_heads, a.dim});
      if (rope) {
        rotate_in_place(q, a.rotary_dim, cos, sin);
        rotate_in_place(k, a.rotary_dim, cos, sin);
      }
    } else if (a.qk_norm == 1) {     // per head
      q = rms_norm_.call(q.view({t, a.heads, a.dim}), *a.q_norm, a.eps);
      k = rms_norm_.call(k.view({t, a.kv_heads, a.dim}), *a.k_norm, a.eps);
      if (rope && !partial) {
        q = rotary_.call(q, cos, sin);
        k = rotary_.call(k, cos, sin);
      } else if (rope) {
        rotate_in_place(q, a.rotary_dim, cos, sin);
        rotate_in_place(k, a.rotary_dim, cos, sin);
      }
    } else {                         // q's and k's heads side by side: rotated in place, in one call
      q = q.view({t, a.heads, a.dim});
      k = k.view({t, a.kv_heads, a.dim});
      if (rope) rotate_in_place(qkv.narrow(1, 0, q_size + kv_size).view({t, a.heads + a.kv_heads, a.dim}),
                                a.rotary_dim, cos, sin);
    }
    const Tensor& kv = step.kv[a.cache];
    write_kv_.call(kv, k, v, step.slots[a.group]);
    // in q's dtype both ways (the kernel reads 16-bit rows into float32 and writes its output back rounded)
    const Tensor o = attention_.call(q.contiguous(), step.q_index, step.q_lens, kv, step.tables[a.group], step.seq_lens,
                                     a.scale, a.window, a.softcap, a.sinks);
    if (!a.gated) return (*a.o)(o.view({t, q_size}));
    return (*a.o)(o.view({t, q_size}) * at::sigmoid(qkv.narrow(1, q_size + 2 * kv_size, q_size)));
  }

  std::vector<Instruction> program_;
  std::vector<Tensor> weights_;
  std::vector<std::shared_ptr<FusedLinear>> linears_;
  std::vector<FusedAttention> attentions_;
  std::vector<FusedMoE> moes_;
  std::vector<FusedLinearAttention> linear_attentions_;
  int64_t num_states_ = 0;
  std::optional<c10::TypedOperatorHandle<GatedDelta>> gated_delta_;
  int64_t num_caches_ = 0;
  int64_t num_groups_ = 1;
  std::shared_ptr<FusedLinear> lm_head_;
  std::vector<Tensor> cos_tables_, sin_tables_;
  at::ScalarType dtype_ = at::kFloat;
  OptTensor table_, checked_;
  PlanesRows rows_ = nullptr;
  const void* table_planes_ = nullptr;   // checked_'s bytes, as QuantPart keeps its planes
  int64_t hidden_ = 0;
  bool inputs_set_ = false;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm_;
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm_;
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul_;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&)> rotary_;
  c10::TypedOperatorHandle<RotaryInPlace> rotary_inplace_;
  c10::TypedOperatorHandle<WriteKV> write_kv_;
  c10::TypedOperatorHandle<PagedAttention> attention_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<FusedLinear, std::shared_ptr<FusedLinear>>(m, "FusedLinear")
      .def(py::init<int64_t, OptTensor>(), py::arg("out_features"), py::arg("bias"))
      .def("add_quantized", &FusedLinear::add_quantized, "one quantized part (its planes and format)")
      .def("set_weight", &FusedLinear::set_weight, "a float weight [out, in], bf16_gemv: through linear_bf16")
      .def("__call__", &FusedLinear::operator());
  py::class_<DecodeProgram>(m, "DecodeProgram")
      .def(py::init<>())
      .def("norm", &DecodeProgram::norm)
      .def("add_norm", &DecodeProgram::add_norm, "R += src; dst = norm(R)")
      .def("set_residual", &DecodeProgram::set_residual)
      .def("add_residual", &DecodeProgram::add_residual)
      .def("scale", &DecodeProgram::scale)
      .def("scale_by", &DecodeProgram::scale_by)
      .def("linear", &DecodeProgram::linear)
      .def("act", &DecodeProgram::act, "0: SiLU-and-mul, 1: GELU-tanh-and-mul")
      .def("attention", &DecodeProgram::attention)
      .def("moe", &DecodeProgram::moe, "a mixture of experts: the router and the experts kernel")
      .def("moe_shared", &DecodeProgram::moe_shared, "the last moe's shared expert and its sigmoid gate")
      .def("linear_attention", &DecodeProgram::linear_attention, "a Gated DeltaNet layer: projections, the kernel, out_proj")
      .def("num_instructions", &DecodeProgram::num_instructions)
      .def("set_head", &DecodeProgram::set_head, "the lm_head (None: no logits here)")
      .def("has_head", &DecodeProgram::has_head)
      .def("set_inputs", &DecodeProgram::set_inputs,
           "the rotary tables, the dtype, and a float embedding table or a quantized one's checked planes and planes_rows")
      .def("forward", &DecodeProgram::forward, "every decoder layer of a decode step",
           py::call_guard<py::gil_scoped_release>());
}
