# The two README commands: `make demo` (the main job) and `make test` (the suite). Both set up first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.glm53-setup

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup setup-triton demo test clean

setup: $(STAMP)

# Re-run the set-up only when what it installs changes; the plugin itself is an editable install.
$(STAMP): setup.py pyproject.toml scripts/setup-cpu.sh
	bash scripts/setup-cpu.sh
	@touch $(STAMP)

demo: setup
	$(PY) -m vllm_glm53.demo

# setup-triton: the GPU kernels are also tested on the CPU through Triton's interpreter, in their own venv.
# The kernel build is quick when csrc/ has not changed since the last one, and fails loudly when it does not compile.
# --durations: the log names the slowest tests, to keep the suite well under 30 minutes on 2 cores.
test: setup setup-triton
	$(PY) -m vllm_glm53.backends.cpu.build --if-compiler
	$(PY) -m pytest -ra --durations=30 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-triton build *.egg-info

# The separate environment in which tests/test_gpu_backends_interpreter.py runs the GPU kernels (fla-core,
# Triton) on the CPU through Triton's interpreter; fla-core must stay out of .venv. Quick when up to date.
setup-triton:
	bash scripts/setup-triton-venv.sh
