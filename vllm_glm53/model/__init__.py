"""The model classes vLLM loads (registered lazily as ``vllm_glm53.model:<Class>``).

Registering this package rather than a plain module matters: vLLM caches what it learns about a model class
(hybrid, inner state, ...) keyed by a hash of the registered module file, and for a package it hashes every
file in it, so edits to any layer here invalidate the cache.
"""

from vllm_glm53.model.model import Glm5NextForCausalLM, Glm5NextForConditionalGeneration
from vllm_glm53.model.mtp import Glm5NextMTPModel

__all__ = ["Glm5NextForCausalLM", "Glm5NextForConditionalGeneration", "Glm5NextMTPModel"]
