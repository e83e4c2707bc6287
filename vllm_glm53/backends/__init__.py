"""Compute backends for the op families of GLM-5.3-Flash (KDA, lightning indexer, sparse MLA), one sub-package
per platform. ``cpu`` is plain PyTorch and doubles as the numerical reference for the other platforms.

Layers call the op families through the names below; a platform backend provides the same functions.
Only the CPU backend exists so far, and its torch ops run on any device.
"""

from vllm_glm53.backends.cpu import indexer as indexer_ops
from vllm_glm53.backends.cpu import kda as kda_ops
from vllm_glm53.backends.cpu import sparse_mla as mla_ops

__all__ = ["indexer_ops", "kda_ops", "mla_ops"]
