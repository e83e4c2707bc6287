"""Linear layers with 16-bit weights on CPUs that do not multiply them natively.

Without AVX512_BF16 / AMX (every AVX2-only CPU, many AVX-512 ones) vLLM's CPU linear layers cannot hand bfloat16
weights to oneDNN and fall back to torch's ``F.linear``, whose bfloat16 GEMM converts inside its inner loop:
measured on 2 cores of an AMD EPYC (AVX2), 15 GFLOP/s against 90-95 for the float32 GEMM, and a 16-token decode
batch at 10-25x the time of reading the weight once. :data:`linear16` keeps the weight in 16 bits and computes
in float32 (csrc/linear.cpp): a few tokens stream the weight once, converting it in registers; many tokens widen
it panel by panel into float32 for torch's float32 GEMM.

:func:`take_16bit_gemms` puts it under the plugin's model after loading, layer by layer, where vLLM's dispatch
left torch's ``F.linear`` with the weight in place and the avx2 / avx512 kernels are loaded (on CPUs with native
16-bit arithmetic, where vLLM packed the weight for its own GEMM, or with the portable build, vLLM's choice
stays).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from vllm_glm53 import _vllm
from vllm_glm53.backends.cpu import kernels
from vllm_glm53.backends.dispatch import Op, compiled_kernels_check

__all__ = ["amx_bf16", "linear16", "native_16bit", "onednn_allows_amx", "runs_on_linear16", "take_16bit_gemms",
           "widens"]

logger = logging.getLogger("vllm_glm53")

# The CPU features that give torch's GEMMs native arithmetic for each 16-bit dtype (dot products or tiles).
_NATIVE_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"avx512_fp16", "amx_fp16"}}

# oneDNN, under vLLM's and torch's 16-bit GEMMs, uses no instruction set above ONEDNN_MAX_CPU_ISA (DNNL_MAX_CPU_ISA
# before oneDNN 2): its levels as oneDNN numbers them (dnnl_cpu_isa_t, each level's bits holding the lower ones'),
# and the level each 16-bit dtype's native GEMMs need. Capped below it, vLLM cannot build its GEMM for the dtype
# and torch's converts inside, as on a CPU without the instructions.
_ONEDNN_ISA_BITS = {"SSE41": 0x1, "AVX": 0x3, "AVX2": 0x7, "AVX2_VNNI": 0xF, "AVX2_VNNI_2": 0x1F, "AVX512_CORE": 0x27,
                    "AVX512_CORE_VNNI": 0x67, "AVX512_CORE_BF16": 0xE7, "AVX10_1_512": 0x1EF,
                    "AVX512_CORE_FP16": 0x1EF, "AVX10_1_512_AMX": 0xFEF, "AVX512_CORE_AMX": 0xFEF,
                    "AVX10_1_512_AMX_FP16": 0x1FEF, "AVX512_CORE_AMX_FP16": 0x1FEF}
_ONEDNN_NATIVE_BITS = {torch.bfloat16: 0xE7, torch.float16: 0x1EF}
_ONEDNN_AMX_BITS = _ONEDNN_ISA_BITS["AVX512_CORE_AMX"]


def _onednn_allows(need: int) -> bool:
    """Whether oneDNN's instruction-set cap (if any) leaves it the level whose bits are ``need``."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    bits = _ONEDNN_ISA_BITS.get(cap)
    if bits is None:  # no cap, ALL / DEFAULT, or a level newer than this table (above all of these)
        return True
    return bits & need == need


def onednn_allows_amx() -> bool:
    """Whether oneDNN's instruction-set cap leaves it AMX. torch's small-GEMM kernels (``brgemm``, under vLLM's AMX
    linear path) run only on oneDNN's AMX kernels and raise where the cap hides AMX from oneDNN."""
    return _onednn_allows(_ONEDNN_AMX_BITS)


@functools.cache
def native_16bit(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` (bfloat16 / float16) natively, so torch's and oneDNN's GEMMs in it run
    at full rate: it has the instructions and oneDNN is not capped below them (``ONEDNN_MAX_CPU_ISA``)."""
    from vllm_glm53.backends.cpu.build import cpu_flags

    return bool(_NATIVE_FLAGS.get(dtype, set()) & cpu_flags()) and _onednn_allows(_ONEDNN_NATIVE_BITS[dtype])


@functools.cache
def amx_bf16() -> bool:
    """Whether torch's bfloat16 GEMMs run on AMX tiles here: the CPU has them and oneDNN is not capped below AMX."""
    from vllm_glm53.backends.cpu.build import cpu_flags

    return "amx_bf16" in cpu_flags() and onednn_allows_amx()


def widens(dtype: torch.dtype) -> bool:
    """Whether products in ``dtype`` go to :data:`linear16` on this CPU: a 16-bit dtype it has no native arithmetic
    for (torch's GEMMs would convert inside their loops)."""
    return dtype in _NATIVE_FLAGS and not native_16bit(dtype)


linear16 = Op("linear16")
_tensors = compiled_kernels_check(lambda x, weight: (x, weight))


def _linear16_check(x, weight):
    if weight.dtype not in _NATIVE_FLAGS:
        return f"needs bfloat16 or float16 weights, got {weight.dtype}"
    return _tensors(x, weight)


@linear16.register("compiled", _linear16_check)
def _linear16_compiled(x, weight):
    return kernels.ops().linear16(x, weight)


@linear16.register("torch")
def linear16_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` for x ``[M, K]`` and a 16-bit weight ``[N, K]``: ``[M, N]`` in x's dtype, computed in float32.

    Plain torch (any device): the weight widened to float32, then one matmul."""
    return F.linear(x.float(), weight.float()).to(x.dtype)


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """vLLM's ``cpu_linear(x, weight, bias)`` contract over :data:`linear16` (x ``[..., K]``)."""
    out = linear16(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def runs_on_linear16(dtype: torch.dtype) -> bool:
    """Whether the plugin's model runs CPU GEMMs with ``dtype`` weights on :data:`linear16` here (see
    :func:`take_16bit_gemms`)."""
    return kernels.ops() is not None and kernels.isa() != "portable" and widens(dtype)


def take_16bit_gemms(model: torch.nn.Module) -> int:
    """Run the CPU GEMMs of ``model`` whose weights are bfloat16 / float16 through :data:`linear16`, where the CPU
    has no native arithmetic for them and vectorized kernels (avx2 / avx512) are loaded; returns how many layers it
    took (0 when the conditions do not hold: vLLM's dispatch stays).

    Not with the ``portable`` build: its SSE2 loops stream a 16-bit weight 3-5x slower than torch's bfloat16 GEMM
    at 1-16 tokens (forced on the AVX2 machine, where torch itself runs AVX2 code; a CPU without AVX2 was not
    measured), so only the layers' float32 GEMMs beyond that would gain."""
    taken = 0
    for layer in _vllm.cpu_gemm_layers(model):
        if runs_on_linear16(layer.weight.dtype):
            _vllm.set_cpu_gemm(layer, _cpu_linear)
            taken += 1
    if taken:
        logger.info("vllm-glm53: %d linear layers with 16-bit weights run on the compiled linear16 kernel (this CPU "
                    "has no native 16-bit arithmetic)", taken)
    return taken
