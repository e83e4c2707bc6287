"""The op layer of GLM-5.3-Flash: the op families (KDA, lightning indexer, sparse MLA, mHC, routed experts, RMSNorm),
the step plans they read, and the two attention backends vLLM sees.

Three words, each with one meaning here:

  * **platform package** — ``cpu`` or ``cuda``: the op families one kind of platform runs, one module per family
    with the same functions and signatures (tests/test_ops_dispatch.py checks it). ``cpu`` holds the compiled
    CPU kernels and the plain-torch forms (which run on any device and are the numerical reference); ``cuda``
    serves NVIDIA and AMD GPUs (fla-core's KDA, this package's Triton indexer and sparse MLA, FlashMLA where vLLM
    ships it; needs ``triton`` and ``fla-core``, the ``cuda`` extra).
  * **implementation** — one way to compute an op (``compiled``, ``torch``, ``triton``, ``fla``, ``flashmla``,
    ...), registered on the op's :class:`~vllm_glm53.backends.dispatch.Op` with the reason it declines a call;
    the first that accepts runs, and the choice is logged once.
  * **attention backend** — what vLLM calls a backend: :mod:`.latent_cache` (sparse MLA) and :mod:`.kda_state`
    (KDA state over vLLM's GDN metadata). Each builds one step plan per step (:mod:`.plans`) that every layer's
    ops read.

Layers use ``kda_ops``, ``indexer_ops``, ``mla_ops``, ``mhc_ops``, ``moe_ops`` and ``norm_ops``. Each is resolved on
first use (importing this package costs nothing) from the platform vLLM runs on; a GPU family whose packages are
missing falls back to ``cpu`` with a warning, family by family (no fla-core: KDA on torch, indexer and MLA still
on Triton).
``VLLM_GLM53_BACKEND=cpu|cuda`` overrides the platform.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

logger = logging.getLogger(__name__)

# Attribute the layers use -> module name inside each platform sub-package.
_FAMILIES = {"kda_ops": "kda", "indexer_ops": "indexer", "mla_ops": "sparse_mla", "mhc_ops": "mhc",
             "moe_ops": "moe", "norm_ops": "norm"}
# Platform (as vLLM names it) -> backend sub-package. Triton and fla-core serve NVIDIA and AMD GPUs alike.
_PACKAGES = {"cuda": "cuda", "rocm": "cuda", "cpu": "cpu"}

__all__ = ["indexer_ops", "kda_ops", "mhc_ops", "mla_ops", "moe_ops", "norm_ops", "load_family", "platform_of"]


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


def load_family(family: str, platform: str | None = None) -> ModuleType:
    """The module implementing ``family`` (``kda``, ``indexer``, ``sparse_mla``, ``mhc``, ``moe`` or ``norm``) on
    ``platform`` (default: the current one). A GPU family whose packages are not importable gives the CPU module,
    with a warning."""
    package = _PACKAGES.get(platform or _platform(), "cpu")
    if package != "cpu":
        try:
            return importlib.import_module(f"vllm_glm53.backends.{package}.{family}")
        except ImportError as exc:
            logger.warning("vllm-glm53: %s backend for %s unavailable (%s); using the CPU ops", package, family, exc)
    return importlib.import_module(f"vllm_glm53.backends.cpu.{family}")


def platform_of(module: ModuleType) -> str:
    """``cpu`` or ``cuda``: which sub-package a family module came from."""
    return module.__name__.rsplit(".", 2)[-2]


def __getattr__(name: str) -> ModuleType:
    family = _FAMILIES.get(name)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = load_family(family)
    globals()[name] = module  # resolved once per process
    logger.info("vllm-glm53: %s -> the %s platform package", name, platform_of(module))
    return module
