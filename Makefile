# One-command entry points. Each target sets up its own virtualenv first, so a fresh
# clone needs nothing but python3 (>= 3.10) and make.
#   make demo   install, then run the demo (python -m coda demo)
#   make test   install, then run the test suite (the command CI runs)
PY ?= python3
VENV ?= .venv
# Without an NVIDIA driver, pin the local CPU build of torch (no CUDA downloads).
CONSTRAINTS := $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints/cpu.txt)
# coda targets Hopper; on a GPU-less machine CuTeDSL must be told so explicitly.
export CUTE_DSL_ARCH ?= sm_90a

.PHONY: demo test install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints/cpu.txt
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q $(CONSTRAINTS) -e ".[test]"
	touch $@

demo: install
	$(VENV)/bin/python -m coda demo

test: install
	$(VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
