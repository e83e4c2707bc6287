"""MoE routing and the clamped SwiGLU activation (architecture.md sections 4 and 8), and the expert-parallel split of
routed pairs."""

from __future__ import annotations

import torch

# The router and the activation live with the expert ops (importable without vLLM, so the backends use them too).
from vllm_glm53.backends.cpu.moe import clamped_swiglu, route

__all__ = ["route", "clamped_swiglu", "local_expert_pairs"]


def local_expert_pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, first_expert: int, num_local: int,
                       run) -> torch.Tensor:
    """Expert parallel: the routed output of the experts ``[first_expert, first_expert + num_local)`` only, float32
    ``[T, D]`` (zero rows for tokens none of them received). Each (token, choice) pair routed to one of them becomes a
    one-expert row for ``run(x_rows, local_ids [P, 1], weights [P, 1])``, which returns ``[P, D]``; the pairs of one
    token are summed back into its row."""
    local = ids - first_expert
    token, choice = ((local >= 0) & (local < num_local)).nonzero(as_tuple=True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if token.numel():
        y = run(x[token], local[token, choice].unsqueeze(1), weights[token, choice].unsqueeze(1))
        out.index_add_(0, token, y.to(torch.float32))
    return out
