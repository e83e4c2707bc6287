"""mHC (manifold-constrained hyper-connections) for the CPU — architecture.md section 3; the maths is explained in
:mod:`vllm_glm53.model.mhc`.

Each op is an :class:`~vllm_glm53.backends.dispatch.Op` with a ``compiled`` implementation (csrc/mhc.cpp), used
when the kernels are built: the RMS normalisation of the flattened streams with the GEMM by ``fn`` (the kernel's
own dot products for a decode step's few tokens, torch's GEMM for more), the sigmoid / softmax / Sinkhorn steps
per token, the collapse and the expand. In plain torch the coefficients alone are some 150 tiny ops per block,
two blocks per decoder layer per step, and their dispatch cost weighs on a small-batch decode. The plain forms
are kept under ``*_torch`` names, the reference the kernels are tested against; the kernels follow their order of
operations (the GEMM's sums aside), so both agree to float32 rounding.
"""

from __future__ import annotations

import torch

from vllm_glm53.backends.cpu import kernels
from vllm_glm53.backends.dispatch import Op, compiled_kernels_check

__all__ = ["mhc_coefficients", "mhc_collapse", "mhc_expand"]


mhc_coefficients = Op("mhc_coefficients")
mhc_collapse = Op("mhc_collapse")
mhc_expand = Op("mhc_expand")


@mhc_coefficients.register("compiled", compiled_kernels_check(lambda X, fn, base, scale, *a, **k: (X, fn, base, scale)))
def _mhc_coefficients_compiled(X, fn, base, scale, hc_mult, eps, sinkhorn_iters, norm_eps):
    ops = kernels.ops()
    return ops.mhc_coefficients(ops.mhc_mix(X, fn, norm_eps), base, scale, hc_mult, eps, sinkhorn_iters)


@mhc_coefficients.register("torch")
def mhc_coefficients_torch(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_mult: int,
    eps: float,
    sinkhorn_iters: int,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients of one mHC block.

    X: ``[T, n, D]``; fn: ``[(2+n)n, nD]`` (rows: n "pre", n "post", n*n "comb" row-major); base: ``[(2+n)n]``;
    scale: ``[3]`` = (s_pre, s_post, s_comb); eps = ``hc_eps``; norm_eps = ``rms_norm_eps`` of the unweighted
    RMS norm over all n*D values.
    Returns float32 ``pre [T, n]``, ``post [T, n]`` in (0, 2) and ``comb [T, n, n]`` (Sinkhorn-normalised,
    columns sum to 1; ``comb[i, j]`` weighs input stream i into output stream j).
    """
    m = mhc_rms_norm_torch(X, norm_eps) @ fn.to(torch.float32).t()  # [T, (2+n)n]
    return mhc_coefficients_from_mix_torch(m, base, scale, hc_mult, eps, sinkhorn_iters)


def mhc_rms_norm_torch(X: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``[T, n, D] -> [T, nD]`` float32: each token's flattened streams over their RMS (no weight)."""
    x = X.reshape(X.shape[0], -1).to(torch.float32)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)


def mhc_coefficients_from_mix_torch(
    m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_mult: int, eps: float, sinkhorn_iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre, post, comb from the GEMM output ``m [T, (2+n)n]`` (float32)."""
    n = hc_mult
    base = base.to(torch.float32)
    s_pre, s_post, s_comb = scale.to(torch.float32).unbind(0)
    pre = torch.sigmoid(m[:, :n] * s_pre + base[:n]) + eps
    post = 2.0 * torch.sigmoid(m[:, n : 2 * n] * s_post + base[n : 2 * n])
    comb_logits = m[:, 2 * n :].view(-1, n, n) * s_comb + base[2 * n :].view(n, n)
    comb = torch.softmax(comb_logits, dim=-1) + eps
    # Sinkhorn: column, then (sinkhorn_iters - 1) x (row, column); ends column-normalised.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


@mhc_collapse.register("compiled", compiled_kernels_check(lambda X, pre: (X, pre)))
def _mhc_collapse_compiled(X, pre):
    return kernels.ops().mhc_collapse(X, pre)


@mhc_collapse.register("torch")
def mhc_collapse_torch(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``u = sum_i pre_i X_i``: ``[T, n, D] -> [T, D]``, float32 accumulation, returned in ``X.dtype``."""
    return (pre.to(torch.float32).unsqueeze(-1) * X.to(torch.float32)).sum(dim=1).to(X.dtype)


_expand_tensors = compiled_kernels_check(lambda X, y, post, comb: (X, y, post, comb))


def _expand_check(X, y, post, comb):
    if y.dtype != X.dtype:
        return f"reads y in the streams' dtype {X.dtype}, got {y.dtype}"
    return _expand_tensors(X, y, post, comb)


@mhc_expand.register("compiled", _expand_check)
def _mhc_expand_compiled(X, y, post, comb):
    return kernels.ops().mhc_expand(X, y, post, comb)


@mhc_expand.register("torch")
def mhc_expand_torch(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'_j = post_j y + sum_i comb[i, j] X_i`` (``X' = post (x) y + comb^T X``): ``[T, n, D]``, float32 maths,
    returned in ``X.dtype``."""
    mixed = torch.matmul(comb.to(torch.float32).transpose(-1, -2), X.to(torch.float32))
    return (post.to(torch.float32).unsqueeze(-1) * y.to(torch.float32).unsqueeze(1) + mixed).to(X.dtype)
