"""mHC on GPUs: the CPU backend's plain-torch forms (:mod:`vllm_glm53.backends.cpu.mhc`). Torch ops run on any
device, so these are the GPU implementation as they stand: the coefficient GEMM and the mixes are ordinary
kernels, the per-token sigmoid / softmax / Sinkhorn steps a few dozen small elementwise launches per block (no
fused GPU kernel for them yet).
"""

from __future__ import annotations

from vllm_glm53.backends.cpu.mhc import mhc_coefficients_torch as mhc_coefficients
from vllm_glm53.backends.cpu.mhc import mhc_collapse_torch as mhc_collapse
from vllm_glm53.backends.cpu.mhc import mhc_expand_torch as mhc_expand

__all__ = ["mhc_coefficients", "mhc_collapse", "mhc_expand"]
