"""The GPU backends' kernels, checked on this CPU machine: runs tests/test_gpu_backends_kernels.py (every
Triton / fla-core path against the CPU backend) in the separate environment ``.venv-triton`` under Triton's
interpreter, and reports the outcome per op family.

Why a subprocess in another environment: fla-core must not be importable next to transformers (which would
route its KDA reference to fla's GPU kernels), and ``TRITON_INTERPRET`` must be set before any kernel is
defined. ``make setup-triton`` (scripts/setup-triton-venv.sh) creates the environment.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-triton" / "bin" / "python"
KERNEL_TESTS = "tests/test_gpu_backends_kernels.py"
# Kernel tests that only mean something on a GPU and skip under the interpreter.
GPU_ONLY = {"test_mla_bfloat16_on_gpu"}


_run: dict = {}  # the interpreter run start_in_background began: its process, report and log files


def start_in_background() -> None:
    """Start the interpreter run at the lowest CPU priority as soon as the suite knows it will need it (conftest's
    collection hook): ~65 s of one core, run on the core the rest of the suite leaves idle instead of in line."""
    if _run or not VENV_PYTHON.exists():
        return
    out = Path(tempfile.mkdtemp(prefix="glm53-interpreter-"))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [str(VENV_PYTHON), "-m", "pytest", KERNEL_TESTS, "-q", "-p", "no:cacheprovider",
             f"--junitxml={out / 'junit.xml'}"],
            cwd=ROOT, env=env, stdout=stdout, stderr=stderr, preexec_fn=lambda: os.nice(19))
    _run.update(proc=proc, out=out)
    atexit.register(_stop)


def _stop() -> None:
    """At exit (a run that ended before this module's tests, -x): no interpreter left running, no files left."""
    _run["proc"].kill()
    shutil.rmtree(_run["out"], ignore_errors=True)


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, tuple[str, str]]:
    """Test name -> (outcome, message) from one interpreter run of the kernel tests."""
    if not VENV_PYTHON.exists():
        pytest.skip(".venv-triton is missing: run `make setup-triton` (scripts/setup-triton-venv.sh)")
    start_in_background()
    proc, out = _run["proc"], _run["out"]
    try:
        proc.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    junit, stdout = out / "junit.xml", (out / "stdout").read_text()
    if not junit.exists():
        pytest.fail(f"the interpreter run produced no report (exit {proc.returncode}):\n{stdout[-4000:]}"
                    f"\n{(out / 'stderr').read_text()[-4000:]}")
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, (child.get("message") or "") + "\n" + (child.text or "")[-2000:]
        results[case.get("name")] = (outcome, message)
    sys.stdout.write(stdout[-2000:])
    return results


@pytest.mark.parametrize("family", ["kda", "indexer", "mla"])
def test_gpu_backend_matches_cpu_under_interpreter(family, kernel_results):
    cases = {name: r for name, r in kernel_results.items() if name.startswith(f"test_{family}_")}
    assert len(cases) >= 3, f"no {family} kernel tests ran: {sorted(kernel_results)}"
    bad = {name: msg for name, (outcome, msg) in cases.items()
           if outcome in ("failure", "error") or (outcome == "skipped" and name.split("[")[0] not in GPU_ONLY)}
    assert not bad, "\n\n".join(f"{name}: {msg}" for name, msg in sorted(bad.items()))
