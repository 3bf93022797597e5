// Whether torch's brgemm (oneDNN's, behind at::native::cpublas) runs here, for the prefill
// products gemm_bf16.cpp and gemm_f32.cpp build on.
#pragma once

#include "../simd.h"

#include <ATen/native/CPUBlas.h>

#include <exception>
#include <type_traits>
#include <vector>

namespace twostep::quant {

#ifdef TWOSTEP_AVX2
// whether torch's brgemm multiplies T x T -> float here (a 1 x 16 x 32 product of ones), probed once
template <typename T>
bool brgemm_runs() {
  static const bool runs = [] {
    try {
      std::vector<T> a(32, T(1.f)), b(32 * 16, T(1.f));
      std::vector<float> c(16);
      at::native::cpublas::brgemm(1, 16, 32, 32, 16, 16, false, a.data(), b.data(), c.data());
      at::native::cpublas::brgemm_release(!std::is_same_v<T, float>);   // float's brgemm is not VNNI-packed
      return c[0] == 32.f;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return runs;
}
#endif

}  // namespace twostep::quant
