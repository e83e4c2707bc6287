"""FP8-resident weights on CPU vs the BF16 copy the dequantize-at-load path keeps: decode step time of the FFN
blocks (the part of a step the weight format changes), the memory-bandwidth floor, and resident memory.

    .venv/bin/python benchmarks/bench_fp8_resident.py [--experts 64] [--layers 6] [--threads N] [--repeat 7]
    .venv/bin/python benchmarks/bench_fp8_resident.py --release-shapes   # GLM-5.3-Flash's layer sizes

The geometry is the kernel-friendly tiny config's (hidden 512, dense intermediate 1024, expert intermediate 256:
vllm_glm53/data/kernel_friendly.json) with many experts (``--experts``, top-8, one shared expert), layer 0 dense
and the others MoE, block-FP8 with 128 x 128 blocks like the release. ``--release-shapes``: the released model's
layer sizes (hidden 4096, dense intermediate 12288, expert intermediate 2048: 25 MB per FP8 expert, so each op
does the work it does in serving rather than paying mostly per-call overheads) with fewer experts and layers by
default (32 experts, 1 dense + 2 MoE layers: 1.8 GB of FP8 weights) so that both copies fit in memory. The
weights are quantized from random values and written to a safetensors file; each side then loads that file as
the serving model does:

* ``fp8``: E4M3 bytes and float32 block scales, as ``CpuFp8Experts`` and ``CpuBlockFp8LinearMethod`` keep them;
  the step runs the compiled ``moe_experts_fp8`` and ``fp8_linear``, and each MLP (the dense layer's, the shared
  expert) as one ``mlp_fp8`` call up to ``MLP_FP8_MAX_TOKENS`` tokens, as the model's ``Glm5NextMLP`` does;
* ``bf16``: every weight dequantized to bfloat16 (the default model dtype) as ``StackedExperts`` and vLLM's
  unquantized linears keep them; the step runs the ``routed_experts`` op (compiled kernel for decode batches,
  per-expert GEMMs above its threshold) and its linears as vLLM's ``ReplicatedLinear`` layers after loading:
  vLLM's oneDNN GEMM on a packed copy where the CPU multiplies bfloat16 natively (AVX512_BF16 / AMX), else the
  compiled ``linear16`` (``take_16bit_gemms``, in place of vLLM's fallback to torch's ``F.linear``).

``--as-avx2-cpu``: both sides as an AVX2-only CPU runs them (``benchmarks/avx2_only.py``).

A step is every layer's FFN for a batch of tokens with fresh random routing per call (top-8 of the experts,
distinct per token). Weights of all layers are several times the last-level cache, the caches are flushed before
each timed step, the two sides never share a weight copy and take their steps in turn (same inputs, each side
first and each after the other as often: orders.py); medians of ``--repeat`` steps rounded up to whole cycles of
those orders. The heap is frozen after loading, as vLLM's engine freezes it (no full garbage collections
inside timed steps). Both sides' outputs
are checked inside the benchmark against the float32 dequantize-then-multiply reference of the same weights.

``floor`` = weight bytes a step reads (dense and shared weights, the experts the routing used, block scales) /
read bandwidth (a ``sum`` over a buffer far larger than the caches, as bench_cpu_ops.py measures it; a step
writes next to nothing; earlier versions divided by the copy bandwidth, read + written bytes per second, 0-5 %
lower on this VM), probed after every round of the batch's timed steps and taken as the median, so that the
floor is measured at the same moments as the steps (on the shared VMs this is run on, the bandwidth moves by
up to 2x within minutes; one probe before all batches made the floor ratio follow it). An untimed step follows
each probe: the first step after one ran 1.3-1.4x slower than the rest. ``fp8 step, weights cached``: the same
step repeated on one input and routing with neither flushes nor probes, so its weights stay in the last-level
cache: what the kernels' arithmetic and the per-op overheads cost without memory traffic (close to the cold step:
the step is bound by them, not by memory). Only where the step's weights fit that cache (``caches.L3_BYTES``): a
step reading more streams from memory either way and says nothing, so the column prints "-" (every
``--release-shapes`` batch). Earlier versions probed the bandwidth between the "cached" steps too, which
evicted their weights: that column was a cold step (1.2-1.35 ms against 0.71-0.85 ms cached at batch 1). ``RSS``
is the growth of the process's anonymous resident memory while a side loads (``RssAnon``), against the
checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # bench_kernel_ab (--base), avx2_only, caches

import avx2_only  # noqa: E402

# torch reads these when it first picks a kernel / builds a oneDNN primitive, so before the import
if avx2_only.FLAG in sys.argv:
    avx2_only.apply()

import allocator  # noqa: E402  (this directory's)

allocator.same_as_engine()  # before torch: the script may start over under the engine's allocator

import torch  # noqa: E402

import caches  # noqa: E402
from orders import balanced_orders, whole_cycles  # noqa: E402
from vllm_glm53 import testing  # noqa: E402
from vllm_glm53.backends.cpu import fp8 as fp8_ops  # noqa: E402
from vllm_glm53.backends.cpu import kernels  # noqa: E402
from vllm_glm53.backends.cpu import moe  # noqa: E402
from vllm_glm53.quant.fp8_block import quantize_block_fp8  # noqa: E402

BLOCK = (128, 128)
HIDDEN, DENSE_INTER, MOE_INTER, TOPK, LIMIT = 512, 1024, 256, 8, 10.0
WORKING_SET = 512 << 20


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


_PROBE: list[torch.Tensor] = []  # the buffer the bandwidth probe reads, made once


def read_seconds() -> float:
    """One ``sum`` over WORKING_SET bytes, far more than the caches hold (the bandwidth probe)."""
    if not _PROBE:
        _PROBE.append(torch.ones(WORKING_SET // 4))
    t0 = time.perf_counter()
    _PROBE[0].sum()
    return time.perf_counter() - t0


def write_checkpoint(path: Path, layers: int, experts: int) -> None:
    """Block-FP8 FFN weights of ``layers`` layers (checkpoint names, one tensor per expert projection)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {}

    def add(name, n, k):
        w, s = quantize_block_fp8(torch.randn(n, k, generator=gen) / k**0.5, BLOCK)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = w, s

    for layer in range(layers):
        p = f"model.layers.{layer}.mlp"
        if layer == 0:
            add(f"{p}.gate_proj", DENSE_INTER, HIDDEN), add(f"{p}.up_proj", DENSE_INTER, HIDDEN)
            add(f"{p}.down_proj", HIDDEN, DENSE_INTER)
            continue
        for e in range(experts):
            add(f"{p}.experts.{e}.gate_proj", MOE_INTER, HIDDEN), add(f"{p}.experts.{e}.up_proj", MOE_INTER, HIDDEN)
            add(f"{p}.experts.{e}.down_proj", HIDDEN, MOE_INTER)
        add(f"{p}.shared_experts.gate_proj", MOE_INTER, HIDDEN), add(f"{p}.shared_experts.up_proj", MOE_INTER, HIDDEN)
        add(f"{p}.shared_experts.down_proj", HIDDEN, MOE_INTER)
    save_file(tensors, str(path))


class Fp8Side:
    """What the FP8-resident model keeps: fused gate|up weights with per-part scales, expert stacks."""

    def __init__(self, f, layers: int, experts: int) -> None:
        self.layers = []
        for layer in range(layers):
            p = f"model.layers.{layer}.mlp"
            if layer == 0:
                self.layers.append(("dense", self._fused(f, p, DENSE_INTER), self._one(f, f"{p}.down_proj")))
                continue
            w13 = torch.empty(experts, 2 * MOE_INTER, HIDDEN, dtype=torch.float8_e4m3fn)
            s13 = torch.empty(experts, 2 * -(-MOE_INTER // 128), -(-HIDDEN // 128))
            w2 = torch.empty(experts, HIDDEN, MOE_INTER, dtype=torch.float8_e4m3fn)
            s2 = torch.empty(experts, -(-HIDDEN // 128), -(-MOE_INTER // 128))
            for e in range(experts):
                (w13[e], s13[e]), (w2[e], s2[e]) = self._fused(f, f"{p}.experts.{e}", MOE_INTER)[:2], \
                    self._one(f, f"{p}.experts.{e}.down_proj")
            self.layers.append(("moe", (w13, s13, w2, s2), self._fused(f, f"{p}.shared_experts", MOE_INTER),
                                self._one(f, f"{p}.shared_experts.down_proj")))

    @staticmethod
    def _one(f, name):
        return f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.weight_scale_inv")

    @classmethod
    def _fused(cls, f, prefix, inter):
        (g, gs), (u, us) = cls._one(f, f"{prefix}.gate_proj"), cls._one(f, f"{prefix}.up_proj")
        return torch.cat([g, u]), torch.cat([gs, us]), [inter, inter]

    def step(self, x, routing, compiled: bool = True):
        linear = fp8_ops.fp8_linear if compiled else fp8_ops.fp8_linear_torch
        experts = fp8_ops.routed_experts_fp8 if compiled else fp8_ops.routed_experts_fp8_torch

        def mlp(x, gate_up, down):  # as the model's Glm5NextMLP runs (quant/linear.py's fp8_mlp)
            (w, s, parts), (wd, sd) = gate_up, down
            if compiled and x.shape[0] <= fp8_ops.MLP_FP8_MAX_TOKENS:
                return fp8_ops.mlp_fp8(x, w, s, wd, sd, LIMIT, BLOCK).to(x.dtype)
            return linear(moe.clamped_swiglu(linear(x, w, s, parts, BLOCK), LIMIT), wd, sd, [HIDDEN], BLOCK)

        for i, entry in enumerate(self.layers):
            if entry[0] == "dense":
                x = x + mlp(x, entry[1], entry[2])
                continue
            ids, weights = routing[i]
            routed = experts(x, *entry[1], ids, weights, LIMIT, BLOCK)
            x = x + (routed.to(x.dtype) + mlp(x, entry[2], entry[3]))
        return x

    def bytes_read(self, routing) -> int:
        total = 0
        for i, entry in enumerate(self.layers):
            if entry[0] == "dense":
                total += sum(t.nbytes for t in (*entry[1][:2], *entry[2]))
                continue
            (w13, s13, w2, s2) = entry[1]
            used = routing[i][0].unique().numel()
            total += used * (w13[0].nbytes + s13[0].nbytes + w2[0].nbytes + s2[0].nbytes)
            total += sum(t.nbytes for t in (*entry[2][:2], *entry[3]))
        return total


class Bf16Side:
    """What the dequantize-at-load path keeps: everything in bfloat16, the linears as the model's layers run them
    (``testing.loaded_linear``)."""

    def __init__(self, f, layers: int, experts: int) -> None:
        def deq(name):
            w, s = Fp8Side._one(f, name)
            return fp8_ops.dequantize_parts(w, s, [w.shape[0]], BLOCK, torch.bfloat16)

        def linear(*names):
            weight = torch.cat([deq(name) for name in names])
            self.linear_bytes += weight.nbytes
            return testing.loaded_linear(weight)

        self.layers, self.linear_bytes = [], 0
        for layer in range(layers):
            p = f"model.layers.{layer}.mlp"
            if layer == 0:
                self.layers.append(("dense", linear(f"{p}.gate_proj", f"{p}.up_proj"), linear(f"{p}.down_proj")))
                continue
            w13 = torch.empty(experts, 2 * MOE_INTER, HIDDEN, dtype=torch.bfloat16)
            w2 = torch.empty(experts, HIDDEN, MOE_INTER, dtype=torch.bfloat16)
            for e in range(experts):
                w13[e] = torch.cat([deq(f"{p}.experts.{e}.gate_proj"), deq(f"{p}.experts.{e}.up_proj")])
                w2[e] = deq(f"{p}.experts.{e}.down_proj")
            self.layers.append(("moe", w13, w2, linear(f"{p}.shared_experts.gate_proj", f"{p}.shared_experts.up_proj"),
                                linear(f"{p}.shared_experts.down_proj")))

    def step(self, x, routing):
        for i, entry in enumerate(self.layers):
            if entry[0] == "dense":
                x = x + entry[2](moe.clamped_swiglu(entry[1](x)[0], LIMIT))[0]
                continue
            _, w13, w2, gate_up, down = entry
            ids, weights = routing[i]
            routed = moe.routed_experts(x, w13, w2, ids, weights, LIMIT)
            shared = down(moe.clamped_swiglu(gate_up(x)[0], LIMIT))[0]
            x = x + (routed.to(x.dtype) + shared)
        return x

    def bytes_read(self, routing) -> int:
        total = self.linear_bytes
        for i, entry in enumerate(self.layers):
            if entry[0] == "moe":
                _, w13, w2 = entry[:3]
                total += routing[i][0].unique().numel() * (w13[0].nbytes + w2[0].nbytes)
        return total


class OnKernels:
    """A side whose steps call ``lib`` (another build of the kernels, bench_kernel_ab.build_base) instead of this
    tree's."""

    def __init__(self, side, lib) -> None:
        self.side, self.lib = side, lib

    def step(self, x, routing):
        tree_ops = kernels.ops
        kernels.ops = lambda: self.lib
        try:
            return self.side.step(x, routing)
        finally:
            kernels.ops = tree_ops


def make_routing(layers, experts, T, gen):
    """Per MoE layer: top-8 distinct experts per token and float32 routing weights (fresh per call)."""
    routing = {}
    for i in range(1, layers):
        ids = torch.rand(T, experts, generator=gen).topk(TOPK, dim=-1).indices
        routing[i] = (ids, torch.rand(T, TOPK, generator=gen) / TOPK)
    return routing


def median_steps(sides, dtype, T, layers, experts, repeat, seed, cached: bool = False) -> tuple[list[float], float]:
    """Median step time of each side over the same fresh inputs and routings, the caches flushed before each step
    and the sides interleaved step by step (orders.py's balanced orders, ``repeat`` rounded up to whole cycles of
    them), so that all see the same moments of a host whose memory bandwidth drifts; ``cached``: the same input
    and routing every step, no flush, so the used weights stay in the last-level cache where they fit (the step's
    time without memory traffic: what the kernels' arithmetic and the per-op overheads cost). Also the read
    bandwidth, probed once per round of steps (median; the floor's denominator measured at the same moments as the
    steps, not minutes before them; 0.0 when ``cached``, whose steps a probe would evict)."""
    gen = torch.Generator().manual_seed(seed)
    # each side in each position and right after each other side as often (orders.py; with three sides, plain
    # rotations ran this tree's FP8 step after the BF16 one and --base's after this tree's on the same weights and
    # routing, which printed identical kernels 0.96x): whole cycles of the design
    orders = balanced_orders(len(sides))
    repeat = whole_cycles(repeat, len(sides))
    inputs = [(torch.randn(T, HIDDEN, generator=gen).to(dtype), make_routing(layers, experts, T, gen))
              for _ in range(repeat + 1)]
    if cached:
        inputs = [inputs[0]] * (repeat + 1)
    for side in sides:
        side.step(*inputs[0])
    times, probes = [[] for _ in sides], []
    for i, (x, routing) in enumerate(inputs[1:]):
        for s in orders[i % len(orders)]:
            if not cached:
                caches.flush()
            t0 = time.perf_counter()
            sides[s].step(x, routing)
            times[s].append(time.perf_counter() - t0)
        if cached:
            continue
        probes.append(read_seconds())
        # An untimed step after the probe, of the side the next round starts with: the step right after the probe
        # ran 1.3-1.4x slower than the others (kernel-friendly config, batch 1: 1.17-1.19 against 0.86 ms; the
        # same after 25 ms of any other work, flushes or not), and a step in the model follows the layer before it.
        caches.flush()
        sides[orders[(i + 1) % len(orders)][0]].step(*inputs[0])
    return [statistics.median(t) for t in times], WORKING_SET / statistics.median(probes) if probes else 0.0


def check(fp8: Fp8Side, bf16: Bf16Side, layers, experts, T) -> tuple[float, float, float]:
    """Relative max errors of both sides against the float32 dequantize-then-multiply step on the same weights
    and input; stops the benchmark where either is off."""
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(T, HIDDEN, generator=gen)
    routing = make_routing(layers, experts, T, gen)
    want = fp8.step(x, routing, compiled=False)
    scale = want.abs().max().item()
    err_fp8 = (fp8.step(x, routing) - want).abs().max().item() / scale  # the E4M3 kernels, float32 activations
    # both sides with the bfloat16 activations they are timed with (on a CPU with native bfloat16 the FP8 side's
    # large batches run bfloat16 GEMMs on dequantized copies: the BF16 side's arithmetic)
    err_fp8_bf16 = (fp8.step(x.bfloat16(), routing).float() - want).abs().max().item() / scale
    err_bf16 = (bf16.step(x.bfloat16(), routing).float() - want).abs().max().item() / scale
    if err_fp8 > 1e-5:
        raise SystemExit(f"batch {T}: FP8-resident step differs from the dequantized reference ({err_fp8:.2g})")
    for name, err in (("FP8-resident", err_fp8_bf16), ("BF16", err_bf16)):
        if err > 5e-2:
            raise SystemExit(f"batch {T}: {name} step in bfloat16 differs from the dequantized reference ({err:.2g})")
    return err_fp8, err_fp8_bf16, err_bf16


def main() -> None:
    # no abbreviations: --as-avx2-cpu is looked for in sys.argv as written, before torch is imported
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--experts", type=int, help="default 64 (32 with --release-shapes)")
    parser.add_argument("--layers", type=int, help="default 6 (3 with --release-shapes)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--release-shapes", action="store_true",
                        help="hidden 4096, dense intermediate 12288, expert intermediate 2048 (defaults: 32 experts, "
                             "3 layers)")
    parser.add_argument("--base", metavar="REV",
                        help="also time both steps on a git revision's kernels (built as bench_kernel_ab.py does), "
                             "interleaved with this tree's: the last four columns")
    parser.add_argument(avx2_only.FLAG, action="store_true", help=avx2_only.HELP)
    parser.add_argument("--write", help=argparse.SUPPRESS)  # the child that writes the checkpoint
    args = parser.parse_args()
    if args.release_shapes:
        global HIDDEN, DENSE_INTER, MOE_INTER
        HIDDEN, DENSE_INTER, MOE_INTER = 4096, 12288, 2048
    args.experts = args.experts or (32 if args.release_shapes else 64)
    args.layers = args.layers or (3 if args.release_shapes else 6)
    if args.write:
        write_checkpoint(Path(args.write), args.layers, args.experts)
        return
    torch.set_num_threads(args.threads)
    if kernels.ops() is None:
        raise SystemExit(f"needs the compiled kernels: {kernels.description()}")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ffn.safetensors"
        # written by a child process: memory this process freed would be reused by the loads without showing
        subprocess.run([sys.executable, __file__, "--write", str(path), "--layers", str(args.layers),
                        "--experts", str(args.experts)] + (["--release-shapes"] if args.release_shapes else []),
                       check=True)
        from safetensors import safe_open

        ckpt_bytes = path.stat().st_size
        with testing.standalone_model_parallel():
            testing.loaded_linear(torch.zeros(256, 256, dtype=torch.bfloat16))  # vLLM's set-up, GEMM libraries
            gc.collect()
            rss0 = rss_anon()
            with safe_open(str(path), "pt") as f:
                fp8 = Fp8Side(f, args.layers, args.experts)
            gc.collect()
            rss_fp8 = rss_anon() - rss0
            with safe_open(str(path), "pt") as f:
                bf16 = Bf16Side(f, args.layers, args.experts)
            gc.collect()
            rss_bf16 = rss_anon() - rss0 - rss_fp8
    # As vLLM's engine does once the model is loaded (freeze_gc_heap): collections of the oldest generation would
    # otherwise walk torch's and vLLM's objects inside timed steps (8 % of a batch-1 step loop's samples).
    gc.freeze()

    as_avx2 = avx2_only.describe() if args.as_avx2_cpu else ""
    print(f"# FP8-resident FFN decode step on CPU{as_avx2}: {kernels.description()}; torch {torch.__version__}, "
          f"{args.threads} threads, {allocator.describe()}; bf16 linears on {testing.linear_gemm_name(bf16.layers[0][1])}")
    print(f"# {args.layers} layers (1 dense + {args.layers - 1} MoE), {args.experts} experts top-{TOPK} + 1 shared, "
          f"hidden {HIDDEN}, expert intermediate {MOE_INTER}; checkpoint {ckpt_bytes / 2**20:.1f} MiB; "
          f"RSS after load: fp8 {rss_fp8 / 2**20:.1f} MiB ({rss_fp8 / ckpt_bytes:.2f}x checkpoint), "
          f"bf16 {rss_bf16 / 2**20:.1f} MiB ({rss_bf16 / ckpt_bytes:.2f}x)\n")
    sides, base = [bf16, fp8], ""
    if args.base:
        from bench_kernel_ab import build_base

        with tempfile.TemporaryDirectory(prefix="glm53-base-") as tmp:
            lib = build_base(args.base, kernels.isa(), Path(tmp))
        sides += [OnKernels(fp8, lib), OnKernels(bf16, lib)]
        base = "".join(f" | {name} step on {args.base}'s kernels (ms) | {args.base} / this tree (max rel. difference)"
                       for name in ("fp8", "bf16"))
    print("| batch | bf16 step (ms) | fp8 step (ms) | speed-up | fp8 bytes read (MiB) | fp8 floor (ms) "
          "| fp8 / floor | fp8 step, weights cached (ms) | bf16 floor (ms) | bf16 / floor "
          "| read bandwidth during the steps (GB/s) "
          f"| max rel. err: fp8 (float32 / bf16 activations) / bf16{base} |")
    print("|---" * (12 + 4 * bool(args.base)) + "|")
    for T in args.batches:
        errors = check(fp8, bf16, args.layers, args.experts, T)
        times, bw = median_steps(sides, torch.bfloat16, T, args.layers, args.experts, args.repeat, seed=T)
        t_bf16, t_fp8 = times[:2]
        routing = make_routing(args.layers, args.experts, T, torch.Generator().manual_seed(T))
        b_fp8, b_bf16 = fp8.bytes_read(routing), bf16.bytes_read(routing)
        cached = "-"
        if b_fp8 <= caches.L3_BYTES:
            [t_cached], _ = median_steps([fp8], torch.bfloat16, T, args.layers, args.experts, args.repeat, seed=T,
                                         cached=True)
            cached = f"{t_cached * 1e3:.2f}"
        row = (f"| {T} | {t_bf16 * 1e3:.2f} | {t_fp8 * 1e3:.2f} | {t_bf16 / t_fp8:.2f}x | {b_fp8 / 2**20:.1f} "
               f"| {b_fp8 / bw * 1e3:.2f} | {t_fp8 / (b_fp8 / bw):.2f} | {cached} "
               f"| {b_bf16 / bw * 1e3:.2f} | {t_bf16 / (b_bf16 / bw):.2f} | {bw / 1e9:.1f} "
               f"| {' / '.join(f'{e:.1e}' for e in errors)} |")
        if args.base:
            x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(7)).bfloat16()
            for tree, on_base, t_tree, t_base in ((fp8, sides[2], t_fp8, times[2]), (bf16, sides[3], t_bf16, times[3])):
                want, got = tree.step(x, routing).float(), on_base.step(x, routing).float()
                diff = ((got - want).abs().max() / want.abs().max()).item()
                row += f" {t_base * 1e3:.2f} | {t_base / t_tree:.2f}x ({diff:.1e}) |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
