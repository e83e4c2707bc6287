"""One allocator for both sides of a comparison: the one the plugin gives vLLM's CPU engine processes
(``vllm_glm53/cpu_malloc.py``: a tcmalloc found on the machine, unless ``LD_PRELOAD`` names an allocator or
``VLLM_GLM53_CPU_TCMALLOC=0``). A benchmark calls :func:`same_as_engine` first thing: when that adds a library to
``LD_PRELOAD``, the script starts over under it, so what it times in its own process (transformers, the ops) runs
on the allocator the engine runs on, and the child processes it starts inherit it. Glibc's on both sides:
``VLLM_GLM53_CPU_TCMALLOC=0``."""

import os
import sys

from vllm_glm53 import cpu_malloc


def same_as_engine() -> None:
    if cpu_malloc.preload_tcmalloc() is not None:
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])  # the same command line


def describe() -> str:
    """The allocator this process runs on, for a table's header."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    found = [name for name in cpu_malloc.ALLOCATORS if name in maps]
    return found[0].removeprefix("lib") if found else "glibc malloc"
