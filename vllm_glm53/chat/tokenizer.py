"""The ``glm5_next`` tokenizer mode: the checkpoint's ``tokenizer.json`` with native chat rendering.

``Glm5NextTokenizer`` is the checkpoint's fast tokenizer (a transformers ``TokenizersBackend`` subclass, so
vLLM's fast detokenizer and xgrammar keep working on it) whose ``apply_chat_template`` renders with
``vllm_glm53.chat.render`` instead of a Jinja template, and tokenizes the rendering segment by segment:

- the format's own control tokens (``[gMASK]``, ``<|user|>``, ``<think>``, ``<tool_call>``, ...) become
  their token ids;
- every other piece of text, the request's text above all, is encoded with special-token matching off, so
  a user message spelling ``<|assistant|>`` or ``<tool_call>`` is ordinary text to the model and cannot
  open a fake turn or a fake tool call.

For text that spells no special token the ids are exactly ``encode(render(...), add_special_tokens=False)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

try:  # transformers >= 5
    from transformers import TokenizersBackend as _FastTokenizer
except ImportError:  # transformers 4.x
    from transformers import PreTrainedTokenizerFast as _FastTokenizer
from transformers import BatchEncoding

from vllm_glm53.chat.prompt_format import Segment, render_segments
from vllm_glm53.chat.tokens import ADDED_TOKENS

# Arguments of ``apply_chat_template`` that steer tokenization rather than the rendering.
_TOKENIZE_KWARGS = ("tokenize", "return_dict", "truncation", "max_length")
# vLLM passes the template and the conversation among the keywords; they are not template variables.
_NOT_VARIABLES = ("chat_template", "conversation", "messages", "tools")


class Glm5NextTokenizer(_FastTokenizer):
    """The GLM-5.3-Flash tokenizer with the chat format rendered in Python (tokenizer mode ``glm5_next``)."""

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | Path,
        *args: Any,
        trust_remote_code: bool = False,
        revision: str | None = None,
        download_dir: str | None = None,
        **kwargs: Any,
    ) -> Glm5NextTokenizer:
        """Load like vLLM's ``hf`` mode does, returning the tokenizer wrapped in vLLM's property cache."""
        from vllm_glm53 import _vllm

        if revision is not None:
            kwargs["revision"] = revision
        tokenizer = super().from_pretrained(
            path_or_repo_id, *args, trust_remote_code=trust_remote_code, cache_dir=download_dir, **kwargs
        )
        return _vllm.get_cached_tokenizer(tokenizer)

    def apply_chat_template(
        self, messages: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> str | list[int] | BatchEncoding:
        """Render ``messages`` (vLLM passes them as ``conversation=``) in the GLM-5.3-Flash format.

        Template variables come from the keyword arguments and from a ``chat_template_kwargs`` dict among
        them; a variable given both ways takes the top-level value (vLLM merges the request's top-level
        ``reasoning_effort`` into the keyword arguments). ``add_generation_prompt`` defaults to true. With
        ``tokenize`` (default true) the result is the token ids (a ``BatchEncoding`` with ``return_dict``),
        otherwise the prompt string.
        """
        conversation = kwargs.get("conversation")
        if conversation is None:
            conversation = messages
        if conversation is None:
            raise TypeError("apply_chat_template() needs the messages to render")
        options = {k: kwargs.pop(k) for k in _TOKENIZE_KWARGS if k in kwargs}
        variables = dict(kwargs.pop("chat_template_kwargs", None) or {})
        variables.update((k, v) for k, v in kwargs.items() if v is not None)
        if tools is None:
            tools = variables.get("tools")
        for key in _NOT_VARIABLES:
            variables.pop(key, None)
        variables.setdefault("add_generation_prompt", True)

        segments = render_segments(conversation, tools, **variables)
        if not options.get("tokenize", True):
            return "".join(text for text, _ in segments)
        ids = self.encode_segments(segments)
        if options.get("truncation") and options.get("max_length") is not None:
            limit = options["max_length"]
            ids = ids[-limit:] if self.truncation_side == "left" else ids[:limit]
        if options.get("return_dict"):
            return BatchEncoding({"input_ids": ids, "attention_mask": [1] * len(ids)})
        return ids

    def encode_segments(self, segments: list[Segment]) -> list[int]:
        """Token ids of a rendering: control segments as their ids, text with special-token matching off."""
        control = self._control_ids()
        ids: list[int] = []
        for text, is_control in segments:
            if is_control:
                ids.append(control[text])
            else:
                ids.extend(self.encode_plain(text))
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Encode ``text`` so that no added token is matched: a spelled ``<|user|>`` stays characters."""
        plain, added_ids, added_re = self._plain_state()
        ids = plain.encode(text, add_special_tokens=False).ids
        if added_ids.isdisjoint(ids):
            return ids
        # Added tokens registered as non-special are matched even with special-token matching off. Cut
        # each spelled occurrence after its first character so that the pieces cannot match it.
        ids = []
        pos = 0
        for match in added_re.finditer(text):
            for piece in (text[pos : match.start() + 1], match.group()[1:]):
                ids.extend(plain.encode(piece, add_special_tokens=False).ids)
            pos = match.end()
        ids.extend(plain.encode(text[pos:], add_special_tokens=False).ids)
        return ids

    def _control_ids(self) -> dict[str, int]:
        cached = self.__dict__.get("_glm_control_ids")
        if cached is None:
            vocab = self.get_vocab()
            missing = [t for t in ADDED_TOKENS if t not in vocab]
            if missing:
                raise ValueError(f"the tokenizer lacks GLM-5.3 added tokens {missing}; is this a GLM-5.3 checkpoint?")
            cached = {t: vocab[t] for t in ADDED_TOKENS}
            self.__dict__["_glm_control_ids"] = cached
        return cached

    def _plain_state(self):
        """A private copy of the Rust tokenizer with special-token matching off (the shared one is toggled
        per call by transformers, which is not thread-safe), the added-token ids and a pattern for them."""
        cached = self.__dict__.get("_glm_plain")
        if cached is None:
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(self._tokenizer.to_str())
            plain.encode_special_tokens = True
            added = self.get_added_vocab()
            pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
            cached = (plain, frozenset(added.values()), re.compile(pattern or r"(?!)"))
            self.__dict__["_glm_plain"] = cached
        return cached
