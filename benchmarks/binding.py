"""The thread binding the benchmarks give vLLM's workers: the caller's ``VLLM_CPU_OMP_THREADS_BIND`` if set, else the
CPU recipe's (and ``make demo``'s): each tensor-parallel rank its own share of the cores, the last core left to
vLLM's engine core (``vllm_glm53.recipes.cpu_bind`` says why). A transformers side of a comparison gets all the
cores in its one process."""

import os

from vllm_glm53.recipes import cpu_bind

VAR = "VLLM_CPU_OMP_THREADS_BIND"


def as_recipe(tp: int = 1) -> str:
    """Set the binding in this process's environment (vLLM's processes inherit it) unless set; returns it."""
    os.environ.setdefault(VAR, cpu_bind(tp))
    return os.environ[VAR]
