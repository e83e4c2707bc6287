"""Every environment variable the plugin reads, in one table: its default, what it accepts, what it does.

Values are read when asked (``envs.VLLM_GLM53_MODEL``), not at import, so a test or a launcher that sets a variable
later is seen. A value outside what a variable accepts raises :class:`EnvError` naming the variable and the valid
values, instead of being taken for the default. The README's "Configuration knobs" table lists the same names;
``tests/test_envs.py`` keeps the two in step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class EnvError(ValueError):
    """A ``VLLM_GLM53_*`` variable holds a value the plugin does not accept."""


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    choices: tuple[str, ...]  # accepted spellings (after strip + lower-case)
    help: str

    def read(self) -> str:
        raw = os.environ.get(self.name)
        value = self.default if raw is None or not raw.strip() else raw.strip().lower()
        if value not in self.choices:
            raise EnvError(f"{self.name}={raw!r} is not valid; expected one of: {', '.join(self.choices)}")
        return value


_FLAG = ("0", "1", "false", "true", "no", "yes")
_TRUE = ("1", "true", "yes")

VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable("VLLM_GLM53_DISABLE", "0", _FLAG, "1: the plugin registers nothing (vLLM behaves as if it were absent)"),
        Variable("VLLM_GLM53_MODEL", "auto", ("auto", "plugin", "vllm"),
                 "who serves GLM-5.3: auto (vLLM's own model on CUDA/ROCm, vllm-ascend's where it has one, else the "
                 "plugin's), plugin (force the plugin's model), vllm (force vLLM's / vllm-ascend's)"),
        Variable("VLLM_GLM53_BACKEND", "auto", ("auto", "cpu", "cuda", "rocm"),
                 "op backends of the plugin's model: auto (by platform), or force cpu / cuda"),
        Variable("VLLM_GLM53_CPU_KERNELS", "1", _FLAG, "0: the CPU ops run in plain PyTorch instead of the compiled kernels"),
        Variable("VLLM_GLM53_CPU_ISA", "auto", ("auto", "avx512", "avx2", "portable"),
                 "which compiled CPU kernel build to load: auto (the best this CPU runs) or force one it runs"),
        Variable("VLLM_GLM53_CPU_AMX", "1", _FLAG,
                 "0: the compiled CPU kernels leave AMX tiles unused (the AVX-512 bfloat16 dot products instead) on a "
                 "CPU that has them"),
        Variable("VLLM_GLM53_CPU_TCMALLOC", "1", _FLAG,
                 "1: where the plugin's model serves on CPU, vLLM's engine and worker processes start with a tcmalloc "
                 "found on the machine first in LD_PRELOAD, unless it names an allocator already; 0: LD_PRELOAD is "
                 "left alone (glibc's allocator)"),
        Variable("VLLM_GLM53_SPARSE_MLA", "auto", ("auto", "triton"),
                 "GPU sparse MLA of the plugin's model: auto (FlashMLA's sparse kernel where vLLM ships it, else "
                 "Triton) or triton"),
    )
}


def flag(name: str) -> bool:
    """A yes/no variable as a bool."""
    return VARIABLES[name].read() in _TRUE


def __getattr__(name: str) -> str:
    variable = VARIABLES.get(name)
    if variable is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return variable.read()
