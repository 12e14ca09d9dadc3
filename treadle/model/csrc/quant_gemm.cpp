// The integer GEMM of steps with many rows (prefill chunks, large decode batches) over GGUF
// blocks as stored, without a dense copy. Each thread takes PANEL weight rows at a time (16 on
// AVX-512, 8 on AVX2) and repacks them for the call into a buffer that stays in cache: per 32
// weights, 8 vectors of [PANEL rows x 4 weights] as unsigned bytes, then each row's float scale
// and offset (w = scale q + offset; a scale per 16 for Q6_K). Every activation row then meets
// the panel with one dot-product instruction per 4 weights of PANEL rows (VNNI's dpbusd; AVX2's
// maddubs, its 16-bit sums widened by one madd per several vectors) into a vector of the rows'
// sums, so that a block's float work (convert, scale, offset) is shared by PANEL outputs instead
// of repeated per output as in the row-by-row kernels. On AVX2 the K-quants' panels keep
// integer scales instead and a super-block's sums stay in integers (pack_k_panel, k_tile). Activations are
// the row kernels' (quant_linear.cpp's per-32 blocks, quant_kblocks.cpp's Q8_K per 256); the
// 32-wide types' outputs are the row kernels' bits, the K-quants' differ from theirs in float
// rounding.
#include "quant_blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace quant {

#if defined(__AVX2__)
namespace {

// A panel is as many weight rows as a vector has int32 lanes: 16 with AVX-512 (512-bit dot
// products, twice the 256-bit ones' rate: docs/decisions.md), else 8. A tile
// takes TILE_ROWS activation rows: 3 accumulators a row stay in the 32 or 16 vector registers.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int PANEL = 16;
constexpr int TILE_ROWS = 6;
using VecI = __m512i;
using VecF = __m512;
inline VecI zero_i() { return _mm512_setzero_si512(); }
inline VecF zero_f() { return _mm512_setzero_ps(); }
inline VecI load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VecF load_f(const float* p) { return _mm512_loadu_ps(p); }
inline VecI splat_i(int32_t v) { return _mm512_set1_epi32(v); }
inline VecF splat_f(float v) { return _mm512_set1_ps(v); }
inline VecF to_float(VecI v) { return _mm512_cvtepi32_ps(v); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline void store_f(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline __m256 low_half(VecF v) { return _mm512_castps512_ps256(v); }
inline __m256 high_half(VecF v) { return _mm512_extractf32x8_ps(v, 1); }
// A tile sums a slot's 4-weight products in partial sums (add_products), then adds those to
// int32 lanes (widen) every partial_words<MAX_Q>() vectors. VNNI's dpbusd sums in int32 at once.
inline VecI add_products(VecI partial, VecI u8, VecI s8) {
  return _mm512_dpbusd_epi32(partial, u8, s8);
}
inline VecI widen(VecI acc, VecI partial) { return _mm512_add_epi32(acc, partial); }
template <int MAX_Q> constexpr int partial_words() { return 8; }
#else
constexpr int PANEL = 8;
constexpr int TILE_ROWS = 3;
// A K tile's 4 rows of accumulators, int32 sums and 16-bit partials (12 vectors) with the
// weights, a scale and a broadcast fit the 16 registers.
constexpr int K_TILE_ROWS = 4;
using VecI = __m256i;
using VecF = __m256;
inline VecI zero_i() { return _mm256_setzero_si256(); }
inline VecF zero_f() { return _mm256_setzero_ps(); }
inline VecI load_i(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VecF load_f(const float* p) { return _mm256_loadu_ps(p); }
inline VecI splat_i(int32_t v) { return _mm256_set1_epi32(v); }
inline VecF splat_f(float v) { return _mm256_set1_ps(v); }
inline VecF to_float(VecI v) { return _mm256_cvtepi32_ps(v); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline void store_f(float* p, VecF v) { _mm256_storeu_ps(p, v); }
// AVX2: maddubs's 16-bit pair sums added in 16 bits, one madd widening several vectors' worth:
// half the multiplier-port instructions of a madd per maddubs. A pair sum is at most
// 2 x MAX_Q x 128 (an activation is -128 at worst), so partial_words of them stay below 2^15.
// The adds stay a chain (in_order).
inline VecI add_products(VecI partial, VecI u8, VecI s8) {
  return in_order(_mm256_add_epi16(partial, _mm256_maddubs_epi16(u8, s8)));
}
inline VecI widen(VecI acc, VecI partial) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(partial, _mm256_set1_epi16(1)));
}
template <int MAX_Q> constexpr int partial_words() {
  static_assert(2 * MAX_Q * 128 <= 32767, "maddubs's pair sums would saturate");
  int words = 8;
  while (words > 1 && words * 2 * MAX_Q * 128 > 32767) words /= 2;
  return words;
}
#endif
constexpr int VEC_BYTES = PANEL * 4;

// A vector of PANEL outputs at `out`, or its first `count` lanes.
inline void store_out(float* out, VecF v, int count) {
  if (count == PANEL) return store_f(out, v);
  float lanes[PANEL];
  store_f(lanes, v);
  std::memcpy(out, lanes, count * sizeof(float));
}

inline void store_out(at::BFloat16* out, VecF v, int count) {
  __m128i halves[PANEL / 8];
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  halves[0] = to_bf16(low_half(v));
  halves[1] = to_bf16(high_half(v));
#else
  halves[0] = to_bf16(v);
#endif
  if (count == PANEL) {
    for (int h = 0; h < PANEL / 8; ++h) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * h), halves[h]);
    }
    return;
  }
  std::memcpy(out, halves, count * sizeof(at::BFloat16));
}

// What packing needs of a block type: its UNITS units of 32 weights (one block, or a K-quant's
// 8 sub-blocks) and the scale and offset of each of a unit's SLOTS scale slots (w = scale q +
// offset): a 32-wide type's for 8 rows at once (scale_rows), a K-quant's a block at a time as
// vectors of 8, entry j SLOTS + slot (scale_vectors: AVX-512's tiles; AVX2's K panels take
// KScales' integer scales instead). A 32-wide type also gives a block's
// weights as unsigned bytes q (values); the K-quants' come from their chunk layouts below.
template <int64_t QTYPE> struct Unit;

// A 32-wide type's scales and offsets for 8 rows (scale_rows) from the first 4 bytes of each
// row's block: d, and m for Q4_1.
template <> struct Unit<Q4_0> {  // w = d (q - 8)
  static constexpr int UNITS = 1, SLOTS = 1, MAX_Q = 15;
  static void scale_rows(__m256i head, __m256* s, __m256* o) {
    block32_scales<Q4_0>(head, s, o);
  }
  static __m256i values(const uint8_t* blk, int) {
    return unpack_nibbles(reinterpret_cast<const BlockQ4_0*>(blk)->qs);
  }
};

template <> struct Unit<Q4_1> {  // w = d q + m
  static constexpr int UNITS = 1, SLOTS = 1, MAX_Q = 15;
  static void scale_rows(__m256i head, __m256* s, __m256* o) {
    block32_scales<Q4_1>(head, s, o);
  }
  static __m256i values(const uint8_t* blk, int) {
    return unpack_nibbles(reinterpret_cast<const BlockQ4_1*>(blk)->qs);
  }
};

template <> struct Unit<Q5_0> {  // w = d (q - 16)
  static constexpr int UNITS = 1, SLOTS = 1, MAX_Q = 31;
  static void scale_rows(__m256i head, __m256* s, __m256* o) {
    block32_scales<Q5_0>(head, s, o);
  }
  static __m256i values(const uint8_t* blk, int) {
    const auto* b = reinterpret_cast<const BlockQ5_0*>(blk);
    const __m256i high = _mm256_and_si256(bytes_from_bits(b->qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(unpack_nibbles(b->qs), high);
  }
};

template <> struct Unit<Q8_0> {  // w = d (q' - 128), q' = q + 128 as unsigned bytes
  static constexpr int UNITS = 1, SLOTS = 1, MAX_Q = 255;
  static void scale_rows(__m256i head, __m256* s, __m256* o) {
    block32_scales<Q8_0>(head, s, o);
  }
  static __m256i values(const uint8_t* blk, int) {
    const __m256i q = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(reinterpret_cast<const BlockQ8_0*>(blk)->qs));
    return _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
};

// Q4_K / Q5_K sub-block j: w = d scale_j q - dmin min_j.
template <int64_t QTYPE> struct UnitK45 {
  static constexpr int UNITS = 8, SLOTS = 1, MAX_Q = QTYPE == Q4_K ? 15 : 31;
  using Block = std::conditional_t<QTYPE == Q4_K, BlockQ4_K, BlockQ5_K>;
  static void scale_vectors(const uint8_t* blk, __m256* s, __m256* o) {
    const auto* b = reinterpret_cast<const Block*>(blk);
    alignas(16) uint8_t sm[16];
    k4_scales_mins(b->scales, sm);
    const __m128i bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(sm));
    s[0] = _mm256_mul_ps(_mm256_set1_ps(half_to_float(b->d)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
    o[0] = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(b->dmin)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
  }
};
template <> struct Unit<Q4_K> : UnitK45<Q4_K> {};
template <> struct Unit<Q5_K> : UnitK45<Q5_K> {};

template <> struct Unit<Q6_K> {  // w = d scale (q - 32), a scale per 16
  static constexpr int UNITS = 8, SLOTS = 2, MAX_Q = 63;
  static void scale_vectors(const uint8_t* blk, __m256* s, __m256* o) {
    const auto* b = reinterpret_cast<const BlockQ6_K*>(blk);
    const __m256 d = _mm256_set1_ps(half_to_float(b->d));
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
    for (int v = 0; v < 2; ++v) {
      const __m128i eight = v ? _mm_srli_si128(scales, 8) : scales;
      s[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)));
      o[v] = _mm256_mul_ps(_mm256_set1_ps(-32.f), s[v]);
    }
  }
};

template <int SLOTS>
constexpr int64_t unit_bytes() { return 8 * VEC_BYTES + SLOTS * 2 * PANEL * sizeof(float); }

// An 8 x 8 transpose of 32-bit words: out[g] = word g of each of the 8 rows.
inline void transpose8(const __m256i* r, __m256i* out) {
  __m256i t[8], v[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    v[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int g = 0; g < 4; ++g) {
    out[g] = _mm256_permute2x128_si256(v[g], v[g + 4], 0x20);
    out[g + 4] = _mm256_permute2x128_si256(v[g], v[g + 4], 0x31);
  }
}

// How packing reads a group of BLOCKS blocks: CHUNKS vectors of 32 bytes loaded from the group
// (chunk), and word g of unit j computed from the chunks' words (word; t[8 c + g'] is word g' of
// chunk c). The unit's bytes are computed from the chunks' bytes one by one, so the chunks of 8
// rows can be transposed first and the units computed on the transposed words: units that share
// a chunk (a K-quant's low and high nibbles, two 32-wide blocks' 16 bytes) share its transpose.
template <int64_t QTYPE> struct PerUnit {  // each unit its own chunk: its bytes as Unit gives them
  static constexpr int BLOCKS = 1, CHUNKS = Unit<QTYPE>::UNITS;
  static __m256i chunk(const uint8_t* group, int c) { return Unit<QTYPE>::values(group, c); }
  static __m256i word(const __m256i* t, int j, int g) { return t[8 * j + g]; }
};

inline __m256i nibble_word(__m256i v, bool high) {
  return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

// Q4_0 / Q4_1: two blocks' 16 bytes of nibbles in one chunk; byte l holds weights l (low) and
// l + 16 (high), so unit j's word g < 4 is the low nibbles of its word g, word g >= 4 the high
// nibbles of its word g - 4.
template <int64_t QTYPE> struct NibblePairs {
  using Block = std::conditional_t<QTYPE == Q4_0, BlockQ4_0, BlockQ4_1>;
  static constexpr int BLOCKS = 2, CHUNKS = 1;
  static __m256i chunk(const uint8_t* group, int) {
    const auto* b = reinterpret_cast<const Block*>(group);
    return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b[1].qs),
                               reinterpret_cast<const __m128i*>(b[0].qs));
  }
  static __m256i word(const __m256i* t, int j, int g) { return nibble_word(t[4 * j + g % 4], g >= 4); }
};

// Q4_K / Q5_K: sub-blocks 2c and 2c + 1 in the low and high nibbles of chunk c of qs; Q5_K's
// fifth bits, bit j of qh's bytes, a chunk of their own (the last).
template <int64_t QTYPE> struct KNibbles {
  using Block = std::conditional_t<QTYPE == Q4_K, BlockQ4_K, BlockQ5_K>;
  static constexpr int BLOCKS = 1, CHUNKS = QTYPE == Q5_K ? 5 : 4;
  static __m256i chunk(const uint8_t* group, int c) {
    const auto* b = reinterpret_cast<const Block*>(group);
    if constexpr (QTYPE == Q5_K) {
      if (c == 4) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh));
    }
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * c));
  }
  static __m256i word(const __m256i* t, int j, int g) {
    const __m256i q = nibble_word(t[8 * (j / 2) + g], j % 2);
    if constexpr (QTYPE == Q5_K) {
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(t[32 + g], _mm_cvtsi32_si128(j)),
                                           _mm256_set1_epi8(1));
      return _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
  }
};

// Q6_K: sub-block j = 4 h + s takes the low (s < 2) or high nibbles of ql chunk 2 h + s % 2 and
// bits 2 s of qh chunk h (chunks 4 and 5).
struct Q6Chunks {
  static constexpr int BLOCKS = 1, CHUNKS = 6;
  static __m256i chunk(const uint8_t* group, int c) {
    const auto* b = reinterpret_cast<const BlockQ6_K*>(group);
    const uint8_t* at = c < 4 ? b->ql + 32 * c : b->qh + 32 * (c - 4);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  }
  static __m256i word(const __m256i* t, int j, int g) {
    const int h = j / 4, sub = j % 4;
    const __m256i low = nibble_word(t[8 * (2 * h + sub % 2) + g], sub >= 2);
    const __m256i high = _mm256_and_si256(
        _mm256_srl_epi16(t[8 * (4 + h) + g], _mm_cvtsi32_si128(2 * sub)), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
};

template <int64_t QTYPE> struct Layout { using type = PerUnit<QTYPE>; };
template <> struct Layout<Q4_0> { using type = NibblePairs<Q4_0>; };
template <> struct Layout<Q4_1> { using type = NibblePairs<Q4_1>; };
template <> struct Layout<Q4_K> { using type = KNibbles<Q4_K>; };
template <> struct Layout<Q5_K> { using type = KNibbles<Q5_K>; };
template <> struct Layout<Q6_K> { using type = Q6Chunks; };

// The weights of blocks [blk0, blk0 + L::BLOCKS) of the `count` (<= PANEL; the others zero)
// weight rows at w as unsigned bytes, unit j's at first + j unit_stride: 8 vectors of 4
// weights of the panel's rows (vector g holds weights 4g..4g+3 of each row).
template <int64_t QTYPE, typename L>
void pack_values(const uint8_t* w, int64_t row_bytes, int count, int64_t blk0, uint8_t* first,
                 int64_t unit_stride) {
  const int64_t bb = block_bytes(QTYPE);
  for (int half = 0; half < PANEL / 8; ++half) {  // rows 8 half .. 8 half + 7
    __m256i t[8 * L::CHUNKS];
    for (int c = 0; c < L::CHUNKS; ++c) {
      __m256i raw[8];
      for (int r = 0; r < 8; ++r) {
        const int i = 8 * half + r;
        raw[r] = i < count ? L::chunk(w + i * row_bytes + blk0 * bb, c) : _mm256_setzero_si256();
      }
      transpose8(raw, t + 8 * c);
    }
    for (int j = 0; j < L::BLOCKS * Unit<QTYPE>::UNITS; ++j) {
      uint8_t* dst = first + j * unit_stride + 32 * half;
      for (int g = 0; g < 8; ++g) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + g * VEC_BYTES), L::word(t, j, g));
      }
    }
  }
}

// The units of blocks [blk0, blk0 + L::BLOCKS) of the `count` (<= PANEL; the others zero)
// weight rows at w, packed: per unit, the 8 vectors of 4 weights of the panel's rows (vector g
// holds weights 4g..4g+3 of each row), then per slot the rows' scales and offsets.
template <int64_t QTYPE, typename L>
void pack_group(const uint8_t* w, int64_t row_bytes, int count, int64_t blk0, uint8_t* panel) {
  using U = Unit<QTYPE>;
  constexpr int64_t bytes = unit_bytes<U::SLOTS>();
  const int64_t bb = block_bytes(QTYPE);
  for (int b = 0; b < L::BLOCKS; ++b) {
    // Unit j's scale slots: PANEL floats of scales, then of offsets, a slot.
    auto slots = [&](int j) {
      return reinterpret_cast<float*>(panel + ((blk0 + b) * U::UNITS + j) * bytes +
                                      8 * VEC_BYTES);
    };
    const uint8_t* blk = w + (blk0 + b) * bb;
    if constexpr (U::UNITS == 1) {  // gathered from 8 rows at a time
      float* to = slots(0);
      const __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                              _mm256_set1_epi32(static_cast<int>(row_bytes)));
      for (int half = 0; half < PANEL / 8; ++half) {
        const __m256i present = _mm256_cmpgt_epi32(_mm256_set1_epi32(count - 8 * half),
                                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256i head = _mm256_mask_i32gather_epi32(
            _mm256_setzero_si256(), reinterpret_cast<const int*>(blk + 8 * half * row_bytes),
            rows, present, 1);
        __m256 scale, offset;
        U::scale_rows(head, &scale, &offset);
        _mm256_storeu_ps(to + 8 * half, scale);
        _mm256_storeu_ps(to + PANEL + 8 * half, offset);
      }
    } else {  // 8 rows' vectors of 8 entries transposed into 8 entries' vectors of 8 rows
      constexpr int VECTORS = U::UNITS * U::SLOTS / 8;
      for (int half = 0; half < PANEL / 8; ++half) {
        __m256 s[8][VECTORS], o[8][VECTORS];
        for (int r = 0; r < 8; ++r) {
          const int i = 8 * half + r;
          if (i < count) {
            U::scale_vectors(blk + i * row_bytes, s[r], o[r]);
          } else {
            for (int v = 0; v < VECTORS; ++v) s[r][v] = o[r][v] = _mm256_setzero_ps();
          }
        }
        for (int v = 0; v < VECTORS; ++v) {
          for (int which = 0; which < 2; ++which) {
            __m256i rows[8], entries[8];
            for (int r = 0; r < 8; ++r) rows[r] = _mm256_castps_si256(which ? o[r][v] : s[r][v]);
            transpose8(rows, entries);
            for (int e = 0; e < 8; ++e) {
              const int entry = 8 * v + e, j = entry / U::SLOTS, slot = entry % U::SLOTS;
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(
                  slots(j) + slot * 2 * PANEL + which * PANEL + 8 * half), entries[e]);
            }
          }
        }
      }
    }
  }
  pack_values<QTYPE, L>(w, row_bytes, count, blk0, panel + blk0 * U::UNITS * bytes, bytes);
}

// Bytes [begin, end) of each of the `count` rows at `rows` prefetched into L2: a panel reads 8
// or 16 rows at once, which the hardware prefetcher alone left waiting on memory
// (docs/decisions.md), so packing a panel fetches the thread's next one meanwhile.
inline void prefetch_rows(const uint8_t* rows, int64_t row_bytes, int count, int64_t begin,
                          int64_t end) {
  for (int i = 0; i < count; ++i) {
    const auto first = reinterpret_cast<uintptr_t>(rows + i * row_bytes + begin);
    const uintptr_t last = first + (end - begin);
    for (uintptr_t line = first & ~uintptr_t{63}; line < last; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
    }
  }
}

// The `count` weight rows at w, every unit packed (pack_group), the `next_count` rows that
// follow prefetched.
template <int64_t QTYPE>
void pack_panel(const uint8_t* w, int64_t row_bytes, int count, int64_t units, uint8_t* panel,
                int next_count) {
  using L = typename Layout<QTYPE>::type;
  const int64_t blocks = units / Unit<QTYPE>::UNITS, bb = block_bytes(QTYPE);
  const uint8_t* next = w + PANEL * row_bytes;
  int64_t blk = 0;
  for (; blk + L::BLOCKS <= blocks; blk += L::BLOCKS) {
    prefetch_rows(next, row_bytes, next_count, blk * bb, (blk + L::BLOCKS) * bb);
    pack_group<QTYPE, L>(w, row_bytes, count, blk, panel);
  }
  if constexpr (L::BLOCKS > 1) {  // an odd block left of a pair layout
    for (; blk < blocks; ++blk) {
      prefetch_rows(next, row_bytes, next_count, blk * bb, (blk + 1) * bb);
      pack_group<QTYPE, PerUnit<QTYPE>>(w, row_bytes, count, blk, panel);
    }
  }
}

// Activation rows as the panel tile reads them: int8 values, a scale per `group` values, and
// each slot's sum of values in units of that scale (the offsets multiply it).
struct PanelRows {
  const int8_t* q;
  int64_t k;
  const float* d;
  int64_t groups;             // scales a row
  std::vector<float> sums;    // [rows, slots]
  int64_t slots;              // slots a row
};

// Partial sums of R activation rows (row r's unit of values at x + r k) over 4-weight words
// [g0, g0 + PARTIAL) of the unit whose weight vectors start at `unit`.
template <int R, int PARTIAL>
inline void unit_partials(const uint8_t* unit, const int8_t* x, int64_t k, int g0,
                          VecI* partial) {
  for (int r = 0; r < R; ++r) partial[r] = zero_i();
#pragma GCC unroll 8
  for (int g = g0; g < g0 + PARTIAL; ++g) {
    const VecI wv = load_i(unit + g * VEC_BYTES);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * k + 4 * g, sizeof(four));
      partial[r] = add_products(partial[r], wv, splat_i(four));
    }
  }
}

// out[r * ldo + i] for R activation rows from r0 and the panel's PANEL rows; UNITS_PER_GROUP units
// (32 values each) share an activation scale.
template <int SLOTS, int UNITS_PER_GROUP, int PARTIAL, int R, typename Out>
void panel_tile(const uint8_t* panel, int64_t units, const PanelRows& a, int64_t r0, Out* out,
                int64_t ldo, int count) {
  constexpr int64_t bytes = unit_bytes<SLOTS>();
  constexpr int WORDS = 8 / SLOTS;  // 4-weight vectors a slot
  static_assert(WORDS % PARTIAL == 0);
  VecF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero_f();
  for (int64_t u0 = 0; u0 < units; u0 += UNITS_PER_GROUP) {
    VecF part[R];
    for (int r = 0; r < R; ++r) part[r] = zero_f();
    for (int64_t u = u0; u < u0 + UNITS_PER_GROUP; ++u) {
      const uint8_t* unit = panel + u * bytes;
      const float* scales = reinterpret_cast<const float*>(unit + 8 * VEC_BYTES);
#pragma GCC unroll 2
      for (int slot = 0; slot < SLOTS; ++slot) {
        VecI dot[R];
        for (int r = 0; r < R; ++r) dot[r] = zero_i();
#pragma GCC unroll 8
        for (int g0 = slot * WORDS; g0 < (slot + 1) * WORDS; g0 += PARTIAL) {
          VecI partial[R];
          unit_partials<R, PARTIAL>(unit, a.q + r0 * a.k + 32 * u, a.k, g0, partial);
          for (int r = 0; r < R; ++r) dot[r] = widen(dot[r], partial[r]);
        }
        const VecF scale = load_f(scales + slot * 2 * PANEL);
        const VecF offset = load_f(scales + slot * 2 * PANEL + PANEL);
        for (int r = 0; r < R; ++r) {
          const float sum = a.sums[(r0 + r) * a.slots + u * SLOTS + slot];
          part[r] = fma(to_float(dot[r]), scale, part[r]);
          part[r] = fma(offset, splat_f(sum), part[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float d = a.d[(r0 + r) * a.groups + u0 / UNITS_PER_GROUP];
      acc[r] = fma(part[r], splat_f(d), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_out(out + r * ldo, acc[r], count);
}

template <int SLOTS, int UNITS_PER_GROUP, int PARTIAL, typename Out, int R = TILE_ROWS>
void panel_rows(const uint8_t* panel, int64_t units, const PanelRows& a, int64_t r0,
                int64_t rows, Out* out, int64_t ldo, int count) {
  if constexpr (R > 1) {
    if (rows < R) {
      return panel_rows<SLOTS, UNITS_PER_GROUP, PARTIAL, Out, R - 1>(panel, units, a, r0, rows,
                                                                     out, ldo, count);
    }
  }
  panel_tile<SLOTS, UNITS_PER_GROUP, PARTIAL, R>(panel, units, a, r0, out, ldo, count);
}

// Threads split the n weight rows into panels; a thread packs each of its panels into a buffer
// of its own (pack(p, count, next_count, buffer): panel p's `count` rows, the next panel's
// `next_count`), then runs the tiles of every activation row over it (tiles(p, count, buffer)).
template <typename Pack, typename Tiles>
void for_each_panel(int64_t n, int64_t panel_bytes, const Pack& pack, const Tiles& tiles) {
  at::parallel_for(0, (n + PANEL - 1) / PANEL, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> panel;
    panel.resize(panel_bytes);
    for (int64_t p = begin; p < end; ++p) {
      const int count = static_cast<int>(std::min<int64_t>(PANEL, n - p * PANEL));
      const int next_count =
          p + 1 < end ? static_cast<int>(std::min<int64_t>(PANEL, n - (p + 1) * PANEL)) : 0;
      pack(p, count, next_count, panel.data());
      tiles(p, count, panel.data());
    }
  });
}

template <int64_t QTYPE, int UNITS_PER_GROUP, typename Out>
void gemm(const uint8_t* w, int64_t n, const PanelRows& a, int64_t rows, Out* out,
          int64_t ldo) {
  constexpr int SLOTS = Unit<QTYPE>::SLOTS;
  constexpr int PARTIAL = std::min(8 / SLOTS, partial_words<Unit<QTYPE>::MAX_Q>());
  const int64_t units = a.k / QK, row_bytes = a.k / block_weights(QTYPE) * block_bytes(QTYPE);
  for_each_panel(
      n, units * unit_bytes<SLOTS>(),
      [&](int64_t p, int count, int next_count, uint8_t* panel) {
        pack_panel<QTYPE>(w + p * PANEL * row_bytes, row_bytes, count, units, panel, next_count);
      },
      [&](int64_t p, int count, const uint8_t* panel) {
        for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
          panel_rows<SLOTS, UNITS_PER_GROUP, PARTIAL>(panel, units, a, r0,
                                                      std::min<int64_t>(TILE_ROWS, rows - r0),
                                                      out + r0 * ldo + p * PANEL, ldo, count);
        }
      });
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
// AVX2's K-quant tiles keep a super-block's dot product in integers: maddubs's 16-bit partial
// sums are widened by a madd with each weight row's sub-block scale (6 or 8 bits) instead of
// with ones, and the offsets (Q4_K/Q5_K mins, Q6_K's -32) come from a madd of the rows' pairs
// of offset multipliers with the activation's pairs of sub-block sums; so the float work is a
// super-block's instead of each sub-block's, and a tile's accumulators fit the 16 registers.

// A K-quant super-block's integer scales and offset multipliers as 16 int16 in 8 words (Q4_K /
// Q5_K: scale pairs in words 0-3, min pairs in 4-7; Q6_K: its 16 scales, which are its offset
// multipliers too), and the float factors d and m of their sums:
// w . x = d x.d (sum_s scale_s dot_s) + m x.d (sum_s offset_s sum_s), a slot being 32 values
// (Q4_K/Q5_K) or 16 (Q6_K).
template <int64_t QTYPE> struct KScales;

template <int64_t QTYPE> struct KScales45 {  // w = d scale_j q - dmin min_j
  static constexpr int SCALES = 8;
  using Block = std::conditional_t<QTYPE == Q4_K, BlockQ4_K, BlockQ5_K>;
  static __m256i words(const uint8_t* blk, float* d, float* m) {
    const auto* b = reinterpret_cast<const Block*>(blk);
    alignas(16) uint8_t sm[16];
    k4_scales_mins(b->scales, sm);
    *d = half_to_float(b->d);
    *m = -half_to_float(b->dmin);
    return _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(sm)));
  }
};
template <> struct KScales<Q4_K> : KScales45<Q4_K> {};
template <> struct KScales<Q5_K> : KScales45<Q5_K> {};

template <> struct KScales<Q6_K> {  // w = d scale_s (q - 32), a scale per 16
  static constexpr int SCALES = 16;
  static __m256i words(const uint8_t* blk, float* d, float* m) {
    const auto* b = reinterpret_cast<const BlockQ6_K*>(blk);
    *d = half_to_float(b->d);
    *m = -32.f * *d;
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
  }
};

// A super-block's record in a K panel: its 8 units' value vectors (pack_values), a vector per
// scale slot of the rows' scales (each in both 16-bit halves of its row's lane), a vector per
// pair of slots of the rows' offset multipliers (the pair's in the two halves), d and m.
template <int64_t QTYPE> constexpr int64_t k_record_bytes() {
  constexpr int SCALES = KScales<QTYPE>::SCALES;
  return 64 * VEC_BYTES + (SCALES + SCALES / 2) * VEC_BYTES + 2 * PANEL * sizeof(float);
}

// The `count` weight rows at w, a record a super-block (k_record_bytes), the `next_count` rows
// that follow prefetched.
template <int64_t QTYPE>
void pack_k_panel(const uint8_t* w, int64_t row_bytes, int count, int64_t nsb, uint8_t* panel,
                  int next_count) {
  static_assert(PANEL == 8, "a panel's rows are one transpose8 of their scale words");
  constexpr int SCALES = KScales<QTYPE>::SCALES;
  const int64_t bb = block_bytes(QTYPE);
  const __m256i low = _mm256_set1_epi32(0xFFFF), high = _mm256_set1_epi32(-0x10000);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    prefetch_rows(w + PANEL * row_bytes, row_bytes, next_count, sb * bb, (sb + 1) * bb);
    uint8_t* record = panel + sb * k_record_bytes<QTYPE>();
    pack_values<QTYPE, typename Layout<QTYPE>::type>(w, row_bytes, count, sb, record,
                                                     8 * VEC_BYTES);
    auto* scales = reinterpret_cast<__m256i*>(record + 64 * VEC_BYTES);  // [SCALES]
    __m256i* pairs = scales + SCALES;                                    // [SCALES / 2]
    auto* dm = reinterpret_cast<float*>(pairs + SCALES / 2);             // [PANEL] d, then m
    __m256i words[8], lanes[8];  // 8 rows' words, then word p of each row
    for (int i = 0; i < PANEL; ++i) {
      dm[i] = dm[PANEL + i] = 0.f;
      words[i] = i < count ? KScales<QTYPE>::words(w + i * row_bytes + sb * bb, dm + i,
                                                   dm + PANEL + i)
                           : _mm256_setzero_si256();
    }
    transpose8(words, lanes);
    for (int p = 0; p < SCALES / 2; ++p) {  // scale pair p: slots 2p and 2p + 1
      _mm256_storeu_si256(scales + 2 * p, _mm256_or_si256(_mm256_and_si256(lanes[p], low),
                                                           _mm256_slli_epi32(lanes[p], 16)));
      _mm256_storeu_si256(scales + 2 * p + 1,
                          _mm256_or_si256(_mm256_and_si256(lanes[p], high),
                                          _mm256_srli_epi32(lanes[p], 16)));
      // Q4_K/Q5_K's offsets are the mins in words 4-7; Q6_K's are its scales.
      _mm256_storeu_si256(pairs + p, lanes[SCALES == 8 ? 4 + p : p]);
    }
  }
}

// Q8_K activation rows as a K tile reads them: values, a scale a super-block, and each scale
// slot's sum of values (int16: 32 or 16 values of at most 128).
struct KRows {
  const int8_t* q;
  int64_t k, nsb;
  const float* d;       // [rows, nsb]
  const int16_t* sums;  // [rows, nsb, SCALES]
};

// out[r * ldo + i] for R activation rows from r0 and the K panel's rows: a super-block's sums in
// int32, its float work once.
template <int64_t QTYPE, int R, typename Out>
void k_tile(const uint8_t* panel, const KRows& a, int64_t r0, Out* out, int64_t ldo,
            int count) {
  constexpr int SCALES = KScales<QTYPE>::SCALES, SLOTS = SCALES / 8, WORDS = 8 / SLOTS;
  constexpr int PARTIAL = std::min(WORDS, partial_words<Unit<QTYPE>::MAX_Q>());
  VecF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero_f();
  for (int64_t sb = 0; sb < a.nsb; ++sb) {
    const uint8_t* record = panel + sb * k_record_bytes<QTYPE>();
    const uint8_t* scales = record + 64 * VEC_BYTES;
    VecI dot[R];
    for (int r = 0; r < R; ++r) dot[r] = zero_i();
    for (int j = 0; j < 8; ++j) {
      const int8_t* x = a.q + r0 * a.k + 256 * sb + 32 * j;
#pragma GCC unroll 2
      for (int slot = 0; slot < SLOTS; ++slot) {
        const VecI scale = load_i(scales + (SLOTS * j + slot) * VEC_BYTES);
#pragma GCC unroll 8
        for (int g0 = slot * WORDS; g0 < (slot + 1) * WORDS; g0 += PARTIAL) {
          VecI partial[R];
          unit_partials<R, PARTIAL>(record + 8 * j * VEC_BYTES, x, a.k, g0, partial);
          for (int r = 0; r < R; ++r) {
            dot[r] = in_order(_mm256_add_epi32(dot[r], _mm256_madd_epi16(partial[r], scale)));
          }
        }
      }
    }
    const uint8_t* pairs = scales + SCALES * VEC_BYTES;
    VecI offset[R];
    for (int r = 0; r < R; ++r) offset[r] = zero_i();
    for (int p = 0; p < SCALES / 2; ++p) {
      const VecI multipliers = load_i(pairs + p * VEC_BYTES);
      for (int r = 0; r < R; ++r) {
        int32_t sums;
        std::memcpy(&sums, a.sums + ((r0 + r) * a.nsb + sb) * SCALES + 2 * p, sizeof(sums));
        offset[r] = in_order(
            _mm256_add_epi32(offset[r], _mm256_madd_epi16(multipliers, splat_i(sums))));
      }
    }
    const float* dm = reinterpret_cast<const float*>(pairs + SCALES / 2 * VEC_BYTES);
    const VecF d = load_f(dm), m = load_f(dm + PANEL);
    for (int r = 0; r < R; ++r) {
      const VecF sum = fma(to_float(offset[r]), m, _mm256_mul_ps(to_float(dot[r]), d));
      acc[r] = fma(sum, splat_f(a.d[(r0 + r) * a.nsb + sb]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_out(out + r * ldo, acc[r], count);
}

template <int64_t QTYPE, typename Out, int R = K_TILE_ROWS>
void k_rows(const uint8_t* panel, const KRows& a, int64_t r0, int64_t rows, Out* out,
            int64_t ldo, int count) {
  if constexpr (R > 1) {
    if (rows < R) return k_rows<QTYPE, Out, R - 1>(panel, a, r0, rows, out, ldo, count);
  }
  k_tile<QTYPE, R>(panel, a, r0, out, ldo, count);
}

template <int64_t QTYPE, typename Out>
void k_gemm(const uint8_t* w, int64_t n, const KRows& a, int64_t rows, Out* out, int64_t ldo) {
  const int64_t row_bytes = a.nsb * block_bytes(QTYPE);
  for_each_panel(
      n, a.nsb * k_record_bytes<QTYPE>(),
      [&](int64_t p, int count, int next_count, uint8_t* panel) {
        pack_k_panel<QTYPE>(w + p * PANEL * row_bytes, row_bytes, count, a.nsb, panel,
                            next_count);
      },
      [&](int64_t p, int count, const uint8_t* panel) {
        for (int64_t r0 = 0; r0 < rows; r0 += K_TILE_ROWS) {
          k_rows<QTYPE>(panel, a, r0, std::min<int64_t>(K_TILE_ROWS, rows - r0),
                        out + r0 * ldo + p * PANEL, ldo, count);
        }
      });
}
#endif

}  // namespace

std::vector<int64_t> panel_gemm_types() {
  if (Q8_0_GEMM) return {Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K};
  return {Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K};
}

template <typename Out>
void panel_gemm(int64_t qtype, const uint8_t* w, int64_t n, const QuantizedRows& xq,
                int64_t rows, Out* out, int64_t ldo) {
  PanelRows a{xq.q.data(), xq.k, xq.d.data(), xq.nb, std::vector<float>(rows * xq.nb), xq.nb};
  for (int64_t i = 0; i < rows * xq.nb; ++i) {
    a.sums[i] = qtype == Q8_0 ? offset_sum<Q8_0>(xq, i) : offset_sum<Q4_0>(xq, i);
  }
  switch (qtype) {
    case Q4_0: return gemm<Q4_0, 1>(w, n, a, rows, out, ldo);
    case Q4_1: return gemm<Q4_1, 1>(w, n, a, rows, out, ldo);
    case Q5_0: return gemm<Q5_0, 1>(w, n, a, rows, out, ldo);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case Q8_0: return gemm<Q8_0, 1>(w, n, a, rows, out, ldo);
#endif
  }
  TORCH_CHECK(false, "no integer GEMM for quantized type ", qtype);
}

template <typename Out>
void panel_gemm(int64_t qtype, const uint8_t* w, int64_t n, const Q8KRows& xq, int64_t rows,
                Out* out, int64_t ldo) {
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
  std::vector<int16_t> sums32;  // Q4_K/Q5_K's slots are 32 values, two of Q8_K's sums
  if (qtype != Q6_K) {
    sums32.resize(xq.bsums.size() / 2);
    for (size_t i = 0; i < sums32.size(); ++i) {
      sums32[i] = static_cast<int16_t>(xq.bsums[2 * i] + xq.bsums[2 * i + 1]);
    }
  }
  const KRows a{xq.q.data(), xq.k, xq.nsb, xq.d.data(),
                qtype == Q6_K ? xq.bsums.data() : sums32.data()};
  switch (qtype) {
    case Q4_K: return k_gemm<Q4_K>(w, n, a, rows, out, ldo);
    case Q5_K: return k_gemm<Q5_K>(w, n, a, rows, out, ldo);
    case Q6_K: return k_gemm<Q6_K>(w, n, a, rows, out, ldo);
  }
#else
  const int64_t per_block = qtype == Q6_K ? 16 : 8;  // slots a super-block: per 16 or per 32
  PanelRows a{xq.q.data(), xq.k, xq.d.data(), xq.nsb,
              std::vector<float>(rows * xq.nsb * per_block), xq.nsb * per_block};
  for (size_t i = 0; i < a.sums.size(); ++i) {
    a.sums[i] = per_block == 16 ? xq.bsums[i] : xq.bsums[2 * i] + xq.bsums[2 * i + 1];
  }
  switch (qtype) {
    case Q4_K: return gemm<Q4_K, 8>(w, n, a, rows, out, ldo);
    case Q5_K: return gemm<Q5_K, 8>(w, n, a, rows, out, ldo);
    case Q6_K: return gemm<Q6_K, 8>(w, n, a, rows, out, ldo);
  }
#endif
  TORCH_CHECK(false, "no integer GEMM for quantized type ", qtype);
}
#else
std::vector<int64_t> panel_gemm_types() { return {}; }

template <typename Out>
void panel_gemm(int64_t qtype, const uint8_t*, int64_t, const QuantizedRows&, int64_t, Out*,
                int64_t) {
  TORCH_CHECK(false, "no integer GEMM for quantized type ", qtype, " in this build");
}

template <typename Out>
void panel_gemm(int64_t qtype, const uint8_t*, int64_t, const Q8KRows&, int64_t, Out*,
                int64_t) {
  TORCH_CHECK(false, "no integer GEMM for quantized type ", qtype, " in this build");
}
#endif

template void panel_gemm(int64_t, const uint8_t*, int64_t, const QuantizedRows&, int64_t,
                         float*, int64_t);
template void panel_gemm(int64_t, const uint8_t*, int64_t, const QuantizedRows&, int64_t,
                         at::BFloat16*, int64_t);
template void panel_gemm(int64_t, const uint8_t*, int64_t, const Q8KRows&, int64_t, float*,
                         int64_t);
template void panel_gemm(int64_t, const uint8_t*, int64_t, const Q8KRows&, int64_t,
                         at::BFloat16*, int64_t);

}  // namespace quant
