"""A stand-in ``torchvision`` package for child processes that import transformers' GLM image/video processors or
vLLM's own GLM5Next (whose glm4_1v import pulls them in).

torchvision must never be installed next to the CPU torch (the PyPI wheel is a CUDA build that breaks it; see
design.md), yet those modules import it at module level. The stand-in holds only what they touch: the
``InterpolationMode`` names, ``pad``, ``normalize`` (torchvision's in-place ``sub_(mean).div_(std)``),
``grayscale_to_rgb`` (identity for RGB), ``pil_to_tensor``, ``to_dtype``, and a dist-info so that transformers
believes it is there. ``resize`` is either absent (a reference that must never resize with anything but the real
kernel: it raises) or a bilinear stand-in (enough where only the patch grid and the prompt layout are compared).
"""

from __future__ import annotations

from pathlib import Path

_FILES = {
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
    if x.shape[-3] != 3:
        raise NotImplementedError("torchvision stand-in: RGB only")
    return x
def to_dtype(x, dtype, scale=False):
    return x.to(dtype)
""",
}

_NO_RESIZE = """
def resize(*args, **kwargs):
    raise NotImplementedError("torchvision stand-in: choose frames that need no resizing")
"""

_BILINEAR_RESIZE = """
def resize(x, size, interpolation=None, antialias=True, **kwargs):
    batched = x.float() if x.dim() == 4 else x.float().unsqueeze(0)
    y = F.interpolate(batched, size=list(size), mode="bilinear", antialias=True, align_corners=False)
    y = y if x.dim() == 4 else y[0]
    return y if x.is_floating_point() else y.round().clamp(0, 255).to(x.dtype)
"""


def write(root: str | Path, resize: bool) -> Path:
    """Write the stand-in under ``root`` (put ``root`` first on the child's path); ``resize``: the bilinear one."""
    root = Path(root)
    for rel, text in _FILES.items():
        if rel.endswith("v2/functional.py"):
            text += _BILINEAR_RESIZE if resize else _NO_RESIZE
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root
