// Vector math the kernels share.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>

// 8 floats from float32 or bfloat16 (bfloat16 is float32's high half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The sum of 8 floats.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sum of 8 int32 values.
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// The largest of 8 floats.
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 32 int32 values (4 vectors, in order) saturated to int8 and stored in order.
inline void store_int8x32(int8_t* dst, __m256i a, __m256i b, __m256i c, __m256i d) {
  // packs works within 128-bit lanes: the permute puts the four 8-byte groups back in order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(packed, order));
}

// 8 floats as bfloat16, rounded to nearest even (at::BFloat16's rule: NaN becomes 0x7FC0).
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // packus works within 128-bit lanes: [0-3 0-3 | 4-7 4-7], then 64-bit quarters 0, 2.
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8));
}

// exp(x), Cephes' expf: 2^n times a polynomial in the remainder, ~2 ulp. 0 below -87 (-inf
// included: a forbidden token's weight is 0 exactly); inputs above 88 count as 88 (e^88 ~
// 1.7e38). std::exp in an `omp simd` loop stays scalar libm here (glibc's vector exp needs
// -ffast-math).
inline __m256 exp_avx2(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                   _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}
#endif
