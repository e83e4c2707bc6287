"""The ``glm47``/``glm45`` tool and reasoning parsers, driven the way vLLM's serving layer drives them.

Each output is parsed by the parser vLLM composes (``ParserManager.get_parser``), with real
``ChatCompletionRequest`` objects: non-streaming through ``parse``, streaming through ``parse_delta`` in chunks
of 1, 3 and 7 characters without token ids and one token at a time with ids and an incremental detokenizer
(``parser_harness``). Expected values are the documented behaviour (chat-and-parsers notes, §3); every path
must agree (streamed content keeps the leading whitespace non-streaming strips when calls were made). The
cases ported from vLLM's and SGLang's own GLM parser tests are in ``test_parsers_upstream.py``, the comparison
with vLLM 0.32's parsers in ``test_parsers_vllm_diff.py``.
"""

import json

import pytest

from parser_harness import (
    MODES,
    STREAM_MODES,
    ChatCompletionRequest,
    ParserManager,
    Result,
    call,
    chunks,
    function,
    name_groups,
    pipeline,
    run,
    run_reasoning_parser,
    run_tool_parser,
    streamed_as_oneshot,
)
from parser_harness import agree as agree_modes
from parser_harness import request as make_request
from vllm_glm53.parsers.reasoning import Glm47ReasoningParser
from vllm_glm53.parsers.tool import Glm47ToolParser

TOOLS = [
    function("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}}),
    function(
        "book",
        {
            "seats": {"type": "integer"},
            "note": {"type": "string"},
            "flexible": {"type": "boolean"},
            "price": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "prefs": {"type": "object", "properties": {"meal": {"type": "string"}, "count": {"type": "integer"}}},
            "when": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "level": {"type": ["boolean", "integer", "string"]},
        },
    ),
    function("list_tools"),
]


@pytest.fixture(scope="module", params=name_groups())
def name(request):
    """Both parser names (one class for ``glm47`` and ``glm45``: one group)."""
    return request.param


def request(tools=TOOLS, **kwargs):
    return make_request(tools, **kwargs)


def parse(tok, output, req, name="glm47", **kwargs):
    return run(pipeline(tok, name, **kwargs), tok, output, req, "oneshot")


def stream(tok, output, req, mode="tokens", parts=None, name="glm47", **kwargs):
    """Stream ``output`` (or explicit ``parts``: (text, ids) chunks); returns the result and each call's
    argument pieces, after checking the tool-call delta protocol."""
    got = run(pipeline(tok, name, **kwargs), tok, output, req, mode, parts)
    assert not got.errors, got.errors
    return got, got.pieces


def agree(tok, output, req, expected, name="glm47", **kwargs):
    """One-shot gives ``expected``; streaming in chunks of 1, 3 and 7 characters and token by token gives
    the same (content modulo the leading whitespace only one-shot strips when calls were made)."""
    agree_modes(pipeline(tok, name, **kwargs), tok, output, lambda: req, expected)


REASONING_CASES = {
    "reasoning_then_answer": ("I should greet.</think>Hello!", Result("I should greet.", "Hello!")),
    "leading_think_ignored": ("<think>plan</think>\n\nAnswer", Result("plan", "\n\nAnswer")),
    "reasoning_rstripped_content_not": ("plan \n</think> x ", Result("plan", " x ")),
    "truncated_thinking_is_all_reasoning": ("still thinking \n", Result("still thinking")),
    "empty_reasoning_is_none": ("</think>Answer", Result(None, "Answer")),
    "think_reentry": ("r</think>x<think>y</think>z", Result("ry", "xz")),
    "stray_end_swallowed": ("r</think>a</think>b", Result("r", "ab")),
    "turn_tokens_dropped": ("r</think>Answer<|user|>", Result("r", "Answer")),
    "unicode": ("思考</think>答案 é", Result("思考", "答案 é")),
}


@pytest.mark.parametrize("case", list(REASONING_CASES))
def test_reasoning(tok, name, case):
    output, expected = REASONING_CASES[case]
    agree(tok, output, request(tool_choice="auto"), expected, name=name)


W = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>{}</arg_value></tool_call>"
BOOK = (
    "<tool_call>book<arg_key>seats</arg_key><arg_value>3</arg_value><arg_key>note</arg_key><arg_value>aisle please"
    "</arg_value><arg_key>flexible</arg_key><arg_value>True</arg_value><arg_key>price</arg_key><arg_value>12.50"
    '</arg_value><arg_key>tags</arg_key><arg_value>["a", "b"]</arg_value><arg_key>prefs</arg_key><arg_value>'
    '{"meal": "veg", "count": "2"}</arg_value><arg_key>when</arg_key><arg_value>null</arg_value><arg_key>extra'
    "</arg_key><arg_value>5</arg_value><arg_key>level</arg_key><arg_value>1</arg_value></tool_call>"
)
TOOL_CASES = {
    "call_ends_reasoning": (
        "need weather" + W.format("Paris"),
        Result("need weather", None, [call("get_weather", city="Paris")]),
    ),
    "typed_arguments": (
        "r</think>" + BOOK,
        Result(
            "r",
            None,
            [
                call(
                    "book",
                    seats=3,
                    note="aisle please",
                    flexible=True,
                    price=12.5,
                    tags=["a", "b"],
                    prefs={"meal": "veg", "count": 2},
                    when=None,
                    extra="5",
                    level=1,
                )
            ],
        ),
    ),  # fmt: skip
    "strings_stay_strings_values_unstripped": (
        "r</think><tool_call>get_weather<arg_key> city </arg_key><arg_value>\n 12345\n</arg_value>"
        "<arg_key>days</arg_key><arg_value> 7 </arg_value><arg_key>units</arg_key><arg_value>c</arg_value></tool_call>",
        Result("r", None, [call("get_weather", city="\n 12345\n", days=7, units="c")]),
    ),
    "unparsable_values_stay_strings": (
        "r</think><tool_call>book<arg_key>seats</arg_key><arg_value>three</arg_value><arg_key>tags</arg_key>"
        "<arg_value>[broken</arg_value><arg_key>prefs</arg_key><arg_value>{not json</arg_value><arg_key>when"
        "</arg_key><arg_value>3.0</arg_value></tool_call>",
        Result("r", None, [call("book", seats="three", tags="[broken", prefs="{not json", when=3.0)]),
    ),
    "parallel_calls_and_text_kept": (
        "r</think>Checking both.\n" + W.format("Paris") + "\n" + W.format("Rome") + " Done.",
        Result("r", "Checking both.\n\n Done.", [call("get_weather", city="Paris"), call("get_weather", city="Rome")]),
    ),
    "zero_argument_call": ("r</think><tool_call>list_tools</tool_call>", Result("r", None, [call("list_tools")])),
    "whitespace_only_content_dropped": (
        "r</think>\n\n" + W.format("Oslo") + "\n",
        Result("r", None, [call("get_weather", city="Oslo")]),
    ),
    "unicode_arguments": ("r</think>" + W.format("東京"), Result("r", None, [call("get_weather", city="東京")])),
    "unknown_tool_dropped": (
        "r</think>Hi <tool_call>nope<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        Result("r", "Hi "),
    ),
    "missing_close_at_end": (
        "r</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>",
        Result("r", None, [call("get_weather", city="Paris")]),
    ),
    "unclosed_value_at_end_kept": (
        "r</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",
        Result("r", None, [call("get_weather", city="Par")]),
    ),
    "truncated_opener_vanishes": ("r</think>Let me see.<tool_call>get_wea", Result("r", "Let me see.")),
    "missing_close_before_next_call": (
        "r</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>" + W.format("Rome"),
        Result("r", None, [call("get_weather", city="Paris"), call("get_weather", city="Rome")]),
    ),
    "stray_opener_recovered": (
        "r</think><tool_call>get_weather<tool_call>" + W.format("Paris")[11:],
        Result("r", None, [call("get_weather", city="Paris")]),
    ),
    "junk_between_tags_ignored": (
        "r</think><tool_call> get_weather \n<arg_key>city</arg_key>junk<arg_value>Paris</arg_value>"
        " more</arg_key></tool_call>",
        Result("r", None, [call("get_weather", city="Paris")]),
    ),
    "missing_arg_key_close": (
        "r</think><tool_call>get_weather<arg_key>city<arg_value>Paris</arg_value></tool_call>",
        Result("r", None, [call("get_weather", city="Paris")]),
    ),
    "missing_arg_value_close": (
        "r</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
        "<arg_key>days</arg_key><arg_value>2</tool_call>",
        Result("r", None, [call("get_weather", city="Paris", days=2)]),
    ),
    "key_or_value_alone_dropped": (
        "r</think><tool_call>get_weather<arg_key>city</arg_key><arg_key>days</arg_key><arg_value>2</arg_value>"
        "<arg_value>lost</arg_value></tool_call>",
        Result("r", None, [call("get_weather", days=2)]),
    ),
    "call_without_name_dropped": (
        "r</think><tool_call><arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>ok",
        Result("r", "ok"),
    ),
    "tags_inside_value_are_text": (
        "r</think><tool_call>book<arg_key>note</arg_key>"
        "<arg_value>a<think>b</think><tool_call>c</arg_value></tool_call>",
        Result("r", None, [call("book", note="a<think>b</think><tool_call>c")]),
    ),
    "stray_markup_in_content_kept": (
        "r</think>a</tool_call>b</arg_value>c",
        Result("r", "a</tool_call>b</arg_value>c"),
    ),
    "think_block_after_call": (
        "r</think>" + W.format("Paris") + "<think>more</think>Done",
        Result("rmore", "Done", [call("get_weather", city="Paris")]),
    ),
}


@pytest.mark.parametrize("case", list(TOOL_CASES))
def test_tool_calls(tok, name, case):
    output, expected = TOOL_CASES[case]
    agree(tok, output, request(tool_choice="auto"), expected, name=name)


def test_duplicate_key_keeps_both_last_wins_on_load(tok):
    output = (
        "r</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>A</arg_value>"
        "<arg_key>city</arg_key><arg_value>B</arg_value></tool_call>"
    )
    expected = Result("r", None, [("get_weather", '{"city": "A", "city": "B"}')])
    agree(tok, output, request(tool_choice="auto"), expected)
    assert json.loads(expected.calls[0][1]) == {"city": "B"}


def test_tool_choice_none_consumes_markup(tok):
    output = "r</think>A " + W.format("Paris") + " B"
    agree(tok, output, request(tool_choice="none"), Result("r", "A  B"))
    # A call left open at the end is closed by the final flush: it must not slip out either.
    agree(tok, "r</think>A" + W.format("Paris")[:-12], request(tool_choice="none"), Result("r", "A"))
    # No call is returned, so the text around the markup is not trimmed (as vLLM does).
    agree(tok, "r</think>Wait. " + W.format("Paris") + "\n", request(tool_choice="none"), Result("r", "Wait. \n"))


def test_request_without_tools_defaults_to_none(tok):
    # vLLM's serving layer discards the calls of a tool-less request (its tool_choice defaults to "none")
    # and keeps the content the tool parser returns: the markup is consumed, the text kept.
    output = "r</think>Sure." + W.format("Paris")
    agree(tok, output, request(tools=None), Result("r", "Sure."))
    # A call still open at the end of such a stream must not slip out in the final flush either (vLLM's
    # own parser leaks a nameless '"}' delta there).
    agree(tok, "r</think>Sure." + W.format("Paris")[:-12], request(tools=None), Result("r", "Sure."))


GLM45_LAYOUT = (
    "<tool_call>get_weather\n    <arg_key>city</arg_key>\n    <arg_value>Beijing</arg_value>\n"
    "    <arg_key>days</arg_key>\n    <arg_value>3</arg_value>\n    </tool_call>"
)


@pytest.mark.parametrize(
    "output, expected",
    [
        (GLM45_LAYOUT, Result(None, None, [call("get_weather", city="Beijing", days="3")])),
        (
            "Let me check." + GLM45_LAYOUT,
            Result(None, "Let me check.", [call("get_weather", city="Beijing", days="3")]),
        ),
        (
            GLM45_LAYOUT + "\n" + GLM45_LAYOUT.replace("Beijing", "Paris"),
            Result(
                None, None, [call("get_weather", city="Beijing", days="3"), call("get_weather", city="Paris", days="3")]
            ),
        ),
        ("<tool_call>get_current_time\n</tool_call>", Result(None, None, [call("get_current_time")])),
        # Cut off by max_tokens: the call is closed with what was generated (vLLM 0.32 does the same for a
        # closed value; its parser drops an unclosed one, ours keeps it).
        (
            GLM45_LAYOUT.split("\n    </tool_call>")[0],
            Result(None, None, [call("get_weather", city="Beijing", days="3")]),
        ),
        (GLM45_LAYOUT.split("jing")[0], Result(None, None, [call("get_weather", city="Bei")])),
    ],
    ids=["glm45_layout", "text_before", "two_calls", "no_arguments_newline", "cut_after_value", "cut_in_value"],
)
def test_tool_parser_alone_returns_calls_of_a_request_without_tools(tok, output, expected):
    # The tool parser alone, as vLLM's own tests and direct users drive it: a request without tools (so its
    # tool_choice is the default "none") still gets its calls, every value a string, any name accepted.
    for mode in ("oneshot", *STREAM_MODES):
        got = run_tool_parser(Glm47ToolParser, tok, output, request(tools=None), mode)
        assert not getattr(got, "errors", None), (mode, got.errors)
        assert streamed_as_oneshot(got, mode) == expected, mode


@pytest.mark.parametrize(
    "output, expected",
    [
        ("r</think>x<think>y</think>z", Result("ry", "xz")),
        ("r</think>a</think>b", Result("r", "ab")),
        ("<think>r \n</think>a<think>b\n", Result("rb", "a")),
        ("r</think>" + W.format("P") + "<think>m</think>D", Result("rm", W.format("P") + "D")),
        (
            "r<tool_call>f<arg_value><think>x</think></arg_value></tool_call>",
            Result("r", "<tool_call>f<arg_value><think>x</think></arg_value></tool_call>"),
        ),
    ],
    ids=["reopened", "second_close", "reopened_until_the_end", "after_a_call", "tags_inside_a_call"],
)
def test_reasoning_parser_alone_streams_as_it_parses(tok, output, expected):
    # A reopened <think> is reasoning again and a second </think> is dropped, streamed as in one shot (a
    # caller that streams the whole output through the reasoning parser gets the one-shot result); tool
    # calls pass through verbatim for the tool parser.
    for mode in MODES:
        assert run_reasoning_parser(Glm47ReasoningParser, tok, output, mode) == expected, mode


def test_named_tool_choice_keeps_only_that_function(tok):
    output = (
        "r</think>" + W.format("Paris") + "<tool_call>book<arg_key>seats</arg_key><arg_value>2</arg_value></tool_call>"
    )
    named = request(tool_choice={"type": "function", "function": {"name": "book"}})
    agree(tok, output, named, Result("r", None, [call("book", seats=2)]))


def test_required_parses_like_auto(tok):
    output = "r</think>" + W.format("Paris")
    agree(tok, output, request(tool_choice="required"), Result("r", None, [call("get_weather", city="Paris")]))
    # Without a call, whitespace-only content is no content (vLLM's rule for required and named choices).
    agree(tok, "r</think>\n", request(tool_choice="required"), Result("r"))
    agree(tok, "r</think>\n", request(tool_choice="auto"), Result("r", "\n"))


def test_no_schema_means_string_values(tok):
    # The tool parser alone (no schema at all): every value is the raw text, any name is accepted.
    parser = Glm47ToolParser(tok)
    req = ChatCompletionRequest.model_construct(messages=[], model="m", tools=None, tool_choice="auto")
    info = parser.extract_tool_calls("<tool_call>anything<arg_key>n</arg_key><arg_value>5</arg_value></tool_call>", req)
    assert info.tools_called and [(c.function.name, c.function.arguments) for c in info.tool_calls] == [
        call("anything", n="5")
    ]


@pytest.mark.parametrize(
    "req",
    [
        request(chat_template_kwargs={"enable_thinking": False}),
        request(reasoning_effort="none"),  # vLLM derives enable_thinking=False from it
        request(chat_template_kwargs={"thinking": False}),
    ],
    ids=["enable_thinking_false", "effort_none", "thinking_false"],
)
def test_thinking_switches_do_not_leak_reasoning(tok, req):
    agree(tok, "plan</think>Answer", req, Result("plan", "Answer"))


def test_thinking_switch_honoured_for_templates_that_have_one(tok):
    import copy

    glm47_style = copy.copy(tok)
    glm47_style.chat_template = "{% if enable_thinking is defined and not enable_thinking %}</think>{% endif %}"
    output = "plain answer"
    off = request(chat_template_kwargs={"enable_thinking": False})
    assert parse(glm47_style, output, off) == Result(None, "plain answer")
    assert parse(glm47_style, output, request()) == Result("plain answer")
    parser = Glm47ReasoningParser(glm47_style, chat_template_kwargs={"enable_thinking": False})
    assert parser.is_reasoning_end([]) and parser.extract_content_ids([1, 2]) == [1, 2]


def test_tool_parser_without_reasoning_parser_keeps_think_tags_as_content(tok):
    output = "<think>plan</think>Hi" + W.format("Paris")
    expected = Result(None, "<think>plan</think>Hi", [call("get_weather", city="Paris")])
    agree(tok, output, request(tool_choice="auto"), expected, reasoning=False)


def test_reasoning_parser_alone(tok):
    agree(tok, "plan</think>Answer", request(tool_choice="auto"), Result("plan", "Answer"), tool=False)


def test_tags_spelled_by_ordinary_tokens_are_text(tok):
    # With token ids, a tag counts only as its special token: the same characters from ordinary tokens
    # (a model writing about the format) are content.
    req = request(tool_choice="auto")
    spelled = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    end = tok.convert_tokens_to_ids("</think>")
    parts = [("r", tok.encode_plain("r")), ("</think>", [end])] + [(spelled, tok.encode_plain(spelled))]
    got, _ = stream(tok, "", req, parts=parts)
    assert got == Result("r", spelled)
    real, _ = stream(tok, "r</think>" + spelled, req, "tokens")
    assert real == Result("r", None, [call("get_weather", city="Paris")])


def test_tag_spelled_before_a_real_tag_in_one_delta(tok):
    # vLLM may deliver several tokens in one delta; the spelled tag is text, the special token is the tag.
    req = request(tool_choice="auto")
    end, start = tok.convert_tokens_to_ids("</think>"), tok.convert_tokens_to_ids("<tool_call>")
    spelled = "write <tool_call> then "
    rest = "list_tools</tool_call>"
    parts = [
        ("r</think>", tok.encode_plain("r") + [end]),
        (spelled + "<tool_call>", tok.encode_plain(spelled) + [start]),
    ]
    parts.append((rest, tok.encode(rest, add_special_tokens=False)))
    got, _ = stream(tok, "", req, parts=parts)
    assert got == Result("r", spelled.rstrip(), [call("list_tools")])


@pytest.mark.parametrize(
    "text, schema, value",
    [
        ("5", {"type": ["string", "integer"]}, 5),  # integer is tried before string
        ("1", {"type": ["boolean", "integer"]}, 1),  # ... and before boolean
        ("0", {"type": "boolean"}, False),
        ("null", {"type": ["null", "string"]}, None),
        ("NULL", {"anyOf": [{"type": "null"}, {"type": "integer"}]}, None),
        ("3", {"type": "float"}, 3),  # aliases; integral numbers become integers
        ("2.5", {"type": "double"}, 2.5),
        ("inf", {"type": "number"}, "inf"),  # only finite numbers
        ("7", {"enum": [1, 7]}, 7),
        ("b", {"enum": ["a", "b"]}, "b"),
        ("3.0", {"type": "integer"}, 3.0),  # no listed type reads it: JSON, if it is JSON
        ('[1, "2"]', {"type": "array", "items": {"type": "integer"}}, [1, 2]),
        (
            '{"a": {"b": "4"}}',
            {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}},
            {"a": {"b": 4}},
        ),
        ('{"z": 5}', {"type": "object", "properties": {"z": {"type": "string"}}}, {"z": "5"}),
        ("x", {}, "x"),
        ("5", None, "5"),
    ],
)
def test_schema_coercion(text, schema, value):
    from vllm_glm53.parsers.schema import coerce

    got = coerce(text, schema)
    assert got == value and type(got) is type(value)


def test_lexer_places_tags_whose_text_is_missing_or_shifted(tok):
    from vllm_glm53.parsers.lexer import Tag, TagLexer, tag_ids

    ids_to_tags = tag_ids(tok.get_vocab())
    start = tok.convert_tokens_to_ids("<tool_call>")
    a, b = tok.encode_plain("ab"), tok.encode_plain("cd")
    # skip_special_tokens dropped the tag's text: it is placed after the tokens before it.
    lexer = TagLexer(ids_to_tags, lambda ids: tok.decode(list(ids)))
    assert lexer.feed("abcd", a + [start] + b) == ["ab", Tag("<tool_call>"), "cd"]
    # The detokenizer shifted the text (bytes held back from an earlier delta): the literal is found.
    lexer = TagLexer(ids_to_tags, lambda ids: "")
    assert lexer.feed("xab<tool_call>cd", a + [start] + b) == ["xab", Tag("<tool_call>"), "cd"]


def test_reasoning_parser_with_a_legacy_tool_parser(tok):
    # vLLM drives a non-engine composition differently (accumulated text, transition on token ids).
    req = request(tool_choice="auto")
    cls = ParserManager.get_parser(
        tool_parser_name="hermes", reasoning_parser_name="glm47", enable_auto_tools=True, tokenizer=tok
    )
    for mode in STREAM_MODES:
        parser = cls(tok, req.tools, chat_template_kwargs={})
        reasoning = content = ""
        parts = chunks(tok, "plan</think>Answer", mode)
        for i, (text, token_ids) in enumerate(parts):
            delta = parser.parse_delta(text, token_ids, req, prompt_token_ids=[], finished=i == len(parts) - 1)
            if delta is not None:
                reasoning += delta.reasoning or ""
                content += delta.content or ""
        assert (reasoning, content) == ("plan", "Answer"), mode


def test_argument_deltas_grow_the_final_json(tok):
    output = (
        "r</think><tool_call>book<arg_key>seats</arg_key><arg_value>35</arg_value><arg_key>note</arg_key>"
        "<arg_value>aisle please, near the front</arg_value></tool_call>"
    )
    req = request(tool_choice="auto")
    for mode in STREAM_MODES:
        got, pieces = stream(tok, output, req, mode)
        args = pieces[0]
        assert json.loads("".join(args)) == {"seats": 35, "note": "aisle please, near the front"}
        assert args[0] == '{"seats": ' and args[-2:] == ['"', "}"]
        assert any("35" in piece for piece in args)  # a number arrives whole, once it is complete
        assert len(args) > 5  # the string value streams as it is generated


def test_include_reasoning_false_hides_reasoning(tok):
    req = request(tool_choice="auto", include_reasoning=False)
    for mode in STREAM_MODES:
        got, _ = stream(tok, "secret plan</think>Answer", req, mode)
        assert got == Result(None, "Answer")


def test_streaming_content_keeps_leading_whitespace_before_a_call(tok):
    # The one documented difference: streaming cannot know a call will follow "\n\nText".
    output = "r</think>\n\nText" + W.format("Paris")
    assert parse(tok, output, request(tool_choice="auto")).content == "Text"
    got, _ = stream(tok, output, request(tool_choice="auto"), "tokens")
    assert got.content == "\n\nText"


# -- token-id views ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rp(tok):
    return Glm47ReasoningParser(tok, chat_template_kwargs={})


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_is_reasoning_end_on_prompts(tok, rp):
    history = [
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "content": "b",
            "reasoning_content": "r",
            "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": {}}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "x"},
    ]
    assert not rp.is_reasoning_end(tok.apply_chat_template(history))  # ends <|assistant|><think>
    assert not rp.is_reasoning_end(tok.apply_chat_template(history, add_generation_prompt=False))  # earlier turn
    assert rp.is_reasoning_end(
        tok.apply_chat_template(history[:2], add_generation_prompt=False)[:-1]
    )  # ...</tool_call>
    assert rp.is_reasoning_end(ids(tok, "<|assistant|><think>r</think>partial answer"))
    assert rp.is_reasoning_end(ids(tok, "<|assistant|><think>r<tool_call>f"))
    assert not rp.is_reasoning_end(ids(tok, "<think>r</think>x<think>again"))
    assert not rp.is_reasoning_end([])


def test_reasoning_end_streaming_and_content_ids(tok, rp):
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}])
    out = ids(tok, "plan</think>answer")
    end = out.index(tok.convert_tokens_to_ids("</think>"))
    assert rp.is_reasoning_end_streaming(prompt + out, out[end : end + 1])
    assert not rp.is_reasoning_end_streaming(prompt + out[:end], out[:end])
    # An implicit end at <tool_call> is not reported: vLLM would start the grammar after that token.
    call_ids = ids(tok, "plan<tool_call>f")
    assert not rp.is_reasoning_end_streaming(prompt + call_ids, call_ids)
    assert rp.extract_content_ids(out) == out[end + 1 :]
    assert rp.extract_content_ids(call_ids) == call_ids[call_ids.index(tok.convert_tokens_to_ids("<tool_call>")) :]
    assert rp.extract_content_ids(ids(tok, "still thinking")) == []
    assert rp.count_reasoning_tokens(ids(tok, "<think>")) == 0
    assert rp.count_reasoning_tokens(out) == end
    assert rp.count_reasoning_tokens(ids(tok, "all thinking")) == len(ids(tok, "all thinking"))


def test_registered_over_vllm_names(tok):
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    for name in ("glm45", "glm47"):
        assert ToolParserManager.get_tool_parser(name) is Glm47ToolParser
        assert ReasoningParserManager.get_reasoning_parser(name) is Glm47ReasoningParser


def test_startup_validation_rejects_a_tokenizer_without_glm_tags():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=raw)
    with pytest.raises(TypeError, match="glm47"):
        ParserManager.get_parser(
            tool_parser_name="glm47", reasoning_parser_name="glm47", enable_auto_tools=True, tokenizer=other
        )


def test_random_markup_never_breaks_and_streaming_agrees(tok):
    # Tag soup (unbalanced, nested, truncated, junk between tags): no exception, arguments are JSON, and
    # both streamings give the non-streaming result.
    import random

    rng = random.Random(7)
    words = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>", "get_weather", "book", "nope", "city", "seats", "3", "Paris", " ", "\n", '{"a": 1}',
             "é", "<|user|>", "<", "</"]  # fmt: skip
    for _ in range(120):
        output = "".join(rng.choice(words) for _ in range(rng.randint(0, 20)))
        choice = rng.choice(["auto", "none", "required", {"type": "function", "function": {"name": "book"}}])
        expected = parse(tok, output, request(tool_choice=choice))
        for _, arguments in expected.calls:
            json.loads(arguments)
        agree(tok, output, request(tool_choice=choice), expected)
