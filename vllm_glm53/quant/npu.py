"""Ascend kernels for the quantized layers: MXFP8 (Ascend 950) and int8 w8a8 (A2/A3), through ``torch_npu``.

Layouts (ascend.md §2.2), in the non-transposed form the kernels read from contiguous buffers:

* MXFP8 weight ``[K, N]`` E4M3 with its E8M0 scale bytes pair-packed as ``[ceil(K/64), N, 2]``: the byte of
  (column ``n``, K-group ``g`` of 32) sits at ``[g // 2, n, g % 2]``, the group count padded to even with 0.
  Activations are quantized on the fly per 1x32 group (``npu_dynamic_mx_quant``), scales ``[M, ceil(K/64), 2]``.
* int8 weight ``[K, N]`` with a per-output-channel fp32 scale ``[N]``; activations quantized per token
  (``npu_dynamic_quant``, int8 plus an fp32 scale ``[M]``).

``torch_npu`` is imported on first use only, so the CPU test suite imports this module freely (with a
numerical fake of ``torch_npu`` where a test runs these paths).
"""

from __future__ import annotations

import importlib
import math

import torch

from vllm_glm53.quant.mxfp8 import GROUP

MX_GROUP_SIZES = [1, 1, GROUP]  # npu_quant_matmul's (m, n, k) group sizes for MX: one scale per 1x32 along K
# npu_dynamic_mx_quant's exponent rule for activations: 1 rounds the shared exponent up so that no element
# clips (the rule the weights use, mxfp8.py); 0 is the OCP floor rule, which clips groups whose top mantissa
# is >= 1.75 (ascend.md §2.4: 2.66 % vs 2.93 % error on Gaussian activations).
ACT_SCALE_ALG = 1


def torch_npu():
    return importlib.import_module("torch_npu")


# ---------------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------------


def pack_mx_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scale bytes ``[..., N, G]`` (one per row and K-group) -> the kernels' ``[..., ceil(G/2), N, 2]``."""
    *lead, n, groups = scale.shape
    if groups % 2:
        scale = torch.nn.functional.pad(scale, (0, 1))  # the padding group decodes as zero
    pairs = scale.reshape(*lead, n, math.ceil(groups / 2), 2)
    return pairs.transpose(-3, -2).contiguous()


def mx_weight_layout(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint-side MXFP8 ``weight [..., N, K]``, ``scale [..., N, K/32]`` -> kernel-side ``[..., K, N]`` and
    ``[..., ceil(K/64), N, 2]``."""
    return weight.transpose(-2, -1).contiguous(), pack_mx_scale(scale)


# ---------------------------------------------------------------------------------------------------------
# Kernel calls
# ---------------------------------------------------------------------------------------------------------


def mx_quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_npu().npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn, scale_alg=ACT_SCALE_ALG)


def mx_linear(x: torch.Tensor, weight_kn: torch.Tensor, scale_packed: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W`` for an MXFP8 weight in kernel layout; output in ``x``'s dtype."""
    npu = torch_npu()
    xq, xs = mx_quantize_activations(x)
    return npu.npu_quant_matmul(
        xq, weight_kn, scale_packed,
        scale_dtype=npu.float8_e8m0fnu,
        pertoken_scale=xs,
        pertoken_scale_dtype=npu.float8_e8m0fnu,
        bias=None if bias is None else bias.float(),
        output_dtype=x.dtype,
        group_sizes=MX_GROUP_SIZES,
    )


def mx_grouped_matmul(x: torch.Tensor, weight_ekn: torch.Tensor, scale_packed: torch.Tensor,
                      group_list: torch.Tensor) -> torch.Tensor:
    """Rows of ``x [M, K]`` sorted by expert, ``group_list`` the cumulative row counts per expert:
    row block ``e`` times expert ``e``'s MXFP8 weight ``[K, N]``."""
    npu = torch_npu()
    xq, xs = mx_quantize_activations(x)
    return npu.npu_grouped_matmul(
        [xq], [weight_ekn], scale=[scale_packed], per_token_scale=[xs],
        group_list=group_list, group_list_type=0, group_type=0, split_item=2,
        scale_dtype=npu.float8_e8m0fnu, per_token_scale_dtype=npu.float8_e8m0fnu,
        output_dtype=x.dtype,
    )[0]


def w8a8_linear(x: torch.Tensor, weight_kn: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    npu = torch_npu()
    xq, xs = npu.npu_dynamic_quant(x)
    return npu.npu_quant_matmul(xq, weight_kn, scale, pertoken_scale=xs,
                                bias=None if bias is None else bias.float(), output_dtype=x.dtype)


def w8a8_grouped_matmul(x: torch.Tensor, weight_ekn: torch.Tensor, scale_en: torch.Tensor,
                        group_list: torch.Tensor) -> torch.Tensor:
    npu = torch_npu()
    xq, xs = npu.npu_dynamic_quant(x)
    return npu.npu_grouped_matmul(
        [xq], [weight_ekn], scale=[scale_en], per_token_scale=[xs],
        group_list=group_list, group_list_type=0, group_type=0, split_item=2, output_dtype=x.dtype,
    )[0]
