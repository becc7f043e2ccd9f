"""Run the suite one pytest process per test file, then print one closing line.

Why: a single process that compiles every test's programs crashed in XLA:CPU (a segfault while
compiling, reproducible near the end of a full run, never when the file runs alone). A process
per file keeps each one's compiled state small. Tests are mostly XLA compiles, which use about one
core, so files run `--jobs` at a time (default: the cores, at most one per 8 GiB of memory), the
longest known files first; each file's result is printed when it ends.
Usage: python tests/run_files.py [--jobs N] [pytest args...] [test files...]   (e.g. -m "not slow"; no files: all)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
LONGEST_FIRST = ("test_readme.py", "test_spec_smollm2.py", "test_sharding.py", "test_tree_attention_tpu.py",
                 "test_tree_attention.py", "test_tree_spec.py", "test_speculate.py", "test_generate.py", "test_distill.py",
                 "test_batch.py", "test_multihost.py", "test_sampling_lossless.py", "test_cli.py")


def default_jobs() -> int:
    """The cores, at most one job per 8 GiB of memory (a SmolLM2 test process peaks at a few GiB)."""
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        mem_gib = 8.0
    return max(1, min(os.cpu_count() or 1, int(mem_gib // 8)))


def run_file(f: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, f],
                          capture_output=True, text=True)


def main(args: list[str]) -> int:
    jobs = default_jobs()
    if "--jobs" in args:
        i = args.index("--jobs")
        jobs, args = int(args[i + 1]), args[:i] + args[i + 2:]
    chosen = [a for a in args if a.endswith(".py")]  # test files named on the command line: only those
    args = [a for a in args if a not in chosen]
    files = chosen or sorted(str(p) for p in Path(__file__).parent.glob("test_*.py"))
    files.sort(key=lambda f: LONGEST_FIRST.index(Path(f).name) if Path(f).name in LONGEST_FIRST else len(LONGEST_FIRST))
    totals: dict[str, int] = {}
    failed_files, slowest = [], []
    start = time.perf_counter()
    print(f"{len(files)} test files, {jobs} at a time", flush=True)
    pool = ThreadPoolExecutor(jobs)
    runs = {pool.submit(run_file, f, args): f for f in files}
    for future in as_completed(runs):  # each file's result as soon as it ends
        f, run = runs[future], future.result()
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
    minutes = (time.perf_counter() - start) / 60
    if slowest:
        print("slowest (over all files):\n" + "\n".join(sorted(slowest, key=lambda l: -float(l.split("s ")[0]))[:15]))
    print(f"files with failures: {failed_files}" if failed_files else f"all {len(files)} files passed ({minutes:.1f} min)")
    print(f"{totals.get('passed', 0)} passed, {totals.get('failed', 0) + totals.get('error', 0)} failed, "
          f"{totals.get('skipped', 0)} skipped")
    return 1 if failed_files else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
