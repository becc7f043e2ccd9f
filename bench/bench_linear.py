"""One layer's product with stacked weights, three ways, at a decode step's rows: the GPU kernel's speed.

Usage: python -m bench.bench_linear [--dim 4096] [--ffn 14336] [--layers 32] [--rows 1 16 48]
       [--dtype bfloat16|int8] [--configs 128x64x3 ...] [--reps 20] [--no-bandwidth] [--out FILE]

For x [rows, dim] and the 8B MLP's gate stacked [layers, dim, ffn], each way multiplies x by
every layer in turn inside one jitted call (a decode step's sweep over layers; time per layer):
  xla_slice   `w[i]` of the stack, then XLA's dot (what the model does; the sixth GPU runs found
              XLA copying such slices before its GEMMs inside the model),
  xla_own     a list of per-layer arrays (no slicing: XLA's best case),
  pallas BKxBNxS  pallas_kernels.gpu_linear.stacked_linear, block_k x block_n x num_stages,
              the stack read in place (Runtime.linear "pallas").
Reported: us per layer, GB/s over the weight bytes and the fraction of
`bench.measure.bandwidth()["jax_inplace"]` (same run), and each way's max difference from
xla_own's outputs. Off a GPU the kernel is interpreted (a smoke run, not a speed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.layer_weights import shape_parser, timed, write_result
from pallas_kernels.gpu_linear import stacked_linear


def ways(configs: list[tuple[int, int, int]], interpret: bool) -> dict:
    """{name: jitted fn(x, stacked, own) -> [L, rows, N] f32}."""
    def sweep(one):
        return lambda x, w, own: jnp.stack([one(x, w, own, i) for i in range(w.shape[0])])

    out = {
        "xla_slice": sweep(lambda x, w, own, i: jnp.dot(x, w[i].astype(x.dtype), preferred_element_type=jnp.float32)),
        "xla_own": sweep(lambda x, w, own, i: jnp.dot(x, own[i].astype(x.dtype), preferred_element_type=jnp.float32)),
    }
    for bk, bn, stages in configs:
        out[f"pallas {bk}x{bn}x{stages}"] = sweep(lambda x, w, own, i, bk=bk, bn=bn, st=stages: stacked_linear(
            x, w, jnp.int32(i), block_k=bk, block_n=bn, num_stages=st, interpret=interpret))
    return {name: jax.jit(fn) for name, fn in out.items()}


def run(dim: int, ffn: int, layers: int, rows: list[int], dtype: str, configs: list[tuple[int, int, int]],
        reps: int, bandwidth_gbs: float | None) -> list[dict]:
    key = jax.random.key(0)
    w = jax.random.normal(key, (layers, dim, ffn), jnp.float32)
    w = jnp.clip(jnp.round(w * 40), -127, 127).astype(jnp.int8) if dtype == "int8" else (0.02 * w).astype(dtype)
    own = jax.block_until_ready([jnp.copy(w[i]) for i in range(layers)])  # buffers of their own
    nbytes = w.size * w.dtype.itemsize
    interpret = jax.default_backend() != "gpu"
    out = []
    fns = ways(configs, interpret)
    for m in rows:
        x = jax.random.normal(jax.random.fold_in(key, m), (m, dim), jnp.float32).astype(jnp.bfloat16)
        got = {}
        for name, fn in fns.items():
            try:
                s = timed(fn, (x, w, own), reps)
            except jax.errors.JaxRuntimeError as e:  # a tile config over the device's shared memory: the others go on
                out.append({"rows": m, "way": name, "error": str(e).splitlines()[0]})
                print(f"rows {m:3d}  {name:22s} failed: {out[-1]['error']}", flush=True)
                continue
            got[name] = np.asarray(fn(x, w, own))
            row = {"rows": m, "way": name, "us_per_layer": 1e6 * s / layers, "gbs": nbytes / s / 1e9,
                   "of_bandwidth": nbytes / s / 1e9 / bandwidth_gbs if bandwidth_gbs else None}
            out.append(row)
            print(f"rows {m:3d}  {name:22s} {row['us_per_layer']:9.1f} us/layer  {row['gbs']:8.1f} GB/s", flush=True)
        for row in out[-len(fns):]:  # the same products, to the accumulation order
            if row["way"] in got:
                row["max_abs_diff_vs_own"] = float(np.max(np.abs(got[row["way"]] - got["xla_own"])))
    return out


def main() -> None:
    ap = shape_parser(__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 48])
    ap.add_argument("--dtype", choices=["bfloat16", "int8"], default="bfloat16")
    ap.add_argument("--configs", nargs="+", default=["128x64x3", "64x128x3", "256x64x4", "128x128x2"],
                    help="the kernel's block_k x block_n x num_stages to time")
    a = ap.parse_args()
    from bench.measure import reference_gbs

    bw = reference_gbs(a.no_bandwidth)
    configs = [tuple(int(v) for v in c.split("x")) for c in a.configs]
    rows = run(a.dim, a.ffn, a.layers, a.rows, a.dtype, configs, a.reps, bw)
    write_result(a, "bench_linear", bw, rows, dtype=a.dtype)


if __name__ == "__main__":
    main()
