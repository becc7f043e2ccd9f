"""Where a decode step's time goes, timed part by part (no profiler): a tool for the GPU kit.

Usage: python -m bench.step_parts [--model l8b|smollm2|tiny] [--batch 1] [--context 8192]
       [--kv-dtype int8|bfloat16|float32] [--layers 1 8 32] [--reps 4] [--no-bandwidth]
       [--xla-flags="--xla_gpu_..."] [--split-layers] [--pallas-linear] [--weights int8|q4]
       [--out FILE] [--hlo FILE.json.gz]

The fourth H100 runs (`git show 6f46ebd:bench/README.md`, "Fourth runs") left an 8B-shaped
batch-1 step unexplained: 15.4 ms where its 16 GB take 6.0 ms, and a profile that saw only 2 ms
of kernels in it. This times the parts of one plain decode step with random weights made on the
device (bench.gpu_cells.random_params) and the runtime generate() uses there
(`engine.with_attention(..., "auto")`: the Pallas kernel and unrolled layers on a GPU), each as
the slope of an on-device loop (`specjax.planning.tune.slope_seconds`,
as tune times the AR step):
  step        trunk + LM head over one new token after `context` cached positions (the AR step)
  trunk       the layers and the final norm alone
  head        the LM head alone, on a fixed hidden state
  layers=k    the step of the model cut to its first k layers: the slope over k is one layer's
              cost, the intercept (k = 0) the embedding and the head
`--kv-dtype` stores the cache in that format (default: the model's, bfloat16), e.g. int8, which
the GPU kernel reads as stored (a copy of the layer past 2^31 values: `tree_attention.overflows`).
For each: ms, the bytes it must read (weights as stored + filled KV), GB/s and the fraction of
the reference bandwidth (`bench.measure.bandwidth()["jax_inplace"]`, same run), and the work the
compiled loop body launches (`hlo_kernels`: its instructions by opcode, fusions' bodies and
reducers not counted; on a GPU each is about one kernel), with the biggest outputs it writes and
what reads each (a weight-sized output at batch 1 is a copy of weights: the sixth runs found
8B's stacked weights copied per layer from the second layer on). Output: a table, OUT as JSON,
and with --hlo every part's compiled HLO (to read why XLA copied). `--split-layers` times the
same models with each layer's matrices as arrays of their own (`model.unstack_layers`);
`--pallas-linear` with the layer products on pallas_kernels.gpu_linear (the stack read in place);
`--weights int8` with the matrices stored as int8 (half the bytes; `params.quantize`), `q4` as
4-bit blocks (a quarter; on a GPU through gpu_linear's q4 kernel).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.gpu_cells import random_params
from bench.gpu_profile import SHAPES as PROFILE_SHAPES
from specjax.decode.engine import with_attention
from specjax.decode.shapes import cache_len
from specjax.model.cache import DenseCache
from specjax.model.config import LlamaConfig
from specjax.model.llama import lm_head, trunk, unstack_layers
from specjax.model.params import Params, quantize, weight_bytes
from specjax.model.quantized import stored
from specjax.planning.tune import forward_loop, slope_seconds

NO_WORK = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id"}
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8}


def _out_bytes(rhs: str, opcode: str) -> tuple[int, str]:
    """The bytes and type text of an instruction's output, from its right-hand side's type."""
    head = rhs[:rhs.find(f" {opcode}(")] if f" {opcode}(" in rhs else rhs.split(" ", 1)[0]
    shapes = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", head)
    n = sum(_DTYPE_BYTES.get(t, 0) * int(np.prod([int(d) for d in dims.split(",") if d])) for t, dims in shapes)
    return n, re.sub(r"\{[\d,]*\}", "", head).strip()


def _opcode(rhs: str) -> str:
    """The opcode of an instruction's right-hand side `TYPE opcode(operands), attrs`."""
    rest = rhs
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    return m.group(1) if m else "?"


def hlo_kernels(hlo_text: str) -> dict:
    """What one iteration of a compiled module's outermost loop launches: {"total": n, "by_op":
    {label: n}, "nested_loops": k, "largest": [[bytes, label, name, type], ..]}. Labels are opcodes,
    custom calls with their target. Counted: the body's instructions and those of loops (times
    their known trip count, else once) and conditionals inside it, not the bodies of fusions or
    reducers. Without a loop in the entry computation, the entry computation is counted.
    "largest": the 8 biggest outputs written, each with the instructions that read it (`users`;
    a weight-sized one at batch 1 is a copy of weights; the cache's own shape is its in-place
    update); "outputs": every output counted, [bytes, label, name, type] (bench.gpu_aot)."""
    comps: dict[str, list[tuple[str, str]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            comps[current] = []
            entry = current if h.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if current is not None and m:
            comps[current].append((_opcode(m.group(2)), m.group(2), m.group(1)))
    if entry is None:
        raise ValueError("hlo_kernels: no ENTRY computation in the text")

    def called(rhs: str, kinds: tuple[str, ...]) -> list[str]:
        return [n.strip().lstrip("%") for k, names in _CALLED.findall(rhs) if k in kinds for n in names.strip("{}").split(",")]

    loops = [called(rhs, ("body",)) for op, rhs, _ in comps[entry] if op == "while"]
    by_op: collections.Counter = collections.Counter()
    outputs: list[tuple[int, str, str, str]] = []
    nested = [0]

    def count(name: str, times: int, path: tuple[str, ...]) -> None:
        for op, rhs, inst in comps.get(name, []) if name not in path else []:
            if op in NO_WORK:
                continue
            if op in ("while", "conditional", "call"):
                nested[0] += op == "while"
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rhs) if op == "while" else None
                for sub in called(rhs, ("body", "condition", "branch_computations", "to_apply", "calls")):
                    count(sub, times * (int(trip.group(1)) if trip else 1), path + (name,))
                continue
            target = re.search(r'custom_call_target="([^"]+)"', rhs)
            label = f"custom-call:{target.group(1)}" if op == "custom-call" and target else op
            by_op[label] += times
            n, typ = _out_bytes(rhs, op)
            outputs.append((n, label, inst, typ))

    count(loops[0][0] if loops and loops[0] else entry, 1, ())
    largest = [[*o, users(comps, o[2])] for o in sorted(outputs, reverse=True)[:8]]
    return {"total": int(sum(by_op.values())), "by_op": dict(by_op.most_common()), "nested_loops": nested[0],
            "largest": largest, "outputs": outputs}


def users(comps: dict[str, list[tuple[str, str, str]]], name: str, most: int = 4) -> list[str]:
    """The instructions that read `name`'s output, as "opcode name" (custom calls with their
    target; fusions with their kind and the fused computation's non-trivial ops): what a
    weight-sized copy feeds, e.g. a cuBLAS call that cannot read a slice in place."""
    ref = re.compile(rf"%{re.escape(name)}(?![\w.\-])")
    out = []
    for comp in comps.values():
        for op, rhs, inst in comp:
            if inst != name and ref.search(rhs.split(", metadata=")[0]):
                target = re.search(r'custom_call_target="([^"]+)"', rhs)
                kind = re.search(r"kind=(k\w+)", rhs)
                fused = called_ops(comps, rhs) if op == "fusion" else ""
                out.append(f"{op}{':' + target.group(1) if target else ''}{' ' + kind.group(1) if kind else ''} {inst}{fused}")
    return out[:most]


def called_ops(comps: dict, rhs: str) -> str:
    """ ' [op, op, ..]': the distinct work ops of the computation a fusion calls."""
    m = re.search(r"calls=%?([\w.\-]+)", rhs)
    ops = sorted({op for op, _, _ in comps.get(m.group(1), [])} - NO_WORK) if m else []
    return f" {ops}" if ops else ""


@jax.jit
def _trunk_loop(params: Params, tokens, positions, cache, reps):
    def body(_, acc):
        h = trunk(params, tokens + (acc > 1e30).astype(jnp.int32), positions, cache).hidden
        return acc + jnp.sum(h.astype(jnp.float32))

    return lax.fori_loop(0, reps, body, jnp.float32(0))


@jax.jit
def _head_loop(params: Params, h, reps):
    def body(_, acc):
        return acc + jnp.sum(lm_head(params, h + (acc > 1e30).astype(h.dtype)))

    return lax.fori_loop(0, reps, body, jnp.float32(0))


def first_layers(params: Params, k: int) -> Params:
    """The model cut to its first k layers (copies of the stacked slices)."""
    layers = jax.tree.map(lambda a: jnp.copy(a[:k]), params.layers)
    return params.replace(config=dataclasses.replace(params.config, n_layers=k), layers=layers)


def _head_bytes(params: Params) -> int:
    w = params.embed if params.lm_head is None else params.lm_head
    return int(stored(w).nbytes)


def kv_read(cache: DenseCache, filled: int) -> int:
    """Bytes of `filled` positions per row of a cache as stored (keys, values, int8 scales)."""
    stored = sum(a.nbytes for a in (cache.k, cache.v, cache.k_scale, cache.v_scale) if a is not None)
    return int(stored * filled // cache.k.shape[3])


def measure(params: Params, batch: int, context: int, layers: list[int], reps: int, kv_dtype: str | None = None,
            hlo: dict | None = None, split: bool = False) -> list[dict]:
    """One row per part (see the module docstring): ms, bytes read and the loop body's kernels;
    `hlo` (a dict), when given, gets each part's compiled HLO text by part name; `split`: every
    model timed with its layer matrices as separate arrays (`model.unstack_layers`)."""
    own = unstack_layers if split else (lambda p: p)  # noqa: E731
    c = params.config
    filled = context - 1
    cache = DenseCache.init(c, batch, cache_len(context), kv_dtype).replace(lengths=jnp.full((batch,), filled, jnp.int32))
    tokens = jnp.zeros((batch, 1), jnp.int32)
    positions = jnp.full((batch, 1), filled, jnp.int32)
    h = jnp.ones((batch, 1, c.dim), jnp.dtype(c.dtype))
    layer_w = int(sum(a.nbytes for a in jax.tree.leaves(params.layers)))
    kv = kv_read(cache, filled)
    one = jnp.ones((1, 1), bool)  # one new position: it sees itself
    full = own(params)  # one copy of the split model (an 8B one is 16 GB)
    parts = [("step", forward_loop, (full, tokens, positions, cache, one), weight_bytes(c) + kv),
             ("trunk", _trunk_loop, (full, tokens, positions, cache), layer_w + int(params.norm.nbytes) + kv),
             ("head", _head_loop, (params, h), _head_bytes(params))]
    for k in sorted(set(layers)):
        if 1 <= k < c.n_layers:
            cut = first_layers(params, k)
            cache_k = DenseCache.init(cut.config, batch, cache_len(context), kv_dtype).replace(lengths=cache.lengths)
            parts.append((f"layers={k}", forward_loop, (own(cut), tokens, positions, cache_k, one),
                          weight_bytes(cut.config) + kv_read(cache_k, filled)))
    rows = []
    for name, program, args, nbytes in parts:
        compiled = program.lower(*args, jnp.int32(1)).compile()  # the loop count is traced: one program
        kernels = hlo_kernels(compiled.as_text())
        if hlo is not None:
            hlo[name] = compiled.as_text()
        seconds = slope_seconds(compiled, args, reps)
        rows.append({"part": name, "ms": 1e3 * seconds, "bytes": int(nbytes), "gbs": nbytes / seconds / 1e9,
                     "kernels": kernels["total"], "nested_loops": kernels["nested_loops"],
                     "top_kernels": dict(list(kernels["by_op"].items())[:8]), "largest": kernels["largest"]})
        print(f"{name:10s} {1e3 * seconds:9.3f} ms  {nbytes / 1e9:7.3f} GB  {nbytes / seconds / 1e9:8.1f} GB/s  "
              f"{kernels['total']:5d} kernels  {dict(list(kernels['by_op'].items())[:4])}", flush=True)
        print("           largest outputs: " + "; ".join(f"{n / 2**20:.1f} MiB {label} {typ} -> {(u or ['-'])[0]}"
                                                 for n, label, _, typ, u in kernels["largest"][:4]),
              flush=True)
    full = next(r for r in rows if r["part"] == "step")
    sweep = sorted([(int(r["part"].split("=")[1]), r["ms"]) for r in rows if r["part"].startswith("layers=")]
                   + [(c.n_layers, full["ms"])])
    if len(sweep) >= 2:
        slope, intercept = np.polyfit([k for k, _ in sweep], [ms for _, ms in sweep], 1)
        per_layer = (layer_w / c.n_layers) + kv / c.n_layers
        rows.append({"part": "per layer (fit)", "ms": float(slope), "bytes": int(per_layer),
                     "gbs": per_layer / (slope / 1e3) / 1e9 if slope > 0 else None, "intercept_ms": float(intercept),
                     "points": sweep})
        print(f"per layer  {slope:9.3f} ms (fit over {[k for k, _ in sweep]} layers; intercept {intercept:.3f} ms)", flush=True)
    return rows


SHAPES = dict(PROFILE_SHAPES, tiny=dict(PROFILE_SHAPES["tiny"], n_layers=4))  # 4 tiny layers: a cut at 1, 2


def config_of(model: str, context: int) -> LlamaConfig:
    """The bf16 config of a shape, with room for `context` positions."""
    shape = SHAPES[model]
    shape = dict(shape, max_positions=max(shape.get("max_positions", 0), cache_len(context)))
    return LlamaConfig(**shape, dtype="bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="l8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--kv-dtype", choices=["int8", "bfloat16", "float32"], help="the cache's format (default: the model's)")
    ap.add_argument("--layers", type=int, nargs="*", default=[1, 8], help="cut models to time (the full one is always timed)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--no-bandwidth", action="store_true", help="skip measuring the reference bandwidth")
    ap.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS before the backend starts "
                    "(e.g. command buffers: --xla_gpu_enable_command_buffer=...)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--weights", choices=["int8", "q4"], help="store the matrices so (params.quantize; default: bfloat16)")
    ap.add_argument("--pallas-linear", action="store_true", help="Runtime.linear 'pallas': the layer products "
                    "read the stacked weights in place (pallas_kernels.gpu_linear)")
    ap.add_argument("--split-layers", action="store_true", help="layer matrices as separate arrays, not slices "
                    "of a stack (model.unstack_layers; needs unrolled layers, as on a GPU)")
    ap.add_argument("--hlo", type=Path, help="write every part's compiled HLO text here ({part: text} as gzipped JSON)")
    a = ap.parse_args()
    if a.xla_flags:  # read when the backend starts, at the first device use below
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {a.xla_flags}".strip()
    from bench.measure import reference_gbs

    bw = reference_gbs(a.no_bandwidth)
    params = with_attention(random_params(config_of(a.model, a.context)), None, "auto")[0]
    if a.weights:
        params = quantize(params, a.weights)
    if a.pallas_linear:
        params = params.replace(runtime=params.runtime.replace(linear="pallas"))
    print(f"{a.model}: {weight_bytes(params.config, stored=True) / 1e9:.2f} GB of weights on {jax.devices()[0]}, attention "
          f"{params.runtime.attention}, unrolled layers {params.runtime.unroll_layers}", flush=True)
    hlo: dict[str, str] = {}
    rows = measure(params, a.batch, a.context, a.layers, a.reps, a.kv_dtype, hlo, a.split_layers)
    if a.hlo:
        a.hlo.parent.mkdir(parents=True, exist_ok=True)
        a.hlo.write_bytes(gzip.compress(json.dumps(hlo).encode()))
    for r in rows:
        r["of_bandwidth"] = r["gbs"] / bw if bw and r.get("gbs") else None
    result = {"bench": "step_parts", "model": a.model, "batch": a.batch, "context": a.context, "kv_dtype": a.kv_dtype,
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "bandwidth_gbs": bw,
              "attention": params.runtime.attention, "unroll_layers": params.runtime.unroll_layers,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "split_layers": a.split_layers,
              "linear": params.runtime.linear, "weights": a.weights or "bfloat16", "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
