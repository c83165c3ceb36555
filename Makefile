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
# The newest JAX that pyproject.toml's range admits, tested beside the lock in its own venv on
# what touches JAX's changing APIs (make test-jax-next): the op and its validation, dispatch,
# the modules, the partitioning on 8 fake devices (custom partitioning, shard_map, sharding
# types; both Pallas kernels in interpret mode), x64, and the Pallas lowering of both kernels
# for cuda and tpu (export). The long interpret-mode kernel suites run on the lock only.
JAX_NEXT ?= 0.12.0.1
VENV_NEXT ?= .venv-jax-next
NEXT_TESTS ?= tests/test_reference.py tests/test_api_validation.py tests/test_dispatch.py \
	tests/test_directional.py tests/test_model.py tests/test_attention_fn.py tests/test_linen.py \
	tests/test_partitioning.py tests/test_x64.py tests/test_export.py tests/test_tpu_export.py \
	tests/test_library_use.py tests/test_typing.py

.PHONY: venv train eval sample test test-all test-jax-next bench clean help

help:
	@echo "make train   - set up .venv and train the '$(CONFIG)' config into $(WORKDIR) (resumes if present)"
	@echo "make eval    - evaluate the latest checkpoint in $(WORKDIR)"
	@echo "make sample  - generate text from the latest checkpoint in $(WORKDIR) after PROMPT"
	@echo "make test    - set up .venv and run the test suite (CPU) but its slow tests"
	@echo "make test-all - the whole test suite, slow tests included"
	@echo "make test-jax-next - the op, module, partitioning and export tests on jax $(JAX_NEXT)"
	@echo "make bench   - attention benchmark (needs an NVIDIA GPU)"

# The editable install silences setuptools' warning that folders named like the package may
# shadow it (here they are the package).
$(VENV)/.installed: requirements.txt pyproject.toml Makefile
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found; set PYTHON=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	if [ -n "$(JAX_EXTRA)" ]; then $(PY) -m pip install -q "jax[$(JAX_EXTRA)]==0.11.2"; fi
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --no-deps -e .
	$(PY) -m compileall -q ls_jax kernels configs  # the editable install leaves them uncompiled
	touch $@

venv: $(VENV)/.installed

train: venv
	$(PY) train.py --config $(CONFIG) --workdir $(WORKDIR) $(ARGS)

eval: venv
	$(PY) eval.py --checkpoint $(WORKDIR) $(ARGS)

sample: venv
	$(PY) -m ls_jax.inference.sample --checkpoint $(WORKDIR) --prompt "$(PROMPT)" $(ARGS)

# make test (CI): all but the tests marked slow (more cases of what make test checks, and the
# longer end-to-end runs); make test-all: every test
# (each test module on one worker: a module's fixture runs once)
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not slow" tests $(ARGS)

test-all: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope tests $(ARGS)

# A venv over $(VENV): that venv's packages (and its editable ls_jax) through a .pth, its own
# site-packages first; `make $(VENV_NEXT)/.installed` etc. add to it what differs.
# the site-packages directory of the venv $(1), in a recipe's shell
purelib = $$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
define overlay_venv
	rm -rf $(1)
	"$$($(PY) -c 'import sys; print(sys._base_executable)')" -m venv --without-pip $(1)
	echo "import site; site.addsitedir('$(call purelib,$(VENV))')" > "$(call purelib,$(1))/zz_base_venv.pth"
endef

$(VENV_NEXT)/.installed: $(VENV)/.installed
	$(call overlay_venv,$(VENV_NEXT))
	$(PY) -m pip install -q --no-deps --target "$(call purelib,$(VENV_NEXT))" \
	  "jax==$(JAX_NEXT)" "jaxlib==$(JAX_NEXT)"
	touch $@

test-jax-next: $(VENV_NEXT)/.installed
	$(VENV_NEXT)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not slow" \
	  -p no:cacheprovider $(NEXT_TESTS) $(ARGS)

bench: venv
	$(PY) bench/attention.py $(ARGS)

clean:
	rm -rf $(VENV) $(VENV_NEXT) $(TPU_VENV) runs .pytest_cache

# TPU compile tests (tests/test_tpu_compile.py): a second venv with the lock's jax[tpu], whose
# libtpu compiles for TPU topologies on this host (no TPU needed).
TPU_VENV ?= .venv-tpu

.PHONY: venv-tpu test-tpu-compile

# libtpu as the lock's jax[tpu] extra pins it (jax 0.11.2: libtpu==0.0.48.*)
LIBTPU ?= 0.0.48.1

$(TPU_VENV)/.installed: $(VENV)/.installed
	$(call overlay_venv,$(TPU_VENV))
	$(PY) -m pip install -q --no-deps --target "$(call purelib,$(TPU_VENV))" "libtpu==$(LIBTPU)"
	touch $@

venv-tpu: $(TPU_VENV)/.installed

test-tpu-compile: venv-tpu
	$(TPU_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) -m tpu_compile tests/test_tpu_compile.py $(ARGS)
