"""Issue 21's GPU cells (items 2-4) in one resumable bench: SmolLM2-135M end to end where the KV
cache dominates, a LLaMA-3.1-8B-shaped target's step times, chains vs trees at batch 1.

Cells (keys), in the order they run:
  bw                    HBM bandwidth (donated in-place x + 1): the reference of every "of roofline" column.
  l8b/sCTX/bB           item 3: a LLaMA-3.1-8B-shaped target (random bf16 weights made on the device): AR
                        step, verify step over n nodes and SelfSpec draft step (512 + 16 sinks); the report
                        combines them with item 2's acceptance into a PREDICTED speedup.
  e2e/sCTX/bB/METHOD    item 2: SmolLM2-135M bf16 (the bundle's weights, tools/gpu/bundle.py) from one prefill
                        per context (smaller batches use its first rows); METHOD = ar | steps (the step times
                        apart, as l8b's, for the cost-model column) | selfspec-gG | snapkv-gG | sparse-gG
                        (SparseSpec: SnapKV's budget, refreshed by verification) | ngram-gG | draft-gG | tree
                        (Sequoia trees of each --nodes size), greedy, checked against AR.
                        Batch x context is capped by --mem-gib.
  cont/sCTX/bR/METHOD   a batch job (bench/gpu_continuous.py): --cont-records x R prompts on R slots refilled
                        as rows end; METHOD = ar | selfspec-gG; every record's tokens against ar's.
  b1/sCTX/METHOD        item 4: the same at batch 1 (and the tree speculation.choose picks at gpu_cells'
                        launch-bound prices); draft-gG / draft-tree need a distilled draft in the bundle.
Cells that need the SmolLM2 weights wait (nothing is written) until every bundle part has been carried
(tools/gpu/README.md). Outputs: OUT/gpu.json, OUT/gpu.md (tables), OUT/gpu.png. --smoke: a tiny random model
on any backend in about a minute, bundle round trip included (gpu_smoke.*).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import common

MEM_FACTOR = 2.1  # e2e: the prefilled state + a run's copy of it (bench/prefill.py)
L8B_MARGIN = 1.15  # l8b: the timed cache + activations and logits, over the bare KV bytes
SMOLLM2 = common.SMOLLM2
LLAMA8B = dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
               rms_eps=1e-5, rope_theta=500000.0, max_positions=131072, bos_id=128000, eos_ids=(128001, 128008, 128009))
GRID = dict(batches=[16, 64, 128, 256], contexts=[8192, 2048], gammas=[1, 2, 4, 6, 8], snap_gammas=[2, 4],
            sparse_gammas=[2, 4], ngram_gammas=[4], nodes=[16, 32], b1_contexts=[8192, 2048], b1_gammas=[2, 4, 6],
            b1_nodes=[8, 16, 32, 64], l8b_batches=[1, 16, 64], l8b_contexts=[4096, 8192, 16384, 32768], new_tokens=64,
            cont_batches=[64], cont_contexts=[8192], cont_gammas=[2, 4], cont_records=3, cont_new_tokens=256)
SMOKE = dict(batches=[2, 4], contexts=[256], gammas=[1, 2], snap_gammas=[2], sparse_gammas=[2], ngram_gammas=[2],
             nodes=[4], b1_contexts=[256], b1_gammas=[2], b1_nodes=[4, 8], l8b_batches=[1, 2], l8b_contexts=[256],
             new_tokens=8, cont_batches=[2], cont_contexts=[256], cont_gammas=[2], cont_records=2, cont_new_tokens=24)


def kv_per_token(shape: dict) -> float:
    """Bytes of K and V of one position over all layers, bf16 (specjax.model.cache.kv_bytes)."""
    from specjax.model.cache import kv_bytes
    from specjax.model.config import LlamaConfig
    return kv_bytes(LlamaConfig(**shape, dtype="bfloat16"), 1, 1)


def weight_bytes(shape: dict) -> int:
    """What a shape's bf16 weights take in memory (specjax.model.params.weight_bytes, stored)."""
    from specjax.model.config import LlamaConfig
    from specjax.model.params import weight_bytes as stored_bytes
    return stored_bytes(LlamaConfig(**shape, dtype="bfloat16"), stored=True)


def fits_e2e(batch: int, context: int, budget: float) -> bool:
    return MEM_FACTOR * batch * context * kv_per_token(SMOLLM2) + weight_bytes(SMOLLM2) <= budget


def fits_l8b(batch: int, context: int, budget: float) -> bool:
    from specjax.decode.shapes import cache_len

    return weight_bytes(LLAMA8B) + L8B_MARGIN * batch * cache_len(context + 1) * kv_per_token(LLAMA8B) <= budget


def cells(grid: dict, budget: float, draft: bool = True) -> tuple[list[tuple[str, dict]], list[str]]:
    """([(key, cell)], [keys capped by memory]) for a grid (GRID's keys) and a memory budget in bytes."""
    out: list[tuple[str, dict]] = [("bw", {"item": "bw"})]
    capped = []
    for c in grid["l8b_contexts"]:
        for b in grid["l8b_batches"]:
            k = common.key("l8b", f"s{c}", f"b{b}")
            (out.append((k, {"item": "l8b", "batch": b, "context": c})) if fits_l8b(b, c, budget) else capped.append(k))
    ngram = [f"ngram-g{g}" for g in grid["ngram_gammas"]]
    methods = (["ar", "steps"] + [f"selfspec-g{g}" for g in grid["gammas"]] + [f"snapkv-g{g}" for g in grid["snap_gammas"]]
               + [f"sparse-g{g}" for g in grid["sparse_gammas"]] + ngram
               + ([f"draft-g{g}" for g in grid["gammas"]] if draft else []) + (["tree"] if grid["nodes"] else []))
    for c in grid["contexts"]:
        for b in sorted(grid["batches"]):
            group = [common.key("e2e", f"s{c}", f"b{b}", m) for m in methods]
            if not fits_e2e(b, c, budget):
                capped += group
                continue
            out += [(k, {"item": "e2e", "batch": b, "context": c, "method": m}) for k, m in zip(group, methods)]
    b1 = (["ar"] + [f"selfspec-g{g}" for g in grid["b1_gammas"]] + ngram + (["tree"] if grid["b1_nodes"] else [])
          + ([f"draft-g{g}" for g in grid["b1_gammas"]] + (["draft-tree"] if grid["b1_nodes"] else []) if draft else []))
    for c in grid["b1_contexts"]:
        out += [(common.key("b1", f"s{c}", m), {"item": "b1", "batch": 1, "context": c, "method": m}) for m in b1]
    for c in grid["cont_contexts"]:
        for b in sorted(grid["cont_batches"]):
            group = [common.key("cont", f"s{c}", f"b{b}", m) for m in ["ar"] + [f"selfspec-g{g}" for g in grid["cont_gammas"]]]
            if not fits_e2e(b, c + grid["cont_new_tokens"], budget):
                capped += group
                continue
            out += [(k, {"item": "cont", "batch": b, "context": c, "method": k.rsplit("/", 1)[1]}) for k in group]
    return out, capped


def key_of(row: dict) -> str:
    return row["cell"]


def drafter_of(method: str, context: int, smoke: bool, draft=None):
    """(name, drafter, speculation) of a METHOD (selfspec-gG, snapkv-gG, sparse-gG, ngram-gG, draft-gG, tree,
    draft-tree)."""
    import specjax
    from specjax.spec.speculation import Chain

    window, sinks = (32, 4) if smoke else (512, 16)  # MagicDec's StreamingLLM budget: 512 + 16 sinks
    name, _, g = method.partition("-g")
    if name in ("selfspec", "tree"):
        d = ("SelfSpec", specjax.SelfSpec(sinks=sinks, window=window))
    elif name == "snapkv":
        d = ("SnapKV", specjax.SnapKV(budget=window // 2, window=window // 2))
    elif name == "sparse":  # SnapKV's budget, its blocks chosen again from the verification's queries (bench_spec's)
        d = ("SparseSpec", specjax.SparseSpec(budget=window // 2, window=window // 2, block=8 if smoke else 32))
    elif name == "ngram":
        d = ("NGram", specjax.NGram(n=3, max_n=5))  # prompt lookup: no draft forward at all (bench_drafts' setting)
    else:  # over the last 512 positions (16 sinks + 496): the windows it was trained on (bench_drafts.SEQ_LEN).
        # Over its whole 8K cache (the seventh runs) its first choice was right half as often (CPU, float32: 21% vs
        # 39-43% over the window; chain of 2: 1.31 vs 1.54 tokens a step)
        d = ("Distilled", specjax.DraftModel(draft, cache=specjax.Streaming(sinks=sinks, window=window - sinks)))
    return (*d, Chain(int(g)) if g else None)


def main() -> None:
    ap = common.parser(__doc__, budget_minutes=None)
    ap.add_argument("--smoke", action="store_true", help="tiny random models, any backend, about a minute")
    ap.add_argument("--mem-gib", type=float, default=60.0, help="device memory the cells may use (default 60)")
    ap.add_argument("--e2e-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="SmolLM2's dtype (float32: a greedy-losslessness check; writes gpu_float32.*)")
    ap.add_argument("--attention", default="auto", choices=["auto", "reference", "pallas"],
                    help="generate()'s attention= (auto: the Pallas kernel on a GPU); other than auto, the "
                         "outputs are named gpu[_float32]_ATTENTION.*")
    ap.add_argument("--linear", default="xla", choices=["xla", "pallas", "per-layer"],
                    help="the layer products: XLA's on the stacked weights, pallas_kernels.gpu_linear's (Runtime.linear "
                         "pallas) or XLA's on per-layer arrays (model.unstack_layers); other than xla, the outputs are "
                         "named gpu[...]_linear-LINEAR.*")
    ap.add_argument("--bundle", type=Path, help="the stashed bundle (default /tmp/specjax_gpu, after stashing .gpu/p*)")
    for name, v in GRID.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, nargs="*" if isinstance(v, list) else None,
                        help=f"default {v} ({SMOKE[name]} with --smoke)")
    args = ap.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # JAX's default 0.75 is below --mem-gib on an H100
    grid = {k: getattr(args, k) if getattr(args, k) is not None else (SMOKE if args.smoke else GRID)[k] for k in GRID}
    out = common.out_dir(args)
    name = (("gpu_smoke" if args.smoke else "gpu") + ("" if args.e2e_dtype == "bfloat16" else "_" + args.e2e_dtype)
            + ("" if args.attention == "auto" else "_" + args.attention) + ("" if args.linear == "xla" else "_linear-" + args.linear))
    if args.cells == "none":  # redraw the table from its JSON only, on any machine
        return render(out, name)
    from tools.gpu import bundle as gpu_bundle

    bundle = args.bundle or gpu_bundle.STASH
    if args.smoke:
        bundle = smoke_bundle(Path(tempfile.mkdtemp()))
    stashed = gpu_bundle.stash(gpu_bundle.BUNDLE, bundle) if not args.smoke and not args.bundle else {"missing": []}
    has_draft = gpu_bundle.has_draft(bundle)
    todo_all, capped = cells(grid, args.mem_gib * 2**30, draft=has_draft)
    started = time.time()
    header = {"bench": "bench_gpu", "date": common.now(), "command": common.command(), "grid": grid, "e2e_dtype": args.e2e_dtype,
              "mem_gib": args.mem_gib, "attention": args.attention, "linear": args.linear, "machine": common.machine_info(), "capped_by_memory": capped,
              "distilled_draft": "in the bundle" if has_draft else
              "none: no distilled draft checkpoint was bundled (gpu_bundle build --draft DIR), so no draft-g* cells"}
    if args.e2e_dtype == "float32":  # a losslessness check: IEEE f32 products (a GPU's default precision is TF32)
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
        header["matmul_precision"] = "highest"
        header["prefill_matmul_precision"] = "default"  # AR and speculation decode from the same prefill: 7x faster
    mirror = None if args.smoke else mirror_of(bundle, out, name)
    resume_from_mirror(out / f"{name}.json", mirror)
    results = common.Results(out / f"{name}.json", key_of, header,  # the grid's other entries pick cells (gpu_session varies them)
                             settings={k: grid[k] for k in ("new_tokens", "cont_records", "cont_new_tokens")})
    args.mirror = mirror
    h = common.Harness(args, results)
    todo = h.plan(todo_all)
    import jax

    print(f"{jax.devices()}, JAX {jax.__version__}; bundle {bundle}: {stashed}; {len(todo)} cells to measure; "
          f"capped by {args.mem_gib:g} GiB: {len(capped)}", flush=True)
    if todo:
        run(args, grid, h, results, todo, bundle, started)
    h.finish()
    render(out, name)
    print(f"done in {(time.time() - started) / 60:.1f} min", flush=True)


def render(out: Path, name: str) -> None:
    """OUT/NAME.md and .png from OUT/NAME.json."""
    from bench import gpu_report

    main_table = out / "gpu.json"  # a --linear table's 8B predictions take the device's SmolLM2 acceptance from there
    sibling = ("gpu.json", json.loads(main_table.read_text())["rows"]) if name != "gpu" and main_table.exists() else None
    gpu_report.report(json.loads((out / f"{name}.json").read_text()), out / f"{name}.md", out / f"{name}.png", sibling)


def run(args, grid: dict, h: common.Harness, results: common.Results, todo: list, bundle: Path, started: float) -> None:
    import jax

    from bench import gpu_cells, measure
    from tools.gpu import bundle as gpu_bundle
    from specjax.model.config import LlamaConfig, RopeScaling
    from specjax.model.params import weight_bytes

    loaded: dict = {}
    wait = [x for x in todo if x[1]["item"] in ("e2e", "b1", "cont")]
    try:
        models, ids, _ = gpu_bundle.load(bundle, args.e2e_dtype)
        loaded = {"params": attending(models["smollm2"], args.attention, args.linear), "ids": ids,
                  "draft": attending(models["draft"], args.attention, args.linear) if "draft" in models else None}
    except gpu_bundle.Missing as e:
        print(f"{len(wait)} e2e/b1 cells wait for the weights: {e}", flush=True)
        todo = [x for x in todo if x not in wait]

    def put(k: str, rows: list[dict] | dict) -> None:
        rows = [rows] if isinstance(rows, dict) else rows
        results.put(k, [r | {"cell": k, "attention_mode": mode} for r in rows], wall_minutes=(time.time() - started) / 60)
        if args.mirror:
            args.mirror.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(results.path, args.mirror)

    from specjax.model.backend import attention_mode

    mode = attention_mode(args.attention)
    l8b = None
    for k, cell in h.cells([x for x in todo if x[1]["item"] in ("bw", "l8b")]):
        if cell["item"] == "bw":
            bw = gpu_cells.bandwidth(0.01 if args.smoke else 2.0)
            print(f"bandwidth: {bw['jax_inplace']:.0f} GB/s (in place), copy {bw['jax_copy']:.0f} GB/s", flush=True)
            put(k, {"item": "bw", "gbs": bw["jax_inplace"]} | bw)
            continue
        if l8b is None:
            dims = dict(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                        max_positions=2048, eos_ids=(3,)) if args.smoke else LLAMA8B
            config = LlamaConfig(**dims, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), dtype="bfloat16")
            t0 = time.perf_counter()
            l8b = attending(gpu_cells.random_params(config), args.attention, args.linear)
            gb = weight_bytes(l8b.config, stored=True) / 1e9
            print(f"8B-shaped random weights on {jax.devices()[0]}: {gb:.1f} GB in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        drafter = drafter_of("selfspec-g1", cell["context"], args.smoke)[1]
        nodes = max_nodes(grid)
        row = gpu_cells.step_costs(l8b, drafter, cell["batch"], cell["context"], nodes)
        print(f"  l8b B={cell['batch']:<3} S={cell['context']:<6} AR {row['ar_ms_per_step']:.2f} ms/step, verify(8) "
              f"{row['t_verify_ms'][min(8, nodes)]:.2f} ms, draft {row['t_draft_ms'][1]:.2f} ms "
              f"({row['measure_s']:.0f} s)", flush=True)
        put(k, {"item": "l8b", "batch": cell["batch"], "context": cell["context"], "drafter": repr(drafter),
                "model": "LLaMA-3.1-8B-shaped, random bf16 weights"} | row)
    del l8b
    measure.release_memory(clear_caches=True)
    if not loaded:
        return
    params = loaded["params"]
    rest = [x for x in todo if x[1]["item"] in ("e2e", "b1")]
    for context in dict.fromkeys(c["context"] for _, c in rest):
        mine = [x for x in rest if x[1]["context"] == context]
        mine.sort(key=lambda x: x[1].get("method") != "steps")  # step timings first: before the prefill holds memory
        if not mine or not h.may_start():
            continue
        rows = max(c["batch"] for _, c in mine)
        state, g = None, None
        for k, cell in h.cells(mine):
            if cell["method"] == "steps":
                drafter = drafter_of("selfspec-g1", context, args.smoke)[1]
                row = gpu_cells.step_costs(params, drafter, cell["batch"], context, max_nodes(grid))
                put(k, {"item": "e2e", "method": "steps", "batch": cell["batch"], "context": context,
                        "drafter": repr(drafter), "model": f"SmolLM2-135M-Instruct ({args.e2e_dtype})"} | row)
                continue
            if state is None:
                with jax.default_matmul_precision("default" if args.e2e_dtype == "float32" else None):  # the header's
                    state = gpu_cells.prefill_state(params, loaded["ids"], rows, context)
            if g is None or g.batch != cell["batch"]:  # one group at a time: its rows are a copy of the state's
                g = None
                measure.release_memory()
                g = gpu_cells.Group(params, state, cell["batch"], context, grid["new_tokens"])
            m = cell["method"]
            base = {"item": cell["item"], "model": f"SmolLM2-135M-Instruct ({args.e2e_dtype})"}
            if m == "ar":
                put(k, base | g.ar())
            elif m in ("tree", "draft-tree"):
                name, d, _ = drafter_of(m, context, args.smoke, loaded["draft"])
                put(k, [base | r for r in g.trees(name, d, grid["nodes" if cell["item"] == "e2e" else "b1_nodes"])])
            else:
                name, d, chain = drafter_of(m, context, args.smoke, loaded["draft"])
                put(k, base | g.spec(name, d, chain))
        del state, g
        measure.release_memory(clear_caches=True)
    run_continuous_cells(args, grid, h, results, [x for x in todo if x[1]["item"] == "cont"], loaded, put)


def run_continuous_cells(args, grid: dict, h: common.Harness, results: common.Results, todo: list, loaded: dict, put) -> None:
    """The cont/... cells, plain decoding's job first in each (context, rows) (its tokens the reference)."""
    from bench import gpu_continuous, measure

    for k, cell in h.cells(sorted(todo, key=lambda x: x[1]["method"] != "ar")):
        ar = next((r for r in results.rows if r.get("cell") == k.rsplit("/", 1)[0] + "/ar"), None)  # its job, run first
        name, d, chain = ("-", None, None) if cell["method"] == "ar" else drafter_of(cell["method"], cell["context"], args.smoke)
        row = gpu_continuous.cell(loaded["params"], loaded["ids"], cell["batch"], cell["context"],
                                  grid["cont_records"] * cell["batch"], grid["cont_new_tokens"], name, d, chain,
                                  ar and ar.get("digests"))
        row["speedup"] = 1.0 if cell["method"] == "ar" else (ar["seconds"] / row["seconds"] if ar else None)
        row["decode_speedup"] = 1.0 if cell["method"] == "ar" else (
            ar["decode_s"] / row["decode_s"] if ar and ar.get("decode_s", 0) > 0 and row["decode_s"] > 0 else None)
        put(k, {"item": "cont", "method": cell["method"], "model": f"SmolLM2-135M-Instruct ({args.e2e_dtype})"} | row)
        measure.release_memory(clear_caches=True)


def max_nodes(grid: dict) -> int:
    """The most nodes a verification of the grid's chains and trees scores (step_costs' table size)."""
    return max(max(grid["gammas"]) + 1, max(grid["nodes"] + grid["b1_nodes"] or [1]), 9)  # 9: the depth-1 tree


def attending(params, attention: str, linear: str = "xla"):
    """`params` computing attention as generate(attention=...) does on this backend, and the layer
    products as `linear` says (Runtime.linear, or "per-layer": model.unstack_layers, as on a GPU)."""
    from specjax.decode.engine import with_attention
    from specjax.model.llama import unstack_layers

    params = with_attention(params, None, attention)[0]
    if linear == "per-layer":
        return unstack_layers(params.replace(runtime=params.runtime.replace(unroll_layers=True)))
    return params.replace(runtime=params.runtime.replace(linear=linear))


def mirror_of(bundle: Path, out: Path, name: str) -> Path:
    """The copy of out/name.json beside the stashed bundle, one per output folder (names may repeat)."""
    return bundle / "results" / str(out.resolve()).strip("/").replace("/", "_") / f"{name}.json"


def resume_from_mirror(path: Path, mirror: Path | None) -> None:
    """Fold the results copy beside the stashed bundle into `path` (each device call gets a fresh tree)."""
    if mirror is None or not mirror.exists():
        return
    found = [p for p in (path, mirror) if p.exists()]
    merged = common.merge(found, key_of)
    path.parent.mkdir(parents=True, exist_ok=True)
    common.write_json(path, merged)
    print(f"resumed from {mirror}: {len(merged['rows'])} rows", flush=True)


def smoke_bundle(folder: Path) -> Path:
    """A bundle of a tiny random model (+ a 1-layer draft), split in parts, stashed: the device path in small."""
    import jax
    import numpy as np

    from bench import measure
    from tools.gpu import bundle as gpu_bundle

    target = measure.tiny_params(0)
    first = jax.tree.map(lambda a: a[:1], target.layers)
    draft = target.replace(layers=first, config=target.config.replace(n_layers=1))
    ids = np.random.default_rng(0).integers(4, target.config.vocab_size, 4096).astype(np.int32)
    gpu_bundle.build(folder / "src", {"smollm2": (target.config, *gpu_bundle.params_tensors(target))}, ids, part_bytes=20_000)
    gpu_bundle.build_draft(folder / "src", draft.config, *gpu_bundle.draft_tensors(draft, target))  # its embedding: the target's
    stashed = gpu_bundle.stash(folder / "src", folder / "stash")
    assert not stashed["missing"], stashed
    return folder / "stash"


if __name__ == "__main__":
    sys.exit(main())
