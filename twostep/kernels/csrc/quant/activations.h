// Activations quantized for the integer products: per block of 32 to int16 (the matrix-vector
// passes: a relative error near 2**-16, so a product is the float product of the dequantized weights
// within float rounding) or to int8 (the int8 product: a step of max|x| / 127 a block, llama.cpp's
// precision for its matrix products), with the per-block scales and the sums of the codes that the
// zero points and mins need.
#pragma once

#include "layout.h"

namespace twostep::quant {

// Activations quantized per block of 32: codes, the block's scale, and scale * (sum of the codes)
// for each half block of 16 (a group of 16 needs its own half).
struct QuantizedActivations {
  Buffer<int16_t> q;
  Buffer<float> scale;
  Buffer<float> half_sums;
  Buffer<float> group_sums;   // scale * (sum of the codes) per weight group, [rows, k / group]
  Buffer<int16_t> quads;      // the 8-bit passes' form of q without AVX-512 (expand_quads), [rows, k / 4, 16]
};


struct Int8Activations {
  Buffer<int8_t> q;          // [m, k]
  Buffer<float> scale;       // [m, k / 32]
  Buffer<float> group_sums;  // [m, k / group]: sum over the group's blocks of scale * (sum of codes)
  Buffer<int32_t> half_sums; // [m, k / 16]: the sum of each half block's codes
};

// x [rows, k] (float32, bf16 or fp16; rows `stride` apart) quantized per block of 32: to int16,
// with the groups' sums where the weight has mins (group_sums) and the 8-bit panel passes' quads
// where asked; or to int8 (AVX2 builds)
template <typename scalar_t>
QuantizedActivations quantize_int16(const scalar_t* x, int64_t rows, int64_t k, int64_t stride, int64_t group,
                                    bool group_sums, bool quads);
template <typename scalar_t>
Int8Activations quantize_int8(const scalar_t* x, int64_t rows, int64_t k, int64_t stride, int64_t group);

}  // namespace twostep::quant
