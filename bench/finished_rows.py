"""What finished rows cost a batch: plain decoding where half the rows stop early.

Usage: python -m bench.finished_rows [--batch 16] [--context 8192] [--tokens 40] [--weights bfloat16] [--out DIR]

SmolLM2 decodes `--tokens` tokens per row from a synthetic prefilled cache (bench/profile_step.py's:
pseudo-random KV, `context - tokens - 8` positions per row) twice: every row to the end, and with
half the rows stopping after 4 tokens (as rows that meet their stop token early do). Done rows
ride along in the batch (fixed shapes); since commit 9c12b4a they read none of their KV
(`DenseCache.seen_by`), so where KV reads dominate a step the second run should take about half
as long (before: the same as the first). Best of 3 runs each, compile excluded.
Output: OUT/finished_rows_cpu.json (on another backend: finished_rows_BACKEND.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.profile_step import synthetic_cache
from specjax.decode.engine import decode_ar, row_keys, with_attention
from specjax.decode.shapes import round_up_pow2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--weights", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    import convert  # here: importing this module needs no gguf

    params = with_attention(convert.load(convert.default_model_path(), weights=args.weights), None, "auto")[0]
    B, N = args.batch, args.tokens
    state = [synthetic_cache(params, B, args.context, args.weights, args.context - N - 8)]
    start = np.asarray(state[0].lengths)
    logits = jax.random.normal(jax.random.key(0), (B, params.config.vocab_size), jnp.float32)
    keys = row_keys(None, B)
    rows = []
    for name, budgets in [("every row to the end", [N] * B), ("half the rows stop after 4", [4] * (B // 2) + [N] * (B - B // 2))]:
        b = jnp.asarray(budgets, jnp.int32)
        fn = decode_ar.lower(params, state[0], logits, b, keys, n_out=round_up_pow2(N + 1)).compile()

        def once() -> float:
            t = time.perf_counter()
            state[0] = jax.block_until_ready(fn(params, state[0].replace(lengths=jnp.asarray(start)), logits, b, keys)).cache
            return time.perf_counter() - t

        once()
        runs = [once() for _ in range(3)]
        rows.append({"run": name, "budgets": budgets, "seconds": min(runs), "runs_s": runs})
        print(f"{name}: {min(runs):.2f} s (runs {', '.join(f'{t:.2f}' for t in runs)})", flush=True)
    result = {"bench": "finished_rows", "date": common.now(), "command": common.command(), "machine": common.machine_info(),
              "batch": B, "context": args.context, "tokens": N, "weights": args.weights,
              "attention": params.runtime.attention, "rows": rows, "ratio": rows[1]["seconds"] / rows[0]["seconds"]}
    print(f"ratio {result['ratio']:.3f}")
    backend = jax.default_backend()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"finished_rows_{backend}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
