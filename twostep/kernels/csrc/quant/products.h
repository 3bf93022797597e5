// The library's products, one source each, as ops.cpp calls them after its checks and its dispatch
// on the tensors' types: a weight's planes (checked), its n rows, the activations (m rows) and out
// (rows `stride` apart, unit column stride; float32, bf16 or fp16: a row's sums are float32 either
// way). Raw pointers, so that these sources need no ATen tensor headers (they compile in seconds).
#pragma once

#include "activations.h"
#include "layout.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

// MACRO(out_t) for each output type the products give: the explicit instantiations at the end of
// each product's source
#define TWOSTEP_FOR_OUTPUTS(MACRO) MACRO(float) MACRO(c10::BFloat16) MACRO(c10::Half)

namespace twostep::quant {

// gemv_rows.cpp: the row layout, 1 to 8 rows, int16 activations
template <typename out_t>
void rows_gemv(const Planes& p, int64_t n, int64_t m, const QuantizedActivations& a, out_t* out, int64_t stride);

// gemv_panels.cpp: the panel layout, up to kPanelCallRows rows, int16 activations (AVX2 builds)
template <typename out_t>
void panels_gemv(const Planes& p, int64_t n, int64_t m, const QuantizedActivations& a, out_t* out, int64_t stride);

// gemm_int8.cpp: any rows, int8 activations, either layout, in tiles of rows (AVX2 builds)
template <typename out_t>
void gemm_int8_tiles(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride);

// gemv_int8.cpp: the same sums for fewer than this many rows of the panel layout (AVX2 builds)
inline constexpr int64_t kSmallRows = 8;
template <typename out_t>
void gemv_int8_panels(const Planes& p, int64_t n, int64_t m, const Int8Activations& a, out_t* out, int64_t stride);

// gemm_bf16.cpp / gemm_f32.cpp: bf16 / float32 rows x [m, k] against the panel layout through
// oneDNN's brgemm, where this build and CPU have it (*_runs())
bool brgemm_bf16_runs();
void panels_gemm_bf16(const Planes& p, int64_t n, int64_t m, const c10::BFloat16* x, int64_t x_stride,
                      c10::BFloat16* out, int64_t out_stride);
bool brgemm_f32_runs();
void panels_gemm_f32(const Planes& p, int64_t n, int64_t m, const float* x, int64_t x_stride, float* out,
                     int64_t out_stride);

// dequantize.cpp: out[r] = w[ids[r]] (ids checked), rows of k contiguous
template <typename out_t>
void dequantize_planes(const Planes& p, const int64_t* ids, int64_t count, out_t* out);

// pack.cpp: the panel layout's codes of row-major planes (n a multiple of 8) into dst, zeroed,
// [n / 8, blocks, panel_block(bits)] bytes
void pack_panel_codes(const Planes& p, int64_t n, uint8_t* dst);

}  // namespace twostep::quant
