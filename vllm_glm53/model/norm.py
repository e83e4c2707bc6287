"""RMSNorm with transformers' rounding: statistics in float32, the normalised value cast back to the input
dtype before the weight multiplies it. (vLLM's fused RMSNorm multiplies in float32, which in bf16 gives
different last bits; parity with the reference matters more here than the fused kernel.)"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
