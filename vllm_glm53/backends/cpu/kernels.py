"""The compiled CPU kernels (``csrc/``), loaded on first use when they were built for this torch and CPU.

:func:`ops` returns ``torch.ops.vllm_glm53`` when the library is loaded, else None; the backends in this
package call a compiled op when it is there and their plain-torch code otherwise. The first call logs one
line saying which. ``VLLM_GLM53_CPU_KERNELS=0`` forces the torch code (for comparisons and benchmarks).
Build with ``python -m vllm_glm53.backends.cpu.build`` (the set-up does).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from vllm_glm53.backends.cpu import build

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: bool | None = None
_description = ""


def _load() -> tuple[bool, str]:
    if os.environ.get("VLLM_GLM53_CPU_KERNELS", "1") == "0":
        return False, "plain torch (VLLM_GLM53_CPU_KERNELS=0)"
    # The best instruction set this CPU runs, then the portable build.
    candidates = [build.library_path(isa) for isa in dict.fromkeys([build.best_isa(), "portable"])]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        others = sorted(p.name for p in build.PACKAGE_DIR.glob("_kernels.*.so"))
        hint = f"; found only {', '.join(others)} (another torch or CPU)" if others else ""
        return False, (f"plain torch (no kernels built for torch {torch.__version__}{hint}; "
                       "run python -m vllm_glm53.backends.cpu.build)")
    try:
        torch.ops.load_library(str(path))
        info = torch.ops.vllm_glm53.build_info()
    except (OSError, RuntimeError) as exc:
        return False, f"plain torch ({path.name} failed to load: {exc})"
    return True, f"compiled kernels ({info}) from {path.name}"


def ops():
    """``torch.ops.vllm_glm53`` if the compiled kernels are loaded in this process, else None."""
    global _loaded, _description
    if _loaded is None:
        with _lock:
            if _loaded is None:
                ok, _description = _load()
                log = logger.info if ok or "KERNELS=0" in _description else logger.warning
                log("vllm-glm53 CPU backends: %s", _description)
                _loaded = ok
    return torch.ops.vllm_glm53 if _loaded else None


# What the compiled kernels read; other dtypes (float64, ...) take the torch code.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def for_tensors(*tensors: torch.Tensor):
    """:func:`ops` if the kernels are loaded and take these float tensors (on the CPU, a dtype they read)."""
    found = ops()
    if found is None or any(t.device.type != "cpu" or t.dtype not in KERNEL_DTYPES for t in tensors):
        return None
    return found


def description() -> str:
    """What :func:`ops` decided, e.g. ``compiled kernels (avx512 torch 2.13.0) from ...``."""
    ops()
    return _description
