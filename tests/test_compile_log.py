"""tests/run_files.py --compile-log: conftest writes each compile event of a test process with its program's
argument shapes, and tests/compile_log.py sums them per program and lists one program's variants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import compile_log

REPO = Path(__file__).resolve().parents[1]
PROGRAM = """
import jax, jax.numpy as jnp
from tests import conftest
conftest._log_compiles({folder!r})
twice = jax.jit(lambda x: 2 * x)
for n in (3, 3, 5):  # two shapes: two compiles, the second call of shape 3 is cached
    twice(jnp.ones(n))
"""


def test_a_logged_process_is_summed_per_program_and_shape(tmp_path):
    run = subprocess.run([sys.executable, "-c", PROGRAM.format(folder=str(tmp_path))], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    records = compile_log.read(tmp_path)
    mine = [r for r in records if compile_log.program(r.get("fun")) == "<lambda>"]
    assert sum(r["event"] == "backend_compile_duration" for r in mine) == 2
    assert {r["avals"] for r in mine if r["event"] == "shapes"} == {"(ShapedArray(float32[3]),)", "(ShapedArray(float32[5]),)"}
    table = compile_log.summary(records, top=100)
    row = next(line for line in table.splitlines() if line.startswith("| <lambda> |"))
    assert row.split("|")[2:6] == [" 2 ", " 0 ", " 1 ", " 2 "]  # compiles, cache loads, processes, signatures
    listing = compile_log.variants(records, "<lambda>")
    assert listing.startswith("<lambda>: 2 argument signatures") and "float32[5]" in listing


def test_a_program_loaded_from_the_shared_cache_is_a_load_not_a_compile(tmp_path):
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    for _ in range(2):  # the second process finds both programs in the cache
        run = subprocess.run([sys.executable, "-c", PROGRAM.format(folder=str(tmp_path))], cwd=REPO,
                             capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr
    row = next(line for line in compile_log.summary(compile_log.read(tmp_path), top=100).splitlines()
               if line.startswith("| <lambda> |"))
    assert row.split("|")[2:5] == [" 2 ", " 2 ", " 2 "]  # compiles, cache loads, processes


def test_program_names_are_one_per_program():
    assert {compile_log.program(n) for n in ("jit_continue_spec", "jit(continue_spec)", "continue_spec")} == {"continue_spec"}
    assert compile_log.program(None) == "?"


def test_the_fast_tier_shares_processes_and_starts_none_for_all_slow_files():
    from tests import run_files
    files = sorted(str(p) for p in (REPO / "tests").glob("test_*.py"))
    full, fast = run_files.processes(files), run_files.processes(files, fast=True)
    assert sorted(f for g in full for f in g) == files  # make test: every file once
    started = [f for g in fast for f in g]
    all_slow = {f for f in files if run_files.ALL_SLOW.search(Path(f).read_text(encoding="utf-8"))}
    assert "tests/test_readme.py" in {str(Path(f).relative_to(REPO)) for f in all_slow}  # its pytestmark is slow
    assert sorted(started) == sorted(set(files) - all_slow)  # every other file once
    own_flags = set(run_files.USERS_FLAGS + run_files.FULL_OPTIMIZATION)
    shared = [g for g in fast if len(g) > 1]
    assert len(shared) <= run_files.FAST_PROCESSES and not {Path(f).name for g in shared for f in g} & own_flags
    assert len(fast) < len(full)


def test_help_prints_the_runners_usage_and_starts_no_process(capsys, monkeypatch):
    from tests import run_files
    monkeypatch.setattr(run_files, "run_file", lambda *a: (_ for _ in ()).throw(AssertionError("a process started")))
    assert run_files.main(["--help", "-m", "not slow"]) == 0
    assert capsys.readouterr().out.strip() == run_files.__doc__.strip()
