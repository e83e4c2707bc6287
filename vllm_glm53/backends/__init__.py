"""Compute backends for the op families of GLM-5.3-Flash (KDA, lightning indexer, sparse MLA, mHC, routed experts),
one sub-package per platform, each with the same functions and signatures:

  * ``cpu``  — compiled CPU kernels where built, else plain PyTorch (its torch ops run on any device); the
    plain forms are the numerical reference for the others.
  * ``cuda`` — GPUs (NVIDIA CUDA and AMD ROCm): KDA through fla-core's Triton kernels, the indexer and sparse
    MLA through this package's Triton kernels (FlashMLA's sparse kernel where vLLM ships it). Needs ``triton``
    and, for KDA, ``fla-core`` (the ``cuda`` extra). mHC and the unquantized routed experts use the CPU
    backend's torch forms there.

Layers use ``kda_ops``, ``indexer_ops``, ``mla_ops``, ``mhc_ops`` and ``moe_ops``. Each is resolved on first use
(importing this package costs nothing) from the platform vLLM runs on; a GPU family whose packages are missing falls
back to ``cpu`` with a warning, family by family (no fla-core: KDA on torch, indexer and MLA still on Triton).
``VLLM_GLM53_BACKEND=cpu|cuda`` overrides the platform.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

logger = logging.getLogger(__name__)

# Attribute the layers use -> module name inside each platform sub-package.
_FAMILIES = {"kda_ops": "kda", "indexer_ops": "indexer", "mla_ops": "sparse_mla", "mhc_ops": "mhc",
             "moe_ops": "moe"}
# Platform (as vLLM names it) -> backend sub-package. Triton and fla-core serve NVIDIA and AMD GPUs alike.
_PACKAGES = {"cuda": "cuda", "rocm": "cuda", "cpu": "cpu"}

__all__ = ["indexer_ops", "kda_ops", "mhc_ops", "mla_ops", "moe_ops", "backend_name", "load_backend"]


def _platform() -> str:
    from vllm_glm53 import envs

    forced = envs.VLLM_GLM53_BACKEND  # auto, or a platform name _PACKAGES maps (envs checks the value)
    if forced != "auto":
        return forced
    try:
        from vllm_glm53 import _vllm

        return _vllm.platform_kind()
    except ImportError:  # no vLLM (kernel tests, tools): go by what torch sees
        import torch

        if torch.cuda.is_available():
            return "rocm" if torch.version.hip else "cuda"
        return "cpu"


def load_backend(family: str, platform: str | None = None) -> ModuleType:
    """The module implementing ``family`` (``kda``, ``indexer``, ``sparse_mla``, ``mhc`` or ``moe``) on ``platform``
    (default: the current one). A GPU backend whose packages are not importable gives the CPU module, with a
    warning."""
    package = _PACKAGES.get(platform or _platform(), "cpu")
    if package != "cpu":
        try:
            return importlib.import_module(f"vllm_glm53.backends.{package}.{family}")
        except ImportError as exc:
            logger.warning("vllm-glm53: %s backend for %s unavailable (%s); using the CPU ops", package, family, exc)
    return importlib.import_module(f"vllm_glm53.backends.cpu.{family}")


def backend_name(module: ModuleType) -> str:
    """``cpu`` or ``cuda``: which sub-package a family module came from."""
    return module.__name__.rsplit(".", 2)[-2]


def __getattr__(name: str) -> ModuleType:
    family = _FAMILIES.get(name)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = load_backend(family)
    globals()[name] = module  # resolved once per process
    logger.info("vllm-glm53: %s -> %s backend", name, backend_name(module))
    return module
