// The library's registration, in one place: torch custom ops (torch.ops.twostep.quant_gemv, ...,
// seen by the profiler and torch.compile) and the Python module's functions. A test build of the
// library (KERNELS in kernels/__init__.py) registers its own op namespace, so it loads beside the
// native one.
#include "ops.h"

#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#ifdef TWOSTEP_FORCE_SCALAR
#define TWOSTEP_OPS twostep_portable
#elif defined(TWOSTEP_VARIANT)
#define TWOSTEP_OPS TWOSTEP_VARIANT
#else
#define TWOSTEP_OPS twostep
#endif
#define TWOSTEP_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TWOSTEP_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

using namespace twostep::quant;

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
  m.def("panel_call_rows", &panel_call_rows, "the most rows gemv takes in the panel layout (8 in the row layout)");
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
  m.def("experts", &experts, "a mixture-of-experts layer's chosen experts over a step's rows (experts.cpp)");
  m.def("experts_address", &experts_address, "the address of experts, for the decode stack");
  m.def("path", &path, "the instruction set this build uses");
}
