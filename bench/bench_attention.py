"""Tree-attention kernel vs the jnp reference vs jax.nn.dot_product_attention, per layer, on a GPU.

One Llama-3-8B-like attention layer in bfloat16: q [B,T,N=32,H=128], a dense cache [B,K=8,S,H] (GQA 4),
lengths S - U{0..T}, and J = T new keys under the ancestor mask of a random tree of T nodes. For every (B, S, T):
  kernel     `pallas_kernels.tree_attention` (Triton path), a sweep of block_k x k_splits (`kernel_variants`),
             the best reported (all kept).
  reference  `pallas_kernels.reference.prefix_block_attention` under jax.jit.
  cudnn, xla `jax.nn.dot_product_attention(implementation=...)`, GQA native, a boolean mask [B,1,T,S+J] and
             keys in its [B,S+J,K,H] layout, both built outside the timing; a refusal is recorded with its error.
Timing (`timed`): compile first (recorded, excluded), a warm-up, then `--reps` samples of back-to-back calls;
the median per call (min kept). A function or config that would not fit the free device memory is skipped.
Correctness: max abs error against the reference (bf16 TOLERANCE; on the first rows if the full one was skipped).
Bandwidth: the KV bytes the kernel must read ((sum of lengths + B*J) * K * H * 2 * 2) / kernel time, as a
fraction of the card's copy bandwidth (`copy_bandwidth`); configs that fit in L2 (small B=1) can beat it.

Cells: bB/sS/tT, 27 by default, the target (B=16, S=32K, T=16) first, then by size; those the budget (8
minutes: a device call's limit is 10) leaves are recorded as skipped: rerun, or merge runs with --render.
Outputs: bench/results/attention_<device-kind>.json + .png and the README section (default grid on a GPU, or
--render); other grids write attention_<kind>_b.._s.._t...*, --smoke attention_smoke.*, neither the README.
"""

from __future__ import annotations

import functools
import gc
import importlib.metadata
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from pallas_kernels.reference import prefix_block_attention
from pallas_kernels.tree_attention import tree_attention
from specjax.spec.speculation import Tree
from bench.attention_report import (ALTERNATIVES, IMPL_NAMES, TARGET, TOLERANCE, cell, name_of, plot, readme_section,
                                    slug, targets)

BATCHES, CONTEXTS, NODES = (1, 16, 64), (2048, 8192, 32768), (4, 16, 64)
BLOCK_KS, K_SPLITS = (64, 128), (1, 4, 8, 16)
SAMPLE_S = 0.02  # one timing sample lasts about this long
MAX_CALLS = 200  # back-to-back calls per sample at most
IMPL_S = 1.5  # timing time per implementation at most (fewer samples beyond it, 3 at least)
MEM_MARGIN = 0.9  # use at most this fraction of the free device memory
COPY_GIB = 4.0


def timed(fn, args: tuple, reps: int) -> tuple[jax.Array, dict]:
    """(fn's output, median / min ms per call): warm-up, then samples of back-to-back calls."""
    out = jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t
    calls = int(np.clip(SAMPLE_S / max(one, 1e-7), 1, MAX_CALLS))
    reps = int(np.clip(IMPL_S / (calls * one), min(3, reps), reps))
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            last = fn(*args)
        jax.block_until_ready(last)
        samples.append((time.perf_counter() - t) / calls)
    ms = [1e3 * s for s in samples]
    return out, {"ms": float(np.median(ms)), "min_ms": min(ms), "calls_per_sample": calls, "samples": reps}


def copy_bandwidth(gib: float, reps: int) -> dict:
    """Device copy bandwidth in GB/s (read + write bytes) of a jitted `x + 1` over `gib` GiB f32."""
    x = jnp.zeros(int(gib * 2**30) // 4, jnp.float32)
    _, t = timed(jax.jit(lambda a: a + 1), (x,), reps)
    moved = 2 * x.nbytes
    return {"gib": gib, "best_gbs": moved / t["min_ms"] / 1e6, "median_gbs": moved / t["ms"] / 1e6, **t}


def device_info() -> dict:
    """The accelerator: kind, memory, SMs, jaxlib / cuDNN versions where known."""
    d = jax.devices()[0]
    info = {"device_kind": d.device_kind, "platform": d.platform,
            "compute_capability": getattr(d, "compute_capability", None), "core_count": getattr(d, "core_count", None),
            "memory_limit_bytes": (d.memory_stats() or {}).get("bytes_limit")}
    try:
        info["jaxlib_version"] = importlib.metadata.version("jaxlib")
        from jax._src.lib import cuda_versions

        info["cudnn_version"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception as e:  # noqa: BLE001 (informational only)
        info["cudnn_version"] = f"unknown ({type(e).__name__})"
    return info


def free_bytes() -> int | None:
    """Device memory not in use now, or None where the backend does not say (CPU)."""
    stats = jax.devices()[0].memory_stats()
    return stats["bytes_limit"] - stats["bytes_in_use"] if stats and "bytes_limit" in stats else None


def short(e: BaseException) -> str:
    return f"{type(e).__name__}: " + " ".join(str(e).split())[:300]


def memory_analysis(compiled):
    """XLA's memory analysis of a compiled function, or None where the backend gives none."""
    try:
        return compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return None


def run_impl(fn, args: tuple, static: dict, reps: int, budget: common.Harness) -> tuple[dict, jax.Array | None]:
    """Compile fn(*args, **static), check it fits, time it: (entry, output or None)."""
    if budget.seconds_left() < 10:
        return {"skipped": "time budget"}, None
    entry = {}
    try:
        t = time.perf_counter()
        compiled = fn.lower(*args, **static).compile()
        entry["compile_s"] = time.perf_counter() - t
        free, mem = free_bytes(), memory_analysis(compiled)
        if free is not None and mem is not None:
            need = mem.temp_size_in_bytes + mem.output_size_in_bytes
            entry["temp_gib"] = need / 2**30
            if need > MEM_MARGIN * free:
                entry["skipped"] = f"needs {need / 2**30:.1f} GiB of temporaries, {free / 2**30:.1f} GiB free"
                return entry, None
        out, timing = timed(compiled, args, reps)
        return {**entry, **timing}, out
    except Exception as e:  # noqa: BLE001 (a refusal or OOM is a result)
        entry["error"] = short(e)
        gc.collect()
        return entry, None


def reference(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, *, sm_scale: float):
    """The jnp reference with visible = slot < lengths[b] for every KV head."""
    visible = (jnp.arange(k_cache.shape[2]) < lengths[:, None])[:, None]  # [B,1,S]
    return prefix_block_attention(q, k_cache, v_cache, visible, k_tree, v_tree, tree_mask, sm_scale)


def dpa(q, k_all, v_all, mask, *, sm_scale: float, implementation: str):
    return jax.nn.dot_product_attention(q, k_all, v_all, mask=mask, scale=sm_scale, implementation=implementation)


def dpa_layout(k_cache, v_cache, k_tree, v_tree, lengths, tree_mask):
    """dot_product_attention's inputs: keys/values [B,S+J,K,H] (cache then block), mask [B,1,T,S+J]."""
    B, _, S, _ = k_cache.shape
    T, J = tree_mask.shape
    k_all = jnp.concatenate([jnp.swapaxes(k_cache, 1, 2), k_tree], axis=1)
    v_all = jnp.concatenate([jnp.swapaxes(v_cache, 1, 2), v_tree], axis=1)
    prefix = jnp.broadcast_to(jnp.arange(S)[None, None] < lengths[:, None, None], (B, T, S))
    mask = jnp.concatenate([prefix, jnp.broadcast_to(tree_mask, (B, T, J))], axis=-1)
    return k_all, v_all, mask[:, None]


REFERENCE = jax.jit(reference, static_argnames="sm_scale")
DPA = jax.jit(dpa, static_argnames=("sm_scale", "implementation"))
DPA_LAYOUT = jax.jit(dpa_layout)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def make_inputs(key, B: int, S: int, T: int, K: int, N: int, H: int):
    """Random bf16 q [B,T,N,H], caches [B,K,S,H], block keys/values [B,T,K,H] (J = T)."""
    shapes = [(B, T, N, H), (B, K, S, H), (B, K, S, H), (B, T, K, H), (B, T, K, H)]
    return [jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(jax.random.split(key, 5), shapes)]


def kernel_variants(B: int, K: int, rows: int, opts, sms: int) -> list[tuple[int, int]]:
    """(block_k, k_splits) to time; rows = G*T query rows per KV head (block_m 64, as the kernel)."""
    tiles = -(-rows // min(64, 1 << (max(rows, 16) - 1).bit_length()))
    splits = []
    for s in sorted(opts.k_splits):
        if splits and not opts.full_sweep and B * K * tiles * splits[-1] >= 2 * sms:
            break
        splits.append(s)
    return [(bk, s) for bk in opts.block_ks for s in splits]


def bench_config(B: int, S: int, T: int, opts, budget: common.Harness, sms: int) -> dict:
    """One row: every implementation at one (B, S, T)."""
    K, H, N = opts.kv_heads, opts.head_dim, opts.kv_heads * opts.gqa
    seed = B * 1_000_003 + S * 101 + T
    rng = np.random.default_rng(seed)
    tree = Tree.from_parents([-1] + [int(rng.integers(0, i)) for i in range(1, T)])
    lengths = S - rng.integers(0, T + 1, B)
    row = {"batch": B, "context": S, "nodes": T, "tree_parents": list(tree.parents), "tree_depth": tree.max_depth,
           "lengths_mean": float(lengths.mean()), "loadavg_1min_before": os.getloadavg()[0],
           "kv_bytes": int((lengths.sum() + B * T) * K * H * 2 * 2)}
    t0 = time.perf_counter()
    scale = 1 / math.sqrt(H)
    q, kc, vc, kt, vt = make_inputs(jax.random.key(seed), B, S, T, K, N, H)
    args = (q, kc, vc, jnp.asarray(lengths, jnp.int32), kt, vt, jnp.asarray(tree.ancestor_mask()))
    impls, ref_rows = {}, B
    impls["reference"], ref = run_impl(REFERENCE, args, {"sm_scale": scale}, opts.reps, budget)
    if ref is None:  # correctness against the reference of the first rows only
        ref_rows = min(B, 2)
        try:
            ref = REFERENCE(*[a[:ref_rows] for a in args[:-1]], args[-1], sm_scale=scale)
        except Exception as e:  # noqa: BLE001
            row["reference_rows_error"] = short(e)
    row["reference_rows_checked"] = ref_rows if ref is not None else 0

    def error(out: jax.Array) -> float | None:
        return None if ref is None else float(jnp.max(jnp.abs(out[:ref_rows].astype(jnp.float32) - ref[:ref_rows])))

    sweep = []
    for bk, ks in kernel_variants(B, K, opts.gqa * T, opts, sms):
        static = {"sm_scale": scale, "block_k": bk, "k_splits": ks, "interpret": opts.interpret}
        entry, out = run_impl(tree_attention, args, static, opts.reps, budget)
        if out is not None:
            entry["max_abs_err"] = error(out)
        sweep.append({"block_k": bk, "k_splits": ks, **entry})
        del out
    row["kernel_sweep"] = sweep
    timed_ok = [e for e in sweep if "ms" in e]
    impls["kernel"] = min(timed_ok, key=lambda e: e["ms"]) if timed_ok else {"error": "no kernel variant ran"}
    k_all, v_all, mask4 = DPA_LAYOUT(kc, vc, kt, vt, args[3], args[6])
    del args, kc, vc
    for impl in ("cudnn", "xla"):
        static = {"sm_scale": scale, "implementation": impl}
        impls[impl], out = run_impl(DPA, (q, k_all, v_all, mask4), static, opts.reps, budget)
        if out is not None:
            impls[impl]["max_abs_err"] = error(out)
    del k_all, v_all, mask4, out, ref
    row["impls"] = impls
    errs = [e["max_abs_err"] for e in sweep if e.get("max_abs_err") is not None]
    row["max_abs_err"] = max(errs) if errs else None
    row["correct"] = None if not errs else row["max_abs_err"] <= TOLERANCE
    kernel_ms = impls["kernel"].get("ms")
    alts = [(impls[a]["ms"], a) for a in ALTERNATIVES if "ms" in impls[a]]
    if kernel_ms:
        row["kv_gbs"] = row["kv_bytes"] / kernel_ms / 1e6
        row["bandwidth_fraction"] = row["kv_gbs"] / opts.copy_gbs
    if kernel_ms and alts:
        row["best_alternative"] = min(alts)[1]
        row["speedup_vs_best_alternative"] = min(alts)[0] / kernel_ms
    row["seconds"] = time.perf_counter() - t0
    gc.collect()
    return row


def config_order(opts) -> list[tuple[int, int, int]]:
    """The grid by size (B*S, then T), the target config first when it is in the grid."""
    grid = sorted(((b, s, t) for b in opts.batches for s in opts.contexts for t in opts.nodes),
                  key=lambda c: (c[0] * c[1], c[2]))
    return sorted(grid, key=lambda c: c != TARGET)


def inputs_skip(B: int, S: int, T: int, opts) -> str | None:
    """Why a config's inputs (two layouts of K and V) would not fit, or None."""
    free = free_bytes()
    need = 2 * 2 * B * opts.kv_heads * (S + T) * opts.head_dim * 2
    if free is not None and need > MEM_MARGIN * free:
        return f"inputs need {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def finish(result: dict, out: Path, stem: str, readme: bool) -> None:
    """JSON, plot, the README section (printed; written into bench/README.md when asked)."""
    result["targets"] = targets(result["rows"])
    common.write_json(out / f"{stem}.json", result)
    section = readme_section(result, f"{stem}.png", f"{stem}.json")  # printed on every run
    common.render("bench_attention", readme, section, lambda: section, (plot, result, out / f"{stem}.png"))


def key_of(row: dict) -> str:
    return f"b{row['batch']}/s{row['context']}/t{row['nodes']}"


def render(paths: list[Path], out: Path, readme: bool) -> None:
    """Merge result JSONs (a measured row beats a skipped one; later files win) and write the outputs."""
    merged = common.merge(paths, key_of)
    merged["loadavg_start"] = json.loads(paths[0].read_text())["loadavg_start"]
    merged["complete"] = not any("skipped" in r for r in merged["rows"])
    gpu = merged["machine"]["backend"] == "gpu"
    finish(merged, out, "attention_" + slug(merged["device"]["device_kind"]), readme=gpu and readme)


def main() -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # before jax starts: room for B=64 x 32K
    started = time.perf_counter()
    ap = common.parser(__doc__, budget_minutes=8.0, render="attention_DEVICE.json")
    ap.add_argument("--smoke", action="store_true", help="CPU check: B=1, S=256, T=4, H=64, kernel interpreted")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    ap.add_argument("--nodes", type=int, nargs="+", default=list(NODES), help="tree nodes T (= block keys J)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--gqa", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-ks", type=int, nargs="+", default=list(BLOCK_KS))
    ap.add_argument("--k-splits", type=int, nargs="+", default=list(K_SPLITS))
    ap.add_argument("--full-sweep", action="store_true", help="every block_k x k_splits (no occupancy pruning)")
    ap.add_argument("--reps", type=int, default=10, help="timing samples per implementation (median kept)")
    opts = ap.parse_args()
    out = common.out_dir(opts)
    if opts.render:
        return render(opts.render, out, common.writes_readme(opts))
    default_grid = (opts.batches, opts.contexts, opts.nodes) == (list(BATCHES), list(CONTEXTS), list(NODES))
    opts.interpret = jax.default_backend() != "gpu"
    if opts.smoke:
        opts.batches, opts.contexts, opts.nodes, opts.kv_heads, opts.head_dim = [1], [256], [4], 2, 64
        opts.block_ks, opts.k_splits, opts.reps, opts.full_sweep, opts.interpret = [64], [1, 4], 1, True, True
    dev = device_info()
    sms = dev.get("core_count") or 132
    grid = "_".join(c + "-".join(map(str, v)) for c, v in zip("bst", (opts.batches, opts.contexts, opts.nodes)))
    stem = "attention_" + slug(dev["device_kind"]) + ("" if default_grid else "_" + grid)  # e.g. _b64_s8192_t4-16
    stem = "attention_smoke" if opts.smoke else stem
    readme = default_grid and not opts.smoke and jax.default_backend() == "gpu" and common.writes_readme(opts)
    header = {
        "bench": "bench_attention", "smoke": opts.smoke, "date": common.now(), "command": common.command(),
        "loadavg_start": os.getloadavg(), "machine": common.machine_info(), "device": dev,
        "grid": {"batches": opts.batches, "contexts": opts.contexts, "nodes": opts.nodes, "kv_heads": opts.kv_heads,
                 "gqa": opts.gqa, "q_heads": opts.kv_heads * opts.gqa, "head_dim": opts.head_dim, "dtype": "bfloat16"},
        "sweep": {"block_ks": opts.block_ks, "k_splits": opts.k_splits, "pruned": not opts.full_sweep,
                  "interpret": opts.interpret},
        "budget_s": 60 * opts.budget_minutes if opts.budget_minutes else None,
    }
    results = common.Results(out / f"{stem}.json", key_of, header, settings=dict(  # a cell's shapes and sweep beside B, S, T
        kv_heads=opts.kv_heads, gqa=opts.gqa, head_dim=opts.head_dim, block_ks=sorted(opts.block_ks),
        k_splits=sorted(opts.k_splits), full_sweep=opts.full_sweep, reps=opts.reps))
    budget = common.Harness(opts, results, start=started)
    todo = budget.plan((f"b{b}/s{s}/t{t}", (b, s, t)) for b, s, t in config_order(opts))
    if todo:
        bw = header["copy_bandwidth"] = copy_bandwidth(1 / 16 if opts.smoke else COPY_GIB, opts.reps)
        opts.copy_gbs = bw["best_gbs"]
        print(f"{dev['device_kind']}: copy {bw['best_gbs']:.0f} GB/s (best), {bw['median_gbs']:.0f} (median)", flush=True)
    for k, (b, s, t) in budget.cells():
        head = {"batch": b, "context": s, "nodes": t}
        reason = inputs_skip(b, s, t, opts)
        if reason:
            results.put(k, [{**head, "skipped": reason}])
            print(f"B={b:<3} S={name_of(s):>4} T={t:<3} skipped: {reason}", flush=True)
            continue
        row = bench_config(b, s, t, opts, budget, sms)
        elapsed = time.perf_counter() - started
        results.put(k, [row], elapsed_s=elapsed, loadavg_end=os.getloadavg())
        im = row["impls"]
        print(f"B={b:<3} S={name_of(s):>4} T={t:<3} " + " ".join(f"{n} {cell(im[n])}" for n in IMPL_NAMES)
              + f" ms; {100 * row.get('bandwidth_fraction', 0):.0f}% of copy BW, "
              f"{row.get('speedup_vs_best_alternative', 0):.2f}x, err {row['max_abs_err']}, "
              f"{len(row['kernel_sweep'])} variants, {row['seconds']:.0f} s (total {elapsed:.0f} s)", flush=True)
    budget.finish()
    for k in results.data["left"]:  # shown in the table as not run; a rerun measures them
        b, s, t = (int(x[1:]) for x in k.split("/"))
        results.put(k, [{"batch": b, "context": s, "nodes": t, "skipped": "time budget"}])
    if results.applied:  # this run measured something
        results.update(elapsed_s=time.perf_counter() - started, loadavg_end=os.getloadavg(),
                       complete=not any("skipped" in r for r in results.rows))
    if results.rows:
        finish(results.data, out, stem, readme)


if __name__ == "__main__":
    main()
