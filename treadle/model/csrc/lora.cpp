// LoRA's product for a decode step's rows, inside the fused decoder: y[t] += (x[t] · A[s]) · B[s]
// with s the row's adapter slot (-1: a base row, untouched). A step with rows of 8 adapters
// would otherwise leave the fused decoder for some 30 torch ops a layer per adapter.
//
// A [slots, in, parts·R] and B [slots, parts·R, out] are model/lora.py's stacked slots. B is
// block-diagonal by part (q/k/v, gate/up), so part p's R ranks touch only its columns.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Rows of one slot taken together (so that a slot's A and B are read once for them), up to
// this many, fewer where the threads would otherwise idle.
constexpr int64_t kRowsPerTask = 4;

// T: the rows' dtype, W: the adapters' (float32 or bfloat16 each).
template <typename T, typename W>
void lora_rows(T* y, const T* x, const W* a, const W* b, const int64_t* slots, int64_t tokens,
               int64_t in, int64_t out, int64_t width, const std::vector<int64_t>& offsets,
               int64_t rank) {
  const int64_t parts = static_cast<int64_t>(offsets.size()) - 1;
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
    std::vector<float> low(kRowsPerTask * width), sum(kRowsPerTask * out);
    for (int64_t task = first; task < last; ++task) {
      const auto [begin, end] = tasks[task];
      const int64_t n = end - begin, slot = slots[rows[begin]];
      const W* a_slot = a + slot * in * width;
      const W* b_slot = b + slot * width * out;
      std::fill(low.begin(), low.begin() + n * width, 0.0f);
      for (int64_t i = 0; i < in; ++i) {
        const W* a_row = a_slot + i * width;
        for (int64_t r = 0; r < n; ++r) {
          const float xi = static_cast<float>(x[rows[begin + r] * in + i]);
          float* low_r = low.data() + r * width;
          for (int64_t w = 0; w < width; ++w) low_r[w] += xi * static_cast<float>(a_row[w]);
        }
      }
      std::fill(sum.begin(), sum.begin() + n * out, 0.0f);
      for (int64_t p = 0; p < parts; ++p) {
        for (int64_t k = p * rank; k < (p + 1) * rank; ++k) {
          const W* b_row = b_slot + k * out;
          for (int64_t r = 0; r < n; ++r) {
            const float lw = low[r * width + k];
            if (lw == 0.0f) continue;  // a rank past the adapter's own (zeros in A)
            float* sum_r = sum.data() + r * out;
            for (int64_t o = offsets[p]; o < offsets[p + 1]; ++o) {
              sum_r[o] += lw * static_cast<float>(b_row[o]);
            }
          }
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        T* y_row = y + rows[begin + r] * out;
        const float* sum_r = sum.data() + r * out;
        for (int64_t o = 0; o < out; ++o) {
          y_row[o] = static_cast<T>(static_cast<float>(y_row[o]) + sum_r[o]);
        }
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
