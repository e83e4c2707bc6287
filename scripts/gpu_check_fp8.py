#!/usr/bin/env python3
"""GPU check of native FP8 serving: a block-FP8 tiny checkpoint through vLLM's CUDA FP8 kernels, against the
result of the CPU path (weights dequantized at load).

    python scripts/gpu_check_fp8.py --make-expected FILE.json     # CPU machine (.venv): the CPU result
    python scripts/gpu_check_fp8.py [--expected FILE.json] [--checkpoint DIR]     # GPU machine

The checkpoint (built by the tiny builder from a fixed seed, so both machines get the same bytes, unless
``--checkpoint`` is given) has kernel-friendly dimensions: every FP8 GEMM dimension is a multiple of 128, as
vLLM's block-FP8 linear and fused-MoE kernels need whole 128x128 blocks. On the GPU the plugin's plan must pick
the native kernels (its log line says so: ``fp8 checkpoint, ... native kernels``); greedy generation in bfloat16
is compared with ``--expected`` when given, else with the plugin's unquantized path on the same GPU serving the
checkpoint's dequantized twin (the CPU path's weights). FP8 activations (1x128 groups) are a legitimate
difference, so the criteria are: identical first tokens, first-token logprobs within 0.1, and the share of
identical tokens reported.

Without a CUDA device, or without vLLM, the script prints SKIP and exits 0. Nothing here was run on a GPU when it
was written (no device was available); treat a first failure as possibly the script's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Every FP8 GEMM dimension a multiple of 128: hidden, dense and per-expert intermediate sizes.
FP8_FRIENDLY = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256, "n_routed_experts": 8}
PROMPT_LENGTHS = [5, 40, 130, 300]
MAX_TOKENS = 16
SEED = 7


def build(workdir: Path) -> Path:
    from vllm_glm53.tiny import build_checkpoint

    return build_checkpoint(workdir / "fp8", FP8_FRIENDLY, seed=SEED, dtype="bfloat16", fp8=True)


def dequantized_twin(src: Path, dst: Path) -> Path:
    """``src`` with every FP8 weight replaced by its bfloat16 value and no quantization_config."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_glm53.quant.fp8_block import dequantize_block_fp8

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        scale = tensors.get(name[: -len("weight")] + "weight_scale_inv")
        if not name.endswith(".weight_scale_inv"):
            out[name] = dequantize_block_fp8(t, scale, dtype=torch.bfloat16) if scale is not None else t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def prompts(checkpoint: Path) -> list[list[int]]:
    from importlib import resources

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    ids = tok.encode(resources.files("vllm_glm53.data").joinpath("tiny_corpus.txt").read_text() * 4,
                     add_special_tokens=False)
    return [ids[97 * i : 97 * i + n] for i, n in enumerate(PROMPT_LENGTHS)]


def generate(checkpoint: Path, token_prompts: list[list[int]]) -> list[dict]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(checkpoint), dtype="bfloat16", max_model_len=1024, enforce_eager=True,
              enable_prefix_caching=False, limit_mm_per_prompt={"image": 0, "video": 0}, seed=0)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params)
    results = []
    for o in outs:
        c = o.outputs[0]
        results.append({"token_ids": list(c.token_ids),
                        "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]})
    del llm
    return results


def compare(got: list[dict], want: list[dict]) -> bool:
    ok = True
    same = total = 0
    print("| prompt | first token (gpu / ref) | first logprob diff | identical tokens |")
    for i, (g, w) in enumerate(zip(got, want)):
        n = sum(a == b for a, b in zip(g["token_ids"], w["token_ids"]))
        same, total = same + n, total + len(w["token_ids"])
        diff = abs(g["logprobs"][0] - w["logprobs"][0])
        print(f"| {i} | {g['token_ids'][0]} / {w['token_ids'][0]} | {diff:.4f} | {n}/{len(w['token_ids'])} |")
        ok &= g["token_ids"][0] == w["token_ids"][0] and diff <= 0.1
    print(f"identical tokens overall: {same}/{total}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-expected", type=Path, help="write the CPU result here (run on the CPU machine)")
    parser.add_argument("--expected", type=Path, help="the CPU result to compare with")
    parser.add_argument("--checkpoint", type=Path, help="an FP8 checkpoint to use instead of building one")
    args = parser.parse_args()

    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"SKIP: {e}")
        return 0
    if not args.make_expected and not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or build(Path(tmp))
        token_prompts = prompts(checkpoint)
        if args.make_expected:
            args.make_expected.write_text(json.dumps(generate(checkpoint, token_prompts)))
            print(f"wrote the CPU result to {args.make_expected}")
            return 0
        got = generate(checkpoint, token_prompts)
        if args.expected:
            want = json.loads(args.expected.read_text())
            print("reference: --expected (CPU path)")
        else:
            want = generate(dequantized_twin(checkpoint, Path(tmp) / "twin"), token_prompts)
            print("reference: the dequantized twin on this GPU (the plugin's unquantized path)")
    ok = compare(got, want)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
