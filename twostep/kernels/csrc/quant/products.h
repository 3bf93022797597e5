// The library's products, one source each, as ops.cpp calls them after its checks: a weight's
// planes (checked), its n rows, the activations (x [m, k] as the product takes it) and out [m, n]
// (unit column stride, float32 or x's dtype; a row's sums are float32 either way).
#pragma once

#include "activations.h"
#include "layout.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <vector>

// f (with scalar_t) for a tensor of the engine's float types, the ones the products take and give
#define TWOSTEP_DISPATCH_FLOATS(TYPE, NAME, ...)                                                   \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                          \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace twostep::quant {

// gemv_rows.cpp: the row layout, 1 to 8 rows, int16 activations
void rows_gemv(const Planes& p, int64_t n, const QuantizedActivations& a, at::Tensor& out);

// gemv_panels.cpp: the panel layout, up to kPanelCallRows rows, int16 activations (AVX2 builds)
void panels_gemv(const Planes& p, int64_t n, const QuantizedActivations& a, at::Tensor& out);

// gemm_int8.cpp: any rows, int8 activations, either layout, in tiles of rows (AVX2 builds)
void gemm_int8_tiles(const Planes& p, int64_t n, const Int8Activations& a, at::Tensor& out);

// gemv_int8.cpp: the same sums for fewer than this many rows of the panel layout
inline constexpr int64_t kSmallRows = 8;
// gemv_int8.cpp: the same sums for fewer than kSmallRows rows of the panel layout (AVX2 builds)
void gemv_int8_panels(const Planes& p, int64_t n, const Int8Activations& a, at::Tensor& out);

// gemm_bf16.cpp / gemm_f32.cpp: bf16 / float32 rows against the panel layout through oneDNN's
// brgemm, where this build and CPU have it (*_runs())
bool brgemm_bf16_runs();
void panels_gemm_bf16(const Planes& p, const at::Tensor& x, at::Tensor& out);
bool brgemm_f32_runs();
void panels_gemm_f32(const Planes& p, const at::Tensor& x, at::Tensor& out);

// dequantize.cpp: out[r] = w[ids[r]] (ids checked), out [len(ids), k] float32, bf16 or fp16
void dequantize_planes(const Planes& p, const int64_t* ids, int64_t count, at::Tensor& out);

// pack.cpp: the panel layout's qs of row-major planes (n a multiple of 8)
at::Tensor pack_panel_codes(const Planes& p, int64_t n, const at::Tensor& qs);

}  // namespace twostep::quant
