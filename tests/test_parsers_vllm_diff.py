"""The plugin's GLM parsers against vLLM 0.32's own, on the same inputs.

vLLM's classes for ``glm47`` and ``glm45`` are imported by the module paths vLLM's lazy parser tables give for
those names (the registry itself now holds the plugin's). Every input runs one-shot and streamed (chunks of
1, 3 and 7 characters, token by token) through both, and the results must be equal, except for the cases
listed in ``DIFFERENCES``, each under one of the deliberate improvements in ``IMPROVEMENTS``. For those the
test asserts that the two really differ (so the list stays true and short); what the plugin returns there is
asserted by the case's own test in ``test_parsers.py`` / ``test_parsers_upstream.py``.
"""

import pytest

import test_parsers as own
import test_parsers_upstream as upstream
from parser_harness import (
    MODES,
    name_groups,
    pipeline,
    request,
    run,
    run_reasoning_parser,
    run_tool_parser,
    vllm_classes,
)
from vllm_glm53.parsers.reasoning import Glm47ReasoningParser

IMPROVEMENTS = {
    "text_after_calls": "text after or between tool calls stays in content one-shot (vLLM drops it; SGLang keeps it)",
    "stream_equals_oneshot": "streamed content is the one-shot content: whitespace right before a call is not "
    "streamed (vLLM streams 'Pre \\n' where its one-shot says 'Pre')",
    "malformed_markup": "missing or stray closers, junk between tags and a stray <tool_call> inside a call are "
    "recovered (vLLM 0.32 loses the arguments or the whole call)",
    "truncated_value": "a call cut off inside a value keeps the value so far, one-shot and streamed alike "
    "(vLLM: '{}' one-shot, unterminated JSON streamed)",
    "tags_in_values": "tags inside an argument value are part of the value (vLLM takes <think>...</think> "
    "there for reasoning)",
    "nested_types": "members of object and array values are typed by the schema's properties/items",
    "turn_tokens": "turn tokens (<|user|>, ...) never reach content, whether or not the tokenizer lists them as "
    "special (vLLM drops only the listed ones; the tiny tokenizer lists none)",
    "none_flush": "under tool_choice='none' the end-of-stream flush emits no tool call (vLLM leaks the open "
    "call, or a nameless piece of it, past its own filter)",
    "thinking_switch": "reasoning_effort='none' / enable_thinking=false keep reasoning extraction on: GLM-5.3 "
    "always thinks (vLLM recognises GLM-5.3 only from a chat-template string, which the native "
    "glm5_next tokenizer does not have, and pours the reasoning into content)",
}

# (driver, case id) -> improvement. Drivers: "served" (composed parser, tools, tool_choice auto),
# "tool" (the tool parser alone, tools, auto), "notools" (composed, request without tools), "none" (composed,
# tools, tool_choice="none"),
# "reasoning" (the reasoning parser alone), "effort_none" (composed, reasoning_effort="none").
DIFFERENCES = {
    **{("effort_none", case): "thinking_switch" for case in own.REASONING_CASES},
    **{(driver, "turn_tokens_dropped"): "turn_tokens" for driver in ("served", "notools", "reasoning")},
    **{
        (driver, case): "text_after_calls"
        for driver in ("served", "tool")
        for case in ("s47_text_around_call", "v4_mixed_content")
    },
    ("served", "parallel_calls_and_text_kept"): "text_after_calls",
    ("served", "think_block_after_call"): "text_after_calls",
    ("notools", "parallel_calls_and_text_kept"): "text_after_calls",
    ("notools", "think_block_after_call"): "text_after_calls",
    **{
        (driver, case): "stream_equals_oneshot"
        for driver in ("served", "tool")
        for case in ("v4_content_before", "v4_thinking_tags")
    },
    ("notools", "unknown_tool_dropped"): "stream_equals_oneshot",
    **{
        ("served", case): "malformed_markup"
        for case in (
            "junk_between_tags_ignored",
            "key_or_value_alone_dropped",
            "missing_arg_key_close",
            "missing_arg_value_close",
            "missing_close_before_next_call",
            "stray_opener_recovered",
            "v4_malformed_key",
        )
    },
    ("tool", "v4_malformed_key"): "malformed_markup",
    ("served", "s47_incomplete_at_end"): "truncated_value",
    ("tool", "s47_incomplete_at_end"): "truncated_value",
    ("served", "unclosed_value_at_end_kept"): "truncated_value",
    ("served", "tags_inside_value_are_text"): "tags_in_values",
    ("notools", "tags_inside_value_are_text"): "tags_in_values",
    ("none", "tags_inside_value_are_text"): "tags_in_values",
    ("served", "typed_arguments"): "nested_types",
    ("notools", "missing_close_at_end"): "none_flush",
    ("notools", "truncated_opener_vanishes"): "none_flush",
}


def inputs():
    """(driver, case id, output, request factory)."""
    auto = lambda tools: lambda: request(tools, tool_choice="auto")  # noqa: E731
    for case_id, spec in upstream.CASES.items():
        yield "tool", case_id, spec["output"], auto(upstream.TOOLS)
        yield "served", case_id, "</think>" + spec["output"], auto(upstream.TOOLS)
    for case_id, (output, _) in {**own.REASONING_CASES, **own.TOOL_CASES}.items():
        yield "served", case_id, output, auto(own.TOOLS)
        yield "notools", case_id, output, lambda: request(None)
    for case_id, (output, _) in own.TOOL_CASES.items():
        yield "none", case_id, output, lambda: request(own.TOOLS, tool_choice="none")
    for case_id, (output, _) in own.REASONING_CASES.items():
        yield "reasoning", case_id, output, None
        yield "effort_none", case_id, output, lambda: request(own.TOOLS, reasoning_effort="none")


INPUTS = {(driver, case_id): (output, factory) for driver, case_id, output, factory in inputs()}


def results(tok, name, side, driver, output, factory):
    if driver == "reasoning":
        cls = Glm47ReasoningParser if side == "ours" else vllm_classes(name)[1]
        return [run_reasoning_parser(cls, tok, output, mode) for mode in MODES]
    if driver == "tool":
        cls = pipeline(tok, name).tool_parser_cls if side == "ours" else vllm_classes(name)[0]
        return [run_tool_parser(cls, tok, output, factory(), mode) for mode in MODES]
    cls = pipeline(tok, name, side)
    return [run(cls, tok, output, factory(), mode) for mode in MODES]


def comparable(result):
    return (result.reasoning, result.content, result.calls, getattr(result, "errors", []))


@pytest.mark.parametrize("name", name_groups())
@pytest.mark.parametrize("key", list(INPUTS), ids=["-".join(k) for k in INPUTS])
def test_same_as_vllm_except_listed_improvements(tok, name, key):
    output, factory = INPUTS[key]
    ours = [comparable(r) for r in results(tok, name, "ours", key[0], output, factory)]
    theirs = [comparable(r) for r in results(tok, name, "vllm", key[0], output, factory)]
    if key in DIFFERENCES:
        assert DIFFERENCES[key] in IMPROVEMENTS
        assert ours != theirs, f"{key} no longer differs from vLLM: drop it from DIFFERENCES"
    else:
        assert ours == theirs, dict(zip(MODES, zip(ours, theirs)))


def test_differences_list_is_short_and_named():
    assert set(DIFFERENCES.values()) <= set(IMPROVEMENTS)
    assert set(DIFFERENCES) <= set(INPUTS)
