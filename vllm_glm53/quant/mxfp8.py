"""Re-grouping block-FP8 checkpoints into MXFP8 (OCP Microscaling, E4M3 elements, 1x32 groups along K).

Input: the native checkpoint layout, ``weight`` ``float8_e4m3fn`` ``[N, K]`` and fp32 ``weight_scale_inv``
``[ceil(N/bn), ceil(K/bk)]`` with ``W = float(weight) * scale`` per ``bn x bk`` block (``fp8_block``).
Output: ``weight`` ``float8_e4m3fn`` ``[N, K]`` and ``scale`` ``uint8`` ``[N, ceil(K/32)]`` holding E8M0
exponents, byte ``b`` meaning ``2**(b - 127)``; element ``(i, j)`` decodes to
``float(weight[i, j]) * 2**(scale[i, j // 32] - 127)``. This is the loader-side layout; the NPU kernels'
pair-packed ``[K/64, N, 2]`` form is a pure re-layout done next to the kernel call.

The rule, per row and 1x32 group (a group never straddles two blocks because ``bk`` is a multiple of 32):

* The group's values are ``x = float(w8) * s`` for its block scale ``s``, taken exactly (computed in fp64,
  where the product of a 4-bit and a 24-bit significand is exact).
* Exponent ``e`` = the smallest integer with ``max|x| <= 448 * 2**e``, so no element clips. With
  ``max|x| = m * 2**E`` (``frexp``, ``m`` in [0.5, 1)) that is ``E - 9 + [m > 0.875]`` (448 = 0.875 * 2**9).
  The OCP reference rule (``floor(log2 max) - 8``) clips up to 12.5 % on groups whose top mantissa is
  >= 1.75; this rule never does.
* Power-of-two block scales: when ``s == 2**k`` with ``-126 <= k <= 127``, ``e = k`` instead, whatever the
  group's maximum. The elements are then ``x / 2**e = float(w8)`` exactly, so the weight bytes come out
  unchanged and the conversion is bit-exact (``scale_fmt: ue8m0`` checkpoints). The smallest-exponent rule
  would give the same *values* but re-encode the bytes of groups whose maximum is <= 224.
* Elements: ``q = RNE_E4M3(x / 2**e)``, rounded once from the exact value (``_round_to_odd_fp32``); since
  ``|x / 2**e| <= 448`` nothing saturates and no NaN can appear.
* Scale byte: ``e + 127`` built from the integer exponent. It is never obtained by casting a float scale to
  ``torch.float8_e8m0fnu``: that cast rounds to the nearest power of two (1.4 -> 1), which would clip.
* Exponents of non-zero groups are clamped to >= -126 (byte >= 1) because CANN reads E8M0 byte 0 as zero
  while OCP reads it as 2**-127; only a group below 224 * 2**-126 is affected, losing precision, not range.
  A scale needing ``e > 127`` (beyond fp32 range in practice) is an error.
* An all-zero group (every value +-0, including a zero block scale) gets scale byte 0 and +-0 elements
  (signs kept): it decodes to zero under both readings of byte 0.

Everything is vectorised over chunks of rows (``_CHUNK_ELEMENTS`` elements) to bound the fp64 staging.
"""

from __future__ import annotations

import math

import torch

from .fp8_block import DEFAULT_BLOCK

GROUP = 32
E8M0_BIAS = 127
ZERO_GROUP_BYTE = 0
_EXP_MIN = -126  # smallest exponent for a non-zero group (byte 1)
_EXP_MAX = 127  # byte 254; byte 255 is NaN
# Elements per chunk. The staging is fp32 + fp64 copies plus temporaries, ~40 bytes per element: 2**18
# elements keep it near 10 MiB, mostly cache-resident. Measured at 4096x12288 on 2 threads: 21-row chunks
# ran ~1.4x faster than 85-row ones and ~2.5x faster than 256-row ones.
_CHUNK_ELEMENTS = 1 << 18


@torch.no_grad()
def regroup(
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK,
    *,
    rows_per_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a block-FP8 weight to MXFP8: ``(weight_e4m3 [N, K], scale_e8m0 [N, ceil(K/32)] uint8)``.

    ``rows_per_chunk`` only changes peak memory, never the result.
    """
    n, k, bn, bk = _check_inputs(weight, weight_scale_inv, block_size)
    s = weight_scale_inv.to(device=weight.device, dtype=torch.float32)
    if not torch.isfinite(s).all() or (s < 0).any():
        raise ValueError("weight_scale_inv must be finite and non-negative")
    groups = math.ceil(k / GROUP)
    # Block scale of every (row-block, K-group): small, [ceil(N/bn), groups].
    s_by_group = s[:, torch.arange(groups, device=weight.device) * GROUP // bk]
    out_w = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=weight.device)
    out_s = torch.empty((n, groups), dtype=torch.uint8, device=weight.device)
    rows = rows_per_chunk or max(1, _CHUNK_ELEMENTS // (groups * GROUP))
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        w = _grouped(weight[r0:r1].float(), groups)  # [r, groups, 32], exact E4M3 values
        gmax = w.abs().amax(dim=-1)
        if gmax.isnan().any():
            raise ValueError("weight holds NaN bytes")
        sg = s_by_group[torch.arange(r0, r1, device=weight.device) // bn]
        exponent, factor = _group_exponents(gmax, sg)
        q = _round_to_odd_fp32(w.double() * factor[..., None]).to(torch.float8_e4m3fn)
        out_w[r0:r1] = q.view(r1 - r0, groups * GROUP)[:, :k]
        out_s[r0:r1] = exponent
    return out_w, out_s


@torch.no_grad()
def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Decode MXFP8 to float32 ``[N, K]``: ``float(weight) * 2**(scale - 127)`` per 1x32 group.

    ``scale`` may be ``uint8`` or ``torch.float8_e8m0fnu`` (the same bytes); byte 255 decodes to NaN as the
    format says. The products are exact in fp32.
    """
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected a 2-D float8_e4m3fn weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    groups = math.ceil(k / GROUP)
    if tuple(scale.shape) != (n, groups):
        raise ValueError(
            f"scale has shape {tuple(scale.shape)}; a {tuple(weight.shape)} weight needs {(n, groups)}"
        )
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    elif scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"scale must be uint8 or float8_e8m0fnu, got {scale.dtype}")
    out = torch.empty((n, k), dtype=torch.float32, device=weight.device)
    rows = max(1, _CHUNK_ELEMENTS // (groups * GROUP))
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        x = _grouped(weight[r0:r1].float(), groups).mul_(scale[r0:r1].float()[..., None])
        out[r0:r1] = x.view(r1 - r0, groups * GROUP)[:, :k]
    return out


def _check_inputs(
    weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: tuple[int, int]
) -> tuple[int, int, int, int]:
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected a 2-D float8_e4m3fn weight, got {tuple(weight.shape)} {weight.dtype}")
    bn, bk = (int(b) for b in block_size)
    if bn <= 0 or bk <= 0 or bk % GROUP:
        # With bk a multiple of 32 every 1x32 group lies in one block and so has a single block scale.
        raise ValueError(
            f"block_size must be positive with the K block a multiple of {GROUP}, got {tuple(block_size)}"
        )
    n, k = weight.shape
    expected = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(weight_scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(weight_scale_inv.shape)}; a {(n, k)} weight with "
            f"{(bn, bk)} blocks needs {expected}"
        )
    return n, k, bn, bk


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[r, K]`` -> ``[r, groups, 32]``, zero-padding a partial last group (zeros change no group max)."""
    pad = groups * GROUP - x.shape[1]
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(x.shape[0], groups, GROUP)


def _group_exponents(gmax: torch.Tensor, sg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group: the E8M0 byte and the exact fp64 factor ``s * 2**-e`` that maps ``float(w8)`` to ``x / 2**e``.

    ``gmax`` is the group's max ``|float(w8)|``, ``sg`` its block scale, both fp32 ``[r, groups]``.
    """
    amax = gmax.double() * sg.double()  # exact
    mant, exp = torch.frexp(amax)
    e = exp - 9 + (mant > 0.875).to(exp.dtype)
    s_mant, s_exp = torch.frexp(sg)
    pow2 = (s_mant == 0.5) & (s_exp - 1 >= _EXP_MIN)
    e = torch.where(pow2, s_exp - 1, e).clamp_(min=_EXP_MIN)
    zero = amax == 0
    if (e[~zero] > _EXP_MAX).any():
        raise ValueError("a block scale is too large for an E8M0 exponent (needs 2**e with e > 127)")
    byte = torch.where(zero, ZERO_GROUP_BYTE, e + E8M0_BIAS).to(torch.uint8)
    factor = (sg.double() * _exp2_fp64(-e)).masked_fill_(zero, 0.0)
    return byte, factor


def _exp2_fp64(e: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0**e`` in fp64 for integer ``e`` in the normal range, built from the exponent bits."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _round_to_odd_fp32(p: torch.Tensor) -> torch.Tensor:
    """Round fp64 ``p`` to fp32 with round-to-odd, so that a later RNE cast to E4M3 equals RNE of ``p`` itself.

    A plain fp64 -> fp32 -> E4M3 chain rounds twice and goes wrong when the first rounding lands exactly on an
    E4M3 midpoint. Round-to-odd keeps a sticky bit (the fp32 LSB) for inexact results, which is enough for
    any target with at least two fewer significand bits than fp32.
    """
    r = p.float()
    rem = p - r.double()  # exact: p and r agree to 24 bits
    inexact = rem != 0
    # r was rounded away from zero iff the remainder points back towards zero.
    away = inexact & ((rem < 0) ^ torch.signbit(r))
    bits = r.view(torch.int32)
    bits.sub_(away.to(torch.int32)).bitwise_or_(inexact.to(torch.int32))
    return r
