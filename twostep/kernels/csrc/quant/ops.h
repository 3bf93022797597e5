// The library's ops as Python and the decode stack call them (register.cpp binds them): the checks
// of their tensors, then the product (products.h) or layout change they name.
#pragma once

#include <ATen/core/Tensor.h>

#include "layout.h"

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

// A mixture-of-experts layer's experts over a step's rows (experts.cpp): out [T, H] = for each row,
// sum over j of weights[t, j] * expert ids[t, j]'s MLP of x[t]; gate, up [E * I, H] and down
// [E * H, I] as checked_planes gives them, float32 biases [E * rows] or none; act 0: SiLU, 2:
// gpt-oss's clamped SwiGLU (alpha, limit); int8: the int8 product for the widths it takes; gemm:
// oneDNN's brgemm for an expert's many float32 rows (a prompt's; never a decode batch's)
void experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& gate,
             const at::Tensor& up, const at::Tensor& down, int64_t num_experts, int64_t act, double alpha,
             double limit, const OptionalTensor& gate_bias, const OptionalTensor& up_bias,
             const OptionalTensor& down_bias, bool int8, bool gemm, at::Tensor& out);
int64_t experts_address();

// The products behind the ops, after their checks of the planes (ops.cpp): x [M, p.k] -> out [M, n]
void gemv_planes(const Planes& p, int64_t n, const at::Tensor& x, at::Tensor& out);
void gemm_int8_planes(const Planes& p, int64_t n, const at::Tensor& x, at::Tensor& out);

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
