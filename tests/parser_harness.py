"""Drives GLM tool/reasoning parsers the way vLLM's chat serving does, for the parser tests.

A *pipeline* is a composed per-request parser class: ours (what ``ParserManager`` returns for a name once the
plugin registered it) or vLLM 0.32's own GLM parsers, imported by the module paths vLLM's lazy tables give for
that name (not through the registry, where the plugin replaced them). ``run`` feeds one model output through a
pipeline in one of these ways and returns what a client would assemble:

- ``"oneshot"``: the non-streaming ``parse``;
- ``"chars1"``, ``"chars3"``, ``"chars7"``: streaming ``parse_delta`` in chunks of 1, 3 and 7 characters, no
  token ids (how a text-only caller streams);
- ``"tokens"``: streaming one token at a time with its id, text from an incremental detokenizer (how vLLM
  streams a generation).

The vLLM imports are hard on purpose: a path that moves must fail these tests, not skip them.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.abstract_parser import DelegatingParser
from vllm.parser.parser_manager import ParserManager
from vllm.reasoning import _REASONING_PARSERS_TO_REGISTER
from vllm.tool_parsers import _TOOL_PARSERS_TO_REGISTER

MODES = ("oneshot", "chars1", "chars3", "chars7", "tokens")
STREAM_MODES = MODES[1:]
NAMES = ("glm47", "glm45")


def function(name, properties=None, parameters=None):
    if parameters is None:
        parameters = {"type": "object", "properties": properties or {}}
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": parameters}}


def request(tools=None, **kwargs):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, **kwargs)


@dataclass
class Result:
    reasoning: str | None = None
    content: str | None = None
    calls: list = field(default_factory=list)  # [(name, arguments JSON text)]


def call(name, **arguments):
    return (name, json.dumps(arguments, ensure_ascii=False))


def vllm_classes(name):
    """vLLM 0.32's own (tool parser, reasoning parser) classes for ``name``, by module path."""
    name = name.split("=")[0]
    tool_module, tool_cls = _TOOL_PARSERS_TO_REGISTER[name]
    reasoning_module, reasoning_cls = _REASONING_PARSERS_TO_REGISTER[name]
    tool = getattr(importlib.import_module(f"vllm.tool_parsers.{tool_module}"), tool_cls)
    reasoning = getattr(importlib.import_module(f"vllm.reasoning.{reasoning_module}"), reasoning_cls)
    return tool, reasoning


def name_groups():
    """``NAMES`` grouped by the parser classes they select, ours and vLLM's: names in one group run the very
    same code, so a test runs once per group (ids like ``glm47=glm45``) and still covers every name."""
    import vllm_glm53
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    vllm_glm53.register()
    groups = {}
    for name in NAMES:
        key = (ToolParserManager.get_tool_parser(name), ReasoningParserManager.get_reasoning_parser(name))
        groups.setdefault(key + vllm_classes(name), []).append(name)
    return ["=".join(names) for names in groups.values()]


def pipeline(tok, name="glm47", side="ours", tool=True, reasoning=True):
    """The composed parser class vLLM's serving layer would build for ``--tool-call-parser name
    --reasoning-parser name`` (``side="ours"``: with the plugin; ``"vllm"``: vLLM's own GLM parsers).
    ``name`` may be a ``name_groups`` entry."""
    name = name.split("=")[0]
    if side == "ours":
        return ParserManager.get_parser(
            tool_parser_name=name if tool else None,
            reasoning_parser_name=name if reasoning else None,
            enable_auto_tools=True,
            tokenizer=tok,
        )
    tool_cls, reasoning_cls = vllm_classes(name)
    return type(
        "VllmGlmParser",
        (DelegatingParser,),
        {"tool_parser_cls": tool_cls if tool else None, "reasoning_parser_cls": reasoning_cls if reasoning else None},
    )


def prepared(cls, tok, req):
    """A per-request parser, built and prepared as vLLM's chat serving does."""
    chat_kwargs = req.build_chat_params(None, "auto").chat_template_kwargs
    parser = cls(tok, req.tools, chat_template_kwargs=chat_kwargs)
    parser.adjust_request(req)
    assert req.skip_special_tokens is False  # the tags are special tokens: they must reach the parser
    return parser


def chunks(tok, output, mode):
    """``output`` as streamed ``(delta_text, delta_token_ids)`` pieces; ``mode`` may also be a list of text
    chunks (an upstream test's own chunking)."""
    if not isinstance(mode, str):
        assert "".join(mode) == output
        return [(text, []) for text in mode]
    if mode.startswith("chars"):
        size = int(mode[5:])
        return [(output[i : i + size], []) for i in range(0, len(output), size)]
    assert mode == "tokens", mode
    stream = DecodeStream(skip_special_tokens=False)
    return [(stream.step(tok._tokenizer, t) or "", [t]) for t in tok.encode(output, add_special_tokens=False)]


def run(cls, tok, output, req, mode, parts=None):
    """Parse ``output`` (or explicit ``parts``) with a fresh parser of class ``cls``. Streaming modes also
    return each call's argument pieces (``Result.pieces``) and the breaches of the tool-call delta protocol
    (``Result.errors``: a call's first delta carries its index, id, type and name; later ones none of those)."""
    parser = prepared(cls, tok, req)
    if mode == "oneshot":
        reasoning, content, calls = parser.parse(output, req, enable_auto_tools=True)
        return Result(reasoning, content, [(c.name, c.arguments) for c in calls or []])
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    parts = parts if parts is not None else chunks(tok, output, mode)
    reasoning, content, calls, pieces, errors = "", "", {}, {}, []
    for i, (text, ids) in enumerate(parts):
        delta = parser.parse_delta(text, ids, req, prompt_token_ids=prompt, finished=i == len(parts) - 1)
        if delta is None:
            continue
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # a call's first delta: index, id, type and name
                if not (tc.id and tc.type == "function" and tc.function.name and tc.index == len(calls)):
                    errors.append(f"bad first delta {tc}")
                calls[tc.index] = [tc.function.name, ""]
                pieces[tc.index] = []
            elif tc.id is not None or tc.function.name is not None:
                errors.append(f"bad later delta {tc}")
            if tc.function.arguments:
                calls[tc.index][1] += tc.function.arguments
                pieces[tc.index].append(tc.function.arguments)
    result = Result(reasoning or None, content or None, [tuple(c) for c in calls.values()])
    result.pieces, result.errors = pieces, errors
    return result


def run_tool_parser(cls, tok, output, req, mode):
    """The tool parser alone, as vLLM's own tool-parser tests drive it: ``extract_tool_calls`` one-shot, or
    ``extract_tool_calls_streaming`` per chunk then ``finish_streaming``. Returns (content, calls, errors)."""
    parser = cls(tok, req.tools)
    if mode == "oneshot":
        info = parser.extract_tool_calls(output, req)
        return Result(None, info.content, [(c.function.name, c.function.arguments) for c in info.tool_calls])
    content, calls, errors, previous = "", {}, [], ""
    for part in chunks(tok, output, mode) + [None]:
        if part is None:
            delta = parser.finish_streaming()
        else:
            text, ids = part
            delta = parser.extract_tool_calls_streaming(previous, previous + text, text, [], [], ids, req)
            previous += text
        if delta is None:
            continue
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                if not (tc.id and tc.function.name and tc.index == len(calls)):
                    errors.append(f"bad first delta {tc}")
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
    result = Result(None, content or None, [tuple(c) for c in calls.values()])
    result.errors = errors
    return result


def run_reasoning_parser(cls, tok, output, mode, chat_template_kwargs=None):
    """The reasoning parser alone over the whole output, as vLLM's reasoning-parser tests drive it."""
    parser = cls(tok, chat_template_kwargs=chat_template_kwargs or {})
    if mode == "oneshot":
        reasoning, content = parser.extract_reasoning(output, request())
        return Result(reasoning, content)
    reasoning, content, previous, ids = "", "", "", []
    for text, delta_ids in chunks(tok, output, mode):
        delta = parser.extract_reasoning_streaming(previous, previous + text, text, ids, ids + delta_ids, delta_ids)
        previous, ids = previous + text, ids + delta_ids
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    delta = parser.finish_streaming()
    if delta is not None:
        reasoning += delta.reasoning or ""
        content += delta.content or ""
    return Result(reasoning or None, content or None)


def streamed_as_oneshot(result, mode):
    """``result`` with its content as the one-shot path reports it. One-shot content is ``strip()``-ed when
    calls were returned; a stream cannot know a call will follow text, so it keeps that text's leading
    whitespace (``"\n\nLet me check"``)."""
    if mode == "oneshot" or not result.calls or result.content is None:
        return Result(result.reasoning, result.content, result.calls)
    return Result(result.reasoning, result.content.strip() or None, result.calls)


def agree(cls, tok, output, req_factory, expected, modes=MODES):
    """``output`` parses to ``expected`` one-shot and, up to ``streamed_as_oneshot``, in every streaming
    mode, with no breach of the delta protocol. ``req_factory()`` makes a fresh request per run."""
    for mode in modes:
        got = run(cls, tok, output, req_factory(), mode)
        assert not getattr(got, "errors", None), (mode, got.errors)
        assert streamed_as_oneshot(got, mode) == expected, mode
