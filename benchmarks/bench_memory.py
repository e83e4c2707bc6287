"""Cache memory: what vLLM allocates for the plugin per sequence and per token vs the minimum the model needs,
and what that means for GLM-5.3-Flash's KV pool on an 8 x H200 node.

    .venv/bin/python benchmarks/bench_memory.py [--workdir DIR]

Two checkpoints are built (random weights, tiny hidden size; the cache does not depend on the weights):
* ``kernel-friendly``: the 5-layer real-per-head-geometry tiny checkpoint of bench_e2e.py, float32;
* ``released, one TP8 rank``: the released 45-layer schedule (MLA every 4th layer, 34 KDA + 11 MLA, every
  indexer ``full``) with the per-rank state of TP=8 (64 KDA heads / 8 = 8 heads of 128), latent 512, indexer
  keys of 128 in pools of 4, bfloat16 like the release. Its per-rank cache is the real model's per-rank cache.

Each runs through the engine (``vllm.LLM``, engine core in this process) and the table reads the allocation
the engine decided: cache groups, page sizes, block sizes. The minimum per sequence is the KDA state (conv
window + float32 recurrent state per layer); per token it is the latent of every MLA layer plus, for each
``full`` indexer layer, its pooled key (``index_head_dim`` values per ``index_kpool`` tokens, kept at the
cache dtype; the raw inputs of incomplete pools, a few pools per page, count as overhead).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, to read its decisions
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

RELEASED_RANK = {
    "vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 64,
    "num_hidden_layers": 45,
    "layer_types": ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(45)],
    "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 42,
    "indexer_types": ["full"] * 45,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 256, "kv_lora_rank": 512,
    "qk_nope_head_dim": 256, "v_head_dim": 256, "index_n_heads": 4, "index_head_dim": 128,
    "index_topk": 2048, "index_kpool": 4,
    "linear_attn_config": {"num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
}

# GLM-5.3-Flash, released config (architecture.md §1.3) and FP8 checkpoint policy (§8, §12): routed/shared
# experts and dense MLPs FP8 (1 byte + one fp32 scale per 128x128 block), the rest bf16.
REAL = dict(hidden=4096, layers=45, vocab=154880, dense_layers=3, dense_inter=12288, experts=288, moe_inter=2048,
            shared_experts=1, kda_heads=64, head=128, conv_k=4, mla_heads=64, q_lora=1536, kv_lora=512, nope=256,
            v_head=256, index_heads=32, index_dim=128)
H200_BYTES = 143_771 * 2**20  # what CUDA reports on an H200 (141 GB class)
TP = 8


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def engine_allocation(model: Path, dtype: str) -> dict:
    """How the engine lays out the cache for ``model``: built in a fresh process (one engine per process)."""
    proc = subprocess.run([sys.executable, __file__, "--probe", str(model), dtype], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"engine probe failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe(model: str, dtype: str) -> None:
    from vllm import LLM

    llm = LLM(model=model, dtype=dtype, enforce_eager=True, enable_prefix_caching=False, max_model_len=4096,
              max_num_seqs=4, limit_mm_per_prompt={"image": 0, "video": 0})
    cfg = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config  # vLLM 0.32, engine core in-process
    groups = []
    for g in cfg.kv_cache_groups:
        spec = g.kv_cache_spec
        groups.append({"kind": "state" if type(spec).__name__ == "MambaSpec" else "tokens",
                       "layers": len(g.layer_names), "block_size": spec.block_size, "page": spec.page_size_bytes})
    slots = max(g["layers"] for g in groups)  # pages per block id: the groups overlay one another
    print(json.dumps({"groups": groups, "bytes_per_block": slots * groups[0]["page"], "num_blocks": cfg.num_blocks,
                      "pool_bytes": sum(t.size for t in cfg.kv_cache_tensors)}), flush=True)


def minimum(config: dict, tp: int, cache_bytes: int, model_bytes: int) -> dict:
    """Per-sequence state and per-token cache the model needs on one TP rank."""
    t = config["text_config"] if "text_config" in config else config
    lin = t["linear_attn_config"]
    layer_types = t["layer_types"]
    n_kda = sum(1 for x in layer_types if x in ("linear_attention", "mamba"))
    mla = [i for i, x in enumerate(layer_types) if x not in ("linear_attention", "mamba")]
    n_full = sum(1 for i in mla if t["indexer_types"][i] == "full")
    heads = lin["num_heads"] // tp
    conv = 3 * heads * lin["head_dim"] * (lin["short_conv_kernel_size"] - 1) * model_bytes
    recurrent = heads * lin["head_dim"] ** 2 * 4
    return {"state": n_kda * (conv + recurrent), "state_layer": conv + recurrent, "n_kda": n_kda, "n_mla": len(mla),
            "latent": len(mla) * t["kv_lora_rank"] * cache_bytes,
            "pooled_keys": n_full * t["index_head_dim"] * cache_bytes / t["index_kpool"]}


def engine_costs(alloc: dict) -> dict:
    state_blocks = sum(1 for g in alloc["groups"] if g["kind"] == "state")
    token_groups = [g for g in alloc["groups"] if g["kind"] == "tokens"]
    block = token_groups[0]["block_size"]
    per_token = len(token_groups) * alloc["bytes_per_block"] / block
    return {"state": state_blocks * alloc["bytes_per_block"], "token": per_token, "block": block,
            "state_groups": state_blocks, "token_groups": len(token_groups)}


def report(name: str, config: dict, alloc: dict, tp: int, dtype_bytes: int) -> tuple[dict, dict]:
    low = minimum(config, tp, dtype_bytes, dtype_bytes)
    eng = engine_costs(alloc)
    g = alloc["groups"]
    state_pages = [x for x in g if x["kind"] == "state"]
    print(f"## {name}\n")
    print(f"engine: {len(g)} cache groups ({eng['state_groups']} state, {eng['token_groups']} token), "
          f"{max(x['layers'] for x in g)} layer pages per block id, page {fmt_bytes(g[0]['page'])}, "
          f"token block {eng['block']}; KDA state page needs {fmt_bytes(low['state_layer'])} "
          f"(padded {g[0]['page'] / low['state_layer']:.2f}x); "
          f"{sum(x['layers'] for x in state_pages)} KDA layers in {len(state_pages)} groups of "
          f"{max(x['layers'] for x in g)} slots\n")
    print("| per rank | engine allocates | minimum | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| state per sequence ({low['n_kda']} KDA layers) | {fmt_bytes(eng['state'])} | "
          f"{fmt_bytes(low['state'])} | {eng['state'] / low['state']:.2f} |")
    min_token = low["latent"] + low["pooled_keys"]
    print(f"| cache per token ({low['n_mla']} MLA layers) | {fmt_bytes(eng['token'])} | {fmt_bytes(min_token)} "
          f"(latent {fmt_bytes(low['latent'])} + pooled keys {fmt_bytes(low['pooled_keys'])}) | "
          f"{eng['token'] / min_token:.2f} |")
    print()
    return low, eng


def real_weights_per_rank() -> float:
    """Bytes of GLM-5.3-Flash's FP8 checkpoint weights on one of 8 TP ranks (MoE experts sharded by TP too)."""
    r = REAL
    d = r["hidden"]
    fp8_block = 1 + 4 / (128 * 128)
    moe_layers = r["layers"] - r["dense_layers"]
    mlp_fp8 = (r["dense_layers"] * 3 * d * r["dense_inter"]
               + moe_layers * (r["experts"] + r["shared_experts"]) * 3 * d * r["moe_inter"]) * fp8_block
    n_mla = sum(1 for i in range(r["layers"]) if i % 4 == 3)
    n_kda = r["layers"] - n_mla
    kda = n_kda * (3 * d * r["kda_heads"] * r["head"] + 2 * (d * r["head"] + r["head"] * r["kda_heads"] * r["head"])
                   + d * r["kda_heads"] + r["kda_heads"] * r["head"] * d)
    mla = n_mla * (d * r["q_lora"] + r["q_lora"] * r["mla_heads"] * r["nope"] + d * r["kv_lora"]
                   + r["kv_lora"] * r["mla_heads"] * (r["nope"] + r["v_head"]) + r["mla_heads"] * r["v_head"] * d)
    router = moe_layers * r["experts"] * d
    bf16 = (kda + mla + router + 2 * r["vocab"] * d) * 2
    indexer = n_mla * (r["q_lora"] * r["index_heads"] * r["index_dim"] + 2 * d * r["index_dim"]
                       + d * r["index_heads"]) * 2  # replicated on every rank
    return (mlp_fp8 + bf16) / TP + indexer


def capacity(low: dict, eng: dict, reserve: float, util: float) -> None:
    weights = real_weights_per_rank()
    pool = H200_BYTES * util - weights - reserve
    print(f"## GLM-5.3-Flash on 8 x H200, TP=8, bf16 cache\n")
    print(f"per rank: {fmt_bytes(H200_BYTES)} x {util} utilisation - weights {fmt_bytes(weights)} (FP8 checkpoint) - "
          f"{fmt_bytes(reserve)} activations/graphs (assumed) = KV pool {fmt_bytes(pool)}\n")
    min_token = low["latent"] + low["pooled_keys"]
    print("| context | sequences (engine allocation) | sequences (minimum) | tokens in pool (engine) | tokens (minimum) |")
    print("| --- | --- | --- | --- | --- |")
    for ctx in (8192, 32768, 131072, 1048576):
        blocks = math.ceil(ctx / eng["block"])
        per_seq_engine = eng["state"] + blocks * eng["token"] * eng["block"]
        per_seq_min = low["state"] + ctx * min_token
        n_e, n_m = int(pool // per_seq_engine), int(pool // per_seq_min)
        print(f"| {ctx:,} | {n_e:,} | {n_m:,} | {n_e * ctx:,} | {n_m * ctx:,} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="where to build the checkpoints (default: a temporary directory)")
    parser.add_argument("--reserve-gib", type=float, default=6.0, help="activations / graphs per rank (GiB)")
    parser.add_argument("--util", type=float, default=0.9, help="gpu_memory_utilization")
    parser.add_argument("--probe", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        return probe(*args.probe)
    from vllm_glm53.tiny import build_checkpoint, kernel_friendly_overrides

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        friendly = build_checkpoint(root / "kernel-friendly", overrides=kernel_friendly_overrides())
        released = build_checkpoint(root / "released-rank", overrides=RELEASED_RANK, dtype="bfloat16")
        print("# Cache memory per rank: engine allocation vs minimum\n")
        report("kernel-friendly tiny (float32, TP=1)", json.loads((friendly / "config.json").read_text()),
               engine_allocation(friendly, "float32"), 1, 4)
        # The per-rank checkpoint has 8 KDA heads at TP=1, i.e. one TP8 rank of the real 64.
        low, eng = report("released schedule, one TP8 rank (bfloat16)", json.loads((released / "config.json").read_text()),
                          engine_allocation(released, "bfloat16"), 1, 2)
        capacity(low, eng, args.reserve_gib * 2**30, args.util)


if __name__ == "__main__":
    main()
