// Decode attention straight from the paged KV cache: one query token per sequence, keys and
// values read through the block table (no padding to the longest context). With a window
// (sliding-window layers), only the last `window` positions are read: blocks wholly before
// them are skipped. An int8 cache (a float32 scale per slot and KV head beside it) is read as
// int8, half the bytes of bfloat16: a slot's lanes widened to float as bfloat16's are, each
// vector's scale applied to its heads' scores and softmax weights.
// With AVX2 and heads a whole number of 8-float vectors, a task first copies its slots out of
// their blocks (a block's slots are contiguous), then the query heads that share a KV head take
// each key and value vector in one load for all of them, scores four positions at a time,
// weighted values kept in registers over the task's positions (docs/decisions.md); where the
// CPU has AVX-512 BF16 and the cache is bfloat16, scores and weighted values are dot products
// of bfloat16 pairs, the softmax weights rounded to bfloat16 as the prefill tiles round them.
// A prefill chunk's attention (prefill_attention, AVX2 builds) takes tiles of (query, head)
// rows over keys rearranged once a call, each row's sums over its own keys in order.
#include "kernels.h"
#include "vec_math.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Positions a task attends to: a lone long sequence spreads over the threads, and smaller
// parts cost more merging than they gained (docs/decisions.md).
constexpr int64_t PART = 128;
// A head's scores in a task: PART and room past them (a bfloat16 pair's zero partner; 16
// keeps each head's row whole 64-byte lines).
constexpr int64_t SPAN = PART + 16;

// Widening loads the compiler can vectorize: bfloat16 is the top half of a float32.
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
// An int8 cache's lanes unscaled: each vector's scale multiplies its scores and weights instead
// (one multiply per head and position, not per element).
inline float to_float(int8_t x) { return static_cast<float>(x); }

// The largest of `count` scores (std::max_element stays scalar).
inline float max_of(const float* s, int64_t count) {
  float max = -INFINITY;
  int64_t pos = 0;
#if defined(__AVX2__)
  if (count >= 8) {
    __m256 max8 = _mm256_loadu_ps(s);
    for (pos = 8; pos + 8 <= count; pos += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(s + pos));
    max = hmax(max8);
  }
#endif
  for (; pos < count; ++pos) max = std::max(max, s[pos]);
  return max;
}

// s[i] = exp(s[i] - max) for `count` scores; returns their sum.
inline float exp_in_place(float* s, int64_t count, float max) {
  float total = 0.f;
  int64_t pos = 0;
#if defined(__AVX2__)
  __m256 sum8 = _mm256_setzero_ps();  // a vector exp: libm's stays scalar
  for (; pos + 8 <= count; pos += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + pos), _mm256_set1_ps(max)));
    _mm256_storeu_ps(s + pos, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  total = hsum(sum8);
#endif
  for (; pos < count; ++pos) {
    s[pos] = std::exp(s[pos] - max);
    total += s[pos];
  }
  return total;
}

// a . b. An `omp simd reduction` here compiled (GCC 12) to a store and 16 dependent scalar
// adds per dot; with a 64-bit division per head that cost ~1 us per position (9 heads, 64 wide,
// Xeon 2.0 GHz). Vector accumulators, then one horizontal sum.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  }
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  total = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#endif
#pragma omp simd reduction(+ : total)
  for (int64_t i = d; i < n; ++i) total += a[i] * b[i];
  return total;
}

#if defined(__AVX2__)
// 8 lanes of a cache row as floats: an int8 cache's unscaled (vec_math.h: float, bfloat16).
using ::load8;
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The four horizontal sums of a, b, c, d.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// scores[h stride + pos] = query h . keys[pos row ...], for `count` positions and the G query
// heads (queries head_dim apart) that share one KV head: each key vector is loaded and widened
// once for the G of them, four positions at a time, independent chains sharing each load.
template <int G, typename C>
void group_scores(const float* query, const C* keys, int64_t row, int64_t count,
                  int64_t head_dim, float* scores, int64_t stride) {
  int64_t pos = 0;
  for (; pos + 4 <= count; pos += 4) {
    const C* k[4];
    for (int p = 0; p < 4; ++p) k[p] = keys + (pos + p) * row;
    __m256 acc[G][4];
    for (int h = 0; h < G; ++h) {
      for (int p = 0; p < 4; ++p) acc[h][p] = _mm256_setzero_ps();
    }
    for (int64_t d = 0; d < head_dim; d += 8) {
      for (int p = 0; p < 4; ++p) {
        const __m256 key = load8(k[p] + d);
        for (int h = 0; h < G; ++h) {
          acc[h][p] = _mm256_fmadd_ps(_mm256_loadu_ps(query + h * head_dim + d), key, acc[h][p]);
        }
      }
    }
    for (int h = 0; h < G; ++h) {
      _mm_storeu_ps(scores + h * stride + pos,
                    hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
    }
  }
  for (; pos < count; ++pos) {
    const C* k = keys + pos * row;
    __m256 acc[G];
    for (int h = 0; h < G; ++h) acc[h] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 key = load8(k + d);
      for (int h = 0; h < G; ++h) {
        acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(query + h * head_dim + d), key, acc[h]);
      }
    }
    const __m256 z = _mm256_setzero_ps();
    for (int h = 0; h < G; ++h) scores[h * stride + pos] = _mm_cvtss_f32(hsum4(acc[h], z, z, z));
  }
}

// acc[h head_dim + (0, 8 NR)] += sum over positions of weight[h stride + pos] *
// values[pos row ...], for the G heads sharing one KV head: each value vector is loaded and
// widened once for the G of them. A lone head sums even and odd positions apart, so that its NR
// chains are 2 NR.
template <int G, int NR, typename C>
void group_values_chunk(const float* weight, const C* values, int64_t row, int64_t count,
                        int64_t head_dim, float* acc, int64_t stride) {
  constexpr int SETS = G == 1 ? 2 : 1;
  __m256 sums[SETS][G][NR];
  for (int h = 0; h < G; ++h) {
    for (int j = 0; j < NR; ++j) {
      sums[0][h][j] = _mm256_loadu_ps(acc + h * head_dim + 8 * j);
      if constexpr (SETS == 2) sums[1][h][j] = _mm256_setzero_ps();
    }
  }
  const auto add = [&](int set, int64_t pos) {
    const C* v = values + pos * row;
    __m256 w[G];
    for (int h = 0; h < G; ++h) w[h] = _mm256_set1_ps(weight[h * stride + pos]);
    for (int j = 0; j < NR; ++j) {
      const __m256 value = load8(v + 8 * j);
      for (int h = 0; h < G; ++h) sums[set][h][j] = _mm256_fmadd_ps(w[h], value, sums[set][h][j]);
    }
  };
  int64_t pos = 0;
  for (; pos + SETS <= count; pos += SETS) {
    for (int set = 0; set < SETS; ++set) add(set, pos + set);
  }
  if (pos < count) add(0, pos);
  for (int h = 0; h < G; ++h) {
    for (int j = 0; j < NR; ++j) {
      __m256 total = sums[0][h][j];
      if constexpr (SETS == 2) total = _mm256_add_ps(total, sums[1][h][j]);
      _mm256_storeu_ps(acc + h * head_dim + 8 * j, total);
    }
  }
}

// 32 lanes a pass: the sums (12 or 8 chains), the G weights and the value fit AVX2's 16
// registers.
template <int G, typename C>
void group_values(const float* weight, const C* values, int64_t row, int64_t count,
                  int64_t head_dim, float* acc, int64_t stride) {
  constexpr int NR_MAX = 4;
  for (int64_t d = 0; d < head_dim; d += 8 * NR_MAX) {
    const C* v = values + d;
    float* a = acc + d;
    switch (std::min<int64_t>(NR_MAX, (head_dim - d) / 8)) {
      case 1: group_values_chunk<G, 1>(weight, v, row, count, head_dim, a, stride); break;
      case 2: group_values_chunk<G, 2>(weight, v, row, count, head_dim, a, stride); break;
      case 3: group_values_chunk<G, 3>(weight, v, row, count, head_dim, a, stride); break;
      default: group_values_chunk<G, NR_MAX>(weight, v, row, count, head_dim, a, stride);
    }
  }
}

// Scores (values: FOR_VALUES) of every query head, the heads of each KV head in passes of at
// most 3 (the registers one pass holds), of 2 where that divides them (4: 2 + 2, not 3 + 1).
template <bool FOR_VALUES, typename C>
void all_heads(const float* in, const C* rows, int64_t row, int64_t count, int64_t head_dim,
               int64_t num_heads, int64_t group, float* out, int64_t stride) {
  const int64_t pass = group % 3 != 0 && group % 2 == 0 ? 2 : 3;
  for (int64_t h0 = 0; h0 < num_heads;) {
    const int64_t kv = h0 / group, g = std::min<int64_t>(pass, (kv + 1) * group - h0);
    const C* kv_rows = rows + kv * head_dim;
    const float* src = FOR_VALUES ? in + h0 * stride : in + h0 * head_dim;
    float* dst = FOR_VALUES ? out + h0 * head_dim : out + h0 * stride;
    if constexpr (FOR_VALUES) {
      if (g == 3) group_values<3>(src, kv_rows, row, count, head_dim, dst, stride);
      else if (g == 2) group_values<2>(src, kv_rows, row, count, head_dim, dst, stride);
      else group_values<1>(src, kv_rows, row, count, head_dim, dst, stride);
    } else {
      if (g == 3) group_scores<3>(src, kv_rows, row, count, head_dim, dst, stride);
      else if (g == 2) group_scores<2>(src, kv_rows, row, count, head_dim, dst, stride);
      else group_scores<1>(src, kv_rows, row, count, head_dim, dst, stride);
    }
    h0 += g;
  }
}
#endif

#if defined(__AVX512F__)
// AVX-512 BF16's dot product of bfloat16 pairs (more multiplies a cycle than float32 FMAs) for
// bfloat16 inputs; picked at run time, so the variant still runs on AVX-512 CPUs without it.
bool has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// group_scores over bfloat16 pairs: the G query heads' (unscaled bfloat16) dot products with
// `count` keys, times `scale`; head_dim a multiple of 16.
template <int G>
__attribute__((target("avx512bf16,avx512vl"))) void group_scores_bf16(
    const at::BFloat16* query, const at::BFloat16* keys, int64_t row, int64_t count,
    int64_t head_dim, float scale, float* scores, int64_t stride) {
  const __m128 scale4 = _mm_set1_ps(scale);
  const auto pairs = [](const at::BFloat16* p) {
    return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  int64_t pos = 0;
  for (; pos + 4 <= count; pos += 4) {
    __m256 acc[G][4];
    for (int h = 0; h < G; ++h) {
      for (int p = 0; p < 4; ++p) acc[h][p] = _mm256_setzero_ps();
    }
    for (int64_t d = 0; d < head_dim; d += 16) {
      __m256bh q[G];
      for (int h = 0; h < G; ++h) q[h] = pairs(query + h * head_dim + d);
      for (int p = 0; p < 4; ++p) {
        const __m256bh key = pairs(keys + (pos + p) * row + d);
        for (int h = 0; h < G; ++h) acc[h][p] = _mm256_dpbf16_ps(acc[h][p], q[h], key);
      }
    }
    for (int h = 0; h < G; ++h) {
      _mm_storeu_ps(scores + h * stride + pos,
                    _mm_mul_ps(hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), scale4));
    }
  }
  for (; pos < count; ++pos) {
    __m256 acc[G];
    for (int h = 0; h < G; ++h) acc[h] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m256bh key = pairs(keys + pos * row + d);
      for (int h = 0; h < G; ++h) {
        acc[h] = _mm256_dpbf16_ps(acc[h], pairs(query + h * head_dim + d), key);
      }
    }
    // hsum4's order, as the 4-position groups sum.
    const __m256 z = _mm256_setzero_ps();
    for (int h = 0; h < G; ++h) {
      scores[h * stride + pos] = _mm_cvtss_f32(hsum4(acc[h], z, z, z)) * scale;
    }
  }
}

// Each of `count` softmax weights rounded to bfloat16, packed over the first half of `s`'s
// bytes (16 floats are read before their 16 halves are written over the first 8), a zero after
// them; returns the sum of the rounded weights, so that they normalize exactly what they weigh.
__attribute__((target("avx512bf16,avx512vl"))) float round_weights_bf16(float* s,
                                                                       int64_t count) {
  s[count] = 0.f;  // an odd count's pair partner (a head's scores hold SPAN floats)
  uint16_t* w = reinterpret_cast<uint16_t*>(s);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t p = 0; p < count + 1; p += 16) {
    const __mmask16 present = static_cast<__mmask16>(
        (1u << std::min<int64_t>(16, count + 1 - p)) - 1);
    const __m256bh half = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(present, s + p));
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(
                                 _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)half), 16)));
    _mm256_mask_storeu_epi16(w + p, present, (__m256i)half);
  }
  return _mm512_reduce_add_ps(sum);
}

// group_values over bfloat16 pairs of positions: each dot product adds two positions' weighted
// values (their rows' lanes interleaved) to 8 lanes of a head; `weights` as round_weights_bf16
// leaves them, a head's `stride` floats apart. acc [G][head_dim] (head_dim a multiple of 16) is
// overwritten.
template <int G>
__attribute__((target("avx512bf16,avx512vl"))) void group_values_bf16(
    const float* weights, const at::BFloat16* values, int64_t row, int64_t count,
    int64_t head_dim, float* acc, int64_t stride) {
  for (int64_t d = 0; d < head_dim; d += 16) {
    // Interleaving 16 lanes of two rows gives dims 0-3, 8-11 (lo) and 4-7, 12-15 (hi).
    __m256 lo[G], hi[G];
    for (int h = 0; h < G; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
    for (int64_t pos = 0; pos < count; pos += 2) {
      const __m256i even = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(values + pos * row + d));
      const __m256i odd = pos + 1 < count ? _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(values + (pos + 1) * row + d)) : even;
      const __m256bh v_lo = (__m256bh)_mm256_unpacklo_epi16(even, odd);
      const __m256bh v_hi = (__m256bh)_mm256_unpackhi_epi16(even, odd);
      for (int h = 0; h < G; ++h) {
        int pair;  // the head's weights pos and pos + 1, read past the float type
        std::memcpy(&pair, reinterpret_cast<const char*>(weights + h * stride) + 2 * pos, 4);
        const __m256bh w = (__m256bh)_mm256_set1_epi32(pair);
        lo[h] = _mm256_dpbf16_ps(lo[h], w, v_lo);
        hi[h] = _mm256_dpbf16_ps(hi[h], w, v_hi);
      }
    }
    for (int h = 0; h < G; ++h) {
      float* a = acc + h * head_dim + d;
      _mm256_storeu_ps(a, _mm256_permute2f128_ps(lo[h], hi[h], 0x20));
      _mm256_storeu_ps(a + 8, _mm256_permute2f128_ps(lo[h], hi[h], 0x31));
    }
  }
}

// all_heads over bfloat16 pairs: scores (scaled) or weighted values of every query head.
template <bool FOR_VALUES>
void all_heads_bf16(const void* in, const at::BFloat16* rows, int64_t row, int64_t count,
                    int64_t head_dim, int64_t num_heads, int64_t group, float scale, float* out,
                    int64_t stride) {
  const int64_t pass = group % 3 != 0 && group % 2 == 0 ? 2 : 3;
  for (int64_t h0 = 0; h0 < num_heads;) {
    const int64_t kv = h0 / group, g = std::min<int64_t>(pass, (kv + 1) * group - h0);
    const at::BFloat16* kv_rows = rows + kv * head_dim;
    if constexpr (FOR_VALUES) {
      const float* w = static_cast<const float*>(in) + h0 * stride;
      float* dst = out + h0 * head_dim;
      if (g == 3) group_values_bf16<3>(w, kv_rows, row, count, head_dim, dst, stride);
      else if (g == 2) group_values_bf16<2>(w, kv_rows, row, count, head_dim, dst, stride);
      else group_values_bf16<1>(w, kv_rows, row, count, head_dim, dst, stride);
    } else {
      const at::BFloat16* q = static_cast<const at::BFloat16*>(in) + h0 * head_dim;
      float* dst = out + h0 * stride;
      if (g == 3) group_scores_bf16<3>(q, kv_rows, row, count, head_dim, scale, dst, stride);
      else if (g == 2) group_scores_bf16<2>(q, kv_rows, row, count, head_dim, scale, dst, stride);
      else group_scores_bf16<1>(q, kv_rows, row, count, head_dim, scale, dst, stride);
    }
    h0 += g;
  }
}
#endif

// T: the queries' and output's type; C: the cache's (T, bfloat16 under float queries, or int8_t
// with `k_scale_ptr`, `v_scale_ptr` [blocks, block_size, kv_heads], blocks
// `scale_block_stride` apart; else those are null and unread). Blocks k_cache.stride(0) apart.
template <typename T, typename C>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const float* k_scale_ptr,
                   const float* v_scale_ptr, int64_t scale_block_stride,
                   const at::Tensor& block_tables,
                   const at::Tensor& context_lens, double scale, int64_t window,
                   at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t row = num_kv_heads * head_dim;  // one slot: every KV head's vector, contiguous
  const int64_t block_stride = k_cache.stride(0);
  const T* q_ptr = q.data_ptr<T>();
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  const C* k_ptr = k_cache.data_ptr<C>();
  const C* v_ptr = v_cache.data_ptr<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
#if defined(__AVX2__)
  const bool vector_heads = head_dim % 8 == 0;  // every head a whole number of vectors
#endif
#if defined(__AVX512F__)
  const bool bf16_dot = std::is_same_v<T, at::BFloat16> && std::is_same_v<C, at::BFloat16> &&
                        head_dim % 16 == 0 && has_bf16_dot();
#endif

  // Tasks of at most PART positions of one sequence, all its heads: a lone long sequence (one
  // stream's decode) spreads over the threads, and each slot's keys and values (every KV head,
  // one contiguous row) are read from memory once. Each task keeps its heads' running max,
  // sum of exponentials and unnormalized weighted values; a second pass merges a sequence's
  // tasks in order, so a sequence's result depends on its length alone, not on the batch.
  // Consecutive sequences over the same blocks (a verifying step's rows of one sequence) take
  // their tasks part by part, so that a thread finds a part's slots already copied.
  const auto attended = [&](int64_t seq) {
    return window > 0 ? std::min(lens[seq], window) : lens[seq];
  };
  const auto same_blocks = [&](int64_t a, int64_t b) {  // b reads a's slots from position 0
    if (window > 0 && std::max(lens[a], lens[b]) > window) return false;
    const int64_t blocks = (std::min(lens[a], lens[b]) + block_size - 1) / block_size;
    return std::equal(tables + a * max_blocks, tables + a * max_blocks + blocks,
                      tables + b * max_blocks);
  };
  std::vector<int64_t> seq_first_task(num_seqs + 1, 0);  // a sequence's tasks: seq_tasks[...]
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    seq_first_task[seq + 1] = seq_first_task[seq] + (attended(seq) + PART - 1) / PART;
  }
  const int64_t num_tasks = seq_first_task[num_seqs];
  std::vector<int64_t> task_seq(num_tasks), task_part(num_tasks), seq_tasks(num_tasks);
  const auto parts_of = [&](int64_t seq) { return seq_first_task[seq + 1] - seq_first_task[seq]; };
  for (int64_t seq = 0, task = 0; seq < num_seqs;) {
    int64_t last = seq + 1, parts = parts_of(seq);  // sequences [seq, last) share their blocks
    for (; last < num_seqs && same_blocks(last - 1, last); ++last) {
      parts = std::max(parts, parts_of(last));
    }
    for (int64_t part = 0; part < parts; ++part) {
      for (int64_t s = seq; s < last; ++s) {
        if (part < parts_of(s)) {
          task_seq[task] = s;
          task_part[task] = part;
          seq_tasks[seq_first_task[s] + part] = task++;
        }
      }
    }
    seq = last;
  }
  std::vector<float> task_max(num_tasks * num_heads), task_sum(num_tasks * num_heads),
      task_acc(num_tasks * num_heads * head_dim);

  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(num_heads * head_dim), scores(num_heads * SPAN), slot_row(row);
    // Where each of the task's positions' row (and int8 scales) starts in the cache
    std::vector<int64_t> row_at(PART), scales_at(kInt8 ? PART : 0);
#if defined(__AVX2__)
    std::vector<int64_t> copied(PART);   // the rows in keys and values, by position
    int64_t copied_count = 0;
    // The task's keys and values, contiguous; kept by the thread (not zeroed per call).
    thread_local std::vector<C> keys, values;
    if (vector_heads && static_cast<int64_t>(keys.size()) < PART * row) {
      keys.resize(PART * row);
      values.resize(PART * row);
    }
#endif
    // Where each query head's KV head starts in a slot's row (a 64-bit division per head and
    // position was a fifth of the loop's time).
    std::vector<int64_t> kv_head(num_heads), kv_offset(num_heads);
    for (int64_t h = 0; h < num_heads; ++h) {
      kv_head[h] = h / group;
      kv_offset[h] = kv_head[h] * head_dim;
    }
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task_seq[task];
      const int64_t end_pos = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, end_pos - window) : 0;
      const int64_t len = end_pos - first;  // positions attended: first .. end_pos - 1
      // This task's positions, counted from `first`: [p0, p0 + count).
      const int64_t p0 = task_part[task] * PART, count = std::min(PART, len - p0);
      const int64_t* table = tables + seq * max_blocks;
      const T* q_seq = q_ptr + seq * num_heads * head_dim;
#if defined(__AVX512F__)
      if (!bf16_dot)  // the pairs' path reads q_seq as it is
#endif
      for (int64_t i = 0; i < num_heads * head_dim; ++i) query[i] = to_float(q_seq[i]) * fscale;
      for (int64_t pos = 0; pos < count; ++pos) {
        const int64_t abs_pos = first + p0 + pos;
        const int64_t block = table[abs_pos / block_size], offset = abs_pos % block_size;
        row_at[pos] = block * block_stride + offset * row;
        if constexpr (kInt8) scales_at[pos] = block * scale_block_stride + offset * num_kv_heads;
      }
#if defined(__AVX2__)
      if (vector_heads) {
        // Copied whole, runs of slots stream from memory (docs/decisions.md); the slots the
        // thread's last task copied to the same positions are there already.
        int64_t pos = 0;
        while (pos < std::min(count, copied_count) && copied[pos] == row_at[pos]) ++pos;
        std::copy(row_at.begin() + pos, row_at.begin() + count, copied.begin() + pos);
        copied_count = count;
        while (pos < count) {
          int64_t run = 1;  // positions in consecutive slots
          while (pos + run < count && row_at[pos + run] == row_at[pos] + run * row) ++run;
          std::memcpy(keys.data() + pos * row, k_ptr + row_at[pos], run * row * sizeof(C));
          std::memcpy(values.data() + pos * row, v_ptr + row_at[pos], run * row * sizeof(C));
          pos += run;
        }
#if defined(__AVX512F__)
        if (bf16_dot) {
          if constexpr (std::is_same_v<C, at::BFloat16>) {
            all_heads_bf16<false>(q_seq, keys.data(), row, count, head_dim, num_heads, group,
                                  fscale, scores.data(), SPAN);
          }
        } else
#endif
        all_heads<false>(query.data(), keys.data(), row, count, head_dim, num_heads, group,
                         scores.data(), SPAN);
        if constexpr (kInt8) {
          for (int64_t h = 0; h < num_heads; ++h) {
            for (int64_t pos = 0; pos < count; ++pos) {
              scores[h * SPAN + pos] *= k_scale_ptr[scales_at[pos] + kv_head[h]];
            }
          }
        }
      } else
#endif
      {
        for (int64_t pos = 0; pos < count; ++pos) {
          const C* key = k_ptr + row_at[pos];
#pragma omp simd
          for (int64_t i = 0; i < row; ++i) slot_row[i] = to_float(key[i]);
          for (int64_t h = 0; h < num_heads; ++h) {
            float score = dot(query.data() + h * head_dim, slot_row.data() + kv_offset[h],
                              head_dim);
            if constexpr (kInt8) score *= k_scale_ptr[scales_at[pos] + kv_head[h]];
            scores[h * SPAN + pos] = score;
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * SPAN;
        const float max_score = max_of(s, count);
        float total = exp_in_place(s, count, max_score);
#if defined(__AVX512F__)
        if (bf16_dot) total = round_weights_bf16(s, count);
#endif
        task_max[task * num_heads + h] = max_score;
        task_sum[task * num_heads + h] = total;
      }
      float* acc = task_acc.data() + task * num_heads * head_dim;
      std::fill(acc, acc + num_heads * head_dim, 0.f);
#if defined(__AVX2__)
      if (vector_heads) {
        if constexpr (kInt8) {  // the sums are taken: the weights take the values' scales
          for (int64_t h = 0; h < num_heads; ++h) {
            for (int64_t pos = 0; pos < count; ++pos) {
              scores[h * SPAN + pos] *= v_scale_ptr[scales_at[pos] + kv_head[h]];
            }
          }
        }
#if defined(__AVX512F__)
        if (bf16_dot) {
          if constexpr (std::is_same_v<C, at::BFloat16>) {
            all_heads_bf16<true>(scores.data(), values.data(), row, count, head_dim, num_heads,
                                 group, fscale, acc, SPAN);
          }
          continue;
        }
#endif
        all_heads<true>(scores.data(), values.data(), row, count, head_dim, num_heads, group,
                        acc, SPAN);
        continue;
      }
#endif
      for (int64_t pos = 0; pos < count; ++pos) {
        const C* value = v_ptr + row_at[pos];
#pragma omp simd
        for (int64_t i = 0; i < row; ++i) slot_row[i] = to_float(value[i]);
        for (int64_t h = 0; h < num_heads; ++h) {
          float p = scores[h * SPAN + pos];
          if constexpr (kInt8) p *= v_scale_ptr[scales_at[pos] + kv_head[h]];
          const float* vh = slot_row.data() + kv_offset[h];
          float* a = acc + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
        }
      }
    }
  });

  // Merge each sequence's tasks: rescale each to the largest max, then normalize.
  at::parallel_for(0, num_seqs * num_heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> out_row(head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t seq = i / num_heads, h = i % num_heads;
      float max_score = -INFINITY;
      const int64_t* tasks = seq_tasks.data() + seq_first_task[seq];
      const int64_t count = seq_first_task[seq + 1] - seq_first_task[seq];
      for (int64_t j = 0; j < count; ++j) {
        max_score = std::max(max_score, task_max[tasks[j] * num_heads + h]);
      }
      float total = 0.f;
      std::fill(out_row.begin(), out_row.end(), 0.f);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t t = tasks[j];
        const float w = std::exp(task_max[t * num_heads + h] - max_score);
        total += w * task_sum[t * num_heads + h];
        const float* a = task_acc.data() + (t * num_heads + h) * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) out_row[d] += w * a[d];
      }
      const float inv = 1.f / total;
      T* dst = out_ptr + (seq * num_heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(out_row[d] * inv);
    }
  });
}

#if defined(__AVX2__)
// Rows (a query and one of its KV head's query heads) a prefill tile takes at once: their
// accumulators, the shared key or value vector and a broadcast fit AVX2's 16 registers.
constexpr int64_t TILE_ROWS = 12;
// Positions a tile's value pass takes per sweep of its dimensions: their value vectors stay in
// L1 across the sweep.
constexpr int64_t VALUE_SPAN = 64;
// The most floats of rearranged keys and values a thread keeps between calls (16 MiB).
constexpr int64_t REUSED_FLOATS = int64_t{4} << 20;

// The 8x8 floats in r, transposed in place.
inline void transpose8(__m256* r) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// keys [N, Hkv, D] -> kt [Hkv][ceil(N / 8)][D][8] floats, positions past N zero: each block of 8
// keys as one vector per dimension, which a tile's rows take with a broadcast each.
template <typename T>
void transpose_keys(const T* keys, int64_t num_keys, int64_t num_kv_heads, int64_t head_dim,
                    float* kt) {
  const int64_t num_blocks = (num_keys + 7) / 8, row = num_kv_heads * head_dim;
  at::parallel_for(0, num_kv_heads * num_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / num_blocks, first = item % num_blocks * 8;
      const int64_t count = std::min<int64_t>(8, num_keys - first);
      float* dst = kt + item * head_dim * 8;
      for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; ++j) {
          r[j] = j < count ? load8(keys + (first + j) * row + kv * head_dim + d)
                           : _mm256_setzero_ps();
        }
        transpose8(r);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (d + j) * 8, r[j]);
      }
    }
  });
}

// Scores of MR rows of one KV head, queries qs [MR][D] (scaled, float32), over the keys from
// `lo` (a multiple of 8) to `hi` (exclusive) in kt (its KV head's blocks): scores [MR][span].
template <int MR>
void score_tile(const float* qs, const float* kt, int64_t head_dim, int64_t lo, int64_t hi,
                float* scores, int64_t span) {
  for (int64_t b = lo; b < hi; b += 8) {
    const float* k = kt + b * head_dim;
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; ++d) {
      const __m256 key = _mm256_loadu_ps(k + d * 8);
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(qs[r * head_dim + d]), key, acc[r]);
      }
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(scores + r * span + (b - lo), acc[r]);
  }
}

// out [rows][D] divided row by row by totals.
inline void normalize_rows(float* out, const float* totals, int rows, int64_t head_dim) {
  for (int r = 0; r < rows; ++r) {
    const __m256 inv = _mm256_set1_ps(1.f / totals[r]);
    for (int64_t d = 0; d < head_dim; d += 8) {
      float* o = out + r * head_dim + d;
      _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), inv));
    }
  }
}

// Row r's softmax over its keys first[r] .. last[r] of the scores (from `lo`), zero weights
// elsewhere up to `hi` (adding 0 * a finite value leaves its sums as they are), then out [MR][D]
// the weighted values (its KV head's first lane, rows `row` apart), normalized. Each row's sums run
// over its own keys in order, whatever rows share its tile: chunks agree with the whole prompt
// to the bit.
template <int MR, typename T>
void value_tile(const int64_t* first, const int64_t* last, const T* values, int64_t row,
                int64_t head_dim, int64_t lo, int64_t hi, float* scores, int64_t span,
                float* out) {
  float totals[MR];
  for (int r = 0; r < MR; ++r) {
    float* s = scores + r * span;
    const int64_t f = first[r] - lo, l = last[r] - lo;
    totals[r] = exp_in_place(s + f, l - f + 1, max_of(s + f, l - f + 1));
    std::fill(s, s + f, 0.f);
    std::fill(s + l + 1, s + (hi - lo), 0.f);
  }
  for (int64_t p0 = 0; p0 < hi - lo; p0 += VALUE_SPAN) {
    const int64_t p1 = std::min(hi - lo, p0 + VALUE_SPAN);
    for (int64_t d = 0; d < head_dim; d += 8) {
      __m256 acc[MR];
      for (int r = 0; r < MR; ++r) {
        acc[r] = p0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * head_dim + d);
      }
      for (int64_t p = p0; p < p1; ++p) {
        const __m256 value = load8(values + (lo + p) * row + d);
        for (int r = 0; r < MR; ++r) {
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scores[r * span + p]), value, acc[r]);
        }
      }
      for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * head_dim + d, acc[r]);
    }
  }
  normalize_rows(out, totals, MR, head_dim);
}

#if defined(__AVX512F__)
// keys [N, Hkv, D] bfloat16 -> kp [Hkv][ceil(N / 16)][D / 2][16] pairs of dimensions (positions
// past N zero): 16 keys' pairs side by side, one vector per pair of dimensions.
void pair_keys(const at::BFloat16* keys, int64_t num_keys, int64_t num_kv_heads,
               int64_t head_dim, uint32_t* kp) {
  const int64_t num_blocks = (num_keys + 15) / 16, row = num_kv_heads * head_dim;
  const int64_t half = head_dim / 2;
  // Each of 16 keys' pair p in one gather: key j's pairs start j * row / 2 pairs on.
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(row / 2)));
  at::parallel_for(0, num_kv_heads * num_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / num_blocks, first = item % num_blocks * 16;
      const __mmask16 present = static_cast<__mmask16>(
          (1u << std::min<int64_t>(16, num_keys - first)) - 1);
      const int* key = reinterpret_cast<const int*>(keys + first * row + kv * head_dim);
      uint32_t* dst = kp + item * half * 16;
      for (int64_t p = 0; p < half; ++p) {
        _mm512_storeu_si512(dst + p * 16, _mm512_mask_i32gather_epi32(
                                              _mm512_setzero_si512(), present, rows, key + p, 4));
      }
    }
  });
}

// score_tile over bfloat16 pairs: queries qp [MR][D / 2] (unscaled), keys kp (its KV head's
// blocks of 16), `lo` a multiple of 16.
template <int MR>
__attribute__((target("avx512bf16"))) void score_tile_bf16(
    const uint32_t* qp, const uint32_t* kp, int64_t half, float scale, int64_t lo, int64_t hi,
    float* scores, int64_t span) {
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t b = lo; b < hi; b += 16) {
    const uint32_t* k = kp + b * half;
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < half; ++p) {
      const __m512bh key = (__m512bh)_mm512_loadu_si512(k + p * 16);
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm512_dpbf16_ps(
            acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * half + p])), key);
      }
    }
    for (int r = 0; r < MR; ++r) {
      _mm512_storeu_ps(scores + r * span + (b - lo), _mm512_mul_ps(acc[r], scale16));
    }
  }
}

// values [N, Hkv, D] bfloat16 -> vp [Hkv][ceil(N / 2)][D] pairs of positions (a position past
// N zero): one dot product adds two positions' weighted values to 16 lanes.
void pair_values(const at::BFloat16* values, int64_t num_keys, int64_t num_kv_heads,
                 int64_t head_dim, uint32_t* vp) {
  const int64_t num_pairs = (num_keys + 1) / 2, row = num_kv_heads * head_dim;
  at::parallel_for(0, num_kv_heads * num_pairs, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / num_pairs, pos = item % num_pairs * 2;
      const at::BFloat16* even = values + pos * row + kv * head_dim;
      const bool has_odd = pos + 1 < num_keys;
      uint32_t* dst = vp + item * head_dim;
      for (int64_t d = 0; d < head_dim; d += 16) {
        const __m512i low = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d)));
        const __m512i high = has_odd ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + row + d))), 16)
                                     : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + d, _mm512_or_si512(low, high));
      }
    }
  });
}

// value_tile over bfloat16 pairs: each row's softmax weights rounded to bfloat16 in place of its
// scores, summed as rounded (from its own first key, so the same whatever its tile), then two
// positions a dot product with vp (its KV head's pairs; `lo` a multiple of 16). head_dim: a
// multiple of 16.
template <int MR>
__attribute__((target("avx512bf16"))) void value_tile_bf16(
    const int64_t* first, const int64_t* last, const uint32_t* vp, int64_t head_dim, int64_t lo,
    int64_t hi, float* scores, int64_t span, float* out) {
  const int64_t count = hi - lo, num_pairs = (count + 1) / 2;
  const int64_t rounded = (count + 15) / 16 * 16;  // <= span - 16: the scores' padding
  float totals[MR];
  for (int r = 0; r < MR; ++r) {
    float* s = scores + r * span;
    const int64_t f = first[r] - lo, l = last[r] - lo;
    exp_in_place(s + f, l - f + 1, max_of(s + f, l - f + 1));
    std::fill(s, s + f, 0.f);
    std::fill(s + l + 1, s + rounded, 0.f);
    // In place: 16 floats are read before their 16 halves are written over the first 8.
    uint16_t* w = reinterpret_cast<uint16_t*>(s);
    for (int64_t p = 0; p < rounded; p += 16) {
      const __m256bh half = _mm512_cvtneps_pbh(_mm512_loadu_ps(s + p));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + p), (__m256i)half);
    }
    __m512 sum = _mm512_setzero_ps();
    int64_t p = f;
    for (; p + 16 <= l + 1; p += 16) {
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                   _mm256_loadu_si256(reinterpret_cast<__m256i*>(w + p))), 16)));
    }
    float total = _mm512_reduce_add_ps(sum);
    for (; p <= l; ++p) {
      uint16_t bits;
      std::memcpy(&bits, w + p, sizeof(bits));
      total += to_float(c10::BFloat16(bits, c10::BFloat16::from_bits()));
    }
    totals[r] = total;
  }
  for (int64_t q0 = 0; q0 < num_pairs; q0 += VALUE_SPAN / 2) {
    const int64_t q1 = std::min(num_pairs, q0 + VALUE_SPAN / 2);
    for (int64_t d = 0; d < head_dim; d += 16) {
      __m512 acc[MR];
      for (int r = 0; r < MR; ++r) {
        acc[r] = q0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * head_dim + d);
      }
      for (int64_t q = q0; q < q1; ++q) {
        const __m512bh value = (__m512bh)_mm512_loadu_si512(vp + (lo / 2 + q) * head_dim + d);
        for (int r = 0; r < MR; ++r) {
          int pair;  // the row's weights q * 2 and q * 2 + 1, read past the float type
          std::memcpy(&pair, reinterpret_cast<const char*>(scores + r * span) + 4 * q, 4);
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), value);
        }
      }
      for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * head_dim + d, acc[r]);
    }
  }
  normalize_rows(out, totals, MR, head_dim);
}
#endif

// f(std::integral_constant<int, rows>) for rows in 1 .. sizeof...(MR).
template <typename F, int... MR>
void with_rows(int rows, std::integer_sequence<int, MR...>, F&& f) {
  ((rows == MR + 1 ? f(std::integral_constant<int, MR + 1>{}) : void()), ...);
}

// A chunk's queries q [T, H, D] over keys, values [N, Hkv, D] (query i at key N - T + i): keys
// rearranged once into blocks (8 keys as float32 vectors, or 16 as bfloat16 pairs), then tiles
// of TILE_ROWS (query, head) rows of one KV head, each scoring every key block in one pass of
// its rows, then summing the values (float32, or bfloat16 pairs). T: the queries' and output's
// type; C: the keys' and values' (T, or bfloat16 under float32 queries, widened as read).
template <typename T, typename C>
void prefill_kernel(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                    double scale, int64_t window, at::Tensor& out) {
  const int64_t num_queries = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_keys = keys.size(0), num_kv_heads = keys.size(1);
  const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * head_dim;
  const T* q_ptr = q.data_ptr<T>();
  const C* v_ptr = values.data_ptr<C>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
#if defined(__AVX512F__)
  constexpr bool kBF16 = std::is_same_v<T, at::BFloat16> && std::is_same_v<C, at::BFloat16>;
  const bool pairs = kBF16 && has_bf16_dot();
#else
  constexpr bool pairs = false;
#endif
  const int64_t block = pairs ? 16 : 8, half = head_dim / 2;
  const int64_t num_blocks = (num_keys + block - 1) / block;
  // Values paired by position count pairs from the keys' first, which a windowed chunk's first
  // block moves (by an odd count with an odd block size): windows sum in float32.
  const bool value_pairs = pairs && head_dim % 16 == 0 && window == 0;
  const int64_t kv_stride = num_blocks * block * head_dim / (pairs ? 2 : 1);  // floats
  const int64_t vp_stride = (num_keys + 1) / 2 * head_dim;
  const int64_t total = num_kv_heads * (kv_stride + (value_pairs ? vp_stride : 0));
  // The thread keeps its buffer across calls up to REUSED_FLOATS (fresh pages every layer cost
  // short chunks more than their work); a longer context's is freed after the call. Its
  // pointer is taken here: a thread_local named in the parallel region is each worker's own.
  static thread_local std::vector<float> reused;
  std::vector<float> once;
  std::vector<float>& buffer = total <= REUSED_FLOATS ? reused : once;
  if (static_cast<int64_t>(buffer.size()) < total) buffer.resize(total);
  float* kt = buffer.data();
#if defined(__AVX512F__)
  uint32_t* kp = reinterpret_cast<uint32_t*>(kt);
  const uint32_t* vp = kp + num_kv_heads * kv_stride;
  if constexpr (kBF16) {
    if (pairs) pair_keys(keys.data_ptr<at::BFloat16>(), num_keys, num_kv_heads, head_dim, kp);
    if (value_pairs) {
      pair_values(values.data_ptr<at::BFloat16>(), num_keys, num_kv_heads, head_dim,
                  kp + num_kv_heads * kv_stride);
    }
  }
#endif
  if (!pairs) transpose_keys(keys.data_ptr<C>(), num_keys, num_kv_heads, head_dim, kt);

  const int64_t num_rows = num_queries * group;
  const int64_t num_tiles = (num_rows + TILE_ROWS - 1) / TILE_ROWS;
  // Later tiles see more keys: taken alternately from both ends, the halves of a static split
  // cost alike.
  at::parallel_for(0, num_kv_heads * num_tiles, 1, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> scores;
    std::vector<float> qs(TILE_ROWS * head_dim), tile_out(TILE_ROWS * head_dim);
    std::vector<uint32_t> qp(TILE_ROWS * half);
    int64_t first[TILE_ROWS], last[TILE_ROWS];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / num_tiles, k = item % num_tiles;
      const int64_t tile = k % 2 == 0 ? k / 2 : num_tiles - 1 - k / 2;
      const int64_t row0 = tile * TILE_ROWS;
      const int rows = static_cast<int>(std::min(TILE_ROWS, num_rows - row0));
      for (int r = 0; r < rows; ++r) {
        const int64_t i = (row0 + r) / group, h = kv * group + (row0 + r) % group;
        last[r] = num_keys - num_queries + i;
        first[r] = window > 0 ? std::max<int64_t>(0, last[r] - window + 1) : 0;
        const T* src = q_ptr + (i * num_heads + h) * head_dim;
        if (pairs) {
          std::memcpy(qp.data() + r * half, src, head_dim * sizeof(T));
        } else {
          for (int64_t d = 0; d < head_dim; ++d) {
            qs[r * head_dim + d] = to_float(src[d]) * fscale;
          }
        }
      }
      const int64_t lo = first[0] / block * block, hi = last[rows - 1] + 1;
      // Rows a cache line past a multiple of 4 KiB apart: rows a multiple of 4 KiB apart share
      // L1's sets and a tile's rows evict each other.
      const int64_t span = (hi - lo + 1023) / 1024 * 1024 + 16;
      if (static_cast<int64_t>(scores.size()) < rows * span) scores.resize(rows * span);
      with_rows(rows, std::make_integer_sequence<int, TILE_ROWS>{}, [&](auto mr) {
        constexpr int MR = decltype(mr)::value;
#if defined(__AVX512F__)
        if (pairs) {
          score_tile_bf16<MR>(qp.data(), kp + kv * kv_stride, half, fscale, lo, hi,
                              scores.data(), span);
        }
#endif
        if (!pairs) {
          score_tile<MR>(qs.data(), kt + kv * kv_stride, head_dim, lo, hi, scores.data(), span);
        }
#if defined(__AVX512F__)
        if (value_pairs) {
          value_tile_bf16<MR>(first, last, vp + kv * vp_stride, head_dim, lo, hi, scores.data(),
                              span, tile_out.data());
        }
#endif
        if (!value_pairs) {
          value_tile<MR, C>(first, last, v_ptr + kv * head_dim, row, head_dim, lo, hi,
                            scores.data(), span, tile_out.data());
        }
      });
      for (int r = 0; r < rows; ++r) {
        const int64_t i = (row0 + r) / group, h = kv * group + (row0 + r) % group;
        T* dst = out_ptr + (i * num_heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(tile_out[r * head_dim + d]);
      }
    }
  });
}
#endif
}  // namespace

// q [seqs, heads, head_dim]; caches [blocks, block_size, kv_heads, head_dim] (blocks packed
// inside, any distance apart) in q's dtype or bfloat16, or int8 with k_scales, v_scales
// [blocks, block_size, kv_heads] float32; block_tables [seqs, max_blocks] int64; context_lens
// [seqs] int64 (each >= 1); window: attend to the last `window` positions only (0: all).
// Returns [seqs, heads, head_dim].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens,
                                  double scale, int64_t window,
                                  c10::optional<at::Tensor> k_scales,
                                  c10::optional<at::Tensor> v_scales) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(packed_blocks(k_cache) && packed_blocks(v_cache) &&
                  v_cache.stride(0) == k_cache.stride(0) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "caches: blocks packed inside, keys' and values' alike apart");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong);
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3));
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "float32 or bfloat16 only");
  const bool quantized = k_scales.has_value();
  TORCH_CHECK(quantized == v_scales.has_value(), "scales for both keys and values, or neither");
  const float* k_scale_ptr = nullptr;
  const float* v_scale_ptr = nullptr;
  int64_t scale_block_stride = 0;
  if (quantized) {
    TORCH_CHECK(k_cache.scalar_type() == at::kChar, "scales come with an int8 cache");
    for (const at::Tensor& scales : {*k_scales, *v_scales}) {
      TORCH_CHECK(scales.scalar_type() == at::kFloat && packed_blocks(scales) &&
                      scales.stride(0) == k_scales->stride(0) &&
                      scales.sizes() == k_cache.sizes().slice(0, 3),
                  "scales: float32 [blocks, block_size, kv_heads], blocks packed inside");
    }
    k_scale_ptr = k_scales->data_ptr<float>();
    v_scale_ptr = v_scales->data_ptr<float>();
    scale_block_stride = k_scales->stride(0);
  } else {
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || k_cache.scalar_type() == at::kBFloat16,
                "a cache in q's dtype or bfloat16, or int8 with scales");
  }
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = at::empty_like(q);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  if (quantized && bf16) {
    decode_kernel<at::BFloat16, int8_t>(q, k_cache, v_cache, k_scale_ptr, v_scale_ptr,
                                        scale_block_stride, block_tables, context_lens, scale,
                                        window, out);
  } else if (quantized) {
    decode_kernel<float, int8_t>(q, k_cache, v_cache, k_scale_ptr, v_scale_ptr,
                                 scale_block_stride, block_tables, context_lens, scale, window,
                                 out);
  } else if (bf16) {
    decode_kernel<at::BFloat16, at::BFloat16>(q, k_cache, v_cache, nullptr, nullptr, 0,
                                              block_tables, context_lens, scale, window, out);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    decode_kernel<float, at::BFloat16>(q, k_cache, v_cache, nullptr, nullptr, 0, block_tables,
                                       context_lens, scale, window, out);
  } else {
    decode_kernel<float, float>(q, k_cache, v_cache, nullptr, nullptr, 0, block_tables,
                                context_lens, scale, window, out);
  }
  return out;
}

bool prefill_attention_available() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

// q [T, heads, head_dim], keys and values [N, kv_heads, head_dim] (N >= T) in q's dtype, float32
// or bfloat16 (or bfloat16 under float32 q), head_dim a multiple of 8: query i sits at key
// N - T + i and attends to the keys up to its own, the last `window` of them where window > 0.
// Returns [T, heads, head_dim].
at::Tensor prefill_attention(at::Tensor q, at::Tensor keys, at::Tensor values, double scale,
                             int64_t window) {
  TORCH_CHECK(prefill_attention_available(), "prefill attention needs AVX2");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes());
  TORCH_CHECK(q.size(1) % keys.size(1) == 0 && q.size(2) == keys.size(2) &&
              q.size(2) % 8 == 0 && keys.size(0) >= q.size(0));
  TORCH_CHECK((q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat) &&
              values.scalar_type() == keys.scalar_type() &&
              (keys.scalar_type() == q.scalar_type() || keys.scalar_type() == at::kBFloat16),
              "float32 or bfloat16 q, keys and values in its dtype or bfloat16");
  q = q.contiguous();
  keys = keys.contiguous();
  values = values.contiguous();
  auto out = at::empty_like(q);
#if defined(__AVX2__)
  if (q.scalar_type() == at::kBFloat16) {
    prefill_kernel<at::BFloat16, at::BFloat16>(q, keys, values, scale, window, out);
  } else if (keys.scalar_type() == at::kBFloat16) {
    prefill_kernel<float, at::BFloat16>(q, keys, values, scale, window, out);
  } else {
    prefill_kernel<float, float>(q, keys, values, scale, window, out);
  }
#endif
  return out;
}
