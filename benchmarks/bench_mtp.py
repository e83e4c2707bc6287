"""Decode speed with and without MTP speculation, and the measured acceptance, on tiny checkpoints.

    python benchmarks/bench_mtp.py [--tokens 64] [--batch 1 4] [--spec 0 1 3] [--repeat 3] [--starts 1]
    python benchmarks/bench_mtp.py --batch 1 --spec 3 --paired 60

Two checkpoints: a random one (its draft layer is noise, acceptance ~0: the cost of speculating for nothing)
and one whose draft layer is exact by construction (``python -m vllm_glm53.tiny --exact-mtp``: the ceiling).
Each configuration runs in its own process (vLLM on CPU spawns its engine): a warm-up request, then ``--repeat``
timed calls of the batch, greedy, ``ignore_eos``; tokens/s from their median, acceptance from vLLM's counters over
all of them. ``--starts K`` starts every configuration's engine K times, in K rounds over all configurations (so
a slow stretch of the host hits every configuration alike), and reports the median over the starts with their
range: a batch-1 step of these models takes a few milliseconds, and its rate moves between engine starts more
than between calls of one engine. Greedy speculation must generate what plain decoding does: the last column counts
the sequences equal to N=0's (in every start). Prints one table.

``--paired ROUNDS`` measures the ratio itself: for each N > 0 one process holds an N = 0 and an N engine (an idle
engine core waits on its queue), calls them in turn for ROUNDS rounds, which one first alternating, and reports
the median of the rounds' ratios with their quartiles (and each side's median rate). Engine starts differ
by up to 1.5x in rate on the shared VMs this is run on and a slow stretch can cover one configuration's starts
and not the other's, so the per-start medians' ratio moved by 10 % between series; two calls seconds apart see the
same host.
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


def _engine(model: str, n_spec: int):
    from vllm import LLM

    engine = dict(max_model_len=1024, enforce_eager=True, enable_prefix_caching=False, dtype="float32",
                  disable_log_stats=False)
    if n_spec:
        engine["speculative_config"] = {"method": "mtp", "num_speculative_tokens": n_spec}
    return LLM(model=model, **engine)


def _workload(batch: int, tokens: int):
    """The prompts, the timed calls' sampling and the warm-up call's."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [11 + i, 57, 200 + i, 31, 99]} for i in range(batch)]
    return (prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=4, temperature=0.0))


def _spec_counters(llm) -> dict:
    return {m.name: getattr(m, "value", 0) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


def _acceptance(before: dict, after: dict) -> dict:
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafts = delta.get("vllm:spec_decode_num_drafts", 0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {"accept_len": (1 + accepted / drafts) if drafts else 1.0,
            "accept_rate": accepted / max(delta.get("vllm:spec_decode_num_draft_tokens", 0), 1)}


def _timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def one(model: str, n_spec: int, batch: int, tokens: int, repeat: int) -> dict:
    llm = _engine(model, n_spec)
    prompts, params, warm_up = _workload(batch, tokens)
    llm.generate(prompts, warm_up, use_tqdm=False)
    before = _spec_counters(llm)
    times = []
    for _ in range(repeat):
        seconds, generated = _timed(llm, prompts, params)
        times.append(seconds)
    return {"tok_s": batch * tokens / statistics.median(times), **_acceptance(before, _spec_counters(llm)),
            "tokens": generated}


def paired(model: str, n_spec: int, batch: int, tokens: int, rounds: int) -> dict:
    """Engines for N = 0 and N = ``n_spec`` in this one process (their engine cores idle while the other one
    runs), called in turn for ``rounds`` rounds, which of the two goes first alternating: each round's ratio
    compares two calls made seconds apart, so the host's slow and fast stretches hit both sides of it."""
    plain, spec = _engine(model, 0), _engine(model, n_spec)
    prompts, params, warm_up = _workload(batch, tokens)
    for llm in (plain, spec):
        llm.generate(prompts, warm_up, use_tqdm=False)
    before = _spec_counters(spec)  # the only speculating engine here: vLLM's counters are its own
    times = {0: [], n_spec: []}
    generated = {}
    for i in range(rounds):
        for n in (0, n_spec) if i % 2 == 0 else (n_spec, 0):
            seconds, generated[n] = _timed(spec if n else plain, prompts, params)
            times[n].append(seconds)
    ratios = [t0 / tn for t0, tn in zip(times[0], times[n_spec])]
    return {"base_tok_s": batch * tokens / statistics.median(times[0]),
            "tok_s": batch * tokens / statistics.median(times[n_spec]), "ratios": ratios,
            **_acceptance(before, _spec_counters(spec)), "base_tokens": generated[0], "tokens": generated[n_spec]}


def _run(args, *flags) -> dict:
    out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), *flags], capture_output=True,
                         text=True)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
    if line is None:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    return json.loads(line[len("RESULT"):])


def main_paired(args, checkpoints) -> None:
    rows = []
    for label, ckpt in checkpoints:
        for batch in args.batch:
            for n in (n for n in args.spec if n):
                r = _run(args, "--paired", str(args.paired), "--one", f"{ckpt},{n},{batch}")
                q1, med, q3 = statistics.quantiles(r["ratios"], n=4)
                same = sum(a == b for a, b in zip(r["tokens"], r["base_tokens"]))
                rows.append((label, batch, n, r["base_tok_s"], r["tok_s"], med, q1, q3, r["accept_len"],
                             r["accept_rate"], f"{same} of {batch}"))
    print(f"# MTP speculative decoding, paired: N = 0 and N in one process, {args.paired} rounds of one call each "
          f"(alternating which goes first), tiny float32 checkpoints, {args.tokens} tokens per request, "
          f"VLLM_CPU_OMP_THREADS_BIND={os.environ[binding.VAR]}, {allocator.describe()}\n")
    print("| checkpoint | batch | MTP N | tok/s N=0 / N (medians) | vs N=0: median of the rounds' ratios "
          "(quartiles) | mean acceptance length | acceptance rate | sequences equal to N=0's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, batch, n, base, tps, med, q1, q3, alen, arate, same in rows:
        print(f"| {label} | {batch} | {n} | {base:.1f} / {tps:.1f} | {med:.2f}x ({q1:.2f}-{q3:.2f}) | {alen:.2f} | "
              f"{arate:.2f} | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--spec", type=int, nargs="+", default=[0, 1, 3])
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per engine (their median is reported)")
    parser.add_argument("--starts", type=int, default=1, help="engine starts per configuration, in rounds (the "
                        "median over them is reported, with their range)")
    parser.add_argument("--paired", type=int, metavar="ROUNDS", help="each N > 0 against N = 0 in one process, "
                        "their calls alternated for ROUNDS rounds; reports the median of the rounds' ratios")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, n, b = args.one.split(",")
        result = (paired(model, int(n), int(b), args.tokens, args.paired) if args.paired
                  else one(model, int(n), int(b), args.tokens, args.repeat))
        print("RESULT" + json.dumps(result))
        return

    from vllm_glm53.tiny import build_checkpoint, make_exact_mtp

    root = Path(tempfile.mkdtemp(prefix="bench-mtp-"))
    random_ckpt = build_checkpoint(root / "random")
    exact_ckpt = build_checkpoint(root / "exact")
    make_exact_mtp(exact_ckpt)
    checkpoints = (("random draft", random_ckpt), ("exact draft", exact_ckpt))
    if args.paired:
        main_paired(args, checkpoints)
        return
    configs = [(label, ckpt, batch, n) for label, ckpt in checkpoints for batch in args.batch for n in args.spec]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for _ in range(args.starts):
        for label, ckpt, batch, n in configs:
            runs[(label, ckpt, batch, n)].append(
                _run(args, "--repeat", str(args.repeat), "--one", f"{ckpt},{n},{batch}"))
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
