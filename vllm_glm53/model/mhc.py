"""mHC — manifold-constrained hyper-connections (architecture.md section 3).

The residual stream is ``n = hc_mult`` streams ``X [T, n, D]``. Around each sublayer F (attention or MLP) with
pre-norm N:
    pre, post, comb = mhc_coefficients(X, ...)          # fp32, from the flattened, RMS-normalised streams
    u  = mhc_collapse(X, pre)                           # sum_i pre_i X_i
    y  = F(N(u))
    X' = mhc_expand(X, y, post, comb)                   # X'_j = post_j y + sum_i comb[i, j] X_i
All coefficient maths and the final mix run in float32 (as vLLM does; transformers mixes in the model dtype) and
results are cast back to the stream dtype.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["mhc_coefficients", "mhc_collapse", "mhc_expand", "MHCParams"]


def mhc_coefficients(
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
    n = hc_mult
    x = X.reshape(X.shape[0], -1).to(torch.float32)
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    m = x @ fn.to(torch.float32).t()  # [T, (2+n)n]
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


def mhc_collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``u = sum_i pre_i X_i``: ``[T, n, D] -> [T, D]``, float32 accumulation, returned in ``X.dtype``."""
    return (pre.to(torch.float32).unsqueeze(-1) * X.to(torch.float32)).sum(dim=1).to(X.dtype)


def mhc_expand(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'_j = post_j y + sum_i comb[i, j] X_i`` (``X' = post (x) y + comb^T X``): ``[T, n, D]``, float32 maths,
    returned in ``X.dtype``."""
    mixed = torch.matmul(comb.to(torch.float32).transpose(-1, -2), X.to(torch.float32))
    return (post.to(torch.float32).unsqueeze(-1) * y.to(torch.float32).unsqueeze(1) + mixed).to(X.dtype)


class MHCParams(nn.Module):
    """The three float32 tensors of one mHC block (checkpoint ``hc_attn_{fn,base,scale}`` or
    ``hc_ffn_{fn,base,scale}``) and the two halves of the block around a sublayer."""

    def __init__(
        self, hidden_size: int, hc_mult: int, hc_eps: float, sinkhorn_iters: int, norm_eps: float
    ) -> None:
        super().__init__()
        n = hc_mult
        self.hc_mult = n
        self.hc_eps = hc_eps
        self.sinkhorn_iters = sinkhorn_iters
        self.norm_eps = norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)

    def pre(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``X [T, n, D] -> (u [T, D] in X.dtype, post [T, n], comb [T, n, n])``: the sublayer input and the
        coefficients :meth:`post` needs afterwards."""
        pre, post, comb = mhc_coefficients(
            X, self.fn, self.base, self.scale, self.hc_mult, self.hc_eps, self.sinkhorn_iters, self.norm_eps
        )
        return mhc_collapse(X, pre), post, comb

    def post(self, X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Streams after the block: :func:`mhc_expand` of the block's input streams X and sublayer output y."""
        return mhc_expand(X, y, post, comb)
