"""Tool parser ``glm47`` (also registered as ``glm45``): GLM's XML-like tool calls to OpenAI tool calls.

``<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>`` becomes the call
``get_weather({"city": "Paris"})``; argument values are typed from the request's tool schema (see
``schema``). The parser runs on the text after reasoning, which vLLM's composed parser hands over.

Streaming works on deltas alone (``engine_based_streaming``: vLLM passes only the new text and token ids,
and calls ``finish_streaming`` at the end). A call's first delta carries its index, id and name, the
argument deltas are successive pieces of the final JSON text, and the closing brace comes when the call
ends. Tool choices: ``none`` consumes the markup and returns no calls (for a request that declares tools;
vLLM's serving layer discards the calls of a tool-less one itself); ``auto`` and ``required`` parse the same
way (generation is constrained to the call syntax by vLLM's ``glm_4_7`` structural tag, not by the parser); a
named choice returns only calls to that function.

Results equal vLLM 0.32's GLM parser's except where that one loses output (``tests/test_parsers_vllm_diff.py``
lists each case): text after a call stays content; streamed content is the one-shot content; malformed or
truncated markup keeps what it carried (missing closers implied, a stray opener inside a call ignored, a value
cut off by ``max_tokens`` kept); tags inside a value are text; object/array members are typed by the schema.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_glm53 import _vllm
from vllm_glm53.parsers.lexer import TagLexer, tag_ids
from vllm_glm53.parsers.machine import CallExtractor, Update


def tool_schemas(tools: Sequence[Any] | None) -> dict[str, Mapping[str, Any]] | None:
    """Function name -> its ``parameters`` schema, from a request's tools (``None`` when there are none)."""
    if not tools:
        return None
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        data = tool.model_dump() if hasattr(tool, "model_dump") else tool
        if not isinstance(data, Mapping):
            continue
        fn = data["function"] if isinstance(data.get("function"), Mapping) else data
        name = fn.get("name")
        if isinstance(name, str):
            parameters = fn.get("parameters")
            schemas.setdefault(name, parameters if isinstance(parameters, Mapping) else {})
    return schemas


def named_choice(tool_choice: Any) -> str | None:
    """The function a named ``tool_choice`` forces (chat or Responses API shape), else ``None``."""
    if tool_choice is None or isinstance(tool_choice, str):
        return None
    data = tool_choice.model_dump() if hasattr(tool_choice, "model_dump") else tool_choice
    if not isinstance(data, Mapping):
        return None
    fn = data["function"] if isinstance(data.get("function"), Mapping) else data
    name = fn.get("name")
    return name if isinstance(name, str) else None


def extractor_for(request: Any, fallback_tools: Sequence[Any] | None = None, reasoning_markup: bool = True):
    """A ``CallExtractor`` configured by the request's tools and ``tool_choice``.

    ``tool_choice="none"`` suppresses calls only when the request declares tools, as in vLLM: a request
    without tools defaults to ``"none"``, and the tool parser alone must still return the calls of such a
    request (vLLM's serving layer discards them itself, keeping the content the parser returns).
    """
    request_tools = getattr(request, "tools", None)
    schemas = tool_schemas(request_tools or fallback_tools)
    tool_choice = getattr(request, "tool_choice", None)
    forced = named_choice(tool_choice)

    def properties_of(name: str) -> Mapping[str, Any] | None:
        if schemas is None:
            return None
        properties = schemas.get(name, {}).get("properties")
        return properties if isinstance(properties, Mapping) else {}

    def allowed(name: str) -> bool:
        if forced is not None and name != forced:
            return False
        return schemas is None or name in schemas

    return CallExtractor(
        properties_of,
        allowed,
        emit_calls=not (tool_choice == "none" and request_tools),
        reasoning_markup=reasoning_markup,
        blank_content=tool_choice != "required" and forced is None,
    )


def _function_strict_level():
    try:
        return _vllm.ToolStrictLevel.FUNCTION
    except ImportError:  # vLLM before tool strict levels
        return None


class Glm47ToolParser(_vllm.ToolParser):
    # GLM calls are XML-like: the generic JSON path for required/named choices cannot read them.
    supports_required_and_named = False
    structural_tag_model = "glm_4_7"
    default_tool_strict_level = _function_strict_level()
    engine_based_streaming = True
    # Set by vLLM when no reasoning parser is configured: think tags are then plain content.
    skip_reasoning_parsing = False

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None, **_: Any) -> None:
        super().__init__(tokenizer, tools)
        self._ids_to_tags = tag_ids(self.vocab)
        self._stream: tuple[TagLexer, CallExtractor, bool] | None = None  # lexer, extractor, tool_choice none
        self._last_calls_delta: Any = None  # the last streamed delta that carried tool calls

    def _lexer(self) -> TagLexer:
        return TagLexer(self._ids_to_tags, self._decode)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.model_tokenizer.decode(list(ids), skip_special_tokens=False)

    def adjust_request(self, request: Any) -> Any:
        request = super().adjust_request(request)
        # The tags are special tokens: they must survive detokenization to be parsed.
        if hasattr(request, "skip_special_tokens"):
            request.skip_special_tokens = False
        return request

    def extract_tool_calls(self, model_output: str, request: Any) -> Any:
        lexer = self._lexer()
        extractor = extractor_for(request, self.tools, not self.skip_reasoning_parsing)
        result = extractor.feed(lexer.feed(model_output) + lexer.flush()) + extractor.finish()
        content = result.content.strip() if extractor.calls_returned else result.content
        calls: dict[int, list[str]] = {}  # index -> [name, arguments]
        for call in result.calls:
            entry = calls.setdefault(call.index, [call.name or "", ""])
            entry[1] += call.arguments
        return _vllm.ExtractedToolCallInformation(
            tools_called=bool(calls),
            tool_calls=[
                _vllm.ToolCall(type="function", function=_vllm.FunctionCall(name=name, arguments=arguments))
                for name, arguments in calls.values()
            ],
            content=content or None,
        )

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> Any:
        if self._stream is None:
            extractor = extractor_for(request, self.tools, not self.skip_reasoning_parsing)
            self._stream = (self._lexer(), extractor, getattr(request, "tool_choice", None) == "none")
        lexer, extractor, _ = self._stream
        return self._delta(extractor.feed(lexer.feed(delta_text, delta_token_ids)))

    def finish_streaming(self) -> Any:
        """End of output: close what is open (a call missing ``</tool_call>``), settle held whitespace.

        Under ``tool_choice="none"`` vLLM's composed parser clears the tool calls of every streamed delta but
        not of this last one, which would hand the client a call (or a nameless piece of one) it must not get.
        So under ``"none"`` this delta starts no new call, and it continues none when the caller cleared the
        calls of our earlier deltas; a caller that kept them (the tool parser driven alone, for a request
        without tools) gets its open call closed."""
        if self._stream is None:
            return None
        lexer, extractor, choice_none = self._stream
        update = extractor.feed(lexer.flush()) + extractor.finish()
        if choice_none:
            calls_discarded = self._last_calls_delta is not None and not self._last_calls_delta.tool_calls
            update.calls = [c for c in update.calls if c.name is None and not calls_discarded]
        return self._delta(update)

    def _delta(self, update: Update) -> Any:
        if not update:
            return None
        tool_calls = []
        for call in update.calls:
            if call.name is not None:  # a new call: vLLM's bookkeeping of what was streamed per call
                self.current_tool_id = call.index
                self.current_tool_name_sent = True
                self.prev_tool_call_arr.append({"name": call.name, "arguments": ""})
                self.streamed_args_for_tool.append("")
                function = _vllm.DeltaFunctionCall(name=call.name, arguments=call.arguments)
                tool_calls.append(
                    _vllm.DeltaToolCall(
                        index=call.index, id=_vllm.make_tool_call_id(), type="function", function=function
                    )
                )
            else:
                tool_calls.append(
                    _vllm.DeltaToolCall(index=call.index, function=_vllm.DeltaFunctionCall(arguments=call.arguments))
                )
            self.streamed_args_for_tool[call.index] += call.arguments
            self.prev_tool_call_arr[call.index]["arguments"] = self.streamed_args_for_tool[call.index]
        message = _vllm.DeltaMessage(
            reasoning=update.reasoning or None, content=update.content or None, tool_calls=tool_calls
        )
        if tool_calls:
            self._last_calls_delta = message  # finish_streaming checks whether the caller kept its calls
        return message
