"""msmodelslim "W8A8_DYNAMIC" checkpoints (the GLM-5.3-Flash-w8a8 release for Ascend A2/A3), ascend.md §5.

Format: ``quant_model_description.json`` maps every tensor name to its type (``W8A8_DYNAMIC`` or ``FLOAT``)
next to a few top-level keys; a quantized linear ``<m>`` stores ``<m>.weight`` int8 ``[N, K]`` (symmetric per
output channel), ``<m>.weight_scale`` fp32 ``[N, 1]`` and ``<m>.weight_offset`` fp32 ``[N, 1]`` (zeros).
Activations are quantized at run time per token to int8 (symmetric, scale ``max|x| / 127``), so

    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * weight_scale[n]

with the integer sum exact. Only the MLP and MoE weights are quantized in the GLM-5.3 release. With QuaRot the
checkpoint also carries ``rot.weight`` (``rot.safetensors``), the rotation applied to the hidden state that
enters the MTP layer; the main model does not use it.

The plain-torch functions here are the reference implementation (the CPU path and the tests' oracle); on
Ascend the same layers call ``torch_npu`` (:mod:`.npu`).
"""

from __future__ import annotations

from typing import Any

import torch

DESCRIPTION_FILE = "quant_model_description.json"
W8A8_DYNAMIC = "W8A8_DYNAMIC"
FLOAT = "FLOAT"
CONFIG_NAME = "ascend"  # the --quantization name vllm-ascend gives these checkpoints
MTP_ROTATION = "rot.weight"
# Description keys that describe the file, not a tensor (ascend.md §5).
_TOP_LEVEL_KEYS = {"version", "model_quant_type", "group_size", "metadata", "optional", "is_rot_used",
                   "fa_quant_type", "indexer_quant_type", "kv_cache_type", "kv_quant_type"}
INT8_MAX = 127


def quantized_modules(description: dict[str, Any]) -> set[str]:
    """Names of the linear modules the description marks ``W8A8_DYNAMIC`` (others must be ``FLOAT``)."""
    modules = set()
    for name, kind in description.items():
        if name in _TOP_LEVEL_KEYS or not name.endswith(".weight"):
            continue
        if kind == W8A8_DYNAMIC:
            modules.add(name[: -len(".weight")])
        elif kind != FLOAT:
            raise ValueError(f"{DESCRIPTION_FILE}: {name} is {kind}; vllm-glm53 serves {W8A8_DYNAMIC} and {FLOAT}")
    return modules


# ---------------------------------------------------------------------------------------------------------
# Numerics (reference)
# ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (int8 ``[N, K]``, fp32 scale ``[N, 1]``, fp32 offset ``[N, 1]`` zeros): symmetric per
    output channel, ``scale = max|w_n| / 127`` (1 for an all-zero row), round half to even."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale, torch.zeros_like(scale)


@torch.no_grad()
def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8: ``x [M, K]`` -> (int8 ``[M, K]``, fp32 scale ``[M]``)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(xf / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


@torch.no_grad()
def w8a8_matmul(x: torch.Tensor, weight_kn: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """The w8a8 product for ``x [M, K]`` and an int8 weight ``[K, N]`` with scale ``[N]``, in ``x``'s dtype.

    The integer sums are exact (int32 accumulation, |sum| < 2**31 for K < 2**17); the scaling is fp32.
    """
    xq, xs = quantize_tokens(x)
    acc = torch.mm(xq.to(torch.int32), weight_kn.to(torch.int32))
    out = acc.float() * xs[:, None] * scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
