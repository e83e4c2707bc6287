"""RMSNorm with transformers' rounding: statistics in float32, the normalised value cast back to the input
dtype before the weight multiplies it (vLLM's fused RMSNorm multiplies in float32, which in bf16 gives
different last bits; parity with the reference matters more here than the fused kernel). The arithmetic is the
``norm`` op family's (:mod:`vllm_glm53.backends.cpu.norm`)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_glm53.backends import norm_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_ops.rms_norm(x, self.weight, self.eps)
