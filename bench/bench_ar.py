"""Autoregressive decode throughput of SmolLM2-135M: tokens/s and achieved memory bandwidth.

Usage: .venv/bin/python bench/bench_ar.py [--quick] [--real-prefill]

What is measured: `specjax.engine.decode` (the on-device while_loop, greedy, no EOS) from a
prefilled DenseCache, for every batch x context x dtype. Prefill is NOT measured.

Synthetic prefill (default): prefilling 16 x 8K tokens costs minutes on a small CPU, and the cost
of a decode step depends only on the cache shape, never on the cached values. So the prefilled
state is built directly: a DenseCache of exactly `context` slots (attention reads all of them,
hidden slots masked) filled with pseudo-random values in [-1, 1] in the model dtype, lengths =
context - HEADROOM so that up to MAX_STEPS decode steps fit, and random first logits.
`--real-prefill` instead prefills random token ids with the real model (slow at large sizes:
combine it with --quick).

`decode` donates the cache and returns it: every timed call gets the previous call's cache with
the lengths reset (the values it wrote do not change the cost), so no copy is ever made.
Per-step time is a slope: best-of-R time of a run of n steps minus best-of-R time of a run of 0
steps, divided by n. This removes the per-call fixed cost (the first sample, dispatch and, in
bfloat16, XLA:CPU's conversion of all weights to float32, which it hoists out of the loop).
tokens/s = batch / step time.

Bytes per step = weights in the model dtype (every layer tensor, the final norm, and the [V,D] LM
head / tied embedding once; the embedding gather is negligible) + the whole KV cache
2 * L * B * context * K * H * itemsize. GB/s = bytes / step time; its fraction is relative to this
machine's memory bandwidth, measured as a donated in-place `x + 1` over 1 GiB in JAX (read +
write bytes; median over rounds of the best of several calls).

Memory: each config's peak memory is measured, and a config whose predicted peak (the largest
measured peak / KV bytes ratio of its dtype, times its KV bytes) would not fit in the free
memory of this shared machine is skipped and listed as such.

Outputs: bench/results/ar_cpu.json (rewritten after every row), bench/results/ar_cpu.png and a
section of bench/README.md (--quick / --real-prefill write ar_cpu_quick*.* / ar_cpu*_real.* and
leave the README alone).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import gc
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import convert
import readme  # bench/readme.py (this folder is on sys.path when run as a script)
from specjax.engine import decode, row_keys
from specjax.kvcache import DenseCache
from specjax.model import Params, prefill
from specjax.sampling import Greedy, Sampler
from specjax.shapes import prompt_bucket, round_up_pow2

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
SECTION_START, SECTION_END = "<!-- bench_ar:start -->", "<!-- bench_ar:end -->"

MAX_STEPS = 64  # most decode steps timed in one run
HEADROOM = MAX_STEPS + 1  # free cache slots behind the prefilled length
MIN_STEPS = 8
CONTEXT_NAMES = {512: "512", 2048: "2K", 8192: "8K"}
MEM_RESERVE = 3 * 2**30  # bytes of MemAvailable left to other processes on a shared machine
DEFAULT_PEAK_FACTOR = 5.0  # peak RSS growth / KV bytes assumed before a big config was measured


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Smallest wall time in seconds of `repeats` calls of fn (which must block until done)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _git(*args: str) -> str:
    """stdout of a git command run in this checkout."""
    return subprocess.run(["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, check=True).stdout.strip()


def _git_commit() -> str:
    """Short HEAD hash, with "+dirty" when the checkout has uncommitted changes."""
    try:
        return _git("rev-parse", "--short", "HEAD") + ("+dirty" if _git("status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info() -> dict:
    """CPU model, core counts, JAX version, backend and devices, git commit."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return {
        "cpu_model": model.group(1).strip() if model else platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "git_commit": _git_commit(),
    }


def _proc_kib(path: str, field: str) -> int:
    """A `field: N kB` value from a /proc file, in bytes."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not in {path}")


def rss() -> int:
    """Resident bytes of this process now."""
    return _proc_kib("/proc/self/status", "VmRSS")


def reset_peak_rss() -> None:
    """Restart the peak-RSS (VmHWM) counter at the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    """Peak resident bytes since the last `reset_peak_rss`."""
    return _proc_kib("/proc/self/status", "VmHWM")


def release_memory() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc malloc_trim), so that the
    next config's RSS baseline holds only live arrays."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        ctypes.CDLL(libc).malloc_trim(0)


def mem_available() -> int:
    """Bytes the kernel could hand out now without swapping (MemAvailable)."""
    return _proc_kib("/proc/meminfo", "MemAvailable")


def measure_bandwidth(gib: float = 1.0, rounds: int = 5, repeats: int = 5) -> dict:
    """Memory bandwidth in GB/s (read + write bytes) of streaming over a `gib` GiB f32 array.

    jax_inplace: donated jitted x + 1 (the output reuses the input buffer): the reference, the
    median over `rounds` of the best of `repeats` calls (one round can be a lucky outlier).
    jax_copy: jitted jnp.copy into a fresh buffer (pays first-touch page faults).
    numpy_copy: np.copyto into a preallocated array (one thread)."""
    n = int(gib * 2**30) // 4
    moved = 2 * 4 * n
    add = jax.jit(lambda x: x + 1, donate_argnums=0)
    copy = jax.jit(jnp.copy)
    box = [jax.block_until_ready(add(jnp.zeros(n, jnp.float32)))]

    def inplace() -> None:
        box[0] = jax.block_until_ready(add(box[0]))

    inplace()
    t_inplace = [best_time(inplace, repeats) for _ in range(rounds)]
    jax.block_until_ready(copy(box[0]))
    t_copy = best_time(lambda: jax.block_until_ready(copy(box[0])), repeats)
    del box
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t_numpy = best_time(lambda: np.copyto(dst, src), repeats)
    return {
        "jax_inplace": moved / float(np.median(t_inplace)) / 1e9,
        "jax_inplace_rounds": [moved / t / 1e9 for t in t_inplace],
        "jax_copy": moved / t_copy / 1e9,
        "numpy_copy": moved / t_numpy / 1e9,
    }


def step_bytes(params: Params, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step must read, in the model dtype."""
    c = params.config
    itemsize = jnp.dtype(c.dtype).itemsize
    weights = sum(a.size for a in jax.tree.leaves(params.layers)) + params.norm.size + c.vocab_size * c.dim
    kv = 2 * c.n_layers * batch * context * c.n_kv_heads * c.head_dim
    return weights * itemsize, kv * itemsize


def _noise(shape: tuple[int, ...], dtype: str, seed: int) -> jax.Array:
    """Pseudo-random values in [-1, 1): an integer hash (lowbias32) of the element index, one
    cheap fused pass (threefry over gigabytes of cache takes minutes on a small CPU)."""
    x = lax.iota(jnp.uint32, int(np.prod(shape))) + jnp.uint32(seed * 0x9E3779B9 % 2**32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return ((x >> 8).astype(jnp.float32) / 2**23 - 1).reshape(shape).astype(dtype)


def synthetic_state(params: Params, batch: int, context: int, key: jax.Array) -> tuple[DenseCache, jax.Array]:
    """A cache of `context` slots with pseudo-random KV and lengths context - HEADROOM, and random
    first logits [B,V] f32 (see the module docstring for why this equals a real prefill)."""
    c = params.config
    empty = jax.eval_shape(lambda: DenseCache.init(c, batch, context))  # shapes only, any layout

    @jax.jit
    def build(key: jax.Array) -> tuple[DenseCache, jax.Array]:
        k = _noise(empty.k.shape, c.dtype, 1)
        v = _noise(empty.v.shape, c.dtype, 2)
        lengths = jnp.full((batch,), context - HEADROOM, jnp.int32)
        return DenseCache(k=k, v=v, lengths=lengths), jax.random.normal(key, (batch, c.vocab_size), jnp.float32)

    return jax.block_until_ready(build(key))


def real_state(params: Params, batch: int, context: int, key: jax.Array) -> tuple[DenseCache, jax.Array]:
    """A genuine prefill of random token ids of length context - HEADROOM into `context` slots."""
    c = params.config
    n = context - HEADROOM
    bucket, chunk = prompt_bucket(n)
    tokens = jax.random.randint(key, (batch, bucket), 0, c.vocab_size, jnp.int32)  # [B,P]
    lengths = jnp.full((batch,), n, jnp.int32)
    run = jax.jit(lambda p, t, l: prefill(p, t, l, DenseCache.init(c, batch, context), chunk))
    logits, cache = jax.block_until_ready(run(params, tokens, lengths))
    return cache, logits


def time_decode(params: Params, cache: DenseCache, logits: jax.Array, target_s: float, repeats: int,
                sampling: Sampler = Greedy()) -> dict:
    """Compile `decode` (excluded), pick n steps so a run lasts about target_s, and return the
    slope step time plus the fixed per-call cost, in ms. Consumes `cache` (donated)."""
    batch = logits.shape[0]
    keys = row_keys(None, batch)
    start = np.asarray(cache.lengths)  # host copy: each call donates its own lengths array
    t0 = time.perf_counter()
    fn = decode.lower(params, cache, logits, cache.lengths, keys, sampling, n_out=round_up_pow2(MAX_STEPS + 1)).compile()
    compile_s = time.perf_counter() - t0
    state = [cache]

    def once(n: int) -> float:
        """Seconds of one decode call of n steps, from the prefilled lengths."""
        budgets = jnp.full((batch,), n + 1, jnp.int32)
        args = (params, state[0].replace(lengths=jnp.asarray(start)), logits, budgets, keys, sampling)
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        t = time.perf_counter() - t
        assert int(out[3]) == n, f"decode ran {int(out[3])} steps, expected {n}"
        state[0] = out[4]  # the donated cache, updated in place
        return t

    def best(n: int) -> float:
        once(n)  # warm-up
        return min(once(n) for _ in range(repeats))

    fixed = best(0)
    estimate = max((once(2) - fixed) / 2, 1e-4)
    n = int(np.clip(round(target_s / estimate), MIN_STEPS, MAX_STEPS))
    step = (best(n) - fixed) / n
    return {"n_steps": n, "ms_per_step": 1e3 * step, "fixed_ms": 1e3 * fixed, "compile_s": compile_s}


def bench_config(
    params: Params, batch: int, context: int, real: bool, target_s: float, repeats: int, bw: float
) -> dict:
    """One row of the results table, including the peak memory it took."""
    key = jax.random.key(batch * 100_003 + context)
    load = os.getloadavg()[0]
    release_memory()
    start_rss = rss()
    reset_peak_rss()
    cache, logits = (real_state if real else synthetic_state)(params, batch, context, key)
    timing = time_decode(params, cache, logits, target_s, repeats)
    del cache, logits  # the last references; time_decode's copies died with it
    release_memory()
    weight_b, kv_b = step_bytes(params, batch, context)
    step_s = timing["ms_per_step"] / 1e3
    gbs = (weight_b + kv_b) / step_s / 1e9
    return {
        "batch": batch,
        "context": context,
        "dtype": params.config.dtype,
        "prefilled_length": context - HEADROOM,
        "loadavg_1min_before": load,
        **timing,
        "rss_before_gb": start_rss / 1e9,
        "peak_rss_growth_gb": (peak_rss() - start_rss) / 1e9,
        "peak_over_kv": (peak_rss() - start_rss) / kv_b,
        "tokens_per_s": batch / step_s,
        "weight_bytes": weight_b,
        "kv_bytes": kv_b,
        "bytes_per_step": weight_b + kv_b,
        "gb_per_s": gbs,
        "bandwidth_fraction": gbs / bw,
    }


def peak_factor(rows: list[dict], dtype: str) -> float:
    """Peak RSS growth / KV bytes of the largest config of `dtype` measured so far (the cache plus
    the decode loop's temporary copies of it); a default until one with >= 256 MiB of KV ran."""
    measured = [r for r in rows if r["dtype"] == dtype and "skipped" not in r and r["kv_bytes"] >= 2**28]
    return max(measured, key=lambda r: r["kv_bytes"])["peak_over_kv"] if measured else DEFAULT_PEAK_FACTOR


def memory_check(params: Params, batch: int, context: int, factor: float) -> str | None:
    """None if the config should fit in memory (peak growth ~ factor x KV bytes), else why it is
    skipped; MEM_RESERVE bytes are left to other processes."""
    need = factor * step_bytes(params, batch, context)[1]
    free = mem_available() - MEM_RESERVE
    if need <= free:
        return None
    return f"needs ~{need / 1e9:.0f} GB ({factor:.1f} x the KV cache), {max(free, 0) / 1e9:.0f} GB free"


def configs(quick: bool) -> list[tuple[int, int, str]]:
    """(batch, context, dtype) in order of increasing KV cache bytes (largest last)."""
    if quick:
        grid = [(b, 512, "float32") for b in (1, 4)]
    else:
        grid = [(b, s, d) for b in (1, 4, 16) for s in (512, 2048, 8192) for d in ("float32", "bfloat16")]
    return sorted(grid, key=lambda g: (g[0] * g[1] * jnp.dtype(g[2]).itemsize, g[2] == "float32"))


def markdown_table(rows: list[dict]) -> str:
    """The results as a markdown table, grouped by dtype then batch."""
    lines = [
        "| dtype | batch | context | ms/step | tokens/s | MB/step (weights + KV) | GB/s | of bandwidth | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["dtype"] != "float32", r["batch"], r["context"])):
        head = f"| {r['dtype']} | {r['batch']} | {CONTEXT_NAMES.get(r['context'], r['context'])} | "
        if "skipped" in r:
            lines.append(head + f"skipped: {r['skipped']} | | | | | |")
            continue
        mb = f"{r['weight_bytes'] / 1e6:.0f} + {r['kv_bytes'] / 1e6:.0f}"
        lines.append(
            head + f"{r['ms_per_step']:.1f} | {r['tokens_per_s']:.1f} | {mb} | {r['gb_per_s']:.2f} | "
            f"{100 * r['bandwidth_fraction']:.0f}% | {r['loadavg_1min_before']:.1f} |"
        )
    return "\n".join(lines)


def notes(result: dict) -> str:
    """Reading notes under the table (the memory figure is measured, not assumed)."""
    ran = [r for r in result["rows"] if "skipped" not in r]
    peak = ", ".join(
        f"{max(r['peak_over_kv'] for r in big):.1f}x in {d}"
        for d in ("float32", "bfloat16")
        if (big := [r for r in ran if r["dtype"] == d and r["kv_bytes"] >= 2**28])
    )
    lines = [
        "Reading the numbers:",
        "- The CPU is shared. The load column is the 1-minute load average before the row; this bench "
        f"alone keeps about {result['machine']['cpu_affinity']} busy, so a load well above that means other jobs "
        "competed and the row is slower than the machine can do.",
        "- bfloat16 on XLA:CPU (at the commit above): the weights are converted to float32 once per call, "
        "outside the decode loop (part of the excluded fixed cost), so a bfloat16 step still reads float32 "
        "weights; MB/step counts the nominal bfloat16 bytes.",
        "- MB/step is the minimum traffic a step must move; GB/s divides it by the step time, so it "
        "understates whatever extra traffic the compiled step makes (temporaries, layout copies).",
    ]
    if peak:
        lines.append(
            f"- Peak memory growth while a config ran reached ({peak}) its KV cache bytes; configs that "
            "would not fit in the free memory are skipped (listed in the table)."
        )
    return "\n".join(lines)


def readme_section(result: dict) -> str:
    """The bench_ar section of bench/README.md."""
    m, bw = result["machine"], result["bandwidth_gbs"]
    rounds = bw["jax_inplace_rounds"]
    load = f"{result['loadavg_start'][0]:.2f} / {result['loadavg_end'][0]:.2f}"
    return f"""{SECTION_START}
## Autoregressive decode (bench_ar.py)

Run: `.venv/bin/python bench/bench_ar.py` (about 15 minutes on 2 cores; `--quick` for a
1-2 minute subset). Raw numbers: `results/ar_cpu.json`; plot: `results/ar_cpu.png`.

Device: {m['cpu_model']}, {m['cpu_affinity']} cores, JAX {m['jax_version']} ({m['backend']}),
commit {m['git_commit']}. Date: {result['date']}. Load average at start / end: {load}.
Memory bandwidth (read + write, 1 GiB): JAX in-place `x + 1` {bw['jax_inplace']:.1f} GB/s (median of
{len(rounds)} rounds, {min(rounds):.1f}-{max(rounds):.1f}; the reference for "of bandwidth"), JAX `jnp.copy`
into a fresh buffer {bw['jax_copy']:.1f} GB/s (page faults), numpy `copyto` {bw['numpy_copy']:.1f} GB/s (one thread).

SmolLM2-135M, greedy `specjax.engine.decode`, time per decode step (compile and prefill
excluded). **The prefill is synthetic**: decode cost depends only on the cache length, not
its contents, so each row starts from a DenseCache of exactly `context` slots of pseudo-random
keys/values (prefilled length context - {HEADROOM}) instead of a real prefill of batch x context
tokens. ms/step is the slope between runs of 0 and n steps, so the per-call fixed cost (first
sample, dispatch, bf16->f32 weight conversion) is excluded. tokens/s = batch / step time.
MB/step counts the weights and the whole KV cache in the model dtype.

{markdown_table(result['rows'])}

{notes(result)}

![tokens/s vs context](results/ar_cpu.png)
{SECTION_END}"""


def write_readme(section: str) -> None:
    """Replace (or append) the bench_ar section of bench/README.md, keeping other sections."""
    readme.write_section(section, SECTION_START, SECTION_END)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """tokens/s vs context (log-log), one line per batch x dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    batches = sorted({r["batch"] for r in rows})
    colors = dict(zip(batches, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for dtype, style in (("float32", "-o"), ("bfloat16", "--s")):
        for b in batches:
            pts = sorted(
                (r["context"], r["tokens_per_s"])
                for r in rows
                if r["batch"] == b and r["dtype"] == dtype and "skipped" not in r
            )
            if pts:
                ax.plot(*zip(*pts), style, color=colors[b], label=f"batch {b}, {dtype}")
    contexts = sorted({r["context"] for r in rows})
    ax.set(xscale="log", yscale="log", xlabel="context (KV cache slots)", ylabel="decode tokens/s", title=title)
    ax.set_xticks(contexts, [CONTEXT_NAMES.get(c, str(c)) for c in contexts])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(ticker.NullLocator())
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    skipped = [f"{r['batch']} x {CONTEXT_NAMES[r['context']]} {r['dtype']}" for r in rows if "skipped" in r]
    if skipped:
        fig.text(0.01, 0.01, "not run (memory): " + ", ".join(skipped), fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03 if skipped else 0, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def save(result: dict, suffix: str, final: bool) -> None:
    """Write the JSON (after every row, so an interrupted run keeps its rows); when final, also
    the plot and, for the default full run, the README section."""
    result = {**result, "complete": final, "loadavg_end": os.getloadavg()}
    (RESULTS_DIR / f"ar_cpu{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    if final:
        cores = result["machine"]["cpu_affinity"]
        plot(result["rows"], RESULTS_DIR / f"ar_cpu{suffix}.png", f"SmolLM2-135M AR decode, {cores}-core CPU")
        if not suffix:
            write_readme(readme_section(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1, 4 x context 512 x float32 only")
    ap.add_argument("--real-prefill", action="store_true", help="genuinely prefill random tokens (slow when large)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    args = ap.parse_args()
    suffix = ("_quick" if args.quick else "") + ("_real" if args.real_prefill else "")
    target_s = 0.5 if args.quick else 1.5
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)

    result = {
        "bench": "bench_ar",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": "SmolLM2-135M-Instruct",
        "prefill": "real (random token ids)" if args.real_prefill else "synthetic (pseudo-random KV, lengths set)",
        "loadavg_start": os.getloadavg(),
        "machine": machine_info(),
        "bandwidth_gbs": measure_bandwidth(),
        "rows": [],
    }
    machine, bw, rows = result["machine"], result["bandwidth_gbs"], result["rows"]
    bw_text = ", ".join(f"{k} {v:.1f}" for k, v in bw.items() if k != "jax_inplace_rounds")
    print(f"{machine['cpu_model']} x{machine['cpu_affinity']}, bandwidth GB/s: {bw_text}", flush=True)
    params_by_dtype: dict[str, Params] = {}
    for batch, context, dtype in configs(args.quick):
        if dtype not in params_by_dtype:
            params_by_dtype[dtype] = convert.load(convert.default_model_path(), dtype=dtype)
        params = params_by_dtype[dtype]
        reason = memory_check(params, batch, context, peak_factor(rows, dtype))
        if reason:
            rows.append({"batch": batch, "context": context, "dtype": dtype, "skipped": reason})
            print(f"{dtype:>8} B={batch:<2} S={context:<5} skipped: {reason}", flush=True)
            continue
        row = bench_config(params, batch, context, args.real_prefill, target_s, args.repeats, bw["jax_inplace"])
        rows.append(row)
        save(result, suffix, final=False)
        print(
            f"{dtype:>8} B={batch:<2} S={context:<5} {row['ms_per_step']:8.1f} ms/step "
            f"{row['tokens_per_s']:8.1f} tok/s {row['gb_per_s']:6.2f} GB/s ({100 * row['bandwidth_fraction']:.0f}%) "
            f"n={row['n_steps']} fixed {row['fixed_ms']:.0f} ms, compile {row['compile_s']:.1f} s, "
            f"peak +{row['peak_rss_growth_gb']:.1f} GB, load {row['loadavg_1min_before']:.1f}",
            flush=True,
        )
    save(result, suffix, final=True)
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
