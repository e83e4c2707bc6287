"""Run prompts through vLLM + the plugin in a fresh process and write the results as JSON.

    python tests/engine_runner.py SPEC.json OUT.json

SPEC: {"model": path, "prompts": [[ids...], ...], "max_tokens": [n, ...], "engine": {LLM kwargs},
       "ignore_eos": bool, "logprobs": k}
Each engine scenario runs in its own process: vLLM on CPU spawns its engine core and workers, and a fresh
process per scenario keeps tests independent of each other's engine teardown.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    spec = json.load(open(spec_path))
    engine = dict(max_model_len=1024, enforce_eager=True, enable_prefix_caching=False, dtype="float32")
    engine.update(spec.get("engine", {}))
    llm = LLM(model=spec["model"], **engine)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=spec.get("ignore_eos", False),
                       logprobs=spec.get("logprobs", 0))
        for n in spec["max_tokens"]
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])] if c.logprobs else []
        result.append({"token_ids": list(c.token_ids), "logprobs": lps})
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
