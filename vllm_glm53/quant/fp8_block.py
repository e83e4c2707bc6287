"""Block-scaled FP8: the native GLM-5.3-Flash checkpoint format.

A quantized linear is stored as ``weight`` (``float8_e4m3fn``, ``[N, K]``) plus ``weight_scale_inv`` (fp32,
``[ceil(N/128), ceil(K/128)]``). Despite its name the scale is a multiplier:

    W[i, j] ~= float(weight[i, j]) * weight_scale_inv[i // 128, j // 128]

Edge blocks may be partial (N or K not a multiple of 128); they simply cover fewer rows/columns.

Both directions work on chunks of whole row-blocks so that the fp32 staging copy stays bounded
(``_CHUNK_ELEMENTS``) whatever the weight size: a 12288x6144 expert would otherwise need a 300 MB fp32
temporary on top of its output.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn magnitude
DEFAULT_BLOCK = (128, 128)
# fp32 elements staged per chunk (16 MiB); rounded up to whole row-blocks.
_CHUNK_ELEMENTS = 1 << 22


def is_block_fp8(weight: torch.Tensor, weight_scale_inv: torch.Tensor | None) -> bool:
    """The loader rule: a linear is block-FP8 iff it has a ``weight_scale_inv`` and an E4M3 weight.

    Neither the name nor the quantization config alone decides it: the released config lists modules that are
    left in BF16, and such lists have been wrong before (architecture.md §12.2).
    """
    return weight_scale_inv is not None and weight.dtype == torch.float8_e4m3fn


def block_scale_shape(shape: tuple[int, int], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape`` (partial edge blocks count as blocks)."""
    n, k = shape
    bn, bk = _check_block(block)
    return math.ceil(n / bn), math.ceil(k / bk)


@torch.no_grad()
def quantize_block_fp8(
    weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float ``[N, K]`` weight to ``(weight_e4m3 [N, K], weight_scale_inv [ceil(N/bn), ceil(K/bk)])``.

    Per block: ``scale = absmax / 448`` (fp32) and ``q = RNE_E4M3(W / scale)``, so the block's largest element
    lands on +-448. A block of zeros gets scale 1.0 (the scale is never 0: consumers divide by it or take its
    logarithm). A non-zero block so small that ``absmax / 448`` underflows gets the smallest normal fp32.
    The division is done in fp32 (not a multiply by a rounded reciprocal), matching how the released
    checkpoints' values relate to their scales.
    """
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"expected a 2-D floating-point weight, got {tuple(weight.shape)} {weight.dtype}")
    if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError("weight is already FP8")
    n, k = weight.shape
    bn, bk = _check_block(block)
    nb, kb = block_scale_shape((n, k), block)
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty((nb, kb), dtype=torch.float32, device=weight.device)
    rows = _rows_per_chunk(k, bn)
    tiny = torch.finfo(torch.float32).tiny
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        x = weight[r0:r1].float()
        if not torch.isfinite(x).all():
            raise ValueError("weight has NaN or infinite values; they have no FP8 block encoding")
        xb = _as_blocks(x, bn, bk)  # [row-blocks, bn, col-blocks, bk], zero-padded
        amax = xb.abs().amax(dim=(1, 3))
        s = torch.where(amax > 0, (amax / E4M3_MAX).clamp_min(tiny), torch.ones_like(amax))
        # Clamp before the cast: older torch builds turn out-of-range values into NaN instead of saturating.
        qb = (xb / s[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        q[r0:r1] = qb.reshape(xb.shape[0] * bn, kb * bk)[: r1 - r0, :k].to(torch.float8_e4m3fn)
        scale[r0 // bn : r0 // bn + s.shape[0]] = s
    return q, scale


@torch.no_grad()
def dequantize_block_fp8(
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``float(weight) * weight_scale_inv`` per block, returned as ``dtype`` ``[N, K]``.

    The product is formed in fp32 and rounded once to ``dtype``.
    """
    _check_fp8_pair(weight, weight_scale_inv, block)
    n, k = weight.shape
    bn, bk = _check_block(block)
    s = weight_scale_inv.to(device=weight.device, dtype=torch.float32)
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    k_full = (k // bk) * bk
    rows = _rows_per_chunk(k, bn)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        x = weight[r0:r1].float()
        # Per-row copy of the block scales: 1/bk the size of the chunk, unlike a full [rows, K] expansion.
        s_rows = s[r0 // bn : math.ceil(r1 / bn)].repeat_interleave(bn, dim=0)[: r1 - r0]
        if k_full:
            x[:, :k_full].unflatten(1, (k // bk, bk)).mul_(s_rows[:, : k // bk, None])
        if k_full < k:
            x[:, k_full:].mul_(s_rows[:, -1:])
        out[r0:r1] = x
    return out


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    bn, bk = (int(b) for b in block)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block sizes must be positive, got {tuple(block)}")
    return bn, bk


def _check_fp8_pair(weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected a 2-D float8_e4m3fn weight, got {tuple(weight.shape)} {weight.dtype}")
    expected = block_scale_shape(tuple(weight.shape), block)
    if tuple(weight_scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(weight_scale_inv.shape)}; a {tuple(weight.shape)} weight with "
            f"{tuple(block)} blocks needs {expected}"
        )


def _rows_per_chunk(k: int, bn: int) -> int:
    """Rows per chunk: whole row-blocks, about ``_CHUNK_ELEMENTS`` elements, at least one row-block."""
    return max(1, _CHUNK_ELEMENTS // max(1, bn * k)) * bn


def _as_blocks(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``[r, K]`` -> ``[ceil(r/bn), bn, ceil(K/bk), bk]``, zero-padding partial edge blocks (zeros do not
    change a block's absmax)."""
    r, k = x.shape
    pad_r, pad_k = -r % bn, -k % bk
    if pad_r or pad_k:
        x = torch.nn.functional.pad(x, (0, pad_k, 0, pad_r))
    return x.view((r + pad_r) // bn, bn, (k + pad_k) // bk, bk)
