"""The GLM-5.3-Flash prompt format, rendered natively (no Jinja).

``render`` reproduces, byte for byte, what the released ``zai-org/GLM-5.3-Flash`` chat template (revision
``eb9eb208…``) renders. The rendering is built as a list of *segments*, ``(text, is_control)``: a control
segment is exactly one of the 36 added tokens and is written by the format itself; every other piece of
text, including everything that comes from the request (message content, reasoning, tool names, arguments,
tool results, tool definitions), is plain text. The ``glm5_next`` tokenizer encodes the segments so that
request text spelling ``<|assistant|>`` or ``<tool_call>`` becomes ordinary text tokens; ``render`` just
joins them.

Deliberate choices where the raw template would fail or is silent:

- Multimodal parts render inline, in part order, as the template does for OpenAI-style content lists
  (image → ``<|begin_of_image|><|image|><|end_of_image|>``, video → ``<|begin_of_video|><|video|>
  <|end_of_video|>``, audio → ``<|begin_of_audio|><|end_of_audio|>``). The vLLM renderer therefore parses
  messages in the ``openai`` content format, which keeps that order (the ``string`` format would move all
  placeholders in front of the text).
- Tool-call ``arguments`` given as a JSON string are parsed; invalid JSON or a non-object gives ``{}``
  (vLLM's chat parser does the same before any template runs; the raw template would raise).
- Assistant reasoning is read from ``reasoning_content`` or, failing that, ``reasoning`` (vLLM fills both).
- A ``tool_reference`` result with no tools in the request renders an empty ``<tools>`` list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_glm53.chat.tokens import ADDED_TOKENS

Segment = tuple[str, bool]  # (text, is_control)

_CONTROL = frozenset(ADDED_TOKENS)
_MISSING = object()  # a key that is absent (the template's "undefined"), distinct from None

IMAGE_PLACEHOLDER = ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>")
VIDEO_PLACEHOLDER = ("<|begin_of_video|>", "<|video|>", "<|end_of_video|>")
AUDIO_PLACEHOLDER = ("<|begin_of_audio|>", "<|end_of_audio|>")
_PLACEHOLDERS = {
    "image": IMAGE_PLACEHOLDER,
    "image_url": IMAGE_PLACEHOLDER,
    "video": VIDEO_PLACEHOLDER,
    "video_url": VIDEO_PLACEHOLDER,
    "audio": AUDIO_PLACEHOLDER,
    "audio_url": AUDIO_PLACEHOLDER,
    "input_audio": AUDIO_PLACEHOLDER,
}

_TOOLS_INTRO = (
    "\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_OUTRO = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
)
# The call-format example that closes the tools block; its tags are real control tokens in the template.
_CALL_EXAMPLE: tuple[Segment, ...] = (
    ("<tool_call>", True), ("{function-name}", False),
    ("<arg_key>", True), ("{arg-key-1}", False), ("</arg_key>", True),
    ("<arg_value>", True), ("{arg-value-1}", False), ("</arg_value>", True),
    ("<arg_key>", True), ("{arg-key-2}", False), ("</arg_key>", True),
    ("<arg_value>", True), ("{arg-value-2}", False), ("</arg_value>", True),
    ("...", False), ("</tool_call>", True),
)  # fmt: skip
_TOOL_LINE_SKIPPED_KEYS = ("defer_loading", "strict")


def effort_label(reasoning_effort: Any) -> str:
    """The value written after ``Reasoning Effort:``: exactly ``"low"``/``"high"`` pick Low/High, anything
    else (unset, ``None``, ``"max"``, ``"medium"``, ``"none"``, other casings, ...) is Max."""
    if isinstance(reasoning_effort, str) and reasoning_effort in ("low", "high"):
        return reasoning_effort.capitalize()
    return "Max"


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Render a conversation as the GLM-5.3-Flash prompt string.

    ``kwargs`` are the other chat-template variables; the format reads only ``clear_thinking`` (drop the
    reasoning of assistant turns before the last user turn). Others (``enable_thinking``, ...) have no
    effect: the model always thinks.
    """
    return "".join(
        text for text, _ in render_segments(messages, tools, reasoning_effort, add_generation_prompt, **kwargs)
    )


def render_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
    *,
    clear_thinking: Any = False,
    **_ignored: Any,
) -> list[Segment]:
    """``render`` as segments ``(text, is_control)``; adjacent plain-text segments are merged."""
    out = _Segments()
    tool_defs = [_as_mapping(t) for t in tools or ()]
    out.control("[gMASK]", "<sop>", "<|system|>")
    out.text("Reasoning Effort: " + effort_label(reasoning_effort))
    if tool_defs:
        _tools_block(out, tool_defs)

    messages = [_as_mapping(m) for m in messages]
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    i = 0
    while i < len(messages):
        m = messages[i]
        role = m.get("role")
        if role == "user":
            out.control("<|user|>")
            _visible(out, m.get("content", _MISSING))
        elif role == "system":
            out.control("<|system|>")
            _visible(out, m.get("content", _MISSING))
        elif role == "assistant":
            keep_reasoning = not clear_thinking or i > last_user
            _assistant(out, m, keep_reasoning)
        elif role == "tool":
            end = i
            while end < len(messages) and messages[end].get("role") == "tool":
                end += 1
            previous = messages[i - 1] if i > 0 else None
            calls = previous.get("tool_calls") if previous and previous.get("role") == "assistant" else None
            _tool_results(out, messages[i:end], calls, tool_defs)
            i = end
            continue
        i += 1  # any other role is skipped, as the template does
    if add_generation_prompt:
        out.control("<|assistant|>", "<think>")
    return out.segments


# ---------------------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------------------


class _Segments:
    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def control(self, *tokens: str) -> None:
        for token in tokens:
            if token not in _CONTROL:
                raise ValueError(f"{token!r} is not a GLM-5.3 added token")
            self.segments.append((token, True))

    def text(self, text: str) -> None:
        if not text:
            return
        if self.segments and not self.segments[-1][1]:
            self.segments[-1] = (self.segments[-1][0] + text, False)
        else:
            self.segments.append((text, False))

    def extend(self, segments: Sequence[Segment]) -> None:
        for text, is_control in segments:
            if is_control:
                self.control(text)
            else:
                self.text(text)


def _as_mapping(obj: Any) -> Mapping[str, Any]:
    """Messages and tools are JSON-like dicts; pydantic objects are accepted through their dump."""
    if isinstance(obj, Mapping):
        return obj
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    raise TypeError(f"expected a mapping, got {type(obj).__name__}")


def _get(obj: Any, key: str) -> Any:
    """``obj.key`` as the template sees it: a mapping's entry, or ``_MISSING``."""
    return obj.get(key, _MISSING) if isinstance(obj, Mapping) else _MISSING


def _tool_function(tool: Mapping[str, Any]) -> Any:
    return tool["function"] if "function" in tool else tool


def _tool_line(fn: Mapping[str, Any]) -> str:
    # Keys are written raw inside quotes, values as JSON (Python's default separators, unicode kept).
    pairs = (f'"{k}": {json.dumps(v, ensure_ascii=False)}' for k, v in fn.items() if k not in _TOOL_LINE_SKIPPED_KEYS)
    return "{" + ", ".join(pairs) + "}"


def _tools_block(out: _Segments, tool_defs: list[Mapping[str, Any]]) -> None:
    out.control("<|system|>")
    out.text(_TOOLS_INTRO)
    for tool in tool_defs:
        fn = _tool_function(tool)
        deferred = _get(fn, "defer_loading")
        if deferred is _MISSING or not deferred:  # deferred tools are announced only by a tool_reference
            out.text(_tool_line(fn) + "\n")
    out.text(_TOOLS_OUTRO)
    out.extend(_CALL_EXAMPLE)


def _visible(out: _Segments, content: Any) -> None:
    """The visible text of a message's content: strings as they are, lists part by part."""
    if content is None or content is _MISSING:
        return
    if isinstance(content, str):
        out.text(content)
    elif isinstance(content, (list, tuple)):
        for part in content:
            if isinstance(part, str):
                out.text(part)
            elif isinstance(part, Mapping):
                kind = part.get("type")
                if kind == "text":
                    text = part.get("text", _MISSING)
                    out.text("" if text is _MISSING else str(text))
                elif isinstance(kind, str) and kind in _PLACEHOLDERS:
                    out.control(*_PLACEHOLDERS[kind])
    else:  # a number, a mapping, ...: the template prints it
        out.text(str(content))


def _slice(segments: list[Segment], start: int, stop: int) -> list[Segment]:
    """The segments covering characters ``[start, stop)`` of their joined text (never cuts a control)."""
    result: list[Segment] = []
    pos = 0
    for text, is_control in segments:
        lo, hi = max(start, pos), min(stop, pos + len(text))
        if lo < hi:
            result.append((text[lo - pos : hi - pos], is_control))
        pos += len(text)
    return result


def _assistant(out: _Segments, m: Mapping[str, Any], keep_reasoning: bool) -> None:
    body = _Segments()
    _visible(body, m.get("content", _MISSING))
    segments = body.segments
    text = "".join(t for t, _ in segments)
    content = (0, len(text))
    reasoning: list[Segment] | None = None
    for field in ("reasoning_content", "reasoning"):
        value = m.get(field)
        if isinstance(value, str):
            reasoning = [(value, False)] if value else []
            break
    else:
        if "</think>" in text:
            # Reasoning inlined in the content: before the first </think>, after the last <think> there;
            # the content is what follows the last </think>.
            end = text.index("</think>")
            start = text.rfind("<think>", 0, end)
            reasoning = _slice(segments, 0 if start < 0 else start + len("<think>"), end)
            content = (text.rindex("</think>") + len("</think>"), len(text))
    lo, hi = content
    while lo < hi and text[lo].isspace():
        lo += 1
    while hi > lo and text[hi - 1].isspace():
        hi -= 1

    out.control("<|assistant|>", "<think>")
    if keep_reasoning and reasoning is not None:
        out.extend(reasoning)
    out.control("</think>")
    out.extend(_slice(segments, lo, hi))
    for call in m.get("tool_calls") or ():
        fn = call["function"] if isinstance(call, Mapping) and call.get("function") else call
        name = _get(fn, "name")
        out.control("<tool_call>")
        out.text("" if name is _MISSING else str(name))
        for key, value in _arguments(_get(fn, "arguments")).items():
            out.control("<arg_key>")
            out.text(str(key))
            out.control("</arg_key>", "<arg_value>")
            out.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
            out.control("</arg_value>")
        out.control("</tool_call>")


def _arguments(arguments: Any) -> Mapping[str, Any]:
    if isinstance(arguments, Mapping):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


# ---------------------------------------------------------------------------------------------------------
# Tool results
# ---------------------------------------------------------------------------------------------------------


def _result_id(obj: Any) -> str:
    """A result's (or call's) id: ``tool_call_id`` if set, else ``id``, else empty."""
    for key in ("tool_call_id", "id"):
        value = _get(obj, key)
        if value is not _MISSING and value:
            return str(value)
    return ""


def _is_output_list(content: Any) -> bool:
    return isinstance(content, (list, tuple)) and bool(content) and _get(content[0], "output") is not _MISSING


def _is_reference_list(content: Any) -> bool:
    return isinstance(content, (list, tuple)) and bool(content) and _get(content[0], "type") == "tool_reference"


def _tool_response(out: _Segments, content: Any) -> None:
    out.control("<tool_response>")
    _visible(out, content)
    out.control("</tool_response>")


def _tool_references(out: _Segments, refs: Sequence[Any], tool_defs: list[Mapping[str, Any]]) -> None:
    """A ``tool_reference`` result re-emits the referenced tools' definitions (deferred ones included)."""
    out.control("<tool_response>")
    out.text("<tools>\n")
    for ref in refs:
        for tool in tool_defs:
            fn = _tool_function(tool)
            if _get(fn, "name") == _get(ref, "name"):
                out.text(_tool_line(fn) + "\n")
    out.text("</tools>")
    out.control("</tool_response>")


def _output_entry(out: _Segments, entry: Any, tool_defs: list[Mapping[str, Any]]) -> None:
    output = _get(entry, "output")
    if _is_reference_list(output):
        _tool_references(out, output, tool_defs)
    else:
        _tool_response(out, output)


def _tool_message(out: _Segments, m: Mapping[str, Any], tool_defs: list[Mapping[str, Any]]) -> None:
    content = m.get("content")
    if isinstance(content, str):
        _tool_response(out, content)
    elif _is_reference_list(content):
        _tool_references(out, content, tool_defs)
    elif _is_output_list(content):
        for entry in content:
            _output_entry(out, entry, tool_defs)
    else:
        _tool_response(out, content)


def _result_ids(block: Sequence[Mapping[str, Any]]) -> list[str]:
    ids: list[str] = []
    for m in block:
        if _is_output_list(m.get("content")):
            ids.extend(_result_id(entry) for entry in m["content"])
        else:
            ids.append(_result_id(m))
    return ids


def _can_reorder(block: Sequence[Mapping[str, Any]], calls: Sequence[Any]) -> bool:
    """Results follow the calls' order only when every result id is set, unique and among the call ids,
    and every call id is set and unique."""
    call_ids = [_result_id(c) for c in calls]
    result_ids = _result_ids(block)
    return (
        all(call_ids)
        and len(set(call_ids)) == len(call_ids)
        and all(result_ids)
        and len(set(result_ids)) == len(result_ids)
        and set(result_ids) <= set(call_ids)
    )


def _tool_results(
    out: _Segments, block: Sequence[Mapping[str, Any]], calls: Any, tool_defs: list[Mapping[str, Any]]
) -> None:
    """A run of consecutive tool messages: one ``<|observation|>``, then one response per result."""
    out.control("<|observation|>")
    if not calls or not _can_reorder(block, calls):
        for m in block:
            _tool_message(out, m, tool_defs)
        return
    for call in calls:
        call_id = _result_id(call)
        for m in block:
            if _is_output_list(m.get("content")):
                for entry in m["content"]:
                    if _result_id(entry) == call_id:
                        _output_entry(out, entry, tool_defs)
            elif _result_id(m) == call_id:
                _tool_message(out, m, tool_defs)
