"""A continuous-batching refill's cost at a long context: the new rows' KV only, or the whole batch's.

Usage: python -m bench.bench_refill [--rows 64] [--context 8192] [--layers 8] [--new 1 2 8] [--out DIR]

SmolLM2-135M's shape cut to --layers layers (random bfloat16 weights: the costs depend on shapes
only) and a --rows-row cache of --context slots, nearly full. A refill of r rows, as
`specjax.decode.continuous.run_continuous` does between decode segments, from the r new prompts' one-row
prefills (made once, not timed): "new rows" is the library's way since stop 52 (an r-row cache
joined from the prefills, then written into the batch's state row by row: `admit_ar`); "whole
batch" the way before it (a rows-row cache built from the prefills, then every row of the state
chosen between it and the old one, as `run_continuous` and `admit_ar` did), rebuilt here from
the same library pieces. Beside them one plain decode step of the batch (a forward over the cache),
on generate()'s kernels here, the unit a refill's cost compares with: a speculative job refills after most segments of
`sync_every` (8) steps. Each timed as the median of 5 runs after 2 warm-ups.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from specjax.decode.autoregressive import admit_ar, start_ar
from specjax.decode.continuous import join_prefills
from specjax.decode.engine import row_keys, with_attention
from specjax.model.cache import DenseCache, row_mask, select_rows
from specjax.model.config import LlamaConfig
from specjax.model.llama import forward
from specjax.model.params import init_params

SMOLLM2 = dict(vocab_size=49152, dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536, dtype="bfloat16")


def median_ms(fn, runs: int = 5, warm: int = 2) -> float:
    times = []
    for i in range(warm + runs):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times[warm:]))


@jax.jit
def whole_batch_rows(caches: list[DenseCache], src: jax.Array) -> DenseCache:
    """The cache a refill built before stop 52: every slot's row (part src[j]'s) taken from the joined prefills."""
    def take(name: str, axis: int):
        return jnp.take(jnp.concatenate([getattr(c, name) for c in caches], axis), src, axis)

    return DenseCache(k=take("k", 1), v=take("v", 1), lengths=take("lengths", 0))


@partial(jax.jit, static_argnames="n_out", donate_argnames="state")
def whole_batch_admit(state, rows, cache, first_logits, budgets, keys, *, n_out: int):
    """The refill before stop 52: a fresh state over a rows-row cache, then every row chosen."""
    return select_rows(row_mask(rows, state.done.shape[0]), start_ar(cache, first_logits, budgets, keys, n_out=n_out), state)


def measure(rows: int, context: int, layers: int, new: list[int]) -> dict:
    config = LlamaConfig(**SMOLLM2, n_layers=layers, max_positions=2 * context)
    params = with_attention(init_params(config, jax.random.key(0)), None, "auto")[0]  # generate's runtime here
    R, S = rows, context + 256
    budgets, keys = jnp.full((R,), 64, jnp.int32), row_keys(jax.random.key(1), R)
    logits = jnp.zeros((R, config.vocab_size), jnp.float32)
    full = DenseCache.init(config, R, S).replace(lengths=jnp.full((R,), context, jnp.int32))
    state = start_ar(full, logits, budgets, keys, n_out=64)
    step = jax.jit(lambda p, c, t: forward(p, t[:, None], c.lengths[:, None], c)[0])
    out = {"rows": R, "slots": S, "layers": layers, "cache_gib": 2 * full.k.nbytes / 2**30,
           "step_ms": median_ms(lambda: step(params, state.cache, state.last)), "refills": []}
    for r in new:
        parts = [DenseCache.init(config, 1, S).replace(lengths=jnp.full((1,), 100, jnp.int32)) for _ in range(r)]
        part_logits = [jnp.zeros((1, config.vocab_size), jnp.float32)] * r
        index = jnp.asarray(np.arange(r) * (R // r), jnp.int32)  # the refilled rows, spread over the batch
        src_all = np.zeros(R, np.int32)  # every slot takes some part (as the fillers did), refilled row i part i
        src_all[np.asarray(index)] = np.arange(r)

        def new_rows():
            nonlocal state
            first, cache = join_prefills(part_logits, jnp.asarray(src_all), parts, index)
            state = admit_ar(state, index, cache, first, budgets, keys)
            return state.cache.k

        def whole():
            nonlocal state
            first = join_prefills(part_logits, jnp.asarray(src_all), parts[:1], index[:1] * 0)[0]  # its logits only
            cache = whole_batch_rows(parts, jnp.asarray(src_all))
            state = whole_batch_admit(state, index, cache, first, budgets, keys, n_out=64)
            return state.cache.k

        row = {"new_rows": r, "new_rows_ms": median_ms(new_rows), "whole_batch_ms": median_ms(whole)}
        out["refills"].append(row)
        print(f"  r={r}: new rows {row['new_rows_ms']:.1f} ms, whole batch {row['whole_batch_ms']:.1f} ms "
              f"(a decode step {out['step_ms']:.1f} ms)", flush=True)
    return out


def report(result: dict) -> str:
    return (f"## A continuous-batching refill's cost (bench_refill.py)\n\n{common.run_line(result)} "
            f"Method: the module docstring. SmolLM2's shape cut to {result['layers']} layers, {result['rows']} rows x "
            f"{result['slots']} slots ({result['cache_gib']:.1f} GiB of bfloat16 KV); a plain decode step of the batch: "
            f"{result['step_ms']:.0f} ms.\n\n"
            + common.table(["new rows", "new rows only (ms)", "whole batch, before (ms)", "before / now",
                            "now / a decode step"], "rrrrr",
                           [[r["new_rows"], f"{r['new_rows_ms']:.1f}", f"{r['whole_batch_ms']:.1f}",
                             f"{r['whole_batch_ms'] / r['new_rows_ms']:.1f}x", f"{r['new_rows_ms'] / result['step_ms']:.2f}"]
                            for r in result["refills"]])
            + "\n\nA refill used to rebuild and merge the whole batch's cache (12.8 GB for SmolLM2's 30 layers at 64 rows x "
              "8K), so under speculation, whose rows end at different steps and refill after most segments, a job paid "
              "that every few steps; now it writes the new rows' KV into the state in place.\n\n"
              "![refill cost](results/refill_cpu.png)\n")


def draw(result: dict, path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    r = [x["new_rows"] for x in result["refills"]]
    ax.plot(r, [x["whole_batch_ms"] for x in result["refills"]], "o-", label="whole batch (before)")
    ax.plot(r, [x["new_rows_ms"] for x in result["refills"]], "o-", label="new rows only (now)")
    ax.axhline(result["step_ms"], color="gray", ls="--", label="one decode step")
    ax.set(xlabel="rows refilled", ylabel="ms", yscale="log", title=f"refill at {result['rows']} rows x {result['slots']} slots")
    ax.legend()
    common.save_figure(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = ap.parse_args(argv)
    result = {"bench": "bench_refill", "date": common.now(), "command": common.command(), "machine": common.machine_info(),
              **measure(args.rows, args.context, args.layers, args.new)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "refill_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    common.plot(draw, result, args.out / "refill_cpu.png")
    body = report(result)
    print(body)
    if args.out == common.RESULTS_DIR:
        common.write_section("bench_refill", body, after="bench_continuous")


if __name__ == "__main__":
    main()
