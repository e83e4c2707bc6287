"""Routed-expert stacks of the MoE blocks for quantized checkpoints (chosen by :mod:`.plan`).

Every stack has the interface of ``model.moe.StackedExperts`` (the unquantized one):
``load(expert, which, leaf, tensor) -> [parameter names filled]`` for checkpoint tensor
``experts.{expert}.{which}.{leaf}`` (``tensor`` a :class:`~.fp8.BlockFp8Weight` for FP8 weights), and
``forward(x, router_logits) -> float32 [T, D]``, this TP rank's share of the routed output (summed over ranks by
the MoE block). Each rank holds every expert's slice ``[lo, hi)`` of the intermediate dimension.

:class:`CpuFp8Experts` keeps the checkpoint's E4M3 bytes and block scales for the CPU kernels. The Ascend stacks keep their weights in the grouped-matmul layout, ``[E, K, N]`` with the scales beside, and
write each expert into it as it streams in, so no second copy is made after loading.

:class:`BlockFp8Mxfp8MoEMethod` is the same MXFP8 computation as a vLLM fused-MoE method, for the experts of
another model class built from vLLM layers (vllm-ascend's GLM5Next, :mod:`.configs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vllm_glm53 import _vllm
from vllm_glm53.backends.cpu.moe import clamped_swiglu, group_by_expert
from vllm_glm53.quant import npu
from vllm_glm53.quant.fp8 import BlockFp8Weight
from vllm_glm53.quant.mxfp8 import GROUP
from vllm_glm53.quant.w8a8 import W8A8_DYNAMIC, w8a8_matmul

Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits -> (weights [T,k], ids [T,k])


def combine(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
            tokens: torch.Tensor) -> torch.Tensor:
    """Sum the sorted expert outputs ``y`` back per token, weighted, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, y.float() * weights.reshape(-1)[order, None])


class _ShardedExperts(nn.Module):
    """Shape bookkeeping shared by the Ascend stacks: ``w13 [E, D, 2I]`` (gate | up columns) and ``w2 [E, I, D]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp_rank: int, swiglu_limit: float,
                 router: Router) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.lo, self.hi = tp_rank * inter, (tp_rank + 1) * inter
        self.swiglu_limit = swiglu_limit
        self.router = router

    def _columns(self, which: str) -> slice:
        return slice(0, self.inter) if which == "gate_proj" else slice(self.inter, 2 * self.inter)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(router_logits)
        order, tokens, counts = group_by_expert(ids, self.num_experts)
        group_list = counts.cumsum(0)
        h = clamped_swiglu(self._gemm13(x[tokens], group_list), self.swiglu_limit)
        return combine(x, self._gemm2(h, group_list), weights, order, tokens)


class Mxfp8Experts(_ShardedExperts):
    """Ascend 950: block-FP8 experts re-grouped to MXFP8 at load, run by ``npu_grouped_matmul`` in MX mode."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp_rank: int, swiglu_limit: float,
                 router: Router) -> None:
        super().__init__(num_experts, hidden, inter, tp_rank, swiglu_limit, router)
        if hidden % GROUP or inter % GROUP:
            raise ValueError(f"MXFP8 experts need hidden ({hidden}) and per-rank intermediate ({inter}) sizes "
                             f"that are multiples of {GROUP}")
        E, D, I = num_experts, hidden, inter
        self.w13 = nn.Parameter(torch.empty(E, D, 2 * I, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.empty(E, math.ceil(D / 64), 2 * I, 2, dtype=torch.uint8),
                                      requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, I, D, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.empty(E, math.ceil(I / 64), D, 2, dtype=torch.uint8),
                                     requires_grad=False)

    def load(self, expert: int, which: str, leaf: str, tensor) -> list[str]:
        if leaf != "weight" or not isinstance(tensor, BlockFp8Weight):
            raise ValueError(f"experts.{expert}.{which}.{leaf}: expected a block-FP8 weight")
        weight, scale = tensor.to_mxfp8()  # [N, K], [N, K/32] of the whole checkpoint tensor
        if which == "down_proj":
            weight, scale = weight[:, self.lo : self.hi], scale[:, self.lo // GROUP : self.hi // GROUP]
            self.w2.data[expert], self.w2_scale.data[expert] = npu.mx_weight_layout(weight, scale)
            return ["w2", "w2_scale"]
        cols = self._columns(which)
        w_kn, s_packed = npu.mx_weight_layout(weight[self.lo : self.hi], scale[self.lo : self.hi])
        self.w13.data[expert, :, cols] = w_kn
        self.w13_scale.data[expert, :, cols] = s_packed
        return ["w13", "w13_scale"]

    def _gemm13(self, x, group_list):
        return npu.mx_grouped_matmul(x, self.w13, self.w13_scale, group_list)

    def _gemm2(self, h, group_list):
        return npu.mx_grouped_matmul(h, self.w2, self.w2_scale, group_list)


class W8A8Experts(_ShardedExperts):
    """msmodelslim W8A8_DYNAMIC experts: int8 weights with per-output-channel scales, per-token int8
    activations; ``npu_grouped_matmul`` on Ascend, one reference product per expert elsewhere."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp_rank: int, swiglu_limit: float,
                 router: Router, on_npu: bool) -> None:
        super().__init__(num_experts, hidden, inter, tp_rank, swiglu_limit, router)
        E, D, I = num_experts, hidden, inter
        self.on_npu = on_npu
        self.w13 = nn.Parameter(torch.empty(E, D, 2 * I, dtype=torch.int8), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.empty(E, 2 * I, dtype=torch.float32), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, I, D, dtype=torch.int8), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.empty(E, D, dtype=torch.float32), requires_grad=False)

    def load(self, expert: int, which: str, leaf: str, tensor) -> list[str]:
        if leaf == "weight_offset":
            if bool(tensor.any()):
                raise ValueError(f"experts.{expert}.{which}.weight_offset is not zero; only symmetric w8a8 is served")
            return []
        down = which == "down_proj"
        if leaf == "weight":  # [N, K] int8 -> this rank's slice, transposed into [K, N]
            part = tensor[:, self.lo : self.hi] if down else tensor[self.lo : self.hi]
            if down:
                self.w2.data[expert] = part.t()
            else:
                self.w13.data[expert, :, self._columns(which)] = part.t()
            return ["w2" if down else "w13"]
        if leaf == "weight_scale":  # per output channel [N, 1]; down_proj's outputs are not split
            scale = tensor.reshape(-1)
            if down:
                self.w2_scale.data[expert] = scale
            else:
                self.w13_scale.data[expert, self._columns(which)] = scale[self.lo : self.hi]
            return ["w2_scale" if down else "w13_scale"]
        raise ValueError(f"experts.{expert}.{which}.{leaf}: not part of a {W8A8_DYNAMIC} expert")

    def _grouped(self, x, weight, scale, group_list):
        if self.on_npu:
            return npu.w8a8_grouped_matmul(x, weight, scale, group_list)
        out = torch.empty(x.shape[0], weight.shape[-1], dtype=x.dtype, device=x.device)
        start = 0
        for expert, end in enumerate(group_list.tolist()):
            if end > start:
                out[start:end] = w8a8_matmul(x[start:end], weight[expert], scale[expert])
            start = end
        return out

    def _gemm13(self, x, group_list):
        return self._grouped(x, self.w13, self.w13_scale, group_list)

    def _gemm2(self, h, group_list):
        return self._grouped(h, self.w2, self.w2_scale, group_list)


class CpuFp8Experts(nn.Module):
    """CPU: block-FP8 experts kept as E4M3 bytes with their block scales, run by the compiled
    ``moe_experts_fp8`` (backends/cpu/fp8.py), which dequantizes inside its products.

    ``w13 [E, 2I, D]`` (rows gate | up: the checkpoint's gate_proj / up_proj row slices) with ``w13_scale_inv
    [E, 2 ceil(I/bn), ceil(D/bk)]`` (gate blocks, then up blocks: each half keeps its own ragged last block) and
    ``w2 [E, D, I]`` with ``w2_scale_inv [E, ceil(D/bn), ceil(I/bk)]``; each rank holds every expert's slice
    ``[lo, hi)`` of the intermediate dimension, which must start on a block edge. Expert parallel (``first_expert``,
    ``num_local``): whole experts ``[first_expert, first_expert + num_local)`` only (``E`` is then ``num_local``),
    the others' checkpoint tensors skipped; the kernel runs the (token, choice) pairs routed to them.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, tp_rank: int, swiglu_limit: float,
                 router: Router, block: tuple[int, int], first_expert: int = 0, num_local: int | None = None) -> None:
        super().__init__()
        bn, bk = self.block = tuple(int(b) for b in block)
        self.num_experts, self.inter, self.swiglu_limit, self.router = num_experts, inter, swiglu_limit, router
        self.lo, self.hi = tp_rank * inter, (tp_rank + 1) * inter
        self.first_expert = first_expert
        self.num_local = num_experts if num_local is None else num_local
        self.partitioned = self.num_local != num_experts
        reason = self.slice_reason(inter, tp_rank, block)
        if reason:
            raise ValueError(f"FP8 experts: {reason}")
        E, D, I = self.num_local, hidden, inter
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, D, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w13_scale_inv = nn.Parameter(torch.full((E, 2 * math.ceil(I / bn), math.ceil(D / bk)), -1.0),
                                          requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, D, I, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w2_scale_inv = nn.Parameter(torch.full((E, math.ceil(D / bn), math.ceil(I / bk)), -1.0),
                                         requires_grad=False)

    @staticmethod
    def slice_reason(inter: int, tp_rank: int, block: tuple[int, int]) -> str | None:
        """Why this rank's slice of the intermediate dimension cannot keep its FP8 blocks (None: it can)."""
        lo = tp_rank * inter
        if lo % block[0] or lo % block[1]:
            return f"this rank's intermediate slice starts at {lo}, inside a {list(block)} block"
        return None

    def load(self, expert: int, which: str, leaf: str, tensor) -> list[str]:
        if leaf != "weight" or not isinstance(tensor, BlockFp8Weight):
            raise ValueError(f"experts.{expert}.{which}.{leaf}: expected a block-FP8 weight")
        if tuple(tensor.block) != self.block:
            raise ValueError(f"experts.{expert}.{which}: FP8 block {list(tensor.block)}, expected {list(self.block)}")
        if not 0 <= expert - self.first_expert < self.num_local:
            return []  # another expert-parallel rank's expert
        expert -= self.first_expert
        bn, bk = self.block
        weight, scale = tensor.weight, tensor.scale_inv
        if which == "down_proj":
            self.w2.data[expert].copy_(weight[:, self.lo : self.hi])
            self.w2_scale_inv.data[expert].copy_(scale[:, self.lo // bk : math.ceil(self.hi / bk)])
            return ["w2", "w2_scale_inv"]
        half = 0 if which == "gate_proj" else 1
        nb = math.ceil(self.inter / bn)
        self.w13.data[expert, half * self.inter : (half + 1) * self.inter].copy_(weight[self.lo : self.hi])
        self.w13_scale_inv.data[expert, half * nb : (half + 1) * nb].copy_(
            scale[self.lo // bn : math.ceil(self.hi / bn)])
        return ["w13", "w13_scale_inv"]

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        from vllm_glm53.backends.cpu.fp8 import routed_experts_fp8

        from vllm_glm53.model.moe_routing import local_expert_pairs

        weights, ids = self.router(router_logits)

        def run(rows, rows_ids, rows_weights):
            return routed_experts_fp8(rows, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, rows_ids,
                                      rows_weights, self.swiglu_limit, self.block)

        if not self.partitioned:
            return run(x, ids, weights)
        return local_expert_pairs(x, ids, weights, self.first_expert, self.num_local, run)


class FusedFp8Experts(nn.Module):
    """CUDA/ROCm: the block-FP8 experts in vLLM's fused MoE (its ``Fp8MoEMethod`` kernels), with GLM-5.3's
    clamped SwiGLU (``swiglu_limit``) and the plugin's own routing rule as vLLM's custom routing function.

    ``fp8_config`` is vLLM's ``Fp8Config`` (None gives vLLM's unquantized method: how the CPU test checks the
    wiring)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, swiglu_limit: float,
                 router: Router, fp8_config, prefix: str) -> None:
        super().__init__()
        self.runner = _vllm.FusedMoEFactory(
            num_experts=num_experts, top_k=top_k, hidden_size=hidden, intermediate_size=intermediate,
            quant_config=fp8_config, prefix=prefix, scoring_func="sigmoid", routed_scaling_factor=1.0,
            custom_routing_function=lambda hidden_states, gating_output, topk, renormalize: router(gating_output),
            swiglu_limit=swiglu_limit, reduce_results=False,  # the MoE block all-reduces routed + shared once
            router_logits_dtype=torch.float32,
        )

    def load(self, expert: int, which: str, leaf: str, tensor) -> list[str]:
        experts = self.runner.routed_experts
        stem, shard = {"gate_proj": ("w13", "w1"), "up_proj": ("w13", "w3"), "down_proj": ("w2", "w2")}[which]
        parts = ([("weight", tensor.weight), ("weight_scale_inv", tensor.scale_inv)]
                 if isinstance(tensor, BlockFp8Weight) else [(leaf, tensor)])
        names = {id(p): n for n, p in self.named_parameters()}
        filled = []
        for suffix, part in parts:
            param = getattr(experts, f"{stem}_{suffix}")
            experts.weight_loader(param, part, f"{stem}_{suffix}", shard, expert)
            filled.append(names[id(param)])
        return filled

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.runner(hidden_states=x, router_logits=router_logits).float()


@dataclass
class AscendExpertsResult:
    """What vllm-ascend's experts layer (``AscendRoutedExperts.forward_impl``) reads from its method's
    ``apply``: the routed output, and the tokens per local expert (``group_list_type`` 1: counts, not cumulative)
    for its dynamic expert load balancer."""

    routed_out: torch.Tensor
    expert_tokens: torch.Tensor
    group_list_type: int = 1


class BlockFp8Mxfp8MoEMethod(_vllm.FusedMoEMethodBase):
    """The MXFP8 experts for a vLLM ``RoutedExperts`` layer whose model loads the block-FP8 checkpoint itself
    (vllm-ascend's GLM5Next on Ascend 950, :mod:`.configs`).

    Parameters are the checkpoint's, as vLLM's block-FP8 MoE method declares them (``w13_weight [E, 2I, D]``,
    ``w2_weight [E, D, I]`` E4M3 and their ``*_weight_scale_inv`` block scales, loaded by vLLM's expert weight
    loader), so the model's ``load_weights`` runs unchanged. After loading every expert is re-grouped to MXFP8
    and moved to the grouped-matmul layout of :class:`Mxfp8Experts`, one expert at a time; ``apply`` then runs
    the same two ``npu_grouped_matmul`` calls on the routing the layer's router chose, with the layer's
    ``swiglu_limit``. The output is this rank's share (the layer's runner reduces it over TP ranks); for
    vllm-ascend's experts layer it comes wrapped as :class:`AscendExpertsResult`, which that layer hands to its
    communication method's ``finalize``.
    """

    def __init__(self, moe_config, block_size: tuple[int, int]) -> None:
        super().__init__(moe_config)
        self.block_size = tuple(int(b) for b in block_size)

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        from vllm_glm53.quant.linear import UNLOADED_SCALE

        E, D, I = num_experts, hidden_size, intermediate_size_per_partition
        if D % GROUP or I % GROUP:
            raise ValueError(f"MXFP8 experts need hidden ({D}) and per-rank intermediate ({I}) sizes that are "
                             f"multiples of {GROUP}")
        _vllm.validate_fp8_block_shape_moe(I, list(self.block_size))  # whole blocks per rank, as vLLM's loader needs
        bn, bk = self.block_size
        layer.weight_block_size = list(self.block_size)
        params = {
            "w13_weight": torch.empty(E, 2 * I, D, dtype=torch.float8_e4m3fn),
            "w2_weight": torch.empty(E, D, I, dtype=torch.float8_e4m3fn),
            "w13_weight_scale_inv": torch.full((E, 2 * math.ceil(I / bn), math.ceil(D / bk)), UNLOADED_SCALE),
            "w2_weight_scale_inv": torch.full((E, math.ceil(D / bn), math.ceil(I / bk)), UNLOADED_SCALE),
        }
        for name, data in params.items():
            param = nn.Parameter(data, requires_grad=False)
            layer.register_parameter(name, param)
            attrs = dict(extra_weight_attrs)
            if name.endswith("_scale_inv"):  # tells vLLM's expert loader to shard these per block
                attrs["quant_method"] = _vllm.FusedMoeWeightScaleSupported.BLOCK.value
            for key, value in attrs.items():
                setattr(param, key, value)

    def process_weights_after_loading(self, layer) -> None:
        from vllm_glm53.quant.linear import UNLOADED_SCALE
        from vllm_glm53.quant.mxfp8 import regroup

        for stem in ("w13", "w2"):
            weight, scale_inv = getattr(layer, f"{stem}_weight").data, getattr(layer, f"{stem}_weight_scale_inv").data
            if bool((scale_inv == UNLOADED_SCALE).any()):
                raise ValueError(f"{layer.layer_name}: some experts got no {stem}_weight_scale_inv from the checkpoint")
            # gate | up are whole blocks each (checked in create_weights), so w13 re-groups as one tensor
            E, N, K = weight.shape
            kernel_w = torch.empty(E, K, N, dtype=torch.float8_e4m3fn, device=weight.device)
            kernel_s = torch.empty(E, math.ceil(K / 64), N, 2, dtype=torch.uint8, device=weight.device)
            for e in range(E):
                kernel_w[e], kernel_s[e] = npu.mx_weight_layout(*regroup(weight[e], scale_inv[e], self.block_size))
            delattr(layer, f"{stem}_weight_scale_inv")
            setattr(layer, f"{stem}_weight", nn.Parameter(kernel_w, requires_grad=False))
            setattr(layer, f"{stem}_weight_scale", nn.Parameter(kernel_s, requires_grad=False))

    def get_fused_moe_quant_config(self, layer):
        return None  # no vLLM kernel runs these experts

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        if getattr(layer, "expert_map", None) is not None:
            raise NotImplementedError("MXFP8 experts serve tensor parallelism only, not expert parallelism")
        if layer.apply_router_weight_on_input or getattr(layer.activation, "value", layer.activation) != "silu":
            raise NotImplementedError(f"{layer.layer_name}: MXFP8 experts run SiLU-gated experts weighted after "
                                      "the down projection")
        limit = math.inf if layer.swiglu_limit is None else layer.swiglu_limit
        order, tokens, counts = group_by_expert(topk_ids.long(), layer.w13_weight.shape[0])
        group_list = counts.cumsum(0)
        up = npu.mx_grouped_matmul(x[tokens], layer.w13_weight, layer.w13_weight_scale, group_list)
        down = npu.mx_grouped_matmul(clamped_swiglu(up, limit), layer.w2_weight, layer.w2_weight_scale, group_list)
        out = combine(x, down, topk_weights, order, tokens).to(x.dtype)
        if type(layer).__module__.startswith("vllm_ascend."):
            return AscendExpertsResult(out, counts)
        return out
