"""Two builds of the CPU kernels in one process: this tree's and a git revision's, called in turn (each side in
each position and after each other side as often: orders.py) on the same inputs with the caches flushed before
each call, so that both see the same moments of a host whose speed drifts (on the shared VMs this project is
measured on, separate runs of one build differ by up to 2x).

    .venv/bin/python benchmarks/bench_kernel_ab.py [--base HEAD] [--tokens 2 4 6 8 ...] [--repeat 15]

The revision's ``csrc/`` is compiled with the flags this tree's build uses for the loaded library's instruction set
(``VLLM_GLM53_CPU_ISA`` picks another) and registered as ``torch.ops.vllm_glm53_base``. Ops, at the released model's
sizes with block-FP8 weights (random values quantized by block) and bfloat16 tokens: ``fp8_linear`` 12288 x 4096
(a fused gate|up of the dense layers, 50 MB of E4M3) at M tokens, and ``moe_experts_fp8`` for 4 experts (D 4096,
I 2048: 100 MB) with M tokens each, and ``linear16`` on the linear's weight dequantized to bfloat16 (what a bfloat16
model's linears run on CPUs without bfloat16 dot products; its row pairs' prefetch regressed unnoticed for a day,
2477e34). A third side, timed in the same turns, runs what the dequantize-at-load model runs on the same weights in
bfloat16 (twice the bytes): ``moe_experts``, and the linear as the model's layer runs it (``testing.loaded_linear``:
vLLM's oneDNN GEMM where the CPU multiplies bfloat16 natively, else ``linear16``).
Medians of ``--repeat`` calls per side (rounded up to whole cycles of orders.py's orders); the last column compares
the two builds' outputs (relative max difference: zero where the arithmetic is the same).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import allocator  # this directory's

allocator.same_as_engine()  # before torch: the script may start over under the engine's allocator

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import caches  # noqa: E402
from orders import balanced_orders, whole_cycles  # noqa: E402
from vllm_glm53 import testing  # noqa: E402
from vllm_glm53.backends.cpu import build, kernels  # noqa: E402
from vllm_glm53.quant.fp8_block import dequantize_block_fp8, quantize_block_fp8  # noqa: E402

NAMESPACE = "vllm_glm53_base"


def build_base(rev: str, isa: str, out_dir: Path) -> object:
    """``rev``'s kernels for ``isa``, loaded as torch.ops.vllm_glm53_base."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "csrc"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(out_dir, filter="data")
    src = out_dir / "csrc"
    registration = src / "registration.cpp"
    text = registration.read_text()
    renamed = text.replace("TORCH_LIBRARY(vllm_glm53,", f"TORCH_LIBRARY({NAMESPACE},").replace(
        "TORCH_LIBRARY_IMPL(vllm_glm53,", f"TORCH_LIBRARY_IMPL({NAMESPACE},")
    if renamed.count(NAMESPACE) != 2:
        raise SystemExit(f"{rev}: csrc/registration.cpp does not register the ops as this script expects")
    registration.write_text(renamed)
    target = out_dir / f"base.{isa}.so"
    build.compile_library(isa, target, src=src)
    torch.ops.load_library(str(target))
    return getattr(torch.ops, NAMESPACE)


def compare(calls: dict, repeat: int) -> dict:
    """Median seconds of each side's calls, caches flushed before each, the sides in orders.py's balanced orders
    for ``repeat`` rounds rounded up to whole cycles of them: on the Zen 5 VM an FP8 call right after the bfloat16
    side's (twice the bytes, another kernel) ran 8-19 % slower than right after the other build's, and alternating
    the order of three sides put this tree's build after it every other round and the base's never (identical
    kernels printed 0.85-0.91x at one token, then 0.99-1.02x)."""
    times = {name: [] for name in calls}
    names = list(calls)
    orders = balanced_orders(len(names))
    for i in range(whole_cycles(repeat, len(names))):
        for name in (names[s] for s in orders[i % len(orders)]):
            caches.flush()
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision to compare with (default HEAD)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2, 4, 6, 8, 10, 12, 14, 16])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tree = kernels.ops()
    if tree is None:
        raise SystemExit(f"needs the compiled kernels: {kernels.description()}")
    with tempfile.TemporaryDirectory(prefix="glm53-base-") as tmp:
        libs = {"base": build_base(args.base, kernels.isa(), Path(tmp)), "tree": tree}

    gen = torch.Generator().manual_seed(0)
    D, N, I, E, block = 4096, 12288, 2048, 4, 128

    def quantized(experts, n, k):
        """Block-quantized random weights, as a checkpoint holds them: a block's largest value is 448 and E4M3
        subnormals are as rare as there (~1e-4 of the values; a plain cast of random values makes ~12% of them
        subnormal, which a conversion with a slow path for them would be timed on)."""
        pairs = [quantize_block_fp8(torch.randn(n, k, generator=gen) / k**0.5, (block, block)) for _ in range(experts)]
        return torch.stack([w for w, _ in pairs]), torch.stack([s for _, s in pairs])

    def dequantized(w, s):  # a stack of experts, as the dequantize-at-load path holds it
        return torch.stack([dequantize_block_fp8(w_e, s_e, (block, block)) for w_e, s_e in zip(w, s)])

    (w,), (s,) = quantized(1, N, D)
    w13, s13 = quantized(E, 2 * I, D)
    w2, s2 = quantized(E, D, I)
    w_bf16, w13_bf16, w2_bf16 = dequantize_block_fp8(w, s, (block, block)), dequantized(w13, s13), dequantized(w2, s2)
    with testing.standalone_model_parallel():
        linear_bf16 = testing.loaded_linear(w_bf16)
    short = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.base], capture_output=True,
                           text=True).stdout.strip()
    print(f"# {kernels.description()}; base {args.base} ({short}) against this tree; {torch.get_num_threads()} "
          f"threads, {allocator.describe()}, caches flushed, medians of {whole_cycles(args.repeat, 3)}\n")
    print("| op | tokens | base (ms) | this tree (ms) | base / this tree | outputs: max rel. difference | bfloat16 "
          "weights (ms) | bfloat16 / this tree |")
    print("|---|---|---|---|---|---|---|---|")
    for M in args.tokens:
        x = torch.randn(M, D, generator=gen).bfloat16()
        ids = torch.arange(E, dtype=torch.int32).repeat(M, 1)  # every token to all E experts: M tokens each
        weights = torch.rand(M, E, generator=gen)
        ops = [(f"fp8_linear {N} x {D}", lambda lib: lib.fp8_linear(x, w, s, [N], block, block),
                lambda: linear_bf16(x)[0]),
               (f"moe_experts_fp8, {E} experts",
                lambda lib: lib.moe_experts_fp8(x, w13, s13, w2, s2, ids, weights, 10.0, block, block),
                lambda: tree.moe_experts(x, w13_bf16, w2_bf16, ids, weights, 10.0)),
               (f"linear16 {N} x {D}, bfloat16 weight", lambda lib: lib.linear16(x, w_bf16), lambda: linear_bf16(x)[0])]
        for name, call, call_bf16 in ops:
            t = compare({"base": lambda: call(libs["base"]), "tree": lambda: call(libs["tree"]), "bf16": call_bf16},
                        args.repeat)
            base, this = (call(libs[side]).float() for side in ("base", "tree"))
            diff = ((base - this).abs().max() / base.abs().max()).item()
            print(f"| {name} | {M} | {t['base'] * 1e3:.3f} | {t['tree'] * 1e3:.3f} | {t['base'] / t['tree']:.2f}x | "
                  f"{diff:.1e} | {t['bf16'] * 1e3:.3f} | {t['bf16'] / t['tree']:.2f}x |")


if __name__ == "__main__":
    main()
