# The README's quick start: `make demo` and `make test`. Each creates .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench wheel-test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/maskc check "causal & chunk(8192) | bidirectional(img)"
	$(VENV)/bin/maskc dense "causal & chunk(4) | bidirectional(img)" --q-len 12 \
	  --operand img=0,0,0,1,1,1,1,1,0,0,0,0
	$(VENV)/bin/maskc show "causal & chunk(8192) | bidirectional(img)" --q-len 32768 \
	  --operand img=32768:0,1:1000-3000,1:20000-22048 --width 80

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

test-slow: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow

bench: $(STAMP)
	$(PY) benchmarks/compile_speed.py

clean:
	rm -rf $(VENV) build dist *.egg-info
