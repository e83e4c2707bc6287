"""The behaviours vLLM's and SGLang's own GLM parser tests check, as cases for the plugin's parsers.

Sources (inputs and assertions re-expressed as data, not copied code): vLLM's
``tests/tool_parsers/test_glm47_moe_tool_parser.py`` (``v47_*``) and ``test_glm4_moe_tool_parser.py`` (``v4_*``),
SGLang's ``test/registered/function_call/test_glm47_moe_detector.py`` (``s47_*``) and its GLM-4 detector tests
(``s4_*``). Every case runs for both parser names, one-shot and streamed in chunks of 1, 3 and 7 characters
and token by token (plus the upstream test's own chunking where it has one), through two drivers: the tool
parser alone on the text after reasoning (as those tests drive it), and vLLM's composed parser on a whole
GLM-5.3 turn (``</think>`` first) as serving does.

Where the upstream projects disagree, the expectation is vLLM 0.32's behaviour or a documented improvement
(see ``test_parsers_vllm_diff.py``), said case by case in a comment.
"""

import json
from unittest.mock import Mock

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    FunctionDefinition,
)

from parser_harness import (
    MODES,
    Result,
    call,
    function,
    name_groups,
    pipeline,
    request,
    run,
    run_tool_parser,
    streamed_as_oneshot,
)

S = {"type": "string"}
TOOLS = [
    function("get_weather", {"city": S, "date": S}),
    function("get_current_weather", {"city": S, "state": S, "unit": S}),
    function("get_current_date", parameters={}),
    function("get_current_time"),
    function("get_time"),
    function("send_message", {"recipient": S, "message": S, "priority": S, "greeting": S, "emoji": S}),
    function(
        "calculate",
        {
            "operation": S,
            "a": {"type": "integer"},
            "b": {"type": "number"},
            "enabled": {"type": "boolean"},
            "zero": {"type": "number"},
            "negative": {"type": "number"},
            "large": {"type": "number"},
        },
    ),
    function("apply_diff", {"s": S, "old_string": S, "new_string": S}),
    function("write_to_file", {"file_path": S, "content": S}),
    function("todo_write", {"todos": {"type": "array", "description": "The updated todo list"}}),
    function("create_task", {"title": S, "location": S}),
    function("list_files"),
    function("list_filenames"),
    function("list_dir", {"path": S}),
    function(
        "create_todos", {"priority": {"type": "number"}, "count": {"type": "integer"}, "items": {"type": "array"}}
    ),
    function("create_note", {"title": S, "content": S}),
    function("search", {"query": S}),
    function("execute_command", {"command": S}),
    function("process_data", {"data": {"type": "object"}}),
    function("create_structure", {"empty_obj": {"type": "object"}, "empty_arr": {"type": "array"}}),
    function("multi_param", {"a": S, "b": S, "c": S}),
    function("action"),
    function("store_data", {"id": S, "code": S}),
]


def g45(name, pairs, indent="    "):
    """A call in the GLM-4.5/4.6 layout: newline and indentation before every tag."""
    body = "".join(f"\n{indent}<arg_key>{k}</arg_key>\n{indent}<arg_value>{v}</arg_value>" for k, v in pairs)
    return f"<tool_call>{name}{body}\n{indent}</tool_call>"


def g47(name, pairs):
    """A call in the GLM-4.7 / 5.x layout: no whitespace between tags."""
    return (
        f"<tool_call>{name}"
        + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs)
        + ("</tool_call>")
    )


def nl(name, pairs):
    """A call with a newline after the name and after every tag pair (SGLang's GLM-4 tests)."""
    return g45(name, pairs, indent="")


TODOS = [
    {"id": "1", "task": "Check for hard-coded issues in the backend code", "status": "in_progress"},
    {"id": "2", "task": "Check for hard-coded issues in the frontend code", "status": "pending"},
    {"id": "3", "task": "Check for code violating the Single Responsibility Principle", "status": "pending"},
    {"id": "4", "task": "Generate a rectification proposal report", "status": "pending"},
]
WINDOWS_TODO = [{"id": "1", "task": "Check file at C:\\Users\\test.txt", "status": "pending"}]
BACKSLASH_N_TODO = [{"id": "1", "task": "Print \\n to see newline", "status": "pending"}]
NESTED = {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}
CODE = 'def bubble_sort(arr):\n    n = len(arr)\n    for i in range(n):\n        print(f"{i}: {arr}")\n    return arr\n'
DALLAS = [("city", "Dallas"), ("state", "TX"), ("unit", "fahrenheit")]
BEIJING = [("city", "Beijing"), ("date", "2024-06-27")]


def case(output, content=None, calls=(), reasoning=None, chunks=None):
    return {"output": output, "expected": Result(None, content, list(calls)), "reasoning": reasoning, "chunks": chunks}


CASES = {
    # -- vLLM, GLM-4.7 parser tests --
    "v47_no_tool_call": case("This is a plain response.", "This is a plain response."),
    "v47_zero_arg_inline": case("<tool_call>get_current_date</tool_call>", calls=[call("get_current_date")]),
    "v47_zero_arg_newline": case("<tool_call>get_current_date\n</tool_call>", calls=[call("get_current_date")]),
    "v47_args_same_line": case(g47("get_weather", [("city", "Beijing")]), calls=[call("get_weather", city="Beijing")]),
    "v47_args_with_newlines": case(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n</tool_call>",
        calls=[call("get_weather", city="Beijing")],
    ),
    "v47_content_before": case(
        "Checking.<tool_call>get_current_date</tool_call>", "Checking.", [call("get_current_date")]
    ),
    "v47_multiple": case(
        g47("get_weather", [("city", "Beijing")]) + g47("get_weather", [("city", "Shanghai")]),
        calls=[call("get_weather", city="Beijing"), call("get_weather", city="Shanghai")],
    ),
    "v47_whitespace_content_none": case(
        "  \n  <tool_call>get_current_date</tool_call>", calls=[call("get_current_date")]
    ),
    "v47_name_split_mid_word": case(
        g47("get_weather", [("city", "Beijing")]),
        calls=[call("get_weather", city="Beijing")],
        chunks=["<tool_call>get", "_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value></tool_call>"],
    ),
    # -- vLLM, GLM-4.5 parser tests (GLM-4.5/4.6 layout) --
    "v4_no_tools": case("This is a test", "This is a test"),
    "v4_single": case(
        g45("get_current_weather", DALLAS),
        calls=[call("get_current_weather", city="Dallas", state="TX", unit="fahrenheit")],
    ),
    "v4_multiple": case(
        g45("get_current_weather", DALLAS)
        + "\n    "
        + g45("get_current_weather", [("city", "Orlando"), ("state", "FL"), ("unit", "fahrenheit")]),
        calls=[
            call("get_current_weather", city="Dallas", state="TX", unit="fahrenheit"),
            call("get_current_weather", city="Orlando", state="FL", unit="fahrenheit"),
        ],
    ),
    # vLLM 0.32 strips content when calls were made (the old GLM-4.5 test kept the trailing space).
    "v4_content_before": case(
        "I'll help you check the weather. "
        + g45("get_current_weather", [("city", "Seattle"), ("state", "WA"), ("unit", "celsius")]),
        "I'll help you check the weather.",
        [call("get_current_weather", city="Seattle", state="WA", unit="celsius")],
    ),
    "v4_mixed_args": case(
        g45("get_current_weather", [("city", "New York"), ("state", "NY"), ("unit", "celsius")]),
        calls=[call("get_current_weather", city="New York", state="NY", unit="celsius")],
    ),
    "v4_content_before_no_space": case(
        "I will help you get the weather." + g45("get_weather", [("city", "Beijing"), ("date", "2025-08-01")]),
        "I will help you get the weather.",
        [call("get_weather", city="Beijing", date="2025-08-01")],
    ),
    # vLLM 0.32 treats a think block in the tool parser's input as reasoning (the old test kept it as content).
    "v4_thinking_tags": case(
        "<think>I want to get the weather.</think>\n\nI will help you get the weather.\n"
        + nl("get_weather", [("city", "Beijing"), ("date", "2025-08-01")]),
        "I will help you get the weather.",
        [call("get_weather", city="Beijing", date="2025-08-01")],
        reasoning="I want to get the weather.",
    ),
    # Upstream only asks for no crash; a key missing its </arg_key> is closed by the <arg_value> after it.
    "v4_malformed_key": case(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Seattle</arg_value>\n"
        "<arg_key>incomplete_arg\n<arg_value>value</arg_value>\n</tool_call>",
        calls=[call("get_weather", city="Seattle", incomplete_arg="value")],
    ),
    "v4_empty_arguments": case("<tool_call>get_current_time\n</tool_call>", calls=[call("get_current_time")]),
    # vLLM 0.32 drops the text after a call one-shot (SGLang keeps it): it is kept, see the diff test.
    "v4_mixed_content": case(
        "I will help you get the weather info.\n\n"
        + nl("get_weather", [("city", "Beijing"), ("date", "2025-08-01")])
        + "\n\nmeaningwhile, I will also check the weather in Shanghai.\n\n"
        + nl("get_weather", [("city", "Shanghai"), ("date", "2025-08-01")]),
        "I will help you get the weather info.\n\n\n\nmeaningwhile, I will also check the weather in Shanghai.",
        [
            call("get_weather", city="Beijing", date="2025-08-01"),
            call("get_weather", city="Shanghai", date="2025-08-01"),
        ],
    ),
    # An opener cut off with nothing after it: the text before stays content, the markup goes (vLLM 0.32).
    "v4_content_before_bare_opener": case(
        "I will help you get the weather.<tool_call>", "I will help you get the weather."
    ),
    "v4_special_characters": case(
        nl("send_message", [("recipient", "Amy"), ("message", "It is a nice day"), ("priority", "high")]),
        calls=[call("send_message", recipient="Amy", message="It is a nice day", priority="high")],
    ),
    # Missing </tool_call> (max_tokens): vLLM 0.32 returns the call (the old GLM-4.5 parser did not).
    "v4_incomplete_call": case(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
        "<arg_key>date</arg_key>\n<arg_value>2025-08-01</arg_value>",
        calls=[call("get_weather", city="Beijing", date="2025-08-01")],
    ),
    "v4_empty_tool_call": case("<tool_call></tool_call>"),
    "v4_json_escape_in_string": case(
        nl("send_message", [("message", 'Hello "world"\nNew line')]),
        calls=[call("send_message", message='Hello "world"\nNew line')],
    ),
    "v4_long_string_value": case(
        nl("write_to_file", [("file_path", "/tmp/bubble_sort.py"), ("content", CODE)]),
        calls=[call("write_to_file", file_path="/tmp/bubble_sort.py", content=CODE)],
    ),
    "v4_numeric_deserialization": case(
        nl("calculate", [("operation", "add"), ("a", "42"), ("b", "3.14"), ("enabled", "true")]),
        calls=[call("calculate", operation="add", a=42, b=3.14, enabled=True)],
    ),
    "v4_whitespace_preserved": case(
        nl("apply_diff", [("s", "    indented code    ")]), calls=[call("apply_diff", s="    indented code    ")]
    ),
    "v4_zero_argument": case("<tool_call>get_time\n</tool_call>", calls=[call("get_time")]),
    # A nameless opener at the end: no call, and vLLM 0.32 drops the markup (the old test kept it as content).
    "v4_opener_without_name": case("<tool_call>   "),
    "v4_unicode_preserved": case(
        nl("send_message", [("greeting", "你好世界"), ("emoji", "🎉")]),
        calls=[call("send_message", greeting="你好世界", emoji="🎉")],
    ),
    "v4_multi_token_chunks": case(
        nl("get_weather", [("city", "Beijing")]),
        calls=[call("get_weather", city="Beijing")],
        chunks=["<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Bei", "jing</arg_value>\n</tool_call>"],
    ),
    # -- SGLang, GLM-4.7 detector tests --
    "s47_single": case(g47("get_weather", BEIJING), calls=[call("get_weather", city="Beijing", date="2024-06-27")]),
    "s47_multiple": case(
        g47("get_weather", BEIJING) + g47("get_weather", [("city", "Shanghai"), ("date", "2024-06-28")]),
        calls=[
            call("get_weather", city="Beijing", date="2024-06-27"),
            call("get_weather", city="Shanghai", date="2024-06-28"),
        ],
    ),
    "s47_no_arg": case("<tool_call>list_filenames</tool_call>", calls=[call("list_filenames")]),
    "s47_invalid_tool": case(g47("invalid_func", [("city", "Beijing")])),
    "s47_array_json": case(
        g47("todo_write", [("todos", json.dumps(TODOS))]) + "\n", calls=[call("todo_write", todos=TODOS)]
    ),
    "s47_array_json_backslashes": case(
        g47("todo_write", [("todos", json.dumps(WINDOWS_TODO))]), calls=[call("todo_write", todos=WINDOWS_TODO)]
    ),
    "s47_array_json_literal_backslash_n": case(
        g47("todo_write", [("todos", json.dumps(BACKSLASH_N_TODO))]), calls=[call("todo_write", todos=BACKSLASH_N_TODO)]
    ),
    "s47_mtp_name_and_value_split": case(
        "I'll create a task." + g47("create_task", [("title", "Go to Beijing"), ("location", "San Francisco")]),
        "I'll create a task.",
        [call("create_task", title="Go to Beijing", location="San Francisco")],
        chunks=[
            "I'll create a task.",
            "<tool_call>create_ta",
            "sk<arg_key>title</arg_key><arg_value>Go to Bei",
            "jing</arg_value>",
            "<arg_key>location</arg_key><arg_value>San Fran",
            "cisco</arg_value></tool_call>",
        ],
    ),
    "s47_mtp_no_arg_then_call": case(
        "<tool_call>list_files</tool_call>" + g47("get_weather", [("city", "Beijing")]),
        calls=[call("list_files"), call("get_weather", city="Beijing")],
        chunks=["<tool_call>list_files</tool_call>", g47("get_weather", [("city", "Beijing")])],
    ),
    "s47_mtp_numbers_and_json": case(
        g47(
            "create_todos",
            [
                ("priority", "5.5"),
                ("count", "10"),
                ("items", '[{"description": "TestTodo 1"}, {"description": "TestTodo 2"}]'),
            ],
        ),
        calls=[
            call(
                "create_todos",
                priority=5.5,
                count=10,
                items=[{"description": "TestTodo 1"}, {"description": "TestTodo 2"}],
            )
        ],
        chunks=[
            "<tool_call>create_todos",
            "<arg_key>priority</arg_key><arg_value>5.5</arg_value>",
            "<arg_key>count</arg_key><arg_value>10</arg_value>",
            '<arg_key>items</arg_key><arg_value>[{"description',
            '": "Test',
            'Todo 1"}, {"description": "TestTodo 2"}]</arg_value></tool_call>',
        ],
    ),
    "s47_streaming_calls_meet_in_a_chunk": case(
        g47("get_weather", BEIJING) + g47("get_weather", [("city", "Shanghai"), ("date", "2024-06-28")]),
        calls=[
            call("get_weather", city="Beijing", date="2024-06-27"),
            call("get_weather", city="Shanghai", date="2024-06-28"),
        ],
        chunks=[
            "<tool_call>get_weather",
            "<arg_key>city</arg_key><arg_value>Beijing</arg_value>",
            "<arg_key>date</arg_key><arg_value>2024-06-27</arg_value>",
            "</tool_call><tool_call>get_weather",
            "<arg_key>city</arg_key><arg_value>Shanghai</arg_value>",
            "<arg_key>date</arg_key><arg_value>2024-06-28</arg_value>",
            "</tool_call>",
        ],
    ),
    # Text before an opener is kept; the call is cut off after its name, which vLLM 0.32 returns (SGLang's
    # streaming test looks at the text only).
    **{
        f"s47_text_before_{i}": case(text + "<tool_call>list_dir", text, [call("list_dir")])
        for i, text in enumerate(["Sure, let me help.", "结构：", "问题。", "Complete!", "说明；"])
    },
    "s47_empty_value": case(
        g47("create_note", [("title", "Test"), ("content", "")]), calls=[call("create_note", title="Test", content="")]
    ),
    "s47_value_one_char_per_chunk": case(
        g47("search", [("query", "New York")]),
        calls=[call("search", query="New York")],
        chunks=[
            "<tool_call>search<arg_key>query</arg_key><arg_value>N",
            "e",
            "w ",
            "Y",
            "o",
            "rk</arg_value></tool_call>",
        ],
    ),
    "s47_single_quotes": case(
        g47("execute_command", [("command", "echo 'Hello World'")]),
        calls=[call("execute_command", command="echo 'Hello World'")],
    ),
    "s47_ampersand": case(
        g47("execute_command", [("command", "echo Hello & World")]),
        calls=[call("execute_command", command="echo Hello & World")],
    ),
    "s47_deeply_nested": case(
        g47("process_data", [("data", json.dumps(NESTED))]), calls=[call("process_data", data=NESTED)]
    ),
    "s47_empty_structures": case(
        g47("create_structure", [("empty_obj", "{}"), ("empty_arr", "[]")]),
        calls=[call("create_structure", empty_obj={}, empty_arr=[])],
    ),
    "s47_several_tags_in_one_chunk": case(
        g47("multi_param", [("a", "1"), ("b", "2"), ("c", "3")]), calls=[call("multi_param", a="1", b="2", c="3")]
    ),
    # SGLang keeps the text after a call; vLLM 0.32 drops it one-shot: kept (see the diff test).
    "s47_text_around_call": case(
        "First I'll do this.<tool_call>action</tool_call>Then I'll do that.",
        "First I'll do this.Then I'll do that.",
        [call("action")],
    ),
    "s47_number_edge_values": case(
        g47("calculate", [("zero", "0"), ("negative", "-42.5"), ("large", "1e10")]),
        calls=[call("calculate", zero=0, negative=-42.5, large=10000000000)],
    ),
    "s47_numeric_text_in_string_fields": case(
        g47("store_data", [("id", "12345"), ("code", "67.89")]), calls=[call("store_data", id="12345", code="67.89")]
    ),
    "s47_undefined_tool": case(g47("nonexistent_function", [("param", "value")])),
    # Cut off inside a value: SGLang returns nothing, vLLM 0.32 '{}' one-shot and unterminated JSON
    # streamed; the value so far is kept, the same both ways (see the diff test).
    "s47_incomplete_at_end": case(
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing", calls=[call("get_weather", city="Beijing")]
    ),
    # -- SGLang, GLM-4 detector tests (newline after every tag) --
    "s4_multiple": case(
        nl("get_weather", BEIJING) + nl("get_weather", [("city", "Shanghai"), ("date", "2024-06-28")]),
        calls=[
            call("get_weather", city="Beijing", date="2024-06-27"),
            call("get_weather", city="Shanghai", date="2024-06-28"),
        ],
    ),
    "s4_invalid_tool": case(nl("invalid_func", [("city", "Beijing")])),
    "s4_partial_chunks": case(
        nl("get_weather", BEIJING),
        calls=[call("get_weather", city="Beijing", date="2024-06-27")],
        chunks=[
            "<tool_call>get_weather\n",
            "<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n",
            "<arg_key>date</arg_key>\n<arg_value>2024-06-27</arg_value>\n</tool_call>",
        ],
    ),
    "s4_array_json": case(nl("todo_write", [("todos", json.dumps(TODOS))]), calls=[call("todo_write", todos=TODOS)]),
    "s4_opener_then_newline": case("<tool_call>\n", chunks=["<tool_call>", "\n"]),
    "s4_whitespace_preserved": case(
        nl("apply_diff", [("old_string", "    indented code"), ("new_string", "        also indented")]),
        calls=[call("apply_diff", old_string="    indented code", new_string="        also indented")],
    ),
}


def modes_of(spec):
    return MODES + (("upstream",) if spec["chunks"] else ())


def check(got, expected, mode):
    assert not getattr(got, "errors", None), (mode, got.errors)
    assert streamed_as_oneshot(got, mode) == expected, mode


@pytest.mark.parametrize("name", name_groups())
@pytest.mark.parametrize("case_id", list(CASES))
def test_tool_parser_alone(tok, name, case_id):
    spec = CASES[case_id]
    tool_cls = pipeline(tok, name).tool_parser_cls
    for mode in modes_of(spec):
        if mode == "upstream":
            got = run_tool_parser(tool_cls, tok, spec["output"], request(TOOLS, tool_choice="auto"), spec["chunks"])
        else:
            got = run_tool_parser(tool_cls, tok, spec["output"], request(TOOLS, tool_choice="auto"), mode)
        check(got, spec["expected"], mode)


@pytest.mark.parametrize("name", name_groups())
@pytest.mark.parametrize("case_id", list(CASES))
def test_served(tok, name, case_id):
    # A GLM-5.3 turn: reasoning (here empty) closed by </think>, then the case's text.
    spec = CASES[case_id]
    expected = Result(spec["reasoning"], spec["expected"].content, spec["expected"].calls)
    cls = pipeline(tok, name)
    for mode in modes_of(spec):
        parts = [("</think>", [])] + [(c, []) for c in spec["chunks"]] if mode == "upstream" else None
        got = run(cls, tok, "</think>" + spec["output"], request(TOOLS, tool_choice="auto"), mode, parts)
        check(got, expected, mode)


@pytest.mark.parametrize("tool_choice", ["auto", None], ids=["auto", "unset"])
def test_mock_requests_as_upstream_tests_build_them(tok, tool_choice):
    # vLLM's own parser tests pass ``Mock(spec=ChatCompletionRequest)`` with only ``tools`` (and maybe
    # ``tool_choice``) set; every other attribute is a Mock. The parser must read such a request as "auto",
    # and keep vLLM's per-call bookkeeping (``prev_tool_call_arr``, ``streamed_args_for_tool``) that the
    # serving layer reads at the end of a stream.
    req = Mock(spec=ChatCompletionRequest)
    req.tools = [
        ChatCompletionToolsParam(
            function=FunctionDefinition(name="get_weather", parameters=TOOLS[0]["function"]["parameters"])
        )
    ]
    if tool_choice is not None:
        req.tool_choice = tool_choice
    spec = CASES["v47_args_with_newlines"]
    tool_cls = pipeline(tok, "glm47").tool_parser_cls
    for mode in MODES:
        check(run_tool_parser(tool_cls, tok, spec["output"], req, mode), spec["expected"], mode)
    parser = tool_cls(tok, req.tools)
    for text in [
        "<tool_call>",
        "get_weather\n",
        "<arg_key>city</arg_key>",
        "<arg_value>",
        "Beijing",
        "</arg_value>",
        "</tool_call>",
    ]:
        parser.extract_tool_calls_streaming("", "", text, [], [], [], req)
    assert [entry["name"] for entry in parser.prev_tool_call_arr] == ["get_weather"]
    assert json.loads(parser.prev_tool_call_arr[0]["arguments"]) == {"city": "Beijing"}
    assert parser.streamed_args_for_tool == [parser.prev_tool_call_arr[0]["arguments"]]
    assert parser.get_remaining_unstreamed_args() == ""
