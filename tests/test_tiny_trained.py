"""The trained tiny checkpoint's recipe (``vllm_glm53.tiny_trained``): what the model is taught to say, and that the
shipped files are what the seeded builder makes. No engine; the served behaviour is in test_serve_trained.py."""

from __future__ import annotations

import json
import random

import pytest


@pytest.fixture(scope="module")
def shipped():
    from vllm_glm53.tiny_trained import shipped_checkpoint

    return shipped_checkpoint()


@pytest.fixture(scope="module")
def tokenizer(shipped):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(shipped / "tokenizer.json"))


def _spans(tokenizer, ids, mask) -> list[str]:
    """The learned stretches of a conversation, decoded (special tokens kept)."""
    spans, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            spans.append(tokenizer.decode(current, skip_special_tokens=False))
            current = []
    if current:
        spans.append(tokenizer.decode(current, skip_special_tokens=False))
    return spans


def test_the_model_learns_exactly_the_assistant_turns(tokenizer):
    """Learned: each assistant turn from after ``<|assistant|><think>`` through the role token that stops it;
    not learned: the prompt, the tool results, and a tool-call turn sent back without its reasoning."""
    from vllm_glm53.tiny_trained import HISTORY_ONLY, TIME_TOOL, WEATHER_TOOL, Conversation, encode

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}
    messages = [
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": "", "tool_calls": [call], HISTORY_ONLY: True},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"city\": \"Lima\"}"},
        {"role": "assistant", "reasoning_content": "R1.", "content": "A1."},
        {"role": "user", "content": "And in Oslo?"},
        {"role": "assistant", "reasoning_content": "R2.", "content": "",
         "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"city\": \"Oslo\"}"},
        {"role": "assistant", "reasoning_content": "R3.", "content": "A3."},
    ]
    ids, mask = encode(tokenizer, Conversation(messages, [WEATHER_TOOL, TIME_TOOL], "low"))
    assert _spans(tokenizer, ids, mask) == [
        "R1.</think>A1.<|user|>",
        "R2.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
        "<|observation|>",
        "R3.</think>A3.<|user|>",
    ]
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("[gMASK]<sop><|system|>Reasoning Effort: Low")


def test_corpus_thinks_longer_with_more_effort_and_calls_tools_it_has():
    from vllm_glm53.tiny_trained import conversation

    rng = random.Random(0)
    sentences = {"low": set(), "high": set(), None: set()}
    for _ in range(300):
        c = conversation(rng)
        offered = {t["function"]["name"] for t in c.tools or ()}
        for m in c.messages:
            if m["role"] != "assistant":
                continue
            for call in m.get("tool_calls") or ():
                assert call["function"]["name"] in offered
            if "reasoning_content" in m:
                sentences[c.effort].add(m["reasoning_content"].count(". ") + 1)
    assert sentences == {"low": {1}, "high": {2}, None: {3}}


def test_shipped_tokenizer_is_the_builders(tokenizer):
    """The shipped BPE is what ``build_tokenizer`` makes from the seeded corpus (and keeps all 36 added tokens)."""
    from vllm_glm53.chat.tokens import ADDED_TOKENS
    from vllm_glm53.tiny import build_tokenizer
    from vllm_glm53.tiny_trained import tokenizer_options

    options = tokenizer_options()
    rebuilt = build_tokenizer(options["base_vocab_size"], options["tokenizer_corpus"], options["cross_word_tokens"])
    assert rebuilt.get_vocab() == tokenizer.get_vocab()
    assert json.loads(rebuilt.to_str())["model"]["merges"] == json.loads(tokenizer.to_str())["model"]["merges"]
    assert all(tokenizer.token_to_id(t) is not None for t in ADDED_TOKENS)


def test_shipped_checkpoint_has_every_layer_kind(shipped):
    from safetensors import safe_open

    cfg = json.loads((shipped / "config.json").read_text())
    text = cfg["text_config"]
    assert {"linear_attention", "deepseek_sparse_attention"} <= set(text["layer_types"])
    assert {"full", "shared"} <= {k for k, t in zip(text["indexer_types"], text["layer_types"])
                                  if t == "deepseek_sparse_attention"}
    assert {"dense", "sparse"} <= set(text["mlp_layer_types"]) and text["mhc"]
    with safe_open(str(shipped / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    n = text["num_hidden_layers"]
    assert f"model.language_model.layers.{n}.eh_proj.weight" in names  # MTP
    assert any(k.startswith("model.visual.") for k in names)


def test_training_is_seeded_and_reproducible(tmp_path):
    """Two runs of the same seeded recipe (two steps here) write identical weights; a third seed does not."""
    from safetensors.torch import load_file

    from vllm_glm53.tiny_trained import train

    runs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        train(tmp_path / name, steps=2, seed=seed, batch=2, log=lambda s: None)
        runs.append(load_file(str(tmp_path / name / "model.safetensors")))
    a, b, c = runs
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)
    assert not all(a[k].equal(c[k]) for k in a)
