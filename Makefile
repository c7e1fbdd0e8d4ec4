# The README's quick start: `make demo` and `make test`. Each creates .venv if missing.
# PYTHON and the venv directories can be overridden: `make test-current` reruns `test` and
# `test-lowering` with the newest Python and JAX in venvs of their own.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# `tokamax` installs on Python >= 3.12 only (the extra's marker skips it on 3.11).
EXTRAS ?= test,plot,lint,tokamax,flax

# pytest-xdist spreads each run over JOBS worker processes (`auto`: one per CPU core; CI has
# two). `make test JOBS=0` runs in one process, for pdb or a clean traceback order.
JOBS ?= auto
PYTEST = -m pytest -q -p no:cacheprovider -n $(JOBS)

.PHONY: demo test lint test-slow test-lowering test-torch test-current versions test-gpu bench notebooks clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/maskc check "causal & chunk(8192) | bidirectional(img)"
	$(VENV)/bin/maskc dense "causal & chunk(4) | bidirectional(img)" --q-len 12 \
	  --operand img=0,0,0,1,1,1,1,1,0,0,0,0
	$(VENV)/bin/maskc show "causal & chunk(8192) | bidirectional(img)" --q-len 32768 \
	  --operand img=32768:0,1:1000-3000,1:20000-22048 --width 80

test: $(STAMP)
	$(PY) $(PYTEST) --durations=15

# ruff and mypy (the lint extra), configured in pyproject.toml: ruff over everything with
# Python in it; the public modules are type-checked strictly, the rest with mypy's defaults.
lint: $(STAMP)
	$(VENV)/bin/ruff check maskc tests benchmarks examples notebooks
	$(VENV)/bin/mypy maskc

# Cross-lowering checks (tests/test_cross_lowering.py, tests/test_mosaic_gpu_lowering.py): flash
# -> Triton and mosaic_gpu -> Mosaic GPU for cuda need JAX's CUDA plugin, which prints errors
# when imported on a machine without CUDA, so it lives in its own venv, never in .venv. Its two
# wheels are installed without their CUDA libraries (~460 MB). The mosaic_gpu extra is absl-py,
# which jax 0.10's Mosaic GPU imports. Tests also marked `slow` (the full matrix) run in
# `make test-slow`.
LOWERING_TESTS := tests/test_cross_lowering.py tests/test_mosaic_gpu_lowering.py
LVENV ?= .venv-lowering
LPY := $(LVENV)/bin/python
LSTAMP := $(LVENV)/.installed

$(LVENV)/bin/python:
	$(PYTHON) -m venv $(LVENV)
	$(LPY) -m pip install -q --upgrade pip

$(LSTAMP): pyproject.toml | $(LVENV)/bin/python
	$(LPY) -m pip install -q -e ".[test,tokamax,mosaic_gpu]"
	JAX_VERSION=$$($(LPY) -c "import jax; print(jax.__version__)") && \
	  $(LPY) -m pip install -q --no-deps "jax-cuda12-plugin==$$JAX_VERSION" \
	    "jax-cuda12-pjrt==$$JAX_VERSION"
	touch $(LSTAMP)

test-lowering: $(LSTAMP)
	JAX_PLATFORMS=cpu $(LPY) $(PYTEST) -m "lowering and not slow" \
	  $(LOWERING_TESTS)

# maskc.torch and verify on torch objects: the tests marked `torch` (and maskc/torch's doctests,
# which conftest.py marks so) in .venv-torch, with PyTorch's CPU-only wheel: `+cpu` pins it, so
# pip never takes the registry's default build, which pulls several GB of CUDA libraries (pip's
# find-links on the CI machine hold the wheel; elsewhere set TORCH_PIP_ARGS to
# `--extra-index-url https://download.pytorch.org/whl/cpu`). transformers is there for the tests
# of Hugging Face configs that need torch.
TVENV ?= .venv-torch
TPY := $(TVENV)/bin/python
TSTAMP := $(TVENV)/.installed
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_PIP_ARGS ?=
TRANSFORMERS_SPEC ?= transformers==5.24.0

$(TVENV)/bin/python:
	$(PYTHON) -m venv $(TVENV)
	$(TPY) -m pip install -q --upgrade pip

$(TSTAMP): pyproject.toml | $(TVENV)/bin/python
	$(TPY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(TPY) -m pip install -q -e ".[test,torch]" "$(TRANSFORMERS_SPEC)"
	touch $(TSTAMP)

test-torch: $(TSTAMP)
	$(TPY) $(PYTEST) --durations=10 -m "torch and not slow"

# The newest end of the supported range: Python >= 3.12 (jax 0.11+ needs it) with the newest
# jax and tokamax, in .venv-current and .venv-lowering-current. PYTHON_CURRENT defaults to
# pyenv's newest 3.12, else `python3.12` on the PATH.
PYTHON_CURRENT ?= $(or $(lastword $(sort $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3))),$(shell command -v python3.12 2>/dev/null))

test-current:
	@test -n "$(PYTHON_CURRENT)" || { echo "test-current needs Python 3.12+: set PYTHON_CURRENT"; exit 1; }
	$(MAKE) test test-lowering PYTHON=$(PYTHON_CURRENT) VENV=.venv-current \
	  LVENV=.venv-lowering-current
	$(MAKE) versions PYTHON=$(PYTHON_CURRENT) VENV=.venv-current

# What a venv runs on: Python, jax, jaxlib and tokamax versions.
versions: $(STAMP)
	@$(PY) --version
	@$(PY) -m pip list --disable-pip-version-check 2>/dev/null | grep -E "^(jax|jaxlib|tokamax) "

test-slow: $(STAMP) $(LSTAMP)
	$(PY) $(PYTEST) --durations=15 -m "slow and not lowering"
	JAX_PLATFORMS=cpu $(LPY) $(PYTEST) -m "lowering and slow" \
	  $(LOWERING_TESTS)

# Kernels compiled for and run on a real NVIDIA GPU (tests/test_gpu.py). Needs a Python whose
# jax has a CUDA plugin (jax[cuda12] or jax[cuda13]), with maskc installed in it
# (`pip install -e .`) and pytest and hypothesis; set GPU_PYTHON.
GPU_PYTHON ?= python3

test-gpu:
	MASKC_TEST_GPU=1 $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m gpu \
	  tests/test_gpu.py

bench: $(STAMP)
	$(PY) benchmarks/compile_speed.py

# Re-runs the notebooks in place and writes their outputs, which are committed
# (notebooks/run.py keeps them deterministic; tests/test_notebooks.py checks them).
notebooks: $(STAMP)
	$(PY) notebooks/run.py

clean:
	rm -rf .venv .venv-lowering .venv-current .venv-lowering-current .venv-torch build dist \
	  *.egg-info
