"""Import vLLM's own GLM5Next (``vllm.models.glm5next``) on CPU, for tests that compare against it.

vLLM's model cannot run here, but its classes and its multimodal processor can be imported once torchvision
exists: ``vllm.model_executor.models.glm4_1v`` imports transformers' GLM-4V image processor, which imports
``torchvision.transforms.v2`` at module level (the set-up removes torchvision: the PyPI wheel is a CUDA build that
breaks the CPU torch). A small stand-in package is enough for what the tests touch: class interfaces, and vLLM's
multimodal processor turning a prompt and an image into its placeholder layout. Use it in a subprocess only
(``python tests/vllm_glm5next.py ...``): the stand-in must not leak into other tests.
"""

from __future__ import annotations

import sys


# A stand-in torchvision package: what transformers' GLM image/video processors and vLLM's glm4_1v touch at import
# and while turning a PIL image into patches. Its resize is bilinear, not torchvision's antialiased bicubic: pixel
# values differ from the real processor's, the patch grid and the prompt layout (all the tests compare) do not.
_STANDIN = {
    "torchvision/__init__.py": '__version__ = "0.28.0"\n',
    "torchvision-0.28.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n",
    "torchvision/io.py": """
import enum
class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    RGB = 3
def decode_image(*args, **kwargs):
    raise NotImplementedError("torchvision stand-in")
""",
    "torchvision/transforms/__init__.py": """
import enum
class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
""",
    "torchvision/transforms/functional.py": """
from torchvision.transforms.v2.functional import pil_to_tensor
def to_pil_image(*args, **kwargs):
    raise NotImplementedError("torchvision stand-in")
""",
    "torchvision/transforms/v2/__init__.py": "",
    "torchvision/transforms/v2/functional.py": """
import numpy as np
import torch
import torch.nn.functional as F
from torchvision.transforms import InterpolationMode
def pil_to_tensor(image):
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()
def pad(x, padding, fill=0):
    left, top, right, bottom = padding
    return F.pad(x, (left, right, top, bottom), value=fill)
def normalize(x, mean, std, inplace=False):
    x = x if inplace else x.clone()
    return x.sub_(torch.as_tensor(mean).view(-1, 1, 1)).div_(torch.as_tensor(std).view(-1, 1, 1))
def grayscale_to_rgb(x):
    return x
def resize(x, size, interpolation=None, antialias=True, **kwargs):
    batched = x.float() if x.dim() == 4 else x.float().unsqueeze(0)
    y = F.interpolate(batched, size=list(size), mode="bilinear", antialias=True, align_corners=False)
    y = y if x.dim() == 4 else y[0]
    return y if x.is_floating_point() else y.round().clamp(0, 255).to(x.dtype)
def to_dtype(x, dtype, scale=False):
    return x.to(dtype)
""",
}


def install():
    """Put the torchvision stand-in on the path, import vLLM's GLM5Next package and return it."""
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix="torchvision-standin-"))
    for rel, text in _STANDIN.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    sys.path.insert(0, str(root))  # before transformers decides whether torchvision is available
    import vllm.models.glm5next as glm5next

    return glm5next


INTERFACES = ("HasInnerState", "IsHybrid", "SupportsMultiModal", "SupportsPP", "SupportsLoRA", "SupportsEagle",
              "SupportsEagle3", "MixtureOfExperts")


def interfaces(cls) -> list[str]:
    """The vLLM interfaces ``cls`` declares, by vLLM's own predicates."""
    from vllm.model_executor.models import interfaces as i

    checks = {"HasInnerState": i.has_inner_state, "IsHybrid": i.is_hybrid, "SupportsMultiModal": i.supports_multimodal,
              "SupportsPP": i.supports_pp, "SupportsLoRA": i.supports_lora, "SupportsEagle": i.supports_eagle,
              "SupportsEagle3": i.supports_eagle3,
              # a protocol with data members: declared by inheritance (vLLM checks instances at run time)
              "MixtureOfExperts": lambda c: i.MixtureOfExperts in c.__mro__}
    return sorted(name for name in INTERFACES if checks[name](cls))


def vllm_interfaces() -> dict[str, list[str]]:
    """``{class name: interfaces}`` of vLLM's two GLM5Next classes, found in a child process."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"importing vLLM's GLM5Next failed:\n{out.stderr[-3000:]}")
    line = next(l for l in out.stdout.splitlines() if l.startswith("INTERFACES"))
    return json.loads(line[len("INTERFACES"):])


def process(checkpoint: str, prompt: list[int], image_npy: str, max_model_len: int) -> dict:
    """vLLM's own GLM5Next multimodal processor on ``prompt`` and one image: prompt ids, placeholder ranges, patch
    grid and pixel rows. The plugin's general registration runs as in any vLLM process (tokenizer mode ...), then
    the architecture is pointed back at vLLM's own class, which is what registers vLLM's processor."""
    glm5next = install()  # first: transformers decides once, at its import, whether torchvision exists
    import numpy as np
    from PIL import Image
    from vllm import ModelRegistry
    from vllm.config import ModelConfig
    from vllm.model_executor.models.registry import _RegisteredModel
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    arch = "Glm5NextForConditionalGeneration"
    ModelRegistry.models[arch] = _RegisteredModel.from_model_cls(getattr(glm5next, arch))
    processor = MULTIMODAL_REGISTRY.create_processor(
        ModelConfig(model=checkpoint, max_model_len=max_model_len, limit_mm_per_prompt={"image": 1, "video": 0}))
    assert type(processor).__module__.startswith("vllm.models.glm5next"), type(processor)
    image = Image.fromarray(np.load(image_npy))
    return summarize(processor(prompt, processor.info.parse_mm_data({"image": [image]}), hf_processor_mm_kwargs={}))


def summarize(out) -> dict:
    """What two processors must agree on for the model to see the same input."""
    item = out["mm_kwargs"]["image"][0]
    return {"prompt_token_ids": list(out["prompt_token_ids"]),
            "placeholders": [[r.offset, r.length] for r in out["mm_placeholders"]["image"]],
            "image_grid_thw": [int(v) for v in item["image_grid_thw"].data.tolist()],
            "pixel_rows": int(item["pixel_values"].data.shape[0])}


if __name__ == "__main__":
    import json

    if sys.argv[1:2] == ["process"]:
        ckpt, spec = sys.argv[2], json.loads(open(sys.argv[3]).read())
        print("PROCESSED" + json.dumps(process(ckpt, spec["prompt"], spec["image"], spec["max_model_len"])))
        sys.exit(0)
    glm5next = install()
    print("INTERFACES" + json.dumps({name: interfaces(getattr(glm5next, name))
                                     for name in ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration")}))
