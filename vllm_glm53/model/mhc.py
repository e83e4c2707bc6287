"""mHC — manifold-constrained hyper-connections (architecture.md section 3).

The residual stream is ``n = hc_mult`` streams ``X [T, n, D]``. Around each sublayer F (attention or MLP) with
pre-norm N:
    pre, post, comb = mhc_coefficients(X, ...)          # fp32, from the flattened, RMS-normalised streams
    u  = mhc_collapse(X, pre)                           # sum_i pre_i X_i
    y  = F(N(u))
    X' = mhc_expand(X, y, post, comb)                   # X'_j = post_j y + sum_i comb[i, j] X_i
All coefficient maths and the final mix run in float32 (as vLLM does; transformers mixes in the model dtype) and
results are cast back to the stream dtype.

Coefficients, per token, from the flattened streams x (n*D values) and the block's fn ``[(2+n)n, nD]``, base
``[(2+n)n]`` and scale ``(s_pre, s_post, s_comb)``:
    m    = (x * rsqrt(mean(x^2) + rms_norm_eps)) @ fn^T                  an unweighted RMS norm, then one GEMM
    pre  = sigmoid(s_pre m[:n] + base[:n]) + hc_eps
    post = 2 sigmoid(s_post m[n:2n] + base[n:2n])                       in (0, 2)
    comb = softmax_j(s_comb M + B) + hc_eps                             M[i, j] = m[2n + i n + j], B likewise
then Sinkhorn on comb: divide each column by (its sum + hc_eps), then ``sinkhorn_iters - 1`` times rows then
columns the same way, so comb ends column-normalised (nearly doubly stochastic): each output stream is a convex
mix of the input streams plus a gated copy of the sublayer output.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_glm53.backends import mhc_ops

__all__ = ["MHCBlock"]


class MHCBlock(nn.Module):
    """One mHC block around a sublayer: its three float32 tensors (checkpoint ``hc_attn_{fn,base,scale}`` or
    ``hc_ffn_{fn,base,scale}``) and the two halves, :meth:`pre` (coefficients and collapse, before the
    sublayer) and :meth:`post` (expand and mix, after it)."""

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
        pre, post, comb = mhc_ops.mhc_coefficients(
            X, self.fn, self.base, self.scale, self.hc_mult, self.hc_eps, self.sinkhorn_iters, self.norm_eps
        )
        return mhc_ops.mhc_collapse(X, pre), post, comb

    def post(self, X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Streams after the block: :func:`mhc_expand` of the block's input streams X and sublayer output y."""
        return mhc_ops.mhc_expand(X, y, post, comb)
