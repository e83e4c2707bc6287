"""``vllm bench serve`` against the plugin's CPU server on the tiny checkpoint.

    python benchmarks/bench_serve.py [--num-prompts 64] [--concurrency 1 8 32]

Starts the CPU recipe's ``vllm serve`` (as ``make demo`` does), runs vLLM's own serving benchmark at each
concurrency with random prompts, and prints one table of its numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from vllm_glm53.demo import SERVED_NAME, Server, free_port, serve_command
    from vllm_glm53.tiny import build_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    ckpt = build_checkpoint(work / "tiny", layout="flat")
    port = free_port()
    argv, env = serve_command(ckpt, port, extra_args=("--max-num-seqs", "64"))
    server = Server(argv, env, echo=False)
    rows = []
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}")
        vllm = str(Path(sys.executable).with_name("vllm"))
        for c in args.concurrency:
            result = work / f"c{c}.json"
            cmd = [vllm, "bench", "serve", "--backend", "vllm", "--model", str(ckpt),
                   "--served-model-name", SERVED_NAME, "--tokenizer", str(ckpt), "--base-url",
                   f"http://127.0.0.1:{port}", "--dataset-name", "random", "--random-input-len",
                   str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
                   "--num-prompts", str(args.num_prompts), "--max-concurrency", str(c), "--save-result",
                   "--result-dir", str(work), "--result-filename", result.name]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if out.returncode != 0:
                raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
            r = json.loads(result.read_text())
            rows.append((c, r["request_throughput"], r["output_throughput"], r["mean_ttft_ms"],
                         r["mean_tpot_ms"], r["completed"]))
    finally:
        server.stop()
    print(f"vllm bench serve, tiny float32 checkpoint, {args.num_prompts} prompts, random {args.input_len} in / "
          f"{args.output_len} out")
    print(f"{'concurrency':>11} {'req/s':>7} {'out tok/s':>9} {'TTFT ms':>8} {'TPOT ms':>8} {'done':>5}")
    for c, rps, tps, ttft, tpot, done in rows:
        print(f"{c:>11} {rps:>7.2f} {tps:>9.1f} {ttft:>8.1f} {tpot:>8.1f} {done:>5}")


if __name__ == "__main__":
    main()
