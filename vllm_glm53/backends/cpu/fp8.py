"""Block-FP8 weights kept resident on the CPU: ``W[n, k] = float(W8[n, k]) * scale[n // bn, k // bk]`` stays as
E4M3 bytes plus float32 block scales, and the compiled kernels (csrc/linear.cpp, csrc/moe.cpp) dequantize
inside the products. Decode reads each weight byte once, half the traffic of a bfloat16 copy (a quarter of a
float32 one), and the weights take the checkpoint's size in memory.

Three ops (:class:`~vllm_glm53.backends.dispatch.Op`):

* :data:`fp8_weight_form` decides, once per model, what an FP8 checkpoint's weights become on this CPU:
  ``fp8`` (resident; the compiled kernels are loaded and read the checkpoint's block size) or ``dequantized``
  (the dequantize-at-load path of :mod:`vllm_glm53.quant.fp8`, which runs without the kernels and is the
  numerical reference). Its log line says which, and why the resident form declined.
* :data:`fp8_linear` (dense linears) and :data:`routed_experts_fp8` (the routed experts, with the clamped
  SwiGLU): the compiled kernels, and plain-torch forms that dequantize and multiply (the references the kernels
  are tested against; they run on any device). On a CPU with native bfloat16 arithmetic (AVX512_BF16 / AMX), a
  bfloat16 model's products with many tokens go first to ``bf16_gemm``: the weight (or each expert the tokens
  chose) dequantized by the kernels into a kept bfloat16 buffer, then torch's bfloat16 GEMM, which runs on the
  CPU's bf16 dot products, about twice the float32 FMA rate the E4M3 kernels compute at. The arithmetic is the
  dequantize-at-load model's (the same bfloat16 weights, the same GEMMs), bit for bit.

Fused weights (gate | up, q | k | v) are several checkpoint tensors stacked along the rows, each with its own
block grid and ragged last block: ``parts`` lists their row counts, and part ``p``'s scale rows start at
``ceil(row offset of p / bn)`` (where vLLM's fused-parameter loaders put them). The stacked experts' ``w13`` is
such a weight with parts ``[I, I]`` per expert.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vllm_glm53.backends.cpu import kernels
from vllm_glm53.backends.cpu.linear import native_16bit
from vllm_glm53.backends.cpu.moe import _per_expert, routed_experts_torch
from vllm_glm53.backends.dispatch import Op, _compiled_status, compiled_kernels_check
from vllm_glm53.quant.fp8_block import dequantize_block_fp8

__all__ = ["fp8_linear", "fp8_weight_form", "routed_experts_fp8", "scale_rows"]

# The kernels work on lane groups of 16 columns and tasks of 16 rows that must not straddle a block.
_BLOCK_MULTIPLE = 16


def scale_rows(parts: list[int], block_n: int) -> int:
    """Rows of the block-scale tensor of a weight fused from ``parts`` (the last part's first scale row plus its
    row blocks)."""
    return math.ceil((sum(parts) - parts[-1]) / block_n) + math.ceil(parts[-1] / block_n)


def _block_reason(block: tuple[int, int]) -> str | None:
    bn, bk = block
    if bn <= 0 or bk <= 0 or bn % _BLOCK_MULTIPLE or bk % _BLOCK_MULTIPLE:
        return f"block {list(block)} is not a multiple of {_BLOCK_MULTIPLE} on both sides"
    return None


# --- the form of the weights -------------------------------------------------------------------------------

fp8_weight_form = Op("fp8_weight_form")


def _resident_check(block: tuple[int, int]) -> str | None:
    return _compiled_status() or _block_reason(block)


@fp8_weight_form.register("compiled", _resident_check)
def _resident(block: tuple[int, int]) -> str:
    return "fp8"


@fp8_weight_form.register("torch")
def fp8_weight_form_torch(block: tuple[int, int]) -> str:
    """What the block-FP8 weights (``block`` = the checkpoint's ``weight_block_size``) of a checkpoint become on
    this CPU: ``"fp8"`` (kept as E4M3 bytes with their scales) or ``"dequantized"`` (into the model dtype at load)."""
    return "dequantized"


# --- dense linears -----------------------------------------------------------------------------------------

# Tokens from which a bfloat16 model's FP8 products run as bfloat16 GEMMs on dequantized copies, where the CPU has
# native bfloat16 arithmetic. The copy is written to memory and read back, so the E4M3 kernels stay ahead of small
# batches. bf16_gemm's time / the kernel's, caches flushed, 2 cores: a 12288 x 4096 linear on an AMD EPYC Zen 5
# 3.3 / 1.6 / 1.16 / 0.72 / 0.27 at 4 / 16 / 32 / 64 / 256 tokens (float32 tiles); on a Zen 4, whose kernels multiply
# bfloat16 pairs (csrc/gemv.h), 1.66 / 1.26 / 0.95-1.11 / 0.99-1.13 / 0.37 at 16 / 32 / 40-48 / 64 / 256. 8 experts
# of the released size, top-2: Zen 5 3.6 / 1.8 / 1.34 / 1.01 / 0.76 at 4 / 8 / 16 / 32 / 64 pairs per expert; Zen 4
# with bfloat16 pairs 1.07-1.28 / 0.96-1.05 / 1.08-1.15 / 0.98-1.03 at 24-32 / 40 / 48 / 64.
BF16_GEMM_MIN_TOKENS = 48  # dense linears: tokens of the call
BF16_GEMM_MIN_PAIRS = 64  # routed experts: mean (token, choice) pairs per expert

_scratch: dict[str, torch.Tensor] = {}


def _dequantized_bf16(slot: str, weight: torch.Tensor, scale: torch.Tensor, parts: list[int],
                      block: tuple[int, int]) -> torch.Tensor:
    """``weight``'s bfloat16 values in the kept buffer ``slot`` (grown as needed, reused by the next call: a fresh
    buffer of an expert's size costs more in first-touch page faults than the conversion)."""
    buf = _scratch.get(slot)
    if buf is None or buf.numel() < weight.numel():
        buf = _scratch[slot] = torch.empty(weight.numel(), dtype=torch.bfloat16)
    out = buf[: weight.numel()].view(weight.shape)
    kernels.ops().fp8_dequantize(weight, scale, list(parts), int(block[0]), int(block[1]), out)
    return out


def _bf16_gemm_reason(x: torch.Tensor) -> str | None:
    """Why the bf16_gemm forms decline ``x`` on this CPU (the kernels' own checks follow in each form's check)."""
    if x.dtype != torch.bfloat16:
        return f"{x.dtype} activations (bfloat16 GEMMs serve bfloat16 models)"
    if not native_16bit(torch.bfloat16):
        return "no native bfloat16 arithmetic on this CPU"
    return None


fp8_linear = Op("fp8_linear")
_linear_tensors = compiled_kernels_check(lambda x, weight, scale, parts, block: (x,))


def _linear_bf16_check(x, weight, scale, parts, block):
    if x.shape[0] < BF16_GEMM_MIN_TOKENS:
        return f"fewer than {BF16_GEMM_MIN_TOKENS} tokens: the E4M3 kernel reads fewer bytes"
    return _bf16_gemm_reason(x) or _linear_check(x, weight, scale, parts, block)


@fp8_linear.register("bf16_gemm", _linear_bf16_check)
def fp8_linear_bf16_gemm(x, weight, scale, parts, block):
    """torch's bfloat16 GEMM on the weight dequantized to bfloat16 (see the module docstring)."""
    return F.linear(x, _dequantized_bf16("linear", weight, scale, parts, block))


def _linear_check(x, weight, scale, parts, block):
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        return f"needs float8_e4m3fn weights with float32 scales, got {weight.dtype} / {scale.dtype}"
    return _linear_tensors(x, weight, scale, parts, block) or _block_reason(block)


@fp8_linear.register("compiled", _linear_check)
def _fp8_linear_compiled(x, weight, scale, parts, block):
    return kernels.ops().fp8_linear(x, weight, scale, list(parts), int(block[0]), int(block[1]))


@fp8_linear.register("torch")
def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, parts: list[int],
                     block: tuple[int, int]) -> torch.Tensor:
    """``x @ W^T`` for a block-FP8 weight: x ``[M, K]``, weight ``[N, K]`` float8_e4m3fn, scale float32
    ``[scale_rows(parts, bn), ceil(K / bk)]``, parts: row counts of the fused tensors (summing to N). Returns
    ``[M, N]`` in x's dtype, computed in float32.

    Plain torch (any device): the weight dequantized to float32 part by part, then one matmul."""
    return F.linear(x.float(), dequantize_parts(weight, scale, parts, block)).to(x.dtype)


def dequantize_parts(weight: torch.Tensor, scale: torch.Tensor, parts: list[int], block: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float values of a block-FP8 weight fused from ``parts`` (see the module docstring)."""
    bn = block[0]
    pieces, row = [], 0
    for n in parts:
        first = math.ceil(row / bn)
        pieces.append(dequantize_block_fp8(weight[row : row + n], scale[first : first + math.ceil(n / bn)],
                                           tuple(block), dtype=dtype))
        row += n
    return torch.cat(pieces)


# --- routed experts ----------------------------------------------------------------------------------------

routed_experts_fp8 = Op("routed_experts_fp8")
_expert_tensors = compiled_kernels_check(lambda x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block: (x,))


def _experts_bf16_check(x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block):
    if ids.numel() < BF16_GEMM_MIN_PAIRS * w13.shape[0]:
        return f"fewer than {BF16_GEMM_MIN_PAIRS} (token, expert) pairs per expert: the E4M3 kernel reads fewer bytes"
    return _bf16_gemm_reason(x) or _experts_check(x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block)


class _DequantizingStack:
    """Expert ``e`` of a block-FP8 stack as bfloat16 when the expert loop asks for it (into a kept buffer, valid
    until the next expert of the same stack is asked for)."""

    def __init__(self, slot, weight, scale, parts, block):
        self.slot, self.weight, self.scale, self.parts, self.block = slot, weight, scale, parts, block
        self.shape = weight.shape

    def __getitem__(self, e):
        return _dequantized_bf16(self.slot, self.weight[e], self.scale[e], self.parts, self.block)


@routed_experts_fp8.register("bf16_gemm", _experts_bf16_check)
def routed_experts_fp8_bf16_gemm(x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block):
    """The bfloat16 expert loop (:func:`~vllm_glm53.backends.cpu.moe.routed_experts_torch`) on the experts the
    tokens chose, each dequantized to bfloat16 when its turn comes."""
    inter = w13.shape[1] // 2
    return _per_expert(x, _DequantizingStack("w13", w13, w13_scale, [inter, inter], block),
                       _DequantizingStack("w2", w2, w2_scale, [w2.shape[1]], block), ids, weights, limit, F.linear)


def _experts_check(x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block):
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        return f"needs float8_e4m3fn experts, got {w13.dtype} / {w2.dtype}"
    return _expert_tensors(x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block) or _block_reason(block)


@routed_experts_fp8.register("compiled", _experts_check)
def _routed_experts_fp8_compiled(x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block):
    return kernels.ops().moe_experts_fp8(x, w13, w13_scale, w2, w2_scale, ids, weights, float(limit),
                                         int(block[0]), int(block[1]))


@routed_experts_fp8.register("torch")
def routed_experts_fp8_torch(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                             w2_scale: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, limit: float,
                             block: tuple[int, int]) -> torch.Tensor:
    """:func:`~vllm_glm53.backends.cpu.moe.routed_experts_torch` on block-FP8 stacks: w13 ``[E, 2I, D]`` and w2
    ``[E, D, I]`` float8_e4m3fn, w13_scale ``[E, 2 ceil(I/bn), ceil(D/bk)]`` (gate blocks, then up blocks),
    w2_scale ``[E, ceil(D/bn), ceil(I/bk)]``. Returns ``[T, D]`` float32.

    Plain torch (any device): the experts that received tokens dequantized to float32, then the unquantized loop."""
    inter = w13.shape[1] // 2
    used = torch.unique(ids).tolist()
    w13_f = torch.zeros(w13.shape, dtype=torch.float32, device=x.device)
    w2_f = torch.zeros(w2.shape, dtype=torch.float32, device=x.device)
    for e in used:
        w13_f[e] = dequantize_parts(w13[e], w13_scale[e], [inter, inter], block)
        w2_f[e] = dequantize_parts(w2[e], w2_scale[e], [w2.shape[1]], block)
    return routed_experts_torch(x.float(), w13_f, w2_f, ids, weights, limit)
