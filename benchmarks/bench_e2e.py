"""End to end: the plugin on vLLM's CPU engine vs transformers ``generate``, same checkpoint, same machine.

    .venv/bin/python benchmarks/bench_e2e.py [--model DIR] [--dtype float32|bfloat16] [--batches 1 16 64]
                                             [--prompt-len 128 1024] [--n1 4] [--n2 68] [--repeat 3]
    .venv/bin/python benchmarks/bench_e2e.py --bind-sweep [--tp 1]   # the plugin alone under each thread binding

The checkpoint (built unless ``--model`` is given) is the tiny one with the real per-head geometry
(``vllm_glm53.tiny.kernel_friendly_overrides()``: KDA heads of 128, latent 512, q/k/v heads of 256, indexer
heads of 128, index_topk 64 in pools of 4) and the release's 32 indexer heads (``INDEXER_HEADS``), loaded in
``--dtype`` on both sides, greedy. Measured at each prompt length (batches whose prompts exceed
``--max-batch-tokens`` in all are skipped), each the median of ``--repeat`` runs:

* decode tokens/s at each batch size: B different prompts of equal length generate n1 and then n2 tokens; the
  difference of the two wall times covers exactly B x (n2 - n1) decode tokens, without prefill or start-up. The
  64 decode steps of the defaults keep the prefill's run-to-run spread small against them: with 16 steps (n2 20,
  the default until 2026-12-02) a 16 x 128-token prefill varying by 100 ms on a 17 ms decode step read as 2,203
  and 7,207 tok/s in two runs of the same build, against 860-1,020 from 64 and 128 steps;
* prefill tokens/s: B prompts, one new token each, prompt tokens / wall time (largest batch of ``--batches``
  that is at most 16);
* time to first token: one prompt, one new token, wall time of the call.

Both sides get the same settings: the same prompts, lengths, n1 / n2 and repeats, each in its own child process
on the same cores. vLLM binds its worker's threads with ``VLLM_CPU_OMP_THREADS_BIND`` (default: the CPU recipe's,
each rank its own share of the cores but the last, which the engine core gets, see benchmarks/README.md);
transformers' one process is pinned to all of them with one thread per core (``sched_setaffinity``; ``OMP_PLACES``),
since vLLM's processes together use them all. Stop tokens are masked on both sides (vLLM ``min_tokens``,
transformers ``min_new_tokens``), so every call generates exactly its token count and the outputs are comparable:
the script compares every generated token of the two sides and, in float32, fails where the two differ and
transformers in float64 prefers transformers' token by 1e-3 nats or more (within that, a near-tie float32
rounding breaks either way; a float64 preference for the plugin's token is transformers' own float32 departure;
both reported with their gaps, see ``compare_tokens``). In bfloat16 the two
round differently and choices part early: it reports how many sequences agree and, where each pair first parts,
how far each side's token lies below the best one of transformers in float64. transformers 5.19 has no
text-only GLM-5.3 class: it runs ``Glm5NextForConditionalGeneration``, which on text input runs the embedding and
the language model only; the vLLM side serves the same checkpoint with ``limit_mm_per_prompt`` 0 (no vision tower
built).

``VLLM_GLM53_CPU_KERNELS=0`` runs the plugin on its plain-torch backends, ``VLLM_GLM53_CPU_ISA=avx2`` (or
``portable``) on another instruction set's kernels; ``--as-avx2-cpu`` runs both sides as an AVX2-only CPU would
(``benchmarks/avx2_only.py``: torch and oneDNN held to AVX2 as well). ``--bind-sweep`` runs only the plugin, once per
``VLLM_CPU_OMP_THREADS_BIND`` setting (TP=1: nobind, auto, all CPUs, one CPU; TP=2: one half per rank, nobind,
auto) and prints one table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import avx2_only  # this directory's (--as-avx2-cpu)
import allocator  # this directory's
import binding  # this directory's

allocator.same_as_engine()  # first: the script may start over under the engine's allocator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: room for 64 sequences; also skips vLLM's 92% RAM claim


def prompts(model: Path, n: int, length: int) -> list[list[int]]:
    """``n`` different prompts of ``length`` tokens cut from the shipped corpus (no special tokens)."""
    from importlib import resources

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text = resources.files("vllm_glm53.data").joinpath("tiny_corpus.txt").read_text()
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < length + 97 * n:
        ids = ids + ids
    return [ids[97 * i : 97 * i + length] for i in range(n)]


def median_of(repeat: int, fn) -> tuple[float, list]:
    """Median wall time of ``repeat`` calls of ``fn() -> (seconds, tokens)``, and the tokens of the last call."""
    runs = [fn() for _ in range(repeat)]
    return statistics.median(t for t, _ in runs), runs[-1][1]


def measure(generate, batches: list[int], plist: list[list[int]], n1: int, n2: int, repeat: int) -> dict:
    """``generate(prompts, max_tokens) -> (seconds, generated token ids per prompt)`` for one engine and one
    prompt length; the three metrics and the tokens of the longer decode run of each batch."""
    out: dict = {"decode": {}, "tokens": {}}
    for B in batches:
        batch = plist[:B]
        t1, _ = median_of(repeat, lambda: generate(batch, n1))
        t2, out["tokens"][str(B)] = median_of(repeat, lambda: generate(batch, n2))
        # Noise larger than the extra decode steps (an oversubscribed run) leaves no measurement: NaN.
        out["decode"][str(B)] = B * (n2 - n1) / (t2 - t1) if t2 > t1 else float("nan")
        print(f"  {len(plist[0])}-token prompts, batch {B}: {n1} tokens {t1:.2f} s, {n2} tokens {t2:.2f} s",
              file=sys.stderr, flush=True)
    pb = max(b for b in batches if b <= 16)
    out["prefill_batch"] = pb
    out["prefill"] = pb * len(plist[0]) / median_of(repeat, lambda: generate(plist[:pb], 1))[0]
    out["ttft"] = median_of(repeat, lambda: generate(plist[:1], 1))[0]
    return out


def batches_for(args, length: int) -> list[int]:
    """The batch sizes measured at one prompt length: those within ``--max-batch-tokens`` (always batch 1)."""
    return [B for B in args.batches if B == 1 or B * length <= args.max_batch_tokens]


def measure_all(generate, args, plists: dict[int, list[list[int]]]) -> dict:
    generate(plists[min(plists)][:2], 2)  # warm-up: first-call initialisation on both sides
    return {str(n): measure(generate, batches_for(args, n), plist, args.n1, args.n2, args.repeat)
            for n, plist in plists.items()}


def run_vllm(args, plists) -> dict:
    from vllm import LLM, SamplingParams

    longest = max(plists) + args.n2
    llm = LLM(model=str(args.model), dtype=args.dtype, enforce_eager=True, enable_prefix_caching=False,
              tensor_parallel_size=args.tp, max_model_len=max(512, longest), max_num_seqs=max(args.batches),
              max_num_batched_tokens=max(2048, 16 * longest), limit_mm_per_prompt={"image": 0, "video": 0})

    def generate(batch, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    result = measure_all(generate, args, plists)
    del llm, generate  # let the engine shut its processes down before this one exits
    gc.collect()
    return result


def run_transformers(args, plists) -> dict:
    import torch
    from transformers import Glm5NextForConditionalGeneration

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    dtype = getattr(torch, args.dtype)
    model = Glm5NextForConditionalGeneration.from_pretrained(str(args.model), dtype=dtype).eval()

    def generate(batch, max_tokens):
        ids = torch.tensor(batch)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False)
        return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()

    return measure_all(generate, args, plists)


def child(args, side: str, tp: int, bind: str | None) -> dict:
    """One side's measurement in a fresh process: ``vllm`` under thread binding ``bind`` (None: vLLM's default),
    ``transformers`` pinned to all the cores this process may use (vLLM's processes share them: the worker's bound
    cores and the one the recipe leaves to the engine core), one OpenMP thread per core."""
    cmd = [sys.executable, __file__, "--child", side, "--model", str(args.model), "--dtype", args.dtype,
           "--batches", *map(str, args.batches), "--prompt-len", *map(str, args.prompt_len), "--max-batch-tokens",
           str(args.max_batch_tokens), "--n1", str(args.n1), "--n2", str(args.n2), "--repeat", str(args.repeat),
           "--tp", str(tp)]
    env = dict(os.environ)
    if side == "vllm":
        if bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        preexec = None
    else:
        cores = sorted(os.sched_getaffinity(0))
        env.update(OMP_NUM_THREADS=str(len(cores)), OMP_PROC_BIND="true",
                   OMP_PLACES=",".join(f"{{{c}}}" for c in cores))

        def preexec():
            os.sched_setaffinity(0, cores)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=preexec)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The released model's 32 indexer heads instead of the kernel-friendly tiny's 4: a pool's score is the weighted sum
# of its heads' ReLU'd dot products, so with 4 random heads one pool in 16 scores exactly 0, and in about a third of
# the queries past index_topk the last selected pool ties at 0 with the first left out (measured: 65-68 of 163-195
# queries of three 128-token prompts). The exact model leaves such a choice open, the two sides' top-k break the
# tie differently, and the outputs part by up to 0.1 nats: a token comparison would test tie-breaking, not the
# model. With 32 heads an exact tie is as likely as 32 random signs agreeing.
INDEXER_HEADS = {"index_n_heads": 32}
NEAR_TIE = 1e-3  # nats: float64 log-probability gap under which two tokens are a tie float32 may break either way


def compare_tokens(ours: dict, ref: dict, dtype: str, plists: dict, model: Path) -> tuple[str, bool]:
    """Every generated token of the two sides, per prompt length and batch: (summary, whether it is a failure).
    In float32 each difference is judged at its first differing token by transformers in float64 (on the prompt and
    the tokens both sides agree on): it fails the run only where the float64 model prefers transformers' token to
    the plugin's by ``NEAR_TIE`` or more. Within ``NEAR_TIE`` either way it is a near-tie float32 rounding breaks
    either way; a float64 preference for the plugin's token by more is transformers' own float32 departure (its
    cached decode drifts from its full forward; seen at 50-70 generated tokens). Stop tokens need no masking
    here: both sides masked them, so neither differing token is one."""
    same = total = 0
    diffs = []
    for n in ours:
        for B, seqs in ours[n]["tokens"].items():
            theirs = ref[n]["tokens"][B]
            assert len(seqs) == len(theirs), f"{n}-token prompts, batch {B}: {len(seqs)} vs {len(theirs)} outputs"
            for i, (a, b) in enumerate(zip(seqs, theirs)):
                assert len(a) == len(b), f"{n}-token prompts, batch {B}, sequence {i}: {len(a)} vs {len(b)} tokens"
                total += 1
                if a == b:
                    same += 1
                    continue
                at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                diffs.append((f"{n}-token prompts, batch {B}, sequence {i}, token {at}: {a[at]} vs {b[at]}",
                              plists[int(n)][i] + a[:at], a[at], b[at]))
    summary = f"{same} of {total} generated sequences identical"
    if not diffs:
        return summary, False
    gaps = float64_gaps(model, [(context, x, y) for _, context, x, y in diffs])
    if dtype != "float32":
        # The two sides round differently from the first layer on, so on this model's flat logits their greedy
        # choices part; what is comparable is how good each side's choice is where they part.
        ours_gap, theirs_gap = ([g[i] for g in gaps] for i in (0, 1))
        return (f"{summary}; where they first part ({len(gaps)}), the token chosen lies below transformers-float64's "
                f"best by (median / max nats) {statistics.median(ours_gap):.1e} / {max(ours_gap):.1e} for the plugin, "
                f"{statistics.median(theirs_gap):.1e} / {max(theirs_gap):.1e} for transformers"), False
    margins = [gx - gy for gx, gy in gaps]  # log p(y) - log p(x): how much the exact model prefers transformers'
    ties = [f"{where} (float64 gap {abs(m):.1e} nats)" for (where, *_), m in zip(diffs, margins) if abs(m) < NEAR_TIE]
    theirs_off = [f"{where} (float64 prefers the plugin's by {-m:.1e} nats)"
                  for (where, *_), m in zip(diffs, margins) if m <= -NEAR_TIE]
    real = [f"{where} (float64 prefers transformers' by {m:.1e} nats)"
            for (where, *_), m in zip(diffs, margins) if m >= NEAR_TIE]
    summary += (f"; near-ties: {'; '.join(ties)}" if ties else "")
    summary += (f"; transformers off: {'; '.join(theirs_off)}" if theirs_off else "")
    summary += (f"; DIFFERENT: {'; '.join(real)}" if real else "")
    return summary, bool(real)


def float64_gaps(model: Path, cases: list[tuple[list[int], int, int]]) -> list[tuple[float, float]]:
    """For the next token after each context (x the plugin's, y transformers'), how far each lies below the exact
    model's best token: (max log p - log p(x), max log p - log p(y)), transformers in float64."""
    import torch
    from transformers import Glm5NextForConditionalGeneration

    # float64 needs the eager expert loop (torch's grouped GEMM takes no float64)
    hf = Glm5NextForConditionalGeneration.from_pretrained(str(model), dtype=torch.float64,
                                                          experts_implementation="eager").eval()
    gaps = []
    with torch.no_grad():
        for context, x, y in cases:
            lp = torch.log_softmax(hf(torch.tensor([context])).logits[0, -1], -1)
            gaps.append(((lp.max() - lp[x]).item(), (lp.max() - lp[y]).item()))
    return gaps


def bind_sweep(args, tp: int | None) -> None:
    """The plugin alone under each thread binding (only those of tensor-parallel size ``tp`` when given)."""
    n = os.cpu_count()
    half = n // 2
    split = f"0-{half - 1}|{half}-{n - 1}" if half > 1 else "0|1"
    settings = [(1, "nobind"), (1, "auto"), (1, f"0-{n - 1}"), (1, "0"), (2, split), (2, "nobind"), (2, "auto")]
    settings = [s for s in settings if tp is None or s[0] == tp]
    print(f"# Thread binding sweep, kernel-friendly tiny checkpoint, {args.dtype}, {n} CPUs, "
          f"{allocator.describe()} (plugin on vLLM only)\n")
    head = [f"decode b{B} tok/s" for B in args.batches]
    print("| TP | VLLM_CPU_OMP_THREADS_BIND | " + " | ".join(head) + " | prefill tok/s | TTFT ms |")
    print("| --- | --- | " + " | ".join("---" for _ in head) + " | --- | --- |")
    for tp, bind in settings:
        try:
            r = child(args, "vllm", tp, bind)
        except RuntimeError as exc:  # e.g. `auto` with more ranks than NUMA nodes refuses to start
            reason = next((line for line in str(exc).splitlines() if "Error: " in line), "Error: see its log")
            print(f"| {tp} | `{bind}` | does not start: {reason.split('Error: ', 1)[1][:120]} |", flush=True)
            continue
        r = r[str(args.prompt_len[0])]
        cells = [f"{r['decode'][str(B)]:,.0f}" if str(B) in r["decode"] else "—" for B in args.batches]
        print(f"| {tp} | `{bind}` | " + " | ".join(cells) + f" | {r['prefill']:,.0f} | {r['ttft'] * 1e3:,.0f} |",
              flush=True)


def table(ours: dict, ref: dict, args) -> str:
    """One row per metric, per prompt length: plugin, transformers, and the plugin's advantage."""
    head, rule = ["metric"], ["---"]
    for n in args.prompt_len:
        head += [f"{n}-token prompts: plugin", "transformers", "ratio"]
        rule += ["---:"] * 3
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(rule) + " |"]

    def row(name: str, get, unit: str, higher_better: bool = True) -> str:
        cells = [name]
        for n in args.prompt_len:
            a, b = get(ours[str(n)]), get(ref[str(n)])
            if a is None or b is None:
                cells += ["", "", ""]
                continue
            if math.isnan(a) or math.isnan(b):  # see measure(): no decode rate left after the prefill's spread
                unmeasured.append(f"{name}, {n}-token prompts")
                cells += [f"{v:,.0f} {unit}" if not math.isnan(v) else "—" for v in (a, b)] + ["—"]
                continue
            ratio = a / b if higher_better else b / a
            cells += [f"{a:,.0f} {unit}", f"{b:,.0f} {unit}", f"{ratio:.1f}x"]
        return "| " + " | ".join(cells) + " |"

    unmeasured: list[str] = []

    for B in args.batches:
        lines.append(row(f"decode, batch {B}", lambda r: r["decode"].get(str(B)), "tok/s"))
    lines.append(row("prefill (batch of up to 16)", lambda r: r["prefill"], "tok/s"))
    lines.append(row("time to first token (1 prompt)", lambda r: r["ttft"] * 1e3, "ms", higher_better=False))
    if unmeasured:
        lines.append(f"\n—: not measured ({'; '.join(unmeasured)}): the {args.n2}-token call did not take longer than "
                     f"the {args.n1}-token one by more than the prefill's run-to-run spread; a larger --n2 measures it")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: build the kernel-friendly tiny one)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype both sides load the checkpoint in")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--max-batch-tokens", type=int, default=16384,
                        help="skip batches whose prompts exceed this many tokens in all (batch 1 always runs)")
    parser.add_argument("--n1", type=int, default=4, help="short generation (tokens)")
    parser.add_argument("--n2", type=int, default=68, help="long generation (tokens)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (the median is reported)")
    parser.add_argument("--tp", type=int, help="tensor parallel size of the vLLM run (default 1; with --bind-sweep: "
                        "only that size's settings)")
    parser.add_argument("--bind-sweep", action="store_true", help="plugin only, under each thread binding")
    parser.add_argument(avx2_only.FLAG, action="store_true", help=avx2_only.HELP)
    parser.add_argument("--child", choices=["vllm", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    sweep_tp, args.tp = args.tp, args.tp or 1
    if args.as_avx2_cpu:
        avx2_only.apply()  # before anything here imports torch; both sides' processes inherit it

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from vllm_glm53.tiny import build_checkpoint, kernel_friendly_overrides

            args.model = build_checkpoint(Path(tmp) / "kernel-friendly",
                                          overrides={**kernel_friendly_overrides(), **INDEXER_HEADS})
        plists = {n: prompts(args.model, max(batches_for(args, n)), n) for n in args.prompt_len}
        if args.child:
            run = run_vllm if args.child == "vllm" else run_transformers
            print(json.dumps(run(args, plists)), flush=True)
            return
        if args.bind_sweep:
            return bind_sweep(args, sweep_tp)
        bind = binding.as_recipe(args.tp)
        try:
            ours = child(args, "vllm", args.tp, bind)
            ref = child(args, "transformers", args.tp, bind)
        except RuntimeError as exc:
            sys.exit(f"a benchmark process failed:\n{str(exc)[-6000:]}")
        agreement, mismatch = compare_tokens(ours, ref, args.dtype, plists, args.model)

    from vllm_glm53.backends.cpu import kernels

    print(f"# End to end, kernel-friendly tiny checkpoint, {args.dtype}, {os.cpu_count()} CPUs"
          f"{avx2_only.describe() if args.as_avx2_cpu else ''}, "
          f"VLLM_CPU_OMP_THREADS_BIND={bind} (transformers pinned to cores {sorted(os.sched_getaffinity(0))}), "
          f"n1 {args.n1}, n2 {args.n2}, median of {args.repeat}, {allocator.describe()} on both sides; "
          f"plugin backends: {kernels.description()}; {agreement}\n")
    print(table(ours, ref, args))
    if mismatch:  # after the table, so a long run's numbers are not lost
        sys.exit(f"float32: the plugin and transformers generated different tokens beyond near-ties: {agreement}")


if __name__ == "__main__":
    main()
