// The small per-layer ops of a decoder step as one call each: RMSNorm and rotary embedding. In a
// batch-1 decode step each torch op costs microseconds of dispatch for a few KB of work, and these
// two are chains of 5-12 ops per layer. Both round exactly where the PyTorch code they replace
// rounds (layers/norm.py, layers/rotary.py): rotary is bit-identical to it; RMSNorm sums its squares
// in another order (float32), so it may differ in the last bit of the float32 scale.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

// x rounded to T the way a torch op with a T output rounds its float result
template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// out[t] = weight * T(x[t] / sqrt(mean(x[t]^2) + eps)), the normalisation in float32 (as HF).
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * dim;
      float sum = 0.0f;
      for (int64_t d = 0; d < dim; ++d) sum += as_float(xr[d]) * as_float(xr[d]);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      for (int64_t d = 0; d < dim; ++d)
        o[d] = round_to<T>(as_float(weight[d]) * as_float(round_to<T>(as_float(xr[d]) * inv)));
    }
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_cpu() && weight.is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dtype() == weight.dtype(), "x and weight must share a dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) > 0 && x.size(-1) == weight.size(0),
              "weight must be [hidden] with x's last dimension");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t dim = weight.size(0), rows = xc.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            rows, dim, static_cast<float>(eps));
  });
  return out;
}

// x [T, H, D] (any strides between tokens and heads, D contiguous) -> x * cos + rotate_half(x) * sin
// with cos/sin [T, D], each product and the sum rounded to T as three torch ops would.
template <typename T>
void rotate(const T* x, int64_t token_stride, int64_t head_stride, const T* cos, const T* sin,
            T* out, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens * heads, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const T* xi = x + t * token_stride + h * head_stride;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      T* o = out + i * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const float rotated = d < half ? -as_float(xi[d + half]) : as_float(xi[d - half]);
        const T a = round_to<T>(as_float(xi[d]) * as_float(c[d]));
        const T b = round_to<T>(rotated * as_float(s[d]));
        o[d] = round_to<T>(as_float(a) + as_float(b));
      }
    }
  });
}

torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.is_cpu() && cos.is_cpu() && sin.is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim], head_dim contiguous");
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.size(-1) == dim && sin.size(-1) == dim && cos.numel() == tokens * dim &&
              sin.numel() == tokens * dim, "cos/sin must be [tokens, 1, head_dim]");
  auto c = cos.reshape({tokens, dim}).contiguous();
  auto s = sin.reshape({tokens, dim}).contiguous();
  TORCH_CHECK(c.dtype() == x.dtype() && s.dtype() == x.dtype(), "cos/sin must have x's dtype");
  auto out = torch::empty({tokens, heads, dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rotary", [&] {
    rotate<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), c.data_ptr<scalar_t>(),
                     s.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), tokens, heads, dim);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of the last dimension, normalised in float32");
  m.def("rotary", &rotary, "x * cos + rotate_half(x) * sin, rounded as the PyTorch ops round");
}
