"""Router and routed experts on GPUs: the CPU backend's plain-torch forms (:mod:`vllm_glm53.backends.cpu.moe`): the
router's torch ops, one GEMM pair per expert that received tokens, and the device-agnostic helpers. On GPUs the
plugin's quantized expert stacks run vLLM's fused MoE (:mod:`vllm_glm53.quant.experts`); this is the path of
unquantized (or dequantized-at-load) experts only.
"""

from __future__ import annotations

from vllm_glm53.backends.cpu.moe import clamped_swiglu, group_by_expert
from vllm_glm53.backends.cpu.moe import route_torch as route
from vllm_glm53.backends.cpu.moe import routed_experts_torch as routed_experts

__all__ = ["clamped_swiglu", "group_by_expert", "route", "routed_experts"]
