"""The compiled CPU kernels (``csrc/``), loaded on first use when they were built for this torch and CPU.

:func:`ops` returns ``torch.ops.vllm_glm53`` when the library is loaded, else None; the backends in this
package call a compiled op when it is there and their plain-torch code otherwise. The first call logs one
line saying which. ``VLLM_GLM53_CPU_KERNELS=0`` forces the torch code (for comparisons and benchmarks).
Build with ``python -m vllm_glm53.backends.cpu.build`` (the set-up does).

The loader takes the library of the best instruction set this CPU runs that was built (avx512, avx2, portable).
``VLLM_GLM53_CPU_ISA=avx2`` (or ``avx512`` / ``portable``) forces one, so an AVX-512 machine can test and
measure the paths other CPUs get; engine processes inherit it. ``VLLM_GLM53_CPU_AMX=0`` keeps the avx512 build off
AMX tiles on a CPU that has them (:func:`amx_tiles`). All libraries register the same op namespace,
so one process holds one of them: the tests check the other paths in a subprocess each.
"""

from __future__ import annotations

import logging
import threading

import torch

from vllm_glm53 import envs
from vllm_glm53.backends.cpu import build

logger = logging.getLogger(__name__)

ISA_ENV = "VLLM_GLM53_CPU_ISA"
AMX_ENV = "VLLM_GLM53_CPU_AMX"

_lock = threading.Lock()
_loaded: bool | None = None
_isa: str | None = None
_description = ""
_amx: bool | None = None


def requested_isas() -> list[str]:
    """The instruction sets the loader may use, in order of preference: every one this CPU runs, or the one
    ``VLLM_GLM53_CPU_ISA`` names. An unknown value, or one this CPU cannot run, is an error naming the variable."""
    forced = getattr(envs, ISA_ENV)  # raises envs.EnvError for a value that is no instruction set
    runnable = build.runnable_isas()
    if forced == "auto":
        return runnable
    if forced not in runnable:
        raise ValueError(f"{ISA_ENV}={forced!r}: this CPU runs only {', '.join(runnable)}")
    return [forced]


def _load() -> tuple[str | None, str]:
    if not envs.flag("VLLM_GLM53_CPU_KERNELS"):
        return None, "plain torch (VLLM_GLM53_CPU_KERNELS=0)"
    isas = requested_isas()
    isa = next((isa for isa in isas if build.library_path(isa).is_file()), None)
    if isa is None:
        others = sorted(p.name for p in build.PACKAGE_DIR.glob("_kernels.*.so"))
        hint = f"; found only {', '.join(others)} (another torch, CPU or {ISA_ENV})" if others else ""
        return None, (f"plain torch (no kernels built for {'/'.join(isas)} and torch {torch.__version__}{hint}; "
                      "run python -m vllm_glm53.backends.cpu.build)")
    path = build.library_path(isa)
    try:
        torch.ops.load_library(str(path))
        if not envs.flag(AMX_ENV):
            torch.ops.vllm_glm53.amx_tiles(False)
        info = torch.ops.vllm_glm53.build_info()
    except (OSError, RuntimeError) as exc:
        return None, f"plain torch ({path.name} failed to load: {exc})"
    return isa, f"compiled kernels ({info}) from {path.name}"


def ops():
    """``torch.ops.vllm_glm53`` if the compiled kernels are loaded in this process, else None."""
    global _loaded, _isa, _description
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _isa, _description = _load()
                log = logger.info if _isa or "KERNELS=0" in _description else logger.warning
                log("vllm-glm53 CPU backends: %s", _description)
                _loaded = _isa is not None
    return torch.ops.vllm_glm53 if _loaded else None


# What the compiled kernels read (the dispatch's compiled-kernel check); other dtypes (float64, ...) take the
# torch code.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def description() -> str:
    """What :func:`ops` decided, e.g. ``compiled kernels (avx512 torch 2.13.0) from ...``."""
    ops()
    return _description


def isa() -> str | None:
    """The instruction set of the loaded kernels (``avx512``, ``avx2``, ``portable``), None on the torch path."""
    ops()
    return _isa


def amx_tiles() -> bool:
    """Whether the loaded kernels multiply on AMX tiles (csrc/amx.h): the avx512 build on a CPU with AMX-BF16 whose
    OS grants the tile state, unless ``VLLM_GLM53_CPU_AMX=0``. Read once, then kept (the dispatch asks per call)."""
    global _amx
    if _amx is None:
        lib = ops()
        _amx = bool(lib is not None and lib.amx_tiles())
    return _amx


def set_amx_tiles(on: bool) -> bool:
    """Turn the kernels' AMX tiles on (where the CPU has them) or off, for tests and benchmarks that compare both
    paths in one process; returns :func:`amx_tiles`."""
    global _amx
    lib = ops()
    _amx = bool(lib is not None and lib.amx_tiles(on))
    return _amx
