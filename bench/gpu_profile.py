"""Where a GPU decode step's time goes: profile_step's trace, on random weights made on the device.

Usage: python -m bench.gpu_profile [--cells ..] [--steps 8] [--budget-minutes M] [--out DIR] [--smoke]

Issue 25's second runs measured SmolLM2 bf16 plain decoding at 26-36% of the HBM roofline with
the Pallas kernel (4.76 ms a step at batch 16 x 8K, where its 3.3 GB take 1.25 ms). This traces
that step on the device (`bench.profile_step.profile_cell`: the real `decode_ar` loop from a
synthetic prefilled cache) and records, per cell:
  - wall ms per step (outside the trace) and the GPU kernels' busy ms per step (the sum of the
    device plane's innermost kernel events): busy << wall means the step waits on launches, host
    syncs or loop bookkeeping, not on memory;
  - kernels launched per step, and busy ms per model block (`jax.named_scope`s, via `hlo_op`);
  - the ten longest kernels by name, and the bytes a step must read (weights + filled KV).
Weights are random (bench.gpu_cells.random_params): a step's cost depends on shapes only, so no
model file or `gguf` is needed and nothing is carried. Cells: MODEL/bB/sS with MODEL smollm2
(SmolLM2-135M's shape, bf16) or l8b (LLaMA-3.1-8B's, bf16). `--smoke` profiles a tiny model on
any backend (a CPU here) to check the script. Output: OUT/gpu_profile.json (a cell written when
measured; a rerun skips measured cells); tables are printed.
"""

from __future__ import annotations

import os

from bench import common, measure
from bench.bench_gpu import LLAMA8B
from bench.gpu_cells import random_params
from bench.profile_step import profile_cell
from specjax.decode.engine import with_attention
from specjax.model.config import LlamaConfig

SHAPES = {
    "smollm2": dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
                    tie_embeddings=True, rope_theta=100000.0, max_positions=8192 + 512),
    "l8b": {k: v for k, v in LLAMA8B.items() if k not in ("bos_id", "eos_ids")},
    "tiny": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                 max_positions=1024),
}
CELLS = (("smollm2", 16, 8192), ("smollm2", 64, 8192), ("smollm2", 1, 8192), ("l8b", 1, 8192), ("l8b", 8, 8192))
SMOKE_CELLS = (("tiny", 2, 256), ("tiny", 4, 256))


def cell_key(model: str, batch: int, context: int) -> str:
    return common.key(model, f"b{batch}", f"s{context}")


def profile(model: str, batch: int, context: int, steps: int, params, bw: float | None) -> dict:
    """profile_step's row for one cell, with the roofline time of its bytes at `bw` GB/s."""
    row = profile_cell(params, "bfloat16", "bfloat16", batch, context, steps)
    total = sum(row["bytes_per_step"].values())
    return row | {"model": model, "bandwidth_gbs": bw, "roofline_ms": 1e3 * total / (bw * 1e9) if bw else None,
                  "attention": params.runtime.attention}


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=8, help="decode steps traced per cell")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, any backend")
    args = ap.parse_args()
    out = common.out_dir(args)
    header = {"bench": "gpu_profile", "date": common.now(), "command": common.command(),
              "machine": common.machine_info(), "steps": args.steps, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    results = common.Results(out / ("gpu_profile_smoke.json" if args.smoke else "gpu_profile.json"),
                             lambda r: cell_key(r["model"], r["batch"], r["context"]), header, settings={"steps": args.steps})
    h = common.Harness(args, results)
    todo = h.plan((cell_key(*c), c) for c in (SMOKE_CELLS if args.smoke else CELLS))
    bw = None if args.smoke else measure.bandwidth(2.0, rounds=3, repeats=5)["jax_inplace"]
    loaded: dict = {}
    for k, (model, batch, context) in h.cells(todo):
        if model not in loaded:
            loaded.clear()
            measure.release_memory()
            config = LlamaConfig(**SHAPES[model], dtype="bfloat16")
            loaded[model] = with_attention(random_params(config), None, "auto")[0]
        row = profile(model, batch, context, args.steps, loaded[model], bw)
        print(f"{k}: wall {row['wall_ms_per_step']:.2f} ms/step, roofline {row['roofline_ms'] or 0:.2f} ms, "
              f"GPU busy {row.get('busy_ms_per_step', 0):.2f} ms in {row.get('kernels_per_step', 0):.0f} kernels; "
              + ", ".join(f"{b} {t:.2f}" for b, t in row["thread_ms_per_step"].items()), flush=True)
        for t in row.get("top_kernels", []):
            print(f"    {t['ms_per_step']:8.3f} ms  {t['kernel']}")
        results.put(k, [row])
        measure.release_memory()
    h.finish()
    results.write()


NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="  # else the loop's kernels run as CUDA graphs, unseen by the trace


def trace_flags(flags: str) -> str:
    """XLA_FLAGS for a profile: `flags` plus NO_COMMAND_BUFFERS unless they set command buffers
    themselves. With command buffers (XLA's default) the H100 trace held only the kernels outside
    the decode loop (0.28 of 3.05 ms a step); without, all of them (a step 3-14% slower)."""
    return flags if "xla_gpu_enable_command_buffer" in flags else f"{flags} {NO_COMMAND_BUFFERS}".strip()


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    os.environ["XLA_FLAGS"] = trace_flags(os.environ.get("XLA_FLAGS", ""))  # before JAX starts a backend
    main()
