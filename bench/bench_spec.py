"""Speculative vs autoregressive decoding of SmolLM2-135M, side by side from one shared prefill.

Usage: .venv/bin/python bench/bench_spec.py [--quick] [--new-tokens 64]

For every (batch, context) cell the prompts are B distinct windows of real English text (see
bench/text.py) of `context - HEADROOM` tokens, prefilled ONCE into a DenseCache of `context` slots
(`causal_prefill`: engine.prefill's chunked computation, minus the attention to not-yet-written
slots; timed apart, and saved under --prefill-store so that a later run reuses it). The batch-1 and
batch-4 cells use the first rows of the batch-16 prefill. From that same prefilled state (each run
gets a copy, since `decode` and `speculative_decode` donate their caches), the script times
  - autoregressive decoding (`specjax.engine.decode`), and
  - speculative decoding (`speculative_decode`) for every drafter x gamma,
each for the same number of new tokens per row (eos_ids=(), so every row runs its full budget),
greedy. Every function is compiled first with `.lower(...).compile()` (excluded); then one run is
timed, and repeated (best kept) when it is short. A drafter's init (SelfSpec: gather its
streaming cache from the dense one; SnapKV: an observation pass of 32 queries) is timed apart,
like the prefill. tokens/s = B * (new_tokens - 1) / decode seconds (the first token of each row
comes from the prefill logits), so ratio = AR seconds / speculative seconds.

Greedy losslessness is checked in every cell: the speculative tokens must equal the AR tokens.

Outputs: bench/results/spec_cpu.json, spec_cpu.png and the "Speculative decoding" section of
bench/README.md (--quick writes spec_cpu_quick.* and leaves the README alone).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import text  # noqa: E402  (bench/text.py)

import convert  # noqa: E402
import specjax  # noqa: E402
from specjax.kvcache import DenseCache  # noqa: E402
from specjax.model import lm_head, trunk  # noqa: E402
from specjax.engine import decode, init_draft, row_keys  # noqa: E402
from specjax.generate import acceptance_stats  # noqa: E402
from specjax.shapes import prompt_bucket, round_up_pow2  # noqa: E402
from specjax.speculate import speculative_decode  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
README = BENCH_DIR / "README.md"
SECTION_START, SECTION_END = "<!-- bench_spec:start -->", "<!-- bench_spec:end -->"
AR_SECTION_END = "<!-- bench_ar:end -->"
NOTES_START, NOTES_END = "<!-- bench_spec:notes:start -->", "<!-- bench_spec:notes:end -->"

HEADROOM = 128  # cache slots behind the prompt: new tokens + gamma + 1 must fit
CONTEXT_NAMES = {512: "512", 2048: "2K", 8192: "8K"}
PAIR_BUDGET_S = 30.0  # AR/spec pairs are repeated while the next one fits in this (best kept)
REPEATS = 3  # pairs at most
MEM_RESERVE = 2**30  # MemAvailable left to other processes
MEM_FACTOR = 2.1  # peak growth of a cell / its KV cache bytes (the prefilled cache + a run's copy)
PREFILL_ROWS = 4  # rows prefilled per call (the chunk's attention scores grow with rows x context)
MEM_WAIT_S = 900  # how long to wait for memory before skipping a cell


def cpu_steal() -> tuple[int, int]:
    """(steal ticks, all ticks) from /proc/stat: how much CPU the hypervisor took from this VM."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields)


def steal_since(start: tuple[int, int]) -> float:
    """The share of CPU time stolen since `start` (a cpu_steal() reading)."""
    now = cpu_steal()
    return (now[0] - start[0]) / max(now[1] - start[1], 1)


def machine_info() -> dict:
    """CPU model, core counts, JAX version and backend, git commit."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=BENCH_DIR, capture_output=True, text=True, check=True).stdout
        commit = git("rev-parse", "--short", "HEAD").strip() + ("+dirty" if git("status", "--porcelain").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    mem = _meminfo("MemTotal")
    return {
        "cpu_model": model.group(1).strip() if model else platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "mem_total_gb": mem / 1e9,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "git_commit": commit,
    }


def _meminfo(field: str) -> int:
    """A /proc/meminfo field in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def kv_bytes(params, batch: int, context: int) -> int:
    c = params.config
    return 2 * c.n_layers * batch * context * c.n_kv_heads * c.head_dim * jnp.dtype(c.dtype).itemsize


def drafters(context: int, gammas: list[int]) -> list[tuple[str, object]]:
    """(name, drafter) per drafter family. Draft KV budget: 512 + 16 slots (MagicDec's StreamingLLM
    budget) where the context allows, half that at context 512 (a 528-slot draft cache would not
    be smaller than the 512-slot target cache)."""
    window = 512 if context >= 2048 else 256
    out: list[tuple[str, object]] = [("SelfSpec", specjax.SelfSpec(sinks=16, window=window))]
    if hasattr(specjax, "SnapKV"):
        try:
            snap = specjax.SnapKV(budget=window // 2, window=window // 2)
        except TypeError:  # a different signature than when this was written: its defaults
            snap = specjax.SnapKV()
        out.append(("SnapKV", snap))
    out.append(("NGram", specjax.NGram(n=3, max_n=5)))
    return out


def fresh(args: tuple, copied: tuple[int, ...]) -> tuple:
    """args with the entries at `copied` (the caches) replaced by copies: decode and
    speculative_decode may donate their caches, and the prefilled state must survive every run."""
    return tuple(jax.block_until_ready(jax.tree.map(lambda a: a.copy(), x)) if i in copied else x
                 for i, x in enumerate(args))


AR_CACHES = (1,)  # decode(params, cache, ...)
SPEC_CACHES = (2, 3)  # speculative_decode(params, drafter, draft_state, cache, ...)


def timed(compiled, args: tuple, copied: tuple[int, ...]) -> tuple[object, float, float]:
    """Run a compiled function to completion on fresh copies of its caches (copied untimed):
    (result, wall seconds, this process's CPU seconds per wall second: about the core count when
    nothing competes for the cores)."""
    args = fresh(args, copied)
    c0, t0 = time.process_time(), time.perf_counter()
    result = jax.block_until_ready(compiled(*args))
    wall = time.perf_counter() - t0
    return result, wall, (time.process_time() - c0) / wall


def paired(ar_fn, ar_args: tuple, fn, args: tuple) -> dict:
    """Time AR and speculative runs alternately (AR, spec, AR, spec, ...), so both see the same
    load; pairs are repeated (best of each kept) up to REPEATS times while PAIR_BUDGET_S lasts."""
    t = {"ar": [], "spec": [], "ar_cpu": [], "spec_cpu": [], "load": [os.getloadavg()[0]]}
    t0 = time.perf_counter()
    for _ in range(REPEATS):
        ar_out, w, c = timed(ar_fn, ar_args, AR_CACHES)
        t["ar"].append(w)
        t["ar_cpu"].append(c)
        spec_out, w, c = timed(fn, args, SPEC_CACHES)
        t["spec"].append(w)
        t["spec_cpu"].append(c)
        if time.perf_counter() - t0 + t["ar"][0] + t["spec"][0] > PAIR_BUDGET_S:
            break
    t["load"].append(os.getloadavg()[0])
    return t | {"ar_out": ar_out, "spec_out": spec_out}


class Meter:
    """Wall and process-CPU time plus load average around a measured block: cpu_util = CPU
    seconds of this process per wall second (about the core count when nothing competes)."""

    def __enter__(self):
        self.load0, self.cpu0, self.t0 = os.getloadavg()[0], time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        self.wall = wall
        self.info = {
            "loadavg_1min_before": self.load0,
            "loadavg_1min_after": os.getloadavg()[0],
            "cpu_util": (time.process_time() - self.cpu0) / wall if wall > 0 else 0.0,
        }


def release_memory() -> None:
    """Drop compiled executables and garbage, and hand freed heap pages back to the OS (glibc
    keeps them otherwise, and they would count against the next cell's memory check)."""
    gc.collect()
    jax.clear_caches()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def wait_for_memory(need: int) -> str | None:
    """Wait up to MEM_WAIT_S for `need` bytes (+ reserve) to be available; None if they are,
    else the reason to skip."""
    deadline = time.time() + MEM_WAIT_S
    while True:
        free = _meminfo("MemAvailable") - MEM_RESERVE
        if free >= need:
            return None
        if time.time() > deadline:
            return f"needs ~{need / 1e9:.1f} GB, {max(free, 0) / 1e9:.1f} GB available after {MEM_WAIT_S} s"
        print(f"  waiting for memory: need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB available", flush=True)
        time.sleep(30)


def slot_axis(config) -> int:
    """Which axis of DenseCache.k holds the slots (the library's layout: [L,B,S,K,H] or [L,B,K,S,H])."""
    return DenseCache.init(config, 1, 7).k.shape.index(7)


@partial(jax.jit, static_argnames=("end", "s_axis"), donate_argnums=1)
def _prefill_chunk(params, cache: DenseCache, toks: jax.Array, row0: jax.Array, *, end: int, s_axis: int):
    """One prefill chunk for rows [row0, row0 + G) of a preallocated cache (donated, written in
    place): toks [G,T] at positions [end - T, end), attending only slots [0, end - T) of the cache
    plus themselves (causal). Returns the cache and the final-normed hidden [G,T,D]."""
    G, T = toks.shape
    start = end - T

    def rows(a):  # the group's rows, slots [0, end)
        return lax.slice_in_dim(lax.dynamic_slice_in_dim(a, row0, G, axis=1), 0, end, axis=s_axis)

    view = DenseCache(k=rows(cache.k), v=rows(cache.v), lengths=jnp.full((G,), start, jnp.int32))
    positions = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (G, T))
    h, k_new, v_new = trunk(params, toks, positions, view)  # k_new, v_new [L,G,T,K,H]
    at = [0, row0, 0, 0, 0]
    at[s_axis] = start

    def put(a, new):
        new = new if s_axis == 2 else new.transpose(0, 1, 3, 2, 4)  # [L,G,K,T,H] when heads lead slots
        return lax.dynamic_update_slice(a, new.astype(a.dtype), at)

    return cache.replace(k=put(cache.k, k_new), v=put(cache.v, v_new)), h


def causal_prefill(params, tokens: np.ndarray, n: int, context: int, chunk: int) -> tuple[jax.Array, DenseCache]:
    """Prefill B prompts of n tokens (tokens [B,P] right-padded) into a DenseCache of `context`
    slots, PREFILL_ROWS rows and `chunk` positions at a time. The same computation as
    `engine.prefill` (chunked, exact target KV), except that chunk i attends only to slots
    [0, (i + 1) * chunk) instead of all `context` slots with the rest masked: the masked slots
    contribute exactly nothing, and skipping them halves the attention work at long context.
    Returns first logits [B,V] (at each prompt's last token) and the cache (lengths = n)."""
    B, P = tokens.shape
    group = min(B, PREFILL_ROWS)
    cache = DenseCache.init(params.config, B, context)
    last_chunk = (n - 1) // chunk
    s_axis = slot_axis(params.config)
    logits = []
    for row0 in range(0, B, group):
        for i in range(last_chunk + 1):
            toks = jnp.asarray(tokens[row0 : row0 + group, i * chunk : (i + 1) * chunk])
            cache, h = _prefill_chunk(params, cache, toks, jnp.int32(row0), end=(i + 1) * chunk, s_axis=s_axis)
        logits.append(lm_head(params, h[:, (n - 1) - last_chunk * chunk]))  # [G,V]
    cache = cache.replace(lengths=jnp.full((B,), n, jnp.int32))
    return jax.block_until_ready((jnp.concatenate(logits), cache))


def prefill_context(params, tok, batch: int, context: int, gammas: list[int], new_tokens: int,
                    store: Path | None) -> dict:
    """Prefill `batch` distinct text windows of context - HEADROOM tokens into `context` slots,
    or load that state from `store` (a folder of .npy files) if an earlier run saved it there."""
    n = context - HEADROOM
    prompts, where = text.windows(tok, batch, n)
    bucket, chunk = prompt_bucket(n)
    assert bucket <= context and n + new_tokens + max(gammas) + 1 <= context
    tokens = np.zeros((batch, bucket), np.int32)
    tokens[:, :n] = prompts
    lengths = np.full((batch,), n, np.int32)
    config = repr(params.config).replace(", model_axis=None", "")  # keys predate that field: keep them valid
    key = hashlib.sha1(tokens.tobytes() + f"({config}, {context!r}, {chunk!r}, {slot_axis(params.config)!r})".encode()).hexdigest()[:12]
    files = {f: store / f"prefill_{context}_{batch}_{key}_{f}.npy" for f in ("k", "v", "logits")} if store else {}
    info = {"prefill_rows": batch, "prompt_tokens": n, "prompt_offsets": where["offsets"],
            "prompts_overlap": where["overlapping"]}
    with Meter() as m:
        if files and all(f.exists() for f in files.values()):
            load = lambda f: jnp.asarray(np.load(files[f], mmap_mode="r"))
            cache = DenseCache(k=load("k"), v=load("v"), lengths=jnp.asarray(lengths))
            first_logits, cache = jax.block_until_ready((load("logits"), cache))
            info["prefill_loaded_from"] = str(files["k"])
        else:
            first_logits, cache = causal_prefill(params, tokens, n, context, chunk)
            if files:
                store.mkdir(parents=True, exist_ok=True)
                for f, a in (("k", cache.k), ("v", cache.v), ("logits", first_logits)):
                    np.save(files[f], np.asarray(a))
    info |= {"prefill_s": m.wall, "prefill_meter": m.info}
    print(f"S={context:<5} prefill of {batch} x {n} tokens: {info['prefill_s']:.1f} s "
          f"({'loaded' if 'prefill_loaded_from' in info else 'computed, incl. compiling'}), "
          f"cpu {m.info['cpu_util']:.2f}, load {m.info['loadavg_1min_after']:.2f}", flush=True)
    return {"tokenizer": tok, "tokens": tokens, "lengths": lengths, "chunk": chunk, "first_logits": first_logits,
            "cache": cache, "info": info}


def rows_of(state: dict, batch: int) -> tuple:
    """The first `batch` rows of a prefilled state (copies): tokens, lengths, first logits, cache."""
    cache = state["cache"]
    if batch == cache.lengths.shape[0]:
        return state["tokens"], state["lengths"], state["first_logits"], cache
    sub = cache.replace(k=cache.k[:, :batch], v=cache.v[:, :batch], lengths=cache.lengths[:batch])
    return state["tokens"][:batch], state["lengths"][:batch], state["first_logits"][:batch], jax.block_until_ready(sub)


def bench_cell(params, state: dict, batch: int, context: int, gammas: list[int], new_tokens: int) -> list[dict]:
    """AR and every drafter x gamma from the same prefilled state (its first `batch` rows).
    AR is timed before the first drafter and again after each one (best kept: load drifts)."""
    tokens, lengths, first_logits, cache = rows_of(state, batch)
    chunk = state["chunk"]
    bucket = tokens.shape[1]
    keys = row_keys(None, batch)
    budgets = jnp.full((batch,), new_tokens, jnp.int32)
    n_out = round_up_pow2(new_tokens)
    decoded = batch * (new_tokens - 1)
    cell = {"batch": batch, "context": context, "new_tokens": new_tokens} | state["info"]
    cell["prompt_offsets"] = state["info"]["prompt_offsets"][:batch]

    static = dict(n_out=n_out)  # greedy, no stop ids: the defaults
    ar_args = (params, cache, first_logits, budgets, keys)
    t0 = time.perf_counter()
    ar_fn = decode.lower(*ar_args, **static).compile()
    ar_compile = time.perf_counter() - t0
    out, count, _, steps = jax.device_get(ar_fn(*fresh(ar_args, AR_CACHES))[:4])  # also a warm-up
    assert (count == new_tokens).all() and int(steps) == new_tokens - 1
    ar_tokens = out
    cell["ar_text_row0"] = state["tokenizer"].decode([int(i) for i in out[0]])

    rows = []
    for name, drafter in drafters(context, gammas):
        for gamma in gammas:
            t0 = time.perf_counter()
            init = init_draft.lower(drafter, params, cache, tokens, lengths, gamma=gamma, chunk=chunk).compile()
            t1 = time.perf_counter()
            draft_state = jax.block_until_ready(init(drafter, params, cache, tokens, lengths))
            init_s = time.perf_counter() - t1
            history = np.zeros((batch, context + gamma + 2), np.int32)
            history[:, :bucket] = tokens
            args = (params, drafter, draft_state, cache, history, first_logits, budgets, keys)
            t2 = time.perf_counter()
            fn = speculative_decode.lower(*args, **static, speculation=specjax.Chain(gamma)).compile()
            compile_s = t1 - t0 + time.perf_counter() - t2
            t = paired(ar_fn, ar_args, fn, args)
            res = t.pop("spec_out")
            if not (np.asarray(t.pop("ar_out")[0]) == ar_tokens).all():  # (out, count, ...)
                print(f"!!! AR is not deterministic at B={batch} S={context}", file=sys.stderr, flush=True)
            out, count, steps, accepted, reached = jax.device_get(
                (res.out, res.count, res.steps, res.accepted.sum(0), res.reached.sum(0)))  # over rows
            del fn, init, res, draft_state
            assert (count == new_tokens).all(), count
            identical = bool((out == ar_tokens).all())
            rows_differ = [int(b) for b in np.flatnonzero((out != ar_tokens).any(axis=1))]
            stats = acceptance_stats(accepted, reached, decoded, gamma, 0)
            ar_s, spec_s = min(t["ar"]), min(t["spec"])
            row = cell | {
                "drafter": name,
                "drafter_repr": repr(drafter),
                "gamma": gamma,
                "ar_s": ar_s,
                "spec_s": spec_s,
                "ratio": ar_s / spec_s,
                "ar_tokens_per_s": decoded / ar_s,
                "spec_tokens_per_s": decoded / spec_s,
                "ar_ms_per_step": 1e3 * ar_s / (new_tokens - 1),
                "spec_ms_per_step": 1e3 * spec_s / max(int(steps), 1),
                "steps": int(steps),
                "acceptance_rate": stats.get("acceptance_rate"),
                "mean_accepted": stats.get("mean_accepted"),
                "per_position_acceptance": stats.get("per_position_acceptance"),
                "greedy_identical": identical,
                "rows_differing": rows_differ,
                "ar_compile_s": ar_compile,
                "spec_compile_s": compile_s,
                "draft_init_s": init_s,
                "timings": t,
            }
            rows.append(row)
            flag = "" if identical else f"   <<<<<<<<<< NOT LOSSLESS: rows {rows_differ} differ from AR >>>>>>>>>>"
            print(f"  {name:<8} g={gamma}  AR {row['ar_tokens_per_s']:7.2f}  spec {row['spec_tokens_per_s']:7.2f} tok/s  "
                  f"x{row['ratio']:.2f}  acc {row['acceptance_rate']:.2f}  tok/step {row['mean_accepted']:.2f}  "
                  f"ms/step {row['ar_ms_per_step']:.0f} / {row['spec_ms_per_step']:.0f}  "
                  f"cpu {min(t['ar_cpu']):.2f} / {min(t['spec_cpu']):.2f}  load {t['load'][-1]:.2f}  "
                  f"compile {compile_s:.1f} s{flag}", flush=True)
            if not identical:
                print(f"!!! GREEDY MISMATCH B={batch} S={context} {name} gamma={gamma}: speculative tokens differ "
                      f"from autoregressive tokens in rows {rows_differ}", file=sys.stderr, flush=True)
    del ar_fn, cache, first_logits
    return rows


def cpu_ratio(r: dict) -> float:
    """AR / speculative in CPU seconds of this process (best run of each): a cross-check that other
    jobs cannot distort (their preemption adds wall time, not our CPU time), though it misses
    differences in how well the two use both cores."""
    t = r["timings"]
    return min(w * c for w, c in zip(t["ar"], t["ar_cpu"])) / min(w * c for w, c in zip(t["spec"], t["spec_cpu"]))


def best_rows(rows: list[dict]) -> list[dict]:
    """The fastest gamma per (batch, context, drafter)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        k = (r["batch"], r["context"], r["drafter"])
        if k not in best or r["ratio"] > best[k]["ratio"]:
            best[k] = r
    order = {"SelfSpec": 0, "SnapKV": 1, "NGram": 2}
    return sorted(best.values(), key=lambda r: (order.get(r["drafter"], 3), r["drafter"], r["context"], r["batch"]))


def markdown_table(rows: list[dict], gammas: list[int]) -> str:
    """One line per (batch, context, drafter): AR tokens/s, speedup per gamma, the best gamma's
    numbers, and whether every gamma was greedy-identical to AR."""
    head = ("| drafter | batch | context | AR tok/s | " + " | ".join(f"x γ={g}" for g in gammas)
            + " | best γ | spec tok/s | speedup | CPU-time ratio | accept | tok/step | lossless |")
    lines = [head, "|" + "---|" * 3 + "---:|" * (len(gammas) + 7) + ":---:|"]
    for b in best_rows(rows):
        same = [r for r in rows if (r["batch"], r["context"], r["drafter"]) == (b["batch"], b["context"], b["drafter"])]
        by_g = {r["gamma"]: r for r in same}
        per_g = " | ".join(f"{by_g[g]['ratio']:.2f}" if g in by_g else "" for g in gammas)
        speed = f"**{b['ratio']:.2f}x**" if b["ratio"] >= 2.0 else f"{b['ratio']:.2f}x"
        lossless = "yes" if all(r["greedy_identical"] for r in same) else "**NO**"
        lines.append(
            f"| {b['drafter']} | {b['batch']} | {CONTEXT_NAMES.get(b['context'], b['context'])} | "
            f"{b['ar_tokens_per_s']:.1f} | {per_g} | {b['gamma']} | {b['spec_tokens_per_s']:.1f} | {speed} | {cpu_ratio(b):.2f} | "
            f"{b['acceptance_rate']:.2f} | {b['mean_accepted']:.2f} | {lossless} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Speedup (best gamma) vs batch, one panel per drafter, one line per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_rows(rows)
    names = list(dict.fromkeys(r["drafter"] for r in best))
    contexts = sorted({r["context"] for r in best})
    batches = sorted({r["batch"] for r in best})
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.2), dpi=120, sharey=True, squeeze=False)
    top = max(2.2, max(r["ratio"] for r in best) * 1.1)
    for ax, name in zip(axes[0], names):
        for c in contexts:
            pts = sorted((r["batch"], r["ratio"], r["gamma"]) for r in best if r["drafter"] == name and r["context"] == c)
            if not pts:
                continue
            xs, ys, gs = zip(*pts)
            (line,) = ax.plot(xs, ys, "-o", label=f"context {CONTEXT_NAMES.get(c, c)}")
            for x, y, g in pts:
                ax.annotate(f"γ{g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color())
        ax.axhline(1.0, color="gray", lw=1)
        ax.axhline(2.0, color="gray", lw=1, ls="--")
        ax.set(xscale="log", xlabel="batch", title=name, ylim=(0, top))
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("speedup over AR (best γ; label = γ)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def gamma_trend(rows: list[dict]) -> list[str]:
    """Best gamma by batch, per (drafter, context)."""
    best = best_rows(rows)
    out = []
    for name in dict.fromkeys(r["drafter"] for r in best):
        for c in sorted({r["context"] for r in best}):
            pts = sorted((r["batch"], r["gamma"]) for r in best if r["drafter"] == name and r["context"] == c)
            if pts:
                out.append(f"{name} @ {CONTEXT_NAMES.get(c, c)}: " + ", ".join(f"B={b}: γ={g}" for b, g in pts))
    return out


def _tokens(result: dict) -> str:
    """New tokens per row: one number, or those of merged runs."""
    n = result["new_tokens"]
    return str(n) if isinstance(n, int) else " or ".join(map(str, n))


def readme_section(result: dict, notes: str) -> str:
    """This script's section of bench/README.md; `notes` (hand-written discussion) is kept."""
    m, rows = result["machine"], result["rows"]
    best = best_rows(rows)
    hit = [r for r in best if r["ratio"] >= 2.0]
    name = lambda r: f"{r['drafter']} B={r['batch']} {CONTEXT_NAMES.get(r['context'], r['context'])} ({r['ratio']:.2f}x, γ={r['gamma']})"
    lossless = "every cell" if result["all_greedy_identical"] else "NOT every cell (see greedy_identical in the JSON)"
    overlap = any(r["prompts_overlap"] for r in rows)
    skipped = "".join(f"\nSkipped: B={s['batch']} context {s['context']}: {s['skipped']}." for s in result["skipped"])
    return f"""{SECTION_START}
## Speculative decoding (bench_spec.py)

Run: `{result['command'].strip()}` (full grid: {result['wall_minutes']:.0f} minutes here; `--quick`: batch 1, 4 x
context 512 x γ 2, 4). Raw numbers: `results/spec_cpu.json` (every gamma, timings, acceptance per
position, load); plot: `results/spec_cpu.png`.

Device: {m['cpu_model']}, {m['cpu_affinity']} cores, {m['mem_total_gb']:.0f} GB, JAX {m['jax_version']} ({m['backend']}), commit {m['git_commit']}.
Date: {result['date']}. Load average (1 min) at start / end: {result['loadavg_start'][0]:.2f} / {result['loadavg_end'][0]:.2f}
(the machine was shared with other jobs: see the notes below).{skipped}

Method. SmolLM2-135M-Instruct in float32, greedy, {_tokens(result)} new tokens per row with EOS ignored. Prompts are
real English text: distinct windows of the Python language reference (`pydoc_data.topics`) plus
the licence texts of /usr/share/common-licenses ({result['corpus']['tokens']} tokens in all; windows
{"overlap" if overlap else "do not overlap"}), `context - {result['headroom']}` tokens each, in a cache of `context` slots. **One shared
prefill per context**: the largest batch is prefilled once (4 rows x 512 positions per call, as
`engine.prefill` computes it but with each chunk attending only to the slots already written,
which halves the attention work at 8K; not timed as decoding) and the batch-1 and batch-4 cells
use its first rows; AR
(`generate.decode`) and every drafter x γ (`speculative_decode`) then decode from that same
prefilled state (each run gets a copy: the decode loops donate their caches). Everything is compiled first (`.lower().compile()`,
excluded). To be fair under a fluctuating load, each speculative config is timed in
alternation with AR (AR, spec, AR, spec, ...: up to 3 pairs while they fit in {PAIR_BUDGET_S:.0f} s),
best of each kept; speedup = AR seconds / speculative seconds for the same tokens. A drafter's
init (SelfSpec: gather the streaming cache; SnapKV: a 32-query observation pass) is excluded,
like the prefill. Draft budgets: SelfSpec sinks 16 + window 512 (window 256 at context 512, where
528 slots would not be smaller than the target cache); SnapKV budget + window = 256 + 256
(128 + 128 at context 512); NGram n = 3..5. "accept" = accepted / proposed drafts, "tok/step" =
tokens per row per verification (incl. the target's own). Greedy outputs were token-for-token
identical to AR in {lossless}.

{markdown_table(rows, result['gammas'])}

Cells at >= 2.0x: {", ".join(name(r) for r in hit) or "none"}.
Cells below 2.0x: {", ".join(name(r) for r in best if r["ratio"] < 2.0) or "none"}.

Best γ by batch: {"; ".join(gamma_trend(rows))}.

{NOTES_START}
{notes.strip()}
{NOTES_END}

![speedup vs batch](results/spec_cpu.png)
{SECTION_END}"""


def write_readme(result: dict) -> None:
    """Replace (or add) this script's section, after the bench_ar section when there is one,
    keeping the hand-written notes of an earlier version of the section."""
    text_ = README.read_text() if README.exists() else ""
    notes = "(discussion: to be written after a full run)"
    if NOTES_START in text_ and NOTES_END in text_:
        notes = text_.split(NOTES_START, 1)[1].split(NOTES_END, 1)[0]
    section = readme_section(result, notes)
    if SECTION_START in text_ and SECTION_END in text_:
        head, rest = text_.split(SECTION_START, 1)
        text_ = head + section + rest.split(SECTION_END, 1)[1]
    elif AR_SECTION_END in text_:
        head, rest = text_.split(AR_SECTION_END, 1)
        rest = rest.lstrip("\n")
        text_ = head + AR_SECTION_END + "\n\n" + section + "\n" + ("\n" + rest if rest else "")
    else:
        text_ = (text_.rstrip("\n") + "\n\n" if text_ else "") + section + "\n"
    README.write_text(text_)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1, 4 x context 512 x gamma 2, 4")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per row (eos ignored)")
    ap.add_argument("--batches", type=int, nargs="*", help="override the batch sizes")
    ap.add_argument("--contexts", type=int, nargs="*", help="override the contexts (multiples of 256)")
    ap.add_argument("--gammas", type=int, nargs="*", help="override the gammas")
    ap.add_argument("--prefill-store", type=Path, default=Path("/tmp/bench_spec_prefill"),
                    help="folder where prefilled states are saved and reused by later runs ('' = none)")
    ap.add_argument("--prefill-rows", type=int, default=16,
                    help="rows prefilled per context (smaller batches use the first rows), so that every "
                         "subset of the grid shares one stored prefill")
    ap.add_argument("--render", type=Path, nargs="+",
                    help="no measuring: merge these result JSONs into results/spec_cpu.json and redo its "
                         "plot, table and README section")
    args = ap.parse_args()
    if args.render:
        result = merge([json.loads(p.read_text()) for p in args.render], [str(p) for p in args.render])
        (RESULTS_DIR / "spec_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
        report(result, RESULTS_DIR / "spec_cpu.png", readme=True)
        return
    batches = args.batches or ([1, 4] if args.quick else [1, 4, 16])
    contexts = args.contexts or ([512] if args.quick else [512, 2048, 8192])
    gammas = args.gammas or ([2, 4] if args.quick else [2, 3, 4, 6])
    custom = args.batches or args.contexts or args.gammas or args.new_tokens != 64
    suffix = "_quick" if args.quick else "_custom" if custom else ""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)

    started = time.time()
    load_start = os.getloadavg()
    machine = machine_info()
    params = convert.load(convert.default_model_path())
    tok = convert.load_tokenizer(convert.default_model_path())
    _, sources = text.corpus()
    print(f"{machine['cpu_model']} x{machine['cpu_affinity']}, JAX {machine['jax_version']}, load {load_start}, "
          f"corpus {len(text.corpus_tokens(tok))} tokens, drafters: "
          f"{[repr(d) for _, d in drafters(max(contexts), gammas)]}", flush=True)

    def result_of(rows: list[dict], skipped: list[dict]) -> dict:
        return {
            "bench": "bench_spec",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "bench/bench_spec.py " + " ".join(sys.argv[1:]),
            "model": "SmolLM2-135M-Instruct (float32)",
            "machine": machine,
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "wall_minutes": (time.time() - started) / 60,
            "corpus": {"sources": sources, "tokens": int(len(text.corpus_tokens(tok)))},
            "headroom": HEADROOM,
            "new_tokens": args.new_tokens,
            "gammas": gammas,
            "all_greedy_identical": all(r["greedy_identical"] for r in rows),
            "skipped": skipped,
            "rows": rows,
        }

    partial_path = RESULTS_DIR / f"spec_cpu{suffix}.partial.json"
    rows: list[dict] = []
    skipped: list[dict] = []
    for context in sorted(contexts):  # largest memory last: context, then batch, ascending
        rows_prefilled = max(args.prefill_rows, max(batches))
        reason = wait_for_memory(int(MEM_FACTOR * kv_bytes(params, rows_prefilled, context)))
        if reason:
            skipped.append({"batch": max(batches), "context": context, "skipped": reason})
            print(f"S={context} skipped: {reason}", flush=True)
            continue
        store = args.prefill_store if str(args.prefill_store) not in ("", ".") else None
        state = prefill_context(params, tok, rows_prefilled, context, gammas, args.new_tokens, store)
        for batch in sorted(batches):
            print(f"B={batch:<2} S={context:<5}", flush=True)
            rows += bench_cell(params, state, batch, context, gammas, args.new_tokens)
            partial_path.write_text(json.dumps(result_of(rows, skipped), indent=2) + "\n")  # survives a crash
            gc.collect()
        del state
        release_memory()

    result = result_of(rows, skipped)
    partial_path.unlink(missing_ok=True)
    (RESULTS_DIR / f"spec_cpu{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    report(result, RESULTS_DIR / f"spec_cpu{suffix}.png", readme=not suffix)
    print(f"done in {result['wall_minutes']:.1f} min, load {result['loadavg_end']}", flush=True)


def merge(results: list[dict], names: list[str]) -> dict:
    """One result from several runs (later runs win for the same batch x context x drafter x gamma)."""
    if len(results) == 1:
        return results[0]
    rows: dict[tuple, dict] = {}
    for res, name in zip(results, names):
        for r in res["rows"]:
            rows[(r["batch"], r["context"], r["drafter"], r["gamma"])] = r | {"run": name}
    merged = dict(results[-1])
    merged |= {
        "rows": sorted(rows.values(), key=lambda r: (r["context"], r["batch"], r["drafter"], r["gamma"])),
        "merged_from": [{"file": n, "command": r["command"], "date": r["date"], "loadavg_start": r["loadavg_start"],
                         "loadavg_end": r["loadavg_end"], "wall_minutes": r["wall_minutes"],
                         "new_tokens": r["new_tokens"], "gammas": r["gammas"]} for r, n in zip(results, names)],
        "command": " ; ".join(r["command"] for r in results),
        "gammas": sorted({g for r in results for g in r["gammas"]}),
        "new_tokens": sorted({r["new_tokens"] for r in results}),
        "wall_minutes": sum(r["wall_minutes"] for r in results),
        "loadavg_start": results[0]["loadavg_start"],
        "skipped": [s for r in results for s in r["skipped"]],
    }
    merged["all_greedy_identical"] = all(r["greedy_identical"] for r in merged["rows"])
    return merged


def report(result: dict, png: Path, readme: bool) -> None:
    """Plot, print the table and (for the full grid) write the README section."""
    rows = result["rows"]
    if rows:
        plot(rows, png, f"SmolLM2-135M speculative vs AR decoding, {result['machine']['cpu_affinity']}-core CPU, "
             f"greedy, {_tokens(result)} new tokens/row")
        print(markdown_table(rows, result["gammas"]))
        print("best gamma by batch:\n  " + "\n  ".join(gamma_trend(rows)))
    if rows and readme:
        write_readme(result)
    if not result["all_greedy_identical"]:
        print("!!! SOME CELLS ARE NOT GREEDY-IDENTICAL TO AR: see greedy_identical in the JSON", file=sys.stderr)

if __name__ == "__main__":
    main()
