"""Loading a native FP8 checkpoint on CPU: peak memory and time of the plugin's streaming dequantization,
side by side with dequantizing the whole checkpoint first.

    .venv/bin/python benchmarks/bench_fp8_load.py [--hidden 1024] [--experts 32] [--moe-inter 256]
                                                  [--dtype bfloat16] [--workdir DIR]

An FP8 checkpoint is built with the tiny builder at a larger width (MLP and expert weights block FP8, as in the
release), then the plugin's model is built in this process (as vLLM's loader builds it) and loaded twice:

* ``streaming (plugin)``: vLLM's safetensors iterator into ``load_weights``; each FP8 weight is paired with its
  scale and dequantized into the model dtype as it arrives.
* ``dequantize first``: the same tensors, all dequantized into a dict before ``load_weights`` sees any (what a
  loader without the pairing would hold at once).

Each load runs in a fresh process (memory freed by an earlier model would be reused without showing).
Memory is that process's anonymous resident set (``RssAnon``: file-backed safetensors pages excluded),
sampled every millisecond from a thread, counted from just after the model is built; parameters are allocated
untouched, so the resident set grows to the final size during loading. ``overhead`` = peak - final parameter
bytes. Each cell is the median of ``--repeat`` runs per mode (the machine may be shared), and every run's loaded
parameters are hashed: the two modes must load the same bytes, or the script stops.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The dequantize-at-load path (what runs without the compiled kernels); with them an FP8 checkpoint stays FP8,
# measured by bench_fp8_resident.py.
os.environ["VLLM_GLM53_CPU_KERNELS"] = "0"
import allocator  # noqa: E402  (this directory's)

allocator.same_as_engine()  # before torch: the script may start over under the engine's allocator

import torch  # noqa: E402


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    def __init__(self, period: float = 1e-3) -> None:
        self.period, self.peak, self._stop = period, 0, threading.Event()

    def __enter__(self):
        self.peak = rss_anon()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.period)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def build_checkpoint(workdir: Path, args) -> Path:
    from vllm_glm53.tiny import build_checkpoint as build

    overrides = {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
                 "moe_intermediate_size": args.moe_inter, "n_routed_experts": args.experts}
    return build(workdir / "fp8", overrides, seed=0, dtype=args.dtype, fp8=True)


def load_once(path: Path, dtype: str, dequantize_first: bool) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    from vllm_glm53 import testing
    from vllm_glm53.model import Glm5NextForConditionalGeneration
    from vllm_glm53.quant.fp8 import Fp8Pairing

    config = EngineArgs(model=str(path), dtype=dtype, max_model_len=512, enforce_eager=True,
                        enable_prefix_caching=False, limit_mm_per_prompt={"image": 0, "video": 0}
                        ).create_engine_config()
    files = sorted(glob.glob(f"{path}/*.safetensors"))
    with testing.standalone_model_parallel(), set_current_vllm_config(config):
        torch.set_default_dtype(config.model_config.dtype)
        model = Glm5NextForConditionalGeneration(vllm_config=config)
        final = sum(p.numel() * p.element_size() for p in model.parameters())
        baseline = rss_anon()
        t0 = time.perf_counter()
        with PeakSampler() as sampler:
            weights = safetensors_weights_iterator(files, False)
            if dequantize_first:
                pairing, held = Fp8Pairing(), []
                for name, tensor in weights:
                    if Fp8Pairing.wants(name, tensor):
                        paired = pairing.add(name, tensor)
                        if paired is None:
                            continue
                        name, tensor = paired[0], paired[1].dequantize(config.model_config.dtype)
                    held.append((name, tensor))
                weights = iter(held)
            model.load_weights(weights)
            weights = held = None
        seconds = time.perf_counter() - t0
        digest = hashlib.sha256()
        for name, param in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
        config.compilation_config.static_forward_context.clear()
    del model
    return {"final": final, "peak": sampler.peak - baseline, "seconds": seconds, "digest": digest.hexdigest()}


def child_run(path: Path, dtype: str, dequantize_first: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", str(path), "--dtype", dtype]
    cmd += ["--first"] if dequantize_first else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--moe-inter", type=int, default=256)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # one load in this process, JSON out
    parser.add_argument("--first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.child:
        print(json.dumps(load_once(args.child, args.dtype, args.first)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        path = build_checkpoint(workdir, args)
        on_disk = sum(os.path.getsize(f) for f in glob.glob(f"{path}/*.safetensors"))
        largest = 0
        from safetensors import safe_open

        with safe_open(glob.glob(f"{path}/*.safetensors")[0], "pt") as f:
            for name in f.keys():
                if name.endswith(".weight_scale_inv"):
                    shape = f.get_slice(name[: -len("_scale_inv")]).get_shape()
                    largest = max(largest, shape[0] * shape[1])
        elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
        rows = {}
        for mode, first in (("streaming (plugin)", False), ("dequantize first", True)):
            runs = [child_run(path, args.dtype, first) for _ in range(args.repeat)]
            rows[mode] = {"final": runs[0]["final"], "digests": {r["digest"] for r in runs},
                          "peak": statistics.median(r["peak"] for r in runs),
                          "seconds": statistics.median(r["seconds"] for r in runs)}
        if len(set.union(*(r["digests"] for r in rows.values()))) != 1:
            raise SystemExit("the two loads left different parameters; their memory and times would not compare")

    final = rows["streaming (plugin)"]["final"]
    print(f"\nFP8 checkpoint: {fmt(on_disk)} on disk; model parameters ({args.dtype}): {fmt(final)}; "
          f"largest FP8 weight dequantized: {fmt(largest * elem)}")
    print(f"hidden {args.hidden}, {args.experts} experts x {args.moe_inter}, torch threads "
          f"{torch.get_num_threads()}, {allocator.describe()}\n")
    print(f"| {'mode':<20} | {'peak (RssAnon)':>14} | {'overhead':>12} | {'peak / final':>12} | {'load time':>9} |")
    print(f"|{'-' * 22}|{'-' * 16}|{'-' * 14}|{'-' * 14}|{'-' * 11}|")
    for mode, r in rows.items():
        print(f"| {mode:<20} | {fmt(r['peak']):>14} | {fmt(r['peak'] - r['final']):>12} | "
              f"{r['peak'] / r['final']:>12.3f} | {r['seconds']:>8.2f}s |")


if __name__ == "__main__":
    sys.exit(main())
