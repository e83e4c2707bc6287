"""Run prompts through vLLM + the plugin in a fresh process and write the results as JSON.

    python tests/engine_runner.py SPEC.json OUT.json

SPEC: {"model": path, "prompts": [[ids...], ...], "max_tokens": [n, ...], "engine": {LLM kwargs},
       "ignore_eos": bool, "logprobs": k, "prompt_logprobs": bool, "metrics": bool}
With "metrics", the engine's counters and gauges (vllm:*) are written to OUT.metrics.json.
With "conversation": {"turns": [[ids...], ...], "max_tokens": n, "ignore_eos": bool (optional)}, after the batch the engine also holds a
conversation, one generate call per turn: turn i's prompt is turn i-1's prompt + its reply + turns[i] (turn 0's
prompt is turns[0]). OUT.conversation.json: per turn {"prompt_token_ids", "token_ids", "logprobs",
"prefix_cache_queries", "prefix_cache_hits"} (the engine's prefix-cache counters over that turn).
OUT: one {"token_ids", "logprobs", "prompt_token_ids"} per prompt (prompt ids as the engine saw them), and with
"prompt_logprobs" also "prompt_logprobs": per prompt position after the first, [logprob of the prompt's token
there, the engine's most likely token there].

Multimodal additions (optional):
    "mm_data": one entry per prompt, null or {"image": [IMG.npy, ...], "video": [{"frames": FRAMES.npy,
               "metadata": {...}}, ...]} (uint8 HWC images, uint8 [frames, H, W, 3] videos);
    "rejected": [{"prompt": [ids...], "mm_data": {...}}, ...]: requests submitted one by one after the batch,
                each expected to fail; OUT records each one's error message (null if it was accepted).
"probe": {"function": "module.name", "kwargs": {...}}: after the batch, every worker's model is passed to that
    module-level function (with the keyword arguments; vllm_glm53.testing has model_attributes and
    parameter_bytes) through LLM.apply_model; OUT records its JSON result per worker.
With "rejected" or "probe", OUT is {"outputs": [...], "rejected": [...], "probe": [...]}.
Each engine scenario runs in its own process, which keeps tests independent of each other's engine teardown. A
single-rank engine runs its engine core and worker inside that process (vLLM's in-process engine,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and its ``uni`` executor): the model, the plugin and vLLM's scheduler and
runner are the same code, and the scenario starts in about half the time on 2 cores (two interpreters fewer
importing vLLM). Engines of several ranks (TP, PP, DP) and a spec naming its executor keep vLLM's own process
layout, which the serving tests (``vllm serve``) also exercise as users run it.
"""

import atexit
import functools
import importlib
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _multi_modal_data(entry: dict) -> dict:
    import numpy as np
    from PIL import Image

    data = {}
    if entry.get("image"):
        data["image"] = [Image.fromarray(np.load(path)) for path in entry["image"]]
    if entry.get("video"):
        data["video"] = [(np.load(v["frames"]), v["metadata"]) for v in entry["video"]]
    return data


def _prompt(ids: list[int], mm_entry: dict | None) -> dict:
    prompt = {"prompt_token_ids": ids}
    if mm_entry:
        prompt["multi_modal_data"] = _multi_modal_data(mm_entry)
    return prompt


def _counter(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def _converse(llm, SamplingParams, conversation: dict, logprobs: int) -> list[dict]:
    params = SamplingParams(max_tokens=conversation["max_tokens"], temperature=0.0, logprobs=logprobs,
                            ignore_eos=conversation.get("ignore_eos", False))
    turns, prompt = [], []
    for message in conversation["turns"]:
        prompt = prompt + (turns[-1]["token_ids"] if turns else []) + message
        before = {n: _counter(llm, f"vllm:prefix_cache_{n}") for n in ("queries", "hits")}
        c = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        turns.append({"prompt_token_ids": prompt, "token_ids": list(c.token_ids),
                      "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])],
                      **{f"prefix_cache_{n}": _counter(llm, f"vllm:prefix_cache_{n}") - v for n, v in before.items()}})
    return turns


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    if spec.get("probe"):
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # LLM.apply_model ships a function to workers
    # vLLM's defaults otherwise (prefix caching included): what `LLM(model=CKPT)` gets must start on CPU
    engine = dict(max_model_len=1024, enforce_eager=True, dtype="float32")
    engine.update(spec.get("engine", {}))
    ranks = [engine.get(k, 1) for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")]
    if "distributed_executor_backend" not in engine and ranks == [1, 1, 1]:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        engine["distributed_executor_backend"] = "uni"
    from vllm import LLM, SamplingParams

    if spec.get("metrics") or spec.get("conversation"):
        engine["disable_log_stats"] = False  # LLM() keeps no statistics otherwise
    llm = LLM(model=spec["model"], **engine)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=spec.get("ignore_eos", False),
                       logprobs=spec.get("logprobs", 0), prompt_logprobs=1 if spec.get("prompt_logprobs") else None)
        for n in spec["max_tokens"]
    ]
    mm_data = spec.get("mm_data") or [None] * len(spec["prompts"])
    outs = llm.generate([_prompt(p, m) for p, m in zip(spec["prompts"], mm_data)], params)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])] if c.logprobs else []
        result.append({"token_ids": list(c.token_ids), "logprobs": lps, "prompt_token_ids": list(o.prompt_token_ids)})
        if spec.get("prompt_logprobs"):  # position 0 has none; each later one holds its token and the top-1
            result[-1]["prompt_logprobs"] = [
                [lp[t].logprob, next(k for k, v in lp.items() if v.rank == 1)]
                for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
    if spec.get("conversation"):
        json.dump(_converse(llm, SamplingParams, spec["conversation"], spec.get("logprobs", 0)),
                  open(out_path + ".conversation.json", "w"))
    if spec.get("metrics"):  # counters and gauges by name, next to OUT
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        json.dump(metrics, open(out_path + ".metrics.json", "w"))
    if not {"rejected", "probe"} & set(spec):
        json.dump(result, open(out_path, "w"))
        return
    rejected = []
    for request in spec.get("rejected", []):
        try:
            llm.generate([_prompt(request["prompt"], request.get("mm_data"))], SamplingParams(max_tokens=1))
            rejected.append(None)
        except Exception as e:  # what a client would see as the request's error
            rejected.append(f"{type(e).__name__}: {e}")
    probed = []
    if spec.get("probe"):
        module, name = spec["probe"]["function"].rsplit(".", 1)
        # A module-level function (and a partial of one) pickles by reference into the workers.
        fn = functools.partial(getattr(importlib.import_module(module), name), **spec["probe"].get("kwargs", {}))
        probed = llm.apply_model(fn)
    json.dump({"outputs": result, "rejected": rejected, "probe": probed}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # The results are written. Shut the engine down as a normal exit would (vLLM's exit handlers stop its
    # processes), then leave without the interpreter's own teardown: its garbage collections over vLLM's, torch's
    # and transformers' modules take 3-5 s of every scenario on 2 cores and check nothing.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
