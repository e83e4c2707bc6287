"""The vision path: images/s through the tower and time to first token of an image prompt, the plugin on
vLLM next to transformers, same weights, same machine.

    .venv/bin/python benchmarks/bench_vision.py [--sizes 224 448 896] [--batch 4] [--repeat 3]
                                                [--ttft-size 448] [--ttft-repeat 5] [--threads N]

1. Tower: ``Glm5NextVisionTower`` (vLLM's parallel layers at TP=1, outside an engine) and transformers'
   ``Glm5NextVisionModel`` on identical weights, a batch of ``--batch`` square images per call (patches as
   the processor lays them out, random values), float32; images/s from the median of ``--repeat`` calls of
   each, alternated, after checking that both give the same image features.
2. Time to first token: one prompt with one ``--ttft-size`` image and a short text, one new token, through
   ``vllm.LLM.generate`` (child process, after a warm-up request) and through transformers (its PIL image
   processor, then ``generate``); each the median of ``--ttft-repeat`` requests, a new image every time so
   that no cache answers. Both include preprocessing.

The tower is mid-sized (``BENCH_VISION``: depth 4, width 256, 4 heads, MLP 1024; the released one is depth 24,
width 1024) so that the table finishes in a minute or two on a small CPU; the text model is the tiny one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import binding  # noqa: E402  (this directory's)

binding.as_recipe()

import allocator  # noqa: E402  (this directory's)

allocator.same_as_engine()  # before torch: the script may start over under the engine's allocator

BENCH_VISION = {"depth": 4, "hidden_size": 256, "num_heads": 4, "intermediate_size": 1024,
                "projection_intermediate_size": 1024, "initializer_range": 0.05}
PROMPT = "Describe <|begin_of_image|><|image|><|end_of_image|> in a few words, please."


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_image(size: int, seed: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


# ---------------------------------------------------------------------------------------------------------
# 1. tower images/s
# ---------------------------------------------------------------------------------------------------------


def bench_tower(model_dir: Path, sizes: list[int], batch: int, repeat: int) -> list[dict]:
    import numpy as np
    import torch
    from transformers import AutoConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    from vllm_glm53 import testing
    from vllm_glm53.model.multimodal import IMAGE_DEFAULTS, preprocess_image
    from vllm_glm53.model.vision import Glm5NextVisionTower, vision_arch

    config = AutoConfig.from_pretrained(str(model_dir))
    hf = Glm5NextVisionModel._from_config(config.vision_config, dtype=torch.float32).eval()
    rows = []
    with testing.standalone_model_parallel(), torch.no_grad():
        tower = Glm5NextVisionTower(vision_arch(config))
        tower.load_weights(hf.state_dict().items())
        testing.finish_loading(tower)
        for size in sizes:
            done = [preprocess_image(random_image(size, i), IMAGE_DEFAULTS) for i in range(batch)]
            pixels = torch.from_numpy(np.concatenate([p for p, _ in done]))
            grids = [g for _, g in done]
            # Warm-up, and the two must compute the same features before their times mean anything.
            got = tower(pixels, grids)
            want = hf(pixels, grid_thw=torch.tensor(grids)).pooler_output
            err = (got - want).abs().max().item()
            if not err <= 1e-4 * want.abs().max().item():
                raise SystemExit(f"{size}px: the tower's features differ from transformers' (max {err:.3g})")
            # Alternate the two so that both see the same background load on a shared machine.
            plugin_times, hf_times = [], []
            for _ in range(repeat):
                plugin_times.append(median_seconds(lambda: tower(pixels, grids), 1))
                hf_times.append(median_seconds(lambda: hf(pixels, grid_thw=torch.tensor(grids)), 1))
            t_plugin, t_hf = statistics.median(plugin_times), statistics.median(hf_times)
            t, h, w = grids[0]
            rows.append({"size": size, "patches": t * h * w, "tokens": t * h * w // 4,
                         "plugin": batch / t_plugin, "hf": batch / t_hf})
    return rows


# ---------------------------------------------------------------------------------------------------------
# 2. time to first token
# ---------------------------------------------------------------------------------------------------------

_VLLM_CHILD = r"""
import json, statistics, sys, time
import numpy as np
from PIL import Image
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams

def main():
    model, prompt, size, repeat, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    ids = AutoTokenizer.from_pretrained(model).encode(prompt, add_special_tokens=False)
    llm = LLM(model=model, max_model_len=4096, enforce_eager=True, enable_prefix_caching=False, dtype="float32",
              limit_mm_per_prompt={"image": 1, "video": 0})
    params = SamplingParams(max_tokens=1, temperature=0.0)
    def request(seed):
        image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}], params, use_tqdm=False)
        return time.perf_counter() - t0
    request(10_000)
    json.dump({"ttft": statistics.median(request(i) for i in range(repeat))}, open(out, "w"))

if __name__ == "__main__":
    main()
"""


def ttft_vllm(model_dir: Path, size: int, repeat: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        proc = subprocess.run([sys.executable, "-c", _VLLM_CHILD, str(model_dir), PROMPT, str(size), str(repeat),
                               str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"vLLM run failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())["ttft"]


def ttft_transformers(model_dir: Path, size: int, repeat: int) -> float:
    import torch
    from transformers import AutoTokenizer, Glm5NextForConditionalGeneration
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    model = Glm5NextForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    image_processor = Glm5NextImageProcessorPil()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def request(seed):
        # What Glm5NextProcessor does for one image (it cannot be built here without a video processor).
        t0 = time.perf_counter()
        pixels = image_processor(images=[random_image(size, seed)], return_tensors="pt")
        n = int(pixels["image_grid_thw"][0].prod()) // 4
        ids = tokenizer(PROMPT.replace("<|image|>", "<|image|>" * n), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                           pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        return time.perf_counter() - t0

    request(10_000)
    return statistics.median(request(i) for i in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 896])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ttft-size", type=int, default=448)
    parser.add_argument("--ttft-repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    import torch

    from vllm_glm53.tiny import build_checkpoint

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_checkpoint(Path(d) / "ckpt", overrides={"vision_config": BENCH_VISION})
        rows = bench_tower(model_dir, args.sizes, args.batch, args.repeat)
        vllm_s = ttft_vllm(model_dir, args.ttft_size, args.ttft_repeat)
        hf_s = ttft_transformers(model_dir, args.ttft_size, args.ttft_repeat)

    v = BENCH_VISION
    print(f"\nvision tower (depth {v['depth']}, width {v['hidden_size']}, {v['num_heads']} heads), float32, "
          f"batches of {args.batch} images, {args.threads} threads")
    print(f"{'image':>9} {'patches':>8} {'tokens':>7} {'plugin img/s':>13} {'transformers img/s':>19} {'ratio':>6}")
    for r in rows:
        print(f"{r['size']:>4}x{r['size']:<4} {r['patches']:>8} {r['tokens']:>7} {r['plugin']:>13.2f} "
              f"{r['hf']:>19.2f} {r['plugin'] / r['hf']:>6.2f}")
    print(f"\ntime to first token, one {args.ttft_size}x{args.ttft_size} image + text, preprocessing included "
          f"(median of {args.ttft_repeat}; vLLM's worker on VLLM_CPU_OMP_THREADS_BIND="
          f"{os.environ[binding.VAR]}, transformers on {args.threads} threads; {allocator.describe()})")
    print(f"{'vLLM + plugin':>20}: {1000 * vllm_s:8.1f} ms")
    print(f"{'transformers':>20}: {1000 * hf_s:8.1f} ms   (ratio {hf_s / vllm_s:.2f}x)")


if __name__ == "__main__":
    main()
