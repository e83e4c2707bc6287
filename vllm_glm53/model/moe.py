"""Dense MLP and mixture-of-experts blocks (architecture.md §4, §8), tensor-parallel over the intermediate
dimension.

Why not vLLM's fused MoE on CPU: its CPU expert kernels take only an activation name and silently drop
``swiglu_limit``, so GLM-5.3's clamped SwiGLU would be computed unclamped. The experts here are grouped per
expert (one GEMM pair per expert that received tokens), with routing from :mod:`.moe_routing`.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_glm53._vllm import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm_glm53.config import TextArch
from vllm_glm53.model.moe_routing import clamped_swiglu, route


class Glm5NextMLP(nn.Module):
    """Clamped-SwiGLU MLP: dense layers and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float, prefix: str,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, reduce_results=reduce_results, prefix=f"{prefix}.down_proj"
        )
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(clamped_swiglu(gate_up, self.swiglu_limit))
        return out


class Glm5NextMoE(nn.Module):
    """Sigmoid-routed experts plus an always-on shared expert. Each TP rank holds every expert's slice of the
    intermediate dimension; the partial outputs of routed and shared experts are summed in one all-reduce."""

    def __init__(self, arch: TextArch, prefix: str) -> None:
        super().__init__()
        self.arch = arch
        tp = get_tensor_model_parallel_world_size()
        if arch.moe_intermediate_size % tp:
            raise ValueError(f"moe_intermediate_size {arch.moe_intermediate_size} is not divisible by TP {tp}")
        self.tp_size, self.tp_rank = tp, get_tensor_model_parallel_rank()
        self.inter = arch.moe_intermediate_size // tp
        E, D = arch.n_routed_experts, arch.hidden_size
        # The router runs in float32 (as the reference does); the bias only steers the choice of experts.
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(E, D), requires_grad=False)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        # w13 rows: [gate (inter) ; up (inter)] per expert, the checkpoint's gate_proj/up_proj row slices.
        self.w13 = nn.Parameter(torch.empty(E, 2 * self.inter, D), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, D, self.inter), requires_grad=False)
        self.shared_experts = (
            Glm5NextMLP(D, arch.moe_intermediate_size * arch.n_shared_experts, arch.swiglu_limit,
                        f"{prefix}.shared_experts", reduce_results=False)
            if arch.n_shared_experts else None
        )

    def load_expert(self, expert: int, which: str, weight: torch.Tensor) -> None:
        """Copy this rank's slice of checkpoint tensor ``experts.{expert}.{which}.weight``."""
        lo, hi = self.tp_rank * self.inter, (self.tp_rank + 1) * self.inter
        if which == "gate_proj":
            self.w13.data[expert, : self.inter].copy_(weight[lo:hi])
        elif which == "up_proj":
            self.w13.data[expert, self.inter :].copy_(weight[lo:hi])
        elif which == "down_proj":
            self.w2.data[expert].copy_(weight[:, lo:hi])
        else:
            raise KeyError(which)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.arch
        logits = torch.nn.functional.linear(x.to(torch.float32), self.gate.weight.to(torch.float32))
        weights, ids = route(logits, self.gate.e_score_correction_bias, a.num_experts_per_tok, a.n_group,
                             a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=a.n_routed_experts).tolist()
        token_of = order // a.num_experts_per_tok
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            tokens = token_of[start : start + n]
            start += n
            h = clamped_swiglu(torch.nn.functional.linear(x[tokens], self.w13[expert]), a.swiglu_limit)
            y = torch.nn.functional.linear(h, self.w2[expert])
            out.index_add_(0, tokens, y.to(torch.float32) * weights.reshape(-1)[pairs, None])
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
