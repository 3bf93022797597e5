// The ops' checks: every plane must hold what k and the format say, so that no product reads past
// it; then the product for the call's rows and layout.
#include "ops.h"

#include "codes.h"
#include "products.h"

#include <ATen/Dispatch.h>
#include <ATen/record_function.h>

#include <cstring>

namespace twostep::quant {
namespace {


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

void check_rows(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "2-D row-major views");
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == x.scalar_type()) && out.size(0) == x.size(0),
              "out must be [M, n], float32 or x's dtype");
}


// The ops' checks of x [M, k], the planes and out [M, n]
CheckedPlanes checked_call(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& qh,
                           const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits,
                           int64_t group, int64_t zero, const at::Tensor& out) {
  check_rows(x, out);
  const CheckedPlanes c{planes_of(qs, qh, scales, mins, bits, group, zero, x.size(1)), rows_of(qs)};
  TORCH_CHECK(out.size(1) == c.n, "out has ", out.size(1), " columns for ", c.n, " weight rows");
  return c;
}

// f (with scalar_t) for a tensor of the engine's float types, the ones the products take and give
#define TWOSTEP_DISPATCH_FLOATS(TYPE, NAME, ...)                                                   \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                          \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// f(t's data as its type), for the products' templates
template <typename F>
void with_rows(const at::Tensor& t, F&& f) {
  TWOSTEP_DISPATCH_FLOATS(t.scalar_type(), "twostep's quantized products", [&] { f(t.data_ptr<scalar_t>()); });
}

// out = x . w^T as gemm_int8 (int8) or gemv computes it, for w checked by checked_planes. Through
// the dispatcher a call read each plane's tensor (its impl and storage) and the op's entry, every one
// of them evicted by the step's weight stream: ~0.7 us a call, ~100 calls a step. The same products,
// the same sums: only the way in differs. The caller keeps the planes' tensors alive.
void planes_product(const void* planes, bool int8, const at::Tensor& x, at::Tensor& out) {
  // (the profiler's shapes as the ops record them: x first; made only while it records shapes)
  RECORD_FUNCTION(int8 ? "twostep::quant_gemm_int8" : "twostep::quant_gemv", std::vector<c10::IValue>({x, out}));
  CheckedPlanes c;
  std::memcpy(&c, planes, sizeof c);
  check_rows(x, out);
  TORCH_CHECK(x.size(1) == c.p.k && out.size(1) == c.n, "x [M, ", c.p.k, "] and out [M, ", c.n, "]");
  int8 ? gemm_int8_planes(c.p, c.n, x, out) : gemv_planes(c.p, c.n, x, out);
}

// dequantize_rows after its checks of the planes: ids in range, out [ids, p.k] contiguous
void dequantize_rows_planes(const Planes& p, int64_t n, const at::Tensor& ids, at::Tensor& out) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && out.is_contiguous(), "bad ids / out");
  const int64_t count = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) TORCH_CHECK(id[r] >= 0 && id[r] < n, "row id out of range");
  with_rows(out, [&](auto* o) { dequantize_planes(p, id, count, o); });
}

// rows `ids` of a part checked by checked_planes into out [ids, k] (the decode stack's embedding
// lookup, as dequantize_rows computes it)
void planes_rows(const void* planes, const at::Tensor& ids, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_dequantize_rows", c10::ArrayRef<c10::IValue>({}));
  CheckedPlanes c;
  std::memcpy(&c, planes, sizeof c);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == ids.numel() && out.size(1) == c.p.k, "out: [ids, ", c.p.k, "]");
  dequantize_rows_planes(c.p, c.n, ids, out);
}

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

}  // namespace

// gemv and gemm_int8 after their checks of the planes: x [M, p.k] and out [M, n] as they say
void gemv_planes(const Planes& p, int64_t n, const at::Tensor& x, at::Tensor& out) {
  const int64_t m = x.size(0);
  TORCH_CHECK(!p.panels || kPanels, "this build has no product for the panel layout");
  TORCH_CHECK(m <= (p.panels ? kPanelCallRows : 8), "gemv takes 1 to ", p.panels ? kPanelCallRows : 8,
              " rows in this layout; got ", m);
  QuantizedActivations a;
  with_rows(x, [&](const auto* xs) {
    a = quantize_int16(xs, m, p.k, x.stride(0), p.group, p.mins != nullptr, p.panels && p.bits == 8 && kQuadPasses);
  });
  with_rows(out, [&](auto* o) {
    p.panels ? panels_gemv(p, n, m, a, o, out.stride(0)) : rows_gemv(p, n, m, a, o, out.stride(0));
  });
}

void gemm_int8_planes(const Planes& p, int64_t n, const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(p.bits != 8 || kDpbusd, "this build's int8 product takes 4 to 6-bit codes (8-bit ones need VNNI)");
  TORCH_CHECK(kInt8, "this build has no int8 product (it needs AVX2)");
  const int64_t m = x.size(0);
  if (m == 0) return;
  Int8Activations a;
  with_rows(x, [&](const auto* xs) { a = quantize_int8(xs, m, p.k, x.stride(0), p.group); });
  with_rows(out, [&](auto* o) {
    p.panels && m < kSmallRows ? gemv_int8_panels(p, n, m, a, o, out.stride(0))
                               : gemm_int8_tiles(p, n, m, a, o, out.stride(0));
  });
}

void gemv(const at::Tensor& x, const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
          const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_gemv", c10::ArrayRef<c10::IValue>({}));
  const CheckedPlanes c = checked_call(x, qs, qh, scales, mins, bits, group, zero, out);
  gemv_planes(c.p, c.n, x, out);
}

void gemm_int8(const at::Tensor& x, const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
               const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_gemm_int8", c10::ArrayRef<c10::IValue>({}));
  const CheckedPlanes c = checked_call(x, qs, qh, scales, mins, bits, group, zero, out);
  gemm_int8_planes(c.p, c.n, x, out);
}

void gemm_bf16(const at::Tensor& x, const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
               const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_gemm_bf16", c10::ArrayRef<c10::IValue>({}));
  const Planes p = brgemm_planes("gemm_bf16", at::kBFloat16, brgemm_bf16_runs(), x, qs, qh, scales, mins, bits,
                                 group, zero, out);
  if (x.size(0) > 0)
    panels_gemm_bf16(p, out.size(1), x.size(0), x.data_ptr<at::BFloat16>(), x.stride(0), out.data_ptr<at::BFloat16>(),
                     out.stride(0));
}

void gemm_f32(const at::Tensor& x, const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
              const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_gemm_f32", c10::ArrayRef<c10::IValue>({}));
  const Planes p = brgemm_planes("gemm_f32", at::kFloat, brgemm_f32_runs(), x, qs, qh, scales, mins, bits, group,
                                 zero, out);
  if (x.size(0) > 0)
    panels_gemm_f32(p, out.size(1), x.size(0), x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), out.stride(0));
}

void dequantize_rows(const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
                     const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, const at::Tensor& ids,
                     at::Tensor& out) {
  RECORD_FUNCTION("twostep::quant_dequantize_rows", c10::ArrayRef<c10::IValue>({}));
  TORCH_CHECK(out.size(0) == ids.numel(), "out rows != ids");
  dequantize_rows_planes(planes_of(qs, qh, scales, mins, bits, group, zero, out.size(1)), rows_of(qs), ids, out);
}

std::vector<at::Tensor> pack_panels(const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
                                    const OptionalTensor& mins, int64_t bits, int64_t group, int64_t k) {
  const Planes p = planes_of(qs, qh, scales, mins, bits, group, 0, k);
  const int64_t n = qs.size(0), groups = k / group, panels = n / kPanel;
  TORCH_CHECK(!p.panels && n % kPanel == 0, "the panel layout takes row-major planes, rows a multiple of 8");
  // [n, groups] -> [n / 8, groups, 8]
  auto interleave = [&](const at::Tensor& t) { return t.reshape({panels, kPanel, groups}).transpose(1, 2).contiguous(); };
  at::Tensor codes = qs.new_zeros({panels, k / kBlock, panel_block(p.bits)});
  pack_panel_codes(p, n, reinterpret_cast<uint8_t*>(codes.data_ptr()));
  return {codes, interleave(scales), mins.has_value() && mins->defined() ? interleave(*mins) : at::Tensor()};
}

at::Tensor checked_planes(const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
                          const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, int64_t k) {
  const CheckedPlanes checked{planes_of(qs, qh, scales, mins, bits, group, zero, k), rows_of(qs)};
  at::Tensor bytes = qs.new_empty({static_cast<int64_t>(sizeof checked)}, qs.options().dtype(at::kByte));
  std::memcpy(bytes.data_ptr(), &checked, sizeof checked);
  return bytes;
}

int64_t planes_product_address() { return reinterpret_cast<int64_t>(&planes_product); }
int64_t planes_rows_address() { return reinterpret_cast<int64_t>(&planes_rows); }

std::string path() { return kPath; }
int64_t panel_call_rows() { return kPanelCallRows; }
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

}  // namespace twostep::quant
