"""Run prompts through vLLM + the plugin in a fresh process and write the results as JSON.

    python tests/engine_runner.py SPEC.json OUT.json

SPEC: {"model": path, "prompts": [[ids...], ...], "max_tokens": [n, ...], "engine": {LLM kwargs},
       "ignore_eos": bool, "logprobs": k, "prompt_logprobs": bool, "metrics": bool}
With "metrics", the engine's counters and gauges (vllm:*) are written to OUT.metrics.json.
OUT: one {"token_ids", "logprobs", "prompt_token_ids"} per prompt (prompt ids as the engine saw them), and with
"prompt_logprobs" also "prompt_logprobs": per prompt position after the first, [logprob of the prompt's token
there, the engine's most likely token there].

Multimodal additions (optional):
    "mm_data": one entry per prompt, null or {"image": [IMG.npy, ...], "video": [{"frames": FRAMES.npy,
               "metadata": {...}}, ...]} (uint8 HWC images, uint8 [frames, H, W, 3] videos);
    "rejected": [{"prompt": [ids...], "mm_data": {...}}, ...]: requests submitted one by one after the batch,
                each expected to fail; OUT records each one's error message (null if it was accepted);
    "model_attrs": [name, ...]: OUT records, per worker, the class name of each of the model's attributes
                   ("NoneType" for one set to None).
    "param_bytes": true: OUT records, per worker, vllm_glm53.testing.parameter_bytes of its model.
With "rejected", "model_attrs" or "param_bytes", OUT is {"outputs": [...], "rejected": [...], "model_attrs": [...],
"param_bytes": [...]}.
Each engine scenario runs in its own process: vLLM on CPU spawns its engine core and workers, and a fresh
process per scenario keeps tests independent of each other's engine teardown.
"""

import json
import operator
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


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    if spec.get("model_attrs") or spec.get("param_bytes"):
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # LLM.apply_model ships a function to workers
    from vllm import LLM, SamplingParams

    # vLLM's defaults otherwise (prefix caching included): what `LLM(model=CKPT)` gets must start on CPU
    engine = dict(max_model_len=1024, enforce_eager=True, dtype="float32")
    engine.update(spec.get("engine", {}))
    if spec.get("metrics"):
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
    if spec.get("metrics"):  # counters and gauges by name, next to OUT
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        json.dump(metrics, open(out_path + ".metrics.json", "w"))
    if not any(k in spec for k in ("rejected", "model_attrs", "param_bytes")):
        json.dump(result, open(out_path, "w"))
        return
    rejected = []
    for request in spec.get("rejected", []):
        try:
            llm.generate([_prompt(request["prompt"], request.get("mm_data"))], SamplingParams(max_tokens=1))
            rejected.append(None)
        except Exception as e:  # what a client would see as the request's error
            rejected.append(f"{type(e).__name__}: {e}")
    attrs = []
    if spec.get("model_attrs"):
        names = spec["model_attrs"]
        # An attrgetter pickles by value into the workers, where a local function would not.
        probe = operator.attrgetter(*(f"{n}.__class__.__name__" for n in names))
        per_worker = llm.apply_model(probe)
        attrs = [dict(zip(names, (v,) if len(names) == 1 else v)) for v in per_worker]
    sizes = []
    if spec.get("param_bytes"):
        from vllm_glm53.testing import parameter_bytes

        sizes = llm.apply_model(parameter_bytes)
    json.dump({"outputs": result, "rejected": rejected, "model_attrs": attrs, "param_bytes": sizes},
              open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
