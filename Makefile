# The two README commands: `make demo` (the main job) and `make test` (the suite). Both set up first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.glm53-setup

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test bench clean

setup: $(STAMP)

# Re-run the set-up only when what it installs changes; the plugin itself is an editable install.
$(STAMP): setup.py pyproject.toml scripts/setup-cpu.sh
	bash scripts/setup-cpu.sh
	@touch $(STAMP)

demo: setup
	$(PY) -m vllm_glm53.demo

test: setup
	$(PY) -m pytest -ra $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
