"""Routed experts of an MoE block (unquantized weights) for the CPU — architecture.md sections 4 and 8.

:func:`routed_experts` runs the compiled kernel (csrc/moe.cpp) for decode-sized batches when the kernels are built
(:mod:`vllm_glm53.backends.cpu.kernels`): with a few tokens per expert the work is bound by reading each used
expert's weights once, and the per-expert torch loop pays, per expert, a gather, two small GEMMs (each an
OpenMP fork/join), the activation and a scatter-add on top of that. With many tokens per expert the work is
compute-bound and torch's GEMMs are as fast (float32) or faster (bfloat16 on CPUs that multiply it natively), so
larger batches keep the torch loop there; on CPUs without native 16-bit arithmetic, where torch's 16-bit GEMMs
are slow, 16-bit experts take the same loop with each product on the compiled ``linear16``
(:func:`routed_experts_widened`, backends/cpu/linear.py).
:func:`routed_experts_torch` is that loop, the reference the kernel is tested against.

:func:`route` is the router (csrc/moe_route.cpp; :func:`route_torch` the reference): ten small torch ops a block
and step in torch, one call compiled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_glm53.backends.cpu import kernels
from vllm_glm53.backends.cpu.linear import linear16, widens
from vllm_glm53.backends.dispatch import Op, compiled_kernels_check

__all__ = ["clamped_swiglu", "group_by_expert", "route", "routed_experts"]

# Mean (token, choice) pairs per expert above which 16-bit experts go through per-expert ``linear16`` products on a
# CPU without native 16-bit arithmetic (the measurement is in kernel_max_pairs).
WIDENED_MIN_PAIRS = 64
# Mean pairs per expert up to which bfloat16 experts stay on the kernel where it multiplies on AMX tiles.
AMX_KERNEL_MAX_PAIRS = 64


def kernel_max_pairs(dtype: torch.dtype) -> int | None:
    """Mean (token, choice) pairs per expert up to which the kernel takes weights of ``dtype`` (None: always).

    Measured on 2 threads of an AMD EPYC (AVX2), E = 8, k = 2, caches flushed, with experts of 9 or more tokens on
    the kernel's tile path (csrc/moe.cpp; 7 since): in float32 the kernel is ahead of the torch loop up to 256 pairs
    per expert at the released sizes (D = 4096, I = 2048: 885 vs 989 ms at 256, 236 vs 394 at 64) and even with
    it at 256-512 at D = 512, I = 256 (on an AMD EPYC Zen 5 with AVX-512, the avx512 kernel at the released sizes:
    0.43x the torch loop's time at 16 pairs, 0.78x at 64, 0.82x at 256, 0.87x at 512). Where the CPU has AVX512_BF16,
    torch's bfloat16 GEMMs run on its bf16 dot products and the kernel (which widens to float32) is ahead only of
    very small batches (same Zen 5, released sizes: 0.58x the loop's time at 2 pairs, 0.72x at 4, 0.95x at 5, 1.00x
    at 6, 1.19x at 8, 1.41x at 16, 2.3-2.4x from 64).
    Without native 16-bit arithmetic (every AVX2-only CPU) torch's 16-bit GEMMs convert inside and stay slower
    than the kernel at any batch; the per-expert products of :func:`routed_experts_widened` (``linear16``) take
    over above ``WIDENED_MIN_PAIRS``: bfloat16 at the released sizes, the two were even from 32 to 256 pairs
    (277 vs 280 ms at 64, 799 vs 750 at 256), the kernel 1.1x faster at 16; at D = 512 the kernel was 1.1-2.6x
    faster from 16 to 512.
    On an Intel Xeon with AMX the kernel multiplies bfloat16 experts on its tiles (csrc/moe.cpp, from 4 pairs per
    expert) and stays ahead of the torch loop (whose GEMMs run on AMX too) up to 64 pairs per expert: caches
    flushed, 2 threads, the loop's time / the kernel's 3.0 / 3.7 / 3.0 / 2.5 / 2.1 at 4 / 8 / 16 / 32 / 64 pairs (64
    experts, hidden 512), 1.34 / 1.35 / 1.19 / 1.14 / 1.04 (16 experts of the released size)."""
    if widens(dtype):
        return WIDENED_MIN_PAIRS
    if dtype == torch.bfloat16:
        return AMX_KERNEL_MAX_PAIRS if kernels.amx_tiles() else 6
    if dtype == torch.float32:
        return 256
    return 128 if dtype == torch.float16 else None


routed_experts = Op("routed_experts")
_expert_tensors = compiled_kernels_check(lambda x, w13, w2, ids, weights, swiglu_limit: (x, w13, w2, weights))


def _experts_check(x, w13, w2, ids, weights, swiglu_limit):
    if w13.dtype != w2.dtype:
        return f"needs one weight dtype, got {w13.dtype} and {w2.dtype}"
    limit = kernel_max_pairs(w13.dtype)
    if limit is not None and ids.numel() > limit * w13.shape[0]:
        return f"more than {limit} (token, expert) pairs per expert in {w13.dtype}: per-expert GEMMs are faster there"
    return _expert_tensors(x, w13, w2, ids, weights, swiglu_limit)


def _widened_check(x, w13, w2, ids, weights, swiglu_limit):
    if w13.dtype != w2.dtype:
        return f"needs one weight dtype, got {w13.dtype} and {w2.dtype}"
    if not widens(w13.dtype):
        return f"{w13.dtype} is not widened on this CPU (float32, or 16-bit with native arithmetic: torch's GEMMs)"
    return _expert_tensors(x, w13, w2, ids, weights, swiglu_limit)


@routed_experts.register("compiled", _experts_check)
def _routed_experts_compiled(x, w13, w2, ids, weights, swiglu_limit):
    return kernels.ops().moe_experts(x, w13, w2, ids, weights, float(swiglu_limit))


@routed_experts.register("widened", _widened_check)
def routed_experts_widened(x, w13, w2, ids, weights, swiglu_limit):
    """The loop of :func:`routed_experts_torch` with each product on the compiled ``linear16``."""
    return _per_expert(x, w13, w2, ids, weights, swiglu_limit, linear16)


@routed_experts.register("torch")
def routed_experts_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """Sum over each token's k chosen experts of ``weight * W2_e clamped_swiglu(W13_e x)``.

    x: ``[T, D]``; w13: ``[E, 2I, D]`` (rows: I gate, then I up); w2: ``[E, D, I]``; ids: ``[T, k]`` expert ids;
    weights: ``[T, k]`` float32 routing weights. Returns ``[T, D]`` float32.

    Plain torch (any device): one GEMM pair per expert that received tokens.
    """
    return _per_expert(x, w13, w2, ids, weights, swiglu_limit, F.linear)


route = Op("route")
_route_tensors = compiled_kernels_check(lambda logits, bias: (logits, bias))


def _route_check(router_logits, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    if n_group > 1 and topk_group < n_group:
        return f"group-limited routing ({topk_group} of {n_group} groups) is the torch form's"
    if router_logits.dtype != torch.float32 or (correction_bias is not None and correction_bias.dtype != torch.float32):
        return "needs float32 logits and bias"
    return _route_tensors(router_logits, correction_bias)


@route.register("compiled", _route_check)
def _route_compiled(router_logits, correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                    routed_scaling_factor):
    return kernels.ops().moe_route(router_logits, correction_bias, top_k, norm_topk_prob,
                                   float(routed_scaling_factor))


@route.register("torch")
def route_torch(
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


def _per_expert(x, w13, w2, ids, weights, swiglu_limit, linear) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    order, token_of, counts = group_by_expert(ids, w13.shape[0])
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        pairs = order[start : start + n]
        tokens = token_of[start : start + n]
        start += n
        h = clamped_swiglu(linear(x[tokens], w13[expert]), swiglu_limit)
        y = linear(h, w2[expert])
        out.index_add_(0, tokens, y.to(torch.float32) * weights.reshape(-1)[pairs, None])
    return out


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, choice) pairs by expert: ``(order [T*k], token of each sorted pair [T*k], rows per
    expert [E])``; ``order`` indexes the flattened ``[T, k]`` routing weights."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // ids.shape[1], counts


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """GLM-5.3's clamped SwiGLU (every MLP, expert and vision MLP): ``silu(min(g, L)) * clamp(u, -L, L)`` for
    ``gate_up [..., 2I]`` = [gate | up]; returns ``[..., I]`` in the input dtype. Only the gate's upper side is
    clamped (``swiglu_limit``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
