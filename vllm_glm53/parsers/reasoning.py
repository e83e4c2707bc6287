"""Reasoning parser ``glm47`` (also registered as ``glm45``): ``<think>…</think>`` to the reasoning field.

GLM-5.3-Flash always thinks: its prompt ends with ``<|assistant|><think>``, so the output starts inside
reasoning without an opening tag. Reasoning ends at ``</think>``, or implicitly at a ``<tool_call>`` (the
call is content for the tool parser); output cut off by ``max_tokens`` before either is all reasoning.
``enable_thinking=false`` (which vLLM derives from ``reasoning_effort="none"``) does not change that: the
GLM-5.3 format has no thinking switch, and turning extraction off would pour the reasoning and its
``</think>`` into the answer. The switch is honoured only for tokenizers whose chat template has one
(GLM-4.5/4.7, whose prompt then closes the thinking block itself).

Streaming works on deltas (``engine_based_streaming``) with the rules of the one-shot path, so a caller that
streams the whole output through this parser gets the one-shot result. Inside vLLM's composed parser, once
reasoning has ended, vLLM hands the rest of the output to the tool parser, which applies the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_glm53 import _vllm
from vllm_glm53.parsers.lexer import CALL_START, THINK_END, THINK_START, TagLexer, tag_ids
from vllm_glm53.parsers.machine import ReasoningSplitter

# Tokens that open a turn: markers before the last of them belong to earlier turns of a prompt.
_TURN_STARTS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")


def thinking_enabled(tokenizer: Any, chat_template_kwargs: Any) -> bool:
    """Whether the output starts in reasoning. Only a chat template with an ``enable_thinking`` switch
    (GLM-4.5/4.7) can turn it off; the GLM-5.3 format (native or as a template) always thinks."""
    template = getattr(tokenizer, "chat_template", None)
    if not (isinstance(template, str) and "enable_thinking" in template):
        return True
    kwargs = chat_template_kwargs if isinstance(chat_template_kwargs, dict) else {}
    return kwargs.get("enable_thinking") is not False and kwargs.get("thinking") is not False


class Glm47ReasoningParser(_vllm.ReasoningParser):
    engine_based_streaming = True

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        vocab = self.vocab
        self._ids_to_tags = tag_ids(vocab)
        self._think_start, self._think_end, self._call_start = (vocab[t] for t in (THINK_START, THINK_END, CALL_START))
        self._turn_starts = frozenset(vocab[t] for t in _TURN_STARTS if t in vocab)
        self._thinking = thinking_enabled(tokenizer, kwargs.get("chat_template_kwargs"))
        self._lexer = TagLexer(self._ids_to_tags, self._decode)
        self._splitter = ReasoningSplitter()

    def _decode(self, ids: Sequence[int]) -> str:
        return self.model_tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def reasoning_start_str(self) -> str:
        return THINK_START

    @property
    def reasoning_end_str(self) -> str:
        return THINK_END

    def adjust_request(self, request: Any) -> Any:
        # </think> and <tool_call> are special tokens: they must survive detokenization to be seen.
        if hasattr(request, "skip_special_tokens"):
            request.skip_special_tokens = False
        return request

    # -- token-id views (prompt check, structured outputs) ----------------------------------------------

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether reasoning is over at the end of ``input_ids`` (a prompt, or prompt plus output): the last
        marker of the current turn is ``</think>`` or ``<tool_call>``. A prompt ending in ``<think>`` is not."""
        if not self._thinking:
            return True
        for token_id in reversed(input_ids):
            if token_id in (self._think_end, self._call_start):
                return True
            if token_id == self._think_start or token_id in self._turn_starts:
                return False
        return False

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Sequence[int]) -> bool:
        """Whether ``delta_ids`` close the reasoning with ``</think>``. An implicit end at ``<tool_call>`` is
        left out on purpose: vLLM would start the tool-call grammar *after* that token, and a grammar that
        begins with ``<tool_call>`` would then force a second one."""
        if not self._thinking:
            return True
        for token_id in reversed(delta_ids):
            if token_id == self._think_end:
                return True
            if token_id == self._think_start:
                return False
        return False

    def _reasoning_end(self, ids: Sequence[int]) -> tuple[int, int] | None:
        """(end of the reasoning tokens, start of the content tokens) in generated ``ids``, or None."""
        for i, token_id in enumerate(ids):
            if token_id == self._think_end:
                return i, i + 1
            if token_id == self._call_start:
                return i, i
        return None

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The generated ids after reasoning ended (from the ``<tool_call>`` that ended it implicitly)."""
        if not self._thinking:
            return list(input_ids)
        end = self._reasoning_end(input_ids)
        return list(input_ids[end[1] :]) if end else []

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        if not self._thinking:
            return 0
        end = self._reasoning_end(token_ids)
        reasoning = token_ids[: end[0]] if end else token_ids
        return sum(1 for t in reasoning if t != self._think_start)

    # -- text -----------------------------------------------------------------------------------------------

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        if not self._thinking:
            return None, model_output
        lexer = TagLexer(self._ids_to_tags, self._decode)
        splitter = ReasoningSplitter()
        result = splitter.feed(lexer.feed(model_output) + lexer.flush())
        splitter.finish()
        return result.reasoning or None, result.content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> Any:
        if not self._thinking:
            return _vllm.DeltaMessage(content=delta_text) if delta_text else None
        update = self._splitter.feed(self._lexer.feed(delta_text, delta_token_ids))
        if not update:
            return None
        return _vllm.DeltaMessage(reasoning=update.reasoning or None, content=update.content or None)

    def has_engine_confirmed_reasoning_end(self) -> bool:
        return not self._thinking or self._splitter.ended

    def finish_streaming(self) -> Any:
        """At the end of reasoning: the text held back after it. At the end of output: held reasoning."""
        if not self._thinking:
            return None
        update = self._splitter.feed(self._lexer.flush())
        self._splitter.finish()
        if not update:
            return None
        return _vllm.DeltaMessage(reasoning=update.reasoning or None, content=update.content or None)
