// RMSNorm and rotary position embedding for CPU, float32: one call each where the
// torch references (kernels/norm.py, kernels/rope.py) take 6 to 10 small ops. A
// decode step at small batch runs these on a few rows, so it pays per op, not per
// byte: 25 norms and 24 rotations a step on the bench model.
//
// rms_norm: x [N, C] (rows contiguous), weight [C] -> [N, C]
//           out = weight * (x * rsqrt(mean(x^2) + eps)), as the reference.
// rope:     x [N, heads, d] (each head's d contiguous, any row stride: q and k are
//           views of the fused QKV output), cos, sin [N, d] -> [N, heads, d]
//           out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
// Rows run in parallel on torch's thread pool when there are enough of them.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with tensor casters, without torch/extension.h's whole C++ API
#include <ATen/Parallel.h>

#include <cmath>

namespace {
constexpr int64_t kRowGrain = 64;
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, "x: [N, C] float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat, "weight: [C] float32");
  const int64_t N = x.size(0), C = x.size(1), ldx = x.stride(0);
  auto out = at::empty({N, C}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, N, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = xp + n * ldx;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t c = 0; c < C; ++c) squares += row[c] * row[c];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(C) + feps);
      float* o = op + n * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = wp[c] * (row[c] * inv);
    }
  });
  return out;
}

at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.scalar_type() == at::kFloat,
              "x: [N, heads, d] float32, each token's heads contiguous");
  const int64_t N = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2, ldx = x.stride(0);
  TORCH_CHECK(d % 2 == 0, "head size must be even");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == N && cos.size(1) == d &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat, "cos, sin: [N, d] float32 contiguous");
  auto out = at::empty({N, heads, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* c = cp + n * d;
      const float* s = sp + n * d;
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = xp + n * ldx + h * d;
        float* o = op + (n * heads + h) * d;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o[i] = in[i] * c[i] - in[i + half] * s[i];
          o[i + half] = in[i + half] * c[i + half] + in[i] * s[i + half];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU, float32)");
  m.def("rope", &rope, "rotary position embedding (CPU, float32)");
}
