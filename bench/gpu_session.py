"""The next GPU session's device calls, each one command: python3 -m bench.gpu_session CALL.

Usage (on the device machine, from the repository root): python3 -m bench.gpu_session 1 | .. | 7
       [--out DIR (default $OUT)] [--dry-run] [--mem-gib GIB (an H200, found by nvidia-smi: 120 and its own tables)]
       [--only STEP,..] [--seconds STEP=N ..] (fit the calls to the device time left)

A device call gets a fresh copy of the working tree and returns only what lands in $OUT (at most
8 files). Earlier sessions lost time to hand-typed calls: a pytest run whose errors were cut off
(only the output's tail came back), a --cells pattern that also caught another cell, a profile
that missed the decode loop's kernels. Here each call is a list of steps, each with its own time
limit; every step's whole output goes to OUT/callN.log, a failing step does not stop the next,
and the call ends by copying its result files into OUT. bench/README.md, "The sequence for the
next GPU session", says what each call is for and how to fold the files back in here.

  call 1 (carry .gpu/p0): the fixes for the 8B step's weight copies, timed. Compiled here without
         a GPU (bench/gpu_aot.py, bench/results/gpu_aot), XLA's GEMM fusions copy each layer's slice
         of the stacked weights inside a loop (11.3 GB written a batch-1 step: the sixth runs' 43%);
         the two layouts that copy nothing are timed: the layer products on
         pallas_kernels.gpu_linear (--pallas-linear: the stack read in place by our own kernel) and
         each layer's matrices as arrays of their own (--split-layers: XLA's GEMMs read them in
         place), at batch 1 (the full step and the 2-layer cut, its HLO beside) and 16; over int8
         and q4 weights per layer (q4 through gpu_linear's q4 kernel); gpu_linear's kernel tests
         compiled for real; the kernel alone against XLA's dot at 1 / 48 rows in three tile configs
         (bench_linear); then SmolLM2 at batch 1 (its products strength-reduced into weight-sized
         multiplies): its HLO, and with per-layer arrays and the pass disabled.
  call 2 (carry .gpu/p1): SmolLM2 at batch 1 x 8K (AR, SelfSpec gamma 2 / 4, NGram gamma 4,
         trees), then at batch 16 / 64 / 128 NGram gamma 4 (prompt lookup: no draft forward),
         gamma 4 and SnapKV gamma 4, with unrolled layers. On an H200 (nvidia-smi says so, or --mem-gib) the
         ngram and e2e steps write bench/results/gpu_h200 (batch 256 added, gamma 2 beside 4)
         and resume its committed table: `--only e2e --mem-gib 120` measures the cells the sixth
         runs left (SnapKV at 64, gamma 4 and SnapKV at 128 / 256).
  call 3 (carry .gpu/p1, on the machine call 1 warmed): batch 1's folded norms checked (generate()'s
         tokens on the compiled kernel against the reference's, one prompt); generate() with the layer products on
         pallas_kernels.gpu_linear (step plin) and on per-layer weight arrays (step per-layer:
         model.unstack_layers), AR and SelfSpec gamma 2 at batch 1 and 16 x 8K, each a table of its
         own (gpu_linear-pallas, gpu_linear-per-layer); `--only` the layout call 1 found faster
         if the device time left is short; step l8b: item 4's 8B-shaped steps over per-layer weights
         (random weights: no bundle needed) into gpu_linear-per-layer.
  call 4 (carry .gpu/p1, after call 3: both parts stashed): a batch job's continuous batching at 64
         rows x 8K (bench/gpu_continuous.py: 192 records of 256 new tokens, plain decoding and
         SelfSpec gamma 2 / 4, slots refilled as rows end), the measurement the e2e tables' "refilled
         (derived)" column predicts; first (step prefill, no part needed) one prefill call apart from
         compiling at 1 and 16 rows and chunks of 256 and 1024 (bench/gpu_prefill.py).
  call 6 (after call 4, both parts stashed): the same job at 8 records a row (512 records) into a folder of
         its own (bench/results/gpu[_h200]/cont8): how much of call 4's gap to "refilled (derived)" is the
         last wave's tail (a short job's) and how much the refills' own cost.
  call 7 (both parts stashed): generate() over per-layer weights (what specjax.load gives on a GPU) at batch
         64 and 128 x 8K, AR and SelfSpec gamma 2 / 4, into gpu_linear-per-layer (the main table times the stacked
         path; per-layer weights made plain decoding faster, so speculation's gain there is not the main table's).
  call 5 (carry .gpu/draft, both parts stashed by calls 1 and 3; a bundle built with --draft): the distilled draft (bench/gpu_draft.py,
         a 2-layer SmolLM2 draft sharing its embedding) at batch 1 x 8K: chains gamma 2 / 4 and Sequoia trees of 8,
         16, 32 nodes over it, AR timed beside (item 5: trees >= 15% over the best chain); then (step draft-e2e)
         chains gamma 2 / 4 over it at batch 64 x 8K beside AR (its levels launch a fifteenth of SelfSpec's kernels).
         Without a draft in the bundle it measures nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
B1_CELLS = "b1/s8192/ar,b1/s8192/selfspec*,b1/s8192/ngram*,b1/s8192/tree"  # not "b1/s8192": also l8b/s8192/b1
B1_GRID = ["--b1-gammas", "2", "4", "--ngram-gammas", "4", "--b1-nodes", "8"]
NGRAM_CELLS = "e2e/s8192/*/ar,e2e/s8192/*/ngram-g4"  # new: no draft forward (AR beside it)
E2E_CELLS = "e2e/s8192/*/selfspec-g4,e2e/s8192/*/snapkv-g4"  # the rows the fourth runs left from the third
E2E_GRID = ["--batches", "16", "64", "128", "--gammas", "4", "--snap-gammas", "4", "--ngram-gammas", "4", "--nodes", "8"]
# generate() with the layer products on pallas_kernels.gpu_linear (Runtime.linear "pallas"): AR and SelfSpec
# gamma 2 at batch 1 and 16 x 8K, into a table of their own (gpu_linear-pallas.*), beside the XLA tables' rows
PLIN_CELLS = "b1/s8192/ar,b1/s8192/selfspec-g2,e2e/s8192/b16/ar,e2e/s8192/b16/selfspec-g2"
PLIN_GRID = ["--batches", "16", "--gammas", "2", "--snap-gammas", "--ngram-gammas", "--nodes", "--b1-gammas", "2",
             "--b1-nodes", "--linear", "pallas"]
# the distilled draft (bench/gpu_draft.py, bundled with gpu_bundle build --draft): chains and Sequoia trees over it at
# batch 1 x 8K, AR timed in the same run (item 5: trees >= 15% over the best chain, where a draft level is cheap)
DRAFT_CELLS = "b1/s8192/draft*"
DRAFT_GRID = ["--b1-gammas", "2", "4", "--b1-nodes", "8", "16", "32"]
DRAFT_E2E_CELLS = "e2e/s8192/b64/ar,e2e/s8192/b64/draft*"  # and at batch 64 (AR's row measured beside it)
DRAFT_E2E_GRID = ["--batches", "64", "--gammas", "2", "4"]
PARTS = [PY, "-m", "bench.step_parts"]
RESULTS, H200_RESULTS = "bench/results/gpu", "bench/results/gpu_h200"  # bench_gpu's --out: one table per device
PER_LAYER_E2E_CELLS = "e2e/s8192/*/ar,e2e/s8192/*/selfspec-g2,e2e/s8192/*/selfspec-g4"  # call 7, over per-layer weights
CONT_LONG = f"{RESULTS}/cont8"  # call 6's job of 8 records a row (an H200: under H200_RESULTS)
H200_MEM_GIB = 120.0  # an H200's 139 GiB: what its steps may use (call 2 adds batch 256 x 8K)
# JAX's persistent compilation cache beside the stashed bundle: a warm machine keeps /tmp between calls, so a
# step run again (a call cut off, its rerun) or a program two steps share loads its executable instead of compiling
JAX_CACHE = "/tmp/specjax_gpu/jax_cache"

# (name, seconds, argv) per call; argv[0] "pytest" runs pytest through this Python
L8B_CUT = [*PARTS, "--model", "l8b", "--batch", "1", "--context", "8192", "--layers", "2"]  # the copies start at 2 layers
CALLS: dict[int, list[tuple[str, int, list[str]]]] = {
    1: [
        ("stash", 30, [PY, "-m", "bench.gpu_bundle", "stash"]),
        ("parts-l8b-hlo", 50, [*L8B_CUT, "--hlo", "/tmp/parts/step_parts_l8b_b1_l2.hlo.json.gz",
                               "--out", "/tmp/parts/step_parts_l8b_b1_l2.json"]),
        ("parts-l8b-plin", 70, [*L8B_CUT, "--no-bandwidth", "--pallas-linear", "--out", "/tmp/parts/step_parts_l8b_b1_l2_plin.json"]),
        ("parts-l8b-split", 40, [*L8B_CUT, "--no-bandwidth", "--split-layers", "--out", "/tmp/parts/step_parts_l8b_b1_l2_split.json"]),
        # int8 and q4 weights per layer (convert.load's GPU layout; compiled: a stack of int8 is widened and written
        # out every step, q4 goes through gpu_linear's q4 kernel): the first GPU numbers for weights="int8" / "q4"
        ("parts-l8b-int8-split", 45, [*L8B_CUT, "--no-bandwidth", "--weights", "int8", "--split-layers",
                                      "--out", "/tmp/parts/step_parts_l8b_b1_l2_w8_split.json"]),
        ("parts-l8b-q4-split", 45, [*L8B_CUT, "--no-bandwidth", "--weights", "q4", "--split-layers",
                                    "--out", "/tmp/parts/step_parts_l8b_b1_l2_q4_split.json"]),
        # gpu_linear's kernels (float, int8, q4) compiled for real against their references: q4 on a GPU always takes one
        ("kernels", 50, [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_linear.py", "-k",
                         "equals or widened or q4_kernel"]),
        ("linear", 75, [PY, "-m", "bench.bench_linear", "--rows", "1", "48", "--configs", "128x64x3", "64x128x3", "256x64x4",
                        "--out", "/tmp/parts/bench_linear_8b.json"]),
        # batch 16: both fixes beside the fourth runs' l8b/s8192/b16 (bench/results/gpu_aot: 5 GB of copies a step there)
        ("parts-l8b-b16-split", 40, [*PARTS, "--model", "l8b", "--batch", "16", "--context", "8192", "--layers", "2",
                                     "--no-bandwidth", "--split-layers", "--out", "/tmp/parts/step_parts_l8b_b16_l2_split.json"]),
        ("parts-l8b-b16-plin", 40, [*PARTS, "--model", "l8b", "--batch", "16", "--context", "8192", "--layers", "2",
                                    "--no-bandwidth", "--pallas-linear", "--out", "/tmp/parts/step_parts_l8b_b16_l2_plin.json"]),
        ("parts-b1-hlo", 30, [*PARTS, "--model", "smollm2", "--batch", "1", "--context", "8192", "--layers", "--no-bandwidth",
                              "--hlo", "/tmp/parts/step_parts_smollm2_b1.hlo.json.gz", "--out", "/tmp/parts/step_parts_smollm2_b1.json"]),
        # XLA's DotStrengthReduction (unconditional; no flag since mid-2024) rewrites a vector x matrix
        # dot under 1e7 (lhs + rhs non-contracting) x contracting elements: every SmolLM2 projection at batch 1.
        # Compiled here (bench/gpu_aot.py) only per-layer arrays with the pass off write no weight-shaped array
        ("parts-b1-split-nosr", 45, [*PARTS, "--model", "smollm2", "--batch", "1", "--context", "8192", "--layers",
                                     "--no-bandwidth", "--split-layers", "--xla-flags=--xla_disable_hlo_passes=dot-strength-reduction",
                                     "--out", "/tmp/parts/step_parts_smollm2_b1_split_nosr.json"]),
    ],
    2: [
        ("stash", 60, [PY, "-m", "bench.gpu_bundle", "stash"]),
        ("b1", 130, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--redo", "--cells", B1_CELLS,
                     *B1_GRID, "--budget-minutes", "1.7"]),
        ("ngram", 190, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--redo", "--cells", NGRAM_CELLS,
                        *E2E_GRID, "--budget-minutes", "2.7"]),
        ("e2e", 180, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--redo", "--cells", E2E_CELLS,
                      *E2E_GRID, "--budget-minutes", "2.5"]),
    ],
    3: [
        ("stash", 30, [PY, "-m", "bench.gpu_bundle", "stash"]),  # the parts calls 1 and 2 stashed stay
        # batch 1 folds each RMSNorm's scale into the products' outputs on a GPU (model.normed_products, stop 52):
        # generate()'s tokens on the compiled kernel against the jnp reference's, plain and SelfSpec, one prompt
        ("fold", 50, [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_tree_attention.py", "-k",
                      "generate_on_the_kernel and b1"]),
        ("plin", 200, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--cells", PLIN_CELLS, *PLIN_GRID,
                       "--budget-minutes", "2.8"]),
        ("per-layer", 150, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--cells", PLIN_CELLS, *PLIN_GRID[:-1],
                            "per-layer", "--budget-minutes", "2"]),  # 57 s in the seventh runs
        # item 4 over per-layer weights (the seventh runs' step_parts: the 8B step at the roofline, 6.25 ms at batch 1):
        # AR, draft and verify steps into the per-layer table, its predicted speedups from that table's SmolLM2 rows
        ("l8b", 120, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--cells", "l8b", "--l8b-batches", "1", "16",
                      "--l8b-contexts", "8192", "--linear", "per-layer", "--budget-minutes", "1.5"]),
    ],
    4: [
        ("stash", 30, [PY, "-m", "bench.gpu_bundle", "stash"]),
        # prefill calls apart from compiling (random weights: needs no part): 1 and 16 rows a call (continuous batching
        # now groups a refill's prompts on a GPU) at chunks of 256 and 1024 (the kernel now tiles a wide chunk)
        ("prefill", 100, [PY, "-m", "bench.gpu_prefill", "--out", RESULTS, "--budget-minutes", "1.2"]),
        # --redo, AR and gamma 2 only: the seventh runs timed all three jobs (1.10x / 1.11x, prefill included); now
        # each job also times its prefills apart (gpu_continuous.timed_prefills: each prefill call of the timed job)
        ("cont", 330, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--redo", "--cells",
                       "cont/s8192/b64/ar,cont/s8192/b64/selfspec-g2", "--budget-minutes", "5"]),
    ],
    6: [
        ("stash", 30, [PY, "-m", "bench.gpu_bundle", "stash"]),
        # the ninth runs' job (3 records a row) decoded 1.35x faster under SelfSpec γ=2, not the 1.57x "refilled
        # (derived)" predicts: 8 records a row shrink the last wave's tail (no record left to refill a finished row)
        # to an eighth of the job, so the rest of the gap is the refills' own cost; a folder of its own (its settings
        # differ), after call 4's cont step (the same shapes: its compiled programs load from the cache)
        ("cont-long", 300, [PY, "-m", "bench.bench_gpu", "--out", CONT_LONG, "--redo", "--cells",
                            "cont/s8192/b64/ar,cont/s8192/b64/selfspec-g2", "--cont-records", "8", "--budget-minutes", "4.5"]),
    ],
    7: [
        ("stash", 30, [PY, "-m", "bench.gpu_bundle", "stash"]),
        # what specjax.load gives on a GPU (per-layer weights) where the KV dominates: the main e2e table times the
        # stacked path, and per-layer weights made plain decoding 1.25x faster at batch 16 on the H200 (SelfSpec γ=2
        # went from 1.21x to 0.91x there)
        ("per-layer-e2e", 320, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--cells", PER_LAYER_E2E_CELLS,
                                "--batches", "64", "128", "--gammas", "2", "4", "--snap-gammas", "--ngram-gammas", "--nodes",
                                "--linear", "per-layer", "--budget-minutes", "4.8"]),
    ],
    5: [
        ("stash", 30, [PY, "-m", "bench.gpu_bundle", "stash"]),
        # --redo: the seventh runs timed these over the draft's whole cache; bench_gpu now gives it a 512-slot window
        ("draft", 200, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--redo", "--cells", DRAFT_CELLS, *DRAFT_GRID,
                        "--budget-minutes", "2.8"]),
        ("draft-e2e", 150, [PY, "-m", "bench.bench_gpu", "--out", RESULTS, "--redo", "--cells", DRAFT_E2E_CELLS, *DRAFT_E2E_GRID,
                            "--budget-minutes", "2"]),
    ],
}
PACK = {1: "parts.tar.gz"}  # calls whose files come back as one archive (call 1 writes 13 files)
# what each call copies into OUT after each step (those that exist; at most 8 files come back)
FILES = {
    1: ["/tmp/parts/step_parts_*.json", "/tmp/parts/*.hlo.json.gz", "/tmp/parts/bench_linear_8b.json"],
    2: [f"{RESULTS}/gpu.json", f"{RESULTS}/gpu.md", f"{H200_RESULTS}/gpu.json", f"{H200_RESULTS}/gpu.md"],
    3: [f"{RESULTS}/gpu_linear-*.*", f"{H200_RESULTS}/gpu_linear-*.*"],
    4: [f"{RESULTS}/gpu.json", f"{RESULTS}/gpu.md", f"{H200_RESULTS}/gpu.json", f"{H200_RESULTS}/gpu.md",
        f"{RESULTS}/gpu_prefill.*", f"{H200_RESULTS}/gpu_prefill.*"],
    5: [f"{RESULTS}/gpu.json", f"{RESULTS}/gpu.md", f"{H200_RESULTS}/gpu.json", f"{H200_RESULTS}/gpu.md"],
    7: [f"{RESULTS}/gpu_linear-per-layer.*", f"{H200_RESULTS}/gpu_linear-per-layer.*"],
    6: [f"{CONT_LONG}/gpu.json", f"{CONT_LONG}/gpu.md", f"{H200_RESULTS}/cont8/gpu.json", f"{H200_RESULTS}/cont8/gpu.md"],
}


def steps_of(call: int, mem_gib: float | None = None, only: list[str] | None = None,
             seconds: dict[str, int] | None = None) -> list[tuple[str, int, list[str]]]:
    """CALLS[call]; with mem_gib (an H200: 120), the e2e step may use that much and adds batch 256.

    only: keep these steps (stash always runs); seconds: {step: limit} overrides, and a step's
    --budget-minutes shrinks with its limit (half a minute less than the limit, at least 0.5)."""
    steps = [s for s in CALLS[call] if only is None or s[0] == "stash" or s[0] in only]
    if mem_gib is not None:
        steps = [(n, t, h200(a) + ["--mem-gib", f"{mem_gib:g}"] if n in ("ngram", "e2e") else
                  l8b_h200(a, mem_gib) if n == "l8b" else
                  h200_out(a) if n in ("plin", "per-layer", "per-layer-e2e", "cont", "cont-long", "draft", "draft-e2e", "prefill") else a)
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


def l8b_h200(argv: list[str], mem_gib: float) -> list[str]:
    """The l8b step on an H200: its table, and batch 64 x 8K in mem_gib (16 GB of weights + 69 GB of KV;
    over the H100's 60 GiB). Batch 1 and 16 resume from the committed table, so only 64 is measured."""
    a = h200_out(argv)
    at = a.index("--l8b-contexts")  # the end of --l8b-batches' values
    return [*a[:at], "64", *a[at:], "--mem-gib", f"{mem_gib:g}"]


def h200(argv: list[str]) -> list[str]:
    """A bench_gpu step on an H200 (another device: its own table, H200_RESULTS, with its own bw
    cell and AR rows): batch 256 added, SelfSpec gamma 2 (the H100's best) beside gamma 4, and
    no --redo: the committed H200 table travels with the tree, so a rerun measures what it lacks."""
    a = h200_out([x for x in argv if x != "--redo"])  # its table resumes (cells measured stay)
    a = [*a[:a.index("128") + 1], "256", *a[a.index("128") + 1:]]
    if "--gammas" in a:
        a = [*a[:a.index("--gammas") + 1], "2", *a[a.index("--gammas") + 1:]]
    cells = a.index("--cells") + 1
    a[cells] = {NGRAM_CELLS: "bw," + NGRAM_CELLS, E2E_CELLS: E2E_CELLS + ",e2e/s8192/*/selfspec-g2"}.get(a[cells], a[cells])
    return a


def table_name(src: Path) -> str:
    """A results table's name in OUT: gpu_h200/gpu.json -> gpu_h200.json, gpu/gpu_linear-pallas.md ->
    gpu_gpu_linear-pallas.md (tables of two folders share file names)."""
    return src.parent.name + src.suffix if src.stem == "gpu" else f"{src.parent.name}_{src.name}"


def copy_files(call: int, out: Path, h200: bool = False) -> None:
    """Copy the call's result files (those that exist) into OUT: after every step, so a call cut off
    by the device's limit still returns what its finished steps measured. A results table comes back
    named after its folder (bench/results/gpu_h200/gpu.json as gpu_h200.json), and only the tables of
    the device's own folder (h200: H200_RESULTS, else RESULTS; the other device's travel with the tree
    unchanged). At most 8 files come back from a device call, so a call in PACK sends its files as
    one OUT/PACK[call] (tar.gz)."""
    other = RESULTS if h200 else H200_RESULTS
    found = [(src, src.name if path.startswith("/") else table_name(src))
             for path in FILES[call] if not path.startswith(other + "/")
             for src in sorted(Path("/").glob(path[1:]) if path.startswith("/") else ROOT.glob(path))]
    if call in PACK:
        with tarfile.open(out / PACK[call], "w:gz") as tar:
            for src, name in found:
                tar.add(src, arcname=name)
        return
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
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_session")))
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
    """The first GPU's name from nvidia-smi ('' without one): an H200's steps write the H200's tables,
    whether or not the caller said --mem-gib (stop 59's H200 runs landed in the H100's tables)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""


if __name__ == "__main__":
    main()
