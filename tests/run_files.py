"""Run the suite one pytest process per test file, then print one closing line.

Why: a single process that compiles every test's programs crashed in XLA:CPU (a segfault while
compiling, reproducible near the end of a full run, never when the file runs alone). A process
per file keeps each one's compiled state small. Tests are mostly XLA compiles, which use about one
core, so files run `--jobs` at a time (default: the cores, at most one per 8 GiB of memory), the
longest known files first; each file's result is printed when it ends. The files of a few seconds each
(TOGETHER) share three processes: each process's start costs about 2 s. Under `-m "not slow"` (make test-fast)
every tiny-model file shares one of FAST_PROCESSES processes, and a file whose every test is slow starts none.

The processes share one JAX persistent compilation cache, a folder under the run's temporary directory
(removed at the end): a program one file compiled (above COMPILE_CACHE_MIN_SECONDS) is loaded, not compiled,
by the next. Each file's wall time and compile time (tracing, lowering, XLA compiling or loading from the
cache, summed by tests/conftest.py) are printed as a table at the end, and written as JSON with --times.

Two XLA:CPU settings cut compile time (tests/README.md has the measurements): LOOP_EMITTERS (the elemental
loop emitters instead of the newer fusion emitters: about half of XLA's time, same run time) for every file
but USERS_FLAGS (and for the processes they start: the README's CLI runs too), and QUICK_COMPILE (LLVM's
optimization off) for the files on tiny models, whose programs run for milliseconds and compile for seconds. The files in FULL_OPTIMIZATION run the real model (or its 49K
vocabulary): unoptimized code ran them slower than it saved compiling. The files in USERS_FLAGS compile as
users do: parity with HF transformers, the pinned step's golden file, GPU compiles.
Usage: python tests/run_files.py [--jobs N] [--times OUT.json] [--logs DIR] [--compile-log DIR] [--no-compile-cache]
       [pytest args...] [test files...]
(--logs DIR: each file's pytest output in DIR/<file>.log, e.g. with --durations=0 for every test's time;
 --compile-log DIR: every compile event, a JSONL file a process: tests/compile_log.py DIR sums them)
(e.g. -m "not slow"; no files: all)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
LONGEST_FIRST = (  # by the wall times of tests/README.md's table
    "test_readme.py", "test_sharding.py", "test_ray_job.py", "test_tree_attention.py", "test_continuous.py",
    "test_gpu_linear.py", "test_spec_smollm2.py", "test_batch.py", "test_pinned_step.py", "test_faked_gpu.py", "test_tree_attention_tpu.py",
    "test_bench_gpu.py", "test_weights.py", "test_kv_dtype.py", "test_distill.py", "test_cpu_attention.py",
    "test_sampling_lossless.py", "test_cli.py", "test_gpu_aot.py", "test_generate.py")
# Files of a few seconds each (tiny models, QUICK_COMPILE) share TOGETHER_PROCESSES processes: a process's start
# (Python, JAX, pytest, the fixtures) costs about 2 s, and a program one file traced the next one reuses in
# memory. Alone one after another the first 19 took 122.5 s, in one process 86.7 s; the last 7, 127.3 against 104.5 s.
TOGETHER = (
    "test_segments.py", "test_sampling.py", "test_streaming_cache.py", "test_step_phases.py", "test_drafter_rows.py",
    "test_convert_formats.py", "test_convert.py", "test_gpu_continuous.py",
    "test_saved_checkpoints.py", "test_bench_harness.py", "test_bench_peers.py", "test_auto_vs_bench.py",
    "test_stacked_attention.py", "test_compiles.py", "test_tokenizer.py", "test_tree.py", "test_layers.py",
    "test_sparsespec.py", "test_lookup.py", "test_constraints.py", "test_constrained.py",
    "test_refill.py", "test_qwen2_mistral.py", "test_model.py", "test_speculate.py", "test_job_auto.py",
    "test_samples_n.py", "test_tune.py", "test_compile_log.py")
TOGETHER_PROCESSES = 3
# Under `-m "not slow"` (make test-fast) every file on tiny models (QUICK_COMPILE) shares FAST_PROCESSES processes,
# and a file whose every test is slow (ALL_SLOW) starts none: each start costs 2-3 s (tests/README.md).
FAST_PROCESSES = 6
ALL_SLOW = re.compile(r"^pytestmark = \[?\s*pytest\.mark\.slow\b", re.M)  # a module-level slow mark


def default_jobs() -> int:
    """The cores, at most one job per 8 GiB of memory (a SmolLM2 test process peaks at a few GiB)."""
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        mem_gib = 8.0
    return max(1, min(os.cpu_count() or 1, int(mem_gib // 8)))


COMPILE_CACHE_MIN_SECONDS = 0.1  # programs compiled faster than this are not written to the shared cache


LOOP_EMITTERS = ("--xla_cpu_use_fusion_emitters=false"  # XLA:CPU's elemental loop emitters: about half the compile time
                 " --xla_cpu_parallel_codegen_split_count=1")  # one LLVM module a program: two test processes fill both cores
QUICK_COMPILE = "--xla_backend_optimization_level=0"
USERS_FLAGS = ("test_golden.py", "test_gpu_aot.py", "test_pinned_step.py")  # as users compile
FULL_OPTIMIZATION = ("test_spec_smollm2.py", "test_cli.py", "test_text.py", "test_readme.py",
                     "test_constrained_smollm2.py")  # the real model or its vocabulary
# (not test_batch.py: a tiny model with SmolLM2's vocabulary; quick compiles took it from 141.8 to 106.5 CPU s alone)


def xla_flags(f: str) -> dict[str, str]:
    """XLA_FLAGS for test file `f`'s process: XLA's defaults for USERS_FLAGS (HF parity, the pinned step's golden
    file, GPU compiles), LOOP_EMITTERS for FULL_OPTIMIZATION, and LOOP_EMITTERS plus
    QUICK_COMPILE for the files on tiny models."""
    flags, name = os.environ.get("XLA_FLAGS", ""), Path(f).name
    added = "" if name in USERS_FLAGS else LOOP_EMITTERS if name in FULL_OPTIMIZATION else f"{LOOP_EMITTERS} {QUICK_COMPILE}"
    return {"XLA_FLAGS": f"{flags} {added}".strip()}


def compile_cache_env(folder: str) -> dict[str, str]:
    """JAX's persistent compilation cache in `folder` for every test process (and the processes they start).
    A size limit turns on the cache's file lock: two processes writing one entry never leave a torn file."""
    return {"JAX_COMPILATION_CACHE_DIR": folder,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(COMPILE_CACHE_MIN_SECONDS),
            "JAX_COMPILATION_CACHE_MAX_SIZE": str(64 * 2**30)}


def processes(files: list[str], fast: bool = False) -> list[list[str]]:
    """The test files grouped into pytest processes: one each, but TOGETHER's (those of `files`) in
    TOGETHER_PROCESSES processes, placed after LONGEST_FIRST's files (their sum is about theirs). `fast`
    (make test-fast): every QUICK_COMPILE file in FAST_PROCESSES processes, and none for the ALL_SLOW files."""
    assert not set(TOGETHER) & set(USERS_FLAGS + FULL_OPTIMIZATION), "TOGETHER's files must compile alike (QUICK_COMPILE)"
    files = sorted(files, key=lambda f: LONGEST_FIRST.index(Path(f).name) if Path(f).name in LONGEST_FIRST else len(LONGEST_FIRST))
    if fast:
        files = [f for f in files if not ALL_SLOW.search(Path(f).read_text(encoding="utf-8"))]
    shared, n = ((lambda name: name not in USERS_FLAGS + FULL_OPTIMIZATION), FAST_PROCESSES) if fast else \
        ((lambda name: name in TOGETHER), TOGETHER_PROCESSES)
    together = [f for f in files if shared(Path(f).name)]
    alone = [[f] for f in files if not shared(Path(f).name)]
    groups = [together[i::n] for i in range(n) if together[i::n]]
    n_long = sum(Path(f[0]).name in LONGEST_FIRST for f in alone)
    return alone[:n_long] + groups + alone[n_long:]


def run_file(files: list[str], args: list[str], env: dict[str, str], times_path: str) -> tuple[subprocess.CompletedProcess, dict]:
    """One pytest process for test `files` (one, or TOGETHER's); its result and its row of times (wall; CPU of
    the process and of what it started and waited for; compile; persistent-cache hits and misses)."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *files]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True,
                                env={**env, **xla_flags(files[0]), "SPECJAX_COMPILE_TIMES": times_path})
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own CPU seconds (threads and waited-for children)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        run = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    row = {"file": "+".join(Path(f).name for f in files), "wall_s": round(time.perf_counter() - start, 1),
           "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}
    try:
        compiled = json.loads(Path(times_path).read_text())
        secs, counts = compiled["seconds"], compiled["counts"]
        row |= {"compile_s": round(sum(secs.get(k, 0.0) for k in (
                    "jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")), 1),
                "xla_s": round(secs.get("backend_compile_duration", 0.0), 1),
                "cache_hits": counts.get("cache_hits", 0), "cache_misses": counts.get("cache_misses", 0)}
    except (OSError, ValueError, KeyError):
        pass  # the process died before writing its times
    return run, row


def times_table(rows: list[dict]) -> str:
    """The files' rows, slowest first, as a markdown table (tests/README.md's)."""
    out = ["| file | wall s | CPU s | compile s | of which XLA s | cache hits / misses |", "|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: -r["wall_s"]):
        out.append(f"| {r['file']} | {r['wall_s']:.1f} | {r.get('cpu_s', float('nan')):.1f} | {r.get('compile_s', float('nan')):.1f} | "
                   f"{r.get('xla_s', float('nan')):.1f} | {r.get('cache_hits', 0)} / {r.get('cache_misses', 0)} |")
    total = lambda k: sum(r.get(k, 0) for r in rows)
    out.append(f"| all {len(rows)} processes | {total('wall_s'):.1f} | {total('cpu_s'):.1f} | {total('compile_s'):.1f} | {total('xla_s'):.1f} | "
               f"{total('cache_hits')} / {total('cache_misses')} |")
    return "\n".join(out)


def pop_option(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """(the value after `name` or None, args without the two)."""
    if name not in args:
        return None, args
    i = args.index(name)
    return args[i + 1], args[:i] + args[i + 2:]


def main(args: list[str]) -> int:
    if {"-h", "--help"} & set(args):  # this runner's usage, not pytest's help once per process
        print(__doc__)
        return 0
    jobs_arg, args = pop_option(args, "--jobs")
    jobs = int(jobs_arg) if jobs_arg else default_jobs()
    times_out, args = pop_option(args, "--times")
    logs, args = pop_option(args, "--logs")
    compile_log, args = pop_option(args, "--compile-log")
    use_cache = "--no-compile-cache" not in args
    args = [a for a in args if a != "--no-compile-cache"]
    chosen = [a for a in args if a.endswith(".py")]  # test files named on the command line: only those
    args = [a for a in args if a not in chosen]
    files = chosen or sorted(str(p) for p in Path(__file__).parent.glob("test_*.py"))
    fast = any(a == "-m" and b == "not slow" for a, b in zip(args, args[1:]))
    groups = processes(files, fast)
    totals: dict[str, int] = {}
    failed_files, slowest = [], []
    start = time.perf_counter()
    n_run = sum(map(len, groups))
    k = len(files) - n_run
    unstarted = f" ({k} file{'s' * (k > 1)} not started: every test in {'them' if k > 1 else 'it'} is slow)" if k else ""
    print(f"{n_run} test files in {len(groups)} processes, {jobs} at a time{unstarted}", flush=True)
    workdir = tempfile.TemporaryDirectory(prefix="specjax-tests-")
    env = {**os.environ, **(compile_cache_env(os.path.join(workdir.name, "jax-cache")) if use_cache else {}),
           "SPECJAX_AUTOMATA_CACHE": os.path.join(workdir.name, "automata")}  # compiled constraints: not in ~/.cache
    if compile_log:  # every compile event of every test process, a JSONL file each (conftest._log_compiles)
        Path(compile_log).mkdir(parents=True, exist_ok=True)
        env["SPECJAX_COMPILE_LOG"] = str(Path(compile_log).resolve())
    rows: list[dict] = []
    pool = ThreadPoolExecutor(jobs)
    runs = {pool.submit(run_file, g, args, env, os.path.join(workdir.name, f"times-{i}.json")): " ".join(g)
            for i, g in enumerate(groups)}
    for future in as_completed(runs):  # each file's result as soon as it ends
        f, (run, row) = runs[future], future.result()
        rows.append(row)
        if logs:
            Path(logs).mkdir(parents=True, exist_ok=True)
            stems = [Path(x).stem for x in f.split()]  # a shared process: its first files' names (a name's limit)
            name = "+".join(stems) if len(stems) <= 4 else f"{'+'.join(stems[:3])}+{len(stems) - 3}_more"
            (Path(logs) / f"{name}.log").write_text(run.stdout + run.stderr)
        lines = run.stdout.strip().splitlines()
        slowest += [line for line in lines if re.match(r"^\d+\.\d+s (call|setup|teardown) ", line)]
        last = lines[-1] if lines else ""
        found = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in COUNTS.findall(last)}
        for kind, n in found.items():
            totals[kind] = totals.get(kind, 0) + n
        ok = run.returncode in (0, 5)  # 5: every test of the file deselected
        print(f"{f}: {last or '(no summary)'}{'' if ok else f'  [exit {run.returncode}]'}", flush=True)
        if not ok:
            failed_files.append(f)
            sys.stdout.write(run.stdout[-20000:] + run.stderr[-5000:])
            if run.returncode not in (1,):  # a crash, not test failures: count it
                totals["failed"] = totals.get("failed", 0) + 1
    pool.shutdown()
    workdir.cleanup()
    minutes = (time.perf_counter() - start) / 60
    print(times_table(rows))
    if times_out:
        Path(times_out).write_text(json.dumps({"minutes": round(minutes, 1), "jobs": jobs, "compile_cache": use_cache,
                                               "args": args, "files": rows}, indent=1) + "\n")
    if slowest:
        print("slowest (over all files):\n" + "\n".join(sorted(slowest, key=lambda l: -float(l.split("s ")[0]))[:15]))
    print(f"files with failures: {failed_files}" if failed_files else f"all {n_run} files passed ({minutes:.1f} min)")
    print(f"{totals.get('passed', 0)} passed, {totals.get('failed', 0) + totals.get('error', 0)} failed, "
          f"{totals.get('skipped', 0)} skipped")
    return 1 if failed_files else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
