// LoRA's product for a decode step's rows, inside the fused decoder: y[t] += (x[t] · A[s]) · B[s]
// with s the row's adapter slot (-1: a base row, untouched). A step with rows of 8 adapters
// would otherwise leave the fused decoder for some 30 torch ops a layer per adapter.
//
// A [slots, in, parts·R] and B [slots, parts·R, out] are model/lora.py's stacked slots. B is
// block-diagonal by part (q/k/v, gate/up), so part p's R ranks touch only its columns.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Rows of one slot taken together (so that a slot's A and B are read once for them), up to
// this many, fewer where the threads would otherwise idle.
constexpr int64_t kRowsPerTask = 4;

// Eight floats: one AVX2 register, two SSE ones on the generic build. The products accumulate
// in registers over a block of 16 columns; a loop that updates memory at each multiply-add is
// bound by its loads and stores, at a tenth of the FMA units' rate.
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
constexpr int64_t kBlock = 16;

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x8 load8(const c10::BFloat16* p) {  // bfloat16 is float32's high half
  u16x8 half;
  std::memcpy(&half, p, sizeof half);
  const u32x8 wide = __builtin_convertvector(half, u32x8) << 16;
  f32x8 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// out[r][0:cols) = sum over k in [0, depth) of left[r][k] · right[k][0:cols), for N rows
// (left: float32 [N, left_stride], right: [depth, right_stride]); cols <= kBlock.
template <int N, typename W>
void block_product(float* out, const float* left, int64_t left_stride, const W* right,
                   int64_t right_stride, int64_t depth, int64_t cols) {
  if (cols == kBlock) {
    f32x8 acc[N][2] = {};
    for (int64_t k = 0; k < depth; ++k) {
      const W* row = right + k * right_stride;
      const f32x8 lo = load8(row), hi = load8(row + 8);
      for (int r = 0; r < N; ++r) {
        const float l = left[r * left_stride + k];
        acc[r][0] += l * lo;
        acc[r][1] += l * hi;
      }
    }
    for (int r = 0; r < N; ++r) {
      std::memcpy(out + r * kBlock, &acc[r][0], sizeof(f32x8));
      std::memcpy(out + r * kBlock + 8, &acc[r][1], sizeof(f32x8));
    }
    return;
  }
  for (int r = 0; r < N; ++r) {  // a tail narrower than the block
    for (int64_t c = 0; c < cols; ++c) {
      float sum = 0.0f;
      for (int64_t k = 0; k < depth; ++k) {
        sum += left[r * left_stride + k] * static_cast<float>(right[k * right_stride + c]);
      }
      out[r * kBlock + c] = sum;
    }
  }
}

// y[row] += (x[row] · A) · B for the N rows `row` of one slot.
template <int N, typename T, typename W>
void slot_rows(T* y, const T* x, const W* a, const W* b, const int64_t* row, int64_t in,
               int64_t out, int64_t width, const std::vector<int64_t>& offsets, int64_t rank,
               float* xs, float* low) {
  for (int r = 0; r < N; ++r) {
    for (int64_t i = 0; i < in; ++i) xs[r * in + i] = static_cast<float>(x[row[r] * in + i]);
  }
  float block[N * kBlock];
  for (int64_t w = 0; w < width; w += kBlock) {  // low = x · A, [N, width]
    const int64_t cols = std::min(kBlock, width - w);
    block_product<N, W>(block, xs, in, a + w, width, in, cols);
    for (int r = 0; r < N; ++r) {
      std::memcpy(low + r * width + w, block + r * kBlock, cols * sizeof(float));
    }
  }
  const int64_t parts = static_cast<int64_t>(offsets.size()) - 1;
  for (int64_t p = 0; p < parts; ++p) {  // y += low · B, part p's ranks onto its columns
    // Ranks past the adapter's own are zeros in A: B's rows for them are not read.
    int64_t depth = rank;
    while (depth > 0) {
      bool zero = true;
      for (int r = 0; r < N; ++r) zero = zero && low[r * width + p * rank + depth - 1] == 0.0f;
      if (!zero) break;
      --depth;
    }
    if (depth == 0) continue;
    for (int64_t o = offsets[p]; o < offsets[p + 1]; o += kBlock) {
      const int64_t cols = std::min(kBlock, offsets[p + 1] - o);
      block_product<N, W>(block, low + p * rank, width, b + p * rank * out + o, out, depth,
                          cols);
      for (int r = 0; r < N; ++r) {
        T* y_row = y + row[r] * out + o;
        for (int64_t c = 0; c < cols; ++c) {
          y_row[c] = static_cast<T>(static_cast<float>(y_row[c]) + block[r * kBlock + c]);
        }
      }
    }
  }
}

// T: the rows' dtype, W: the adapters' (float32 or bfloat16 each).
template <typename T, typename W>
void lora_rows(T* y, const T* x, const W* a, const W* b, const int64_t* slots, int64_t tokens,
               int64_t in, int64_t out, int64_t width, const std::vector<int64_t>& offsets,
               int64_t rank) {
  std::vector<int64_t> rows;  // the adapted rows, by slot
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] >= 0) rows.push_back(t);
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [&](int64_t i, int64_t j) { return slots[i] < slots[j]; });
  const int64_t n = static_cast<int64_t>(rows.size()), threads = at::get_num_threads();
  const int64_t per_task = std::max<int64_t>(1, std::min(kRowsPerTask, (n + threads - 1) / threads));
  std::vector<std::pair<int64_t, int64_t>> tasks;  // [begin, end) in rows, one slot each
  for (int64_t begin = 0; begin < n;) {
    int64_t end = begin + 1;
    while (end < n && end - begin < per_task && slots[rows[end]] == slots[rows[begin]]) ++end;
    tasks.emplace_back(begin, end);
    begin = end;
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<float> xs(kRowsPerTask * in), low(kRowsPerTask * width);
    for (int64_t task = first; task < last; ++task) {
      const auto [begin, end] = tasks[task];
      const int64_t slot = slots[rows[begin]];
      const W* a_slot = a + slot * in * width;
      const W* b_slot = b + slot * width * out;
      const int64_t* row = rows.data() + begin;
      const auto run = [&](auto rows_n) {
        slot_rows<decltype(rows_n)::value, T, W>(y, x, a_slot, b_slot, row, in, out, width,
                                                 offsets, rank, xs.data(), low.data());
      };
      switch (end - begin) {
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        default: run(std::integral_constant<int, 4>{}); break;
      }
    }
  });
}

}  // namespace

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& slots, const std::vector<int64_t>& offsets, int64_t rank) {
  const int64_t tokens = x.size(0), in = x.size(1), width = a.size(2), out = b.size(2);
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && a.is_contiguous() && b.is_contiguous() &&
              y.dim() == 2 && y.size(0) == tokens && y.size(1) == out && a.size(1) == in &&
              b.size(1) == width && slots.scalar_type() == at::kLong &&
              slots.numel() == tokens && slots.is_contiguous(), "lora_add: shapes");
  const auto is_float = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
  };
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && a.scalar_type() == b.scalar_type() &&
              is_float(x) && is_float(a), "lora_add: rows and adapters float32 or bfloat16");
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) >= 2 && offsets.back() == out &&
              (static_cast<int64_t>(offsets.size()) - 1) * rank == width, "lora_add: parts");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] < a.size(0), "lora_add: slot ", slot[t], " out of range");
  }
  const auto run = [&](auto* y_data, auto* a_data) {
    using T = std::remove_pointer_t<decltype(y_data)>;
    using W = std::remove_pointer_t<decltype(a_data)>;
    lora_rows<T, W>(y_data, static_cast<const T*>(x.data_ptr()), a_data,
                    static_cast<const W*>(b.data_ptr()), slot, tokens, in, out, width, offsets,
                    rank);
  };
  const bool rows_float = x.scalar_type() == at::kFloat;
  if (a.scalar_type() == at::kFloat) {
    if (rows_float) run(y.data_ptr<float>(), static_cast<const float*>(a.data_ptr()));
    else run(y.data_ptr<at::BFloat16>(), static_cast<const float*>(a.data_ptr()));
  } else {
    const auto* a_bf16 = static_cast<const at::BFloat16*>(a.data_ptr());
    if (rows_float) run(y.data_ptr<float>(), a_bf16);
    else run(y.data_ptr<at::BFloat16>(), a_bf16);
  }
}
