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
  chose) dequantized by the kernels into a kept bfloat16 buffer a panel of rows at a time, each panel multiplied by
  torch's bfloat16 GEMM (oneDNN on the CPU's bfloat16 instructions) while it is in cache. The arithmetic is the
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
from vllm_glm53.backends.cpu.linear import amx_bf16, native_16bit
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


def _part_blocks(weight: torch.Tensor, scale: torch.Tensor, parts: list[int], block_n: int):
    """Each part of a fused weight as ``(first row, its rows of weight, its rows of scale)``: a part's scale rows
    start at ceil(its first row / block_n) (module docstring)."""
    row = 0
    for n in parts:
        first = math.ceil(row / block_n)
        yield row, weight[row : row + n], scale[first : first + math.ceil(n / block_n)]
        row += n


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
# native bfloat16 arithmetic: the E4M3 kernels read half the bytes, the GEMMs do the products faster once there are
# enough tokens. bf16_gemm's time / the kernel's, caches flushed, 2 cores, AMD EPYC, both kernels multiplying
# bfloat16 pairs (csrc/gemv.h). A 12288 x 4096 linear: Zen 4 1.66 / 1.26 / 0.95-1.11 / 0.99-1.13 / 0.37 at 16 / 32 /
# 40-48 / 64 / 256 tokens (the weight dequantized whole, before the panels below); Zen 5 with panels 1.25-1.26 /
# 1.13-1.16 / 1.02-1.05 / 0.98 / 0.89 / 0.23 at 48 / 64 / 96 / 128 / 192 / 256. Routed experts of the released size
# (Zen 5: 16, top-4): Zen 4 1.07-1.28 / 0.96-1.05 / 1.08-1.15 / 0.98-1.03 at 24-32 / 40 / 48 / 64 pairs per expert
# (whole); Zen 5 with panels 0.96 / 1.05-1.11 / 0.85-0.97 / 0.92-1.10 / 0.80-0.96 / 0.82-0.84 / 0.75-0.76 at 24 / 32
# / 40 / 48 / 64 / 96 / 128. Zen 5's kernels gain most from full-width 512-bit units (two bfloat16 dot products a
# cycle), the panels move both CPUs' crossovers down: 64 tokens lies between them, and 64 pairs stays.
# Where torch's bfloat16 GEMMs run on AMX tiles and the kernels do not (VLLM_GLM53_CPU_AMX=0) the GEMMs win much
# earlier. Intel Xeon with AMX (2 cores of a VM, its AVX-512 bfloat16 dot products at half a Zen 5's rate), the same
# measurements with panels: the linear 1.20-1.25 / 0.71 / 0.75-0.78 / 0.62-0.63 / 0.64 / 0.52 / 0.39 at 16 / 24 / 32
# / 40 / 48 / 64 / 96 tokens; experts 2.07 / 0.95 / 0.71 / 0.66 / 0.59 / 0.49 at 8 / 16 / 24 / 32 / 48 / 64 pairs per
# expert.
# Where the kernels multiply on AMX tiles themselves (kernels.amx_tiles(): csrc/amx.h) they keep the products far
# longer. Same machine, kernels on AMX, bf16_gemm's time / the kernel's: the linear 3.59 / 2.97 / 3.24 / 2.58 / 1.87 /
# 1.48 at 16 / 24 / 32 / 64 / 128 / 192 tokens (from 256 the kernel's own panels run torch's float32 GEMM: 0.29);
# experts 2.77 / 3.67 / 2.96 / 2.42 / 1.78 / 1.44 / 1.06 at 8 / 16 / 32 / 64 / 128 / 192 / 256 pairs per expert.
BF16_GEMM_MIN_TOKENS = 64  # dense linears: tokens of the call
BF16_GEMM_MIN_PAIRS = 64  # routed experts: mean (token, choice) pairs per expert
AMX_BF16_GEMM_MIN_TOKENS = 24
AMX_BF16_GEMM_MIN_PAIRS = 24
KERNEL_AMX_BF16_GEMM_MIN_TOKENS = 256
KERNEL_AMX_BF16_GEMM_MIN_PAIRS = 256


def bf16_gemm_min() -> tuple[int, int]:
    """``(tokens, pairs per expert)`` from which a bfloat16 model's FP8 products run as bfloat16 GEMMs on this CPU
    (where it multiplies bfloat16 natively at all: :func:`_bf16_gemm_reason`)."""
    if kernels.amx_tiles():
        return KERNEL_AMX_BF16_GEMM_MIN_TOKENS, KERNEL_AMX_BF16_GEMM_MIN_PAIRS
    if amx_bf16():
        return AMX_BF16_GEMM_MIN_TOKENS, AMX_BF16_GEMM_MIN_PAIRS
    return BF16_GEMM_MIN_TOKENS, BF16_GEMM_MIN_PAIRS


# Rows of a bfloat16 panel are about this many bytes: the bf16_gemm forms dequantize and multiply a weight a panel
# of rows at a time, so the GEMM reads each panel from cache right after the kernel wrote it instead of a whole
# bfloat16 copy going out to memory and back. 12288 x 4096, Zen 5, 2 threads: 1.29x faster at 64 tokens, 1.14-1.18x
# at 128-256 (512-row panels; 256- and 1024-row ones were slower).
_PANEL_BYTES = 4 << 20

_panel: torch.Tensor | None = None  # kept between calls: a fresh buffer costs first-touch page faults every call


def _panel_buffer(numel: int) -> torch.Tensor:
    """The kept bfloat16 panel buffer, grown to at least ``numel`` values."""
    global _panel
    if _panel is None or _panel.numel() < numel:
        _panel = torch.empty(numel, dtype=torch.bfloat16)
    return _panel


def _bf16_panels_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, parts: list[int],
                        block: tuple[int, int]) -> torch.Tensor:
    """``x @ W^T`` in bfloat16 for a bfloat16 ``x`` and the block-FP8 ``weight``: W dequantized to bfloat16 a panel
    of rows at a time (whole row blocks of one part) into a kept buffer, each panel's product written into its
    columns of the output. Every output is the whole-weight GEMM's (tests/test_fp8_resident.py)."""
    N, K = weight.shape
    bn, bk = int(block[0]), int(block[1])
    rows = max(bn, _PANEL_BYTES // (2 * K) // bn * bn)
    panel = _panel_buffer(min(rows, N) * K)
    dequantize = kernels.ops().fp8_dequantize
    out = torch.empty(x.shape[0], N, dtype=torch.bfloat16)
    for row, w, s in _part_blocks(weight, scale, parts, bn):
        for r0 in range(0, w.shape[0], rows):
            m = min(rows, w.shape[0] - r0)
            p = panel[: m * K].view(m, K)
            dequantize(w[r0 : r0 + m], s[r0 // bn : math.ceil((r0 + m) / bn)], [m], bn, bk, p)
            torch.mm(x, p.t(), out=out[:, row + r0 : row + r0 + m])
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
    tokens = bf16_gemm_min()[0]
    if x.shape[0] < tokens:
        return f"fewer than {tokens} tokens: the E4M3 kernel reads fewer bytes"
    return _bf16_gemm_reason(x) or _linear_check(x, weight, scale, parts, block)


@fp8_linear.register("bf16_gemm", _linear_bf16_check)
def fp8_linear_bf16_gemm(x, weight, scale, parts, block):
    """torch's bfloat16 GEMM on the weight dequantized to bfloat16 (see the module docstring)."""
    return _bf16_panels_linear(x, weight, scale, parts, block)


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
    return torch.cat([dequantize_block_fp8(w, s, tuple(block), dtype=dtype)
                      for _, w, s in _part_blocks(weight, scale, parts, block[0])])


# --- routed experts ----------------------------------------------------------------------------------------

routed_experts_fp8 = Op("routed_experts_fp8")
_expert_tensors = compiled_kernels_check(lambda x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block: (x,))


def _experts_bf16_check(x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block):
    pairs = bf16_gemm_min()[1]
    if ids.numel() < pairs * w13.shape[0]:
        return f"fewer than {pairs} (token, expert) pairs per expert: the E4M3 kernel reads fewer bytes"
    return _bf16_gemm_reason(x) or _experts_check(x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block)


class _Fp8Stack:
    """Expert ``e`` of a block-FP8 stack as ``(weight, scale, parts, block)`` for :func:`_bf16_panels_linear`."""

    def __init__(self, weight, scale, parts, block):
        self.weight, self.scale, self.parts, self.block = weight, scale, parts, block
        self.shape = weight.shape

    def __getitem__(self, e):
        return self.weight[e], self.scale[e], self.parts, self.block


@routed_experts_fp8.register("bf16_gemm", _experts_bf16_check)
def routed_experts_fp8_bf16_gemm(x, w13, w13_scale, w2, w2_scale, ids, weights, limit, block):
    """The bfloat16 expert loop (:func:`~vllm_glm53.backends.cpu.moe.routed_experts_torch`) on the experts the
    tokens chose, each dequantized to bfloat16 a panel at a time when its turn comes."""
    inter = w13.shape[1] // 2
    return _per_expert(x, _Fp8Stack(w13, w13_scale, [inter, inter], block),
                       _Fp8Stack(w2, w2_scale, [w2.shape[1]], block), ids, weights, limit,
                       lambda x_e, w_e: _bf16_panels_linear(x_e, *w_e))


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

    Plain torch (any device): the experts that received tokens dequantized to float32 (only those: a float32 copy of
    every expert of a released-size layer is tens of GB), then the unquantized loop on them, renumbered in order."""
    inter = w13.shape[1] // 2
    used, renumbered = torch.unique(ids, return_inverse=True)
    w13_f = torch.empty((used.numel(), *w13.shape[1:]), dtype=torch.float32, device=x.device)
    w2_f = torch.empty((used.numel(), *w2.shape[1:]), dtype=torch.float32, device=x.device)
    for i, e in enumerate(used.tolist()):
        w13_f[i] = dequantize_parts(w13[e], w13_scale[e], [inter, inter], block)
        w2_f[i] = dequantize_parts(w2[e], w2_scale[e], [w2.shape[1]], block)
    return routed_experts_torch(x.float(), w13_f, w2_f, renumbered.reshape(ids.shape), weights, limit)


# --- a whole MLP -------------------------------------------------------------------------------------------

# Tokens up to which a clamped-SwiGLU MLP on block-FP8 weights (a dense layer, the shared expert) runs as one call
# (mlp_fp8) instead of its two linears and the SwiGLU between them: at decode sizes the three ops' dispatch and
# the gate | up tensor they pass on cost as much as the products. 2 Zen 5 cores, bfloat16 tokens, the three ops'
# time / the call's: hidden 512, intermediate 256, warm, 2.07 / 1.87 / 1.49 / 1.17 at 1 / 4 / 16 / 32 tokens (as
# an AVX2 CPU 1.94 / 1.61 / 1.17-1.34 / 1.23, float32 tokens 1.09 / 0.99 at 16 / 32); the released shared expert
# (hidden 4096, intermediate 2048), caches flushed, 0.95-1.24 from 1 to 32 tokens, bfloat16 and float32, runs in
# sequence on a drifting VM (memory-bound: the same bytes read).
# At 64 tokens an AVX2 CPU's linears take their float32 GEMM panels (0.67x as one call).
MLP_FP8_MAX_TOKENS = 32


def mlp_fp8(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
            down_scale: torch.Tensor, limit: float, block: tuple[int, int]) -> torch.Tensor:
    """``down(clamped_swiglu(gate_up(x)))`` for block-FP8 weights ``gate_up`` ``[2I, D]`` (parts ``[I, I]``) and
    ``down`` ``[D, I]``, as :data:`routed_experts_fp8` with one expert that every token takes at weight 1: one
    kernel call, the SwiGLU on float32 sums, h rounded to x's dtype (as the experts' is). Returns ``[T, D]``
    float32."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int32)
    return routed_experts_fp8(x, gate_up[None], gate_up_scale[None], down[None], down_scale[None], ids,
                              torch.ones(x.shape[0], 1), limit, block)
