// A decode step's decoder layers in one call (models/fused_decode.py): from the step's token ids
// and positions the embeddings and the rotary tables' rows, then for each layer the input
// norm (with the residual add), the qkv projection, q/k norms, rotary, the K/V write, paged decode
// attention, o_proj, the second norm, gate/up, SiLU-and-mul and down, then the final norm and, where
// the step asks for every row's logits, the lm_head, in the order and through the
// same registered ops (torch.library, looked up once in the dispatcher) that the Python layers
// call one by one (models/decoder.py). So the results are bit-identical to theirs, and what is
// saved is the interpreter: ~40 Python calls, views and tensor wrappers per layer, 1.5-3 ms of a
// batch-1 step on a 30-layer model.
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
using PagedAttention = Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, double);

// quant/ops.cpp's planes_product: a part's product from its checked planes, not through the
// dispatcher (read there why)
using PlanesProduct = void (*)(const void* planes, bool int8, const Tensor& x, Tensor& out);
// and its planes_rows: rows of a quantized embedding table
using PlanesRows = void (*)(const void* planes, const Tensor& ids, Tensor& out);

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

struct FusedLayer {
  Tensor input_norm, post_norm;
  OptTensor q_norm, k_norm;
  std::shared_ptr<FusedLinear> qkv, o, gate_up, down;
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(num_heads), kv_heads_(num_kv_heads), dim_(head_dim), eps_(eps), scale_(scale),
        rms_norm_(find_op<Tensor(const Tensor&, const Tensor&, double)>("twostep::rms_norm")),
        add_rms_norm_(find_op<AddRmsNorm>("twostep::add_rms_norm")),
        silu_and_mul_(find_op<Tensor(const Tensor&)>("twostep::silu_and_mul")),
        rotary_(find_op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("twostep::rotary")),
        rotary_inplace_(find_op<RotaryInPlace>("twostep::rotary_")),
        write_kv_(find_op<WriteKV>("twostep::write_kv")),
        attention_(find_op<PagedAttention>("twostep::paged_decode_attention")) {}

  void add_layer(Tensor input_norm, Tensor post_norm, OptTensor q_norm, OptTensor k_norm,
                 std::shared_ptr<FusedLinear> qkv, std::shared_ptr<FusedLinear> o,
                 std::shared_ptr<FusedLinear> gate_up, std::shared_ptr<FusedLinear> down) {
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm),
                       std::move(qkv), std::move(o), std::move(gate_up), std::move(down)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The model's final norm and lm_head, so a step that asks for every row's logits gets them from
  // this call too (what DecoderForCausalLM.compute_logits computes)
  void set_head(Tensor final_norm, std::shared_ptr<FusedLinear> lm_head) {
    final_norm_ = std::move(final_norm);
    lm_head_ = std::move(lm_head);
  }

  bool has_head() const { return lm_head_ != nullptr; }

  // What the model computes before its layers from a step's token ids and positions: the rotary
  // tables' rows (cos / sin [max_positions, 1, head_dim], in the embeddings' dtype) and the
  // embedding's rows, of a float table (in the tables' dtype) or of a quantized one (its planes
  // checked by quant_linear's checked_planes, read by planes_rows at rows_address; table: none)
  void set_inputs(Tensor cos_table, Tensor sin_table, OptTensor table, OptTensor checked, int64_t rows_address,
                  int64_t hidden) {
    TORCH_CHECK(cos_table.scalar_type() == sin_table.scalar_type() && table.has_value() != checked.has_value() &&
                    (table.has_value() || rows_address != 0),
                "rotary tables of one dtype, and a float table or a quantized one's planes");
    cos_table_ = std::move(cos_table);
    sin_table_ = std::move(sin_table);
    table_ = std::move(table);
    checked_ = std::move(checked);
    rows_ = checked_.has_value() ? reinterpret_cast<PlanesRows>(rows_address) : nullptr;
    table_planes_ = checked_.has_value() ? checked_->data_ptr() : nullptr;
    hidden_ = hidden;
  }

  // ids, positions [t]: the token ids and positions of t sequences decoding one token each;
  // kv_values: each layer's cache values; slots [t]; q_index [t, 1], q_lens, tables, seq_lens: the
  // paged decode plan.
  // -> (the final norm's output, and with `logits` float32 logits of every row, as the model's
  // forward and compute_logits return them; else none).
  std::tuple<Tensor, OptTensor> forward(const Tensor& ids, const Tensor& positions,
                                        const std::vector<Tensor>& kv_values, const Tensor& slots,
                                        const Tensor& q_index, const Tensor& q_lens, const Tensor& tables,
                                        const Tensor& seq_lens, bool logits) const {
    RECORD_FUNCTION("twostep::decode_layers", c10::ArrayRef<c10::IValue>({}));
    TORCH_CHECK(kv_values.size() == layers_.size(), "one cache per layer: ", kv_values.size(), " for ",
                layers_.size());
    TORCH_CHECK(cos_table_.defined(), "the stack has no inputs (set_inputs)");
    TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && ids.size(0) == positions.size(0), "ids, positions: [t]");
    at::NoGradGuard no_grad;
    // the embeddings become the residual stream, updated in place
    Tensor x = embed(ids.to(at::kLong).contiguous());
    const Tensor cos = cos_table_.index_select(0, positions), sin = sin_table_.index_select(0, positions);
    Tensor residual = x;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const FusedLayer& layer = layers_[i];
      Tensor h = i == 0 ? rms_norm_.call(x, layer.input_norm, eps_)
                        : add_rms_norm_.call(x, residual, layer.input_norm, eps_);
      h = attention(layer, h, cos, sin, kv_values[i], slots, q_index, q_lens, tables, seq_lens);
      h = add_rms_norm_.call(h, residual, layer.post_norm, eps_);
      x = (*layer.down)(silu_and_mul_.call((*layer.gate_up)(h)));
    }
    TORCH_CHECK(final_norm_.defined(), "the stack has no final norm (set_head)");
    Tensor hidden = add_rms_norm_.call(x, residual, final_norm_, eps_);
    if (!logits) return {hidden, std::nullopt};
    return {hidden, head(hidden)};
  }

 private:
  // the embedding's rows [t, hidden] in the tables' dtype, as the model's Embedding returns them
  Tensor embed(const Tensor& ids) const {
    if (table_.has_value()) return table_->index_select(0, ids).to(cos_table_.scalar_type());
    Tensor rows = at::empty({ids.size(0), hidden_}, cos_table_.options());
    rows_(table_planes_, ids, rows);
    return rows;
  }

  // float32 logits of every row (named in a profile: step_breakdown counts it under logits)
  Tensor head(const Tensor& hidden) const {
    RECORD_FUNCTION("twostep::decode_head", c10::ArrayRef<c10::IValue>({}));
    TORCH_CHECK(lm_head_ != nullptr, "the stack has no lm_head (set_head)");
    return (*lm_head_)(hidden).to(at::kFloat);
  }

  Tensor attention(const FusedLayer& layer, const Tensor& h, const Tensor& cos, const Tensor& sin,
                   const Tensor& kv, const Tensor& slots, const Tensor& q_index, const Tensor& q_lens,
                   const Tensor& tables, const Tensor& seq_lens) const {
    const int64_t t = h.size(0), q_size = heads_ * dim_, kv_size = kv_heads_ * dim_;
    Tensor qkv = (*layer.qkv)(h);
    Tensor q = qkv.narrow(1, 0, q_size).view({t, heads_, dim_});
    Tensor k = qkv.narrow(1, q_size, kv_size).view({t, kv_heads_, dim_});
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, kv_heads_, dim_});
    if (layer.q_norm.has_value()) {
      q = rotary_.call(rms_norm_.call(q, *layer.q_norm, eps_), cos, sin);
      k = rotary_.call(rms_norm_.call(k, *layer.k_norm, eps_), cos, sin);
    } else {          // q's and k's heads side by side: rotated in place, in one call
      rotary_inplace_.call(qkv.narrow(1, 0, q_size + kv_size).view({t, heads_ + kv_heads_, dim_}), cos, sin);
    }
    write_kv_.call(kv, k, v, slots);
    // in q's dtype both ways (the kernel reads 16-bit rows into float32 and writes its output back rounded)
    const Tensor o = attention_.call(q.contiguous(), q_index, q_lens, kv, tables, seq_lens, scale_);
    return (*layer.o)(o.view({t, q_size}));
  }

  int64_t heads_, kv_heads_, dim_;
  double eps_, scale_;
  std::vector<FusedLayer> layers_;
  Tensor final_norm_;
  std::shared_ptr<FusedLinear> lm_head_;
  Tensor cos_table_, sin_table_;
  OptTensor table_, checked_;
  PlanesRows rows_ = nullptr;
  const void* table_planes_ = nullptr;   // checked_'s bytes, as QuantPart keeps its planes
  int64_t hidden_ = 0;
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
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("set_head", &DecoderStack::set_head, "the final norm's weight and the lm_head (None: no logits here)")
      .def("has_head", &DecoderStack::has_head)
      .def("set_inputs", &DecoderStack::set_inputs,
           "the rotary tables, and a float embedding table or a quantized one's checked planes and planes_rows")
      .def("forward", &DecoderStack::forward, "every decoder layer of a decode step",
           py::call_guard<py::gil_scoped_release>());
}
