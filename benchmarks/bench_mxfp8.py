"""Throughput of the block-FP8 -> MXFP8 re-grouping, side by side with its naive form and the memory floor.

    .venv/bin/python benchmarks/bench_mxfp8.py [--rows 4096] [--cols 12288] [--repeat 5] [--threads N]

Rows of the table:
* ``regroup``: ``vllm_glm53.quant.mxfp8.regroup`` on the full weight (ascend.md §2.4's synthetic checkpoint);
* ``naive per-group loop``: the same rule written as a Python loop over 1x32 groups (torch ops per group),
  timed on a slice of ``--naive-rows`` rows and extrapolated per element;
* ``dequantize`` rows for context (block-FP8 -> fp32 and MXFP8 -> fp32);
* ``copy floor``: the time a plain memory copy of the bytes regroup must move (read the FP8 weight, write the
  FP8 weight and one scale byte per 32) would take at this machine's measured copy bandwidth, measured with
  a large ``Tensor.copy_``.

Each time is the median of ``--repeat`` calls (the naive loop: one call); the machine may be shared, so expect
noise. regroup's output is checked against the naive loop's on the slice the loop runs, and the MXFP8 weight it
produces against the block-FP8 one (both dequantized) before anything is timed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from vllm_glm53.quant import mxfp8
from vllm_glm53.quant.fp8_block import dequantize_block_fp8, quantize_block_fp8


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, repeat: int) -> float:
    """Bytes per second moved (read + write) by a large ``copy_`` between pre-touched buffers."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    return 2 * nbytes / median_time(lambda: dst.copy_(src), repeat)


def naive_regroup(weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)):
    """One 1x32 group at a time: exact values in fp64, smallest non-clipping exponent, RNE to E4M3."""
    n, k = weight.shape
    groups = math.ceil(k / 32)
    out_w = torch.empty_like(weight)
    out_s = torch.empty(n, groups, dtype=torch.uint8)
    for i in range(n):
        for g in range(groups):
            cols = slice(32 * g, min(32 * g + 32, k))
            s = float(scale_inv[i // block[0], 32 * g // block[1]])
            x = weight[i, cols].double() * s
            amax = float(x.abs().max())
            if amax == 0:
                out_w[i, cols], out_s[i, g] = weight[i, cols], 0
                continue
            mant, exp = math.frexp(s)
            if mant == 0.5 and exp - 1 >= -126:
                e = exp - 1
            else:
                m, E = math.frexp(amax)
                e = max(E - 9 + (m > 0.875), -126)
            # Single rounding of the exact value: x * 2**-e has <= 28 significant bits, RNE'd via fp64 round().
            y = x * 2.0**-e
            _, ye = torch.frexp(y)
            quantum = torch.exp2((ye - 1).clamp(min=-6).double() - 3)
            out_w[i, cols] = (torch.round(y / quantum) * quantum).to(torch.float8_e4m3fn)
            out_s[i, g] = e + 127
    return out_w, out_s


def synthetic_checkpoint(n: int, k: int):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    w *= torch.exp(torch.randn(n, 1, generator=gen) * 0.3)
    w *= torch.exp(torch.randn(1, k, generator=gen) * 0.2)
    w[torch.rand(n, k, generator=gen) < 1e-3] *= 8
    return quantize_block_fp8(w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=12288)
    ap.add_argument("--naive-rows", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    n, k = args.rows, args.cols
    q, s = synthetic_checkpoint(n, k)
    elements = n * k
    moved = elements + elements + n * math.ceil(k / 32)  # read FP8, write FP8 + E8M0 bytes

    # The slice starts at row 0 so that its block scales are the first row-blocks' (the naive loop indexes them
    # itself; regroup needs the matching scale shape).
    naive_q, naive_s = naive_regroup(q[: args.naive_rows], s)
    fast_q, fast_s = mxfp8.regroup(q[: args.naive_rows], s[: math.ceil(args.naive_rows / 128)])
    if not (torch.equal(naive_q.view(torch.uint8), fast_q.view(torch.uint8)) and torch.equal(naive_s, fast_s)):
        raise SystemExit("naive and vectorised regroup disagree; the timings below would compare different work")

    mx_q, mx_s = mxfp8.regroup(q, s)
    block_fp8 = dequantize_block_fp8(q, s, dtype=torch.float32)
    rel = ((mxfp8.dequantize(mx_q, mx_s) - block_fp8).norm() / block_fp8.norm()).item()
    del block_fp8

    rows = []
    t = median_time(lambda: mxfp8.regroup(q, s), args.repeat)
    rows.append(("regroup", f"{n}x{k}", t, elements / t, moved / t))
    t_naive = median_time(lambda: naive_regroup(q[: args.naive_rows], s), 1)
    per = t_naive / (args.naive_rows * k)
    t = per * elements
    rows.append(("naive per-group loop (extrapolated)", f"{args.naive_rows}x{k}", t, elements / t, moved / t))
    t = median_time(lambda: mxfp8.dequantize(mx_q, mx_s), args.repeat)
    rows.append(("mxfp8.dequantize -> fp32", f"{n}x{k}", t, elements / t, (elements * 5 + mx_s.numel()) / t))
    t = median_time(lambda: dequantize_block_fp8(q, s, dtype=torch.float32), args.repeat)
    rows.append(("dequantize_block_fp8 -> fp32", f"{n}x{k}", t, elements / t, (elements * 5 + s.numel() * 4) / t))
    bw = copy_bandwidth(max(moved, 1 << 28), args.repeat)
    rows.append(("copy floor (same bytes as regroup)", f"{n}x{k}", moved / bw, elements / (moved / bw), bw))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; weight {n}x{k} block-FP8 "
          f"({elements / 1e6:.1f} M elements); GB/s counts bytes read + written; regroup's MXFP8 weight against the "
          f"block-FP8 one: relative Frobenius error {rel:.2%}")
    print(f"{'what':38} {'shape':>12} {'time [s]':>10} {'M elem/s':>10} {'GB/s':>8} {'x regroup':>10}")
    t_regroup = rows[0][2]
    for name, shape, t, eps, bps in rows:
        print(f"{name:38} {shape:>12} {t:10.4f} {eps / 1e6:10.1f} {bps / 1e9:8.3f} {t / t_regroup:10.2f}")


if __name__ == "__main__":
    main()
