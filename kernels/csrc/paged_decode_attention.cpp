// Paged decode attention for CPU, float32: one query token per sequence over its
// whole context, read in place from the block-major KV cache (no gather copy).
//
// q:            [B, H, D] contiguous
// layer_cache:  [num_blocks, 2, block_size, KVH, D], any strides with the last two
//               dims contiguous (a layer's view of the page-first cache)
// block_tables: [B, max_blocks] int64 contiguous
// context_lens: [B] int64
// Returns [B, H, D].
//
// Work is split over (sequence, context split) items, flash-decoding style: a
// sequence's blocks are cut into splits of about 128 tokens, so that even a batch
// of one with a long context keeps every thread busy. An item streams whole token rows (all KVH
// heads, KVH * D contiguous floats) through two passes, K for the scores and V for
// the output, so memory is read front to back; each K or V row is loaded once for
// all H query heads (GQA without copies). An item leaves an unnormalised partial
// (running max, sum of exponentials, weighted V sum) per query head; the partials of
// a sequence are merged at the end (exact up to rounding). The splits depend only
// on the sequence's own length, so its result does not depend on the batch.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with tensor casters, without torch/extension.h's whole C++ API
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

constexpr int64_t kSplitTokens = 128;  // context tokens per work item (rounded to whole blocks): enough items to balance two threads at batch 1

struct Item {
  int64_t seq, first_token, end_token;
};

// Where one item's tokens live: a sequence's block table and a token range.
struct Span {
  const float* cache;
  const int64_t* table;
  int64_t block_size, s_block, s_kv, s_tok, first_token, end_token;

  // fn(t, row) for every token t of the range (0-based), row = its K (kv = 0) or V
  // (kv = 1) row of KVH * D floats; walks whole runs of a block, no per-token division.
  template <typename Fn>
  void for_rows(int64_t kv, Fn fn) const {
    for (int64_t pos = first_token; pos < end_token;) {
      const int64_t offset = pos % block_size, run = std::min(block_size - offset, end_token - pos);
      const float* row = cache + table[pos / block_size] * s_block + kv * s_kv + offset * s_tok;
      for (int64_t r = 0; r < run; ++r) fn(pos - first_token + r, row + r * s_tok);
      pos += run;
    }
  }
};

// One item: scores of all H query heads over the span's K rows, their softmax
// numerators (max and sum kept), then the weighted sum of V rows. D_FIXED is the
// head size when known at compile time (fully unrolled dot products), 0 otherwise.
template <int64_t D_FIXED>
void attend_span(const Span& span, const float* qs, int64_t H, int64_t G, int64_t d_runtime, float* scores,
                 float* max_out, float* sum_out, float* acc) {
  const int64_t D = D_FIXED ? D_FIXED : d_runtime;
  const int64_t n = span.end_token - span.first_token;
  span.for_rows(0, [&](int64_t t, const float* k) {
    for (int64_t h = 0; h < H; ++h) scores[h * n + t] = dot(qs + h * D, k + (h / G) * D, D);
  });
  for (int64_t h = 0; h < H; ++h) {
    float* s = scores + h * n;
    const float m = *std::max_element(s, s + n);
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] = expf(s[t] - m);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) sum += s[t];
    max_out[h] = m;
    sum_out[h] = sum;
  }
  std::fill(acc, acc + H * D, 0.f);
  span.for_rows(1, [&](int64_t t, const float* v) {
    for (int64_t h = 0; h < H; ++h) axpy(scores[h * n + t], v + (h / G) * D, acc + h * D, D);
  });
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor layer_cache, at::Tensor block_tables,
                                     at::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat, "q: [B, H, D] float32");
  TORCH_CHECK(layer_cache.dim() == 5 && layer_cache.scalar_type() == at::kFloat && layer_cache.stride(4) == 1,
              "layer_cache: [num_blocks, 2, block_size, KVH, D] float32, last dim contiguous");
  TORCH_CHECK(layer_cache.stride(3) == layer_cache.size(4), "layer_cache: a token's KVH x D row must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong,
              "block_tables: [B, max_blocks] int64");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kLong, "context_lens: [B] int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = layer_cache.size(2), KVH = layer_cache.size(3);
  TORCH_CHECK(layer_cache.size(4) == D && H % KVH == 0, "head dims do not match");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "batch sizes do not match");
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  const int64_t s_block = layer_cache.stride(0), s_kv = layer_cache.stride(1), s_tok = layer_cache.stride(2);
  auto lens = context_lens.contiguous();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens_p[b] >= 1 && lens_p[b] <= max_blocks * block_size, "context length out of range");

  // Splits of a fixed number of whole blocks: a sequence's partials, and so its
  // result, do not depend on what else is in the batch (batch-invariant).
  const int64_t blocks_per_split = std::max<int64_t>(1, kSplitTokens / block_size);
  std::vector<Item> items;
  std::vector<int64_t> first_item(B + 1);
  for (int64_t b = 0; b < B; ++b) {
    first_item[b] = static_cast<int64_t>(items.size());
    for (int64_t start = 0; start < lens_p[b]; start += blocks_per_split * block_size)
      items.push_back({b, start, std::min(lens_p[b], start + blocks_per_split * block_size)});
  }
  first_item[B] = static_cast<int64_t>(items.size());
  const int64_t num_items = first_item[B];

  // Per item and query head: running max, sum of exponentials, unnormalised output.
  std::vector<float> maxes(num_items * H), sums(num_items * H), accs(num_items * H * D);
  const float* q_p = q.data_ptr<float>();
  const float* cache_p = layer_cache.data_ptr<float>();
  const int64_t* tables_p = block_tables.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(H * D), scores;
    for (int64_t i = begin; i < end; ++i) {
      const Item item = items[i];
      for (int64_t j = 0; j < H * D; ++j) qs[j] = q_p[item.seq * H * D + j] * fscale;
      scores.resize(H * (item.end_token - item.first_token));
      const Span span{cache_p, tables_p + item.seq * max_blocks, block_size, s_block, s_kv, s_tok,
                      item.first_token, item.end_token};
      float* acc = accs.data() + i * H * D;
      float* max_p = maxes.data() + i * H;
      float* sum_p = sums.data() + i * H;
      if (D == 64) attend_span<64>(span, qs.data(), H, G, D, scores.data(), max_p, sum_p, acc);
      else if (D == 128) attend_span<128>(span, qs.data(), H, G, D, scores.data(), max_p, sum_p, acc);
      else attend_span<0>(span, qs.data(), H, G, D, scores.data(), max_p, sum_p, acc);
    }
  });

  auto out = at::empty_like(q);
  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = first_item[b]; i < first_item[b + 1]; ++i) m = std::max(m, maxes[i * H + h]);
      float* o = out_p + bh * D;
      std::fill(o, o + D, 0.f);
      float sum = 0.f;
      for (int64_t i = first_item[b]; i < first_item[b + 1]; ++i) {
        const float w = std::exp(maxes[i * H + h] - m);
        sum += w * sums[i * H + h];
        axpy(w, accs.data() + (i * H + h) * D, o, D);
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
