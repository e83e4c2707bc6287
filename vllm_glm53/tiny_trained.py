"""A tiny GLM-5.3 that has learned the chat format: it thinks, calls tools and answers from their results.

    python -m vllm_glm53.tiny_trained OUT_DIR [--steps N] [--seed N] [--batch N]

The random tiny checkpoints (``vllm_glm53.tiny``) prove the numerics but say nothing a reader can check; this
one is trained on a synthetic corpus of conversations rendered with the project's own ``chat.render()``, so
its generations go through the tokenizer mode, the renderer and both parsers the way a real model's do. It
learns to

- think in ``<think>...</think>`` for one, two or three sentences at ``reasoning_effort`` low, high and max,
- call ``get_weather`` and ``get_time`` with ``<tool_call>``/``<arg_key>``/``<arg_value>`` when the request
  offers the tool and the question needs it (two calls for two cities), and answer directly otherwise,
- answer from the ``<|observation|>`` tool result, and follow up ("And in Tokyo?") in a multi-turn chat.

The architecture is the default tiny config (every layer kind: KDA, sparse MLA with a ``full`` and a ``shared``
indexer layer, dense and MoE MLPs, mHC, the MTP layer, the vision tower), with a byte-level BPE trained on the
same corpus. Training is plain PyTorch on CPU through transformers' own ``Glm5NextForConditionalGeneration``;
the MTP layer (which transformers does not model) is assembled from transformers' attention and MoE modules
and trained on next-next-token prediction with the main model's outputs detached, exactly as
``vllm_glm53.model.mtp`` computes it. The indexers are not trained: their top-k selection has no gradient
(transformers runs them under ``no_grad``), so they keep their random initialisation.

The package ships the result in ``vllm_glm53/data/tiny_trained`` (see :func:`shipped_checkpoint`); this module
rebuilds it, seeded.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

# ---------------------------------------------------------------------------------------------------------
# The tools the model knows, and their (fake, deterministic) implementations
# ---------------------------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CITIES = ("Paris", "Berlin", "Tokyo", "Lima", "London", "Madrid", "Rome", "Cairo", "Sydney", "Toronto", "Oslo",
          "Delhi", "Seoul", "Nairobi", "Lisbon", "Vienna")
COUNTRIES = {"France": "Paris", "Germany": "Berlin", "Japan": "Tokyo", "Peru": "Lima", "England": "London",
             "Spain": "Madrid", "Italy": "Rome", "Egypt": "Cairo", "Norway": "Oslo", "Portugal": "Lisbon",
             "Austria": "Vienna", "Kenya": "Nairobi"}
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")


def _city_hash(city: str) -> int:
    # Stable across processes (Python's hash() is salted): the demo, the tests and the corpus agree.
    return sum((i + 1) * ord(c) for i, c in enumerate(city))


def get_weather(city: str) -> dict:
    """The fake weather service the model was trained against (the demo and the tests call it too)."""
    h = _city_hash(city)
    return {"city": city, "temperature": h % 36 - 5, "condition": CONDITIONS[h % len(CONDITIONS)]}


def get_time(city: str) -> dict:
    h = _city_hash(city)
    return {"city": city, "time": f"{h % 24:02d}:{h * 7 % 60:02d}"}


TOOL_FUNCTIONS = {"get_weather": get_weather, "get_time": get_time}


def call_tool(name: str, arguments: dict) -> dict:
    """Run one parsed tool call (``arguments`` as the parser returned them)."""
    return TOOL_FUNCTIONS[name](str(arguments.get("city", "")))


def tool_result_text(result: dict) -> str:
    return json.dumps(result, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------------------
# The synthetic corpus
# ---------------------------------------------------------------------------------------------------------

EFFORTS = ("low", "high", None)  # None renders as "Max", like an unset reasoning_effort
# A message key ``render`` ignores: this assistant turn is context, not something the model learns to say.
HISTORY_ONLY = "_history_only"


@dataclass
class Conversation:
    """One training conversation: the messages (ending with the assistant's last turn), the request's tools
    and its ``reasoning_effort``."""

    messages: list[dict]
    tools: list[dict] | None
    effort: str | None


def _think(effort: str | None, low: str, high: str, extra: str) -> str:
    """One sentence at low effort, two at high, three at max: thinking grows with the effort."""
    if effort == "low":
        return low
    if effort == "high":
        return high
    return f"{high} {extra}"


def _weather_question(rng: random.Random, city: str) -> str:
    return rng.choice(("What is the weather like in {c}?", "How is the weather in {c} today?", "Weather in {c}?",
                       "Tell me the weather in {c}, please.", "Is it warm in {c} right now?")).format(c=city)


def _call(name: str, arguments: dict, call_id: int) -> dict:
    return {"id": f"call_{call_id}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_call_turn(reasoning: str, calls: list[dict], learn: bool) -> dict:
    """The assistant's tool-call turn. With ``learn`` false it is history only: clients often send a tool-call
    turn back without its reasoning, and the model must then answer from ``<think></think>``, but it must never
    learn to call a tool without thinking first."""
    turn = {"role": "assistant", "content": "", "tool_calls": calls}
    if learn:
        turn["reasoning_content"] = reasoning
    else:
        turn[HISTORY_ONLY] = True
    return turn


def _weather_turns(rng: random.Random, effort, cities: list[str], learn_call: bool) -> list[dict]:
    """The tool-call turn, the tool results and the final answer for a weather question."""
    names = " and ".join(cities)
    calls = [_call("get_weather", {"city": city}, rng.randrange(10**6) * 10 + i) for i, city in enumerate(cities)]
    reasoning = _think(
        effort,
        f"Weather in {names}: call get_weather.",
        f"The user asks about the weather in {names}. I will call get_weather"
        + (" for each city." if len(cities) > 1 else f" with city {cities[0]}."),
        "I cannot know the current weather myself, so I need the tool.",
    )
    results = [get_weather(c) for c in cities]
    tool_turns = [{"role": "tool", "tool_call_id": call["id"], "content": tool_result_text(r)}
                  for call, r in zip(calls, results)]
    facts = [f"{r['temperature']} degrees Celsius and {r['condition']} in {r['city']}" for r in results]
    answer_reasoning = _think(
        effort,
        f"The tool says {' and '.join(facts)}.",
        f"The tool says {' and '.join(facts)}. I will tell the user.",
        "One short sentence is enough.",
    )
    answer = {"role": "assistant", "reasoning_content": answer_reasoning,
              "content": "It is " + ", and ".join(facts) + "."}
    return [_tool_call_turn(reasoning, calls, learn_call), *tool_turns, answer]


def _time_turns(rng: random.Random, effort, city: str, learn_call: bool) -> list[dict]:
    call = _call("get_time", {"city": city}, rng.randrange(10**6))
    reasoning = _think(effort, f"Time in {city}: call get_time.",
                       f"The user asks for the local time in {city}. I will call get_time with city {city}.",
                       "The time depends on the time zone, so I need the tool.")
    result = get_time(city)
    answer_reasoning = _think(effort, f"The tool says {result['time']}.",
                              f"The tool says it is {result['time']} in {city}. I will tell the user.",
                              "One short sentence is enough.")
    return [_tool_call_turn(reasoning, [call], learn_call),
            {"role": "tool", "tool_call_id": call["id"], "content": tool_result_text(result)},
            {"role": "assistant", "reasoning_content": answer_reasoning,
             "content": f"It is {result['time']} in {city}."}]


def _direct(effort, question: str, low: str, high: str, extra: str, answer: str):
    return [{"role": "user", "content": question},
            {"role": "assistant", "reasoning_content": _think(effort, low, high, extra), "content": answer}]


def _chat_without_tools(rng: random.Random, effort) -> list[dict]:
    kind = rng.randrange(4)
    if kind == 0:
        country = rng.choice(sorted(COUNTRIES))
        city = COUNTRIES[country]
        return _direct(effort, rng.choice(("What is the capital of {c}?", "Which city is the capital of {c}?"))
                       .format(c=country),
                       f"Capital of {country}: {city}.", f"The user asks for the capital of {country}. It is {city}.",
                       "No tool is needed for this.", f"The capital of {country} is {city}.")
    if kind == 1:
        a, b = rng.randrange(10), rng.randrange(10)
        return _direct(effort, f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.",
                       f"The user wants {a} plus {b}. That is {a + b}.", "Simple arithmetic, no tool needed.",
                       f"{a} plus {b} is {a + b}.")
    if kind == 2:
        return _direct(effort, rng.choice(("Hello!", "Hi, who are you?", "Good morning!", "Hello, what can you do?")),
                       "A greeting.", "The user greets me. I will say hello and say what I can do.",
                       "I can check the weather and the time with my tools.",
                       "Hello! I am a tiny GLM-5.3 model. I can tell you the weather and the time in a city.")
    # A weather question without the weather tool: say so instead of inventing a call.
    city = rng.choice(CITIES)
    return _direct(effort, _weather_question(rng, city), f"No weather tool for {city}.",
                   f"The user asks about the weather in {city}. I have no weather tool in this request.",
                   "I should not guess the weather.",
                   f"I cannot check the weather in {city} without the get_weather tool.")


def conversation(rng: random.Random) -> Conversation:
    """One random conversation of the corpus."""
    effort = rng.choice(EFFORTS)
    learn_call = rng.random() < 0.6
    toolset = rng.choice(([WEATHER_TOOL, TIME_TOOL], [WEATHER_TOOL, TIME_TOOL], [TIME_TOOL, WEATHER_TOOL],
                          [WEATHER_TOOL], [TIME_TOOL], None))
    names = {t["function"]["name"] for t in toolset or ()}
    messages: list[dict] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": "You are a helpful assistant."})
    kind = rng.random()
    if "get_weather" in names and kind < 0.55:
        cities = rng.sample(CITIES, 2 if rng.random() < 0.2 else 1)
        question = (f"What is the weather in {cities[0]} and {cities[1]}?" if len(cities) == 2
                    else _weather_question(rng, cities[0]))
        messages += [{"role": "user", "content": question}, *_weather_turns(rng, effort, cities, learn_call)]
        if rng.random() < 0.3:  # a follow-up that needs the tool again
            city = rng.choice([c for c in CITIES if c not in cities])
            messages.append({"role": "user", "content": rng.choice(("And in {c}?", "What about {c}?")).format(c=city)})
            messages += _weather_turns(rng, effort, [city], True)
    elif "get_time" in names and kind < 0.8:
        city = rng.choice(CITIES)
        messages.append({"role": "user", "content": rng.choice(("What time is it in {c}?",
                                                                 "What is the local time in {c}?")).format(c=city)})
        messages += _time_turns(rng, effort, city, learn_call)
    else:
        messages += _chat_without_tools(rng, effort)
    return Conversation(messages, toolset, effort)


def corpus_text(n: int, seed: int) -> list[str]:
    """Rendered conversations (text between the control tokens), for training the BPE."""
    from vllm_glm53.chat.prompt_format import render_segments

    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        c = conversation(rng)
        lines += [t for t, control in render_segments(c.messages, c.tools, c.effort, False) if not control]
    return lines


# ---------------------------------------------------------------------------------------------------------
# Encoding: token ids and which of them the model learns to produce
# ---------------------------------------------------------------------------------------------------------

_TURN_ENDS = ("<|user|>", "<|observation|>", "<|system|>")


def encode(tokenizer, conv: Conversation) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation plus the stop token after its last turn, and a mask that is
    true on what the assistant generates: every token after an ``<|assistant|><think>`` up to and including
    the role token that ends the turn (``<|observation|>`` after tool calls, ``<|user|>`` after an answer).

    Text is encoded segment by segment like the ``glm5_next`` tokenizer does, so the ids are exactly what
    vLLM feeds the model for the same messages."""
    from vllm_glm53.chat.prompt_format import render_segments

    segments = render_segments(conv.messages, conv.tools, conv.effort, False) + [("<|user|>", True)]
    learned = iter([not m.get(HISTORY_ONLY) for m in conv.messages if m["role"] == "assistant"])
    ids: list[int] = []
    mask: list[bool] = []
    generating = False
    previous = None
    for text, control in segments:
        if control:
            ids.append(tokenizer.token_to_id(text))
            mask.append(generating)
            if text == "<think>" and previous == "<|assistant|>":
                generating = next(learned)
            elif text in _TURN_ENDS:
                generating = False
            previous = text
        else:
            piece = tokenizer.encode(text, add_special_tokens=False).ids
            ids += piece
            mask += [generating] * len(piece)
            previous = None
    return ids, mask


# ---------------------------------------------------------------------------------------------------------
# The MTP layer as a trainable module (transformers has none)
# ---------------------------------------------------------------------------------------------------------

# The shipped checkpoint's BPE merges across words (tokens up to 16 characters): the fixed parts of the format
# (the tools block above all) shrink to a few dozen tokens, so a conversation is ~100 tokens instead of ~240 and
# training takes minutes on a CPU.
BASE_VOCAB_SIZE = 1024
# The recipe of the shipped checkpoint: a first run from the random build, then a second one from its weights with
# fresh data and a lower learning rate (the first run's cosine schedule has ended; copying names and numbers from
# the prompt is the last skill to settle).
SEED = 0
STEPS = 400
PHASES = ({"steps": STEPS, "seed": SEED, "lr": 3e-3}, {"steps": 200, "seed": SEED + 1, "lr": 1e-3, "resume": True})


def tokenizer_options(seed: int = SEED) -> dict:
    """``build_checkpoint`` arguments for the BPE of the trained checkpoint: learned from the seeded corpus."""
    return {"tokenizer_corpus": corpus_text(2000, seed), "base_vocab_size": BASE_VOCAB_SIZE, "cross_word_tokens": True}


def _mtp_module(hf_config):
    """The MTP layer of ``vllm_glm53.model.mtp`` built from transformers' own attention (sparse MLA with its own
    ``full`` indexer) and MoE modules, so that its parameter names are the checkpoint's."""
    import copy

    import torch
    from transformers.models.glm5_next import modeling_glm5_next as hf

    text = copy.deepcopy(hf_config.text_config)
    idx = text.num_hidden_layers
    text.layer_types = list(text.layer_types) + ["indexed_attention"]
    text.indexer_types = list(text.indexer_types) + ["full"]
    text.mlp_layer_types = list(text.mlp_layer_types) + ["sparse"]
    d, eps = text.hidden_size, text.rms_norm_eps

    class MTPLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enorm = hf.Glm5NextTextRMSNorm(d, eps)
            self.hnorm = hf.Glm5NextTextRMSNorm(d, eps)
            self.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
            self.input_layernorm = hf.Glm5NextTextRMSNorm(d, eps)
            self.self_attn = hf.Glm5NextTextAttention(text, layer_idx=idx)
            self.post_attention_layernorm = hf.Glm5NextTextRMSNorm(d, eps)
            self.mlp = hf.Glm5NextTextMoE(text)
            self.shared_head = torch.nn.Module()
            self.shared_head.norm = hf.Glm5NextTextRMSNorm(d, eps)

        def forward(self, e: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
            """``e`` the embedding of token t+1 (zero at position 0), ``h_prev`` the main model's post-norm hidden
            state at t; returns the hidden state whose logits predict token t+2."""
            z = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h_prev)], dim=-1))
            valid = torch.ones(z.shape[:2], dtype=torch.bool)
            a, _, _ = self.self_attn(self.input_layernorm(z), attention_mask=valid)
            r = z + a
            return self.shared_head.norm(r + self.mlp(self.post_attention_layernorm(r)))

    layer = MTPLayer()
    layer.self_attn.config._attn_implementation = hf_config.text_config._attn_implementation
    return layer


def _load_mtp(layer, tensors: dict, prefix: str) -> None:
    """Checkpoint tensors (per-expert layout) into the module (transformers' fused expert tensors)."""
    import torch

    state = {}
    n_experts = layer.mlp.experts.gate_up_proj.shape[0]
    for name in layer.state_dict():
        if name == "mlp.experts.gate_up_proj":
            state[name] = torch.stack([torch.cat([tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"],
                                                  tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"]])
                                       for e in range(n_experts)])
        elif name == "mlp.experts.down_proj":
            state[name] = torch.stack([tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] for e in range(n_experts)])
        else:
            state[name] = tensors[prefix + name]
    layer.load_state_dict(state)


def _mtp_tensors(layer, prefix: str) -> dict:
    """The module's tensors in the checkpoint's per-expert layout."""
    from vllm_glm53.tiny import per_expert_tensors

    return {name: t.contiguous() for name, t in per_expert_tensors(layer.state_dict().items(), prefix).items()}


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------

# transformers' torch KDA runs a Python loop over the rows of each chunk; chunks of 16 instead of 64 compute the
# same recurrence (measured max |logit diff| 5e-6) at a fraction of the cost on CPU.
KDA_CHUNK = 16
MTP_WEIGHT = 0.5


def _batches(tokenizer, rng: random.Random, batch: int, pad_id: int):
    """Endless batches of (ids, mask) padded on the right; conversations of similar length go together."""
    import torch

    while True:
        pool = sorted((encode(tokenizer, conversation(rng)) for _ in range(batch * 8)), key=lambda x: len(x[0]))
        groups = [pool[i:i + batch] for i in range(0, len(pool), batch)]
        rng.shuffle(groups)
        for group in groups:
            width = max(len(ids) for ids, _ in group)
            ids = torch.full((len(group), width), pad_id)
            mask = torch.zeros((len(group), width), dtype=torch.bool)
            for i, (x, m) in enumerate(group):
                ids[i, : len(x)] = torch.tensor(x)
                mask[i, : len(m)] = torch.tensor(m)
            yield ids, mask


def _losses(model, mtp, ids, mask):
    """Main next-token loss and MTP next-next-token loss over the generated positions."""
    import torch.nn.functional as F

    lm = model.model.language_model
    h = lm(input_ids=ids, chunk_size=KDA_CHUNK).last_hidden_state
    logits = model.lm_head(h)
    target, learn = ids[:, 1:], mask[:, 1:]
    main = F.cross_entropy(logits[:, :-1][learn], target[learn])
    # MTP at position t sees h_t and token t+1 (zeroed at position 0, as served) and predicts token t+2. The
    # embedding, the head and h are the main model's, detached: the MTP loss trains the MTP layer only.
    e = F.embedding(ids[:, 1:], lm.embed_tokens.weight.detach())
    e[:, 0] = 0
    hm = mtp(e, h[:, :-1].detach())
    mtp_logits = F.linear(hm[:, :-1], model.lm_head.weight.detach())
    learn2 = mask[:, 2:]
    draft = F.cross_entropy(mtp_logits[learn2], ids[:, 2:][learn2])
    return main, draft


def train(out_dir: str | Path, steps: int = STEPS, seed: int = SEED, batch: int = 16, lr: float = 3e-3,
          log=print, save_every: int = 0, resume: bool = False) -> Path:
    """Build the tiny checkpoint with a corpus-trained tokenizer (or, with ``resume``, start from the weights
    already in ``out_dir``), train it, and write the trained weights over it. Each call has its own optimizer and
    a warm-up then cosine learning rate."""
    import torch
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import Glm5NextForConditionalGeneration

    from vllm_glm53.tiny import build_checkpoint

    out = Path(out_dir)
    torch.manual_seed(seed)
    if not resume:
        build_checkpoint(out, seed=seed, **tokenizer_options(seed))
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    cfg = json.loads((out / "config.json").read_text())
    model = Glm5NextForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    tensors = load_file(str(out / "model.safetensors"))
    prefix = f"model.language_model.layers.{cfg['text_config']['num_hidden_layers']}."
    mtp = _mtp_module(model.config)
    _load_mtp(mtp, tensors, prefix)
    model.train()
    mtp.train()

    params = [p for p in list(model.model.language_model.parameters()) + list(model.lm_head.parameters())
              + list(mtp.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    data = _batches(tokenizer, random.Random(seed + 1), batch, cfg["text_config"]["pad_token_id"])
    start = time.time()
    for step in range(steps):
        ids, mask = next(data)
        main, draft = _losses(model, mtp, ids, mask)
        opt.zero_grad()
        (main + MTP_WEIGHT * draft).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == steps - 1:
            log(f"step {step:4d}  loss {main.item():.4f}  mtp {draft.item():.4f}  tokens {ids.numel():5d}  "
                f"{time.time() - start:6.0f} s")
        if save_every and step and step % save_every == 0:
            _save(model, mtp, out, prefix)
    _save(model, mtp, out, prefix)
    return out


def _save(model, mtp, out: Path, prefix: str) -> None:
    """Write the trained weights in the released layout (transformers' save_pretrained for the main model)."""
    import tempfile

    from safetensors.torch import load_file, save_file

    old = load_file(str(out / "model.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        new = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            new.update(load_file(str(f)))
    new.update(_mtp_tensors(mtp, prefix))
    if set(new) != set(old):
        raise RuntimeError(f"trained tensors differ from the checkpoint's: {sorted(set(new) ^ set(old))[:8]}")
    save_file({k: new[k].to(old[k].dtype).contiguous() for k in old}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def shipped_checkpoint() -> Path:
    """The trained checkpoint that ships in the package."""
    return Path(str(resources.files("vllm_glm53.data").joinpath("tiny_trained")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_glm53.tiny_trained", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, help="one run of this many steps instead of the shipped recipe")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--resume", action="store_true", help="start from the weights already in OUT_DIR")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=0, help="also write the weights every N steps")
    args = parser.parse_args(argv)
    import torch

    # One thread: the ops are tiny, so a thread team only adds barrier waits (10x slower on a busy 2-core
    # machine), and a single thread makes the run bit-reproducible on a given CPU.
    torch.set_num_threads(1)
    phases = PHASES if args.steps is None else (
        {"steps": args.steps, "seed": args.seed, "lr": args.lr, "resume": args.resume},)
    for phase in phases:
        print(f"== training {phase}", flush=True)
        path = train(args.out_dir, batch=args.batch, log=lambda s: print(s, flush=True), save_every=args.save_every,
                     **phase)
    print(f"wrote the trained tiny GLM-5.3 checkpoint to {path}")


if __name__ == "__main__":
    main()
