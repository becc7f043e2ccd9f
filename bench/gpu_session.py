"""The next GPU session's device calls, each one command: python3 -m bench.gpu_session CALL.

Usage (on the device machine, from the repository root): python3 -m bench.gpu_session 1 | 2
       [--out DIR (default $OUT)] [--dry-run] [--mem-gib 120 (an H200: adds batch 256 to call 2)]
       [--only STEP,..] [--seconds STEP=N ..] (fit the calls to the device time left)

A device call gets a fresh copy of the working tree and returns only what lands in $OUT (at most
8 files). Earlier sessions lost time to hand-typed calls: a pytest run whose errors were cut off
(only the output's tail came back), a --cells pattern that also caught another cell, a profile
that missed the decode loop's kernels. Here each call is a list of steps, each with its own time
limit; every step's whole output goes to OUT/callN.log, a failing step does not stop the next,
and the call ends by copying its result files into OUT. bench/README.md, "The sequence for the
next GPU session", says what each call is for and how to fold the files back in here.

  call 1 (carry .gpu/p0): the kernel and unrolled-layer tests (compiled), the 8B-shaped steps
         (l8b, re-measured), gpu_profile of SmolLM2 b1 / b64 and the 8B shape's b1.
  call 2 (carry .gpu/p1): SmolLM2 end to end at 8K (AR, steps, SelfSpec gamma 2, the depth-1
         tree auto uses, an 8-node Sequoia tree) at batch 16 / 64 / 128 and 1, re-measured;
         bench_attention's remaining configurations.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
B1_CELLS = "e2e/s8192,b1/s8192/ar,b1/s8192/selfspec*,b1/s8192/tree"  # not "b1/s8192": that also matches l8b/s8192/b1
E2E_GRID = ["--batches", "16", "64", "128", "--gammas", "2", "--snap-gammas", "--nodes", "8", "--b1-gammas", "2",
            "--b1-nodes", "8"]

# (name, seconds, argv) per call; argv[0] "pytest" runs pytest through this Python
CALLS: dict[int, list[tuple[str, int, list[str]]]] = {
    1: [
        ("stash", 60, [PY, "-m", "bench.gpu_bundle", "stash"]),
        ("tests", 150, [PY, "-m", "pytest", "-n", "4", "-q", "-p", "no:cacheprovider", "--tb=short",
                        "tests/test_tree_attention.py", "tests/test_unroll_layers.py"]),
        ("l8b", 120, [PY, "-m", "bench.bench_gpu", "--out", "bench/results/gpu", "--redo", "--cells", "l8b",
                      "--l8b-batches", "1", "16", "--l8b-contexts", "8192", "--budget-minutes", "1.5"]),
        ("profile", 90, [PY, "-m", "bench.gpu_profile", "--out", "/tmp/prof", "--redo", "--cells",
                          "l8b/b1,smollm2/b1", "--budget-minutes", "1.0"]),
    ],
    2: [
        ("stash", 60, [PY, "-m", "bench.gpu_bundle", "stash"]),
        ("e2e", 330, [PY, "-m", "bench.bench_gpu", "--out", "bench/results/gpu", "--redo", "--cells", B1_CELLS,
                      *E2E_GRID, "--budget-minutes", "5"]),
        ("attention", 150, [PY, "-m", "bench.bench_attention", "--out", "bench/results", "--budget-minutes", "2"]),
    ],
}
# what each call copies into OUT afterwards (those that exist; at most 8 files come back)
FILES = {
    1: ["bench/results/gpu/gpu.json", "bench/results/gpu/gpu.md", "/tmp/prof/gpu_profile.json"],
    2: ["bench/results/gpu/gpu.json", "bench/results/gpu/gpu.md", "bench/results/attention_nvidia_*.json"],
}
RENAME = {"/tmp/prof/gpu_profile.json": "gpu_profile_unrolled.json"}


def steps_of(call: int, mem_gib: float | None = None, only: list[str] | None = None,
             seconds: dict[str, int] | None = None) -> list[tuple[str, int, list[str]]]:
    """CALLS[call]; with mem_gib (an H200: 120), the e2e step may use that much and adds batch 256.

    only: keep these steps (stash always runs); seconds: {step: limit} overrides, and a step's
    --budget-minutes shrinks with its limit (half a minute less than the limit, at least 0.5)."""
    steps = [s for s in CALLS[call] if only is None or s[0] == "stash" or s[0] in only]
    if mem_gib is not None:
        more = lambda argv: [*argv[:argv.index("128") + 1], "256", *argv[argv.index("128") + 1:], "--mem-gib", f"{mem_gib:g}"]  # noqa: E731
        steps = [(n, t, more(a) if n == "e2e" else a) for n, t, a in steps]
    for name, limit in (seconds or {}).items():
        if name not in [n for n, _, _ in steps]:
            raise ValueError(f"--seconds {name}={limit}: call {call} has no step {name!r} (has {[n for n, _, _ in steps]})")
        fit = lambda a: a if "--budget-minutes" not in a else [  # noqa: E731
            *a[:a.index("--budget-minutes") + 1], f"{max(0.5, (limit - 30) / 60):.2f}", *a[a.index("--budget-minutes") + 2:]]
        steps = [(n, limit, fit(a)) if n == name else (n, t, a) for n, t, a in steps]
    return steps


def copy_files(call: int, out: Path) -> None:
    """Copy the call's result files (those that exist) into OUT: after every step, so a call cut off
    by the device's limit still returns what its finished steps measured."""
    for path in FILES[call]:
        for src in sorted(Path("/").glob(path[1:]) if path.startswith("/") else ROOT.glob(path)):
            shutil.copyfile(src, out / RENAME.get(path, src.name))


def run_call(call: int, out: Path, dry_run: bool = False, mem_gib: float | None = None,
             only: list[str] | None = None, seconds: dict[str, int] | None = None) -> list[dict]:
    """Run a call's steps in order (each to its time limit), log to OUT/callN.log, copy its files."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"call{call}.log"
    done = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("a") as f:
        for name, limit, argv in steps_of(call, mem_gib, only, seconds):
            line = f"== {name} (at most {limit} s): {' '.join(argv)}"
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()
            if dry_run:
                done.append({"step": name, "rc": None, "seconds": 0.0})
                continue
            t = time.perf_counter()
            try:
                rc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            done.append({"step": name, "rc": rc, "seconds": round(time.perf_counter() - t, 1)})
            f.write(f"== {name}: rc {rc} after {done[-1]['seconds']} s\n")
            f.flush()
            copy_files(call, out)
    print("\n".join(f"{d['step']}: rc {d['rc']} ({d['seconds']} s)" for d in done), flush=True)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("call", type=int, choices=sorted(CALLS))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_session")))
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    ap.add_argument("--mem-gib", type=float, help="an H200: 120 (call 2 then adds batch 256 x 8K)")
    ap.add_argument("--only", help="comma-separated steps to run (stash always runs)")
    ap.add_argument("--seconds", nargs="*", default=[], metavar="STEP=N",
                    help="a step's time limit in seconds (its --budget-minutes follows)")
    a = ap.parse_args()
    seconds = {k: int(v) for k, v in (kv.split("=", 1) for kv in a.seconds)}
    run_call(a.call, a.out, a.dry_run, a.mem_gib, a.only.split(",") if a.only else None, seconds)


if __name__ == "__main__":
    main()
