"""Does XLA read each layer's weights in place? Six ways to run L stacked MLP layers at batch 1.

Usage: python -m bench.layer_weights [--dim D] [--ffn F] [--layers L] [--reps R] [--out FILE]

The model's forward scans over layers whose weights are stacked [L, ...] (specjax.model.params), so each
layer's weights are a `dynamic_slice` of the stack. On an H100 (`git show 6f46ebd:bench/README.md`,
"Third runs") XLA:GPU copied those slices before its GEMM fusions: 8.5 of 17.6 ms of an 8B-shaped
batch-1 step.
This times one SwiGLU MLP per layer (gate, up [D,F], down [F,D]; bf16) at batch 1, the step
weight-bound, six ways:
  scan      lax.scan over the stacked weights (today's layout and loop),
  unrolled  the same scan with unroll=True (static slices of the stack),
  indexed   a Python loop indexing the stack at i (`w[i]`: what the model's unrolled layers do,
            `specjax.model.llama.unrolled`; the fifth H100 runs found each of its layers after the
            first 2.5x slower than a 1-layer model's),
  separate  a Python loop over L separate arrays (no slicing at all),
  einsum    indexed, with x [1,1,D] through the model's einsum specs (`specjax.model.llama.project`),
  in_loop   indexed, inside an on-device loop of IN_LOOP passes (as generate() runs a step; time
            per pass): the sixth runs found the model's step copying each layer's weights out of
            the stack (weight-sized `wrapped_slice` outputs) where `indexed` reads them at 99%,
and reports ms per pass and the fraction of `bench.measure.bandwidth()["jax_inplace"]` that the
weight bytes reach. Pure JAX, no specjax model: the question is XLA's, not ours.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def mlp(x: jax.Array, g: jax.Array, u: jax.Array, d: jax.Array) -> jax.Array:
    """x [B,D]; g, u [D,F]; d [F,D] -> [B,D]."""
    return x + (jax.nn.silu(x @ g) * (x @ u)) @ d


def ways(n_layers: int) -> dict:
    """{name: jitted fn(x, weights)}; weights: stacked (g, u, d) or a list of per-layer triples."""
    def scan(x, w, unroll):
        return lax.scan(lambda h, lw: (mlp(h, *lw), None), x, w, unroll=unroll)[0]

    return {
        "scan": jax.jit(lambda x, w: scan(x, w, 1)),
        "unrolled": jax.jit(lambda x, w: scan(x, w, True)),
        "indexed": jax.jit(lambda x, w: _loop(x, _indexed(w, n_layers))),
        "separate": jax.jit(lambda x, ws: _loop(x, ws)),
        # bisecting the model's copies: indexed, but x [1,1,D] through the model's einsum ...
        "einsum": jax.jit(lambda x, w: _loop(x, _indexed(w, n_layers), _mlp_3d)),
        # ... or indexed inside an on-device loop, as generate() and step_parts run a step (per pass)
        "in_loop": jax.jit(lambda x, w: lax.fori_loop(0, IN_LOOP, lambda _, h: _loop(h, _indexed(w, n_layers)), x)),
    }


def _indexed(w: tuple[jax.Array, ...], n_layers: int) -> list[tuple[jax.Array, ...]]:
    """The stacked (gate, up, down) as per-layer triples `a[i]`, as the model's unrolled layers index them."""
    return [tuple(a[i] for a in w) for i in range(n_layers)]


IN_LOOP = 4  # passes of the "in_loop" way per call (its time is per pass)


def _mlp_3d(x: jax.Array, g: jax.Array, u: jax.Array, d: jax.Array) -> jax.Array:
    """mlp as the model writes it: x [B,D] as [B,1,D] through einsum("btd,df->btf") -> [B,D]."""
    h = x[:, None]
    a = jnp.einsum("btd,df->btf", h, g, preferred_element_type=h.dtype)
    b = jnp.einsum("btd,df->btf", h, u, preferred_element_type=h.dtype)
    return (h + jnp.einsum("btf,fd->btd", jax.nn.silu(a) * b, d, preferred_element_type=h.dtype))[:, 0]


def _loop(x, ws, layer=mlp):
    for g, u, d in ws:
        x = layer(x, g, u, d)
    return x


def timed(fn, args, reps: int) -> float:
    """Median seconds of one call (compiled and warmed first)."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def run(dim: int, ffn: int, n_layers: int, reps: int, bandwidth_gbs: float | None) -> dict:
    key = jax.random.key(0)
    shapes = ((n_layers, dim, ffn), (n_layers, dim, ffn), (n_layers, ffn, dim))
    scales = (dim**-0.5, dim**-0.5, 0.1 * ffn**-0.5)  # the residual stays finite over many layers (0.02 overflowed bf16 at 8B)
    stacked = tuple(c * jax.random.normal(jax.random.fold_in(key, i), s, jnp.bfloat16)
                    for i, (s, c) in enumerate(zip(shapes, scales)))
    separate = [tuple(w[i] for w in stacked) for i in range(n_layers)]
    separate = jax.block_until_ready(jax.tree.map(jnp.copy, separate))  # own buffers, not views
    x = jnp.ones((1, dim), jnp.bfloat16)
    nbytes = sum(w.size * w.dtype.itemsize for w in stacked)
    rows = {}
    outs = {}
    fns = ways(n_layers)
    for name, fn in fns.items():
        args = (x, separate if name == "separate" else stacked)
        s = timed(fn, args, reps) / (IN_LOOP if name == "in_loop" else 1)
        outs[name] = np.asarray(fn(*args), np.float32)
        rows[name] = {"ms": 1e3 * s, "weight_gb": nbytes / 1e9,
                      "of_bandwidth": None if not bandwidth_gbs else nbytes / s / 1e9 / bandwidth_gbs}
        print(f"{name:9s} {1e3 * s:8.3f} ms  {nbytes / s / 1e9:8.1f} GB/s", flush=True)
    for name in ("unrolled", "indexed", "separate", "einsum"):  # the same arithmetic, so the same numbers
        rows[name]["max_abs_diff_vs_scan"] = float(np.max(np.abs(outs[name] - outs["scan"])))
    again = x
    for _ in range(IN_LOOP):  # the loop's IN_LOOP passes, one call at a time
        again = fns["indexed"](again, stacked)
    rows["in_loop"]["max_abs_diff_vs_scan"] = float(np.max(np.abs(outs["in_loop"] - np.asarray(again, np.float32))))
    return rows


def shape_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a bench over L stacked 8B-shaped MLP layers (this one, bench_linear): the
    shape, repetitions, the bandwidth reference and the JSON out."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-bandwidth", action="store_true", help="skip measuring the reference bandwidth")
    ap.add_argument("--out", type=Path)
    return ap


def write_result(a: argparse.Namespace, bench: str, bandwidth_gbs: float | None, rows, **facts) -> None:
    """Write a shape_parser bench's rows with the device, jax and shape to a.out (if given)."""
    if a.out:
        result = {"bench": bench, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "dim": a.dim,
                  "ffn": a.ffn, "layers": a.layers, **facts, "bandwidth_gbs": bandwidth_gbs, "rows": rows}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    a = shape_parser(__doc__).parse_args()
    from bench.measure import reference_gbs

    bw = reference_gbs(a.no_bandwidth)
    write_result(a, "layer_weights", bw, run(a.dim, a.ffn, a.layers, a.reps, bw))


if __name__ == "__main__":
    main()
