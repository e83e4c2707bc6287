"""The arithmetic of the layers' RMSNorm (:class:`vllm_glm53.model.norm.RMSNorm`, which says why it keeps
transformers' rounding): the statistic in float32, the normalised value cast back to the input dtype before the
weight multiplies it.

:data:`rms_norm` is an :class:`~vllm_glm53.backends.dispatch.Op`: the ``compiled`` kernel (csrc/norm.cpp, one pass
per row) when the kernels are loaded and the weight has the input's dtype, else :func:`rms_norm_torch`, the
reference, whose six tensor ops cost a decode step ~13 us a norm in dispatch alone.
"""

from __future__ import annotations

import torch

from vllm_glm53.backends.cpu import kernels
from vllm_glm53.backends.dispatch import Op, compiled_kernels_check

__all__ = ["rms_norm"]

rms_norm = Op("rms_norm")

_tensors_check = compiled_kernels_check(lambda x, weight, eps: (x, weight))


def _compiled_check(x, weight, eps) -> str | None:
    if weight.dtype != x.dtype:
        return f"needs the weight in the input's dtype, got {weight.dtype} and {x.dtype}"
    return _tensors_check(x, weight, eps)


@rms_norm.register("compiled", _compiled_check)
def _rms_norm_compiled(x, weight, eps):
    return kernels.ops().rms_norm(x, weight, eps)


@rms_norm.register("torch")
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension, the statistic in float32
    (the result takes the dtype torch promotes ``weight`` and ``x`` to)."""
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
