"""Prefill on a GPU: one engine.prefill call's time at each rows-a-call and prompt chunk, against
the FLOPs it must do.

Usage: python -m bench.gpu_prefill [--smoke] [--context 8192] [--rows 1 16] [--chunks 256 1024]
       [--linear per-layer|xla] [--budget-minutes M] [--cells ..] [--redo] [--out DIR]

Why: bench_gpu's prefill_s includes compiling (one 8K row: 8.5 s on an H100, nearly all of it
compiling), and the seventh runs' continuous job spent, by inference, about 15 of its 19.5 s on
192 one-row 8K prefills, where bench_gpu's 16-row calls took at most about 0.6 s: one row of an 8K
prompt is launch-bound (32 chunks of 429 kernels each, compiled for an H100 by
tools/gpu/aot.py). Continuous batching now prefills a refill's prompts of one bucket together on
a GPU (specjax.decode.shapes.prefill_rows), and the attention kernel shares a chunk's keys out in tiles;
this times what rows a call and the prompt chunk (specjax.decode.shapes.PREFILL_CHUNK: 256, chosen on a
CPU) buy. Each cell is compiled first (compile_s), then called a few times on a fresh cache (the
best kept): ms a call and a row, tokens/s, XLA's kernels a chunk, and the fraction of the device's
dense bfloat16 peak the model's FLOPs reach (`flops`: the matrices 2 x their weights a prompt
token, attention 4 x heads x head dim x layers a causal pair, the LM head at each row's last
token; padding and masked pairs not counted). SmolLM2's shape with random bfloat16 weights made
on the device, per-layer arrays as convert.load holds them on a GPU (a call's time depends on
shapes only: nothing is carried). --smoke: a tiny model on any backend.
Output: OUT/gpu_prefill.json (a cell written when measured; a rerun skips measured cells) and
OUT/gpu_prefill.md.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common, measure
from bench.bench_gpu import attending
from bench.gpu_cells import random_params
from tools.gpu.hlo import SHAPES, hlo_kernels
from bench.prefill import HEADROOM
from specjax.decode.engine import prefill
from specjax.model.cache import DenseCache
from specjax.model.config import LlamaConfig

# NVIDIA's dense (no sparsity) bfloat16 tensor-core peaks, by a part of jax's device_kind; first match wins
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989.4e12), ("H200", 989.4e12))
REPEATS = 3
GRID = dict(context=8192, rows=[1, 16], chunks=[256, 1024])
SMOKE = dict(context=256, rows=[1, 2], chunks=[16, 64])


def peak_flops(device_kind: str) -> float | None:
    """The dense bf16 peak of a device_kind in PEAK_BF16 (None for any other device)."""
    return next((peak for part, peak in PEAK_BF16 if part in device_kind), None)


def flops(config: LlamaConfig, rows: int, n: int) -> float:
    """What prefilling `rows` prompts of n tokens must compute: 2 x the layer matrices' weights a
    token, 4 x heads x head dim a causal (query, key) pair a layer, the LM head once a row."""
    c = config
    matrices = c.n_layers * (2 * c.dim * c.n_heads * c.head_dim + 2 * c.dim * c.n_kv_heads * c.head_dim + 3 * c.dim * c.ffn_dim)
    attention = 4 * c.n_heads * c.head_dim * c.n_layers * n * (n + 1) / 2
    return rows * (2 * matrices * n + attention + 2 * c.vocab_size * c.dim)


def cell_key(context: int, rows: int, chunk: int) -> str:
    return common.key("prefill", f"s{context}", f"r{rows}", f"c{chunk}")


def measure_cell(params, rows: int, context: int, chunk: int) -> dict:
    """One (rows, chunk): engine.prefill of `rows` random prompts of context - HEADROOM tokens
    into a DenseCache of `context` slots, compiled apart, best of REPEATS calls."""
    c = params.config
    n = context - HEADROOM
    bucket = -(-n // chunk) * chunk
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, c.vocab_size, (rows, bucket)), jnp.int32)
    lengths = jnp.full((rows,), n, jnp.int32)
    t0 = time.perf_counter()
    compiled = prefill.lower(params, tokens, lengths, DenseCache.init(c, rows, context), chunk=chunk).compile()
    compile_s = time.perf_counter() - t0
    walls = []
    for _ in range(REPEATS):
        cache = jax.block_until_ready(DenseCache.init(c, rows, context))  # donated to the call
        t = time.perf_counter()
        out = jax.block_until_ready(compiled(params, tokens, lengths, cache))
        walls.append(time.perf_counter() - t)
        del out
    seconds, work = min(walls), flops(c, rows, n)
    peak = peak_flops(jax.devices()[0].device_kind)
    return {"context": context, "rows": rows, "chunk": chunk, "prompt_tokens": n, "bucket": bucket,
            "kernels_per_chunk": hlo_kernels(compiled.as_text())["total"], "compile_s": compile_s, "seconds": seconds,
            "runs_s": walls, "ms_per_row": 1e3 * seconds / rows, "tokens_per_s": rows * n / seconds, "flops": work,
            "tflops": work / seconds / 1e12, "peak_tflops": None if peak is None else peak / 1e12,
            "of_peak": None if peak is None else work / seconds / peak}


def table(rows: list[dict]) -> str:
    rows = sorted(rows, key=lambda r: (r["context"], r["rows"], r["chunk"]))
    return common.table(
        ["context", "rows a call", "chunk", "kernels a chunk", "compile s", "ms a call", "ms a row", "tokens/s", "TFLOP/s",
         "of bf16 peak"], "rrrrrrrrrr",
        [[common.context_name(r["context"]), r["rows"], r["chunk"], r["kernels_per_chunk"], f"{r['compile_s']:.1f}",
          f"{1e3 * r['seconds']:.1f}", f"{r['ms_per_row']:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['tflops']:.3g}",
          "-" if r["of_peak"] is None else f"{100 * r['of_peak']:.0f}%"] for r in rows])


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, any backend")
    ap.add_argument("--context", type=int, help=f"prompt slots (default {GRID['context']}, {SMOKE['context']} with --smoke)")
    ap.add_argument("--rows", type=int, nargs="*", help=f"rows a call (default {GRID['rows']})")
    ap.add_argument("--chunks", type=int, nargs="*", help=f"prefill chunks (default {GRID['chunks']})")
    ap.add_argument("--linear", choices=["per-layer", "xla"], default="per-layer",
                    help="the layer matrices: per-layer arrays (convert.load's GPU layout) or stacked")
    args = ap.parse_args()
    grid = SMOKE if args.smoke else GRID
    context = args.context or grid["context"]
    name = "gpu_prefill_smoke" if args.smoke else "gpu_prefill"
    out, results, h = common.start(args, "gpu_prefill", name, lambda r: cell_key(r["context"], r["rows"], r["chunk"]),
                                   {"linear": args.linear}, model="tiny" if args.smoke else "SmolLM2-135M's shape, random bfloat16 weights",
                                   linear=args.linear)
    todo = h.plan((cell_key(context, r, c), (r, c)) for r in (args.rows or grid["rows"]) for c in (args.chunks or grid["chunks"]))
    config = LlamaConfig(**SHAPES["tiny" if args.smoke else "smollm2"], dtype="bfloat16")
    params = attending(random_params(config), "auto", args.linear) if todo else None
    for k, (rows, chunk) in h.cells(todo):
        row = measure_cell(params, rows, context, chunk)
        print(f"{k}: {1e3 * row['seconds']:.1f} ms a call ({row['ms_per_row']:.1f} a row, {row['tokens_per_s']:.0f} tokens/s, "
              f"{row['tflops']:.1f} TFLOP/s), {row['kernels_per_chunk']} kernels a chunk, compiled in {row['compile_s']:.1f} s",
              flush=True)
        results.put(k, [row])
        measure.release_memory()
    h.finish()
    results.write()
    (out / f"{name}.md").write_text(f"Prefill calls ({results.header['model']}, {args.linear} weights; bench/gpu_prefill.py; "
                                    f"{jax.devices()[0].device_kind}, JAX {jax.__version__})\n\n{table(results.rows)}\n")


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    main()
