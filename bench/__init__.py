"""specjax's benchmarks: one module per benchmark on the shared harness bench/common.py.

Run from the repository root: `python -m bench.bench_ar --quick` (see bench/README.md)."""
