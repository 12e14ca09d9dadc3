// A mixture-of-experts feed-forward over GGUF-block experts in one call a layer. Each token's
// (token, expert) pairs are grouped by expert; the experts' gate/up rows, then their down rows,
// are split among the threads in one parallel region per projection, each weight tile read once
// for all of its expert's rows (the row kernels). An expert with more rows than its row-kernel
// limit runs the integer GEMM instead, before the region. A pair's result is its row kernels'
// alone and a token sums its k experts in its own order, so a token's output does not depend on
// the step's other tokens, except where an expert's rows cross the limit and its type's GEMM
// rounds otherwise than its row kernels (the K-quants).
#include "kernels.h"
#include "quant_blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

using namespace quant;

namespace {

// Rows `rows` of a quantized activation matrix, in that order.
QuantizedRows gather(const QuantizedRows& x, const std::vector<int64_t>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  QuantizedRows out{x.k, x.nb, std::vector<int8_t>(n * x.k), std::vector<float>(n * x.nb),
                    std::vector<float>(n * x.nb), std::vector<int32_t>(n * x.nb)};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rows[i];
    std::memcpy(out.q.data() + i * x.k, x.q.data() + r * x.k, x.k);
    std::memcpy(out.d.data() + i * x.nb, x.d.data() + r * x.nb, x.nb * sizeof(float));
    std::memcpy(out.sum.data() + i * x.nb, x.sum.data() + r * x.nb, x.nb * sizeof(float));
    std::memcpy(out.qsum.data() + i * x.nb, x.qsum.data() + r * x.nb, x.nb * sizeof(int32_t));
  }
  return out;
}

Q8KRows gather(const Q8KRows& x, const std::vector<int64_t>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  Q8KRows out{x.k, x.nsb, std::vector<int8_t>(n * x.k), std::vector<float>(n * x.nsb),
              std::vector<int16_t>(n * x.nsb * 16)};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rows[i];
    std::memcpy(out.q.data() + i * x.k, x.q.data() + r * x.k, x.k);
    std::memcpy(out.d.data() + i * x.nsb, x.d.data() + r * x.nsb, x.nsb * sizeof(float));
    std::memcpy(out.bsums.data() + i * x.nsb * 16, x.bsums.data() + r * x.nsb * 16,
                x.nsb * 16 * sizeof(int16_t));
  }
  return out;
}

std::vector<int64_t> consecutive(int64_t first, int64_t count) {
  std::vector<int64_t> rows(count);
  for (int64_t i = 0; i < count; ++i) rows[i] = first + i;
  return rows;
}

// One activation matrix in both quantized forms a projection's types may need.
struct Activations {
  QuantizedRows q8;
  Q8KRows q8k;
};

// Weight rows a row-kernel work item takes.
constexpr int64_t TILE = 16;

}  // namespace

QuantMoE::QuantMoE(std::vector<std::vector<at::Tensor>> gate_up,
                   std::vector<std::vector<int64_t>> gate_up_types, std::vector<at::Tensor> down,
                   std::vector<int64_t> down_types) {
  const size_t n = gate_up.size();
  TORCH_CHECK(n > 0 && gate_up_types.size() == n && down.size() == n && down_types.size() == n,
              "QuantMoE: gate/up parts, their types, down and its type for every expert");
  const std::vector<int64_t> gemm = panel_gemm_types();
  for (size_t e = 0; e < n; ++e) {
    TORCH_CHECK(!gate_up[e].empty() && gate_up_types[e].size() == gate_up[e].size(),
                "QuantMoE: one type per gate/up part");
    experts_.push_back({{gate_up[e], gate_up_types[e]}, {{down[e]}, {down_types[e]}}});
    for (const Projection& p : {experts_.back().gate_up, experts_.back().down}) {
      for (int64_t type : p.types) {
        TORCH_CHECK(std::find(gemm.begin(), gemm.end(), type) != gemm.end(),
                    "QuantMoE: type ", type, " has no integer GEMM in this build");
      }
    }
  }
  const Projection& first = experts_[0].gate_up;
  hidden_ = first.weights[0].size(1) / block_bytes(first.types[0]) *
            block_weights(first.types[0]);
  for (const Expert& expert : experts_) {
    int64_t width = 0;
    for (size_t p = 0; p < expert.gate_up.weights.size(); ++p) {
      check_weight(expert.gate_up.weights[p], expert.gate_up.types[p], hidden_);
      width += expert.gate_up.weights[p].size(0);
    }
    TORCH_CHECK(width % 2 == 0 && (gate_up_width_ == 0 || width == gate_up_width_),
                "QuantMoE: experts' gate/up widths differ or are odd");
    gate_up_width_ = width;
    check_weight(expert.down.weights[0], expert.down.types[0], width / 2);
    TORCH_CHECK(expert.down.weights[0].size(0) == hidden_, "QuantMoE: down's rows != hidden");
    for (const Projection* p : {&expert.gate_up, &expert.down}) {
      Forms& forms = p == &expert.gate_up ? gate_up_forms_ : down_forms_;
      for (int64_t type : p->types) (is_k_quant(type) ? forms.q8k : forms.q8) = true;
    }
  }
}

std::tuple<at::Tensor, int64_t> QuantMoE::forward(at::Tensor x, at::Tensor chosen,
                                                   at::Tensor weights, int64_t gate_up_rows,
                                                   int64_t down_rows) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_, "x must be [tokens, hidden]");
  TORCH_CHECK(chosen.dim() == 2 && chosen.size(0) == x.size(0) &&
              chosen.scalar_type() == at::kLong && weights.sizes() == chosen.sizes() &&
              weights.scalar_type() == at::kFloat, "chosen [tokens, k] int64, weights float32");
  const auto dtype = x.scalar_type();
  x = x.contiguous();
  if (dtype != at::kBFloat16) x = x.to(at::kFloat);
  chosen = chosen.contiguous();
  weights = weights.contiguous();
  const int64_t tokens = x.size(0), k = chosen.size(1), pairs = tokens * k;
  const int64_t num_experts = static_cast<int64_t>(experts_.size());
  const int64_t* choice = chosen.data_ptr<int64_t>();

  // The pairs grouped by expert (a counting sort, stable): expert e's rows are
  // [first[e], first[e + 1]) of the grouped order; position[t * k + j] is pair (t, j)'s row.
  std::vector<int64_t> first(num_experts + 1, 0), position(pairs), token_of(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(choice[i] >= 0 && choice[i] < num_experts, "expert ", choice[i], " out of range");
    ++first[choice[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) first[e + 1] += first[e];
  {
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t i = 0; i < pairs; ++i) {
      position[i] = next[choice[i]]++;
      token_of[position[i]] = i / k;
    }
  }
  int64_t experts_run = 0;
  for (int64_t e = 0; e < num_experts; ++e) experts_run += first[e + 1] > first[e];

  // The activations in the forms the projection's types take: for gate/up the tokens' rows
  // quantized and gathered into pair order, for down the pairs' rows as they are.
  const auto quantized = [&](const at::Tensor& rows, bool for_gate_up) {
    const Forms& forms = for_gate_up ? gate_up_forms_ : down_forms_;
    Activations a;
    if (forms.q8) a.q8 = for_gate_up ? gather(quantize_rows_q8(rows), token_of) : quantize_rows_q8(rows);
    if (forms.q8k) {
      a.q8k = for_gate_up ? gather(quantize_rows_q8k(rows), token_of) : quantize_rows_q8k(rows);
    }
    return a;
  };

  // out [pairs, width]: each pair's row of its expert's gate/up (or down) projection.
  const auto project = [&](const Activations& a, bool gate_up, int64_t row_limit, float* out,
                           int64_t width) {
    struct Item {
      const uint8_t* weight;
      int64_t type, first_row, rows, begin, end, column;
    };
    std::vector<Item> items;
    std::vector<int64_t> cost_before{0};  // items' cumulative cost
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t rows = first[e + 1] - first[e];
      if (rows == 0) continue;
      const Projection& p = gate_up ? experts_[e].gate_up : experts_[e].down;
      Activations own;  // the GEMM's: this expert's rows alone
      if (rows > row_limit) {
        const std::vector<int64_t> own_rows = consecutive(first[e], rows);
        if (!a.q8.q.empty()) own.q8 = gather(a.q8, own_rows);
        if (!a.q8k.q.empty()) own.q8k = gather(a.q8k, own_rows);
      }
      int64_t column = 0;
      for (size_t i = 0; i < p.weights.size(); ++i) {
        const int64_t n = p.weights[i].size(0), type = p.types[i];
        const uint8_t* w = p.weights[i].data_ptr<uint8_t>();
        if (rows > row_limit) {  // the GEMM splits its weight rows among the threads itself
          float* o = out + first[e] * width + column;
          if (is_k_quant(type)) {
            panel_gemm(type, w, n, own.q8k, rows, o, width);
          } else {
            panel_gemm(type, w, n, own.q8, rows, o, width);
          }
        } else {
          for (int64_t o = 0; o < n; o += TILE) {
            items.push_back({w, type, first[e], rows, o, std::min(n, o + TILE), column});
            // A tile's read from memory costs about two rows' products on it.
            cost_before.push_back(cost_before.back() + 2 + rows);
          }
        }
        column += n;
      }
    }
    if (items.empty()) return;
    // Each thread takes the items whose cost starts in its equal share of the total.
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), items.size());
    const int64_t total = cost_before.back();
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t thread = begin; thread < end; ++thread) {
        const auto from = std::lower_bound(cost_before.begin(), cost_before.end() - 1,
                                           total * thread / threads);
        const auto to = std::lower_bound(cost_before.begin(), cost_before.end() - 1,
                                         total * (thread + 1) / threads);
        for (auto it = from; it != to; ++it) {
          const Item& item = items[it - cost_before.begin()];
          quant_rows_range(item.type, item.weight, item.begin, item.end,
                           a.q8, a.q8k, item.first_row, item.rows,
                           out + item.first_row * width + item.column, width);
        }
      }
    });
  };

  const int64_t width = gate_up_width_;
  at::Tensor h = at::empty({pairs, width}, x.options().dtype(at::kFloat));
  project(quantized(x, true), true, gate_up_rows, h.data_ptr<float>(), width);
  const at::Tensor act = silu_and_mul(h);
  at::Tensor y = at::empty({pairs, hidden_}, x.options().dtype(at::kFloat));
  project(quantized(act, false), false, down_rows, y.data_ptr<float>(), hidden_);

  // Each token's k outputs weighted and summed in its own order.
  at::Tensor out = at::empty({tokens, hidden_}, x.options().dtype(at::kFloat));
  const float* rows = y.data_ptr<float>();
  const float* weight = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* dst = o + t * hidden_;
      std::fill(dst, dst + hidden_, 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const float* src = rows + position[t * k + j] * hidden_;
        const float w = weight[t * k + j];
        for (int64_t i = 0; i < hidden_; ++i) dst[i] += w * src[i];
      }
    }
  });
  return {out.to(dtype), experts_run};
}
