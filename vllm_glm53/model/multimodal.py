"""Images and videos for GLM-5.3 in vLLM: pixel preprocessing, prompt expansion, profiling inputs, and the
three parts vLLM's multimodal registry wants (processing info, dummy-input builder, processor).

Preprocessing follows transformers 5.19 (``Glm5NextImageProcessorPil`` and ``Glm5NextVideoProcessor``,
architecture.md §11.1) number for number, without torchvision:

* the canvas: sides multiples of ``patch·merge = 28``, within a token budget (``min/max_image_tokens``; one
  token = temporal_patch · 28² pixels), content resized (bicubic) into its top-left corner keeping the aspect
  ratio, the rest black;
* values: ``(x/255 - mean) / std`` with the CLIP mean/std;
* patches: vectors of ``channel × temporal 2 × 14 × 14`` values ordered (c, t, row, col); 2×2 merge windows in
  raster order, the 4 patches of a window in raster order; a still image fills both temporal slots;
* videos: sampled at 2 fps (at most 2048 frames, duplicates dropped, an odd count repeats its last frame)
  unless the loader already sampled them; every 2 consecutive frames form one temporal patch.

Images are resized with PIL as the reference image processor does. Video frames are resized the way
torchvision resizes a uint8 tensor (float bicubic with antialiasing, rounded back to uint8), with plain
torch, because the reference video processor uses torchvision.

Prompt expansion (architecture.md §11.3) is done here, on token ids: each ``<|image|>`` of the prompt becomes
``t·h·w/4`` image tokens; each ``<|video|>`` becomes, per temporal patch, ``<|begin_of_image|>`` + image
tokens + ``<|end_of_image|>`` + the text ``"{ts:.1f} seconds"`` (the time of the patch's first frame). Video
features fill the image tokens inside the video span, as in the reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from vllm_glm53 import _vllm
from vllm_glm53.chat.tokens import (
    IMAGE_END_TOKEN,
    IMAGE_START_TOKEN,
    IMAGE_TOKEN,
    VIDEO_END_TOKEN,
    VIDEO_START_TOKEN,
    VIDEO_TOKEN,
)

IMAGE_PLACEHOLDER = IMAGE_START_TOKEN + IMAGE_TOKEN + IMAGE_END_TOKEN
VIDEO_PLACEHOLDER = VIDEO_START_TOKEN + VIDEO_TOKEN + VIDEO_END_TOKEN

# ---------------------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PixelSettings:
    """Preprocessing parameters of one modality. Geometry comes from the vision config; the budgets and
    normalisation from the checkpoint's processor config, then ``--mm-processor-kwargs``, then the request."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    image_mean: tuple[float, ...] = tuple(OPENAI_CLIP_MEAN)
    image_std: tuple[float, ...] = tuple(OPENAI_CLIP_STD)
    rescale_factor: float = 1 / 255
    # videos only
    fps: float = 2.0
    max_frames: int = 2048

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def pixels_per_token(self) -> int:
        return self.temporal_patch_size * self.factor**2


IMAGE_DEFAULTS = PixelSettings()
VIDEO_DEFAULTS = PixelSettings(max_image_tokens=240000)
# Keys a processor config or mm_processor_kwargs may set (the reference processors' names).
SETTING_KEYS = ("min_image_tokens", "max_image_tokens", "image_mean", "image_std", "rescale_factor", "fps",
                "max_frames")


def override(settings: PixelSettings, values: Mapping[str, Any]) -> PixelSettings:
    """``settings`` with the values of ``values`` whose keys name a setting (other keys are ignored)."""
    changes = {}
    for key in SETTING_KEYS:
        value = values.get(key)
        if value is None:
            continue
        default = getattr(settings, key)
        changes[key] = tuple(float(v) for v in value) if isinstance(default, tuple) else type(default)(value)
    return replace(settings, **changes)


# ---------------------------------------------------------------------------------------------------------
# geometry
# ---------------------------------------------------------------------------------------------------------


def _align(value: float, factor: int) -> int:
    return math.ceil(value / factor) * factor


def fit_canvas(num_frames: int, height: int, width: int, s: PixelSettings) -> tuple[int, int]:
    """Canvas ``(height, width)`` for ``num_frames`` frames of ``height × width``: sides aligned up to the
    factor; scaled up to the minimum budget; if over the maximum, the tallest aspect-preserving canvas that
    fits, found by bisection over the content height (the reference's search, step for step)."""
    factor, t_factor = s.factor, s.temporal_patch_size
    min_pixels, max_pixels = s.min_image_tokens * s.pixels_per_token, s.max_image_tokens * s.pixels_per_token
    frames = max(t_factor, round(num_frames / t_factor) * t_factor)
    h, w = _align(height, factor), _align(width, factor)
    if frames * h * w < min_pixels:
        scale = math.sqrt(min_pixels / (num_frames * height * width))
        h, w = _align(max(1, math.ceil(height * scale)), factor), _align(max(1, math.ceil(width * scale)), factor)
    if frames * h * w > max_pixels:
        if max_pixels < frames * factor**2:
            raise ValueError(f"max_image_tokens={s.max_image_tokens} leaves no room for one aligned patch of "
                             f"{num_frames} frames")
        best, lo, hi = (factor, factor), 1, height
        while lo <= hi:
            content_h = (lo + hi) // 2
            content_w = max(1, math.floor(width * content_h / height))
            cand = (_align(content_h, factor), _align(content_w, factor))
            if frames * cand[0] * cand[1] <= max_pixels:
                best, lo = cand, content_h + 1
            else:
                hi = content_h - 1
        h, w = best
    return h, w


def fit_content(num_frames: int, height: int, width: int, canvas: tuple[int, int],
                s: PixelSettings) -> tuple[int, int]:
    """Size the content is resized to inside ``canvas``: aspect preserved, never upscaled unless the
    input is below the minimum budget."""
    ch, cw = canvas
    scale = min(ch / height, cw / width)
    if num_frames * height * width >= s.pixels_per_token * s.min_image_tokens:
        scale = min(1.0, scale)
    return max(1, min(ch, math.floor(height * scale))), max(1, min(cw, math.floor(width * scale)))


# ---------------------------------------------------------------------------------------------------------
# pixels
# ---------------------------------------------------------------------------------------------------------


def patchify(frames: np.ndarray | torch.Tensor, s: PixelSettings):
    """``[F, C, H, W]`` normalised frames (F a multiple of the temporal patch) -> ``[F/T·H/P·W/P, C·T·P·P]``."""
    f, c, h, w = frames.shape
    t, p, m = s.temporal_patch_size, s.patch_size, s.merge_size
    x = frames.reshape(f // t, t, c, h // (p * m), m, p, w // (p * m), m, p)
    # -> (temporal patch, window row, window col, row in window, col in window, channel, frame, py, px)
    order = (0, 3, 6, 4, 7, 2, 1, 5, 8)
    x = x.permute(*order) if isinstance(x, torch.Tensor) else x.transpose(order)
    return x.reshape(-1, c * t * p * p)


def _rgb_array(image: Any) -> np.ndarray:
    """``[H, W, 3]`` uint8 from a PIL image (converted to RGB) or a uint8 HWC / CHW array or tensor."""
    if isinstance(image, Image.Image):
        return np.asarray(image if image.mode == "RGB" else image.convert("RGB"))
    arr = image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if arr.ndim == 3 and arr.shape[0] == 3 and arr.shape[-1] != 3:
        arr = arr.transpose(1, 2, 0)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[-1] != 3:
        raise ValueError(f"images must be PIL images or uint8 RGB arrays, got {arr.dtype} {arr.shape}")
    return arr


def preprocess_image(image: Any, s: PixelSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image -> (patches ``[h·w, C·T·P·P]`` float32, grid ``(1, h, w)``)."""
    rgb = _rgb_array(image)
    height, width = rgb.shape[:2]
    canvas = fit_canvas(s.temporal_patch_size, height, width, s)
    ch, cw = fit_content(s.temporal_patch_size, height, width, canvas, s)
    if (ch, cw) != (height, width):
        rgb = np.asarray(Image.fromarray(rgb).resize((cw, ch), resample=Image.Resampling.BICUBIC))
    padded = np.zeros((*canvas, 3), dtype=np.uint8)
    padded[:ch, :cw] = rgb
    # float64 rescale cast to float32, then float32 normalisation: the reference's rounding.
    x = (padded.astype(np.float64) * s.rescale_factor).astype(np.float32)
    x = (x - np.asarray(s.image_mean, np.float32)) / np.asarray(s.image_std, np.float32)
    chw = x.transpose(2, 0, 1)[None]
    frames = np.broadcast_to(chw, (s.temporal_patch_size, *chw.shape[1:]))
    return np.ascontiguousarray(patchify(frames, s)), (1, canvas[0] // s.patch_size, canvas[1] // s.patch_size)


def _frames_tensor(frames: Any) -> torch.Tensor:
    """``[F, 3, H, W]`` uint8 from ``[F, H, W, 3]`` frames (array, tensor or list of PIL images)."""
    if isinstance(frames, (list, tuple)):
        frames = np.stack([_rgb_array(f) for f in frames])
    x = frames if isinstance(frames, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(frames))
    if x.ndim != 4 or x.shape[-1] != 3 or x.dtype != torch.uint8:
        raise ValueError(f"video frames must be uint8 [frames, height, width, 3], got {x.dtype} {tuple(x.shape)}")
    return x.permute(0, 3, 1, 2)


def preprocess_video(frames: Any, s: PixelSettings) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Sampled frames -> (patches ``[t·h·w, C·T·P·P]`` float32, grid ``(t, h, w)``)."""
    x = _frames_tensor(frames)
    n, _, height, width = x.shape
    canvas = fit_canvas(n, height, width, s)
    ch, cw = fit_content(n, height, width, canvas, s)
    if (ch, cw) != (height, width):
        # torchvision's uint8 bicubic: antialiased float interpolation, clamped and rounded back to uint8.
        x = F.interpolate(x.float(), size=(ch, cw), mode="bicubic", align_corners=False, antialias=True)
        x = x.clamp_(0, 255).round_().to(torch.uint8)
    x = F.pad(x, (0, canvas[1] - cw, 0, canvas[0] - ch))
    # Rescale folded into the normalisation, in float32, as the reference's fused rescale-normalise.
    mean = torch.tensor(s.image_mean) * (1.0 / s.rescale_factor)
    std = torch.tensor(s.image_std) * (1.0 / s.rescale_factor)
    x = (x.float() - mean[:, None, None]) / std[:, None, None]
    if pad := -n % s.temporal_patch_size:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    grid = (x.shape[0] // s.temporal_patch_size, canvas[0] // s.patch_size, canvas[1] // s.patch_size)
    return patchify(x, s).contiguous(), grid


# ---------------------------------------------------------------------------------------------------------
# video frames and timestamps
# ---------------------------------------------------------------------------------------------------------


def sample_frame_indices(total_frames: int, fps: float, duration: float | None, s: PixelSettings) -> list[int]:
    """Frames to keep, at ``s.fps`` per second (the reference sampler): a walk keeping the first frame at or
    after every ``1/fps`` seconds, re-spread evenly when it yields too few or too many, duplicates dropped, an
    odd count completed by repeating the last frame."""
    duration = duration or round((total_frames - 1) / fps) + 1
    wanted = min(int(duration * s.fps), s.max_frames)
    if total_frames < wanted:
        picks = np.linspace(0, total_frames - 1, wanted, dtype=int).tolist()
    else:
        picks, next_time = [], 0.0
        for i in range(total_frames):
            if i / fps >= next_time:
                next_time += 1 / s.fps
                picks.append(i)
                if next_time >= int(duration):
                    break
    if len(picks) < wanted:
        start, end = (picks[0], picks[-1]) if picks else (0, max(total_frames - 1, 0))
        picks = np.linspace(start, end, wanted, dtype=int).tolist()
    elif len(picks) > wanted:
        picks = np.linspace(0, total_frames - 1, wanted, dtype=int).tolist()
    picks = list(dict.fromkeys(int(i) for i in picks))
    if not picks:
        raise ValueError(f"the video is too short to sample at {s.fps} fps (duration {duration} s, "
                         f"{total_frames} frames)")
    if len(picks) % 2:
        picks.append(picks[-1])
    return picks


@dataclass(frozen=True)
class VideoPlan:
    """Which of the given frames to use (``None``: all, already sampled by the loader) and the original
    video's index of each used frame (for the timestamps)."""

    take: list[int] | None
    frame_indices: list[int]
    fps: float

    def timestamps(self, grid_t: int, temporal_patch_size: int) -> list[float]:
        """Seconds of each temporal patch's first frame; a short list repeats its last value."""
        ts = [i / self.fps for i in self.frame_indices[::temporal_patch_size]][:grid_t]
        return ts + [ts[-1] if ts else 0.0] * (grid_t - len(ts))


def plan_video(num_frames: int, metadata: Mapping[str, Any] | None, s: PixelSettings) -> VideoPlan:
    """Frame selection from vLLM's video metadata. Frames the loader already sampled (vLLM's loaders say so
    with ``do_sample_frames: false`` and give ``frames_indices``) are used as they are; otherwise the frames
    are the whole clip and are sampled here, as the reference processor does by default. Without an fps the
    timestamps assume 24 fps, as the reference does."""
    metadata = metadata or {}
    fps = metadata.get("fps")
    if metadata.get("do_sample_frames", True):
        if not fps:
            raise ValueError("sampling video frames needs the video's fps in its metadata")
        take = sample_frame_indices(int(metadata.get("total_num_frames") or num_frames), float(fps),
                                    metadata.get("duration"), s)
        return VideoPlan(take, take, float(fps))
    indices = metadata.get("frames_indices")
    indices = list(range(num_frames)) if indices is None else [int(i) for i in indices]
    return VideoPlan(None, indices, float(fps) if fps else 24.0)


def _video_item(item: Any) -> tuple[Any, Mapping[str, Any] | None]:
    return item if isinstance(item, tuple) else (item, None)


def _select_frames(frames: Any, take: list[int]) -> Any:
    if isinstance(frames, (list, tuple)):
        return [frames[i] for i in take]
    return frames[take]


# ---------------------------------------------------------------------------------------------------------
# vLLM registration: processing info, dummy inputs, processor
# ---------------------------------------------------------------------------------------------------------


class Glm5NextProcessingInfo(_vllm.BaseProcessingInfo):
    """Token ids, preprocessing settings and token budgets. No transformers processor is involved: the
    reference video processor needs torchvision, which this plugin must run without."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None, "video": None}

    def get_supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        return {"text_kwargs": set(), "images_kwargs": set(SETTING_KEYS), "videos_kwargs": set(SETTING_KEYS)}

    def get_data_parser(self):
        # Timestamps and sampling need each video's metadata (fps, frame indices).
        return _vllm.MultiModalDataParser(video_needs_metadata=True,
                                          expected_hidden_size=self._get_expected_hidden_size())

    def token_ids(self) -> dict[str, int]:
        cfg = self.get_hf_config()
        return {"image": cfg.image_token_id, "video": cfg.video_token_id,
                "image_start": cfg.image_start_token_id, "image_end": cfg.image_end_token_id}

    def pixel_settings(self, mm_kwargs: Mapping[str, object] | None = None) -> dict[str, PixelSettings]:
        """Settings per modality: defaults, the vision config's geometry, the checkpoint's processor configs,
        ``--mm-processor-kwargs`` and the request's kwargs (flat keys for both modalities, ``images_kwargs`` /
        ``videos_kwargs`` for one)."""
        v = self.get_hf_config().vision_config
        geometry = dict(patch_size=int(v.patch_size), temporal_patch_size=int(v.temporal_patch_size),
                        merge_size=int(v.spatial_merge_size))
        stored = self._stored_processor_configs()
        kwargs = self.ctx.get_merged_mm_kwargs(mm_kwargs or {})
        out = {}
        for modality, defaults, scope in (("image", IMAGE_DEFAULTS, "images_kwargs"),
                                          ("video", VIDEO_DEFAULTS, "videos_kwargs")):
            s = override(replace(defaults, **geometry), stored[modality])
            s = override(s, kwargs)
            out[modality] = override(s, kwargs.get(scope) or {})
        return out

    def _stored_processor_configs(self) -> dict[str, dict]:
        cached = self.__dict__.get("_stored_configs")
        if cached is None:
            model_config = self.ctx.model_config
            combined = _vllm.read_model_json(model_config, "processor_config.json")
            image = {**(combined.get("image_processor") or {}), **self.ctx.get_hf_image_processor_config()}
            video = {**(combined.get("video_processor") or {}),
                     **_vllm.read_model_json(model_config, "video_preprocessor_config.json")}
            cached = self.__dict__["_stored_configs"] = {"image": image, "video": video}
        return cached

    # --- budgets: the largest items, computed without processing any pixels ------------------------------

    def largest_image_grid(self, seq_len: int) -> tuple[int, int, int]:
        """The patch grid of the image with the most tokens that fits ``seq_len``: the most merged windows
        ``≤ min(max_image_tokens, seq_len - 2)`` with an aspect ratio of at most 4."""
        s = self.pixel_settings()["image"]
        limit = max(1, min(s.max_image_tokens, seq_len - 2))
        rows, cols = _largest_window_grid(limit)
        return 1, rows * s.merge_size, cols * s.merge_size

    def largest_video(self, seq_len: int) -> tuple[int, tuple[int, int, int]]:
        """(frames, patch grid) of the video with the most tokens that fits ``seq_len``: frames of at most the
        largest image's size, as many temporal patches as the video budget, the frame cap and the prompt
        length allow."""
        s = self.pixel_settings()["video"]
        # Each temporal patch also spends its begin/end image tokens and a timestamp (bounded by a 4-digit one).
        overhead = 2 + len(self.get_tokenizer().encode("0000.0 seconds", add_special_tokens=False))
        budget = max(1, min(s.max_image_tokens, seq_len - 2 - overhead))
        rows, cols = _largest_window_grid(min(budget, self.pixel_settings()["image"].max_image_tokens))
        per_patch = rows * cols
        grid_t = max(1, min(budget // per_patch, s.max_frames // s.temporal_patch_size,
                            (seq_len - 2) // (per_patch + overhead)))
        return grid_t * s.temporal_patch_size, (grid_t, rows * s.merge_size, cols * s.merge_size)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        merge = self.get_hf_config().vision_config.spatial_merge_size**2
        out = {}
        if mm_counts.get("image", 0):
            out["image"] = math.prod(self.largest_image_grid(seq_len)) // merge
        if mm_counts.get("video", 0):
            out["video"] = math.prod(self.largest_video(seq_len)[1]) // merge
        return out


def _largest_window_grid(limit: int) -> tuple[int, int]:
    """``(rows, cols)`` maximising ``rows·cols ≤ limit`` with ``cols ≤ 4·rows``."""
    best = (1, 1)
    for rows in range(1, math.isqrt(limit) + 1):
        cols = min(limit // rows, 4 * rows)
        if rows * cols > best[0] * best[1]:
            best = (rows, cols)
    return best


class Glm5NextDummyInputsBuilder(_vllm.BaseDummyInputsBuilder):
    """Largest-case inputs for vLLM's encoder profiling; they agree with ``get_mm_max_tokens_per_item``."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0) + VIDEO_PLACEHOLDER * mm_counts.get("video", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Mapping[str, Any]):
        info = self.info
        patch = info.get_hf_config().vision_config.patch_size
        _, h, w = info.largest_image_grid(seq_len)
        images = self._get_dummy_images(width=w * patch, height=h * patch, num_images=mm_counts.get("image", 0),
                                        overrides=mm_options.get("image"))
        frames, (_, vh, vw) = info.largest_video(seq_len)
        fps = info.pixel_settings()["video"].fps
        videos = [
            (video, {"fps": fps, "duration": len(video) / fps, "total_num_frames": len(video),
                     "frames_indices": list(range(len(video))), "do_sample_frames": False})
            for video in self._get_dummy_videos(width=vw * patch, height=vh * patch, num_frames=frames,
                                                num_videos=mm_counts.get("video", 0),
                                                overrides=mm_options.get("video"))
        ]
        return {"image": images, "video": videos}


class Glm5NextMultiModalProcessor(_vllm.BaseMultiModalProcessor):
    """Pixels through :func:`preprocess_image` / :func:`preprocess_video`; prompt expansion on token ids."""

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        settings = self.info.pixel_settings(hf_kwargs)
        out: dict[str, torch.Tensor] = {}
        images = hf_data.get("images") or []
        if images:
            done = [preprocess_image(image, settings["image"]) for image in images]
            out["pixel_values"] = torch.from_numpy(np.concatenate([p for p, _ in done]))
            out["image_grid_thw"] = torch.tensor([g for _, g in done], dtype=torch.long)
        videos = hf_data.get("videos") or []
        if videos:
            done = []
            for item in videos:
                frames, metadata = _video_item(item)
                plan = plan_video(len(frames), metadata, settings["video"])
                if plan.take is not None:
                    frames = _select_frames(frames, plan.take)
                done.append(preprocess_video(frames, settings["video"]))
            out["pixel_values_videos"] = torch.cat([p for p, _ in done])
            out["video_grid_thw"] = torch.tensor([g for _, g in done], dtype=torch.long)
        return BatchFeature(out)

    def _get_mm_fields_config(self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]):
        fields = _vllm.MultiModalFieldConfig
        image_grid = hf_inputs.get("image_grid_thw", torch.empty((0, 3), dtype=torch.long))
        video_grid = hf_inputs.get("video_grid_thw", torch.empty((0, 3), dtype=torch.long))
        return {
            "pixel_values": fields.flat_from_sizes("image", image_grid.prod(-1)),
            "image_grid_thw": fields.batched("image", keep_on_cpu=True),
            "pixel_values_videos": fields.flat_from_sizes("video", video_grid.prod(-1)),
            "video_grid_thw": fields.batched("video", keep_on_cpu=True),
        }

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs):
        ids = self.info.token_ids()
        tokenizer = self.info.get_tokenizer()
        settings = self.info.pixel_settings(hf_processor_mm_kwargs)["video"]
        merge = settings.merge_size**2

        def image_tokens(item_idx: int) -> list[int]:
            grid = out_mm_kwargs["image"][item_idx]["image_grid_thw"].data
            return [ids["image"]] * (int(grid.prod()) // merge)

        def video_tokens(item_idx: int):
            t, h, w = (int(v) for v in out_mm_kwargs["video"][item_idx]["video_grid_thw"].data)
            frames, metadata = _video_item(mm_items["video"][item_idx])
            plan = plan_video(len(frames), metadata, settings)
            seq: list[int] = []
            for ts in plan.timestamps(t, settings.temporal_patch_size):
                seq += [ids["image_start"], *[ids["image"]] * (h * w // merge), ids["image_end"]]
                seq += tokenizer.encode(f"{ts:.1f} seconds", add_special_tokens=False)
            return _vllm.PromptUpdateDetails.select_token_id(seq, ids["image"])

        return [
            _vllm.PromptReplacement(modality="image", target=[ids["image"]], replacement=image_tokens),
            _vllm.PromptReplacement(modality="video", target=[ids["video"]], replacement=video_tokens),
        ]
