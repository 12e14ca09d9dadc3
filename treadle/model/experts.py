"""A mixture-of-experts feed-forward layer: a router picks each token's top-k experts, and each
expert chosen in the step runs its gated MLP once over all of its tokens. Experts in GGUF blocks
run in one native call a layer in steps of up to NATIVE_MAX_TOKENS tokens (`QuantMoE`: every
chosen expert's weight tiles split among the threads at once); otherwise each expert runs through
the paths of any linear layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treadle.model.layers import silu_and_mul
from treadle.model.linear import Linear, QuantizedLinear

# The most tokens a step runs through the native layer, whose float32 scratch per (token, expert)
# pair costs more than it saves past this (docs/decisions.md); larger steps group in torch.
NATIVE_MAX_TOKENS = 256


class SparseMoE:
    """y = sum over each token's top-k experts of weight * down(silu(gate(x)) * up(x))."""

    def __init__(self, router: torch.Tensor, experts: list[tuple[Linear | QuantizedLinear,
                                                                 Linear | QuantizedLinear]],
                 top_k: int, normalize_top_k: bool) -> None:
        self.router = router  # float [num_experts, hidden]
        self.experts = experts  # (gate/up fused, down) per expert
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k  # renormalize the k chosen probabilities to 1
        self.experts_run = 0  # experts run since the count was last taken (each read once)
        self.native = native_experts(experts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        if self.native is not None and x.shape[0] <= NATIVE_MAX_TOKENS:
            gate_up, down = self.experts[0]
            out, experts_run = self.native.forward(x, chosen, weights, gate_up.max_gemv_rows,
                                                   down.max_gemv_rows)
            self.experts_run += experts_run
            return out
        if x.shape[0] == 1:  # one token (a lone decode): its experts in turn, nothing to group
            self.experts_run += self.top_k
            out = torch.zeros_like(x)
            for expert, weight in zip(chosen[0].tolist(), weights[0].tolist(), strict=True):
                gate_up, down = self.experts[expert]
                out.add_(down(silu_and_mul(gate_up(x))), alpha=weight)
            return out
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        self.experts_run += sum(1 for count in counts if count)
        slot_weights = weights.flatten().to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // self.top_k
            gate_up, down = self.experts[expert]
            y = down(silu_and_mul(gate_up(x.index_select(0, tokens))))
            out.index_add_(0, tokens, y * slot_weights[pairs, None])
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts and their float32 weights: a softmax over all experts,
        the k largest kept (renormalized where the family does), as transformers routes."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def parts(self) -> list[Linear | QuantizedLinear]:
        return [linear for expert in self.experts for linear in expert]

    @property
    def expert_numel(self) -> int:
        return sum(p.numel for p in self.parts())

    @property
    def expert_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts())

    def numel(self) -> int:
        return self.router.numel() + self.expert_numel

    @property
    def nbytes(self) -> int:
        """All experts' bytes: what the weights hold (a step reads only the chosen ones)."""
        return self.router.nbytes + self.expert_bytes

    @property
    def resident_bytes(self) -> int:
        return self.router.nbytes + sum(getattr(p, "resident_bytes", p.nbytes)
                                        for p in self.parts())


def native_experts(experts: list[tuple[Linear | QuantizedLinear, Linear | QuantizedLinear]]
                   ) -> object | None:
    """The native layer over the experts where every one is in GGUF blocks whose batch path is
    the integer GEMM (no dense copy, a type this build's GEMM takes), else None."""
    parts = [p for expert in experts for p in expert]
    if not all(isinstance(p, QuantizedLinear) and p.integer_gemm and p.bias is None
               for p in parts):
        return None
    return parts[0].kernels.QuantMoE([g.data for g, _ in experts], [g.qtypes for g, _ in experts],
                                     [d.data[0] for _, d in experts],
                                     [d.qtypes[0] for _, d in experts])
