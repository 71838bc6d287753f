// y = x @ w.T (+ bias) for float32 on CPU when x has few rows (decode steps).
//
// x: [M, K] contiguous, w: [N, K] contiguous (nn.Linear's layout), bias: [N] or none.
// Returns [M, N].
//
// Decode steps multiply a handful of token rows by every weight matrix, so they are
// bound by reading the weights. MKL's sgemm packs the weight for each call and, on
// this project's AMD machines, reaches a fraction of the memory bandwidth at small M.
// Here each thread takes blocks of 16 weight rows, streams each pair of rows once
// from memory and, while they sit in L1/L2, multiplies them by the input rows four
// at a time with AVX2 FMAs (8 accumulators in registers). The output rows are
// independent: an element's summation order depends only on K, never on M or on
// the other rows, so a row's result does not depend on the batch it is in.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with tensor casters, without torch/extension.h's whole C++ API
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kRowBlock = 16;  // weight rows per work unit
constexpr int kMaxTile = 4;        // input rows per register tile

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ROWS (1 or 2) weight rows against MT input rows: y[m * ldy + r] for r < ROWS.
template <int ROWS, int MT>
inline void tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  __m256 acc[ROWS][MT];
  for (int r = 0; r < ROWS; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[ROWS];
    for (int r = 0; r < ROWS; ++r) wv[r] = _mm256_loadu_ps(w + r * K + k);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < ROWS; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < ROWS; ++r) {
      float sum = hsum(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) sum += x[m * K + kk] * w[r * K + kk];
      y[m * ldy + r] = sum;
    }
}

template <int MT>
void row_block(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) tile<2, MT>(x, K, w + n * K, y + n, N);
  if (n < n1) tile<1, MT>(x, K, w + n * K, y + n, N);
}

}  // namespace

at::Tensor small_linear(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: [M, K] float32 contiguous");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kFloat, "w: [N, K] float32 contiguous");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kRowBlock - 1) / kRowBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowBlock, n1 = std::min(N, n0 + kRowBlock);
      for (int64_t m = 0; m < M; m += kMaxTile) {
        const float* xm = xp + m * K;
        float* ym = yp + m * N;
        switch (std::min<int64_t>(kMaxTile, M - m)) {
          case 1: row_block<1>(xm, K, wp, ym, N, n0, n1); break;
          case 2: row_block<2>(xm, K, wp, ym, N, n0, n1); break;
          case 3: row_block<3>(xm, K, wp, ym, N, n0, n1); break;
          default: row_block<4>(xm, K, wp, ym, N, n0, n1); break;
        }
      }
    }
  });
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat, "bias: [N] float32");
    y.add_(*bias);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "x @ w.T (+ bias) for a few rows (CPU, float32, AVX2)");
}
