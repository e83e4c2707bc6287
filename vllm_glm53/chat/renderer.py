"""The ``glm5_next`` renderer: chat messages to prompt token ids for vLLM's front-end.

vLLM picks the renderer by tokenizer mode. This one parses the request's messages in the ``openai`` content
format (parts stay parts, so image/video/audio placeholders land inline, in part order), renders them with
``Glm5NextTokenizer.apply_chat_template`` and hands vLLM the *token ids*. Handing back the prompt string
instead (what vLLM's own DeepSeek renderers do) would let vLLM re-tokenize it with special-token matching on,
turning text that spells ``<|assistant|>`` in a user message back into a control token.
"""

from __future__ import annotations

from typing import Any

from vllm_glm53 import _vllm

# vLLM's request-time kwargs include ``tokenize=False`` (it expects a string back); the ids are the point.
_TOKEN_IDS = {"tokenize": True, "return_dict": False}


class Glm5NextRenderer(_vllm.BaseRenderer):
    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        self._render_ids_async = _vllm.make_async(self._render_ids, executor=self._executor)

    def _render_ids(self, conversation: list[dict[str, Any]], params: Any) -> list[int]:
        kwargs = {**params.get_apply_chat_template_kwargs(), **_TOKEN_IDS}
        return self.get_tokenizer().apply_chat_template(conversation, **kwargs)

    def _parse_kwargs(self, params: Any) -> dict[str, Any]:
        return {
            "content_format": "openai",
            "media_io_kwargs": params.media_io_kwargs,
            "mm_processor_kwargs": params.mm_processor_kwargs,
        }

    @staticmethod
    def _prompt(token_ids: list[int], mm_data: Any, mm_uuids: Any, params: Any) -> Any:
        prompt = _vllm.parse_dec_only_prompt(token_ids)
        if mm_data is not None:
            prompt["multi_modal_data"] = mm_data
            if params.mm_processor_kwargs:  # per-request processor settings (e.g. max_image_tokens)
                prompt["mm_processor_kwargs"] = params.mm_processor_kwargs
        if mm_uuids is not None:
            prompt["multi_modal_uuids"] = mm_uuids
        return prompt

    def render_messages(self, messages: list[Any], params: Any) -> tuple[list[Any], Any]:
        conversation, mm_data, mm_uuids = _vllm.parse_chat_messages(
            messages, self.model_config, **self._parse_kwargs(params)
        )
        return conversation, self._prompt(self._render_ids(conversation, params), mm_data, mm_uuids, params)

    async def render_messages_async(self, messages: list[Any], params: Any) -> tuple[list[Any], Any]:
        conversation, mm_data, mm_uuids = await _vllm.parse_chat_messages_async(
            messages, self.model_config, **self._parse_kwargs(params)
        )
        token_ids = await self._render_ids_async(conversation, params)
        return conversation, self._prompt(token_ids, mm_data, mm_uuids, params)
