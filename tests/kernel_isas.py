"""What the compiled-kernel test modules share: the kernels this process loaded, the fixture that requires them,
and the re-run of a module on every other instruction set this CPU runs (in a subprocess, with
``VLLM_GLM53_CPU_ISA`` forcing that build), so each path the loader could pick here is tested.

A CPU without AVX-512 also re-runs the modules on the avx512 path emulated (``avx512-emulated``): the kernels
built with that path's intrinsics taken from SIMDe (Debian's libsimde-dev, which the set-up installs) and
tests/avx512_emulation.h, so the arithmetic every AVX-512 server runs is checked on every machine; the rerun's
process loads that library as its avx512 one (``EMULATION_ENV`` names it). It checks values, not speed, and not
that masked loads stay inside their buffers (the emulation reads only the selected lanes, as the instructions
do, but cannot fault where they would)."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vllm_glm53.backends.cpu import build, kernels

EMULATED = "avx512-emulated"
EMULATION_ENV = "GLM53_TEST_EMULATED_AVX512"  # set in an emulated rerun: the library to load as avx512
EMULATION_HEADER = Path(__file__).resolve().parent / "avx512_emulation.h"
SIMDE_HEADER = "simde/x86/avx512.h"

if os.environ.get(EMULATION_ENV):
    # This process is an emulated rerun: the CPU "runs" avx512 and its library is the emulated build. Patched
    # before the first kernels.ops() call, which loads the library.
    _emulated_library = Path(os.environ[EMULATION_ENV])
    _library_path = build.library_path
    build.ISA_CPU_FLAGS = {**build.ISA_CPU_FLAGS, "avx512": build.ISA_CPU_FLAGS["avx2"]}
    build.library_path = lambda isa, torch_version=None: (
        _emulated_library if isa == "avx512" else _library_path(isa, torch_version))

ops = kernels.ops()
ISA = kernels.isa()
OTHER_ISAS = [isa for isa in build.runnable_isas() if isa != ISA]
if os.environ.get(EMULATION_ENV):
    assert ISA == "avx512", f"the emulated rerun loaded {kernels.description()}"


def simde_include_dir() -> Path | None:
    """The include directory holding SIMDe's AVX-512 header, or None."""
    for d in ("/usr/include", "/usr/local/include"):
        if (Path(d) / SIMDE_HEADER).is_file():
            return Path(d)
    return None


def require_kernels() -> None:
    """Skip where no compiler could build the kernels; fail where one exists and they are not loaded (a test going
    through a backend entry point would otherwise compare the torch path with itself)."""
    if ops is None:
        if build.compiler() is None:
            pytest.skip(f"no C++ compiler, so no CPU kernels: {kernels.description()}")
        pytest.fail(f"CPU kernels not loaded although a compiler exists: {kernels.description()}; "
                    "run make setup (or python -m vllm_glm53.backends.cpu.build)", pytrace=False)


def other_isas():
    """The parameters of a module's ``test_other_instruction_sets``: every other instruction set this CPU runs, and
    the emulated avx512 path where the CPU has no AVX-512 (skipped, saying why, without SIMDe's headers)."""
    params = list(OTHER_ISAS)
    if "avx512" not in build.runnable_isas() and ops is not None:
        params.append(EMULATED if simde_include_dir() else pytest.param(EMULATED, marks=pytest.mark.skip(
            reason=f"no {SIMDE_HEADER}: apt-get install libsimde-dev (make setup does, as root)")))
    return params or [pytest.param(None, marks=pytest.mark.skip(
        reason=f"this CPU runs only the {ISA} path, tested in this process"))]


def emulated_avx512_library() -> Path:
    """The kernels built with the avx512 path emulated (see the module docstring): vec.h's avx512 branch with
    tests/avx512_emulation.h force-included, on top of the avx2 build's flags. Kept under build/ and rebuilt
    when a kernel source or the emulation header is newer. Waits for the build start_emulated_build began."""
    if _background_build is not None:
        return _background_build.result()
    return _build_emulated()


_background_build: concurrent.futures.Future | None = None


def start_emulated_build() -> None:
    """Build the emulated avx512 library in the background at the lowest CPU priority (the suite calls this when
    it will rerun modules on that path, and runs those reruns last). Compiling SIMDe's AVX-512 takes ~280 s of CPU
    on a Zen 3 core, ~140 s of a 2-core machine's time when run alone; the suite leaves about 0.8 of its 2 cores
    idle on average (engine start-ups are mostly one process's imports), so the build runs on that instead."""
    global _background_build
    if _background_build is not None:
        return

    def build_niced() -> Path:
        # Linux keeps the nice value per thread, and the compiler processes (and the pool threads starting them)
        # inherit it from this one: the tests' own processes keep the CPU when they want it.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return _build_emulated()

    _background_build = concurrent.futures.ThreadPoolExecutor(1, "emulated-avx512-build").submit(build_niced)


def _build_emulated() -> Path:
    import torch

    target = build.source_dir().parent / "build" / f"kernels-{EMULATED}"
    target = target / f"_kernels.avx512.torch-{torch.__version__}.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    # -fno-tree-sra: GCC 12 stops with an internal error in that pass on SIMDe's 512-bit types.
    extra = ("-DGLM53_EMULATED_AVX512", f"-I{simde_include_dir()}", "-include", str(EMULATION_HEADER), "-fno-tree-sra")
    return build.compile_library("avx2", target, extra_cflags=extra, extra_sources=(EMULATION_HEADER,))


def rerun_on(isa: str, module: str, deselect: str, timeout: int = 600) -> None:
    """Run the test module ``module`` (a file path) again on the kernels of ``isa`` (or the emulated avx512 path),
    without the tests ``deselect`` names (a ``-k`` expression, which must include ``other_instruction_sets``)."""
    env = {**os.environ, kernels.ISA_ENV: isa}
    if isa == EMULATED:
        env.update({kernels.ISA_ENV: "avx512", EMULATION_ENV: str(emulated_avx512_library())})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", module, "-q", "-p", "no:cacheprovider", "-k", f"not ({deselect})"],
        env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{isa}:\n{proc.stdout[-8000:]}{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout


@pytest.fixture(params=["dot products", "AMX tiles"])
def bf16_products(request):
    """Each way the avx512 kernels multiply bfloat16 tokens where the CPU offers both: its bfloat16 dot products (or
    float32 for bfloat16 weights) and AMX tiles (csrc/amx.h), switched in this process; elsewhere the one way there
    is, and the AMX case skipped saying why."""
    before = kernels.amx_tiles()
    on = kernels.set_amx_tiles(request.param == "AMX tiles")
    try:
        if request.param == "AMX tiles" and not on:
            pytest.skip(f"no AMX tiles in {kernels.description()} (an Intel Xeon from Sapphire Rapids on)")
        assert ops is None or ("AMX tiles" in ops.build_info()) == on
        yield request.param
    finally:
        kernels.set_amx_tiles(before)
