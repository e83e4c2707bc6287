"""What the compiled-kernel test modules share: the kernels this process loaded, the fixture that requires them,
and the re-run of a module on every other instruction set this CPU runs (in a subprocess, with
``VLLM_GLM53_CPU_ISA`` forcing that build), so each path the loader could pick here is tested."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_glm53.backends.cpu import build, kernels

ops = kernels.ops()
ISA = kernels.isa()
OTHER_ISAS = [isa for isa in build.runnable_isas() if isa != ISA]


def require_kernels() -> None:
    """Skip where no compiler could build the kernels; fail where one exists and they are not loaded (a test going
    through a backend entry point would otherwise compare the torch path with itself)."""
    if ops is None:
        if build.compiler() is None:
            pytest.skip(f"no C++ compiler, so no CPU kernels: {kernels.description()}")
        pytest.fail(f"CPU kernels not loaded although a compiler exists: {kernels.description()}; "
                    "run make setup (or python -m vllm_glm53.backends.cpu.build)", pytrace=False)


def other_isas():
    """The parameters of a module's ``test_other_instruction_sets``: every other instruction set this CPU runs, or
    one skipped parameter saying that this process tests the only one."""
    return OTHER_ISAS or [pytest.param(None, marks=pytest.mark.skip(
        reason=f"this CPU runs only the {ISA} path, tested in this process"))]


def rerun_on(isa: str, module: str, deselect: str, timeout: int = 600) -> None:
    """Run the test module ``module`` (a file path) again on the kernels of ``isa``, without the tests ``deselect``
    names (a ``-k`` expression, which must include ``other_instruction_sets``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", module, "-q", "-p", "no:cacheprovider", "-k", f"not ({deselect})"],
        env={**os.environ, kernels.ISA_ENV: isa}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{kernels.ISA_ENV}={isa}:\n{proc.stdout[-8000:]}{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout
