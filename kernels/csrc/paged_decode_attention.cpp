// Paged decode attention for CPU, float32: one query token per sequence over its
// whole context, read in place from the block-major KV cache (no gather copy).
//
// q:            [B, H, D] contiguous
// layer_cache:  [num_blocks, 2, block_size, KVH, D], any strides with the last dim
//               contiguous (a layer's view of the page-first cache)
// block_tables: [B, max_blocks] int64 contiguous
// context_lens: [B] int64
// Returns [B, H, D]. Work is split over (sequence, KV head) pairs with
// at::parallel_for; each pair computes its G = H / KVH query heads together so
// every K and V row is loaded once for the whole group (GQA without copies).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor layer_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat32, "q: [B, H, D] float32");
  TORCH_CHECK(layer_cache.dim() == 5 && layer_cache.scalar_type() == torch::kFloat32 && layer_cache.stride(4) == 1,
              "layer_cache: [num_blocks, 2, block_size, KVH, D] float32, last dim contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && block_tables.scalar_type() == torch::kInt64,
              "block_tables: [B, max_blocks] int64");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == torch::kInt64, "context_lens: [B] int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = layer_cache.size(2), KVH = layer_cache.size(3);
  TORCH_CHECK(layer_cache.size(4) == D && H % KVH == 0, "head dims do not match");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "batch sizes do not match");
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  const int64_t s_block = layer_cache.stride(0), s_kv = layer_cache.stride(1), s_tok = layer_cache.stride(2),
                s_head = layer_cache.stride(3);
  auto lens = context_lens.contiguous();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens_p[b] >= 1 && lens_p[b] <= max_blocks * block_size, "context length out of range");
  auto out = torch::empty_like(q);
  const float* q_p = q.data_ptr<float>();
  const float* cache_p = layer_cache.data_ptr<float>();
  const int64_t* tables_p = block_tables.data_ptr<int64_t>();
  float* out_p = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(G * D), acc(G * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH, ctx = lens_p[b];
      const int64_t* table = tables_p + b * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qs[g * D + d] = q_p[(b * H + h * G + g) * D + d] * fscale;
      scores.assign(G * ctx, 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const float* k = cache_p + table[t / block_size] * s_block + (t % block_size) * s_tok + h * s_head;
        for (int64_t g = 0; g < G; ++g) scores[g * ctx + t] = dot(qs.data() + g * D, k, D);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * ctx;
        const float m = *std::max_element(s, s + ctx);
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) sum += (s[t] = std::exp(s[t] - m));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const float* v = cache_p + table[t / block_size] * s_block + s_kv + (t % block_size) * s_tok + h * s_head;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * ctx + t], v, acc.data() + g * D, D);
      }
      for (int64_t g = 0; g < G; ++g)
        std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, out_p + (b * H + h * G + g) * D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
