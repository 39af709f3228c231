# Two commands on a fresh machine:  make demo   and   make test
# Both create .venv, install the CPU torch wheel first (so nothing pulls CUDA torch),
# then the project (building the C++ extension when a compiler is there).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-fast test-oldest test-gpu clean

$(VENV)/.installed: setup.py
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VPY) -m tabed_engine.demo

# everything but GPU tests, the statistical ones (marked slow) included
test: setup
	$(VPY) -m pytest -q -n 2 --dist worksteal

# the same without the tests marked slow (statistical losslessness, end-to-end benchmark smoke runs)
test-fast: setup
	$(VPY) -m pytest -q -n 2 --dist worksteal -m "not gpu and not slow"

# the oldest transformers setup.py accepts, in its own venv (CI runs make test, then this)
TF_OLDEST ?= transformers==4.57.6
VENV_OLDEST := .venv-tf4

$(VENV_OLDEST)/.installed: setup.py
	test -x $(VENV_OLDEST)/bin/python || $(PY) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(VENV_OLDEST)/bin/python -m pip install -q "$(TORCH_SPEC)"
	TABED_NO_EXT=1 $(VENV_OLDEST)/bin/python -m pip install -q --no-build-isolation -e ".[test]" "$(TF_OLDEST)"
	touch $@

test-oldest: $(VENV_OLDEST)/.installed
	$(VENV_OLDEST)/bin/python -m pytest -q -n 2 tests/test_bad_input.py tests/test_bundled_pair.py
	$(VENV_OLDEST)/bin/python -m tabed_engine.demo --device cpu --max-new-tokens 8

# On a machine that already has CUDA torch/triton/transformers (no registry needed).
test-gpu:
	$(PY) -m pip install -q --no-build-isolation --no-deps -e . && $(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) $(VENV_OLDEST) build *.egg-info tabed_engine/_C*.so
