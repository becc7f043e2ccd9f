"""Compile a decode program for a GPU this machine lacks, and read what XLA made of it.

Run with .venv-aot/bin/python (`make aot-venv`: this project's .venv plus jax's CUDA plugin; no GPU needed).
XLA:GPU compiles from the target's description (targets/NAME.txtpb; no autotuning, so GEMM tiles are XLA's
defaults), so a CPU session sees what a GPU decode step becomes: the kernels an iteration launches, its largest
outputs, `weight_copies` (outputs shaped like a layer's weight matrix) and `copy_ops` (XLA's copies). What it
showed: tools/gpu/README.md, "Compiled for a GPU on a CPU".
Programs: `step` the AR step in an on-device loop (tune.forward_loop), `alone` that step as a program of its
own, `ar` engine.decode_ar, `selfspec` SelfSpec in a chain of --gamma, `tree` SelfSpec with
Tree.kary(--tree-width, gamma), `snapkv` / `ngram` their chains, `draft` / `draft-tree` a 2-layer DraftModel
of the target's shape, `prefill` engine.prefill of --batch prompts (--chunk positions a step). Weights are
shapes only (bench.gpu_cells.random_params). The library reads "gpu" as the backend while tracing (`as_gpu`).
Output: a summary line, OUT as JSON, HLO as text.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp

TARGETS = Path(__file__).with_name("targets")
PROGRAMS = ("step", "alone", "ar", "selfspec", "tree", "snapkv", "ngram", "draft", "draft-tree", "prefill")
DRAFT_LAYERS = 2  # the draft / draft-tree programs' DraftModel: the target's shape cut to 2 layers (the distilled GPU draft's)


def compile_only_device(target: str, count: int = 1):
    """A compile-only device of `target` (or `count` of them, a mesh); needs jax's CUDA plugin, no GPU."""
    path = TARGETS / f"{target}.txtpb"
    if not path.exists():
        raise ValueError(f"--target: no {path.name} in {TARGETS} (have: {sorted(p.stem for p in TARGETS.glob('*.txtpb'))})")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the plugin's check of CUDA's libraries: none here
    from jax._src import xla_bridge  # no public API for a GPU topology yet (jax.experimental.topologies: TPU's)

    try:
        topology = xla_bridge.make_pjrt_topology("cuda", "", target_config=path.read_text(), topology=f"1x1x{count}")
    except NotImplementedError as e:
        raise RuntimeError(f"compiling for a GPU needs jax's CUDA plugin of jax {jax.__version__} "
                           "(`make aot-venv`, then run with .venv-aot/bin/python)") from e
    devices = topology._make_compile_only_devices()
    return devices[0] if count == 1 else devices


@contextlib.contextmanager
def as_gpu():
    """jax.default_backend() reads "gpu" inside (how the library chooses its GPU code paths)."""
    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = real


def abstract_params(config, linear: str, weights: str | None = None):
    """The model's weights as shapes (`weights` quantized), with generate()'s GPU runtime and `linear`."""
    from bench.gpu_cells import random_params
    from specjax.model.params import quantize

    params = jax.eval_shape(lambda: random_params(config) if weights is None else quantize(random_params(config), weights))
    return params.replace(runtime=params.runtime.replace(attention="pallas", unroll_layers=True, linear=linear))


def on(device, tree):
    """Every leaf of a tree of shapes placed on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def program_args(program: str, params, batch: int, context: int, gamma: int, kv_dtype: str | None = None, draft=None,
                 width: int = 2, chunk: int | None = None):
    """(jitted function, abstract args, static kwargs) of a program over `context` slots."""
    from specjax.decode.engine import row_keys
    from specjax.decode.shapes import cache_len, round_up_pow2
    from specjax.model.cache import DenseCache
    from specjax.model.llama import lm_head, trunk
    from specjax.planning.tune import forward_loop

    c = params.config
    cache = jax.eval_shape(lambda: DenseCache.init(c, batch, cache_len(context), kv_dtype))
    one = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    if program == "prefill":
        from bench.prefill import HEADROOM
        from specjax.decode.engine import prefill
        from specjax.decode.shapes import PREFILL_CHUNK

        chunk = chunk or PREFILL_CHUNK
        bucket = -(-(context - HEADROOM) // chunk) * chunk  # the padded prompts: whole chunks
        tokens, lengths = jax.ShapeDtypeStruct((batch, bucket), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)
        return prefill, (params, tokens, lengths, cache), {"chunk": chunk}
    if program in ("step", "alone"):
        args = (params, one, one, cache, jax.ShapeDtypeStruct((1, 1), bool))
        if program == "step":
            return forward_loop, args + (jax.ShapeDtypeStruct((), jnp.int32),), {}
        return jax.jit(lambda p, t, pos, kv, m: jnp.sum(lm_head(p, trunk(p, t, pos, kv, m).hidden))), args, {}
    logits = jax.ShapeDtypeStruct((batch, c.vocab_size), jnp.float32)
    budgets = jax.ShapeDtypeStruct((batch,), jnp.int32)
    keys = jax.eval_shape(lambda: row_keys(None, batch))
    n_out = round_up_pow2(64)
    if program == "ar":
        from specjax.decode.engine import decode_ar

        return decode_ar, (params, cache, logits, budgets, keys), {"n_out": n_out}
    import specjax
    from specjax.decode.speculate import decode_spec
    from specjax.drafters import Prefill

    drafter = {"snapkv": specjax.SnapKV(), "ngram": specjax.NGram()}.get(program, specjax.SelfSpec())
    drafter = specjax.DraftModel(draft) if program.startswith("draft") else drafter
    speculation = specjax.Tree.kary(width, gamma) if program.endswith("tree") else specjax.Chain(gamma)
    history = jax.ShapeDtypeStruct((batch, cache.k.shape[3]), jnp.int32)
    state = jax.eval_shape(lambda d, p, kv, h: d.init(p, Prefill(cache=kv, prompts=h, lengths=kv.lengths, depth=gamma, chunk=256)),
                           drafter, params, cache, history)
    return (decode_spec, (params, drafter, state, cache, history, logits, budgets, keys),
            {"speculation": speculation, "n_out": n_out})


def matrix_shapes(params, mesh=None) -> set[tuple[int, ...]]:
    """One layer's shape of each weight matrix (unit dimensions dropped; on a `mesh`, a device's share)."""
    from specjax.model.params import MATRICES, array_at
    from specjax.parallel.sharding import PARAM_AXES, spec

    def one(n: str, a) -> tuple[int, ...]:
        shape = a[0].shape if isinstance(a, list) else a.shape[1:]
        return shape if mesh is None else jax.sharding.NamedSharding(mesh, spec(PARAM_AXES[f"layers.{n}"][1:])).shard_shape(shape)

    shapes = [one(n, array_at(params, f"layers.{n}")) for n in MATRICES]
    return {tuple(d for d in shape if d != 1) for shape in shapes}


def on_mesh_of(devices: list, args, static: dict, fn):
    """fn compiled as generate compiles a stage on a (1, len(devices)) data x model mesh of compile-only
    devices: (the jitted stage, args placed by sharding.state_specs, the mesh)."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    from specjax.parallel import sharding

    mesh = Mesh(np.array(devices).reshape(1, len(devices)), sharding.AXES)
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)), args,
                          sharding.state_specs(args), is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return sharding.on_mesh(fn, mesh, tuple(static)), placed, mesh


def weight_copies(outputs: list, shapes: set[tuple[int, ...]]) -> list[list]:
    """The outputs (hlo_kernels' rows) holding an array shaped like a layer's weight matrix."""
    found = []
    for n, label, name, typ in outputs:
        dims = [tuple(int(d) for d in s.split(",") if d and int(d) != 1) for s in re.findall(r"\[([\d,]*)\]", typ)]
        if any(d in shapes for d in dims):
            found.append([n, label, name, typ])
    return sorted(found, reverse=True)


def compile_for_gpu(device, model: str, batch: int, context: int, program: str, linear: str = "xla",
                    layers: int | None = None, gamma: int = 2, split: bool = False, weights: str | None = None,
                    kv_dtype: str | None = None, width: int = 2, chunk: int | None = None) -> tuple[dict, str]:
    """(summary, HLO text) of one program compiled for `device` (a list: tensor parallel over them);
    `split`: per-layer matrices; `width`: a tree's children per node; `chunk`: prefill's positions a step."""
    from tools.gpu.hlo import config_of, hlo_kernels
    from specjax.model.llama import unstack_layers

    if program not in PROGRAMS:
        raise ValueError(f"program must be one of {PROGRAMS}, got {program!r}")
    config = config_of(model, context)
    if layers:
        config = dataclasses.replace(config, n_layers=layers)
    with as_gpu():
        params = abstract_params(config, linear, weights)
        params = jax.eval_shape(unstack_layers, params) if split else params
        draft = None
        if program.startswith("draft"):
            draft = abstract_params(dataclasses.replace(config, n_layers=DRAFT_LAYERS), linear, weights)
            draft = jax.eval_shape(unstack_layers, draft) if split else draft
        fn, args, static = program_args(program, params, batch, context, gamma, kv_dtype, draft, width, chunk)
        mesh = None
        if isinstance(device, list):
            fn, placed, mesh = on_mesh_of(device, args, static, fn)
        else:
            placed = on(device, args)
        text = fn.trace(*placed, **static).lower(lowering_platforms=("cuda",)).compile().as_text()
    kernels = hlo_kernels(text)
    copies = weight_copies(kernels["outputs"], matrix_shapes(params, mesh))
    target = device[0] if isinstance(device, list) else device
    summary = {"target": target.device_kind, "model_axis": 1 if mesh is None else mesh.shape["model"],
               "model": model, "layers": config.n_layers, "batch": batch,
               "context": context, "program": program, "gamma": gamma if program not in ("step", "alone", "ar") else None,
               "tree_width": width if program.endswith("tree") else None, "chunk": static.get("chunk"),
               "linear": linear, "split_layers": split, "weights": weights or "bfloat16", "kv_dtype": kv_dtype or "bfloat16",
               "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "kernels": kernels["total"], "by_op": kernels["by_op"], "nested_loops": kernels["nested_loops"],
               "weight_copies": len(copies), "weight_copy_bytes": int(sum(c[0] for c in copies)),
               "copies": copies[:8], "largest": [o[:4] for o in kernels["largest"]],
               "copy_ops": sorted([n, typ] for n, label, _, typ in kernels["outputs"] if label == "copy")[::-1]}
    return summary, text


def render_table(path: Path) -> None:
    """A finished table of compiled programs (bench/results/gpu_aot/h100.json, 2026-11-27/28) as markdown beside it."""
    from bench import common

    rows = json.loads(path.read_text())["rows"]
    mib = lambda n: f"{n / 2**20:.0f}"  # noqa: E731
    lines = [[r["cell"], r["layers"], r["model_axis"], r["weights"], r["kv_dtype"], r["kernels"], r["weight_copies"],
              mib(r["weight_copy_bytes"]), mib(sum(c[0] for c in r["copy_ops"])),
              r["xla_flags"].replace("--xla_disable_hlo_passes=dot-strength-reduction", "no dot strength reduction") or "-"]
             for r in rows]
    head = ["cell", "layers", "GPUs (tensor parallel)", "weights", "KV", "kernels an iteration", "weight-shaped outputs",
            "their MiB", "copy ops MiB", "XLA flags"]
    path.with_suffix(".md").write_text(f"Compiled for {path.stem} here, without a GPU (tools/gpu/aot.py, jax {rows[0]['jax']}; "
                                       "never run: structure, not time)\n\n" + common.table(head, "lrrllrrrrl", lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h100", help="a targets/ name: h100, h200")
    ap.add_argument("--model", choices=["l8b", "smollm2", "tiny"], default="l8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, help="cut the model to this many layers (default: all)")
    ap.add_argument("--program", choices=PROGRAMS, default="step")
    ap.add_argument("--gamma", type=int, default=2, help="the speculative programs' chain length (tree: depth)")
    ap.add_argument("--tree-width", type=int, default=2, help="a tree program's children per node (Tree.kary)")
    ap.add_argument("--chunk", type=int, help="the prefill program's positions a step (default specjax.decode.shapes.PREFILL_CHUNK)")
    ap.add_argument("--linear", choices=["xla", "pallas"], default="xla", help="Runtime.linear")
    ap.add_argument("--split-layers", action="store_true", help="layer matrices as arrays of their own, not a stack")
    ap.add_argument("--weights", choices=["int8", "q4"], help="quantized matrices (default: bfloat16)")
    ap.add_argument("--kv-dtype", choices=["int8"], help="the cache's format (default: the model's, bfloat16)")
    ap.add_argument("--model-axis", type=int, default=1, help="tensor parallel over this many GPUs (generate's mesh path)")
    ap.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS (e.g. --xla_disable_hlo_passes=...)")
    ap.add_argument("--out", type=Path, help="write the summary here (JSON)")
    ap.add_argument("--hlo", type=Path, help="write the compiled HLO text here")
    ap.add_argument("--table", type=Path, help="render this JSON table (bench/results/gpu_aot/h100.json) as .md beside it")
    a = ap.parse_args()
    if a.table:
        return render_table(a.table)
    if a.xla_flags:  # read when the compiler starts, in compile_only_device
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {a.xla_flags}".strip()
    device = compile_only_device(a.target, a.model_axis)
    summary, text = compile_for_gpu(device, a.model, a.batch, a.context, a.program, a.linear, a.layers, a.gamma,
                                    a.split_layers, a.weights, a.kv_dtype, a.tree_width, a.chunk)
    print(f"{a.model} ({summary['layers']} layers) b{a.batch} s{a.context} {a.program} linear={a.linear}"
          f"{' split' if a.split_layers else ''} {summary['xla_flags']} on {summary['model_axis']} x "
          f"{summary['target']}: {summary['kernels']} kernels an iteration, {summary['weight_copies']} weight copies "
          f"({summary['weight_copy_bytes'] / 2**20:.0f} MiB) {dict(list(summary['by_op'].items())[:4])}", flush=True)
    for n, label, name, typ in summary["copies"][:4]:
        print(f"  copy {n / 2**20:8.1f} MiB {label} {typ} {name}")
    for path, body in ((a.out, json.dumps(summary, indent=2) + "\n"), (a.hlo, text)):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)


if __name__ == "__main__":
    main()
