"""GLM-5.3-Flash chat: the prompt format (``render``, in ``chat.prompt_format``), the ``glm5_next`` tokenizer mode and
its renderer.

``render`` is a pure function with no vLLM or model import; the tokenizer (``chat.tokenizer``) and the
renderer (``chat.renderer``) are loaded by vLLM through the names registered in ``vllm_glm53.TOKENIZER_MODES``
and ``vllm_glm53.RENDERERS``.
"""

from vllm_glm53.chat.prompt_format import render

__all__ = ["render"]
