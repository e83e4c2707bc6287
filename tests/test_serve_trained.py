"""``vllm serve`` on the trained tiny checkpoint that ships in the package (``vllm_glm53.tiny_trained``), with MTP
speculative decoding: the tokenizer mode, the renderer and the ``glm47`` parsers on what a model really generates.
Nothing is forced: no ``tool_choice``, no logit bias; the model decides to think, to call a tool and to answer.
One server for the module."""

from __future__ import annotations

import json

import pytest

from conftest import hf_greedy, hf_model

pytestmark = [pytest.mark.serve, pytest.mark.engine]

NAME = "glm-5.3-tiny"
MTP_DRAFTS = 2


@pytest.fixture(scope="module")
def server():
    from conftest import served
    from vllm_glm53.tiny_trained import shipped_checkpoint

    with served(shipped_checkpoint(), ("--max-model-len", "1024"), features=(f"mtp={MTP_DRAFTS}",)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tools():
    from vllm_glm53.tiny_trained import TIME_TOOL, WEATHER_TOOL

    return [WEATHER_TOOL, TIME_TOOL]


def stream(client, messages, tools, **kwargs):
    """A streamed chat turn, reassembled from its deltas (the demo's own reader, printing nothing)."""
    from vllm_glm53.demo import stream_turn

    return stream_turn(client, messages, tools, out=lambda *a, **k: None, max_tokens=160, **kwargs)


def history(turn, question: str) -> list[dict]:
    """The conversation so far with the tools' results, as a client sends it back."""
    from vllm_glm53.tiny_trained import call_tool, tool_result_text

    messages = [{"role": "user", "content": question},
                {"role": "assistant", "content": None, "reasoning_content": turn.reasoning,
                 "tool_calls": turn.tool_calls()}]
    for call in turn.tool_calls():
        result = call_tool(call["function"]["name"], json.loads(call["function"]["arguments"]))
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result_text(result)})
    return messages


def test_trained_checkpoint_matches_transformers(server, client, tools):
    """It is just another checkpoint: greedy tokens over HTTP (with MTP drafting) are transformers' tokens, on
    chat prompts rendered by the tokenizer mode (the question, and the turn after a tool result)."""
    from vllm_glm53.chat.tokenizer import Glm5NextTokenizer
    from vllm_glm53.tiny_trained import get_weather, tool_result_text

    tok = Glm5NextTokenizer.from_pretrained(str(server["path"]))
    conversations = [
        [{"role": "user", "content": "What is the weather like in Lima?"}],
        [{"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
         {"role": "tool", "tool_call_id": "c1", "content": tool_result_text(get_weather("Oslo"))}],
    ]
    prompts = [list(tok.apply_chat_template(c, tools=tools, reasoning_effort="high")) for c in conversations]
    want = hf_greedy(hf_model(server["path"]), prompts, 48)
    for prompt, w in zip(prompts, want):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=48, temperature=0,
                                        extra_body={"return_token_ids": True, "skip_special_tokens": False})
        assert out.choices[0].token_ids == w["token_ids"]


def test_model_calls_the_tool_itself_streamed(client, tools):
    turn = stream(client, [{"role": "user", "content": "What is the weather like in Paris?"}], tools,
                  reasoning_effort="high")
    assert turn.finish_reason == "tool_calls"
    assert "Paris" in turn.reasoning and "get_weather" in turn.reasoning
    assert "<think>" not in turn.reasoning and "</think>" not in turn.reasoning
    assert turn.content.strip() == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in turn.calls.values()] == \
        [("get_weather", {"city": "Paris"})]


def test_streamed_and_non_streamed_replies_agree(client, tools):
    messages = [{"role": "user", "content": "What time is it in Seoul?"}]
    turn = stream(client, messages, tools, reasoning_effort="low")
    full = client.chat.completions.create(model=NAME, messages=messages, tools=tools, reasoning_effort="low",
                                          max_tokens=160, temperature=0)
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == turn.finish_reason == "tool_calls"
    assert (getattr(msg, "reasoning", None) or msg.reasoning_content) == turn.reasoning
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [(c["name"], json.loads(c["arguments"])) for c in turn.calls.values()] == [("get_time", {"city": "Seoul"})]


def test_answer_uses_the_tool_result(client, tools):
    from vllm_glm53.tiny_trained import get_weather

    question = "Weather in Berlin?"
    call = stream(client, [{"role": "user", "content": question}], tools, reasoning_effort="high")
    answer = stream(client, history(call, question), tools, reasoning_effort="high")
    weather = get_weather("Berlin")
    assert answer.finish_reason == "stop" and not answer.calls
    assert answer.content == f"It is {weather['temperature']} degrees Celsius and {weather['condition']} in Berlin."
    assert f"{weather['temperature']} degrees" in answer.reasoning


def test_two_calls_in_one_turn_are_parsed_as_generated(server, client, tools):
    """Two cities: the model writes two ``<tool_call>`` blocks back to back (its choice of cities is not reliable
    yet, so the test compares the parsed calls with the raw text it generated, not with the question)."""
    import re

    from vllm_glm53.chat.tokenizer import Glm5NextTokenizer

    messages = [{"role": "user", "content": "What is the weather in Tokyo and Lima?"}]
    prompt = list(Glm5NextTokenizer.from_pretrained(str(server["path"])).apply_chat_template(messages, tools=tools))
    raw = client.completions.create(model=NAME, prompt=prompt, max_tokens=160, temperature=0,
                                    extra_body={"skip_special_tokens": False}).choices[0].text
    written = re.findall(r"<tool_call>(\w+)<arg_key>city</arg_key><arg_value>(\w+)</arg_value></tool_call>", raw)
    assert len(written) == 2, raw
    turn = stream(client, messages, tools)
    assert sorted(turn.calls) == [0, 1] and len({c["id"] for c in turn.calls.values()}) == 2
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(turn.calls.items())] == \
        [(name, {"city": city}) for name, city in written]
    assert turn.finish_reason == "tool_calls"


def test_follow_up_question_calls_the_tool_again(client, tools):
    question = "What is the weather like in Rome?"
    call = stream(client, [{"role": "user", "content": question}], tools, reasoning_effort="low")
    messages = history(call, question)
    answer = stream(client, messages, tools, reasoning_effort="low")
    messages += [{"role": "assistant", "content": answer.content, "reasoning_content": answer.reasoning},
                 {"role": "user", "content": "And in Madrid?"}]
    follow = stream(client, messages, tools, reasoning_effort="low")
    assert [(c["name"], json.loads(c["arguments"])) for c in follow.calls.values()] == \
        [("get_weather", {"city": "Madrid"})]


def test_no_tool_when_none_is_needed(client, tools):
    turn = stream(client, [{"role": "user", "content": "What is the capital of Japan?"}], tools, reasoning_effort="low")
    assert turn.finish_reason == "stop" and not turn.calls
    assert turn.content == "The capital of Japan is Tokyo."
    assert turn.reasoning


def test_thinking_grows_with_reasoning_effort(client, tools):
    lengths = []
    for effort in ("low", "high", "max"):
        turn = stream(client, [{"role": "user", "content": "What time is it in Cairo?"}], tools,
                      reasoning_effort=effort)
        assert turn.calls
        lengths.append(len(turn.reasoning.split(". ")))
    assert lengths == [1, 2, 3]


def test_mtp_drafts_are_mostly_accepted(server):
    from vllm_glm53.demo import metrics

    m = metrics(server["url"])
    drafted = m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafted > 0
    # A trained MTP layer: the demo's conversation measured 49 of 75 drafts accepted (0.65); an untrained one
    # (the random tiny checkpoint) is accepted only where the main model repeats itself.
    assert accepted / drafted > 0.5


def test_stops_cleanly(server):
    """The last test: a requested stop leaves no ERROR record and no traceback except vLLM's known shutdown race,
    which the server wrapper recognises (vllm-project/vllm#48745)."""
    srv = server["server"]
    assert srv.stop() == 0
    assert srv.errors == []
