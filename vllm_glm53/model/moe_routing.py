"""MoE routing and the clamped SwiGLU activation (architecture.md sections 4 and 8)."""

from __future__ import annotations

import torch

# The activation lives with the expert ops (importable without vLLM, so the backends can use it too).
from vllm_glm53.backends.cpu.moe import clamped_swiglu

__all__ = ["route", "clamped_swiglu"]


def route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias ("noaux_tc") and group limiting.

    router_logits: ``[T, E]`` (computed in float32); correction_bias: ``[E]`` or None.
    Choice scores ``s + bias`` decide *which* experts (groups ranked by the sum of their two best choice scores,
    the best ``topk_group`` groups kept); the weights are the unbiased sigmoid scores of the chosen experts,
    normalised by ``sum + 1e-20`` if ``norm_topk_prob`` and multiplied by ``routed_scaling_factor``.
    Returns ``(weights [T, top_k] float32, ids [T, top_k] int64)``, ordered by descending choice score.
    """
    scores = torch.sigmoid(router_logits.to(torch.float32))
    choice = scores if correction_bias is None else scores + correction_bias.to(torch.float32)
    T, E = choice.shape
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep_groups = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


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
