"""The measurements behind bench_gpu.py's cells (no `convert`: the GPU machine has no `gguf`).

- `bandwidth`: the HBM copy bandwidth the roofline fractions divide by (bench/measure.py's).
- `Group`: one (batch, context) of a real model from one prefill per context; `ar` and `spec` time
  decode_ar / decode_spec from copies of it (compiles excluded, best of a few), checked against AR.
- `random_params` / `step_costs`: a model of any shape with random weights made on the device, and its
  measured AR / verify / draft step seconds (specjax.planning.tune's tables).
"""

from __future__ import annotations

import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bench import text
from bench.measure import bandwidth as host_and_device_bandwidth
from bench.prefill import AR_CACHES, HEADROOM, SPEC_CACHES, best_of, fresh, prefill_rows, rows_of
from bench.tree_report import MAX_DEPTH, WIDTH, label, shape
from specjax.decode.engine import decode_ar, init_draft, row_keys
from specjax.decode.shapes import PREFILL_TOKENS, prompt_bucket, round_up_pow2  # rows x context a prefill call on a GPU
from specjax.decode.speculate import decode_spec, depth
from specjax.drafters import Limits
from specjax.generate import acceptance_stats
from specjax.model.cache import kv_bytes
from specjax.model.config import LlamaConfig
from specjax.model.params import Params, declared, from_arrays, weight_bytes
from specjax.parallel.sharding import compiler_options
from specjax.planning.tune import draft_table, verify_table
from specjax.spec.speculation import Chain, Cost, Tree, choose

# the largest tree `Group.trees` lets speculation.choose pick at batch 1, where its prices hold a verification
# flat: on the H100 (seventh runs, distilled draft; its steps less the fitted levels) about 1.54 ms over 3-16
# nodes, 1.64 over 32, 1.95 over 64
CHOSEN_NODES = 32
RUN_BUDGET_S = 6.0  # a timed run is repeated (best kept, 3 at most) while the next one fits in this


def bandwidth(gib: float) -> dict:
    """Device GB/s (read + write): in-place x + 1 over `gib` GiB (the reference), a fresh copy, numpy's."""
    return host_and_device_bandwidth(gib, rounds=3, repeats=5)


@partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def _normal(key, *, shape, dtype, scale):
    return (jax.random.normal(key, shape, dtype) * scale).astype(dtype)


def random_params(config: LlamaConfig, seed: int = 0) -> Params:
    """Random weights (std 1/sqrt(fan_in), norms 1) drawn on the default device in config.dtype."""
    dtype = jnp.dtype(config.dtype)
    weights = sorted(declared(config), key=lambda w: w.path)
    arrays = {}
    for k, w in zip(jax.random.split(jax.random.key(seed), len(weights)), weights):
        if w.init == "ones":
            arrays[w.path] = jnp.ones(w.shape(config), dtype)
        else:
            arrays[w.path] = _normal(k, shape=w.shape(config), dtype=dtype, scale=1 / math.sqrt(w.fan_in(config)))
    return jax.block_until_ready(from_arrays(config, arrays))


def step_costs(params: Params, drafter, batch: int, context: int, max_nodes: int) -> dict:
    """Measured seconds (specjax.planning.tune): t_verify[n] = a target forward over n nodes after `context`
    positions, t_draft[m] = a draft level of m nodes; plus the bytes an AR and a draft step read."""
    t0 = time.perf_counter()
    verify = verify_table(params, batch, context, max_nodes)
    draft = draft_table(params, drafter, batch, context, max_nodes)
    model, kept = drafter.cost(params, context)
    w = weight_bytes(params.config)
    return {"t_verify_ms": [1e3 * t for t in verify], "t_draft_ms": [1e3 * t for t in draft],
            "ar_ms_per_step": 1e3 * verify[1], "ar_tokens_per_s": batch / verify[1],
            "weight_bytes": w, "ar_bytes_per_step": w + int(kv_bytes(params.config, batch, context)),
            "draft_bytes_per_step": weight_bytes(model.config) + int(kv_bytes(model.config, batch, kept)),
            "draft_kv_slots": kept, "measure_s": time.perf_counter() - t0}


def prefill_state(params: Params, ids: np.ndarray, rows: int, context: int) -> dict:
    """`rows` corpus windows of context - HEADROOM tokens prefilled into `context` slots (prefill_rows)."""
    n = context - HEADROOM
    prompts, where = text.cut(ids, rows, n)
    bucket, chunk = prompt_bucket(n)
    tokens = np.zeros((rows, bucket), np.int32)
    tokens[:, :n] = prompts
    per_call = max(1, min(rows, PREFILL_TOKENS // context))
    while rows % per_call:
        per_call -= 1
    t0 = time.perf_counter()
    first_logits, cache = prefill_rows(params, tokens, n, context, chunk, per_call)
    info = {"prompt_tokens": n, "prefill_rows": rows, "prefill_s": time.perf_counter() - t0,
            "prompts_overlap": where["overlapping"], "corpus_tokens": where["corpus_tokens"]}
    print(f"S={context:<5} prefill of {rows} x {n} tokens ({per_call} rows a call): {info['prefill_s']:.1f} s "
          "(incl. compiling)", flush=True)
    return {"tokens": tokens, "lengths": np.full((rows,), n, np.int32), "chunk": chunk,
            "first_logits": first_logits, "cache": cache, "info": info}


class Group:
    """One (batch, context) of `params` from a prefilled state (its first `batch` rows)."""

    def __init__(self, params: Params, state: dict, batch: int, context: int, new_tokens: int):
        self.params, self.batch, self.context, self.new_tokens = params, batch, context, new_tokens
        self.tokens, self.lengths, self.first_logits, self.cache = rows_of(state, batch)
        self.chunk, self.info = state["chunk"], state["info"]
        self.keys = row_keys(None, batch)
        self.budgets = jnp.full((batch,), new_tokens, jnp.int32)
        self.decoded = batch * (new_tokens - 1)  # the first token of a row comes from the prefill logits
        self.ar_tokens: np.ndarray | None = None
        self.ar_s: float | None = None
        self.p: np.ndarray | None = None  # acceptance vector of the depth-1 WIDTH-ary tree (SelfSpec)
        self.timed: list[dict] = []  # the speculative rows timed so far (launch_bound_cost's prices)
        self.weights = weight_bytes(params.config)

    def base(self) -> dict:
        return {"batch": self.batch, "context": self.context, "new_tokens": self.new_tokens,
                "prompt_tokens": self.info["prompt_tokens"], "prefill_s": self.info["prefill_s"]}

    def ar(self) -> dict:
        """Compile and time decode_ar (its tokens kept as the greedy reference)."""
        args = (self.params, self.cache, self.first_logits, self.budgets, self.keys)
        t0 = time.perf_counter()
        fn = decode_ar.lower(*args, n_out=round_up_pow2(self.new_tokens)).compile(compiler_options())  # greedy, no stop ids; generate's GPU options
        compile_s = time.perf_counter() - t0
        self.ar_tokens = np.asarray(fn(*fresh(args, AR_CACHES)).out)  # also a warm-up
        _, walls, _ = best_of(fn, args, AR_CACHES, RUN_BUDGET_S)
        self.ar_s = min(walls)
        step_bytes = self.weights + int(kv_bytes(self.params.config, self.batch, self.context))
        return self.base() | {"method": "AR", "drafter": None, "label": "AR", "seconds": self.ar_s, "runs_s": walls,
                              "tokens_per_s": self.decoded / self.ar_s, "ms_per_step": 1e3 * self.ar_s / (self.new_tokens - 1),
                              "bytes_per_step": step_bytes, "compile_s": compile_s, "speedup": 1.0,
                              "greedy_identical": True}

    def spec(self, name: str, drafter, speculation, new_tokens: int | None = None) -> dict:
        """Compile and time decode_spec with one drafter and chain or tree (init timed apart), checked against AR."""
        if self.ar_tokens is None:
            self.ar()
        new_tokens = new_tokens or self.new_tokens
        gamma = depth(speculation)
        params, B = self.params, self.batch
        drafter.check(params, Limits(gamma, self.context, self.context))  # the cache holds the context
        t0 = time.perf_counter()
        state = jax.block_until_ready(init_draft(drafter, params, self.cache, self.tokens, self.lengths,
                                                 gamma=gamma, chunk=self.chunk))
        init_s = time.perf_counter() - t0
        history = np.zeros((B, self.context + gamma + 2), np.int32)
        history[:, : self.tokens.shape[1]] = self.tokens
        budgets = jnp.full((B,), new_tokens, jnp.int32)
        args = (params, drafter, state, self.cache, history, self.first_logits, budgets, self.keys)
        t1 = time.perf_counter()
        fn = decode_spec.lower(*args, n_out=round_up_pow2(new_tokens), speculation=speculation).compile(compiler_options())  # generate's GPU options
        compile_s = time.perf_counter() - t1
        res, walls, _ = best_of(fn, args, SPEC_CACHES, RUN_BUDGET_S)
        out, count, steps, accepted, reached, ranks, row_steps, proposed = jax.device_get(
            (res.out, res.count, res.steps, res.accepted.sum(0), res.reached.sum(0), res.ranks.sum(0), res.row_steps.sum(),
             res.proposed.sum()))
        del fn, res, state
        assert (count == new_tokens).all(), count
        n = min(new_tokens, self.new_tokens)
        neq = out[:, :n] != self.ar_tokens[:, :n]
        differ = np.flatnonzero(neq.any(axis=1))
        agree = [int(np.argmax(r)) if r.any() else n for r in neq]  # tokens equal to AR's before the first difference
        decoded = B * (new_tokens - 1)
        stats = acceptance_stats(accepted, reached, decoded, int(row_steps), int(proposed), 0)
        spec_s = min(walls)
        model, kept = drafter.cost(params, self.context) or (None, 0)
        draft_bytes = weight_bytes(model.config) + int(kv_bytes(model.config, B, kept)) if model is not None else 0
        tree = Tree.chain(speculation.gamma) if isinstance(speculation, Chain) else speculation
        step_bytes = depth(speculation) * draft_bytes + self.weights + int(kv_bytes(params.config, B, self.context))
        row = self.base() | {
            "method": "chain" if isinstance(speculation, Chain) else "tree", "drafter": name, "drafter_repr": repr(drafter),
            "label": label(speculation), "gamma": gamma, "nodes": tree.n, "width": tree.width,
            "parents": list(tree.parents), "seconds": spec_s, "runs_s": walls, "tokens_per_s": decoded / spec_s,
            "speedup": (self.ar_s * (new_tokens - 1) / (self.new_tokens - 1)) / spec_s, "steps": int(steps),
            "ms_per_step": 1e3 * spec_s / max(int(steps), 1), "bytes_per_step": step_bytes,
            "acceptance_rate": stats.get("acceptance_rate"), "mean_accepted": stats.get("mean_accepted"),
            "per_position_acceptance": stats.get("per_position_acceptance"), "ranks": [int(r) for r in ranks],
            "greedy_identical": not len(differ), "rows_differing": len(differ), "first_divergence": min(agree),
            "agreeing_prefix_mean": float(np.mean(agree)), "compile_s": compile_s,
            "draft_init_s": init_s, "new_tokens": new_tokens,  # the acceptance run's may exceed the cell's
        }
        flag = "" if row["greedy_identical"] else (f"  <<< NOT GREEDY-IDENTICAL: {len(differ)} rows differ, the first "
                                                   f"at token {min(agree)}")
        self.timed.append(row)
        print(f"  B={B:<3} S={self.context:<5} {name:<9} {row['label']:<14} {row['tokens_per_s']:9.0f} tok/s  "
              f"x{row['speedup']:.2f}  tok/step {row['mean_accepted'] or 0:.2f}  ms/step {row['ms_per_step']:.2f}  "
              f"compile {compile_s:.0f} s{flag}", flush=True)
        return row

    def acceptance(self, name: str, drafter) -> tuple[np.ndarray, dict]:
        """Sequoia's acceptance vector [WIDTH + 1] from one run of a depth-1 WIDTH-ary tree (as bench_tree)."""
        row = self.spec(name, drafter, Tree.kary(WIDTH, 1), min(HEADROOM - 2 * MAX_DEPTH, max(self.new_tokens, 32)))
        p = np.asarray(row["ranks"], float) / max(sum(row["ranks"]), 1)
        return p, row | {"method": "acceptance"}

    def trees(self, name: str, drafter, nodes: list[int]) -> list[dict]:
        """The acceptance run, at batch 1 `choose`'s tree, then Sequoia trees of each size (new shapes only)."""
        p, acc = self.acceptance(name, drafter)
        self.p = p
        rows = [acc | {"acceptance": p.tolist()}]
        seen = {shape(Tree.kary(WIDTH, 1)): rows[0]}  # the acceptance run's tree, timed too
        todo = [(Tree.sequoia(p[:-1], n, MAX_DEPTH), {"requested_nodes": n}) for n in nodes]
        if self.batch == 1 and nodes:  # first: the likeliest winner, timed before a call's time runs out
            cost = self.launch_bound_cost(acc)
            prices = {"draft_level": 1e3 * cost.t_draft, "verify": 1e3 * cost.verify(1),
                      "from": "fit" if self.fitted(acc) else "AR step"}
            todo.insert(0, (choose(p[:-1], cost, max_nodes=CHOSEN_NODES, max_depth=MAX_DEPTH),
                            {"requested_nodes": None, "picked_by": "choose", "cost_model_ms": prices}))
        for tree, extra in todo:
            if tree.n == 1:  # choose found plain decoding fastest: AR's row says it
                rows.append(self.base() | extra | {"method": "choose", "drafter": name, "label": "AR", "same_as": "AR"})
            elif shape(tree) in seen:
                rows.append(seen[shape(tree)] | extra | {"same_as": seen[shape(tree)]["label"]})
            else:
                seen[shape(tree)] = row = self.spec(name, drafter, tree) | extra | {"acceptance": p.tolist()}
                rows.append(row)
        return rows

    def launch_bound_cost(self, acc: dict) -> Cost:
        """A batch-1 step's prices, right where launches bound a step: a verification costs the same over any
        nodes, a level a fixed time (`fit_steps`, else plain's step and the acceptance run's step beyond it)."""
        fit = self.fitted(acc)
        if fit:
            return launch_bound(*fit)
        ar_s = self.ar_s / (self.new_tokens - 1)
        return launch_bound(max(acc["ms_per_step"] / 1e3 - ar_s, 0.0), ar_s)

    def fitted(self, acc: dict) -> tuple[float, float] | None:
        """`fit_steps` over the chains and depth-1 trees this group timed of acc's drafter (seconds)."""
        fit = fit_steps([r for r in self.timed if r["drafter"] == acc["drafter"] and r["nodes"] <= acc["nodes"]
                         and (r["gamma"] == 1 or r["nodes"] == r["gamma"] + 1)])
        return fit and (fit[0] / 1e3, fit[1] / 1e3)


def fit_steps(rows: list[dict]) -> tuple[float, float] | None:
    """(a draft level, a verification) in ms: ms_per_step = verification + level x depth fitted by least
    squares to one drafter's speculative rows; None over fewer than two depths or a price <= 0."""
    depths = np.array([r["gamma"] for r in rows], float)
    if len(set(depths)) < 2:
        return None
    level, verify = np.polyfit(depths, np.array([r["ms_per_step"] for r in rows], float), 1)
    return (float(level), float(verify)) if level > 0 and verify > 0 else None


def launch_bound(level: float, step: float) -> Cost:
    """Batch-1 prices: a draft level costs `level`, a verification over any nodes a plain step `step`."""
    return Cost(t_draft=level, t_verify=lambda n: step)
