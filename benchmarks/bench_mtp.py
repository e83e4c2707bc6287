"""Decode speed with and without MTP speculation, and the measured acceptance, on tiny checkpoints.

    python benchmarks/bench_mtp.py [--tokens 64] [--batch 1 4] [--spec 0 1 3] [--repeat 3] [--starts 1]

Two checkpoints: a random one (its draft layer is noise, acceptance ~0: the cost of speculating for nothing)
and one whose draft layer is exact by construction (``python -m vllm_glm53.tiny --exact-mtp``: the ceiling).
Each configuration runs in its own process (vLLM on CPU spawns its engine): a warm-up request, then ``--repeat``
timed calls of the batch, greedy, ``ignore_eos``; tokens/s from their median, acceptance from vLLM's counters over
all of them. ``--starts K`` starts every configuration's engine K times, in K rounds over all configurations (so
a slow stretch of the host hits every configuration alike), and reports the median over the starts with their
range: a batch-1 step of these models takes a few milliseconds, and its rate moves between engine starts more
than between calls of one engine. Greedy speculation must generate what plain decoding does: the last column counts
the sequences equal to N=0's (in every start). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import binding  # noqa: E402  (this directory's)

binding.as_recipe()

import allocator  # noqa: E402  (this directory's)

allocator.same_as_engine()  # before torch: the script may start over under the engine's allocator


def one(model: str, n_spec: int, batch: int, tokens: int, repeat: int) -> dict:
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
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    after = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("vllm:spec_decode")}
    drafts = delta.get("vllm:spec_decode_num_drafts", 0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {"tok_s": batch * tokens / statistics.median(times),
            "accept_len": (1 + accepted / drafts) if drafts else 1.0,
            "accept_rate": accepted / max(delta.get("vllm:spec_decode_num_draft_tokens", 0), 1),
            "tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--spec", type=int, nargs="+", default=[0, 1, 3])
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per engine (their median is reported)")
    parser.add_argument("--starts", type=int, default=1, help="engine starts per configuration, in rounds (the "
                        "median over them is reported, with their range)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, n, b = args.one.split(",")
        print("RESULT" + json.dumps(one(model, int(n), int(b), args.tokens, args.repeat)))
        return

    from vllm_glm53.tiny import build_checkpoint, make_exact_mtp

    root = Path(tempfile.mkdtemp(prefix="bench-mtp-"))
    random_ckpt = build_checkpoint(root / "random")
    exact_ckpt = build_checkpoint(root / "exact")
    make_exact_mtp(exact_ckpt)
    configs = [(label, ckpt, batch, n) for label, ckpt in (("random draft", random_ckpt), ("exact draft", exact_ckpt))
               for batch in args.batch for n in args.spec]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for _ in range(args.starts):
        for label, ckpt, batch, n in configs:
            out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--repeat",
                                  str(args.repeat), "--one", f"{ckpt},{n},{batch}"], capture_output=True, text=True)
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
            if line is None:
                raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
            runs[(label, ckpt, batch, n)].append(json.loads(line[len("RESULT"):]))
    rows = []
    for label, ckpt, batch, n in configs:
        mine, base = runs[(label, ckpt, batch, n)], runs[(label, ckpt, batch, args.spec[0])]
        rates = [r["tok_s"] for r in mine]
        # Greedy speculation must not change what is generated: count the sequences equal to N=0's in every start.
        same = sum(all(r["tokens"][i] == base[0]["tokens"][i] for r in mine) for i in range(batch))
        spread = f" ({min(rates):.0f}-{max(rates):.0f})" if args.starts > 1 else ""
        rows.append((label, batch, n, statistics.median(rates), spread,
                     statistics.median(rates) / statistics.median(r["tok_s"] for r in base),
                     statistics.median(r["accept_len"] for r in mine), statistics.median(r["accept_rate"] for r in mine),
                     f"{same} of {batch}"))
    print(f"# MTP speculative decoding, tiny float32 checkpoints, {args.tokens} tokens per request, median of "
          f"{args.repeat} calls per engine, {args.starts} engine start(s) per configuration, "
          f"VLLM_CPU_OMP_THREADS_BIND={os.environ[binding.VAR]}, {allocator.describe()}\n")
    print(f"| checkpoint | batch | MTP N | tok/s | vs N=0 | mean acceptance length | acceptance rate | "
          f"sequences equal to N=0's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, batch, n, tps, spread, ratio, alen, arate, same in rows:
        print(f"| {label} | {batch} | {n} | {tps:.1f}{spread} | {ratio:.2f}x | {alen:.2f} | "
              f"{arate:.2f} | {same} |")


if __name__ == "__main__":
    main()
