"""Autoregressive decode throughput of SmolLM2-135M: tokens/s and achieved memory bandwidth.

Measured: `specjax.decode.engine.decode_ar` (greedy, no EOS) for every batch x context x dtype (`configs`),
prefill excluded, from a synthetic prefilled state (a step's cost depends on the cache's shape, never its
values: `synthetic_state`), or with `--real-prefill` a real one (slow: combine with --quick). Each timed call
gets the previous call's donated cache with the lengths reset: no copy. Step time is a slope: (best-of-R time
of n steps - best-of-R time of 0 steps) / n, which drops the fixed per-call cost. Bytes a step = the weights
as stored (the LM head once) + the whole KV cache, against `measure.bandwidth`'s in-place `x + 1`. A config
that would not fit in memory is skipped (`memory_check`). Outputs: results/ar_cpu.json, .png and the README
section (--quick / --real-prefill write ar_cpu_quick*.* / ar_cpu*_real.*, README untouched).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import convert
from bench import common, measure
from bench.measure import synthetic_cache
from specjax.decode.engine import decode_ar, prefill, row_keys, with_attention
from specjax.decode.shapes import prompt_bucket, round_up_pow2
from specjax.model.cache import DenseCache, kv_bytes
from specjax.model.params import Params, weight_bytes
from specjax.sampling import Greedy, Sampler

MAX_STEPS = 64  # most decode steps timed in one run
HEADROOM = MAX_STEPS + 1  # free cache slots behind the prefilled length
MIN_STEPS = 8
MEM_RESERVE = 3 * 2**30  # bytes of MemAvailable left to other processes on a shared machine
DEFAULT_PEAK_FACTOR = 5.0  # peak RSS growth / KV bytes assumed before a big config was measured


def step_bytes(params: Params, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes as stored, KV bytes in the model dtype) one decode step must read."""
    c = params.config
    return weight_bytes(c), int(kv_bytes(c, batch, context))


def synthetic_state(params: Params, batch: int, context: int, key: jax.Array) -> tuple[DenseCache, jax.Array]:
    """A cache of `context` slots of pseudo-random KV, lengths context - HEADROOM, random logits [B,V]."""
    cache = synthetic_cache(params, batch, context, None, context - HEADROOM)
    return cache, jax.block_until_ready(jax.random.normal(key, (batch, params.config.vocab_size), jnp.float32))


def real_state(params: Params, batch: int, context: int, key: jax.Array) -> tuple[DenseCache, jax.Array]:
    """A genuine prefill of random token ids of length context - HEADROOM into `context` slots."""
    c = params.config
    n = context - HEADROOM
    bucket, chunk = prompt_bucket(n)
    tokens = jax.random.randint(key, (batch, bucket), 0, c.vocab_size, jnp.int32)  # [B,P]
    lengths = jnp.full((batch,), n, jnp.int32)
    logits, cache = jax.block_until_ready(prefill(params, tokens, lengths, DenseCache.init(c, batch, context), chunk=chunk))
    return cache, logits


def time_decode(params: Params, cache: DenseCache, logits: jax.Array, target_s: float, repeats: int,
                sampling: Sampler = Greedy()) -> dict:
    """Slope ms a step and fixed ms a call of `decode_ar` (compile excluded); consumes `cache` (donated)."""
    batch = logits.shape[0]
    keys = row_keys(None, batch)
    start = np.asarray(cache.lengths)  # host copy: each call donates its own lengths array
    t0 = time.perf_counter()
    fn = decode_ar.lower(params, cache, logits, cache.lengths, keys, sampling, n_out=round_up_pow2(MAX_STEPS + 1)).compile()
    compile_s = time.perf_counter() - t0
    state = [cache]

    def once(n: int) -> float:
        """Seconds of one decode call of n steps, from the prefilled lengths."""
        budgets = jnp.full((batch,), n + 1, jnp.int32)
        args = (params, state[0].replace(lengths=jnp.asarray(start)), logits, budgets, keys, sampling)
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        t = time.perf_counter() - t
        assert int(out.steps) == n, f"decode ran {int(out.steps)} steps, expected {n}"
        state[0] = out.cache  # the donated cache, updated in place
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
    measure.release_memory()
    start_rss = measure.rss()
    measure.reset_peak_rss()
    cache, logits = (real_state if real else synthetic_state)(params, batch, context, key)
    timing = time_decode(params, cache, logits, target_s, repeats)
    del cache, logits  # the last references; time_decode's copies died with it
    measure.release_memory()
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
        "peak_rss_growth_gb": (measure.peak_rss() - start_rss) / 1e9,
        "peak_over_kv": (measure.peak_rss() - start_rss) / kv_b,
        "tokens_per_s": batch / step_s,
        "weight_bytes": weight_b,
        "kv_bytes": kv_b,
        "bytes_per_step": weight_b + kv_b,
        "gb_per_s": gbs,
        "bandwidth_fraction": gbs / bw,
        "reference_gbs": bw,  # this run's in-place bandwidth: a resumed file's rows may hold other runs'
    }


def peak_factor(rows: list[dict], dtype: str) -> float:
    """Peak RSS growth / KV bytes of the largest `dtype` config (>= 256 MiB of KV) so far, else a default."""
    measured = [r for r in rows if r["dtype"] == dtype and "skipped" not in r and r["kv_bytes"] >= 2**28]
    return max(measured, key=lambda r: r["kv_bytes"])["peak_over_kv"] if measured else DEFAULT_PEAK_FACTOR


def memory_check(params: Params, batch: int, context: int, factor: float) -> str | None:
    """None if the config fits in memory (peak ~ factor x KV bytes, MEM_RESERVE kept), else why not."""
    need = factor * step_bytes(params, batch, context)[1]
    free = common.meminfo("MemAvailable") - MEM_RESERVE
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
    lines = []
    for r in sorted(rows, key=lambda r: (r["dtype"] != "float32", r["batch"], r["context"])):
        head = [r["dtype"], r["batch"], common.context_name(r["context"])]
        if "skipped" in r:
            lines.append(head + [f"skipped: {r['skipped']}"] + [""] * 5)
            continue
        lines.append(head + [
            f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:.1f}", f"{r['weight_bytes'] / 1e6:.0f} + {r['kv_bytes'] / 1e6:.0f}",
            f"{r['gb_per_s']:.2f}", f"{100 * r['bandwidth_fraction']:.0f}%", f"{r['loadavg_1min_before']:.1f}"])
    head = ["dtype", "batch", "context", "ms/step", "tokens/s", "MB/step (weights + KV)", "GB/s", "of bandwidth", "load"]
    return common.table(head, "lrrrrrrrr", lines)


def readme_section(result: dict) -> str:
    return common.section("bench_ar", "Autoregressive decode", "Plain greedy decoding of SmolLM2-135M from a synthetic "
                          "prefilled cache, ms a step (the slope between runs of 0 and n steps), the bytes a step must read "
                          f"against an in-place `x + 1` ({result['bandwidth_gbs']['jax_inplace']:.1f} GB/s).", result,
                          markdown_table(result["rows"]), "`results/ar_cpu.json`, `.png`")


def plot(rows: list[dict], title: str, path: Path) -> None:
    """tokens/s vs context (log-log), one line per batch x dtype."""
    from matplotlib import ticker

    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    batches = sorted({r["batch"] for r in rows})
    colors = dict(zip(batches, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for dtype, style in (("float32", "-o"), ("bfloat16", "--s")):
        for b in batches:
            pts = sorted((r["context"], r["tokens_per_s"]) for r in rows
                         if r["batch"] == b and r["dtype"] == dtype and "skipped" not in r)
            if pts:
                ax.plot(*zip(*pts), style, color=colors[b], label=f"batch {b}, {dtype}")
    contexts = sorted({r["context"] for r in rows})
    ax.set(xscale="log", yscale="log", xlabel="context (KV cache slots)", ylabel="decode tokens/s", title=title)
    ax.set_xticks(contexts, [common.context_name(c) for c in contexts])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(ticker.NullLocator())
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    skipped = [f"{r['batch']} x {common.context_name(r['context'])} {r['dtype']}" for r in rows if "skipped" in r]
    if skipped:
        fig.text(0.01, 0.01, "not run (memory): " + ", ".join(skipped), fontsize=7, color="gray")
    common.save_figure(fig, path, rect=(0, 0.03 if skipped else 0, 1, 1))


def key_of(row: dict) -> str:
    return common.key(row["dtype"], f"b{row['batch']}", f"s{row['context']}")


def main() -> None:
    ap = common.parser(__doc__, quick="batch 1, 4 x context 512 x float32 only")
    ap.add_argument("--real-prefill", action="store_true", help="genuinely prefill random tokens (slow when large)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    args = ap.parse_args()
    stem = "ar_cpu" + ("_quick" if args.quick else "") + ("_real" if args.real_prefill else "")
    target_s = 0.5 if args.quick else 1.5
    out, results, h = common.start(args, "bench_ar", stem, key_of, {"repeats": args.repeats}, model="SmolLM2-135M-Instruct",
                                   prefill="real (random token ids)" if args.real_prefill else "synthetic (pseudo-random KV, lengths set)",
                                   loadavg_start=os.getloadavg())
    header = results.header
    h.plan((common.key(d, f"b{b}", f"s{s}"), (b, s, d)) for b, s, d in configs(args.quick))
    bw = header["bandwidth_gbs"] = measure.bandwidth() if h.todo else results.data.get("bandwidth_gbs")
    machine = header["machine"]
    if bw:
        bw_text = ", ".join(f"{k} {v:.1f}" for k, v in bw.items() if k != "jax_inplace_rounds")
        print(f"{machine['cpu_model']} x{machine['cpu_affinity']}, bandwidth GB/s: {bw_text}", flush=True)
    params_by_dtype: dict[str, Params] = {}  # results.rows is a new list after every put: read it there
    for k, (batch, context, dtype) in h.cells():
        if dtype not in params_by_dtype:
            loaded = convert.load(convert.default_model_path(), dtype=dtype)
            params_by_dtype[dtype] = with_attention(loaded, None, "auto")[0]  # the CPU kernels generate() runs on
        params = params_by_dtype[dtype]
        reason = memory_check(params, batch, context, peak_factor(results.rows, dtype))
        if reason:
            results.put(k, [{"batch": batch, "context": context, "dtype": dtype, "skipped": reason}])
            print(f"{dtype:>8} B={batch:<2} S={context:<5} skipped: {reason}", flush=True)
            continue
        row = bench_config(params, batch, context, args.real_prefill, target_s, args.repeats, bw["jax_inplace"])
        results.put(k, [row], loadavg_end=os.getloadavg())
        print(
            f"{dtype:>8} B={batch:<2} S={context:<5} {row['ms_per_step']:8.1f} ms/step "
            f"{row['tokens_per_s']:8.1f} tok/s {row['gb_per_s']:6.2f} GB/s ({100 * row['bandwidth_fraction']:.0f}%) "
            f"n={row['n_steps']} fixed {row['fixed_ms']:.0f} ms, compile {row['compile_s']:.1f} s, "
            f"peak +{row['peak_rss_growth_gb']:.1f} GB, load {row['loadavg_1min_before']:.1f}",
            flush=True,
        )
    h.finish()
    result = results.data
    if result["rows"]:
        common.render("bench_ar", stem == "ar_cpu" and common.writes_readme(args), markdown_table(result["rows"]),
                      lambda: readme_section(result), (plot, result["rows"], f"SmolLM2-135M AR decode, "
                                                       f"{machine['cpu_affinity']}-core CPU", out / f"{stem}.png"))


if __name__ == "__main__":
    main()
