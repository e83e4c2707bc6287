"""State machines over lexed GLM output (see ``lexer``): one splits reasoning from the rest, one extracts
tool calls. Both are incremental and emit only what can no longer change, so that the streamed pieces,
joined, are the non-streaming result:

- reasoning: each thinking block's trailing whitespace is held back and dropped where the block ends;
- content: trailing whitespace is held back until more text follows; at the end it is dropped if the turn
  returned a tool call (non-streaming content is ``strip()``-ed then) and emitted otherwise;
- tool-call arguments stream as successive pieces of the final JSON object text.

Output format (GLM-4.5 / 4.7 / 5.x): ``<think>`` reasoning ``</think>`` content, tool calls as
``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``, with any whitespace or
newlines between the name and the tags (GLM-4.5/4.6 indent every tag on its own line). Malformed markup never
raises: a stray tag outside a call stays content, junk between argument tags is ignored, a call whose name
is missing or not allowed is consumed silently, and missing closers are implied (``</arg_value>`` by the
next ``<arg_key>`` or the end of the call, ``</tool_call>`` by the next ``<tool_call>`` or the end of output).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_glm53.parsers.lexer import (
    CALL_END,
    CALL_START,
    DROPPED,
    KEY_END,
    KEY_START,
    THINK_END,
    THINK_START,
    VALUE_END,
    VALUE_START,
    Piece,
    Tag,
)
from vllm_glm53.parsers.schema import coerce, is_string_only

REASONING, CONTENT, NAME, ARGS, KEY, VALUE, RAW_CALL = "reasoning", "content", "name", "args", "key", "value", "raw"


@dataclass
class CallUpdate:
    index: int
    name: str | None  # set on a call's first update only
    arguments: str


@dataclass
class Update:
    reasoning: str = ""
    content: str = ""
    calls: list[CallUpdate] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __add__(self, other: Update) -> Update:
        merged = Update(self.reasoning + other.reasoning, self.content + other.content)
        for call in self.calls + other.calls:
            merged.add_call(call.index, call.name, call.arguments)
        return merged

    def add_call(self, index: int, name: str | None, arguments: str) -> None:
        """A call's name (its first update) or a piece of its arguments; pieces of one call are merged."""
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == index and name is None:
            last.arguments += arguments
        else:
            self.calls.append(CallUpdate(index, name, arguments))


class _WhitespaceHold:
    """Emits text but keeps its trailing whitespace back until non-whitespace text follows."""

    def __init__(self) -> None:
        self.held = ""

    def push(self, text: str) -> str:
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body

    def take(self) -> str:
        held, self.held = self.held, ""
        return held


class ReasoningSplitter:
    """Reasoning versus everything else, for the reasoning parser, one-shot and streamed alike.

    The turn starts inside reasoning (the prompt ends with ``<think>``; a leading ``<think>`` is ignored).
    ``</think>`` ends it, and so does ``<tool_call>`` (a call is an implicit end of thinking; the call
    itself is content). After that, a later ``<think>…</think>`` block outside tool calls is reasoning too
    and a stray ``</think>`` is dropped, as vLLM's GLM parser does; tool calls pass through verbatim for the
    tool parser, tags inside them included. ``ended`` tells vLLM's composed parser that the first reasoning
    block is over (it then feeds the rest of the output to the tool parser, which applies the same rules).
    """

    def __init__(self) -> None:
        self._state = REASONING
        self._hold = _WhitespaceHold()
        self.ended = False

    def feed(self, pieces: Iterable[Piece]) -> Update:
        out = Update()
        for piece in pieces:
            tag = piece if isinstance(piece, Tag) else None
            if tag in DROPPED:
                continue
            if self._state == REASONING:
                self._reasoning(piece, tag, out)
            elif self._state == CONTENT and tag == THINK_START:
                self._state = REASONING
            elif self._state == CONTENT and tag == THINK_END:
                continue
            else:
                out.content += piece
                if tag == CALL_START:
                    self._state = RAW_CALL
                elif tag == CALL_END and self._state == RAW_CALL:
                    self._state = CONTENT
        return out

    def _reasoning(self, piece: Piece, tag: str | None, out: Update) -> None:
        if tag == THINK_START:
            return
        if tag in (THINK_END, CALL_START):
            self._hold.take()
            self.ended = True
            self._state = CONTENT
            if tag == CALL_START:
                out.content += piece
                self._state = RAW_CALL
            return
        out.reasoning += self._hold.push(piece)

    def finish(self) -> None:
        """End of output: reasoning cut off (max_tokens) keeps no trailing whitespace either."""
        self._hold.take()


class _Call:
    def __init__(self) -> None:
        self.name = ""
        self.index = -1  # >= 0 once the name is known to be valid
        self.properties: Mapping[str, Any] | None = None
        self.pairs = 0
        self.key = ""
        self.pending_key: str | None = None
        self.value_key: str | None = None
        self.value = ""
        self.value_streams = False


class CallExtractor:
    """Content, reasoning and tool calls from the text after reasoning, for the tool parser.

    ``properties_of(name)`` gives a tool's parameter properties (``None`` when the request has no schema:
    every value is then a string); ``allowed(name)`` says whether a call may be returned. With
    ``emit_calls`` false (``tool_choice="none"``) calls are parsed and consumed but not returned. With
    ``reasoning_markup`` false (no reasoning parser configured) think tags are plain content. With
    ``blank_content`` false, content that is only whitespace is never returned (vLLM does so for
    ``tool_choice="required"`` or a named function when no call was made).
    """

    def __init__(
        self,
        properties_of: Callable[[str], Mapping[str, Any] | None],
        allowed: Callable[[str], bool],
        emit_calls: bool = True,
        reasoning_markup: bool = True,
        blank_content: bool = True,
    ) -> None:
        self._properties_of = properties_of
        self._allowed = allowed
        self._emit_calls = emit_calls
        self._reasoning_markup = reasoning_markup
        self._blank_content = blank_content
        self._content_started = False  # some non-whitespace content was emitted
        self._state = CONTENT
        self._call: _Call | None = None
        self._content = _WhitespaceHold()
        self._reasoning = _WhitespaceHold()
        self.calls_made = 0  # calls with a valid name, returned or not

    @property
    def calls_returned(self) -> int:
        """Calls the caller gets. Content is trimmed only when there are some: under ``tool_choice="none"``
        the text around consumed markup is kept as it came (vLLM does the same)."""
        return self.calls_made if self._emit_calls else 0

    def feed(self, pieces: Iterable[Piece]) -> Update:
        out = Update()
        for piece in pieces:
            if isinstance(piece, Tag):
                if piece not in DROPPED:
                    self._tag(piece, out)
            else:
                self._text(piece, out)
        return out

    def finish(self) -> Update:
        out = Update()
        if self._state == VALUE:
            self._close_value(out)
        if self._state == NAME:
            self._name_done(out)
        if self._state in (NAME, ARGS, KEY, VALUE):
            self._close_call(out)
        self._reasoning.take()
        held = self._content.take()
        if not self.calls_returned and (self._blank_content or self._content_started):
            out.content += held
        return out

    # -- text and tags, by state ---------------------------------------------------------------------------

    def _text(self, text: str, out: Update) -> None:
        state, call = self._state, self._call
        if state == CONTENT:
            body = self._content.push(text)
            self._content_started |= bool(body)
            out.content += body
        elif state == REASONING:
            out.reasoning += self._reasoning.push(text)
        elif state == NAME:
            call.name += text
        elif state == KEY:
            call.key += text
        elif state == VALUE:
            call.value += text
            if call.value_streams:
                self._emit_args(call, json.dumps(text, ensure_ascii=False)[1:-1], out)
        # ARGS: junk between argument tags is ignored

    def _tag(self, tag: str, out: Update) -> None:
        state, call = self._state, self._call
        if state == CONTENT:
            if tag == CALL_START:
                self._open_call()
            elif tag in (THINK_START, THINK_END) and self._reasoning_markup:
                if tag == THINK_START:  # a stray </think> is swallowed
                    self._state = REASONING
            else:
                self._text(tag, out)
        elif state == REASONING:
            if tag in (THINK_END, CALL_START):
                self._reasoning.take()
                self._state = CONTENT
                if tag == CALL_START:
                    self._open_call()
            elif tag != THINK_START:
                self._text(tag, out)
        elif state == VALUE:
            if tag in (VALUE_END, KEY_START, CALL_END):
                self._close_value(out)
                self._state = ARGS
                self._tag(tag, out)
            else:  # other tags inside a value are part of it
                self._text(tag, out)
        elif tag == CALL_START:
            if state == NAME:  # a stray opener: the call starts again
                call.name = ""
            else:
                self._close_call(out)
                self._open_call()
        elif tag == CALL_END:
            if state == NAME:
                self._name_done(out)
            self._close_call(out)
        elif tag == KEY_START:
            if state == NAME:
                self._name_done(out)
            call.key, call.pending_key = "", None
            self._state = KEY
        elif tag == VALUE_START:
            if state == NAME:
                self._name_done(out)
            key = call.key.strip() if state == KEY else call.pending_key if state == ARGS else None
            self._open_value(key, out)
        elif tag == KEY_END and state == KEY:
            call.pending_key = call.key.strip()
            self._state = ARGS
        # anything else inside a call is junk

    # -- calls ----------------------------------------------------------------------------------------------

    def _open_call(self) -> None:
        self._call = _Call()
        self._state = NAME

    def _name_done(self, out: Update) -> None:
        call = self._call
        call.name = call.name.strip()
        if call.name and self._allowed(call.name):
            call.index = self.calls_made
            self.calls_made += 1
            call.properties = self._properties_of(call.name)
            if self._emit_calls:
                out.add_call(call.index, call.name, "")
        self._state = ARGS

    def _emit_args(self, call: _Call, text: str, out: Update) -> None:
        if call.index >= 0 and self._emit_calls:
            out.add_call(call.index, None, text)

    def _open_value(self, key: str | None, out: Update) -> None:
        call = self._call
        self._state = VALUE
        call.value = ""
        call.value_key = key or None
        call.value_streams = False
        if call.value_key is None or call.index < 0:
            return
        schema = call.properties.get(call.value_key) if call.properties else None
        call.value_streams = is_string_only(schema)
        opener = ("{" if call.pairs == 0 else ", ") + json.dumps(call.value_key, ensure_ascii=False) + ": "
        self._emit_args(call, opener + ('"' if call.value_streams else ""), out)
        call.pairs += 1

    def _close_value(self, out: Update) -> None:
        call = self._call
        if call.value_key is not None and call.index >= 0:
            if call.value_streams:
                self._emit_args(call, '"', out)
            else:
                schema = call.properties.get(call.value_key) if call.properties else None
                self._emit_args(call, json.dumps(coerce(call.value, schema), ensure_ascii=False), out)
        call.value_key = None
        call.pending_key = None

    def _close_call(self, out: Update) -> None:
        call = self._call
        if call.index >= 0:
            self._emit_args(call, "}" if call.pairs else "{}", out)
        self._call = None
        self._state = CONTENT
