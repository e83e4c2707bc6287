"""Pixel preprocessing and frame sampling (``vllm_glm53.model.multimodal``) against transformers 5.19.

Images: ``Glm5NextImageProcessorPil`` (no torchvision needed), compared bit for bit.

Videos: transformers' ``Glm5NextVideoProcessor`` imports torchvision, which must never be installed next to
the CPU torch (see design.md). :func:`hf_reference` therefore runs transformers in a subprocess whose
``torchvision`` is a stub holding only the pieces the reference calls for frames that need no resizing:
``pad`` (zero padding), ``normalize`` (torchvision's in-place ``sub_(mean).div_(std)``), ``grayscale_to_rgb``
(identity for RGB) and the ``InterpolationMode`` names. Sampling, budgets, padding, the fused
rescale/normalise, temporal padding, patch order and the prompt expansion are all transformers' own code.
The resize of video frames (torchvision's antialiased bicubic, which the stub does not provide) is checked
against PIL's bicubic, which torchvision's antialiased kernels are built to approximate.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from tests import torchvision_standin
from vllm_glm53.model.multimodal import (
    IMAGE_DEFAULTS,
    VIDEO_DEFAULTS,
    plan_video,
    preprocess_image,
    preprocess_video,
    sample_frame_indices,
)

# ---------------------------------------------------------------------------------------------------------
# transformers' video processor in a subprocess with a torchvision stub
# ---------------------------------------------------------------------------------------------------------


_RUNNER = """
import pickle, sys
import numpy as np
import torch
from transformers.video_utils import VideoMetadata
from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

jobs = pickle.load(open(sys.argv[1], "rb"))
results = []
for kind, args in jobs:
    if kind == "sample":
        results.append([int(i) for i in Glm5NextVideoProcessor().sample_frames(VideoMetadata(**args))])
    elif kind == "video":
        frames, metadata, kwargs = args
        out = Glm5NextVideoProcessor()(videos=[frames], video_metadata=[metadata], return_tensors="pt",
                                       return_metadata=True, **kwargs)
        results.append({"pixels": out["pixel_values_videos"], "grid": out["video_grid_thw"][0].tolist(),
                        "frames_indices": [int(i) for i in out["video_metadata"][0].frames_indices]})
    elif kind == "processor":
        from transformers import AutoTokenizer
        from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
        from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
        tokenizer_dir, text, images, videos = args
        proc = Glm5NextProcessor(image_processor=Glm5NextImageProcessorPil(),
                                 tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
                                 video_processor=Glm5NextVideoProcessor())
        kwargs = {}
        if images:
            kwargs["images"] = images
        if videos:
            kwargs["videos"] = [f for f, _ in videos]
            kwargs["video_metadata"] = [m for _, m in videos]
        out = proc(text=[text], return_tensors="pt", **kwargs)
        results.append({k: v for k, v in out.items() if k != "video_metadata"})
pickle.dump(results, open(sys.argv[2], "wb"))
"""


def hf_reference(jobs: list[tuple[str, object]]) -> list:
    """Run transformers on ``jobs`` in a subprocess with the torchvision stub. Job kinds: ``("sample",
    metadata)`` -> frame indices; ``("video", (frames, metadata, kwargs))`` -> pixels, grid, frame indices;
    ``("processor", (tokenizer_dir, text, images, videos))`` -> ``Glm5NextProcessor`` outputs."""
    with tempfile.TemporaryDirectory() as d:
        # resize absent: the reference resizes no frame with anything but torchvision's own kernel
        stub = str(torchvision_standin.write(os.path.join(d, "stub"), resize=False))
        jobs_path, out_path = os.path.join(d, "jobs.pkl"), os.path.join(d, "out.pkl")
        with open(jobs_path, "wb") as f:
            pickle.dump(jobs, f)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([stub, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", _RUNNER, jobs_path, out_path], env=env, capture_output=True,
                              text=True, timeout=600)
        if proc.returncode != 0:
            raise AssertionError(f"transformers reference failed:\n{proc.stderr[-4000:]}")
        with open(out_path, "rb") as f:
            return pickle.load(f)


def random_frames(n: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, height, width, 3), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------------------

IMAGE_CASES = [
    # (height, width, max_image_tokens, PIL mode): below the minimum budget (upscaled), inside it (padded
    # only), above it (bisection), a thin strip, alpha and grayscale inputs, a downscale
    (50, 70, 8000, "RGB"),
    (300, 200, 8000, "RGB"),
    (333, 517, 64, "RGB"),
    (20, 900, 100, "RGBA"),
    (28, 28, 8000, "L"),
    (1000, 1200, 300, "RGB"),
]


@pytest.mark.parametrize("height,width,max_tokens,mode", IMAGE_CASES)
def test_image_pixels_and_grid_match_transformers(height, width, max_tokens, mode):
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    rgba = np.random.default_rng(height).integers(0, 256, (height, width, 4), dtype=np.uint8)
    image = Image.fromarray(rgba, "RGBA").convert(mode)
    want = Glm5NextImageProcessorPil()(images=[image], max_image_tokens=max_tokens, return_tensors="pt")
    pixels, grid = preprocess_image(image, replace(IMAGE_DEFAULTS, max_image_tokens=max_tokens))
    assert list(grid) == want["image_grid_thw"][0].tolist()
    assert torch.equal(torch.from_numpy(pixels), want["pixel_values"])


def test_uint8_arrays_are_images_too():
    rgb = np.random.default_rng(1).integers(0, 256, (90, 60, 3), dtype=np.uint8)
    from_pil, grid = preprocess_image(Image.fromarray(rgb), IMAGE_DEFAULTS)
    for array in (rgb, rgb.transpose(2, 0, 1), torch.from_numpy(rgb)):
        pixels, g = preprocess_image(array, IMAGE_DEFAULTS)
        assert g == grid and np.array_equal(pixels, from_pil)


# ---------------------------------------------------------------------------------------------------------
# videos
# ---------------------------------------------------------------------------------------------------------


def test_frame_sampling_matches_transformers():
    cases = [
        # (total frames, fps, duration): typical clips, a clip with fewer frames than 2 fps needs, a long one
        # past the frame cap's reach, no duration in the metadata, odd counts
        (31, 10.0, 3.1), (300, 30.0, 10.0), (8, 4.0, 2.0), (5, 1.0, 5.0), (90, 29.97, None), (7, 2.0, 3.5),
        (1200, 24.0, 50.0), (61, 30.0, 2.03),
    ]
    metas = [{"total_num_frames": n, "fps": fps, "duration": dur} for n, fps, dur in cases]
    want = hf_reference([("sample", m) for m in metas])
    for (n, fps, dur), w in zip(cases, want):
        assert sample_frame_indices(n, fps, dur, VIDEO_DEFAULTS) == w, (n, fps, dur)


def test_video_pixels_match_transformers():
    """Frames that need no resizing (within budget; 60×80 is padded to 84×84): one clip sampled here
    from its metadata, one already sampled by a loader (odd count, so the last frame is repeated)."""
    clip = random_frames(31, 60, 80, seed=2)
    clip_meta = {"total_num_frames": 31, "fps": 10.0, "duration": 3.1}
    loaded = random_frames(7, 56, 84, seed=3)
    loaded_meta = {"total_num_frames": 300, "fps": 30.0, "duration": 10.0,
                   "frames_indices": [0, 50, 100, 150, 200, 250, 299]}
    want = hf_reference([("video", (clip, clip_meta, {})),
                         ("video", (loaded, loaded_meta, {"do_sample_frames": False}))])
    for frames, meta, w in ((clip, clip_meta, want[0]), (loaded, {**loaded_meta, "do_sample_frames": False}, want[1])):
        plan = plan_video(len(frames), meta, VIDEO_DEFAULTS)
        used = frames if plan.take is None else frames[plan.take]
        pixels, grid = preprocess_video(used, VIDEO_DEFAULTS)
        assert plan.frame_indices == w["frames_indices"]
        assert list(grid) == w["grid"]
        assert torch.equal(pixels, w["pixels"])


def test_video_resize_agrees_with_pil_bicubic():
    """Frames above the budget are downscaled as torchvision scales a uint8 tensor (antialiased bicubic).
    torchvision's antialiased kernels follow PIL's, so each frame must agree with PIL's bicubic resize of it
    to within one level almost everywhere: PIL rounds and clips to uint8 between its horizontal and vertical
    passes, which moves a few values next to saturated edges by several levels (measured: 0.1% of values)."""
    s = replace(VIDEO_DEFAULTS, max_image_tokens=120)
    frames = random_frames(4, 300, 410, seed=4)
    frames[:, 100:200] = 255  # flat areas and hard edges, not only noise
    pixels, (t, h, w) = preprocess_video(frames, s)
    image_pixels = []
    for frame in frames[::2]:
        p, grid = preprocess_image(frame, replace(IMAGE_DEFAULTS, max_image_tokens=120 // 2))
        assert grid == (1, h, w)
        image_pixels.append(torch.from_numpy(p))
    # A still image fills both temporal slots with one frame: compare the first slot of each temporal patch.
    ours = pixels.view(t, h * w, 3, 2, 14 * 14)[:, :, :, 0]
    pil = torch.stack(image_pixels).view(t, h * w, 3, 2, 14 * 14)[:, :, :, 0]
    level = 1 / (255 * torch.tensor(VIDEO_DEFAULTS.image_std).view(1, 1, 3, 1))  # one uint8 step, normalised
    levels = (ours - pil).abs() / level
    assert (levels <= 1.01).float().mean() > 0.995
    assert levels.mean() < 0.2 and levels.max() < 16


def test_timestamps_follow_each_temporal_patch():
    """The reference's prompt uses the time of every second sampled frame, repeating the last one when the
    grid has more temporal patches (a repeated odd frame)."""
    plan = plan_video(5, {"fps": 30.0, "do_sample_frames": False, "frames_indices": [0, 15, 30, 45, 60]},
                      VIDEO_DEFAULTS)
    assert plan.timestamps(3, 2) == [0.0, 1.0, 2.0]
    assert plan.timestamps(4, 2) == [0.0, 1.0, 2.0, 2.0]


# ---------------------------------------------------------------------------------------------------------
# the registered vLLM processor: profiling inputs and processor kwargs
# ---------------------------------------------------------------------------------------------------------

# The checkpoint test_vision_engine.py uses (built once per session under this name).
VISION_CKPT = dict(overrides={"vision_config": {"initializer_range": 0.1}}, seed=3)
SEQ_LEN = 1024


@pytest.fixture(scope="module")
def mm_processor(tiny_ckpt):
    from vllm_glm53 import testing

    return testing.multimodal_processor(tiny_ckpt("vision", **VISION_CKPT), max_model_len=SEQ_LEN,
                                      limit_mm_per_prompt={"image": 2, "video": 1})


@pytest.mark.parametrize("modality", ["image", "video"])
def test_profiling_inputs_are_the_largest_items_that_fit(mm_processor, modality):
    """vLLM sizes its encoder budget from ``get_mm_max_tokens_per_item`` and profiles with the dummy inputs:
    the dummy item must produce exactly that many feature tokens, in a prompt that fits ``max_model_len``."""
    dummy = mm_processor.get_dummy_mm_inputs({modality: 1})
    [placeholder] = dummy["mm_placeholders"][modality]
    want = mm_processor.info.get_mm_max_tokens_per_item(SEQ_LEN, {modality: 1})[modality]
    assert placeholder.get_num_embeds() == want
    assert len(dummy["prompt_token_ids"]) <= SEQ_LEN
    assert want > 0.9 * SEQ_LEN  # as large as the prompt allows, not a token-starved probe


def test_processor_kwargs_set_the_budgets(mm_processor):
    """Request ``mm_processor_kwargs``: flat keys apply to images and videos, ``images_kwargs`` /
    ``videos_kwargs`` to one modality; the grid is the one the reference computes for that budget."""
    info = mm_processor.info
    tokenizer = info.get_tokenizer()
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (300, 400, 3), dtype=np.uint8))
    prompt = tokenizer.encode("<|begin_of_image|><|image|><|end_of_image|>", add_special_tokens=False)
    for kwargs, budget in (({}, 8000), ({"max_image_tokens": 20}, 20),
                           ({"max_image_tokens": 20, "images_kwargs": {"max_image_tokens": 40}}, 40),
                           ({"videos_kwargs": {"max_image_tokens": 20}}, 8000)):
        out = mm_processor(prompt, info.parse_mm_data({"image": [image]}), hf_processor_mm_kwargs=kwargs)
        grid = out["mm_kwargs"]["image"][0]["image_grid_thw"].data.tolist()
        _, want = preprocess_image(image, replace(IMAGE_DEFAULTS, max_image_tokens=budget))
        assert tuple(grid) == want, kwargs
        assert len(out["prompt_token_ids"]) == len(prompt) - 1 + want[1] * want[2] // 4
