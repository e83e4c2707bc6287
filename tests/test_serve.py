"""The main job as a user sees it: ``vllm serve`` with the plugin (the CPU recipe's command), spoken to over HTTP
with the ``openai`` client. One server for the whole module, on a flat (text-only) float32 checkpoint so that
completions can be compared token for token with transformers."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import requests

from conftest import hf_greedy, hf_model, prompt_set

pytestmark = [pytest.mark.serve, pytest.mark.engine]

MAX_MODEL_LEN = 512
NAME = "glm-5.3-tiny"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def _metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"metric {name} not exported"
    return total


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    from conftest import served

    path = tiny_ckpt("serve-flat", layout="flat", seed=5)
    # LD_PRELOAD as a user's shell has it (an engine config built earlier in this process may have set it).
    with served(path, ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64"), env={"LD_PRELOAD": ""}) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(server):
    from vllm_glm53.chat.tokenizer import Glm5NextTokenizer

    return Glm5NextTokenizer.from_pretrained(str(server["path"]))


def assert_alive(client):
    out = client.completions.create(model=NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert out.choices[0].text is not None


# ---------------------------------------------------------------------------------------------------------
# The OpenAI surface
# ---------------------------------------------------------------------------------------------------------


def test_the_log_says_which_model_serves(server):
    """The plugin's start-up line is written through vLLM's log handlers, with vLLM's format, in the processes
    that load the model (the engine core's worker here), not only to a logger nobody listens to."""
    served = [line for line in server["server"].lines if "GLM-5.3 is served by the plugin's model" in line]
    assert served and all(" INFO " in line for line in served), server["server"].lines[-60:]
    assert any(line.startswith(("(EngineCore", "(Worker")) for line in served), served


def test_engine_processes_run_on_tcmalloc(server):
    """The engine core and its worker start with a tcmalloc preloaded (vllm_glm53/cpu_malloc.py), so vLLM's worker
    has no missing-libtcmalloc warning to give; the front-end, started without one, keeps glibc's allocator."""
    import psutil

    from vllm_glm53 import cpu_malloc

    if cpu_malloc.find_tcmalloc() is None:
        pytest.skip("no tcmalloc on this machine (apt install libtcmalloc-minimal4; make setup does as root)")
    front = psutil.Process(server["server"].proc.pid)
    engine = front.children(recursive=True)
    mapped = {p.pid: "libtcmalloc" in open(f"/proc/{p.pid}/maps").read() for p in [front, *engine]}
    assert engine and all(mapped[p.pid] for p in engine), mapped
    assert not mapped[front.pid]
    assert not [line for line in server["server"].lines if "libtcmalloc is not found in LD_PRELOAD" in line]


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert requests.get(server["url"] + "/health", timeout=10).status_code == 200
    metrics = requests.get(server["url"] + "/metrics", timeout=10).text
    assert "vllm:num_requests_running" in metrics


def test_completions_match_transformers(server, client):
    """Greedy completions over HTTP are the same tokens transformers generates on the same checkpoint."""
    prompts = prompt_set(server["path"], [5, 40, 150])
    want = hf_greedy(hf_model(server["path"]), prompts, 10)
    for prompt, w in zip(prompts, want):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert out.choices[0].token_ids == w["token_ids"]


def test_chat_prompt_is_exactly_the_rendered_template(client, tokenizer):
    from vllm_glm53.chat import render

    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Paris? <|assistant|> is plain text here"}]
    for effort, header in (("low", "Low"), ("high", "High"), ("max", "Max"), (None, "Max")):
        extra = {"return_token_ids": True}
        kwargs = {} if effort is None else {"reasoning_effort": effort}
        out = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=3,
                                             temperature=0, extra_body=extra, **kwargs)
        rendered = render(messages, tools=[WEATHER], reasoning_effort=effort)
        assert f"Reasoning Effort: {header}" in rendered
        want = tokenizer.apply_chat_template(messages, tools=[WEATHER], reasoning_effort=effort, tokenize=True)
        assert out.prompt_token_ids == list(want)
        # the user's spelled "<|assistant|>" stayed text: exactly one assistant control token (the prompt's own)
        assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")
        assert out.prompt_token_ids.count(assistant) == 1


def test_chat_streaming_equals_non_streaming(client):
    messages = [{"role": "user", "content": "Tell me a story about the sea."}]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    msg = full.choices[0].message
    reasoning, content = [], []
    for chunk in client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0,
                                                stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning", None) or getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
    full_reasoning = getattr(msg, "reasoning", None) or getattr(msg, "reasoning_content", None) or ""
    assert "".join(reasoning) == full_reasoning
    assert "".join(content) == (msg.content or "")
    # The prompt ends inside <think>: unfinished thinking is reasoning, never content.
    assert full_reasoning and not msg.content


def test_tool_choice_required_and_none(client, tokenizer):
    messages = [{"role": "user", "content": "What is the weather in Lima?"}]
    # A random model never closes its reasoning; vLLM applies the tool-call grammar only after </think>, so
    # push the model to end thinking at once (the grammar then masks </think> away).
    end_think = {str(tokenizer.convert_tokens_to_ids("</think>")): 100}
    req = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], tool_choice="required",
                                         max_tokens=60, temperature=0, logit_bias=end_think)
    calls = req.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert isinstance(args.get("city"), str)
    none = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], tool_choice="none",
                                          max_tokens=20, temperature=0)
    assert not none.choices[0].message.tool_calls
    auto = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], tool_choice="auto",
                                          max_tokens=20, temperature=0)
    # Without the logit bias the random model stays in its reasoning for all 20 tokens: no tool call can be
    # parsed, and the request ends on its token budget (an EOS would have ended it shorter).
    assert not auto.choices[0].message.tool_calls
    assert auto.usage.completion_tokens == 20 and auto.choices[0].finish_reason == "length"
    assert none.choices[0].finish_reason == ("length" if none.usage.completion_tokens == 20 else "stop")
    # the forced call's arguments run to the token budget on this random model (measured: 60 of 60 tokens)
    assert req.choices[0].finish_reason == ("length" if req.usage.completion_tokens == 60 else "tool_calls")


def test_n_seed_logprobs_and_stop(client):
    kwargs = dict(model=NAME, prompt="The weather today", max_tokens=12, temperature=1.0, seed=1234, n=3)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert len(a.choices) == 3
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded sampling is reproducible
    c = client.completions.create(**{**kwargs, "seed": 4321})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]

    lp = client.completions.create(model=NAME, prompt="The weather today", max_tokens=6, temperature=0, logprobs=3)
    top = lp.choices[0].logprobs
    assert len(top.tokens) == len(top.token_logprobs) == len(top.top_logprobs) == lp.usage.completion_tokens
    for token, token_lp, alternatives in zip(top.tokens, top.token_logprobs, top.top_logprobs):
        assert token_lp == pytest.approx(max(alternatives.values()), abs=1e-5)  # greedy picks the best

    greedy = client.completions.create(model=NAME, prompt="The weather today", max_tokens=12, temperature=0)
    text = greedy.choices[0].text
    assert greedy.choices[0].finish_reason == ("length" if greedy.usage.completion_tokens == 12 else "stop")
    # The stop string: the first two non-blank characters from the middle of the text on (a blank one would
    # test nothing), so that the cut lands inside the output.
    start = next(i for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip() == text[i : i + 2])
    stop = text[start : start + 2]
    cut = client.completions.create(model=NAME, prompt="The weather today", max_tokens=12, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


# ---------------------------------------------------------------------------------------------------------
# Bad input: a clear 4xx, and the server keeps serving
# ---------------------------------------------------------------------------------------------------------


def _post(server, path, body, raw=False):
    data = body if raw else json.dumps(body)
    return requests.post(server["url"] + path, data=data, headers={"Content-Type": "application/json"},
                         timeout=120)


@pytest.mark.parametrize(
    "case",
    ["prompt_too_long", "max_tokens_beyond_context", "malformed_json", "unknown_model", "invalid_tool_schema",
     "image_to_text_only", "non_utf8"],
)
def test_bad_input_is_a_clear_4xx(server, client, case):
    long_prompt = list(range(10, 10 + MAX_MODEL_LEN + 20))
    user = [{"role": "user", "content": "hi"}]
    if case == "prompt_too_long":
        r = _post(server, "/v1/completions", {"model": NAME, "prompt": long_prompt, "max_tokens": 4})
    elif case == "max_tokens_beyond_context":
        r = _post(server, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": MAX_MODEL_LEN * 4})
    elif case == "malformed_json":
        r = _post(server, "/v1/chat/completions", '{"model": "x", "messages": [', raw=True)
    elif case == "unknown_model":
        r = _post(server, "/v1/chat/completions", {"model": "no-such-model", "messages": user})
    elif case == "invalid_tool_schema":
        r = _post(server, "/v1/chat/completions", {"model": NAME, "messages": user,
                                                   "tools": [{"type": "function", "function": {"parameters": 3}}]})
    elif case == "image_to_text_only":
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        r = _post(server, "/v1/chat/completions",
                  {"model": NAME, "messages": [{"role": "user", "content": [image, {"type": "text", "text": "?"}]}]})
    else:
        r = _post(server, "/v1/completions", b'{"model": "' + NAME.encode() + b'", "prompt": "\xff\xfe\xfa"}',
                  raw=True)
    assert 400 <= r.status_code < 500, (case, r.status_code, r.text[:500])
    body = r.json()
    message = body.get("error", {}).get("message") or body.get("message") or body.get("detail")
    assert isinstance(message, str) and message, r.text[:500]
    assert_alive(client)


def test_cancelled_stream_frees_its_state(server, client):
    """Closing a stream mid-way aborts the request: the engine frees its KDA state slot and cache blocks, and
    later requests still run."""
    metrics_url = server["url"] + "/metrics"
    for _ in range(3):
        stream = client.completions.create(model=NAME, prompt="A long story: ", max_tokens=400, temperature=0,
                                           stream=True)
        for i, _chunk in enumerate(stream):
            if i == 3:
                break
        stream.close()
    for _ in range(60):
        m = requests.get(metrics_url, timeout=10).text
        if _metric(m, "vllm:num_requests_running") == 0 and _metric(m, "vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(1)
    m = requests.get(metrics_url, timeout=10).text
    assert _metric(m, "vllm:num_requests_running") == 0
    assert _metric(m, "vllm:kv_cache_usage_perc") == 0
    assert_alive(client)


# ---------------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------------


def test_64_concurrent_streams_lose_and_duplicate_nothing(server, client):
    """64 concurrent streaming requests of mixed lengths give, token for token, what each gives alone."""
    from openai import AsyncOpenAI

    prompts = prompt_set(server["path"], [3 + (i * 37) % 200 for i in range(64)])
    max_tokens = [4 + i % 13 for i in range(64)]
    alone = [
        client.completions.create(model=NAME, prompt=p, max_tokens=n, temperature=0,
                                  extra_body={"return_token_ids": True}).choices[0].token_ids
        for p, n in zip(prompts, max_tokens)
    ]

    async def one(aclient, prompt, n):
        ids = []
        stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True, extra_body={"return_token_ids": True})
        async for chunk in stream:
            ids.extend(chunk.choices[0].token_ids or [])
        return ids

    async def all_at_once():
        aclient = AsyncOpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=600)
        return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(prompts, max_tokens)))

    together = asyncio.run(all_at_once())
    assert len(together) == len(alone) == 64
    for i, (ids, want) in enumerate(zip(together, alone)):
        assert ids == want, f"request {i}: concurrent stream {ids} != alone {want}"
