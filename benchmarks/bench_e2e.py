"""End to end: the plugin on vLLM's CPU engine vs transformers ``generate``, same checkpoint, same machine.

    .venv/bin/python benchmarks/bench_e2e.py [--model DIR] [--batches 1 16 64] [--prompt-len 128] [--repeat 3]
    .venv/bin/python benchmarks/bench_e2e.py --bind-sweep   # the plugin alone under each thread binding

The checkpoint (built unless ``--model`` is given) is the tiny one with the real per-head geometry
(``vllm_glm53.tiny.kernel_friendly_overrides()``: KDA heads of 128, latent 512, q/k/v heads of 256, indexer
heads of 128, index_topk 64 in pools of 4), float32 on both sides, greedy. Measured, each the median of ``--repeat`` runs:

* decode tokens/s at each batch size: B equal-length prompts generate N1 and then N2 tokens (EOS ignored); the
  difference of the two wall times covers exactly B x (N2 - N1) decode tokens, without prefill or start-up;
* prefill tokens/s: B prompts, one new token each, prompt tokens / wall time (largest batch of ``--batches``
  that is at most 16);
* time to first token: one prompt, one new token, wall time of the call.

vLLM runs in a child process (its engine spawns its own processes and binds their threads; see
``VLLM_CPU_OMP_THREADS_BIND`` in benchmarks/README.md), transformers in this one with ``torch.set_num_threads``
= the CPU count. ``VLLM_GLM53_CPU_KERNELS=0`` runs the plugin on its plain-torch backends instead of the
compiled kernels. ``--bind-sweep`` runs only the plugin, once per ``VLLM_CPU_OMP_THREADS_BIND`` setting
(TP=1: nobind, auto, all CPUs, one CPU; TP=2: one half per rank, nobind, auto) and prints one table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def median_of(repeat: int, fn) -> float:
    return statistics.median(fn() for _ in range(repeat))


def measure(generate, batches: list[int], plist: list[list[int]], n1: int, n2: int, repeat: int) -> dict:
    """``generate(prompts, max_tokens) -> seconds`` for one engine; returns the three metrics."""
    generate(plist[:2], 2)  # warm-up: first-call initialisation on both sides
    out: dict = {"decode": {}}
    for B in batches:
        batch = plist[:B]
        t1 = median_of(repeat, lambda: generate(batch, n1))
        t2 = median_of(repeat, lambda: generate(batch, n2))
        # Noise larger than the extra decode steps (an oversubscribed run) leaves no measurement: NaN.
        out["decode"][str(B)] = B * (n2 - n1) / (t2 - t1) if t2 > t1 else float("nan")
        print(f"  batch {B}: {n1} tokens {t1:.2f} s, {n2} tokens {t2:.2f} s", file=sys.stderr, flush=True)
    pb = max(b for b in batches if b <= 16)
    out["prefill_batch"] = pb
    out["prefill"] = pb * len(plist[0]) / median_of(repeat, lambda: generate(plist[:pb], 1))
    out["ttft"] = median_of(repeat, lambda: generate(plist[:1], 1))
    return out


def run_vllm(args, plist) -> dict:
    from vllm import LLM, SamplingParams

    longest = len(plist[0]) + args.n2
    llm = LLM(model=str(args.model), dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              tensor_parallel_size=args.tp, max_model_len=max(512, longest), max_num_seqs=max(args.batches),
              max_num_batched_tokens=max(2048, 16 * longest), limit_mm_per_prompt={"image": 0, "video": 0})

    def generate(batch, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return time.perf_counter() - t0

    result = measure(generate, args.batches, plist, args.n1, args.n2, args.repeat)
    del llm, generate  # let the engine shut its processes down before this one exits
    gc.collect()
    return result


def run_transformers(args, plist) -> dict:
    import torch
    from transformers import Glm5NextForConditionalGeneration

    torch.set_num_threads(os.cpu_count())
    model = Glm5NextForConditionalGeneration.from_pretrained(str(args.model), dtype=torch.float32).eval()

    def generate(batch, max_tokens):
        ids = torch.tensor(batch)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False)
        return time.perf_counter() - t0

    return measure(generate, args.batches, plist, args.n1, args.hf_n2, args.hf_repeat)


def engine_child(args, tp: int, bind: str | None) -> dict:
    """The vLLM measurement in a fresh process, under thread binding ``bind`` (None: vLLM's default)."""
    cmd = [sys.executable, __file__, "--engine-only", "--model", str(args.model), "--batches",
           *map(str, args.batches), "--prompt-len", str(args.prompt_len), "--n1", str(args.n1), "--n2",
           str(args.n2), "--repeat", str(args.repeat), "--tp", str(tp)]
    env = dict(os.environ)
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bind_sweep(args) -> None:
    n = os.cpu_count()
    half = n // 2
    split = f"0-{half - 1}|{half}-{n - 1}" if half > 1 else "0|1"
    settings = [(1, "nobind"), (1, "auto"), (1, f"0-{n - 1}"), (1, "0"), (2, split), (2, "nobind"), (2, "auto")]
    print(f"# Thread binding sweep, kernel-friendly tiny checkpoint, float32, {n} CPUs (plugin on vLLM only)\n")
    head = [f"decode b{B} tok/s" for B in args.batches]
    print("| TP | VLLM_CPU_OMP_THREADS_BIND | " + " | ".join(head) + " | prefill tok/s | TTFT ms |")
    print("| --- | --- | " + " | ".join("---" for _ in head) + " | --- | --- |")
    for tp, bind in settings:
        try:
            r = engine_child(args, tp, bind)
        except RuntimeError as exc:  # e.g. `auto` with more ranks than NUMA nodes refuses to start
            reason = next((line for line in str(exc).splitlines() if "Error: " in line), "Error: see its log")
            print(f"| {tp} | `{bind}` | does not start: {reason.split('Error: ', 1)[1][:120]} |", flush=True)
            continue
        cells = [f"{r['decode'][str(B)]:,.0f}" for B in args.batches]
        print(f"| {tp} | `{bind}` | " + " | ".join(cells) + f" | {r['prefill']:,.0f} | {r['ttft'] * 1e3:,.0f} |",
              flush=True)


def table(ours: dict, ref: dict, args) -> str:
    def row(name, a, b, unit, higher_better=True):
        ratio = a / b if higher_better else b / a
        return f"| {name} | {a:,.1f} {unit} | {b:,.1f} {unit} | {ratio:.1f}x |"

    lines = ["| metric | plugin on vLLM | transformers generate | plugin advantage |", "| --- | --- | --- | --- |"]
    for B in args.batches:
        lines.append(row(f"decode, batch {B}", ours["decode"][str(B)], ref["decode"][str(B)], "tok/s"))
    lines.append(row(f"prefill, {ours['prefill_batch']} x {args.prompt_len} tokens", ours["prefill"], ref["prefill"],
                     "tok/s"))
    lines.append(row(f"time to first token, {args.prompt_len}-token prompt", ours["ttft"] * 1e3, ref["ttft"] * 1e3,
                     "ms", higher_better=False))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: build the kernel-friendly tiny one)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--n1", type=int, default=4, help="short generation (tokens)")
    parser.add_argument("--n2", type=int, default=36, help="long generation on vLLM (tokens)")
    parser.add_argument("--hf-n2", type=int, default=12, help="long generation on transformers (tokens)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hf-repeat", type=int, default=1, help="repeats on transformers (slow)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size of the vLLM run")
    parser.add_argument("--bind-sweep", action="store_true", help="plugin only, under each thread binding")
    parser.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from vllm_glm53.tiny import build_checkpoint, kernel_friendly_overrides

            args.model = build_checkpoint(Path(tmp) / "kernel-friendly", overrides=kernel_friendly_overrides())
        plist = prompts(args.model, max(args.batches), args.prompt_len)
        if args.engine_only:
            print(json.dumps(run_vllm(args, plist)), flush=True)
            return
        if args.bind_sweep:
            return bind_sweep(args)
        try:
            ours = engine_child(args, args.tp, os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
        except RuntimeError as exc:
            sys.exit(f"vLLM run failed:\n{str(exc)[-6000:]}")
        ref = run_transformers(args, plist)

    from vllm_glm53.backends.cpu import kernels

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    print(f"# End to end, kernel-friendly tiny checkpoint, float32, {os.cpu_count()} CPUs, "
          f"VLLM_CPU_OMP_THREADS_BIND={bind}, plugin backends: {kernels.description()}\n")
    print(table(ours, ref, args))


if __name__ == "__main__":
    main()
