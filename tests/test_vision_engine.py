"""Images and videos end to end: vLLM + the plugin against transformers' ``generate`` on the same checkpoint.

The reference prompts come from transformers' own ``Glm5NextProcessor`` (its PIL image processor and its
video processor, run as in ``test_vision_processor.hf_reference``): expanded token ids and pixel values go to
``Glm5NextForConditionalGeneration.generate``; vLLM gets the unexpanded prompt and the raw media. Expanded
prompt ids and greedy tokens must be identical, logprobs close. One engine start serves every multimodal
case batched with text-only prompts; a second one serves the same batch with pipeline parallel 2; a third checks
that ``--limit-mm-per-prompt`` zero limits build no vision tower and still serve text (the mixed-length parity
batch of test_model_parity, on this nested checkpoint).

The checkpoint's vision weights are initialised at std 0.1 so that image features are of the size of token
embeddings (with the default 0.02 they are ~1e-3 and would barely move the logits).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TESTS, EngineRunError, hf_model, probe, prompt_set
from test_model_parity import LENGTHS as PARITY_LENGTHS
from test_model_parity import MAX_TOKENS as PARITY_MAX_TOKENS
from test_vision_processor import VISION_CKPT, hf_reference, random_frames

pytestmark = pytest.mark.engine

IMG = "<|begin_of_image|><|image|><|end_of_image|>"
VID = "<|begin_of_video|><|video|><|end_of_video|>"
LOGPROB_ATOL = 2e-4
MAX_TOKENS = 10


def rgb(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


# Media: images below, inside and above nothing special (upscaled, padded, thin); a clip sampled at 2 fps
# from its metadata (20 frames at 8 fps -> 6 frames, 3 temporal patches; 60×80 frames need no resizing).
IMAGES = {"a": rgb(60, 90, 1), "b": rgb(150, 100, 2), "c": rgb(40, 200, 3)}
VIDEO = (random_frames(20, 60, 80, seed=4), {"fps": 8.0, "duration": 2.5, "total_num_frames": 20})

CASES = [  # (text, images, videos)
    (f"Describe {IMG} please.", ["a"], 0),
    (f"{IMG} and {IMG} differ how?", ["b", "c"], 0),
    (f"{VID} What happens here?", [], 1),
    (f"First {IMG} then a few words of text {IMG} and the end.", ["b", "a"], 0),
    (f"Look {IMG} and watch {VID} now.", ["c"], 1),
]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("vision", **VISION_CKPT)


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


@pytest.fixture(scope="module")
def reference(ckpt):
    """transformers' processor outputs per multimodal case, and the HF model."""
    jobs = [("processor", (str(ckpt), text, [IMAGES[k] for k in imgs], [VIDEO] * vids))
            for text, imgs, vids in CASES]
    return hf_reference(jobs), hf_model(ckpt)


def hf_greedy_mm(model, inputs: dict, max_tokens: int) -> dict:
    ids = inputs["input_ids"]
    extra = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
             if k in inputs}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **extra)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    lps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, tokens)]
    return {"token_ids": tokens, "logprobs": lps}


def run_mm_engine(model, prompts, mm_data, max_tokens, engine, rejected=(), probe=None, env=None) -> dict:
    """``tests/engine_runner.py`` with media written to ``.npy`` files."""
    with tempfile.TemporaryDirectory() as d:
        def save(array, name):
            path = os.path.join(d, f"{name}.npy")
            np.save(path, array)
            return path

        def entry(images, videos, tag):
            if not images and not videos:
                return None
            return {"image": [save(IMAGES[k], k) for k in images],
                    "video": [{"frames": save(VIDEO[0], f"video{tag}{i}"), "metadata": VIDEO[1]}
                              for i in range(videos)]}

        spec = {
            "model": str(model), "prompts": prompts, "engine": engine,
            "max_tokens": max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts),
            "logprobs": 1, "mm_data": [entry(*m, i) if m else None for i, m in enumerate(mm_data)],
            "rejected": [{"prompt": p, "mm_data": entry(*m, f"r{i}")} for i, (p, m) in enumerate(rejected)],
            **({"probe": probe} if probe else {}),
        }
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, str(TESTS / "engine_runner.py"), str(spec_path), str(out_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                              env={**os.environ, **(env or {})})
        if proc.returncode != 0:
            raise EngineRunError(proc.returncode, proc.stdout)
        return json.loads(out_path.read_text())


def assert_same_generation(got: dict, want: dict, label: str) -> None:
    assert got["token_ids"] == want["token_ids"], \
        f"{label}: vLLM {got['token_ids']} != transformers {want['token_ids']}"
    diffs = [abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])]
    assert max(diffs) < LOGPROB_ATOL, f"{label}: logprob differences {diffs}"


def test_images_change_the_reference_output(reference):
    """Guard for the parity test below: the images really steer the model (a different image moves the
    next-token logits by far more than the tolerance), so equal tokens mean equal image features."""
    outs, model = reference
    inputs = outs[0]
    with torch.no_grad():
        base = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                     image_grid_thw=inputs["image_grid_thw"]).logits[0, -1]
        other = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"].flip(0),
                      image_grid_thw=inputs["image_grid_thw"]).logits[0, -1]
    assert (base - other).abs().max() > 0.05


@pytest.fixture(scope="module")
def batch(ckpt, tokenizer, reference):
    """Every multimodal case and two text prompts: vLLM's prompts and media, and transformers' expanded prompt ids
    and greedy outputs."""
    outs, model = reference
    texts = prompt_set(ckpt, [7, 40])
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text, _, _ in CASES] + texts
    mm = [(imgs, vids) for _, imgs, vids in CASES] + [None] * len(texts)
    want_ids = [o["input_ids"][0].tolist() for o in outs] + texts
    want = [hf_greedy_mm(model, o, MAX_TOKENS) for o in outs]
    want += [hf_greedy_mm(model, {"input_ids": torch.tensor([t])}, MAX_TOKENS) for t in texts]
    return prompts, mm, want_ids, want


def test_images_and_videos_match_transformers(ckpt, tokenizer, batch):
    prompts, mm, want_ids, want = batch
    three_images = tokenizer.encode(f"{IMG}{IMG}{IMG}", add_special_tokens=False)
    got = run_mm_engine(ckpt, prompts, mm, MAX_TOKENS,
                        engine={"max_num_seqs": 3, "limit_mm_per_prompt": {"image": 2, "video": 1}},
                        rejected=[(three_images, (["a", "b", "c"], 0))], probe=probe("model_attributes", paths=["visual.__class__.__name__"]))

    for i, (g, w, ids) in enumerate(zip(got["outputs"], want, want_ids)):
        assert g["prompt_token_ids"] == ids, f"prompt {i}: vLLM's expansion differs from transformers' processor"
        assert_same_generation(g, w, f"prompt {i}")
    assert got["probe"] == [{"visual.__class__.__name__": "Glm5NextVisionTower"}]
    # Over the limit: refused with the message the OpenAI server returns as a 400.
    [error] = got["rejected"]
    assert error.startswith("VLLMValidationError: At most 2 image(s) may be provided in one prompt.")


def test_images_and_videos_under_pipeline_parallel_match_transformers(ckpt, batch):
    """PP 2 (the mp executor, one core per stage), split 4 | 1: the vision tower runs on the first stage with the
    embedding, and the merged image and video embeddings cross the stage boundary inside the mHC streams; the
    second stage starts with the ``shared`` sparse-MLA layer 4, so the selection of layer 3's indexer crosses
    too. Each stage builds only its layers and only the first a tower. (Prefix caching off: a stage of sparse-MLA
    layers only has no KDA state for it, see tests/test_serving.py; tests/test_parallel.py runs PP with caching.)"""
    prompts, mm, want_ids, want = batch
    layers = ["model.layers.3.__class__.__name__", "model.layers.4.__class__.__name__"]
    got = run_mm_engine(ckpt, prompts, mm, MAX_TOKENS,
                        engine={"max_num_seqs": 3, "limit_mm_per_prompt": {"image": 2, "video": 1},
                                "pipeline_parallel_size": 2, "enable_prefix_caching": False},
                        probe=probe("model_attributes", paths=["visual.__class__.__name__", *layers]),
                        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_PP_LAYER_PARTITION": "4,1"})
    for i, (g, w, ids) in enumerate(zip(got["outputs"], want, want_ids)):
        assert g["prompt_token_ids"] == ids, f"prompt {i}: vLLM's expansion differs from transformers' processor"
        assert_same_generation(g, w, f"PP 2, prompt {i}")
    built = [[p[k] for k in ("visual.__class__.__name__", *layers)] for p in got["probe"]]
    assert built == [["Glm5NextVisionTower", "Glm5NextDecoderLayer", "PPMissingLayer"],
                     ["NoneType", "PPMissingLayer", "Glm5NextDecoderLayer"]], built


def test_zero_limits_build_no_tower_and_serve_text(ckpt, tokenizer, reference):
    """``--limit-mm-per-prompt`` zero limits: no tower is built and the released (nested) layout serves text; the
    batch is test_model_parity's mixed one (3 to 260 tokens, many times index_topk, prefills mixed with decodes)."""
    _, model = reference
    texts = prompt_set(ckpt, PARITY_LENGTHS)
    want = [hf_greedy_mm(model, {"input_ids": torch.tensor([t])}, n) for t, n in zip(texts, PARITY_MAX_TOKENS)]
    image_prompt = tokenizer.encode(f"Describe {IMG}", add_special_tokens=False)
    got = run_mm_engine(ckpt, texts, [None] * len(texts), PARITY_MAX_TOKENS,
                        engine={"max_num_seqs": 3, "limit_mm_per_prompt": {"image": 0, "video": 0}},
                        rejected=[(image_prompt, (["a"], 0))],
                        probe=probe("model_attributes", paths=["visual.__class__.__name__"]))
    for i, (g, w) in enumerate(zip(got["outputs"], want)):
        assert_same_generation(g, w, f"text prompt {i}")
    assert got["probe"] == [{"visual.__class__.__name__": "NoneType"}]
    # With every modality off vLLM treats the model as text-only and refuses media before processing them.
    assert got["rejected"] == ["ValueError: Multi-modal processor not available for text-only models"]