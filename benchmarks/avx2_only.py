"""``--as-avx2-cpu`` of the benchmarks: measure, on a CPU with AVX-512 (and native bfloat16), what an AVX2-only CPU
runs. The plugin loads its ``avx2`` kernels (``VLLM_GLM53_CPU_ISA``), torch's own kernels stay on AVX2
(``ATEN_CPU_CAPABILITY``) and oneDNN's too (``ONEDNN_MAX_CPU_ISA``: vLLM's bfloat16 GEMM then cannot be built and
torch's converts inside, as on such a CPU, and the plugin, which follows that cap, moves 16-bit linears to
``linear16`` as it does there). The arithmetic is an AVX2 CPU's; the memory system and the clock stay this
machine's. Set before torch is imported; child processes (vLLM's engine, transformers) inherit it.
(``VLLM_GLM53_CPU_ISA=avx2`` alone forces only the plugin's kernels and leaves torch's native bfloat16 GEMMs.)
"""

import os

FLAG = "--as-avx2-cpu"
ENV = {"VLLM_GLM53_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
HELP = "run as an AVX2-only CPU would (benchmarks/avx2_only.py)"


def apply() -> None:
    """Set the environment (replacing any VLLM_GLM53_CPU_ISA given)."""
    os.environ.update(ENV)


def describe() -> str:
    return f" as an AVX2-only CPU ({', '.join(f'{k}={v}' for k, v in ENV.items())})"
