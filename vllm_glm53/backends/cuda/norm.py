"""RMSNorm on GPUs: the reference form of :mod:`vllm_glm53.backends.cpu.norm` (a few elementwise kernels; the
GPU runs vLLM's own model unless the plugin's is asked for)."""

from __future__ import annotations

from vllm_glm53.backends.cpu.norm import rms_norm_torch as rms_norm

__all__ = ["rms_norm"]
