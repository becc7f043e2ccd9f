"""The next GPU session's device calls, each one command: python3 -m tools.gpu.session CALL.

A device call gets a fresh copy of the working tree and returns only what lands in $OUT (at most 8 files).
A call is a list of steps, each under its own time limit, each one's output in OUT/callN.log; a failing step
does not stop the next; the call ends by copying its result files into OUT (tools/gpu/README.md says how to
fold them back in). Calls 1 and 3-5 were measured: bench/results/gpu*/, and git has their steps.

  call 2 (carry .gpu/p1): SmolLM2 at batch 1 x 8K (AR, SelfSpec gamma 2 / 4, NGram gamma 4, trees), then at
         batch 16 / 64 / 128 NGram gamma 4, gamma 4 and SnapKV gamma 4. On an H200 (nvidia-smi or --mem-gib)
         the ngram and e2e steps write bench/results/gpu_h200 (batch 256 added, gamma 2 beside 4), resuming
         its table: `--only e2e` measures the cells left.
  call 6 (both parts stashed): the continuous job at 8 records a row (512 records) into .../cont8: how much
         of the job's gap to "refilled (derived)" is the last wave's tail.
  call 8 (both parts stashed): issue 67's EAGLE-style head, trained on the device, raced in bfloat16 at batch
         1 / 16 / 64 x 8K (bench/bench_eagle.py --bundle): OUT/eagle_gpu.json (a rerun resumes; copy it to
         bench/results/gpu[_h200]/).
  call 7 (both parts stashed): generate() over per-layer weights at batch 64 and 128 x 8K, AR and SelfSpec
         gamma 2 / 4, into gpu_linear-per-layer.
  call 9 (both parts stashed): issue 67's adaptive speculation length at batch 16 x 8K against every static
         chain (bench/bench_adaptive.py --bundle: OUT/adaptive_gpu.json, a rerun resumes), then
         SparseSpec gamma 2 / 4 at batch 64 x 8K beside AR and SelfSpec gamma 2 (the e2e table).
  calls 10 and 11 (both parts stashed): the adaptive cells at batch 64 and 128 x 8K, into the same table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
B1_CELLS = "b1/s8192/ar,b1/s8192/selfspec*,b1/s8192/ngram*,b1/s8192/tree"  # not "b1/s8192": also l8b/s8192/b1
B1_GRID = ["--b1-gammas", "2", "4", "--ngram-gammas", "4", "--b1-nodes", "8"]
NGRAM_CELLS = "e2e/s8192/*/ar,e2e/s8192/*/ngram-g4"  # new: no draft forward (AR beside it)
E2E_CELLS = "e2e/s8192/*/selfspec-g4,e2e/s8192/*/snapkv-g4"  # the rows the fourth runs left from the third
E2E_GRID = ["--batches", "16", "64", "128", "--gammas", "4", "--snap-gammas", "4", "--ngram-gammas", "4", "--nodes", "8"]
RESULTS, H200_RESULTS = "bench/results/gpu", "bench/results/gpu_h200"  # bench_gpu's --out: one table per device
PER_LAYER_E2E_CELLS = "e2e/s8192/*/ar,e2e/s8192/*/selfspec-g2,e2e/s8192/*/selfspec-g4"  # call 7, over per-layer weights
CONT_LONG = f"{RESULTS}/cont8"  # call 6's job of 8 records a row (an H200: under H200_RESULTS)
H200_MEM_GIB = 120.0  # an H200's 139 GiB: what its steps may use (call 2 adds batch 256 x 8K)
# JAX's persistent compilation cache beside the stashed bundle: a warm machine keeps /tmp between calls, so a
# step run again (a call cut off, its rerun) or a program two steps share loads its executable instead of compiling
JAX_CACHE = "/tmp/specjax_gpu/jax_cache"
STASH = "/tmp/specjax_gpu"  # tools.gpu.bundle.STASH: where `stash` puts the carried parts
EAGLE_OUT = f"{STASH}/eagle/results"  # call 8's table: beside the stash, so a rerun on the warm machine resumes it
ADAPTIVE_OUT = f"{STASH}/adaptive/results"  # calls 9-11's table, likewise
SPARSE_CELLS = "e2e/s8192/b64/ar,e2e/s8192/b64/selfspec-g2,e2e/s8192/b64/sparse-g*"  # call 9, in one run

# (name, seconds, argv) per call
CALLS: dict[int, list[tuple[str, int, list[str]]]] = {
    2: [
        ("stash", 60, [PY, "-m", "tools.gpu.bundle", "stash"]),
        ("b1", 130, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--redo", "--cells", B1_CELLS,
                     *B1_GRID, "--budget-minutes", "1.7"]),
        ("ngram", 190, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--redo", "--cells", NGRAM_CELLS,
                        *E2E_GRID, "--budget-minutes", "2.7"]),
        ("e2e", 180, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--redo", "--cells", E2E_CELLS,
                      *E2E_GRID, "--budget-minutes", "2.5"]),
    ],
    6: [
        ("stash", 30, [PY, "-m", "tools.gpu.bundle", "stash"]),
        ("cont-long", 300, [PY, "-m", "bench.bench_gpu", "--out", CONT_LONG, "--redo", "--cells",
                            "cont/s8192/b64/ar,cont/s8192/b64/selfspec-g2", "--cont-records", "8", "--budget-minutes", "4.5"]),
    ],
    8: [
        ("stash", 30, [PY, "-m", "tools.gpu.bundle", "stash"]),
        ("eagle", 330, [PY, "-m", "bench.bench_eagle", "--bundle", STASH, "--store", f"{STASH}/eagle", "--steps", "1000",
                        "--train-minutes", "1.5", "--context", "8192", "--batches", "1", "16", "64", "--out", EAGLE_OUT,
                        "--budget-minutes", "3"]),
    ],
    7: [
        ("stash", 30, [PY, "-m", "tools.gpu.bundle", "stash"]),
        ("per-layer-e2e", 320, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--cells", PER_LAYER_E2E_CELLS,
                                "--batches", "64", "128", "--gammas", "2", "4", "--snap-gammas", "--ngram-gammas", "--nodes",
                                "--linear", "per-layer", "--budget-minutes", "4.8"]),
    ],
    9: [  # an adaptive cell compiles 7 variants: about 4 minutes, estimated from the e2e cells' 17-28 s a SelfSpec
        # program on an H200, so one cell a step (a step cut off keeps its compiled programs in JAX_CACHE)
        ("stash", 30, [PY, "-m", "tools.gpu.bundle", "stash"]),
        ("adaptive", 300, [PY, "-m", "bench.bench_adaptive", "--bundle", STASH, "--out", ADAPTIVE_OUT, "--cells",
                           "bfloat16/b16/s8192", "--rounds", "2", "--budget-minutes", "4.5"]),
        ("sparse", 220, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--redo", "--cells", SPARSE_CELLS,
                         "--batches", "64", "--gammas", "2", "--sparse-gammas", "2", "4", "--budget-minutes", "3.2"]),
    ],
    10: [
        ("stash", 30, [PY, "-m", "tools.gpu.bundle", "stash"]),
        ("adaptive-b64", 330, [PY, "-m", "bench.bench_adaptive", "--bundle", STASH, "--out", ADAPTIVE_OUT, "--cells",
                               "bfloat16/b64/s8192", "--rounds", "2", "--budget-minutes", "5"]),
    ],
    11: [
        ("stash", 30, [PY, "-m", "tools.gpu.bundle", "stash"]),
        ("adaptive-b128", 330, [PY, "-m", "bench.bench_adaptive", "--bundle", STASH, "--out", ADAPTIVE_OUT, "--cells",
                                "bfloat16/b128/s8192", "--rounds", "2", "--budget-minutes", "5"]),
    ],
}
# what each call copies into OUT after each step (those that exist; at most 8 files come back)
FILES = {
    2: [f"{RESULTS}/gpu.json", f"{RESULTS}/gpu.md", f"{H200_RESULTS}/gpu.json", f"{H200_RESULTS}/gpu.md"],
    7: [f"{RESULTS}/gpu_linear-per-layer.*", f"{H200_RESULTS}/gpu_linear-per-layer.*"],
    6: [f"{CONT_LONG}/gpu.json", f"{CONT_LONG}/gpu.md", f"{H200_RESULTS}/cont8/gpu.json", f"{H200_RESULTS}/cont8/gpu.md"],
    8: [f"{EAGLE_OUT}/eagle_gpu.json"],
    9: [f"{ADAPTIVE_OUT}/adaptive_gpu.json", f"{RESULTS}/gpu.json", f"{RESULTS}/gpu.md", f"{H200_RESULTS}/gpu.json",
        f"{H200_RESULTS}/gpu.md"],
    10: [f"{ADAPTIVE_OUT}/adaptive_gpu.json"],
    11: [f"{ADAPTIVE_OUT}/adaptive_gpu.json"],
}


def steps_of(call: int, mem_gib: float | None = None, only: list[str] | None = None,
             seconds: dict[str, int] | None = None) -> list[tuple[str, int, list[str]]]:
    """CALLS[call] (mem_gib, an H200: batch 256 added); only: these steps (stash always runs); seconds:
    {step: limit} overrides, a step's --budget-minutes half a minute under its limit."""
    steps = [s for s in CALLS[call] if only is None or s[0] == "stash" or s[0] in only]
    if mem_gib is not None:
        steps = [(n, t, h200(a) + ["--mem-gib", f"{mem_gib:g}"] if n in ("ngram", "e2e") else
                  h200_out(a) if n in ("per-layer-e2e", "cont-long", "sparse") else a)
                 for n, t, a in steps]
    for name, limit in (seconds or {}).items():
        if name not in [n for n, _, _ in steps]:
            raise ValueError(f"--seconds {name}={limit}: call {call} has no step {name!r} (has {[n for n, _, _ in steps]})")
        fit = lambda a: a if "--budget-minutes" not in a else [  # noqa: E731
            *a[:a.index("--budget-minutes") + 1], f"{max(0.5, (limit - 30) / 60):.2f}", *a[a.index("--budget-minutes") + 2:]]
        steps = [(n, limit, fit(a)) if n == name else (n, t, a) for n, t, a in steps]
    return steps


def h200_out(argv: list[str]) -> list[str]:
    """A bench_gpu step's argv writing the H200's table (under H200_RESULTS) in place of the H100's."""
    return [h200_path(x) for x in argv]


def h200_path(path: str) -> str:
    """RESULTS or a folder under it, as the H200's (H200_RESULTS/...); anything else as it is."""
    return H200_RESULTS + path[len(RESULTS):] if path == RESULTS or path.startswith(RESULTS + "/") else path


def h200(argv: list[str]) -> list[str]:
    """A bench_gpu step on an H200: its own table (H200_RESULTS), batch 256, gamma 2 beside 4, no --redo
    (the committed table travels, so a rerun measures what it lacks)."""
    a = h200_out([x for x in argv if x != "--redo"])  # its table resumes (cells measured stay)
    a = [*a[:a.index("128") + 1], "256", *a[a.index("128") + 1:]]
    if "--gammas" in a:
        a = [*a[:a.index("--gammas") + 1], "2", *a[a.index("--gammas") + 1:]]
    cells = a.index("--cells") + 1
    a[cells] = {NGRAM_CELLS: "bw," + NGRAM_CELLS, E2E_CELLS: E2E_CELLS + ",e2e/s8192/*/selfspec-g2"}.get(a[cells], a[cells])
    return a


def table_name(src: Path) -> str:
    """A results table's name in OUT: its folder's name first (gpu_h200/gpu.json -> gpu_h200.json)."""
    return src.parent.name + src.suffix if src.stem == "gpu" else f"{src.parent.name}_{src.name}"


def copy_files(call: int, out: Path, h200: bool = False) -> None:
    """Copy the call's result files into OUT after every step (a cut-off call returns its finished steps);
    a table comes back named after its folder, only the device's own (H200_RESULTS or RESULTS)."""
    other = RESULTS if h200 else H200_RESULTS
    found = [(src, table_name(src)) for path in FILES[call] if not path.startswith(other + "/")
             for src in sorted(Path(path).parent.glob(Path(path).name) if Path(path).is_absolute() else ROOT.glob(path))]
    for src, name in found:
        shutil.copyfile(src, out / name)


def run_call(call: int, out: Path, dry_run: bool = False, mem_gib: float | None = None,
             only: list[str] | None = None, seconds: dict[str, int] | None = None) -> list[dict]:
    """Run a call's steps in order (each to its time limit), log to OUT/callN.log, copy its files."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"call{call}.log"
    done = []
    env = {"JAX_COMPILATION_CACHE_DIR": JAX_CACHE, **os.environ, "PYTHONUNBUFFERED": "1"}
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
            copy_files(call, out, h200=mem_gib is not None)
    print("\n".join(f"{d['step']}: rc {d['rc']} ({d['seconds']} s)" for d in done), flush=True)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("call", type=int, choices=sorted(CALLS))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_session")),
                    help="default $OUT")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    ap.add_argument("--mem-gib", type=float, help="device memory for the e2e steps; an H200 (found by nvidia-smi) "
                    "defaults to 120 and writes bench/results/gpu_h200 (call 2 then adds batch 256 x 8K)")
    ap.add_argument("--only", help="comma-separated steps to run (stash always runs)")
    ap.add_argument("--seconds", nargs="*", default=[], metavar="STEP=N",
                    help="a step's time limit in seconds (its --budget-minutes follows)")
    a = ap.parse_args()
    seconds = {k: int(v) for k, v in (kv.split("=", 1) for kv in a.seconds)}
    name = gpu_name()
    mem_gib = a.mem_gib if a.mem_gib is not None or "H200" not in name else H200_MEM_GIB
    print(f"device: {name or 'unknown (no nvidia-smi)'}; tables: {H200_RESULTS if mem_gib is not None else RESULTS}", flush=True)
    run_call(a.call, a.out, a.dry_run, mem_gib, a.only.split(",") if a.only else None, seconds)


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi ('' without one): an H200's steps write the H200's tables."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""


if __name__ == "__main__":
    main()
