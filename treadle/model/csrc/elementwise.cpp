// A decoder layer's elementwise steps, each one pass over its rows: RMS norm, rotary position
// embedding (rotate-half), SiLU-and-multiply. In torch they are 3 to 8 small ops each, and at
// one token a step it is those ops' dispatch, not their arithmetic, that costs.
//
// Values are computed in float32. Where torch rounds an intermediate to the model's dtype
// (bfloat16), `round_to` rounds it here too, so both paths give the same bits up to the last
// float32 ulp of exp and of fused multiply-adds.
#include "kernels.h"
#include "vec_math.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);  // bfloat16: round to nearest even
}

template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

constexpr int64_t kGrain = 16;  // rows per parallel task: a decode step's few rows stay serial

// out = weight * bf(x / rms(x)) (Llama: the weight applies after the cast back, in T), or
// bf(x / rms(x) * weight) (`scale_in_float32`: Gemma, whose weight is float32).
template <typename T, typename W>
void rms_norm_rows(const T* x, int64_t x_stride, const W* weight, T* out, int64_t rows,
                   int64_t dim, float eps, bool scale_in_float32) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * dim;
      float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < dim; ++i) {
        const float v = to_float(xr[i]);
        sum_sq += v * v;
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
      if (scale_in_float32) {
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i)
          o[i] = from_float<T>(to_float(xr[i]) * inv_rms * to_float(weight[i]));
      } else {
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i)
          o[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(xr[i]) * inv_rms));
      }
    }
  });
}

// x [tokens, heads, dim] (any token and head strides), cos and sin [tokens, dim / 2].
template <typename T>
void rope_rows(const T* x, int64_t token_stride, int64_t head_stride, const T* cos,
               const T* sin, T* out, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + t * token_stride + h * head_stride;
        T* o = out + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(xh[i]), x2 = to_float(xh[i + half]);
          const float ci = to_float(c[i]), si = to_float(s[i]);
          o[i] = from_float<T>(round_to<T>(x1 * ci) - round_to<T>(x2 * si));
          o[i + half] = from_float<T>(round_to<T>(x2 * ci) + round_to<T>(x1 * si));
        }
      }
    }
  });
}

// gate_up [tokens, 2 * width] (any token stride): silu(gate) * up, [tokens, width].
template <typename T>
void silu_and_mul_rows(const T* gate_up, int64_t row_stride, T* out, int64_t tokens,
                       int64_t width) {
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gate_up + t * row_stride;
      const T* u = g + width;
      T* o = out + t * width;
      int64_t i = 0;
#if defined(__AVX2__)
      for (; i + 8 <= width; i += 8) {  // a vector exp (libm's stays scalar)
        const __m256 gi = load8(g + i);
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gi));
        const __m256 silu = _mm256_div_ps(gi, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        if constexpr (std::is_same_v<T, float>) {
          _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        } else {  // silu rounded to bfloat16 as torch rounds it, then the product
          const __m128i rounded = to_bf16(silu);
          const __m256 silu16 = _mm256_castsi256_ps(
              _mm256_slli_epi32(_mm256_cvtepu16_epi32(rounded), 16));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i),
                           to_bf16(_mm256_mul_ps(silu16, load8(u + i))));
        }
      }
#endif
      for (; i < width; ++i) {
        const float gi = to_float(g[i]);
        o[i] = from_float<T>(round_to<T>(gi / (1.f + std::exp(-gi))) * to_float(u[i]));
      }
    }
  });
}

void check_dtype(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 only, got ", x.scalar_type());
}

}  // namespace

// x [..., dim]; weight [dim], x's dtype or float32. Returns x's shape, contiguous.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, bool scale_in_float32) {
  check_dtype(x);
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim, "weight must be [", dim, "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "weight must be x's dtype or float32");
  at::Tensor rows = x.reshape({-1, dim});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  weight = weight.contiguous();
  auto out = at::empty({rows.size(0), dim}, x.options());
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(rows.data_ptr<float>(), rows.stride(0), weight.data_ptr<float>(),
                  out.data_ptr<float>(), rows.size(0), dim, feps, scale_in_float32);
  } else if (weight.scalar_type() == at::kFloat) {
    rms_norm_rows(rows.data_ptr<at::BFloat16>(), rows.stride(0), weight.data_ptr<float>(),
                  out.data_ptr<at::BFloat16>(), rows.size(0), dim, feps, scale_in_float32);
  } else {
    rms_norm_rows(rows.data_ptr<at::BFloat16>(), rows.stride(0), weight.data_ptr<at::BFloat16>(),
                  out.data_ptr<at::BFloat16>(), rows.size(0), dim, feps, scale_in_float32);
  }
  return out.view(x.sizes());
}

// x [tokens, heads, dim] (last dim contiguous); cos, sin [tokens, 1, dim / 2] or
// [tokens, dim / 2], x's dtype. Returns [tokens, heads, dim], contiguous.
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_dtype(x);
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x must be [tokens, heads, even dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type());
  TORCH_CHECK(cos.numel() == tokens * dim / 2 && sin.numel() == cos.numel(),
              "cos and sin must hold [tokens, dim / 2]");
  if (x.stride(2) != 1) x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto out = at::empty({tokens, heads, dim}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rope_rows(x.data_ptr<float>(), x.stride(0), x.stride(1), cos.data_ptr<float>(),
              sin.data_ptr<float>(), out.data_ptr<float>(), tokens, heads, dim);
  } else {
    rope_rows(x.data_ptr<at::BFloat16>(), x.stride(0), x.stride(1), cos.data_ptr<at::BFloat16>(),
              sin.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), tokens, heads, dim);
  }
  return out;
}

// gate_up [tokens, 2 * width] (last dim contiguous). Returns silu(gate) * up, [tokens, width].
at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_dtype(gate_up);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [tokens, 2 * width]");
  if (gate_up.stride(1) != 1) gate_up = gate_up.contiguous();
  const int64_t tokens = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = at::empty({tokens, width}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), tokens,
                      width);
  } else {
    silu_and_mul_rows(gate_up.data_ptr<at::BFloat16>(), gate_up.stride(0),
                      out.data_ptr<at::BFloat16>(), tokens, width);
  }
  return out;
}
