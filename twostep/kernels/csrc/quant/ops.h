// The library's ops as Python and the decode stack call them (register.cpp binds them): the checks
// of their tensors, then the product (products.h) or layout change they name.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace twostep::quant {

using OptionalTensor = c10::optional<at::Tensor>;

// out[m, :n] = x[m] . w^T for x [M, k], M <= 8 in the row layout, <= panel_call_rows() in the
// panel layout; out is [M, n] with unit column stride, float32 or x's dtype (the sums are float32
// either way; a bf16 / fp16 out saves the caller a cast). Each row's sums are the same at any M.
void gemv(const at::Tensor& x, const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
          const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out);
// The same product for any number of rows with int8 activations (AVX2 builds; 8-bit codes need VNNI)
void gemm_int8(const at::Tensor& x, const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
               const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out);
// bf16 (gemm_bf16) or float32 (gemm_f32) x and out against the panel layout, through oneDNN's
// brgemm where has_bf16_gemm() / has_f32_gemm()
void gemm_bf16(const at::Tensor& x, const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
               const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out);
void gemm_f32(const at::Tensor& x, const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
              const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, at::Tensor& out);
// out[r] = w[ids[r]] for each id; out [len(ids), k] float32, bf16 or fp16, contiguous
void dequantize_rows(const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
                     const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, const at::Tensor& ids,
                     at::Tensor& out);
// row-major planes in the panel layout: qs (with the high bits), scales, mins
std::vector<at::Tensor> pack_panels(const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
                                    const OptionalTensor& mins, int64_t bits, int64_t group, int64_t k);

// The decode stack's way in (kernels/csrc/decode_step.cpp): a part's planes checked once at load
// into bytes it keeps, then each step's call through a plain function pointer
at::Tensor checked_planes(const at::Tensor& qs, const OptionalTensor& qh, const at::Tensor& scales,
                          const OptionalTensor& mins, int64_t bits, int64_t group, int64_t zero, int64_t k);
int64_t planes_product_address();
int64_t planes_rows_address();

// what this build has
std::string path();
int64_t panel_call_rows();
std::vector<int64_t> int8_bits();
bool has_int8();
int64_t int8_min_rows();
bool has_panels();
bool wide_pass();
bool wide_dot();
bool has_bf16_gemm();
bool has_f32_gemm();

}  // namespace twostep::quant
