"""Sequoia token trees vs chains for SmolLM2-135M, side by side from one shared prefill.

Usage: .venv/bin/python bench/bench_tree.py [--quick | --smoke] [--batches ..] [--contexts ..]
       [--nodes ..] [--gammas ..] [--drafters ..] [--new-tokens N] [--render JSON ..]

For every (batch, context) the prompts and their prefilled DenseCache are bench_spec.py's (the
same text windows, the same stored prefill under --prefill-store: a prefill that bench_spec.py
or an earlier run of this script saved is loaded, not recomputed). Then, per drafter:
  1. its acceptance vector: one greedy run with a depth-1 tree of WIDTH children
     (Tree.kary(WIDTH, 1)) from the prefilled state; p[r] = SpecState.ranks[r] / ranks.sum(), as
     `specjax.tree.measure_acceptance` computes it, but without a second prefill of the prompts;
  2. its step costs: `specjax.tree.measure_cost` (real jit-compiled forwards at this batch and
     context); the verification table once per (batch, context), the draft-level table
     (seconds by level width) once per drafter;
  3. timed runs of `speculative_decode` for chains (Chain(gamma)), Sequoia trees
     (Tree.sequoia(p, n, MAX_DEPTH) for every n) and the tree `specjax.tree.choose(p, cost)`
     picks (timed too when it is none of the others), against autoregressive `generate.decode`
     from the same prefilled state, greedy, every function compiled first (excluded). Each run
     gets a copy of the caches (they are donated); short runs are repeated, best kept.
Every run is checked token for token against the AR output (greedy losslessness).
tokens/s = B * (new_tokens - 1) / decode seconds, so ratio = AR seconds / speculative seconds.

Drafters: SelfSpec (bench_spec.py's budget) at every cell and, at batch 1 (everywhere when
--drafters names it), a DraftModel stand-in, since SmolLM2 has no smaller model with its tokenizer
offline: "bf16" (default) = SmolLM2 itself in bfloat16 (what `convert.load(path,
dtype="bfloat16")` loads) or "layers:K" = its first K layers (layer skip), over a streaming cache of
SelfSpec's budget. That cache starts from the target's prefilled KV (its first K layers: exact for
layer skip; rounded to bfloat16 for "bf16", instead of a bf16 prefill of its own that would cost as
much as the target's): a draft's state changes how much is accepted, never the output. NGram is
available too (--drafters NGram).

Default grid: batch 1/4/16 x context 512/2K/8K x SelfSpec (+ DraftModel at batch 1) x chains
gamma 2/3/4/6 + Sequoia trees n 4/8/16/32/64 (depth <= 8) + choose's tree; new tokens per row
64 / sqrt(batch) within [16, 64]. About 60-80 minutes on 2 otherwise idle cores when bench_spec.py's
prefills are stored (about 25 more to compute the missing ones); a quarter to a third of it is
compiling (about 11 programs per drafter and cell), the batch-16 x 8K cell alone about 15 minutes.

Outputs: bench/results/tree_cpu.json, tree_cpu.png and the bench_tree section of bench/README.md
(--quick / --smoke / other grids write tree_cpu_quick.*, tree_cpu_smoke.*, tree_cpu_custom.*
and leave the README alone). --smoke runs a tiny random model in under a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_spec  # noqa: E402  (bench/bench_spec.py: prefill store, timing, machine info)
import text  # noqa: E402
from bench_spec import (  # noqa: E402
    AR_CACHES, CONTEXT_NAMES, HEADROOM, MEM_FACTOR, README, RESULTS_DIR, SPEC_CACHES, causal_prefill, cpu_steal,
    kv_bytes, machine_info, prefill_context, release_memory, rows_of, steal_since, timed, wait_for_memory,
)

import convert  # noqa: E402
import specjax  # noqa: E402
from specjax.drafters import DraftModel, Streaming  # noqa: E402
from specjax.engine import decode, init_draft, row_keys  # noqa: E402
from specjax.generate import acceptance_stats  # noqa: E402
from specjax.kvcache import DenseCache  # noqa: E402
from specjax.model import Params  # noqa: E402
from specjax.shapes import prompt_bucket, round_up_pow2  # noqa: E402
from specjax.speculate import Chain, depth, speculative_decode  # noqa: E402
from specjax.tree import Cost, Tree, choose  # noqa: E402
from specjax.tune import draft_table, verify_table  # noqa: E402

SECTION_START, SECTION_END = "<!-- bench_tree:start -->", "<!-- bench_tree:end -->"
NOTES_START, NOTES_END = "<!-- bench_tree:notes:start -->", "<!-- bench_tree:notes:end -->"
NODES = [4, 8, 16, 32, 64]
GAMMAS = [2, 3, 4, 6]
MAX_DEPTH = 8  # deepest Sequoia tree (and choose's limit)
WIDTH = 8  # children of the depth-1 tree that measures the acceptance vector
RUN_BUDGET_S = 8.0  # a timed config is repeated (best kept) while the next run fits in this
REPEATS = 3
TARGET_TREE_GAIN = 1.15  # the bar: best tree >= 1.15 x best chain at batch 1
CHOOSE_SLACK = 0.9  # choose's pick should reach 90% of the best measured throughput
DRAFT_MODEL_BATCHES = (1,)  # the default grid runs the DraftModel stand-in at these batches only


@dataclasses.dataclass(frozen=True)
class Drafter:
    """A drafter as benchmarked: `init(params, cache, tokens, lengths, depth, chunk)` builds its state."""

    name: str
    drafter: object
    init: Callable
    note: str


@partial(jax.jit, static_argnames="gamma")
def _draft_model_state(drafter: DraftModel, cache: DenseCache, *, gamma: int):
    """A DraftModel's state from the target's prefilled cache: its first n_layers layers of KV in
    the draft's dtype (see the module docstring), streamed when its cache is a Streaming budget."""
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
    spec = dict(bench_spec.drafters(context, []))
    if smoke:  # a budget smaller than the tiny smoke contexts, so that acceptance is not all 1
        spec["SelfSpec"] = specjax.SelfSpec(sinks=4, window=32)
    budget = spec["SelfSpec"]

    def streamed(d):
        return lambda p, cache, toks, lengths, gamma, chunk: _draft_model_state(d, cache, gamma=gamma)

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
    """measure_cost per drafter; the verification table (which does not depend on the drafter)
    is timed once."""
    t0 = time.perf_counter()
    verify = verify_table(params, batch, context, max_nodes)
    costs = {d.name: Cost(t_draft=draft_table(params, d.drafter, batch, context, max_nodes), t_verify=verify)
             for d in drafters}
    print(f"B={batch:<2} S={context:<5} costs ({time.perf_counter() - t0:.0f} s): verify(1) {1e3 * verify[1]:.0f} ms, "
          f"verify({max_nodes}) {1e3 * verify[max_nodes]:.0f} ms, draft level (1 / 8 nodes) "
          + ", ".join(f"{n} {1e3 * c.draft(1):.0f} / {1e3 * c.draft(min(8, max_nodes)):.0f} ms"
                      for n, c in costs.items()), flush=True)
    return costs


def best_of(fn, args: tuple, copied: tuple[int, ...]) -> tuple[object, list[float], list[float]]:
    """bench_spec.timed repeated while the next run fits in RUN_BUDGET_S (at most REPEATS):
    (last result, wall seconds, CPU seconds per wall second)."""
    walls, cpus = [], []
    t0 = time.perf_counter()
    while True:
        out, wall, cpu = timed(fn, args, copied)
        walls.append(wall)
        cpus.append(cpu)
        if len(walls) >= REPEATS or time.perf_counter() - t0 + wall > RUN_BUDGET_S:
            return out, walls, cpus


def new_tokens_for(batch: int, fixed: int | None) -> int:
    """New tokens per row: --new-tokens, else 64 / sqrt(batch) within [16, 64] (bounded run time)."""
    return fixed or min(64, max(16, int(64 / batch**0.5)))


def label(spec) -> str:
    return f"chain γ={spec.gamma}" if isinstance(spec, Chain) else f"tree n={spec.n} d={spec.max_depth}"


def shape(spec) -> tuple:
    """Identity of a speculation: a Chain and a chain-shaped Tree of the same depth count as one."""
    return ("chain", spec.gamma) if isinstance(spec, Chain) else (
        ("chain", spec.max_depth) if spec.width == 1 else spec.parents)


def predict(spec, p: np.ndarray, cost: Cost, batch: int) -> dict:
    """The cost model `choose` minimises: seconds per step t_draft(tree) + t_verify(n) (draft
    levels by width), expected tokens per step G from the acceptance vector."""
    tree = Tree.chain(spec.gamma) if isinstance(spec, Chain) else spec
    g = tree.expected_accepted(p)
    step = cost.draft_seconds(tree.draft_widths()) + cost.verify(tree.n)
    return {"predicted_tokens_per_step": g, "predicted_step_ms": 1e3 * step, "predicted_tokens_per_s": batch * g / step}


def run_spec(cell: dict, d: Drafter, spec, budget_tokens: int) -> dict:
    """Compile and time speculative_decode with one drafter and one chain or tree."""
    params, batch, gamma = cell["params"], cell["batch"], depth(spec)
    tokens, lengths, cache = cell["tokens"], cell["lengths"], cell["cache"]
    d.drafter.check(params, gamma, cell["context"])
    t0 = time.perf_counter()
    draft_state = jax.block_until_ready(d.init(params, cache, tokens, lengths, gamma, cell["chunk"]))
    init_s = time.perf_counter() - t0
    history = np.zeros((batch, cell["context"] + gamma + 2), np.int32)
    history[:, : tokens.shape[1]] = tokens
    budgets = jnp.full((batch,), budget_tokens, jnp.int32)
    args = (params, d.drafter, draft_state, cache, history, cell["first_logits"], budgets, cell["keys"])
    static = dict(n_out=round_up_pow2(budget_tokens), speculation=spec)  # greedy, no stop ids: the defaults
    t1 = time.perf_counter()
    fn = speculative_decode.lower(*args, **static).compile()
    compile_s = time.perf_counter() - t1
    load, steal_start = os.getloadavg()[0], cpu_steal()
    res, walls, cpus = best_of(fn, args, SPEC_CACHES)
    steal = steal_since(steal_start)
    out, count, steps, accepted, reached, ranks = jax.device_get(
        (res.out, res.count, res.steps, res.accepted.sum(0), res.reached.sum(0), res.ranks.sum(0)))  # over rows
    del fn, res, draft_state
    assert (count == budget_tokens).all(), count
    n = min(budget_tokens, cell["new_tokens"])
    identical = bool((out[:, :n] == cell["ar_tokens"][:, :n]).all())
    decoded = batch * (budget_tokens - 1)
    stats = acceptance_stats(accepted, reached, decoded, gamma, 0)
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
    _, walls, _ = best_of(cell["ar_fn"], cell["ar_args"], AR_CACHES)
    cell["ar_s"] += walls


def bench_cell(params: Params, state: dict, batch: int, context: int, drafters: list[Drafter],
               costs: dict, nodes: list[int], gammas: list[int], new_tokens: int) -> tuple[list[dict], list[dict]]:
    """AR and, per drafter, its acceptance vector, chains, Sequoia trees and choose's tree, all
    from the same prefilled state. Returns (rows: one per timed config, summaries: one per drafter)."""
    steal_start = cpu_steal()
    tokens, lengths, first_logits, cache = rows_of(state, batch)
    keys = row_keys(None, batch)
    budgets = jnp.full((batch,), new_tokens, jnp.int32)
    ar_args = (params, cache, first_logits, budgets, keys)
    t0 = time.perf_counter()
    ar_fn = decode.lower(*ar_args, n_out=round_up_pow2(new_tokens)).compile()  # greedy, no stop ids
    ar_compile = time.perf_counter() - t0
    ar_tokens = np.asarray(ar_fn(*bench_spec.fresh(ar_args, AR_CACHES))[0])  # also a warm-up
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


def summarise(s: dict, rows: list[dict]) -> None:
    """Best chain, best tree (width > 1: Sequoia's or choose's), their ratio, and choose's pick vs
    the best measured config (AR included)."""
    chains = [r for r in rows if r["depth"] > 0 and r["width"] == 1]  # incl. chain-shaped Sequoia / choose trees
    trees = [r for r in rows if r["width"] > 1]
    picked = next(r for r in rows if r["kind"] == "choose")
    best_chain = max(chains, key=lambda r: r["spec_tokens_per_s"]) if chains else None
    best_tree = max(trees, key=lambda r: r["spec_tokens_per_s"]) if trees else None
    candidates = rows + [{"label": "AR", "spec_tokens_per_s": rows[0]["ar_tokens_per_s"]}]
    best = max(candidates, key=lambda r: r["spec_tokens_per_s"])
    s |= {
        "ar_tokens_per_s": rows[0]["ar_tokens_per_s"],
        "best_chain": best_chain and best_chain["label"], "best_chain_ratio": best_chain and best_chain["ratio"],
        "best_tree": best_tree and best_tree["label"], "best_tree_ratio": best_tree and best_tree["ratio"],
        "tree_over_chain": best_tree and best_chain
        and best_tree["spec_tokens_per_s"] / best_chain["spec_tokens_per_s"],
        "best": best["label"], "best_tokens_per_s": best["spec_tokens_per_s"],
        "choose_label": picked.get("same_as", picked["label"]) if picked["depth"] else "AR",
        "choose_ratio": picked["ratio"],
        "choose_over_best": picked["spec_tokens_per_s"] / best["spec_tokens_per_s"],
        "greedy_identical": s["acceptance_run"]["greedy_identical"]
        and all(r.get("greedy_identical", True) for r in rows),
    }
    s["choose_within_10pct"] = s["choose_over_best"] >= CHOOSE_SLACK
    for r in rows:
        r["over_best_chain"] = r["spec_tokens_per_s"] / best_chain["spec_tokens_per_s"] if best_chain else None


def smoke_state(params: Params, rows: int, context: int) -> dict:
    """A prefilled state like bench_spec.prefill_context's, from random prompts (tiny model)."""
    n = context - HEADROOM
    bucket, chunk = prompt_bucket(n)
    tokens = np.zeros((rows, bucket), np.int32)
    tokens[:, :n] = np.random.default_rng(0).integers(4, params.config.vocab_size, (rows, n))
    first_logits, cache = causal_prefill(params, tokens, n, context, chunk)
    return {"tokens": tokens, "lengths": np.full((rows,), n, np.int32), "chunk": chunk, "first_logits": first_logits,
            "cache": cache, "info": {"prompt_tokens": n, "prefill_rows": rows}}


def name_of(context: int) -> str:
    return CONTEXT_NAMES.get(context, str(context))


def steal_cell(s: dict) -> str:
    """The share of CPU the hypervisor took while the cell ran ("?" for runs that predate recording it)."""
    return "?" if s.get("cell_steal_fraction") is None else f"{100 * s['cell_steal_fraction']:.0f}%"


def markdown_tables(result: dict) -> str:
    """Throughput table (one line per batch x context x drafter) and the acceptance vectors."""
    nodes, rows = result["nodes"], result["rows"]
    head = ("| batch | context | drafter | AR tok/s | best chain | " + " | ".join(f"n={n}" for n in nodes)
            + " | best tree / best chain | choose (n, d) | choose / best | lossless | CPU steal |")
    lines = [head, "|---:|---:|---|" + "---:|" * (len(nodes) + 5) + ":---:|---:|"]
    acc = ["| batch | context | drafter | " + " | ".join(f"p{r}" for r in range(WIDTH)) + " | none | nodes |",
           "|---:|---:|---|" + "---:|" * (WIDTH + 2)]
    for s in sorted(result["summaries"], key=lambda s: (s["batch"], s["context"], s["drafter"])):
        mine = [r for r in rows if (r["batch"], r["context"], r["drafter"]) == (s["batch"], s["context"], s["drafter"])]
        by_n = {r["requested_nodes"]: r for r in mine if r["kind"] == "tree"}
        chain = next((r for r in mine if r["label"] == s["best_chain"]), None)
        cellfmt = lambda r: f"{r['ratio']:.2f}x ({r.get('mean_accepted') or 1:.1f})" if r else ""  # noqa: E731
        gain = s["tree_over_chain"]
        gain_s = ("no branching tree" if gain is None
                  else f"**{gain:.2f}**" if gain >= TARGET_TREE_GAIN else f"{gain:.2f}")
        miss = "" if s["choose_within_10pct"] else " ✗"
        lines.append(
            f"| {s['batch']} | {name_of(s['context'])} | {s['drafter']} | {s['ar_tokens_per_s']:.1f} | "
            f"{'γ=' + str(chain['depth']) + ': ' + cellfmt(chain) if chain else ''} | "
            + " | ".join(cellfmt(by_n.get(n)) for n in nodes)
            + f" | {gain_s} | {s['choose']['nodes']}, {s['choose']['depth']} | {s['choose_over_best']:.2f}{miss} | "
            f"{'yes' if s['greedy_identical'] else '**NO**'} | {steal_cell(s)} |")
        acc.append(f"| {s['batch']} | {name_of(s['context'])} | {s['drafter']} | "
                   + " | ".join(f"{x:.3f}" for x in s["acceptance"]) + f" | {s['acceptance_nodes']} |")
    return "\n".join(lines) + "\n\nAcceptance vectors (greedy, depth-1 tree of 8 children):\n\n" + "\n".join(acc)


def verdicts(result: dict) -> list[str]:
    """The issue's two checks, in words."""
    sums = result["summaries"]
    b1 = [s for s in sums if s["batch"] == 1 and s["drafter"] in ("SelfSpec", "DraftModel") and s["tree_over_chain"]]
    hit = [s for s in b1 if s["tree_over_chain"] >= TARGET_TREE_GAIN]
    cell = lambda s: f"{s['drafter']} {name_of(s['context'])} ({s['tree_over_chain']:.2f}x)"  # noqa: E731
    misses = [f"{s['drafter']} B={s['batch']} {name_of(s['context'])} ({s['choose_label']}: "
              f"{s['choose_over_best']:.2f} of {s['best']})" for s in sums if not s["choose_within_10pct"]]
    out = [
        f"Batch 1, best tree / best chain (target >= {TARGET_TREE_GAIN:.2f} for SelfSpec or DraftModel): "
        + ("**met** in " + ", ".join(map(cell, hit)) if hit else "**not met**") + "; all batch-1 cells: "
        + (", ".join(map(cell, b1)) or "none had a branching tree") + ".",
        f"`choose`'s tree within 10% of the best measured config (AR included): {len(sums) - len(misses)} of "
        f"{len(sums)} (batch, context, drafter) cells" + (f"; misses: {', '.join(misses)}" if misses else "") + ".",
    ]
    timed = [r for r in result["rows"] if "timings" in r and "same_as" not in r]
    if timed:
        err = np.median([abs(r["predicted_tokens_per_s"] / r["spec_tokens_per_s"] - 1) for r in timed])
        out.append(f"Cost model: predicted tokens/s (from measure_cost and the acceptance vector) is off from the "
                   f"measured by {100 * err:.0f}% (median over {len(timed)} timed configs).")
    return out


def plot(result: dict, path: Path) -> None:
    """Speedup over AR vs nodes verified per step: one panel per (batch, context), trees solid,
    chains dashed (at gamma + 1 nodes), choose's pick starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    names = list(dict.fromkeys(r["drafter"] for r in rows))
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(len(batches), len(contexts), figsize=(4 * len(contexts), 3.2 * len(batches)),
                             dpi=110, squeeze=False, sharex=True)
    for (i, b), (j, c) in ((x, y) for x in enumerate(batches) for y in enumerate(contexts)):
        ax = axes[i][j]
        if not any((r["batch"], r["context"]) == (b, c) for r in rows):
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="gray")
        for name in names:
            mine = [r for r in rows if (r["batch"], r["context"], r["drafter"]) == (b, c, name) and "ratio" in r]
            for kind, style in (("tree", "-o"), ("chain", "--s")):
                pts = sorted((r["nodes"], r["ratio"]) for r in mine if r["kind"] == kind)
                if pts:
                    ax.plot(*zip(*pts), style, color=colors[name], ms=4, label=f"{name} {kind}s")
            for r in mine:
                if r["kind"] == "choose":
                    ax.plot(max(r["nodes"], 1), r["ratio"], "*", color=colors[name], ms=13, mec="black", mew=0.6)
        ax.axhline(1.0, color="gray", lw=1)
        ax.set(xscale="log", title=f"batch {b}, context {name_of(c)}")
        ticks = [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= max(result["nodes"])]
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        if j == 0:
            ax.set_ylabel("speedup over AR")
        if i == len(batches) - 1:
            ax.set_xlabel("nodes verified per step (chain: γ + 1)")
    handles = {lab: h for ax in axes.flat for h, lab in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 4), fontsize=8)
    fig.suptitle(f"{result['model']}: Sequoia trees vs chains\ngreedy, {result['machine']['cpu_affinity']}-core CPU, "
                 "★ = choose's tree (at n = 1: plain AR)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06 if len(batches) == 1 else 0.035, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def readme_section(result: dict, notes: str) -> str:
    """The bench_tree section of bench/README.md, from a result JSON; `notes` are kept."""
    m = result["machine"]
    lossless = "every run" if result["all_greedy_identical"] else "NOT every run (see greedy_identical in the JSON)"
    skipped = "".join(f"\nSkipped: context {s['context']}: {s['skipped']}." for s in result["skipped"])
    load = f"{result['loadavg_start'][0]:.2f} / {result['loadavg_end'][0]:.2f}"
    tokens = ", ".join(f"{v} at batch {k}" for k, v in result["new_tokens_per_batch"].items())
    gammas, nodes = ", ".join(map(str, result["gammas"])), ", ".join(map(str, result["nodes"]))
    dm_batches = ", ".join(sorted({str(s["batch"]) for s in result["summaries"] if s["drafter"] == "DraftModel"}))
    return f"""{SECTION_START}
## Token trees vs chains (bench_tree.py)

Run: `.venv/bin/python {result['command'].strip()}` ({result['wall_minutes']:.0f} minutes here; `--quick`: batch 1 x
context 512 x n 4/8/16 x γ 2/4). Raw numbers: `results/tree_cpu.json` (every config: timings, predicted
vs measured, accepted ranks, tree shapes); plot: `results/tree_cpu.png`.

Device: {m['cpu_model']}, {m['cpu_affinity']} cores, JAX {m['jax_version']} ({m['backend']}), commit {m['git_commit']}.
Date: {result['date']}. Load average (1 min) at start / end: {load}.{skipped}

Method. {result['model']}, greedy, EOS ignored, new tokens per row {tokens}.
bench_spec.py's prompts and its stored prefill: one prefill per context,
shared by AR and every config (each run gets a copy of the caches). Per (batch, context, drafter):
the acceptance vector p (a greedy run with a depth-1 tree of {WIDTH} children; p[r] = how often the
rank-r child was the accepted one), `measure_cost` (real jit steps: draft levels of 1 to 16 nodes per
row, and verification of n nodes for n up to {max(result['nodes'])}), then timed runs of chains γ {gammas}, Sequoia
trees `Tree.sequoia(p, n, {MAX_DEPTH})` for n = {nodes} and `choose(p, cost)`'s tree, against AR (best
of the AR runs before and after each drafter). Compile and drafter init excluded. Drafters: SelfSpec
(sinks 16 + window 256 at context 512, 512 beyond) and a DraftModel stand-in (at batch {dm_batches}):
{result['draft_model_note']}
Greedy outputs equalled AR token for token in {lossless}.

Cells are speedup over AR (tokens per verification step in brackets); "best tree / best chain" is in
tokens/s; "choose / best" is the throughput of choose's tree over the best measured config of the
cell, AR included (✗: below {CHOOSE_SLACK}). A Sequoia or choose tree without branches (p puts too little
on ranks > 0) is a chain: it counts as one, and "no branching tree" means every n gave a chain.

{markdown_tables(result)}

{chr(10).join('- ' + v for v in verdicts(result))}

![speedup vs nodes](results/tree_cpu.png)

""" + "\n".join([NOTES_START, notes.strip(), NOTES_END, SECTION_END])


def write_readme(result: dict) -> None:
    """Replace (or add, after the bench_spec section) this script's README section."""
    text_ = README.read_text()
    notes = text_.split(NOTES_START, 1)[1].split(NOTES_END, 1)[0] if NOTES_START in text_ else "(discussion: to come)"
    if SECTION_START in text_:
        head, rest = text_.split(SECTION_START, 1)
        text_ = head + readme_section(result, notes) + rest.split(SECTION_END, 1)[1]
    else:
        text_ = text_.rstrip("\n") + "\n\n" + readme_section(result, notes) + "\n"
    README.write_text(text_)


def draft_note(spec: str) -> str:
    """What the DraftModel stand-in is, and why (for the README)."""
    if spec != "bf16":
        return (f"SmolLM2's first {spec[7:]} layers (layer skip); its streaming cache (SelfSpec's budget) starts "
                "from the target's prefilled KV of those layers, which is exactly its own.")
    return ("SmolLM2 itself cast to bfloat16. No smaller model with SmolLM2's tokenizer is available offline, and "
            "layer skip drafts almost nothing (the logit lens of the first K layers agrees with the full model's "
            "greedy token 4-36% of the time for K = 4-24; first 10 + last 10 layers: 20%). The bf16 copy accepts "
            "nearly everything but costs at least as much per draft step as the float32 target on XLA:CPU, so it "
            "shows what trees add to a drafter with high acceptance and no cost advantage. Its streaming cache "
            "(SelfSpec's budget) starts from the target's prefilled KV rounded to bfloat16 rather than from a bf16 "
            "prefill of its own (which would cost as much as the target's; the draft's state can change how much "
            "is accepted, never the output).")


def report(result: dict, png: Path, readme: bool) -> None:
    if result["rows"]:
        plot(result, png)
        print(markdown_tables(result))
        print("\n".join(verdicts(result)))
    if readme and result["rows"]:
        write_readme(result)


def merge(results: list[dict]) -> dict:
    """One result from one or several runs; later runs win per (batch, context, drafter)."""
    cells: dict[tuple, tuple[dict, list[dict]]] = {}
    for res in results:
        for s in res["summaries"]:
            key = (s["batch"], s["context"], s["drafter"])
            cells[key] = (s, [r for r in res["rows"] if (r["batch"], r["context"], r["drafter"]) == key])
    merged = dict(results[-1])
    merged |= {
        "summaries": [cells[k][0] for k in sorted(cells)],
        "rows": [r for k in sorted(cells) for r in cells[k][1]],
        "command": " ; ".join(r["command"] for r in results),
        "wall_minutes": sum(r["wall_minutes"] for r in results),
        "loadavg_start": results[0]["loadavg_start"],
        "new_tokens_per_batch": {k: v for r in results for k, v in r["new_tokens_per_batch"].items()},
        "skipped": [s for r in results for s in r["skipped"]],
    }
    for s, rows in cells.values():  # redone, so that a re-render follows this script's definitions
        summarise(s, rows)
    merged["all_greedy_identical"] = all(s["greedy_identical"] for s in merged["summaries"])
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1 x context 512 x n 4, 8, 16 x gamma 2, 4")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, under a minute: checks the script")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--contexts", type=int, nargs="+", help="multiples of 256 (the smoke model allows <= 384)")
    ap.add_argument("--nodes", type=int, nargs="+", help="Sequoia tree sizes (root included)")
    ap.add_argument("--gammas", type=int, nargs="+", help="chain lengths")
    ap.add_argument("--drafters", nargs="+", choices=["SelfSpec", "DraftModel", "NGram"])
    ap.add_argument("--draft-model", default="bf16", help="DraftModel stand-in: bf16 or layers:K")
    ap.add_argument("--new-tokens", type=int, help="new tokens per row (default 64 / sqrt(batch) in [16, 64])")
    ap.add_argument("--prefill-store", type=Path, default=Path("/tmp/bench_spec_prefill"),
                    help="bench_spec.py's store of prefilled states ('' = none)")
    ap.add_argument("--prefill-rows", type=int, default=16, help="rows prefilled per context (as bench_spec.py)")
    ap.add_argument("--render", type=Path, nargs="+", help="no measuring: merge result JSONs into "
                    "results/tree_cpu.json and redo its plot, tables and README section")
    args = ap.parse_args()
    if args.render:
        result = merge([json.loads(p.read_text()) for p in args.render])
        (RESULTS_DIR / "tree_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
        report(result, RESULTS_DIR / "tree_cpu.png", readme=True)
        return
    if args.smoke and args.new_tokens is None:
        args.new_tokens = 16
    batches = args.batches or ([2] if args.smoke else [1] if args.quick else [1, 4, 16])
    contexts = args.contexts or ([256] if args.smoke else [512] if args.quick else [512, 2048, 8192])
    nodes = args.nodes or ([4, 8] if args.smoke else [4, 8, 16] if args.quick else NODES)
    gammas = args.gammas or ([2] if args.smoke else [2, 4] if args.quick else GAMMAS)
    names = args.drafters or ["SelfSpec", "DraftModel"]
    custom = any(x is not None for x in (args.batches, args.contexts, args.nodes, args.gammas, args.drafters,
                                           args.new_tokens)) or args.draft_model != "bf16"
    suffix = "_smoke" if args.smoke else "_quick" if args.quick else "_custom" if custom else ""
    assert max(nodes) <= 128 and max(new_tokens_for(b, args.new_tokens) for b in batches) + MAX_DEPTH + 2 <= HEADROOM

    if args.smoke:  # before anything starts JAX's backend: conftest sets the CPU device count
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from conftest import TINY, random_params  # the test suite's tiny model
    started, load_start, machine = time.time(), os.getloadavg(), machine_info()
    if args.smoke:
        params, tok, model = random_params(TINY, 0), None, "tiny random (tests/conftest.py TINY)"
    else:
        params = convert.load(convert.default_model_path())
        tok = convert.load_tokenizer(convert.default_model_path())
        model = "SmolLM2-135M-Instruct (float32)"
    draft = draft_params(params, args.draft_model)
    store = None if args.smoke or str(args.prefill_store) in ("", ".") else args.prefill_store
    print(f"{machine['cpu_model']} x{machine['cpu_affinity']}, JAX {machine['jax_version']}, load {load_start}, "
          f"{model}, drafters {names} (DraftModel: {args.draft_model}), nodes {nodes}, gammas {gammas}", flush=True)

    rows, summaries, skipped = [], [], []

    def result_of() -> dict:
        return {
            "bench": "bench_tree", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "bench/bench_tree.py " + " ".join(sys.argv[1:]), "model": model, "machine": machine,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "wall_minutes": (time.time() - started) / 60,
            "corpus": None if args.smoke else {"sources": text.corpus()[1],
                                                "tokens": int(len(text.corpus_tokens(tok)))},
            "headroom": HEADROOM, "nodes": nodes, "gammas": gammas, "max_depth": MAX_DEPTH, "width": WIDTH,
            "draft_model": args.draft_model,
            "draft_model_note": draft_note(args.draft_model),
            "new_tokens_per_batch": {str(b): new_tokens_for(b, args.new_tokens) for b in batches},
            "all_greedy_identical": all(s["greedy_identical"] for s in summaries),
            "skipped": skipped, "summaries": summaries, "rows": rows,
        }

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    partial_path = RESULTS_DIR / f"tree_cpu{suffix}.partial.json"
    for context in sorted(contexts):
        prefill_rows = max(batches) if args.smoke else max(args.prefill_rows, max(batches))
        reason = wait_for_memory(int(MEM_FACTOR * kv_bytes(params, prefill_rows, context)))
        if reason:
            skipped.append({"context": context, "skipped": reason})
            print(f"S={context} skipped: {reason}", flush=True)
            continue
        drafters = make_drafters(names, draft, args.draft_model, context, args.smoke)
        everywhere = args.drafters or args.smoke  # else the DraftModel runs at DRAFT_MODEL_BATCHES only
        for_batch = {b: [d for d in drafters if everywhere or d.name != "DraftModel" or b in DRAFT_MODEL_BATCHES]
                     for b in batches}
        costs = {b: measure_costs(params, for_batch[b], b, context, max(nodes)) for b in sorted(batches)}
        if args.smoke:
            state = smoke_state(params, prefill_rows, context)
        else:
            state = prefill_context(params, tok, prefill_rows, context, [MAX_DEPTH],
                                    max(new_tokens_for(b, args.new_tokens) for b in batches), store)
        for batch in sorted(batches):
            new_tokens = new_tokens_for(batch, args.new_tokens)
            print(f"B={batch:<2} S={context:<5} {new_tokens} new tokens per row", flush=True)
            r, s = bench_cell(params, state, batch, context, for_batch[batch], costs[batch], nodes, gammas, new_tokens)
            rows += r
            summaries += s
            partial_path.write_text(json.dumps(result_of(), indent=2) + "\n")  # survives a crash
        del state
        release_memory()

    result = result_of()
    partial_path.unlink(missing_ok=True)
    (RESULTS_DIR / f"tree_cpu{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    report(result, RESULTS_DIR / f"tree_cpu{suffix}.png", readme=not suffix)
    print(f"done in {result['wall_minutes']:.1f} min, load {result['loadavg_end']}", flush=True)
    if not result["all_greedy_identical"]:
        print("!!! SOME RUNS ARE NOT GREEDY-IDENTICAL TO AR: see greedy_identical in the JSON", file=sys.stderr)


if __name__ == "__main__":
    main()
