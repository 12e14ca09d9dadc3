// Linear layers over GGUF's quantized blocks as stored (Q4_0, Q4_1, Q8_0: 32 weights a block),
// never expanded: each activation row is quantized to int8 per block of 32 (llama.cpp's Q8
// scheme, with the block's exact float sum for the offset term) and multiplied with integer dot
// products (AVX2 maddubs, AVX-512 VNNI dpbusd where built for it; a scalar loop elsewhere).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;  // weights per block
// ggml's type ids, as the gguf package numbers them.
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;

struct BlockQ4_0 { uint16_t d; uint8_t qs[QK / 2]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[QK / 2]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[QK]; };
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34,
              "GGUF block layouts");

inline float half_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return sizeof(BlockQ4_0);
    case Q4_1: return sizeof(BlockQ4_1);
    case Q8_0: return sizeof(BlockQ8_0);
  }
  TORCH_CHECK(false, "unsupported quantized type ", qtype);
}

// One activation row quantized per block: int8 values, the block's scale and its exact sum.
struct QuantizedRows {
  std::vector<int8_t> q;    // [rows, K]
  std::vector<float> d;     // [rows, K / QK]
  std::vector<float> sum;   // [rows, K / QK]
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t nb = k / QK;
  QuantizedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * nb),
                    std::vector<float>(rows * nb)};
  at::parallel_for(0, rows * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* src = x + i * QK;
      float v[QK];
      float amax = 0.f, sum = 0.f;
      for (int j = 0; j < QK; ++j) {
        v[j] = static_cast<float>(src[j]);
        amax = std::max(amax, std::fabs(v[j]));
        sum += v[j];
      }
      const float d = amax / 127.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      for (int j = 0; j < QK; ++j) out.q[i * QK + j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
      out.d[i] = d;
      out.sum[i] = sum;
    }
  });
  return out;
}

// Sum over one block of w[j] * a[j] for 32 unsigned 4-bit weights (in the GGUF nibble order:
// low nibbles are weights 0-15, high nibbles 16-31) and 32 signed int8 activations.
#if defined(__AVX2__)
inline __m256i dot_pairs_u8_s8(__m256i w, __m256i a) {  // 8 int32 partial sums
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
#endif
}

inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Dot product of one weight row (nb blocks) with one quantized activation row.
template <int64_t QTYPE>
float row_dot(const uint8_t* w_row, const int8_t* aq, const float* ad, const float* asum,
              int64_t nb) {
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  float offset = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + b * QK));
    __m256i p;
    float dw;
    if constexpr (QTYPE == Q8_0) {
      const auto* blk = reinterpret_cast<const BlockQ8_0*>(w_row) + b;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk->qs));
      // maddubs wants unsigned x signed: |w| times a with w's sign.
      p = dot_pairs_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
      dw = half_to_float(blk->d);
    } else if constexpr (QTYPE == Q4_1) {
      const auto* blk = reinterpret_cast<const BlockQ4_1*>(w_row) + b;
      p = dot_pairs_u8_s8(unpack_nibbles(blk->qs), a);
      dw = half_to_float(blk->d);
      offset += half_to_float(blk->m) * asum[b];
    } else {  // Q4_0: w = d (q - 8)
      const auto* blk = reinterpret_cast<const BlockQ4_0*>(w_row) + b;
      p = dot_pairs_u8_s8(unpack_nibbles(blk->qs), a);
      dw = half_to_float(blk->d);
      offset -= 8.f * dw * asum[b];
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * ad[b]), acc);
  }
  return hsum(acc) + offset;
#else
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* a = aq + b * QK;
    int32_t isum = 0;
    float dw;
    if constexpr (QTYPE == Q8_0) {
      const auto* blk = reinterpret_cast<const BlockQ8_0*>(w_row) + b;
      for (int j = 0; j < QK; ++j) isum += int32_t(blk->qs[j]) * a[j];
      dw = half_to_float(blk->d);
    } else {
      const uint8_t* qs;
      if constexpr (QTYPE == Q4_1) {
        const auto* blk = reinterpret_cast<const BlockQ4_1*>(w_row) + b;
        qs = blk->qs;
        dw = half_to_float(blk->d);
        total += half_to_float(blk->m) * asum[b];
      } else {
        const auto* blk = reinterpret_cast<const BlockQ4_0*>(w_row) + b;
        qs = blk->qs;
        dw = half_to_float(blk->d);
        total -= 8.f * dw * asum[b];
      }
      for (int j = 0; j < QK / 2; ++j) {
        isum += int32_t(qs[j] & 0x0F) * a[j] + int32_t(qs[j] >> 4) * a[j + QK / 2];
      }
    }
    total += dw * ad[b] * static_cast<float>(isum);
  }
  return total;
#endif
}

template <int64_t QTYPE>
void gemv_rows(const uint8_t* w, int64_t n, int64_t k, const QuantizedRows& xq, int64_t rows,
               float* out) {
  const int64_t nb = k / QK, row_bytes = nb * block_bytes(QTYPE);
  // Each weight row is read once and used for every activation row while it is in L1.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* w_row = w + o * row_bytes;
      for (int64_t r = 0; r < rows; ++r) {
        out[r * n + o] = row_dot<QTYPE>(w_row, xq.q.data() + r * k, xq.d.data() + r * nb,
                                        xq.sum.data() + r * nb, nb);
      }
    }
  });
}

void check_weight(const torch::Tensor& weight, int64_t qtype, int64_t k) {
  TORCH_CHECK(weight.dtype() == torch::kUInt8 && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be contiguous uint8 [out_features, row_bytes]");
  TORCH_CHECK(k % QK == 0, "in_features must be a multiple of ", QK);
  TORCH_CHECK(weight.size(1) == k / QK * block_bytes(qtype), "weight rows hold ",
              weight.size(1), " bytes, not ", k / QK * block_bytes(qtype));
}

}  // namespace

// y = x W^T (+ bias) for x [rows, k] float32 or bfloat16; W in GGUF blocks [n, row_bytes].
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor weight, int64_t qtype,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
  x = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  check_weight(weight, qtype, k);
  const QuantizedRows xq = x.scalar_type() == torch::kBFloat16
      ? quantize_rows(x.data_ptr<at::BFloat16>(), rows, k)
      : quantize_rows(x.to(torch::kFloat32).data_ptr<float>(), rows, k);
  auto out = torch::empty({rows, n}, x.options().dtype(torch::kFloat32));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (qtype) {
    case Q4_0: gemv_rows<Q4_0>(w, n, k, xq, rows, o); break;
    case Q4_1: gemv_rows<Q4_1>(w, n, k, xq, rows, o); break;
    case Q8_0: gemv_rows<Q8_0>(w, n, k, xq, rows, o); break;
    default: TORCH_CHECK(false, "unsupported quantized type ", qtype);
  }
  if (bias.has_value()) out.add_(bias->to(torch::kFloat32));
  return out.to(x.scalar_type());
}

// The float weights [n, k] the blocks stand for (the large-batch path: dequantize, then GEMM).
torch::Tensor dequantize(torch::Tensor weight, int64_t qtype, int64_t k) {
  check_weight(weight, qtype, k);
  const int64_t n = weight.size(0), nb = k / QK, bb = block_bytes(qtype);
  auto out = torch::empty({n, k}, torch::kFloat32);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* blk = w + i * bb;
      float* dst = o + i * QK;
      if (qtype == Q8_0) {
        const auto* q = reinterpret_cast<const BlockQ8_0*>(blk);
        const float d = half_to_float(q->d);
        for (int j = 0; j < QK; ++j) dst[j] = d * q->qs[j];
      } else {
        if (qtype == Q4_1) {  // as ggml: q d + m
          const auto* q = reinterpret_cast<const BlockQ4_1*>(blk);
          const float d = half_to_float(q->d), m = half_to_float(q->m);
          for (int j = 0; j < QK / 2; ++j) {
            dst[j] = (q->qs[j] & 0x0F) * d + m;
            dst[j + QK / 2] = (q->qs[j] >> 4) * d + m;
          }
        } else {  // as ggml: (q - 8) d
          const auto* q = reinterpret_cast<const BlockQ4_0*>(blk);
          const float d = half_to_float(q->d);
          for (int j = 0; j < QK / 2; ++j) {
            dst[j] = ((q->qs[j] & 0x0F) - 8) * d;
            dst[j + QK / 2] = ((q->qs[j] >> 4) - 8) * d;
          }
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear);
  m.def("dequantize", &dequantize);
}
