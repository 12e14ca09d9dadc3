// GGUF blocks to float32 or bfloat16 weights: the float path of a step with more rows than the
// integer kernel wins at dequantizes a slice of a layer at a time and multiplies it with a GEMM,
// so this runs at every such step and has to keep up with the GEMM. Each value is computed in
// ggml's arithmetic and order (a multiply, then an add), so that it equals the gguf package's
// dequantization bit for bit: where an add follows, the product is exact in float32 (an fp16
// scale times at most 11 bits), so a compiler's fused multiply-add gives the same bits.
// bfloat16 rounds to nearest even, as at::BFloat16 does.
// AVX2 builds compute 8 weights a vector; the portable build a weight at a time.
#include "kernels.h"
#include "quant_blocks.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>

namespace {

using namespace quant;

// Q4_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
inline void q4_k_scale_min(const uint8_t* s, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#if defined(__AVX2__)
inline void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }
inline void store8(at::BFloat16* dst, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), to_bf16(v));
}

// dst[l] = float(q[l] + bias) * scale[l / 16] + offset for 32 quants q, bytes (signed where
// SIGNED); the offset added only where OFFSET.
template <bool SIGNED, bool OFFSET, typename Out>
inline void emit32(__m256i q, int bias, float scale_low, float scale_high, float offset,
                   Out* dst) {
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  const __m256i bias8 = _mm256_set1_epi32(bias);
  for (int g = 0; g < 4; ++g) {
    const __m128i bytes = g % 2 ? _mm_srli_si128(halves[g / 2], 8) : halves[g / 2];
    const __m256i ints = SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ints, bias8)),
                             _mm256_set1_ps(g < 2 ? scale_low : scale_high));
    if constexpr (OFFSET) v = _mm256_add_ps(v, _mm256_set1_ps(offset));
    store8(dst + 8 * g, v);
  }
}

template <typename Out>
void dequantize_block(const uint8_t* blk, int64_t qtype, Out* dst) {
  switch (qtype) {
    case Q8_0: {  // d q
      const auto* b = reinterpret_cast<const BlockQ8_0*>(blk);
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs));
      const float d = half_to_float(b->d);
      return emit32<true, false>(q, 0, d, d, 0.f, dst);
    }
    case Q4_1: {  // q d + m
      const auto* b = reinterpret_cast<const BlockQ4_1*>(blk);
      const float d = half_to_float(b->d);
      return emit32<false, true>(unpack_nibbles(b->qs), 0, d, d, half_to_float(b->m), dst);
    }
    case Q4_0: {  // (q - 8) d
      const auto* b = reinterpret_cast<const BlockQ4_0*>(blk);
      const float d = half_to_float(b->d);
      return emit32<false, false>(unpack_nibbles(b->qs), -8, d, d, 0.f, dst);
    }
    case Q5_0: {  // (q - 16) d, q's fifth bit from qh
      const auto* b = reinterpret_cast<const BlockQ5_0*>(blk);
      const __m256i high = _mm256_and_si256(bytes_from_bits(b->qh), _mm256_set1_epi8(0x10));
      const float d = half_to_float(b->d);
      return emit32<false, false>(_mm256_or_si256(unpack_nibbles(b->qs), high), -16, d, d, 0.f,
                                  dst);
    }
    case Q4_K:
    case Q5_K: {  // (d scale) q - (dmin min), per sub-block; Q5_K's fifth bits from qh
      const auto* b = reinterpret_cast<const BlockQ4_K*>(blk);  // Q5_K shares the head
      const uint8_t* qs = qtype == Q4_K ? b->qs : reinterpret_cast<const BlockQ5_K*>(blk)->qs;
      const uint8_t* qh = qtype == Q5_K ? reinterpret_cast<const BlockQ5_K*>(blk)->qh : nullptr;
      const float d = half_to_float(b->d), dmin = half_to_float(b->dmin);
      for (int j = 0; j < QK_K / QK; ++j) {
        int scale, min;
        q4_k_scale_min(b->scales, j, &scale, &min);
        const float dl = d * static_cast<float>(scale), ml = dmin * static_cast<float>(min);
        __m256i q = nibbles32(qs + 32 * (j / 2), j % 2);
        if (qh != nullptr) q = _mm256_or_si256(q, bit_field32(qh, j, 1, 4));
        emit32<false, true>(q, 0, dl, dl, -ml, dst + QK * j);
      }
      return;
    }
    case Q6_K: {  // (d scale) (q - 32), a scale per 16; q's 2 high bits from qh
      const auto* b = reinterpret_cast<const BlockQ6_K*>(blk);
      const float d = half_to_float(b->d);
      for (int j = 0; j < QK_K / QK; ++j) {  // sub-block j = 4 h + s of half h
        const int h = j / 4, s = j % 4;
        const __m256i q = _mm256_or_si256(nibbles32(b->ql + 64 * h + 32 * (s % 2), s >= 2),
                                          bit_field32(b->qh + 32 * h, 2 * s, 2, 4));
        emit32<false, false>(q, -32, d * static_cast<float>(b->scales[2 * j]),
                             d * static_cast<float>(b->scales[2 * j + 1]), 0.f, dst + QK * j);
      }
      return;
    }
  }
  TORCH_CHECK(false, "unsupported quantized type ", qtype);
}
#else
// Q6_K's 6-bit q (0..63) of the 32 weights of sub-block j: sub-block j = 4 h + s of half h
// takes the low (s < 2) or high nibbles of ql[64 h + 32 (s % 2) + l] and bits 2 s of qh[32 h + l].
inline void q6_k_values(const BlockQ6_K* blk, int j, uint8_t* q) {
  const int h = j / 4, s = j % 4;
  const uint8_t* ql = blk->ql + 64 * h + 32 * (s % 2);
  const uint8_t* qh = blk->qh + 32 * h;
  for (int l = 0; l < QK; ++l) {
    q[l] = ((s < 2 ? ql[l] & 0x0F : ql[l] >> 4) | (((qh[l] >> (2 * s)) & 3) << 4));
  }
}

void dequantize_block_float(const uint8_t* blk, int64_t qtype, float* dst) {
  switch (qtype) {
    case Q8_0: {
      const auto* q = reinterpret_cast<const BlockQ8_0*>(blk);
      const float d = half_to_float(q->d);
      for (int j = 0; j < QK; ++j) dst[j] = d * q->qs[j];
      return;
    }
    case Q4_1: {  // q d + m
      const auto* q = reinterpret_cast<const BlockQ4_1*>(blk);
      const float d = half_to_float(q->d), m = half_to_float(q->m);
      for (int j = 0; j < QK / 2; ++j) {
        dst[j] = (q->qs[j] & 0x0F) * d + m;
        dst[j + QK / 2] = (q->qs[j] >> 4) * d + m;
      }
      return;
    }
    case Q4_0: {  // (q - 8) d
      const auto* q = reinterpret_cast<const BlockQ4_0*>(blk);
      const float d = half_to_float(q->d);
      for (int j = 0; j < QK / 2; ++j) {
        dst[j] = ((q->qs[j] & 0x0F) - 8) * d;
        dst[j + QK / 2] = ((q->qs[j] >> 4) - 8) * d;
      }
      return;
    }
    case Q5_0: {  // (q - 16) d
      const auto* q = reinterpret_cast<const BlockQ5_0*>(blk);
      const float d = half_to_float(q->d);
      uint32_t qh;
      std::memcpy(&qh, q->qh, sizeof(qh));
      for (int j = 0; j < QK / 2; ++j) {
        const int lo = (q->qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        const int hi = (q->qs[j] >> 4) | (((qh >> (j + QK / 2)) & 1) << 4);
        dst[j] = (lo - 16) * d;
        dst[j + QK / 2] = (hi - 16) * d;
      }
      return;
    }
    case Q4_K:
    case Q5_K: {  // (d scale) q - (dmin min), per sub-block; Q5_K's fifth bits from qh
      const auto* q = reinterpret_cast<const BlockQ4_K*>(blk);  // Q5_K shares the head
      const uint8_t* qs = qtype == Q4_K ? q->qs : reinterpret_cast<const BlockQ5_K*>(blk)->qs;
      const uint8_t* qh = qtype == Q5_K ? reinterpret_cast<const BlockQ5_K*>(blk)->qh : nullptr;
      const float d = half_to_float(q->d), dmin = half_to_float(q->dmin);
      for (int j = 0; j < QK_K / QK; ++j) {
        int scale, min;
        q4_k_scale_min(q->scales, j, &scale, &min);
        const float dl = d * static_cast<float>(scale), ml = dmin * static_cast<float>(min);
        const uint8_t* sub = qs + 32 * (j / 2);
        for (int l = 0; l < QK; ++l) {
          int value = j % 2 ? sub[l] >> 4 : sub[l] & 0x0F;
          if (qh != nullptr) value |= ((qh[l] >> j) & 1) << 4;
          dst[QK * j + l] = dl * static_cast<float>(value) - ml;
        }
      }
      return;
    }
    case Q6_K: {  // (d scale) (q - 32), a scale per 16
      const auto* q = reinterpret_cast<const BlockQ6_K*>(blk);
      const float d = half_to_float(q->d);
      for (int j = 0; j < QK_K / QK; ++j) {
        uint8_t values[QK];
        q6_k_values(q, j, values);
        for (int l = 0; l < QK; ++l) {
          const float dl = d * static_cast<float>(q->scales[(QK * j + l) / 16]);
          dst[QK * j + l] = dl * static_cast<float>(int(values[l]) - 32);
        }
      }
      return;
    }
  }
  TORCH_CHECK(false, "unsupported quantized type ", qtype);
}

template <typename Out>
void dequantize_block(const uint8_t* blk, int64_t qtype, Out* dst) {
  if constexpr (std::is_same_v<Out, float>) {
    dequantize_block_float(blk, qtype, dst);
  } else {
    float values[QK_K];
    dequantize_block_float(blk, qtype, values);
    for (int64_t j = 0; j < block_weights(qtype); ++j) dst[j] = Out(values[j]);
  }
}
#endif

template <typename Out>
at::Tensor dequantize_as(at::Tensor weight, int64_t qtype, int64_t k, at::ScalarType dtype) {
  weight = weight.contiguous();
  check_weight(weight, qtype, k);
  const int64_t n = weight.size(0), width = block_weights(qtype), bb = block_bytes(qtype);
  auto out = at::empty({n, k}, dtype);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  Out* o = out.data_ptr<Out>();
  at::parallel_for(0, n * (k / width), 256 * QK / width, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_block(w + i * bb, qtype, o + i * width);
  });
  return out;
}

}  // namespace

// The float weights [n, k] the blocks stand for.
at::Tensor dequantize(at::Tensor weight, int64_t qtype, int64_t k) {
  return dequantize_as<float>(weight, qtype, k, at::kFloat);
}

// The same weights as bfloat16 (rounded to nearest even, as .to(torch.bfloat16)).
at::Tensor dequantize_bf16(at::Tensor weight, int64_t qtype, int64_t k) {
  return dequantize_as<at::BFloat16>(weight, qtype, k, at::kBFloat16);
}
