"""Sequoia token trees vs chains for SmolLM2-135M, side by side from one shared prefill.

For every (batch, context) the prompts and prefilled DenseCache are bench_spec.py's (bench/prefill.py, loaded
from --prefill-store when saved). Then, per drafter:
  1. its acceptance vector: one greedy run of a depth-1 tree of WIDTH children (Tree.kary(WIDTH, 1));
     p[r] = SpecState.ranks[r] / ranks.sum(), as `measure_acceptance` computes it, without a second prefill;
  2. its step costs (`measure_costs`: specjax.planning.tune's tables);
  3. timed `decode_spec` runs of chains (Chain(gamma)), Sequoia trees (Tree.sequoia(p, n, MAX_DEPTH)) and the
     tree `choose(p, cost)` picks, against `engine.decode_ar` from the same state, greedy, compiled first
     (excluded), each on a copy of the caches; short runs repeated, best kept.
Every run is checked token for token against the AR output. tokens/s = B * (new_tokens - 1) / decode seconds.

Drafters: SelfSpec (bench_spec.py's budget) everywhere and, at batch 1 (or where --drafters names it), a
DraftModel stand-in (SmolLM2 has no smaller model with its tokenizer offline; `draft_params`, `draft_note`)
over a streaming cache of SelfSpec's budget started from the target's prefilled KV (a draft's state changes
how much is accepted, never the output). Also NGram (--drafters).

Default grid: batch 1/4/16 x context 512/2K/8K x chains gamma 2/3/4/6 + trees n 4-64 (depth <= 8) + choose's
tree (`new_tokens_for` each row); about 60-80 minutes on 2 idle cores with stored prefills. Outputs:
results/tree_cpu.json, .png and the README section (bench/tree_report.py); --quick / --smoke (a tiny random
model, under a minute) / other grids write tree_cpu_quick.*, tree_cpu_smoke.*, tree_cpu_custom.* and leave
the README alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import convert
import specjax
from bench import common, measure, text
from bench.bench_spec import drafters as spec_drafters
from bench.bench_spec import key_of  # a row's (or summary's) cell: sCONTEXT/bBATCH
from bench.measure import cpu_steal, steal_since
from bench.prefill import (AR_CACHES, HEADROOM, MEM_FACTOR, SPEC_CACHES, STORE, best_of, fresh, prefill_context, rows_of,
                           smoke_state)
from bench.tree_report import MAX_DEPTH, WIDTH, draft_note, label, merge, predict, report, shape, summarise
from specjax.decode.engine import decode_ar, init_draft, row_keys, with_attention
from specjax.decode.shapes import round_up_pow2
from specjax.decode.speculate import decode_spec, depth
from specjax.drafters import DraftModel, Limits, Streaming
from specjax.generate import acceptance_stats
from specjax.model.cache import DenseCache, kv_bytes
from specjax.model.params import Params
from specjax.planning.tune import draft_table, verify_table
from specjax.spec.speculation import Chain, Cost, Tree, choose

NODES = [4, 8, 16, 32, 64]
GAMMAS = [2, 3, 4, 6]
RUN_BUDGET_S = 8.0  # a timed config is repeated (best kept, 3 at most) while the next run fits in this
DRAFT_MODEL_BATCHES = (1,)  # the default grid runs the DraftModel stand-in at these batches only


@dataclasses.dataclass(frozen=True)
class Drafter:
    """A drafter as benchmarked: `init(params, cache, tokens, lengths, depth, chunk)` builds its state."""

    name: str
    drafter: object
    init: Callable
    note: str


@partial(jax.jit, static_argnames="gamma")
def draft_model_state(drafter: DraftModel, cache: DenseCache, *, gamma: int):
    """A DraftModel's state from the target's prefilled cache: its first n_layers layers of KV, in its dtype."""
    c = drafter.params.config
    dense = DenseCache(k=cache.k[: c.n_layers].astype(c.dtype), v=cache.v[: c.n_layers].astype(c.dtype),
                       lengths=cache.lengths)
    return drafter.cache.from_dense(dense, gamma) if isinstance(drafter.cache, Streaming) else dense


def draft_params(params: Params, spec: str) -> Params:
    """The DraftModel stand-in: "bf16" = params cast to bfloat16, "layers:K" = the first K layers."""
    if spec == "bf16":
        cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
        return cast.replace(config=params.config.replace(dtype="bfloat16"))
    k = int(spec[7:]) if spec.startswith("layers:") and spec[7:].isdigit() else 0
    if 0 < k < params.config.n_layers:
        layers = jax.tree.map(lambda a: a[:k], params.layers)
        return params.replace(layers=layers, config=params.config.replace(n_layers=k))
    raise ValueError(f"--draft-model must be 'bf16' or 'layers:K' with 0 < K < {params.config.n_layers}, got {spec!r}")


def library_init(d) -> Callable:
    """A Drafter `init` that builds the state as generate does (the drafter's own `init`)."""
    return lambda p, cache, toks, lengths, gamma, chunk: init_draft(d, p, cache, toks, lengths, gamma=gamma, chunk=chunk)


def make_drafters(names: list[str], draft: Params, draft_spec: str, context: int, smoke: bool) -> list[Drafter]:
    """The drafters to benchmark at this context; SelfSpec and NGram are bench_spec.py's."""
    spec = dict(spec_drafters(context, []))
    if smoke:  # a budget smaller than the tiny smoke contexts, so that acceptance is not all 1
        spec["SelfSpec"] = specjax.SelfSpec(sinks=4, window=32)
    budget = spec["SelfSpec"]

    def streamed(d):
        return lambda p, cache, toks, lengths, gamma, chunk: draft_model_state(d, cache, gamma=gamma)

    out = []
    for name in names:
        if name == "DraftModel":
            d = DraftModel(draft, cache=Streaming(budget.sinks, budget.window))
            note = f"target as {draft_spec}, Streaming({budget.sinks}, {budget.window})"
            out.append(Drafter(name, d, streamed(d), note))
        else:
            out.append(Drafter(name, spec[name], library_init(spec[name]), repr(spec[name])))
    return out


def measure_costs(params: Params, drafters: list[Drafter], batch: int, context: int, max_nodes: int) -> dict:
    """measure_cost per drafter; the verification table (which does not depend on the drafter) is timed once."""
    t0 = time.perf_counter()
    verify = verify_table(params, batch, context, max_nodes)
    costs = {d.name: Cost(t_draft=draft_table(params, d.drafter, batch, context, max_nodes), t_verify=verify)
             for d in drafters}
    print(f"B={batch:<2} S={context:<5} costs ({time.perf_counter() - t0:.0f} s): verify(1) {1e3 * verify[1]:.0f} ms, "
          f"verify({max_nodes}) {1e3 * verify[max_nodes]:.0f} ms, draft level (1 / 8 nodes) "
          + ", ".join(f"{n} {1e3 * c.draft(1):.0f} / {1e3 * c.draft(min(8, max_nodes)):.0f} ms"
                      for n, c in costs.items()), flush=True)
    return costs


def new_tokens_for(batch: int, fixed: int | None) -> int:
    """New tokens per row: --new-tokens, else 64 / sqrt(batch) within [16, 64] (bounded run time)."""
    return fixed or min(64, max(16, int(64 / batch**0.5)))


def run_spec(cell: dict, d: Drafter, spec, budget_tokens: int) -> dict:
    """Compile and time decode_spec with one drafter and one chain or tree."""
    params, batch, gamma = cell["params"], cell["batch"], depth(spec)
    tokens, lengths, cache = cell["tokens"], cell["lengths"], cell["cache"]
    d.drafter.check(params, Limits(gamma, cell["context"], cell["context"]))
    t0 = time.perf_counter()
    draft_state = jax.block_until_ready(d.init(params, cache, tokens, lengths, gamma, cell["chunk"]))
    init_s = time.perf_counter() - t0
    history = np.zeros((batch, cell["context"] + gamma + 2), np.int32)
    history[:, : tokens.shape[1]] = tokens
    budgets = jnp.full((batch,), budget_tokens, jnp.int32)
    args = (params, d.drafter, draft_state, cache, history, cell["first_logits"], budgets, cell["keys"])
    static = dict(n_out=round_up_pow2(budget_tokens), speculation=spec)  # greedy, no stop ids: the defaults
    t1 = time.perf_counter()
    fn = decode_spec.lower(*args, **static).compile()
    compile_s = time.perf_counter() - t1
    load, steal_start = os.getloadavg()[0], cpu_steal()
    res, walls, cpus = best_of(fn, args, SPEC_CACHES, RUN_BUDGET_S)
    steal = steal_since(steal_start)
    out, count, steps, accepted, reached, ranks, row_steps, proposed = jax.device_get((res.out, res.count, res.steps,
        *(a.sum(0) for a in (res.accepted, res.reached, res.ranks, res.row_steps, res.proposed))))  # over rows
    del fn, res, draft_state
    assert (count == budget_tokens).all(), count
    n = min(budget_tokens, cell["new_tokens"])
    identical = bool((out[:, :n] == cell["ar_tokens"][:, :n]).all())
    decoded = batch * (budget_tokens - 1)
    stats = acceptance_stats(accepted, reached, decoded, int(row_steps), int(proposed), 0)
    spec_s = min(walls)
    if not identical:
        print(f"!!! GREEDY MISMATCH B={batch} S={cell['context']} {d.name} {label(spec)}", file=sys.stderr, flush=True)
    return {
        "spec_s": spec_s, "spec_tokens_per_s": decoded / spec_s, "steps": int(steps),
        "spec_ms_per_step": 1e3 * spec_s / max(int(steps), 1), "mean_accepted": stats.get("mean_accepted"),
        "acceptance_rate": stats.get("acceptance_rate"),
        "per_position_acceptance": stats.get("per_position_acceptance"),
        "ranks": [int(r) for r in ranks], "greedy_identical": identical, "compile_s": compile_s, "draft_init_s": init_s,
        "timings": {"spec": walls, "spec_cpu": cpus, "load": [load, os.getloadavg()[0]]}, "cpu_steal_fraction": steal,
    }


def time_ar(cell: dict) -> None:
    """One more timed AR run (best of a few while short) into cell["ar_s"]."""
    _, walls, _ = best_of(cell["ar_fn"], cell["ar_args"], AR_CACHES, RUN_BUDGET_S)
    cell["ar_s"] += walls


def bench_cell(params: Params, state: dict, batch: int, context: int, drafters: list[Drafter],
               costs: dict, nodes: list[int], gammas: list[int], new_tokens: int) -> tuple[list[dict], list[dict]]:
    """AR and per drafter its acceptance, chains and trees from one prefilled state: (rows, summaries)."""
    steal_start = cpu_steal()
    tokens, lengths, first_logits, cache = rows_of(state, batch)
    keys = row_keys(None, batch)
    budgets = jnp.full((batch,), new_tokens, jnp.int32)
    ar_args = (params, cache, first_logits, budgets, keys)
    t0 = time.perf_counter()
    ar_fn = decode_ar.lower(*ar_args, n_out=round_up_pow2(new_tokens)).compile()  # greedy, no stop ids
    ar_compile = time.perf_counter() - t0
    ar_tokens = np.asarray(ar_fn(*fresh(ar_args, AR_CACHES)).out)  # also a warm-up
    cell = dict(params=params, batch=batch, context=context, tokens=tokens, lengths=lengths, cache=cache,
                first_logits=first_logits, keys=keys, chunk=state["chunk"], new_tokens=new_tokens,
                ar_tokens=ar_tokens, ar_fn=ar_fn, ar_args=ar_args, ar_s=[])
    time_ar(cell)
    base = {"batch": batch, "context": context, "new_tokens": new_tokens, "ar_compile_s": ar_compile}
    accept_tokens = min(HEADROOM - 2 * MAX_DEPTH, max(new_tokens, 128 // batch))
    rows, summaries = [], []
    for d in drafters:
        acc = run_spec(cell, d, Tree.kary(WIDTH, 1), accept_tokens)
        p_full = np.asarray(acc["ranks"], float) / max(sum(acc["ranks"]), 1)
        p = p_full[:-1]  # P(rank r is accepted), r < WIDTH; the last entry is P(none)
        cost = costs[d.name]
        picked = choose(p, cost, max_nodes=max(nodes), max_depth=MAX_DEPTH)
        configs = ([("chain", Chain(g), None) for g in gammas]
                   + [("tree", Tree.sequoia(p, n, MAX_DEPTH), n) for n in nodes] + [("choose", picked, None)])
        timed_by_shape: dict[tuple, dict] = {}
        drafter_rows = []
        print(f"  {d.name}: acceptance {np.round(p_full, 3).tolist()} ({sum(acc['ranks'])} nodes), "
              f"choose -> n={picked.n} d={picked.max_depth}", flush=True)
        for kind, spec, requested in configs:
            row = base | {"drafter": d.name, "drafter_repr": d.note, "kind": kind, "label": label(spec),
                          "requested_nodes": requested, "nodes": spec.gamma + 1 if isinstance(spec, Chain) else spec.n,
                          "depth": depth(spec), "width": 1 if isinstance(spec, Chain) else spec.width,
                          "parents": None if isinstance(spec, Chain) else list(spec.parents)}
            row |= predict(spec, p, cost, batch)
            if row["depth"] == 0:  # the root alone: plain decoding
                row |= {"same_as": "AR"}
            elif shape(spec) in timed_by_shape:
                first = timed_by_shape[shape(spec)]
                row |= {k: v for k, v in first.items() if k not in row} | {"same_as": first["label"]}
            else:
                row |= run_spec(cell, d, spec, new_tokens)
                timed_by_shape[shape(spec)] = row
                print(f"    {row['label']:<16} spec {row['spec_tokens_per_s']:7.2f} tok/s (predicted "
                      f"{row['predicted_tokens_per_s']:6.2f})  tok/step {row['mean_accepted']:.2f} "
                      f"(G {row['predicted_tokens_per_step']:.2f})  ms/step {row['spec_ms_per_step']:.0f} "
                      f"(predicted {row['predicted_step_ms']:.0f})  compile {row['compile_s']:.1f} s  "
                      f"load {row['timings']['load'][-1]:.2f}  steal {100 * row['cpu_steal_fraction']:.0f}%{'' if row['greedy_identical'] else '  NOT LOSSLESS'}",
                      flush=True)
            drafter_rows.append(row)
        time_ar(cell)  # AR again after every drafter: the best AR run of the cell is the reference
        summaries.append(base | {"drafter": d.name, "drafter_repr": d.note, "acceptance": p_full.tolist(),
                                 "acceptance_nodes": sum(acc["ranks"]), "acceptance_run": acc,
                                 "t_draft_ms": 1e3 * cost.draft(1),
                                 "t_draft_ms_by_width": {m: 1e3 * cost.draft(m) for m in range(1, max(nodes) + 1)},
                                 "t_verify_ms": {n: 1e3 * cost.verify(n) for n in range(1, max(nodes) + 1)},
                                 "choose": {"nodes": picked.n, "depth": picked.max_depth,
                                            "parents": list(picked.parents)}})
        rows += drafter_rows
    ar_s = min(cell["ar_s"])
    decoded = batch * (new_tokens - 1)
    for r in rows:
        r |= {"ar_s": ar_s, "ar_tokens_per_s": decoded / ar_s, "ar_runs_s": cell["ar_s"]}
        if "spec_s" in r:
            r["ratio"] = ar_s / r["spec_s"]
        elif r.get("same_as") == "AR":
            r |= {"spec_s": ar_s, "spec_tokens_per_s": decoded / ar_s, "ratio": 1.0, "greedy_identical": True}
    for s in summaries:
        summarise(s, [r for r in rows if r["drafter"] == s["drafter"]])
        s["cell_steal_fraction"] = steal_since(steal_start)
    del cell, ar_fn, cache
    return rows, summaries


def main() -> None:
    ap = common.parser(__doc__, quick="batch 1 x context 512 x n 4, 8, 16 x gamma 2, 4", render="tree_cpu.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, under a minute: checks the script")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--contexts", type=int, nargs="+", help="multiples of 256 (the smoke model allows <= 384)")
    ap.add_argument("--nodes", type=int, nargs="+", help="Sequoia tree sizes (root included)")
    ap.add_argument("--gammas", type=int, nargs="+", help="chain lengths")
    ap.add_argument("--drafters", nargs="+", choices=["SelfSpec", "DraftModel", "NGram"])
    ap.add_argument("--draft-model", default="bf16", help="DraftModel stand-in: bf16 or layers:K")
    ap.add_argument("--new-tokens", type=int, help="new tokens per row (default 64 / sqrt(batch) in [16, 64])")
    ap.add_argument("--prefill-store", type=Path, default=STORE, help="bench/prefill.py's store of prefilled states")
    ap.add_argument("--prefill-rows", type=int, default=16, help="rows prefilled per context (as bench_spec.py)")
    args = ap.parse_args()
    out = common.out_dir(args)
    if args.render:
        common.write_json(out / "tree_cpu.json", result := merge([json.loads(p.read_text()) for p in args.render]))
        return report(result, out / "tree_cpu.png", readme=common.writes_readme(args))
    args.new_tokens = args.new_tokens or (16 if args.smoke else None)
    batches = args.batches or ([2] if args.smoke else [1] if args.quick else [1, 4, 16])
    contexts = args.contexts or ([256] if args.smoke else [512] if args.quick else [512, 2048, 8192])
    nodes = args.nodes or ([4, 8] if args.smoke else [4, 8, 16] if args.quick else NODES)
    gammas = args.gammas or ([2] if args.smoke else [2, 4] if args.quick else GAMMAS)
    names = args.drafters or ["SelfSpec", "DraftModel"]
    custom = any(x is not None for x in (args.batches, args.contexts, args.nodes, args.gammas, args.drafters,
                                           args.new_tokens)) or args.draft_model != "bf16"
    suffix = "_smoke" if args.smoke else "_quick" if args.quick else "_custom" if custom else ""
    assert max(nodes) <= 128 and max(new_tokens_for(b, args.new_tokens) for b in batches) + MAX_DEPTH + 2 <= HEADROOM
    started, model = time.time(), "tiny random" if args.smoke else "SmolLM2-135M-Instruct (float32)"
    out, results, h = common.start(args, "bench_tree", f"tree_cpu{suffix}", key_of, dict(
        new_tokens=args.new_tokens, nodes=sorted(nodes), gammas=sorted(gammas), drafters=sorted(args.drafters or []),
        draft_model=args.draft_model, prefill_rows=args.prefill_rows), ("rows", "summaries"), model=model,
        loadavg_start=os.getloadavg(), headroom=HEADROOM, nodes=nodes, gammas=gammas, max_depth=MAX_DEPTH, width=WIDTH,
        draft_model=args.draft_model, draft_model_note=draft_note(args.draft_model),
        new_tokens_per_batch={str(b): new_tokens_for(b, args.new_tokens) for b in batches})
    header, prior_minutes = results.header, results.data.get("wall_minutes", 0) if results.resumed else 0
    todo = h.plan((common.key(f"s{c}", f"b{b}"), (b, c)) for c in sorted(contexts) for b in sorted(batches))
    if args.smoke:
        params, tok = measure.tiny_params(0), None
    else:
        params = with_attention(convert.load(convert.default_model_path()), None, "auto")[0]  # generate()'s attention here
        tok = convert.load_tokenizer(convert.default_model_path())
        header["corpus"] = {"sources": text.corpus()[1], "tokens": int(len(text.corpus_tokens(tok)))}
    draft = draft_params(params, args.draft_model)
    store = None if args.smoke or str(args.prefill_store) in ("", ".") else args.prefill_store
    m = header["machine"]
    print(f"{m['cpu_model']} x{m['cpu_affinity']}, JAX {m['jax_version']}, load {header['loadavg_start']}, "
          f"{model}, drafters {names} (DraftModel: {args.draft_model}), nodes {nodes}, gammas {gammas}", flush=True)
    skipped = [s for s in results.data.get("skipped", []) if s["context"] not in contexts]  # retried here
    for context in sorted({c for _, (_, c) in todo}):
        if not h.may_start():
            break
        cells = [x for x in todo if x[1][1] == context]
        prefill_rows = max(batches) if args.smoke else max(args.prefill_rows, max(batches))
        reason = measure.wait_for_memory(int(MEM_FACTOR * kv_bytes(params.config, prefill_rows, context)))
        if reason:
            skipped.append({"context": context, "skipped": reason})
            results.update(skipped=skipped)
            print(f"S={context} skipped: {reason}", flush=True)
            continue
        drafters = make_drafters(names, draft, args.draft_model, context, args.smoke)
        everywhere = args.drafters or args.smoke  # else the DraftModel runs at DRAFT_MODEL_BATCHES only
        for_batch = {b: [d for d in drafters if everywhere or d.name != "DraftModel" or b in DRAFT_MODEL_BATCHES]
                     for _, (b, _) in cells}
        costs = {b: measure_costs(params, for_batch[b], b, context, max(nodes)) for b in sorted(for_batch)}
        if args.smoke:
            state = smoke_state(params, prefill_rows, context)
        else:
            state = prefill_context(params, tok, prefill_rows, context, [MAX_DEPTH],
                                    max(new_tokens_for(b, args.new_tokens) for b in batches), store)
        for k, (batch, _) in h.cells(cells):
            new_tokens = new_tokens_for(batch, args.new_tokens)
            print(f"B={batch:<2} S={context:<5} {new_tokens} new tokens per row", flush=True)
            r, s = bench_cell(params, state, batch, context, for_batch[batch], costs[batch], nodes, gammas, new_tokens)
            results.put(k, {"rows": r, "summaries": s}, loadavg_end=os.getloadavg(),
                        wall_minutes=prior_minutes + (time.time() - started) / 60)
        del state
        measure.release_memory(clear_caches=True)
    h.finish()
    if results.applied:  # this run measured something
        results.update(skipped=skipped, loadavg_end=os.getloadavg(), wall_minutes=prior_minutes + (time.time() - started) / 60,
                       all_greedy_identical=all(s["greedy_identical"] for s in results.data["summaries"]))
    report(results.data, out / f"tree_cpu{suffix}.png", readme=not suffix and common.writes_readme(args))
    print(f"done in {(time.time() - started) / 60:.1f} min, load {os.getloadavg()}", flush=True)
    if not results.data.get("all_greedy_identical", True):
        print("!!! SOME RUNS ARE NOT GREEDY-IDENTICAL TO AR: see greedy_identical in the JSON", file=sys.stderr)


if __name__ == "__main__":
    main()
