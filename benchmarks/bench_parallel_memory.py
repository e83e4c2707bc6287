"""Per-rank parameter bytes of the plugin's model under tensor, pipeline and expert parallel.

    .venv/bin/python benchmarks/bench_parallel_memory.py [--checkpoint DIR] [--configs tp1,pp2,tp2,tp2-ep]

Each configuration starts ``vllm.LLM`` on a tiny float32 checkpoint (built with ``vllm_glm53.tiny`` unless one is
given), generates one token, and asks every worker what its model holds (``vllm_glm53.testing.parameter_bytes``):
all parameter bytes, routed-expert bytes, the decoder layers it built and the whole experts per MoE block.
Prints one row per rank. What to read: PP 2 splits the decoder layers (each stage about half the parameters; the
embedding lives on the first stage, the LM head and final norm on the last); EP over TP 2 holds half of the experts,
whole (expert bytes 1/2, like TP's slicing, but in the stacked [experts, out, in] layout of only local experts).
Each configuration is its own process (vLLM on CPU spawns its workers); ranks are bound to separate cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CONFIGS = {
    "tp1": ({}, {}),
    # vLLM's default split of the tiny's 5 layers, 0-2 | 3-4, leaves stage 1 no KDA layer to keep prefix-cache state
    # snapshots for, which the plugin refuses with prefix caching on (see the README's pipeline-parallel notes)
    "pp2": ({"pipeline_parallel_size": 2, "enable_prefix_caching": False}, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
    "tp2": ({"tensor_parallel_size": 2}, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
    "tp2-ep": ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
}


def _child(checkpoint: str, engine: dict, out: str) -> None:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships the function to the workers
    from vllm import LLM, SamplingParams

    from vllm_glm53.testing import parameter_bytes

    llm = LLM(model=checkpoint, max_model_len=256, enforce_eager=True, dtype="float32", **engine)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1))
    Path(out).write_text(json.dumps(llm.apply_model(parameter_bytes)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], json.loads(args.child[1]), args.child[2])
        return
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from vllm_glm53.tiny import build_checkpoint

            checkpoint = str(build_checkpoint(Path(tmp) / "tiny"))
        rows = []
        for name in args.configs.split(","):
            engine, env = CONFIGS[name]
            out = Path(tmp) / f"{name}.json"
            proc = subprocess.run([sys.executable, __file__, "--child", checkpoint, json.dumps(engine), str(out)],
                                  env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)
            if proc.returncode != 0:
                sys.exit(f"{name} ({json.dumps(engine)}) failed:\n{proc.stderr[-4000:]}")
            ranks = json.loads(out.read_text())
            for rank, r in enumerate(ranks):
                rows.append((name, rank, r["total"], r["experts"], r["layers"], r["experts_per_block"]))
        single = {r[0]: r for r in rows if r[1] == 0}.get("tp1")
        print(f"{'config':8} {'rank':>4} {'param bytes':>12} {'vs tp1':>7} {'expert bytes':>13} {'vs tp1':>7}  "
              f"{'layers built':16} experts/block")
        for name, rank, total, experts, layers, per_block in rows:
            rel = f"{total / single[2]:.2f}" if single else "-"
            rel_e = f"{experts / single[3]:.2f}" if single and single[3] else "-"
            print(f"{name:8} {rank:>4} {total:>12,} {rel:>7} {experts:>13,} {rel_e:>7}  {str(layers):16} "
                  f"{per_block}")


if __name__ == "__main__":
    main()
