# ls-jax: `make train` and `make test` work on a fresh machine with Python 3.12 available.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# A Python >= 3.12 to build the venv from: $(PYTHON) if set, else the first that works.
PYTHON ?= $(shell for p in python3.12 python3.13 python3 /root/.pyenv/versions/3.12*/bin/python /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	  if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then echo $$p; break; fi; done)
CONFIG ?= tiny
WORKDIR ?= runs/$(CONFIG)
ARGS ?=
PROMPT ?= def main(
TEST_WORKERS ?= 2
# On accelerators: JAX_EXTRA=cuda13 (NVIDIA GPUs) or JAX_EXTRA=tpu (TPU VMs) adds jax[...]
JAX_EXTRA ?=

.PHONY: venv train eval sample test test-fast bench clean help

help:
	@echo "make train   - set up .venv and train the '$(CONFIG)' config into $(WORKDIR) (resumes if present)"
	@echo "make eval    - evaluate the latest checkpoint in $(WORKDIR)"
	@echo "make sample  - generate text from the latest checkpoint in $(WORKDIR) after PROMPT"
	@echo "make test    - set up .venv and run the test suite (CPU)"
	@echo "make bench   - attention benchmark (needs an NVIDIA GPU)"

$(VENV)/.installed: requirements.txt pyproject.toml Makefile
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found; set PYTHON=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	if [ -n "$(JAX_EXTRA)" ]; then $(PY) -m pip install -q "jax[$(JAX_EXTRA)]==0.11.2"; fi
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.installed

train: venv
	$(PY) train.py --config $(CONFIG) --workdir $(WORKDIR) $(ARGS)

eval: venv
	$(PY) eval.py --checkpoint $(WORKDIR) $(ARGS)

sample: venv
	$(PY) -m ls_jax.sample --checkpoint $(WORKDIR) --prompt "$(PROMPT)" $(ARGS)

test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests $(ARGS)

bench: venv
	$(PY) bench/attention.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache

# TPU compile tests (tests/test_tpu_compile.py): a second venv with the lock's jax[tpu], whose
# libtpu compiles for TPU topologies on this host (no TPU needed).
TPU_VENV ?= .venv-tpu

.PHONY: venv-tpu test-tpu-compile

venv-tpu:
	$(MAKE) --no-print-directory venv VENV=$(TPU_VENV) JAX_EXTRA=tpu

test-tpu-compile: venv-tpu
	$(TPU_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) -m tpu_compile tests/test_tpu_compile.py $(ARGS)
