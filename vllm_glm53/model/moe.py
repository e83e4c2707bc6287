"""Dense MLP and mixture-of-experts blocks (architecture.md §4, §8), tensor-parallel over the intermediate
dimension, or with ``--enable-expert-parallel`` (unquantized experts, and block-FP8 ones on CPU) the routed experts
partitioned whole across vLLM's expert-parallel group, its DP x TP ranks: rank r holds experts
``[r E/ep, (r+1) E/ep)`` with their full intermediate dimension, in the same stacked ``[experts, out, in]`` layout,
and computes the (token, expert) pairs routed to them; the shared expert stays sliced over TP. With TP only, one TP
all-reduce sums both kinds of partial output; across DP ranks every MoE block first gathers all DP ranks' tokens
(:meth:`Glm5NextMoE.forward_across_dp`) and one all-reduce over the EP group sums the partials.

Why not vLLM's fused MoE on CPU: its CPU expert kernels take only an activation name and silently drop
``swiglu_limit``, so GLM-5.3's clamped SwiGLU would be computed unclamped. The experts here run through
``moe_ops.routed_experts`` (a compiled kernel for decode-sized CPU batches, else one GEMM pair per expert that
received tokens), with routing from :mod:`.moe_routing`. Quantized
checkpoints swap the expert stack for one of :mod:`vllm_glm53.quant.experts` (vLLM's fused MoE on CUDA, the
Ascend grouped matmuls on NPU, FP8-resident experts on CPU) and hand ``quant_config`` to the linear layers, as the plan says
(:mod:`vllm_glm53.quant.plan`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from vllm_glm53 import _vllm
from vllm_glm53._vllm import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm_glm53.backends import moe_ops
from vllm_glm53.config import TextArch
from vllm_glm53.model.moe_routing import clamped_swiglu, local_expert_pairs
from vllm_glm53.quant import experts as quant_experts
from vllm_glm53.quant.fp8 import BlockFp8Weight
from vllm_glm53.quant.linear import fp8_mlp
from vllm_glm53.quant.plan import LayerQuant, layer_quant

logger = logging.getLogger("vllm_glm53")


class Glm5NextMLP(nn.Module):
    """Clamped-SwiGLU MLP: dense layers and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float, prefix: str,
                 reduce_results: bool = True) -> None:
        super().__init__()
        quant_config = layer_quant()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, reduce_results=reduce_results, quant_config=quant_config,
            prefix=f"{prefix}.down_proj"
        )
        self.swiglu_limit = swiglu_limit
        self.all_reduce = reduce_results and get_tensor_model_parallel_world_size() > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_mlp(self.gate_up_proj, self.down_proj, x, self.swiglu_limit)  # FP8-resident on CPU, decode
        if out is not None:
            return tensor_model_parallel_all_reduce(out) if self.all_reduce else out
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(clamped_swiglu(gate_up, self.swiglu_limit))
        return out


class Glm5NextMoE(nn.Module):
    """Sigmoid-routed experts plus an always-on shared expert. Each TP rank holds every expert's slice of the
    intermediate dimension (or, under expert parallel, its range of whole experts); the partial outputs of routed and
    shared experts are summed in one all-reduce (over TP, or over the EP group across DP ranks)."""

    def __init__(self, arch: TextArch, prefix: str) -> None:
        super().__init__()
        self.arch = arch
        tp = get_tensor_model_parallel_world_size()
        if arch.moe_intermediate_size % tp:
            raise ValueError(f"moe_intermediate_size {arch.moe_intermediate_size} is not divisible by TP {tp}")
        self.tp_size, self.tp_rank = tp, get_tensor_model_parallel_rank()
        E, D = arch.n_routed_experts, arch.hidden_size
        self.ep_rank, self.ep_size = _vllm.expert_parallel_rank()
        self.dp_rank, self.dp_size = _vllm.data_parallel_rank()
        # EP over DP ranks: every DP rank's tokens must meet every rank's experts (forward_across_dp)
        self.exchange = self.ep_size > 1 and self.dp_size > 1
        if E % self.ep_size:
            raise ValueError(f"--enable-expert-parallel: {E} routed experts cannot be split evenly over "
                             f"{self.ep_size} ranks")
        # The router runs in float32 (as the reference does); the bias only steers the choice of experts. Its weight
        # (bfloat16 in the checkpoint) is held in float32, an exact widening done once at load: converting it every
        # step read it and wrote a float32 copy of E x D per MoE block (the released model: ~300 MB per decode step,
        # 1-2 % of the weights a CPU decode step reads), for 2.4 MB more memory per block.
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(E, D, dtype=torch.float32), requires_grad=False)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
        self.experts = _routed_experts(arch, layer_quant(), prefix, self.tp_rank, tp,
                                       Router(arch, self.gate.e_score_correction_bias), self.ep_rank, self.ep_size)
        self.shared_experts = (
            Glm5NextMLP(D, arch.moe_intermediate_size * arch.n_shared_experts, arch.swiglu_limit,
                        f"{prefix}.shared_experts", reduce_results=False)
            if arch.n_shared_experts else None
        )

    def load_expert(self, expert: int, which: str, leaf: str, tensor) -> list[str]:
        """Checkpoint tensor ``experts.{expert}.{which}.{leaf}`` -> this rank's slice; returns the names (relative
        to this block) of the parameters it filled."""
        return [f"experts.{name}" for name in self.experts.load(expert, which, leaf, tensor)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exchange:
            return self.forward_across_dp(x)
        logits = torch.nn.functional.linear(x.to(torch.float32), self.gate.weight)
        out = self.experts(x, logits).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def forward_across_dp(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallel over DP x TP ranks. Every DP rank's hidden states are all-gathered (each padded to the
        step's largest count, which vLLM agreed on before the step: ``dp_token_counts`` reads it from the forward
        context), this rank routes all of them (the router is per token, so each token's choice is the one a
        single rank would make) and computes the pairs routed to its experts; its shared-expert partial (TP slice,
        local tokens) goes into its own DP rank's rows, and one all-reduce over the EP group sums routed and shared
        partials for every token. This DP rank keeps its rows. Idle DP ranks take part with vLLM's dummy batches
        (one token), so every rank runs every MoE block of every step."""
        n, hidden = x.shape
        counts = _vllm.dp_token_counts(n)
        rows = max(counts)
        if rows == 0:  # no rank has tokens this step (all skip alike: the counts are the same everywhere)
            return x.new_zeros(0, hidden)
        padded = x if n == rows else torch.cat([x, x.new_zeros(rows - n, hidden)])
        everyone = _vllm.dp_all_gather(padded)  # [dp * rows, hidden], DP rank order
        if any(c != rows for c in counts):  # drop the padding rows: they would be routed and computed for nothing
            keep = torch.cat([torch.arange(r * rows, r * rows + c) for r, c in enumerate(counts)])
            everyone = everyone.index_select(0, keep)
        logits = torch.nn.functional.linear(everyone.to(torch.float32), self.gate.weight)
        out = self.experts(everyone, logits).to(x.dtype)  # [sum(counts), hidden]: this rank's experts only
        start = sum(counts[: self.dp_rank])
        if self.shared_experts is not None:
            out[start : start + n] += self.shared_experts(x)
        out = _vllm.ep_all_reduce(out)
        return out[start : start + n]


class Router:
    """GLM-5.3's routing rule for one MoE block, applied to float32 router logits: ``(weights, ids)``."""

    def __init__(self, arch: TextArch, correction_bias: torch.Tensor) -> None:
        self.arch = arch
        self.correction_bias = correction_bias

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.arch
        return moe_ops.route(logits, self.correction_bias, a.num_experts_per_tok, a.n_group, a.topk_group,
                             a.norm_topk_prob, a.routed_scaling_factor)


class StackedExperts(nn.Module):
    """The experts' weights stacked in the model dtype: ``w13 [E_local, 2*I_tp, D]`` (rows gate | up, the checkpoint's
    gate_proj/up_proj row slices) and ``w2 [E_local, D, I_tp]``. FP8 checkpoints are dequantized into them at load
    where their experts do not stay FP8 (:mod:`vllm_glm53.quant.plan`).

    Tensor parallel: every expert, this rank's slice ``I_tp`` of each intermediate dimension. Expert parallel
    (``first_expert``, ``num_local``): whole experts ``[first_expert, first_expert + num_local)`` only, ``I_tp`` the
    full dimension; the other experts' checkpoint tensors are skipped, never allocated."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp_rank: int, swiglu_limit: float,
                 router: Router, first_expert: int = 0, num_local: int | None = None) -> None:
        super().__init__()
        self.num_experts, self.inter, self.swiglu_limit, self.router = num_experts, inter, swiglu_limit, router
        self.lo, self.hi = tp_rank * inter, (tp_rank + 1) * inter
        self.first_expert = first_expert
        self.num_local = num_experts if num_local is None else num_local
        self.partitioned = self.num_local != num_experts
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, inter), requires_grad=False)

    def load(self, expert: int, which: str, leaf: str, weight) -> list[str]:
        if leaf != "weight":
            raise ValueError(f"experts.{expert}.{which}.{leaf}: the checkpoint's experts are not quantized "
                             f"in a form this platform runs")
        if not 0 <= expert - self.first_expert < self.num_local:
            return []  # another expert-parallel rank's expert
        expert -= self.first_expert
        if isinstance(weight, BlockFp8Weight):
            weight = weight.dequantize(self.w13.dtype)
        if which == "down_proj":
            self.w2.data[expert].copy_(weight[:, self.lo : self.hi])
            return ["w2"]
        rows = slice(0, self.inter) if which == "gate_proj" else slice(self.inter, 2 * self.inter)
        self.w13.data[expert, rows].copy_(weight[self.lo : self.hi])
        return ["w13"]

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(router_logits)
        if not self.partitioned:
            return moe_ops.routed_experts(x, self.w13, self.w2, ids, weights, self.swiglu_limit)
        # Expert parallel: only the (token, choice) pairs routed to this rank's experts, each as a one-expert row.
        return local_expert_pairs(x, ids, weights, self.first_expert, self.num_local,
                                  lambda rows, rows_ids, rows_weights: moe_ops.routed_experts(
                                      rows, self.w13, self.w2, rows_ids, rows_weights, self.swiglu_limit))


def _routed_experts(arch: TextArch, quant: LayerQuant | None, prefix: str, tp_rank: int, tp_size: int,
                    router: Router, ep_rank: int = 0, ep_size: int = 1) -> nn.Module:
    """The expert stack the plan asks for: unquantized (or dequantized at load) unless the checkpoint stores
    the experts quantized and this platform runs them so."""
    E, D, inter = arch.n_routed_experts, arch.hidden_size, arch.moe_intermediate_size // tp_size
    scheme = quant.experts_scheme(prefix, E) if quant is not None else None
    if ep_size > 1 and (scheme is None or (scheme == "fp8" and quant.backend == "cpu")):
        local = E // ep_size
        if scheme is None:
            return StackedExperts(E, D, arch.moe_intermediate_size, 0, arch.swiglu_limit, router,
                                  first_expert=ep_rank * local, num_local=local)
        # the compiled FP8 kernel on this rank's whole experts (full intermediate dimension: no block is split)
        return quant_experts.CpuFp8Experts(E, D, arch.moe_intermediate_size, 0, arch.swiglu_limit, router,
                                           quant.block_size, first_expert=ep_rank * local, num_local=local)
    if ep_size > 1:
        raise ValueError(f"--enable-expert-parallel: the plugin's model partitions unquantized experts (and block-FP8 "
                         f"ones on CPU) only; this checkpoint's experts run as {scheme} here")
    if scheme is None:
        return StackedExperts(E, D, inter, tp_rank, arch.swiglu_limit, router)
    if scheme == "w8a8":
        return quant_experts.W8A8Experts(E, D, inter, tp_rank, arch.swiglu_limit, router,
                                         on_npu=quant.backend == "npu")
    if quant.backend == "npu":
        return quant_experts.Mxfp8Experts(E, D, inter, tp_rank, arch.swiglu_limit, router)
    if quant.backend == "cpu":
        reason = quant_experts.CpuFp8Experts.slice_reason(inter, tp_rank, quant.block_size)
        if reason is None:
            return quant_experts.CpuFp8Experts(E, D, inter, tp_rank, arch.swiglu_limit, router, quant.block_size)
        # the dequantize-at-load path, as for the linears whose TP share splits a block
        logger.warning("vllm-glm53: %s.experts stay dequantized on CPU: %s", prefix, reason)
        return StackedExperts(E, D, inter, tp_rank, arch.swiglu_limit, router)
    return quant_experts.FusedFp8Experts(E, arch.num_experts_per_tok, D, arch.moe_intermediate_size,
                                         arch.swiglu_limit, router, quant.vllm_fp8_config(),
                                         prefix=f"{prefix}.experts")
