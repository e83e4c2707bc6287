"""Decode speed with and without MTP speculation, and the measured acceptance, on tiny checkpoints.

    python benchmarks/bench_mtp.py [--tokens 64] [--batch 1 4]

Two checkpoints: a random one (its draft layer is noise, acceptance ~0: the cost of speculating for nothing)
and one whose draft layer is exact by construction (``python -m vllm_glm53.tiny --exact-mtp``: the ceiling).
Each configuration runs in its own process (vLLM on CPU spawns its engine). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def one(model: str, n_spec: int, batch: int, tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    engine = dict(max_model_len=1024, enforce_eager=True, enable_prefix_caching=False, dtype="float32",
                  disable_log_stats=False)
    if n_spec:
        engine["speculative_config"] = {"method": "mtp", "num_speculative_tokens": n_spec}
    llm = LLM(model=model, **engine)
    prompts = [{"prompt_token_ids": [11 + i, 57, 200 + i, 31, 99]} for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))  # warm up
    before = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    start = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    after = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("vllm:spec_decode")}
    drafts = delta.get("vllm:spec_decode_num_drafts", 0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {"tok_s": batch * tokens / elapsed,
            "accept_len": (1 + accepted / drafts) if drafts else 1.0,
            "accept_rate": accepted / max(delta.get("vllm:spec_decode_num_draft_tokens", 0), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--spec", type=int, nargs="+", default=[0, 1, 3])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, n, b = args.one.split(",")
        print("RESULT" + json.dumps(one(model, int(n), int(b), args.tokens)))
        return

    from vllm_glm53.tiny import build_checkpoint, make_exact_mtp

    root = Path(tempfile.mkdtemp(prefix="bench-mtp-"))
    random_ckpt = build_checkpoint(root / "random")
    exact_ckpt = build_checkpoint(root / "exact")
    make_exact_mtp(exact_ckpt)
    rows = []
    for label, ckpt in (("random draft", random_ckpt), ("exact draft", exact_ckpt)):
        for batch in args.batch:
            base = None
            for n in args.spec:
                out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--one",
                                      f"{ckpt},{n},{batch}"], capture_output=True, text=True)
                line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
                if line is None:
                    raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
                r = json.loads(line[len("RESULT"):])
                base = base or r["tok_s"]
                rows.append((label, batch, n, r["tok_s"], r["tok_s"] / base, r["accept_len"], r["accept_rate"]))
    print(f"{'checkpoint':<14} {'batch':>5} {'MTP N':>5} {'tok/s':>8} {'vs N=0':>7} {'accept len':>10} "
          f"{'accept rate':>11}")
    for label, batch, n, tps, ratio, alen, arate in rows:
        print(f"{label:<14} {batch:>5} {n:>5} {tps:>8.1f} {ratio:>6.2f}x {alen:>10.2f} {arate:>11.2f}")


if __name__ == "__main__":
    main()
