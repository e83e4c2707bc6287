"""Long context on CPU: chunked prefill and prefix caching (issue #17).

    .venv/bin/python benchmarks/bench_long_context.py [--model DIR] [--lengths 1024 4096 16384 32768]
                                                      [--prefix 4096] [--decode-contexts 1024 16384]
                                                      [--budget 2048] [--quick]

The checkpoint (built unless ``--model`` is given) is the kernel-friendly tiny one (``vllm_glm53.tiny.
kernel_friendly_overrides()``: KDA heads of 128, latent 512, index_topk 64 in pools of 4), float32, with room for
the longest prompt. Each table comes from one engine (``vllm.LLM``, engine core and worker in one child process,
so the child's memory is the engine's), with vLLM's CPU defaults otherwise (chunked prefill at ``--budget``
tokens per step, prefix caching in align mode). In one process vLLM's CPU platform applies no thread binding (it
binds OpenMP threads only under its multiprocess executor), so ``VLLM_CPU_OMP_THREADS_BIND`` does not apply here:
the model runs torch's default threads, one per core (the header says how many), where ``vllm serve`` with the
CPU recipe's binding gives it one core of two (a 2,048-token prompt: 0.39-0.43 s here, 0.67 s there):

* **turn 2 with and without a cached prefix**: a ``--prefix``-token first turn, then a second turn of that prompt +
  its reply + 64 new tokens; the time to first token of turn 2 (a one-token generate call) against a fresh prompt
  of the same length with nothing cached, and vLLM's prefix-cache hits for each;
* **prefill time and peak memory** per prompt length (prefix caching off, a fresh prompt each): the wall time of a
  one-token generate call, the process's peak resident memory during that call (Linux ``VmHWM``, reset before each
  call through ``/proc/self/clear_refs``) and how far it rose above the resident memory before the call;
* **decode step time** at each context length: the same prompt generating n1 and then n2 tokens, (t(n2) - t(n1)) /
  (n2 - n1). Prefix caching is on and a first call caches the prompt, so both timed calls prefill only the prompt's
  last, partial block and the difference is decode steps only (re-prefilling a 16K prompt in each call varies by
  more than the 32 decode steps take).

Prompts are random ordinary token ids (the model is random; only lengths matter). Numbers from a shared 2-core
machine are noisy: report them as such (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB

import allocator  # noqa: E402  (this directory's)

allocator.same_as_engine()  # before torch: the script may start over under the engine's allocator

NEW_MESSAGE = 64
DECODE_N1, DECODE_N2 = 2, 34


def build_model(workdir: Path, max_len: int) -> Path:
    from vllm_glm53.tiny import build_checkpoint, kernel_friendly_overrides

    overrides = {**kernel_friendly_overrides(), "max_position_embeddings": max_len}
    return build_checkpoint(workdir / "kernel-friendly-long", overrides=overrides, dtype="float32")


def random_prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab - 64) for _ in range(n)]  # below the added special tokens


def memory_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def child(spec: dict) -> dict:
    """One engine; runs ``spec["kind"]`` and returns its measurements."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"],
              max_num_batched_tokens=spec["budget"], enable_prefix_caching=spec["kind"] != "prefill",
              disable_log_stats=False, limit_mm_per_prompt={"image": 0, "video": 0})
    vocab = spec["vocab"]

    def timed(prompt: list[int], n: int) -> tuple[float, list[int]]:
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        return time.perf_counter() - t, list(out.token_ids)

    def hits() -> float:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits" and hasattr(m, "value"))

    timed(random_prompt(1, 64, vocab), 2)  # warm-up: first-call costs out of the measurements
    import torch

    result: dict = {"threads": torch.get_num_threads()}
    if spec["kind"] == "cached_turn":
        n = spec["prefix"]
        first = random_prompt(2, n, vocab)
        result["turn1_s"], reply = timed(first, 8)
        turn2 = first + reply + random_prompt(3, NEW_MESSAGE, vocab)
        before = hits()
        result["turn2_cached_s"], _ = timed(turn2, 1)
        result["turn2_hits"] = hits() - before
        before = hits()
        result["fresh_s"], _ = timed(random_prompt(4, len(turn2), vocab), 1)
        result["fresh_hits"] = hits() - before
        result["turn2_tokens"] = len(turn2)
    elif spec["kind"] == "prefill":
        rows = []
        for i, n in enumerate(spec["lengths"]):
            rss0, _ = memory_kib()
            reset_peak()
            seconds, _ = timed(random_prompt(100 + i, n, vocab), 1)
            _, peak = memory_kib()
            rows.append({"tokens": n, "seconds": seconds, "rss_before_mib": rss0 / 1024, "peak_mib": peak / 1024})
        result["rows"] = rows
    elif spec["kind"] == "decode":
        rows = []
        for i, n in enumerate(spec["contexts"]):
            prompt = random_prompt(200 + i, n, vocab)
            timed(prompt, 1)  # caches the prompt: the two timed calls prefill only its last, partial block
            t1, _ = timed(prompt, DECODE_N1)
            t2, _ = timed(prompt, DECODE_N2)
            rows.append({"context": n, "step_ms": 1000 * (t2 - t1) / (DECODE_N2 - DECODE_N1)})
        result["rows"] = rows
    return result


def run_child(spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "spec.json"
        path.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # engine core and worker in the child
        proc = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True, text=True,
                              env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{spec['kind']} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens (vllm serve's default)")
    parser.add_argument("--quick", action="store_true", help="small sizes: check that the script runs end to end")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child.read_text()))))
        return
    if args.quick:
        args.lengths, args.prefix, args.decode_contexts, args.budget = [256, 1024], 512, [256, 1024], 256

    longest = max(args.lengths + args.decode_contexts + [args.prefix + NEW_MESSAGE + 8]) + DECODE_N2
    max_model_len = -(-longest // 1024) * 1024
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_long_"))
    model = args.model or build_model(workdir, max_model_len)
    vocab = json.loads((Path(model) / "config.json").read_text()).get("text_config", {}).get("vocab_size", 1024)
    base = {"model": str(model), "max_model_len": max_model_len, "budget": args.budget, "vocab": vocab}

    turn = run_child({**base, "kind": "cached_turn", "prefix": args.prefix})
    print(f"# checkpoint {model}, float32, --max-num-batched-tokens {args.budget}, max_model_len {max_model_len}, "
          f"engine in one process (no thread binding: {turn['threads']} torch threads), {allocator.describe()}; "
          f"load average {os.getloadavg()[0]:.1f} at the end of the first table")
    print(f"\n## Turn 2 of a conversation: {args.prefix}-token first turn, turn 2 = {turn['turn2_tokens']} tokens\n")
    print("| turn 2 | prefix-cache hits (tokens) | time to first token (ms) |\n|---|---:|---:|")
    print(f"| with the first turn cached | {turn['turn2_hits']:.0f} | {1000 * turn['turn2_cached_s']:.0f} |")
    print(f"| same length, nothing cached | {turn['fresh_hits']:.0f} | {1000 * turn['fresh_s']:.0f} |")
    print(f"\nspeed-up {turn['fresh_s'] / turn['turn2_cached_s']:.1f}x")

    prefill = run_child({**base, "kind": "prefill", "lengths": args.lengths})
    print("\n## Prefill (one-token generate call, prefix caching off)\n")
    print("| prompt tokens | prefill (s) | tokens/s | s per 1K tokens | RSS before (MiB) | peak RSS (MiB) | rise (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in prefill["rows"]:
        print(f"| {r['tokens']} | {r['seconds']:.2f} | {r['tokens'] / r['seconds']:.0f} | "
              f"{1000 * r['seconds'] / r['tokens']:.3f} | {r['rss_before_mib']:.0f} | {r['peak_mib']:.0f} | "
              f"{r['peak_mib'] - r['rss_before_mib']:.0f} |")

    decode = run_child({**base, "kind": "decode", "contexts": args.decode_contexts})
    print(f"\n## Decode step time (batch 1, prompt cached, (t({DECODE_N2}) - t({DECODE_N1})) / {DECODE_N2 - DECODE_N1})\n")
    print("| context tokens | ms per step |\n|---:|---:|")
    for r in decode["rows"]:
        print(f"| {r['context']} | {r['step_ms']:.1f} |")
    print(f"\n# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
