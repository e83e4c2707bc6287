#!/usr/bin/env python3
"""GPU op benchmark: the CUDA backends (vllm_glm53/backends/cuda) at GLM-5.3-Flash's real per-layer shapes,
against the naive torch form (the CPU backend's torch ops, run on the same GPU) and the memory-bandwidth floor.

    python benchmarks/bench_gpu_ops.py [--contexts 4096,16384,65536,131072] [--dtype bfloat16]

Shapes (one layer, TP 1): KDA 64 heads x 128 (conv channels 3 x 8192), MLA 64 heads over a 512-wide latent,
indexer 32 heads x 128, index_topk 2048 with kpool 4 (2051-wide index rows), contexts 4K-128K. The floor is the
op's compulsory bytes (inputs read once, outputs written once) over the copy bandwidth measured at the start.
Columns: kernel / naive / floor times in ms, naive/kernel (speed-up) and kernel/floor (1.0 = at bandwidth).
Without a CUDA device it prints why and exits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

H_KDA, D_KDA = 64, 128
H_MLA, LAT = 64, 512
NI, DI = 32, 128
TOPK, KP = 2048, 4
PREFILL = 4096  # prefill chunk (tokens) for the per-token ops
PREFILL_Q = 256  # query chunk for the context-dependent prefill ops (indexer, sparse MLA)


def bandwidth_gbps() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def timed(fn) -> float | None:
    from triton.testing import do_bench

    try:
        return do_bench(fn, warmup=10, rep=50)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,16384,65536,131072")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="activation / cache dtype for the indexer and MLA rows (KDA runs as the layer calls it)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device here; bench_gpu_ops.py measures the CUDA backends on a GPU.")
        return 0

    from vllm_glm53.backends.cpu import indexer as ix_ref
    from vllm_glm53.backends.cpu import kda as kda_ref
    from vllm_glm53.backends.cpu import sparse_mla as mla_ref
    from vllm_glm53.backends.cuda import indexer as ix_gpu
    from vllm_glm53.backends.cuda import kda as kda_gpu
    from vllm_glm53.backends.cuda import sparse_mla as mla_gpu
    from vllm_glm53.backends.plans import LatentCachePlan, StateSlots

    dev = torch.device("cuda")
    dt = getattr(torch, args.dtype)
    esz = torch.tensor([], dtype=dt).element_size()
    contexts = [int(c) for c in args.contexts.split(",")]
    bw = bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s; activations {args.dtype}\n")
    rows: list[tuple] = []

    def bench(op: str, shape: str, kernel, naive, nbytes: int) -> None:
        k_ms = timed(kernel)
        n_ms = timed(naive) if naive is not None else None
        floor = nbytes / (bw * 1e9) * 1e3
        rows.append((op, shape, k_ms, n_ms, floor))
        print(_fmt(rows[-1]), flush=True)

    print(_header())
    f32 = 4

    # --- KDA (context-independent: per prefill chunk and per decode batch) ---------------------------------
    T, H, d = PREFILL, H_KDA, D_KDA
    C = 3 * H * d
    x = torch.randn(T, C, device=dev, dtype=dt)
    w = torch.randn(C, 4, device=dev) * 0.5
    st = torch.randn(C, 3, device=dev, dtype=dt)
    bench("kda conv prefill", f"T={T} C={C}", lambda: kda_gpu.causal_conv1d(x, w, st),
          lambda: kda_ref.causal_conv1d(x, w, st), 2 * T * C * esz + C * 4 * f32)
    xb, stb = x[:64], torch.randn(64, C, 3, device=dev, dtype=dt)
    decode64 = StateSlots.single_slot(torch.arange(65, device=dev), torch.arange(64, device=dev),
                                      torch.ones(64, dtype=torch.bool, device=dev), 64, 1)
    bench("kda conv decode", f"B=64 C={C}", lambda: kda_gpu.causal_conv1d_varlen(xb, w, stb, decode64),
          lambda: kda_ref.causal_conv1d_varlen.implementation("torch")(xb, w, stb, decode64),
          2 * 64 * C * esz + 2 * 64 * C * 3 * esz)
    a, A_log = torch.randn(T, H, d, device=dev), torch.randn(H, device=dev)
    bench("kda gate", f"T={T} H={H} d={d}", lambda: kda_gpu.kda_gate(a, A_log, -5.0),
          lambda: kda_ref.kda_gate(a, A_log, -5.0), 2 * T * H * d * f32)
    o, nw = torch.randn(T, H, d, device=dev), torch.ones(d, device=dev)
    gate = torch.randn(T, H, d, device=dev, dtype=dt)
    bench("kda gated rmsnorm", f"T={T} H={H} d={d}", lambda: kda_gpu.gated_rmsnorm(o, gate, nw, 1e-5, dt),
          lambda: kda_ref.gated_rmsnorm(o, gate, nw, 1e-5, dt), T * H * d * (f32 + 2 * esz))
    q, k = kda_ref.l2norm_qk(torch.randn(T, H, d, device=dev), torch.randn(T, H, d, device=dev), d)
    v = torch.randn(T, H, d, device=dev)
    g = kda_ref.kda_gate(torch.randn(T, H, d, device=dev), A_log, -5.0)
    beta = torch.rand(T, H, device=dev)
    s0 = torch.randn(H, d, d, device=dev) * 0.1
    bench("kda chunked prefill", f"T={T} H={H} d={d} fp32",
          lambda: kda_gpu.kda_chunked(q, k, v, g, beta, s0), lambda: kda_ref.kda_chunked(q, k, v, g, beta, s0),
          (4 * T * H * d + T * H + T * H * d) * f32 + 2 * H * d * d * f32)
    B = 64
    pool = torch.randn(2 * B, H, d, d, device=dev) * 0.1
    slots = torch.randperm(2 * B, device=dev)[:B]
    plan = StateSlots.single_slot(torch.arange(B + 1, device=dev), slots, torch.ones(B, dtype=torch.bool, device=dev),
                                  B, 1)
    bench("kda decode (slot pool)", f"B={B} H={H} d={d}",
          lambda: kda_gpu.kda_varlen(q[:B], k[:B], v[:B], g[:B], beta[:B], pool, plan),
          lambda: kda_ref.kda_varlen.implementation("torch")(q[:B], k[:B], v[:B], g[:B], beta[:B], pool, plan),
          2 * B * H * d * d * f32 + 5 * B * H * d * f32)

    # --- indexer and sparse MLA, per context ----------------------------------------------------------------
    width = ix_ref.index_width(TOPK, KP)
    for ctx in contexts:
        n_pools = ctx // KP
        cache = torch.randn(ctx, LAT + 2 * DI, device=dev, dtype=dt)
        keys, gates, latent = cache[:, LAT : LAT + DI], cache[:, LAT + DI :], cache[:, :LAT]
        ape = torch.randn(KP, DI, device=dev)
        bench("indexer kpool compress", f"ctx={ctx}", lambda: ix_gpu.kpool_compress(keys, gates, ape),
              lambda: ix_ref.kpool_compress(keys, gates, ape), 2 * ctx * DI * esz + n_pools * DI * f32)
        pooled = ix_gpu.kpool_compress(keys, gates, ape)
        for Tq, kind in ((1, "decode"), (PREFILL_Q, "prefill")):
            qi = torch.randn(Tq, NI, DI, device=dev, dtype=dt)
            wi = torch.randn(Tq, NI, device=dev)
            positions = torch.arange(ctx - Tq, ctx, device=dev)
            bench(f"indexer scores {kind}", f"ctx={ctx} Tq={Tq}", lambda: ix_gpu.index_scores(qi, wi, pooled),
                  lambda: ix_ref.index_scores(qi, wi, pooled),
                  n_pools * DI * f32 + Tq * NI * DI * esz + Tq * n_pools * f32)
            scores = ix_gpu.index_scores(qi, wi, pooled)
            bench(f"indexer select {kind}", f"ctx={ctx} Tq={Tq}",
                  lambda: ix_gpu.select_tokens(scores, positions, TOPK, KP),
                  lambda: ix_ref.select_tokens(scores, positions, TOPK, KP), Tq * (n_pools * f32 + width * 8))
            indices = ix_gpu.select_tokens(scores, positions, TOPK, KP)
            q_lat = torch.randn(Tq, H_MLA, LAT, device=dev, dtype=dt) * 0.05
            mla_bytes = Tq * width * LAT * esz + 2 * Tq * H_MLA * LAT * esz + Tq * width * 8
            bench(f"sparse MLA {kind} (triton)", f"ctx={ctx} Tq={Tq} N={width}",
                  lambda: mla_gpu._triton_sparse_attention(q_lat, latent, indices, 0.0625, None),
                  lambda: mla_ref.sparse_latent_attention(q_lat, latent, indices, 0.0625), mla_bytes)
            if kind == "decode":  # the batch form: 64 requests over the paged cache, one launch
                R, bs = 64, 64
                pages = cache.view(ctx // bs, bs, cache.shape[1])
                table = torch.stack([torch.randperm(ctx // bs, device=dev) for _ in range(R)])
                qb = torch.randn(R, H_MLA, LAT, device=dev, dtype=dt) * 0.05
                ib = indices.expand(R, -1).contiguous()
                lens = torch.full((R,), ctx, device=dev)
                plan = LatentCachePlan(torch.arange(R + 1, device=dev), lens, lens - 1, table,
                                       torch.zeros(R, dtype=torch.int64, device=dev), R, R, 1, ctx)
                bench("sparse MLA paged decode", f"ctx={ctx} reqs={R} N={width}",
                      lambda: mla_gpu.sparse_latent_attention_paged(qb, pages, plan, ib, 0.0625, LAT),
                      lambda: mla_ref.sparse_latent_attention_paged(qb, pages, plan, ib, 0.0625, LAT),
                      R * mla_bytes)
            flashmla = mla_gpu.sparse_latent_attention.implementation("flashmla")
            if mla_gpu._flashmla_check(q_lat, latent, indices, 0.0625) is None:
                bench(f"sparse MLA {kind} (FlashMLA)", f"ctx={ctx} Tq={Tq} N={width}",
                      lambda: flashmla(q_lat, latent, indices, 0.0625), None, mla_bytes)
    return 0


def _header() -> str:
    return (f"{'op':28} {'shape':30} {'kernel ms':>10} {'naive ms':>10} {'floor ms':>9} {'naive/kern':>10} "
            f"{'kern/floor':>10}\n" + "-" * 113)


def _fmt(row: tuple) -> str:
    op, shape, k, n, floor = row

    def ms(x):
        return f"{x:10.4f}" if x is not None else f"{'oom/n.a.':>10}"

    speedup = f"{n / k:10.1f}" if (k and n) else f"{'-':>10}"
    vs_floor = f"{k / floor:10.1f}" if k else f"{'-':>10}"
    return f"{op:28} {shape:30} {ms(k)} {ms(n)} {floor:9.4f} {speedup} {vs_floor}"


if __name__ == "__main__":
    sys.exit(main())
