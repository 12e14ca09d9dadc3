// Sampling from softmax(logits / temperature) when no filter (top-k, top-p, min-p) is on: one
// pass a row computes the weights exp((l - max) / t) and their block sums, a second finds the
// first token whose cumulative weight passes u times the total. The same two-level search as
// the torch path (Sampler.draw: float32 sums of blocks of 256, float64 over blocks and inside
// the target block), in one call instead of some 25 torch ops, whose dispatch was most of their
// time.
#include "kernels.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 256;  // Sampler.DRAW_BLOCK


// weights[i] = exp((logits[i] - top) * inv_t) for i in [begin, end); returns their sum.
float block_weights(const float* logits, float top, float inv_t, float* weights, int64_t begin,
                    int64_t end) {
  float sum = 0.f;
  int64_t i = begin;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= end; i += 8) {
    const __m256 w = exp_avx2(_mm256_mul_ps(
        _mm256_sub_ps(_mm256_loadu_ps(logits + i), _mm256_set1_ps(top)),
        _mm256_set1_ps(inv_t)));
    _mm256_storeu_ps(weights + i, w);
    acc = _mm256_add_ps(acc, w);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; i < end; ++i) {
    weights[i] = std::exp((logits[i] - top) * inv_t);
    sum += weights[i];
  }
  return sum;
}

int64_t sample_row(const float* logits, int64_t vocab, float temperature, double u,
                   float* weights, double* block_cdf) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < vocab; ++i) top = std::max(top, logits[i]);
  if (!(top > -std::numeric_limits<float>::infinity())) return 0;  // every token forbidden
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  const float inv_t = 1.f / temperature;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += block_weights(logits, top, inv_t, weights, b * BLOCK,
                           std::min(vocab, (b + 1) * BLOCK));
    block_cdf[b] = total;
  }
  // u < 1 puts the target below the total, so some block passes it; a token of weight 0 adds
  // nothing and is never the first to pass.
  const double target = u * total;
  const int64_t b = std::upper_bound(block_cdf, block_cdf + blocks, target) - block_cdf;
  double passed = b > 0 ? block_cdf[b - 1] : 0.0;
  int64_t last = -1;
  for (int64_t i = b * BLOCK; i < std::min(vocab, (b + 1) * BLOCK); ++i) {
    if (weights[i] > 0.f) {
      last = i;
      passed += weights[i];
      if (passed > target) return i;
    }
  }
  // The block's float32 sum and this float64 one may differ in the last bit: a target past
  // the block's end takes its last token of nonzero weight.
  return last;
}

}  // namespace

torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperatures, torch::Tensor u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32,
              "logits must be float32 [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(temperatures.scalar_type() == torch::kFloat32 && temperatures.numel() == rows &&
              u.scalar_type() == torch::kFloat64 && u.numel() == rows,
              "one float32 temperature and one float64 u a row");
  logits = logits.contiguous();
  temperatures = temperatures.contiguous();
  u = u.contiguous();
  auto tokens = torch::empty({rows}, torch::kInt64);
  const float* l = logits.data_ptr<float>();
  const float* t = temperatures.data_ptr<float>();
  const double* uniform = u.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(t[r] > 0.f, "temperature must be positive");
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(vocab);
    std::vector<double> block_cdf((vocab + BLOCK - 1) / BLOCK);
    for (int64_t r = begin; r < end; ++r) {
      out[r] = sample_row(l + r * vocab, vocab, t[r], uniform[r], weights.data(),
                          block_cdf.data());
    }
  });
  return tokens;
}
