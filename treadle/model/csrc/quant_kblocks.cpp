// Linear layers over the K-quants (Q4_K, Q5_K, Q6_K) as stored. Activations are quantized per
// super-block of 256 (llama.cpp's Q8_K), so a super-block's dot product stays in integers: per
// 32 weights one maddubs (u8 weights x s8 activations) and one multiply-add by the weights'
// 16-bit sub-block scales (VNNI's dpwssd where built for it), then two float FMAs a super-block
// (the scale d, and the offset term: the mins or Q6_K's -32 times the activations' sums).
//
// One tile routine serves every batch size: R activation rows x W weight rows, the weight
// super-blocks unpacked once for the R rows and each activation vector loaded once for the W
// rows. A decode step streams the weights (R = 1, W = 2, prefetching ahead); larger steps run
// as a GEMM over blocks of rows that stay in L2. Every (row, output) pair sees the same
// arithmetic in the same order whatever the tile, so results do not depend on the batch.
#include "quant_blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

namespace quant {
namespace {

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

#if defined(__AVX2__)
inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// acc + sum over pairs of (q * a) * scale: 8 int32 lanes, each 4 consecutive weights.
inline __m256i dot_scaled(__m256i acc, __m256i q, __m256i a, __m256i scale) {
  const __m256i pairs = _mm256_maddubs_epi16(q, a);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, pairs, scale);
#else
  return in_order(_mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale)));
#endif
}

// What the tile needs of one weight super-block: its 32-weight chunks as unsigned bytes, each
// chunk's 16-bit scales (per 16 weights), the offsets' multipliers per 16 (m16) and the float
// factors of the two terms: d * sum(scale q a) + dm * sum(m16 bsum).
struct Prepared {
  const uint8_t* blk;
  __m256i m16;
  __m256i s16;  // Q4_K/Q5_K: the 8 scales as 16 bits, in both lanes (a shuffle picks one)
  float d, dm;
  alignas(16) uint8_t sm[16];  // Q4_K/Q5_K: scales, mins
};

// The 8 scales of a Q4_K/Q5_K super-block as 16-bit words in both 128-bit lanes.
inline __m256i k4_scales16(const uint8_t* sm) {
  return _mm256_broadcastsi128_si256(
      _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm))));
}

// A vpshufb mask word that picks 16-bit word w of its 128-bit lane.
constexpr int16_t word_picker(int w) { return static_cast<int16_t>((2 * w + 1) << 8 | 2 * w); }

// Scale j in every 16-bit lane: one shuffle, where a broadcast from memory costs a load and a
// shuffle (the one-row kernels are bound by their instruction count).
inline __m256i k4_scale(const Prepared& p, int j) {
  return _mm256_shuffle_epi8(p.s16, _mm256_set1_epi16(word_picker(j)));
}

template <int64_t QTYPE> struct KBlock;

template <> struct KBlock<Q4_K> {
  using Block = BlockQ4_K;
  static Prepared prepare(const uint8_t* p) {
    const auto* b = reinterpret_cast<const Block*>(p);
    Prepared out;
    out.blk = p;
    k4_scales_mins(b->scales, out.sm);
    const __m128i mins = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(out.sm + 8));
    out.m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins));  // min_j for 16-groups 2j, 2j+1
    out.s16 = k4_scales16(out.sm);
    out.d = half_to_float(b->d);
    out.dm = -half_to_float(b->dmin);
    return out;
  }
  static __m256i q(const Prepared& p, int j) {
    const auto* b = reinterpret_cast<const Block*>(p.blk);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * (j / 2)));
    const __m256i low = _mm256_set1_epi8(0x0F);
    return j % 2 ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), low) : _mm256_and_si256(raw, low);
  }
  static __m256i scale(const Prepared& p, int j) { return k4_scale(p, j); }
};

template <> struct KBlock<Q5_K> {
  using Block = BlockQ5_K;
  static Prepared prepare(const uint8_t* p) {
    const auto* b = reinterpret_cast<const Block*>(p);
    Prepared out;
    out.blk = p;
    k4_scales_mins(b->scales, out.sm);
    const __m128i mins = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(out.sm + 8));
    out.m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins));
    out.s16 = k4_scales16(out.sm);
    out.d = half_to_float(b->d);
    out.dm = -half_to_float(b->dmin);
    return out;
  }
  static __m256i q(const Prepared& p, int j) {
    const auto* b = reinterpret_cast<const Block*>(p.blk);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * (j / 2)));
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i q4 = j % 2 ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), low)
                             : _mm256_and_si256(raw, low);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh));
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)),
                                         _mm256_set1_epi8(1));
    return _mm256_or_si256(q4, _mm256_slli_epi16(bit, 4));
  }
  static __m256i scale(const Prepared& p, int j) { return k4_scale(p, j); }
};

template <> struct KBlock<Q6_K> {
  using Block = BlockQ6_K;
  static Prepared prepare(const uint8_t* p) {
    const auto* b = reinterpret_cast<const Block*>(p);
    Prepared out;
    out.blk = p;
    out.m16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
    out.d = half_to_float(b->d);
    out.dm = -32.f * out.d;
    return out;
  }
  // Sub-block j = 4 h + s of half h: the low (s < 2) or high nibbles of ql[64 h + 32 (s % 2)..]
  // and bits 2 s of qh[32 h..].
  static __m256i q(const Prepared& p, int j) {
    const auto* b = reinterpret_cast<const Block*>(p.blk);
    const int h = j / 4, s = j % 4;
    const __m256i ql = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(b->ql + 64 * h + 32 * (s % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * h));
    const __m256i low = _mm256_and_si256(s < 2 ? ql : _mm256_srli_epi16(ql, 4),
                                         _mm256_set1_epi8(0x0F));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * s)),
                                          _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
  // Scale 2 j in the low lane's words, 2 j + 1 in the high lane's: shuffles of m16 (the 16
  // scales as words), not two broadcasts from memory.
  static __m256i scale(const Prepared& p, int j) {
    const __m256i half = j < 4 ? _mm256_permute2x128_si256(p.m16, p.m16, 0x00)
                               : _mm256_permute2x128_si256(p.m16, p.m16, 0x11);
    const int lo = 2 * (j % 4);
    return _mm256_shuffle_epi8(half, _mm256_set_m128i(_mm_set1_epi16(word_picker(lo + 1)),
                                                      _mm_set1_epi16(word_picker(lo))));
  }
};

// out[r * ldo + i] = weight row i . activation row r0 + r, for R rows and W weight rows.
template <int64_t QTYPE, int R, int W, bool PREFETCH>
void k_tile(const uint8_t* w, int64_t row_bytes, const Q8KRows& xq, int64_t r0, float* out,
            int64_t ldo) {
  using B = KBlock<QTYPE>;
  constexpr int64_t bb = sizeof(typename B::Block);
  const int64_t nsb = xq.nsb;
  __m256 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < W; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    if constexpr (PREFETCH) prefetch_rows(w, W, row_bytes, sb * bb, bb);
    Prepared p[W];
    for (int i = 0; i < W; ++i) p[i] = B::prepare(w + i * row_bytes + sb * bb);
    __m256i iacc[R][W];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < W; ++i) iacc[r][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256i a[R];
      for (int r = 0; r < R; ++r) {
        a[r] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xq.q_row(r0 + r) + sb * QK_K + 32 * j));
      }
      for (int i = 0; i < W; ++i) {
        const __m256i q = B::q(p[i], j), scale = B::scale(p[i], j);
        for (int r = 0; r < R; ++r) iacc[r][i] = dot_scaled(iacc[r][i], q, a[r], scale);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t slot = (r0 + r) * nsb + sb;
      const float da = xq.d[slot];
      const __m256i bsums = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(xq.bsums.data() + 16 * slot));
      for (int i = 0; i < W; ++i) {
        const __m256i offset = _mm256_madd_epi16(p[i].m16, bsums);
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][i]), _mm256_set1_ps(p[i].d * da),
                                    acc[r][i]);
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset), _mm256_set1_ps(p[i].dm * da),
                                    acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < W; ++i) out[r * ldo + i] = hsum(acc[r][i]);
}

// Row and weight tiles of a GEMM step: AVX-512's 32 vector registers hold 4 x 2 pairs' two
// accumulators each, AVX2's 16 hold 2 x 2.
#if defined(__AVX512VL__)
constexpr int TILE_ROWS = 4;
#else
constexpr int TILE_ROWS = 2;
#endif
constexpr int TILE_WEIGHTS = 2;
// Weight rows a one-row step streams at once: 2 streams with the software prefetch kept the
// memory busiest (see the commit that chose it for 1, 4 and 8).
constexpr int DECODE_WEIGHTS = 2;
// Activation rows a GEMM keeps in L2 while the weight tiles pass over them (64 x 8192 bytes at
// the widest layers of an 8B model: 512 KB).
constexpr int64_t ROW_BLOCK = 64;

template <int64_t QTYPE, bool PREFETCH, int R = TILE_ROWS, int W = TILE_WEIGHTS>
void k_tile_any(int64_t rows, int64_t weights, const uint8_t* w, int64_t row_bytes,
                const Q8KRows& xq, int64_t r0, float* out, int64_t ldo) {
  if constexpr (R > 1) {
    if (rows < R) {
      return k_tile_any<QTYPE, PREFETCH, R - 1, W>(rows, weights, w, row_bytes, xq, r0, out, ldo);
    }
  }
  if constexpr (W > 1) {
    if (weights < W) {
      return k_tile_any<QTYPE, PREFETCH, R, W - 1>(rows, weights, w, row_bytes, xq, r0, out, ldo);
    }
  }
  k_tile<QTYPE, R, W, PREFETCH>(w, row_bytes, xq, r0, out, ldo);
}

// Weight rows [begin, end) against activation rows [r0, r0 + rows): out[r * ldo + o] is
// weight row o . activation row r0 + r, run by the calling thread.
template <int64_t QTYPE>
void range_avx2(const uint8_t* w, int64_t begin, int64_t end, const Q8KRows& xq, int64_t r0,
                int64_t rows, float* out, int64_t ldo) {
  const int64_t row_bytes = xq.nsb * sizeof(typename KBlock<QTYPE>::Block);
  if (rows == 1) {
    int64_t o = begin;
    for (; o + DECODE_WEIGHTS <= end; o += DECODE_WEIGHTS) {
      k_tile<QTYPE, 1, DECODE_WEIGHTS, true>(w + o * row_bytes, row_bytes, xq, r0, out + o, ldo);
    }
    for (; o < end; ++o) k_tile<QTYPE, 1, 1, true>(w + o * row_bytes, row_bytes, xq, r0, out + o, ldo);
    return;
  }
  for (int64_t rb = 0; rb < rows; rb += ROW_BLOCK) {
    const int64_t rb_end = std::min(rows, rb + ROW_BLOCK);
    for (int64_t o = begin; o < end; o += TILE_WEIGHTS) {
      const int64_t count = std::min<int64_t>(TILE_WEIGHTS, end - o);
      // The first row tile brings the weight tile in from memory, prefetching ahead as a
      // decode step does; the other row tiles find it in cache.
      k_tile_any<QTYPE, true>(std::min<int64_t>(TILE_ROWS, rb_end - rb), count,
                              w + o * row_bytes, row_bytes, xq, r0 + rb, out + rb * ldo + o, ldo);
      for (int64_t r = rb + TILE_ROWS; r < rb_end; r += TILE_ROWS) {
        k_tile_any<QTYPE, false>(std::min<int64_t>(TILE_ROWS, rb_end - r), count,
                                 w + o * row_bytes, row_bytes, xq, r0 + r, out + r * ldo + o, ldo);
      }
    }
  }
}

template <typename T>
void quantize_q8k_avx2(const T* x, int64_t rows, Q8KRows& out) {
  const int64_t nsb = out.nsb;
  at::parallel_for(0, rows * nsb, 16, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t i = begin; i < end; ++i) {
      const T* src = x + i * QK_K;
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < QK_K; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8(src + j)));
      const float d = hmax(amax) / 127.f;
      const __m256 id = _mm256_set1_ps(d >= FLT_MIN ? 1.f / d : 0.f);  // 1 / d finite
      out.d[i] = d;
      int8_t* q = out.q.data() + i * QK_K;
      int16_t* bsums = out.bsums.data() + 16 * i;
      for (int j = 0; j < QK_K; j += 32) {  // rounded to nearest even, as nearbyint
        const __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + j), id));
        const __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + j + 8), id));
        const __m256i v2 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + j + 16), id));
        const __m256i v3 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + j + 24), id));
        bsums[j / 16] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(v0, v1)));
        bsums[j / 16 + 1] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(v2, v3)));
        store_int8x32(q + j, v0, v1, v2, v3);
      }
    }
  });
}
#endif

// The portable build: the same scheme, one weight row and one activation row at a time.
inline int k_value(int64_t qtype, const uint8_t* blk, int j, int l) {
  if (qtype == Q6_K) {
    const auto* b = reinterpret_cast<const BlockQ6_K*>(blk);
    const int h = j / 4, s = j % 4;
    const uint8_t ql = b->ql[64 * h + 32 * (s % 2) + l];
    return (s < 2 ? ql & 0x0F : ql >> 4) | (((b->qh[32 * h + l] >> (2 * s)) & 3) << 4);
  }
  const uint8_t* qs = qtype == Q4_K ? reinterpret_cast<const BlockQ4_K*>(blk)->qs
                                    : reinterpret_cast<const BlockQ5_K*>(blk)->qs;
  int q = j % 2 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 0x0F;
  if (qtype == Q5_K) q |= ((reinterpret_cast<const BlockQ5_K*>(blk)->qh[l] >> j) & 1) << 4;
  return q;
}

float row_dot_portable(int64_t qtype, const uint8_t* w_row, const Q8KRows& xq, int64_t r) {
  const int64_t bb = block_bytes(qtype);
  float total = 0.f;
  for (int64_t sb = 0; sb < xq.nsb; ++sb) {
    const uint8_t* blk = w_row + sb * bb;
    const int8_t* a = xq.q_row(r) + sb * QK_K;
    const int16_t* bsums = xq.bsums.data() + 16 * (r * xq.nsb + sb);
    int scale16[16], m16[16];
    float d, dm;
    if (qtype == Q6_K) {
      const auto* b = reinterpret_cast<const BlockQ6_K*>(blk);
      for (int g = 0; g < 16; ++g) scale16[g] = m16[g] = b->scales[g];
      d = half_to_float(b->d);
      dm = -32.f * d;
    } else {
      uint8_t sm[16];
      const auto* b = reinterpret_cast<const BlockQ4_K*>(blk);  // Q5_K shares the head
      k4_scales_mins(b->scales, sm);
      for (int g = 0; g < 16; ++g) {
        scale16[g] = sm[g / 2];
        m16[g] = sm[8 + g / 2];
      }
      d = half_to_float(b->d);
      dm = -half_to_float(b->dmin);
    }
    int32_t isum = 0, offset = 0;
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < QK; ++l) {
        isum += scale16[2 * j + l / 16] * k_value(qtype, blk, j, l) * a[32 * j + l];
      }
    }
    for (int g = 0; g < 16; ++g) offset += m16[g] * bsums[g];
    const float da = xq.d[r * xq.nsb + sb];
    total += static_cast<float>(isum) * (d * da) + static_cast<float>(offset) * (dm * da);
  }
  return total;
}

template <typename T>
void quantize_q8k_portable(const T* x, int64_t rows, Q8KRows& out) {
  at::parallel_for(0, rows * out.nsb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* src = x + i * QK_K;
      float amax = 0.f;
      for (int j = 0; j < QK_K; ++j) amax = std::max(amax, std::fabs(to_float(src[j])));
      const float d = amax / 127.f, id = d >= FLT_MIN ? 1.f / d : 0.f;
      out.d[i] = d;
      for (int g = 0; g < 16; ++g) {
        int sum = 0;
        for (int l = 16 * g; l < 16 * g + 16; ++l) {
          const int q = static_cast<int>(std::nearbyint(to_float(src[l]) * id));
          out.q[i * QK_K + l] = static_cast<int8_t>(q);
          sum += q;
        }
        out.bsums[16 * i + g] = static_cast<int16_t>(sum);
      }
    }
  });
}

template <typename T>
void quantize_q8k(const T* x, int64_t rows, Q8KRows& out) {
#if defined(__AVX2__)
  quantize_q8k_avx2(x, rows, out);
#else
  quantize_q8k_portable(x, rows, out);
#endif
}

}  // namespace

Q8KRows quantize_rows_q8k(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), nsb = k / QK_K;
  Q8KRows out{k, nsb, std::vector<int8_t>(rows * k), std::vector<float>(rows * nsb),
              std::vector<int16_t>(rows * nsb * 16)};
  if (x.scalar_type() == at::kBFloat16) {
    quantize_q8k(x.data_ptr<at::BFloat16>(), rows, out);
  } else {
    quantize_q8k(x.data_ptr<float>(), rows, out);
  }
  return out;
}

void k_quant_rows_range(int64_t qtype, const uint8_t* w, int64_t begin, int64_t end,
                        const Q8KRows& xq, int64_t r0, int64_t rows, float* out, int64_t ldo) {
#if defined(__AVX2__)
  switch (qtype) {
    case Q4_K: return range_avx2<Q4_K>(w, begin, end, xq, r0, rows, out, ldo);
    case Q5_K: return range_avx2<Q5_K>(w, begin, end, xq, r0, rows, out, ldo);
    case Q6_K: return range_avx2<Q6_K>(w, begin, end, xq, r0, rows, out, ldo);
  }
  TORCH_CHECK(false, "unsupported quantized type ", qtype);
#else
  const int64_t row_bytes = xq.nsb * block_bytes(qtype);
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t r = 0; r < rows; ++r) {
      out[r * ldo + o] = row_dot_portable(qtype, w + o * row_bytes, xq, r0 + r);
    }
  }
#endif
}

void k_quant_rows(int64_t qtype, const uint8_t* w, int64_t n, const Q8KRows& xq, int64_t rows,
                  float* out, int64_t ldo) {
#if defined(__AVX2__)
  if (rows > 1) {  // threads split whole weight tiles
    const int64_t tiles = (n + TILE_WEIGHTS - 1) / TILE_WEIGHTS;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      k_quant_rows_range(qtype, w, begin * TILE_WEIGHTS, std::min(n, end * TILE_WEIGHTS), xq, 0,
                         rows, out, ldo);
    });
    return;
  }
#endif
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    k_quant_rows_range(qtype, w, begin, end, xq, 0, rows, out, ldo);
  });
}

}  // namespace quant
