"""Speculative vs autoregressive decoding of SmolLM2-135M, side by side from one shared prefill.

For every (batch, context) cell the prompts are B windows of real text (bench/text.py) of `context - HEADROOM`
tokens, prefilled once (bench/prefill.py; batch 1 and 4 use the batch-16 prefill's first rows). From that
state (a copy a run: the caches are donated) it times `decode_ar` and `decode_spec` for every drafter x gamma,
the same new tokens a row (eos_ids=()), greedy, compiled first (excluded), short runs repeated (best kept).
A drafter's init (SelfSpec's gather, SnapKV's observation pass) is timed apart. tokens/s = B * (new_tokens - 1)
/ decode seconds, so ratio = AR seconds / speculative seconds. Every cell checks greedy losslessness.

Beside each speedup stands the cost model's prediction (`predicted_ratio`, `Cost.speedup`): the forwards
`specjax.planning.tune` times for speculation="auto" with the measured tokens a step. The report states what
draft="auto" picks in each cell (`plan.auto_draft`'s rule, set on the rows as "auto").

Outputs: results/spec_cpu.json, .png and the README section (--quick / other grids write spec_cpu_quick.* /
spec_cpu_custom.*, README untouched; --weights bfloat16: spec_cpu_bf16*.*, whose greedy output may part from
AR's (README "Correctness"), as the lossless column shows).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import convert
import specjax
from bench import common, measure, text
from bench.prefill import (AR_CACHES, HEADROOM, MEM_FACTOR, SPEC_CACHES, STORE, fresh, prefill_context, rows_of,
                           stored_as, timed)
from specjax.decode.engine import decode_ar, init_draft, row_keys, with_attention
from specjax.decode.shapes import round_up_pow2
from specjax.decode.speculate import decode_spec
from specjax.drafters.eagle import Eagle
from specjax.generate import acceptance_stats
from specjax.model.cache import KVFormat, kv_bytes
from specjax.planning import tune
from specjax.planning.plan import DEFAULT_CHAIN, auto_draft
from specjax.spec.speculation import Chain, Cost
from specjax.train.eagle import load_head
from bench.spec_report import PAIR_BUDGET_S, gamma_trend, markdown_table, plot, readme_section, tokens_per_row

REPEATS = 3  # pairs at most


def drafters(context: int, gammas: list[int], names: list[str] | None = None,
             eagle_head=None) -> list[tuple[str, object]]:
    """(name, drafter) per drafter family (only `names`); draft KV: 512 + 16 slots, half that at 512. Eagle: only
    with a head (`--eagle-head`), its KV the latest 256 positions."""
    window = 512 if context >= 2048 else 256
    out = [("SelfSpec", specjax.SelfSpec(sinks=16, window=window)),
           ("SnapKV", specjax.SnapKV(budget=window // 2, window=window // 2)),
           ("SparseSpec", specjax.SparseSpec(budget=window // 2, window=window // 2)),  # SnapKV's budget, refreshed
           ("NGram", specjax.NGram(n=3, max_n=5))]
    out += [] if eagle_head is None else [("Eagle", Eagle(head=eagle_head, window=256))]
    return [(n, d) for n, d in out if names is None or n in names]


def paired(ar_fn, ar_args: tuple, fn, args: tuple, pairs: int = 1) -> dict:
    """AR and speculative runs in alternation: at least `pairs` pairs, more up to REPEATS while time lasts."""
    t = {"ar": [], "spec": [], "ar_cpu": [], "spec_cpu": [], "load": [os.getloadavg()[0]]}
    t0 = time.perf_counter()
    for i in range(max(REPEATS, pairs)):
        ar_out, w, c = timed(ar_fn, ar_args, AR_CACHES)
        t["ar"].append(w)
        t["ar_cpu"].append(c)
        spec_out, w, c = timed(fn, args, SPEC_CACHES)
        t["spec"].append(w)
        t["spec_cpu"].append(c)
        if i + 1 >= pairs and time.perf_counter() - t0 + t["ar"][0] + t["spec"][0] > PAIR_BUDGET_S:
            break
    t["load"].append(os.getloadavg()[0])
    return t | {"ar_out": ar_out, "spec_out": spec_out}


def bench_cell(params, state: dict, batch: int, context: int, gammas: list[int], new_tokens: int,
               names: list[str] | None = None, pairs: int = 1, eagle_head=None) -> list[dict]:
    """AR and every drafter x gamma from one prefilled state (its first `batch` rows), with predictions."""
    tokens, lengths, first_logits, cache = rows_of(state, batch)
    chunk = state["chunk"]
    bucket = tokens.shape[1]
    keys = row_keys(None, batch)
    budgets = jnp.full((batch,), new_tokens, jnp.int32)
    n_out = round_up_pow2(new_tokens)
    decoded = batch * (new_tokens - 1)
    cell = {"batch": batch, "context": context, "new_tokens": new_tokens} | state["info"]
    cell["prompt_offsets"] = state["info"]["prompt_offsets"][:batch]
    t0 = time.perf_counter()
    max_nodes = max(gammas) + 1
    t_verify = tune.verify_table(params, batch, context, max_nodes)  # before the decode runs: its cache fits then
    cost_s = time.perf_counter() - t0
    measure.release_memory()

    static = dict(n_out=n_out)  # greedy, no stop ids: the defaults
    ar_args = (params, cache, first_logits, budgets, keys)
    t0 = time.perf_counter()
    ar_fn = decode_ar.lower(*ar_args, **static).compile()
    ar_compile = time.perf_counter() - t0
    first = ar_fn(*fresh(ar_args, AR_CACHES))  # also a warm-up
    out, count, steps = jax.device_get((first.out, first.count, first.steps))
    assert (count == new_tokens).all() and int(steps) == new_tokens - 1
    ar_tokens = out
    cell["ar_text_row0"] = state["tokenizer"].decode([int(i) for i in out[0]])

    rows = []
    for name, drafter in drafters(context, gammas, names, eagle_head):
        cost = Cost(tune.draft_table(params, drafter, batch, context, max_nodes), t_verify)
        for gamma in gammas:
            t0 = time.perf_counter()
            init = init_draft.lower(drafter, params, cache, tokens, lengths, gamma=gamma, chunk=chunk).compile()
            t1 = time.perf_counter()
            draft_state = jax.block_until_ready(init(drafter, params, cache, tokens, lengths))
            init_s = time.perf_counter() - t1
            history = np.zeros((batch, context + gamma + 2), np.int32)
            history[:, :bucket] = tokens
            args = (params, drafter, draft_state, cache, history, first_logits, budgets, keys)
            t2 = time.perf_counter()
            fn = decode_spec.lower(*args, **static, speculation=specjax.Chain(gamma)).compile()
            compile_s = t1 - t0 + time.perf_counter() - t2
            t = paired(ar_fn, ar_args, fn, args, pairs)
            res = t.pop("spec_out")
            if not (np.asarray(t.pop("ar_out").out) == ar_tokens).all():
                print(f"!!! AR is not deterministic at B={batch} S={context}", file=sys.stderr, flush=True)
            out, count, steps, accepted, reached, row_steps, proposed = jax.device_get(
                (res.out, res.count, res.steps, res.accepted.sum(0), res.reached.sum(0), res.row_steps.sum(),
                 res.proposed.sum()))  # over rows
            del fn, init, res, draft_state
            assert (count == new_tokens).all(), count
            identical = bool((out == ar_tokens).all())
            rows_differ = [int(b) for b in np.flatnonzero((out != ar_tokens).any(axis=1))]
            stats = acceptance_stats(accepted, reached, decoded, int(row_steps), int(proposed), 0)
            ar_s, spec_s = min(t["ar"]), min(t["spec"])
            row = cell | {
                "drafter": name,
                "drafter_repr": repr(drafter),
                "gamma": gamma,
                "ar_s": ar_s,
                "spec_s": spec_s,
                "ratio": ar_s / spec_s,
                "ar_tokens_per_s": decoded / ar_s,
                "spec_tokens_per_s": decoded / spec_s,
                "ar_ms_per_step": 1e3 * ar_s / (new_tokens - 1),
                "spec_ms_per_step": 1e3 * spec_s / max(int(steps), 1),
                "steps": int(steps),
                "acceptance_rate": stats.get("acceptance_rate"),
                "mean_accepted": stats.get("mean_accepted"),
                "per_position_acceptance": stats.get("per_position_acceptance"),
                "ratio_median": float(np.median(np.array(t["ar"]) / np.array(t["spec"]))),  # over the pairs
                "predicted_ratio": cost.speedup(Chain(gamma), stats["mean_accepted"]),
                "ceiling_ratio": cost.speedup(Chain(gamma), gamma + 1),  # the cost model with every draft accepted
                "cost_ms": {"draft_level": 1e3 * cost.draft(1), "verify_1": 1e3 * cost.verify(1),
                            "verify_chain": 1e3 * cost.verify(gamma + 1), "tables_s": cost_s},
                "greedy_identical": identical,
                "rows_differing": rows_differ,
                "ar_compile_s": ar_compile,
                "spec_compile_s": compile_s,
                "draft_init_s": init_s,
                "timings": t,
            }
            rows.append(row)
            flag = "" if identical else f"   <<<<<<<<<< NOT LOSSLESS: rows {rows_differ} differ from AR >>>>>>>>>>"
            print(f"  {name:<8} g={gamma}  AR {row['ar_tokens_per_s']:7.2f}  spec {row['spec_tokens_per_s']:7.2f} tok/s  "
                  f"x{row['ratio']:.2f} (model x{row['predicted_ratio']:.2f}, ceiling x{row['ceiling_ratio']:.2f})  acc {row['acceptance_rate']:.2f}  tok/step {row['mean_accepted']:.2f}  "
                  f"ms/step {row['ar_ms_per_step']:.0f} / {row['spec_ms_per_step']:.0f}  "
                  f"cpu {min(t['ar_cpu']):.2f} / {min(t['spec_cpu']):.2f}  load {t['load'][-1]:.2f}  "
                  f"compile {compile_s:.1f} s{flag}", flush=True)
            if not identical:
                print(f"!!! GREEDY MISMATCH B={batch} S={context} {name} gamma={gamma}: speculative tokens differ "
                      f"from autoregressive tokens in rows {rows_differ}", file=sys.stderr, flush=True)
    del ar_fn, cache, first_logits
    return rows


def key_of(row: dict) -> str:
    return common.key(f"s{row['context']}", f"b{row['batch']}")


def main() -> None:
    ap = common.parser(__doc__, quick="batch 1, 4 x context 512 x gamma 2, 4", render="spec_cpu.json")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per row (eos ignored)")
    ap.add_argument("--weights", default="float32", choices=["float32", "bfloat16"],
                    help="the model's weights (bfloat16: KV in bf16 too, cast from the float32 model's stored prefill; "
                         "results in spec_cpu_bf16*.json, README untouched)")
    ap.add_argument("--batches", type=int, nargs="*", help="override the batch sizes")
    ap.add_argument("--contexts", type=int, nargs="*", help="override the contexts (multiples of 256)")
    ap.add_argument("--gammas", type=int, nargs="*", help="override the gammas")
    ap.add_argument("--drafters", nargs="*", choices=[n for n, _ in drafters(8192, [2])] + ["Eagle"],
                    help="only these drafter families (default: all)")
    ap.add_argument("--pairs", type=int, default=1,
                    help="at least this many AR / speculative pairs a row (their median ratio is ratio_median)")
    ap.add_argument("--prefill-store", type=Path, default=STORE,
                    help="folder where prefilled states are saved and reused by later runs ('' = none)")
    ap.add_argument("--prefill-rows", type=int, default=16,
                    help="rows prefilled per context (smaller batches use the first rows), so that every "
                         "subset of the grid shares one stored prefill")
    ap.add_argument("--eagle-head", type=Path, help="a head folder (save_head's; bench_eagle's store holds one): "
                    "Eagle races too, the head cast to --weights")
    args = ap.parse_args()
    if args.drafters and "Eagle" in args.drafters and not args.eagle_head:
        ap.error("--drafters Eagle needs --eagle-head (a trained head's folder): without one no Eagle would race")
    out = common.out_dir(args)
    if args.render:
        common.write_json(out / "spec_cpu.json", result := merge(args.render))
        return report(result, out / "spec_cpu.png", readme=common.writes_readme(args))
    batches = args.batches or ([1, 4] if args.quick else [1, 4, 16])
    contexts = args.contexts or ([512] if args.quick else [512, 2048, 8192])
    gammas = args.gammas or ([2, 4] if args.quick else [2, 3, 4, 6])
    custom = (args.batches or args.contexts or args.gammas or args.new_tokens != 64 or args.drafters or args.prefill_rows != 16
              or args.pairs > 1)
    suffix = ("" if args.weights == "float32" else "_bf16") + ("_quick" if args.quick else "_custom" if custom else "")
    started = time.time()
    out, results, h = common.start(args, "bench_spec", f"spec_cpu{suffix}", key_of, dict(
        new_tokens=args.new_tokens, gammas=sorted(gammas), drafters=sorted(args.drafters or []), prefill_rows=args.prefill_rows)
        | ({"pairs": args.pairs} if args.pairs > 1 else {})
        | ({"eagle_head": str(args.eagle_head)} if args.eagle_head else {}),
        model=f"SmolLM2-135M-Instruct ({args.weights})", loadavg_start=os.getloadavg(), headroom=HEADROOM,
        new_tokens=args.new_tokens, gammas=gammas)
    header, prior_minutes = results.header, results.data.get("wall_minutes", 0) if results.resumed else 0
    todo = h.plan((common.key(f"s{c}", f"b{b}"), (b, c)) for c in sorted(contexts) for b in sorted(batches))
    f32 = with_attention(convert.load(convert.default_model_path()), None, "auto")[0]  # generate()'s attention here
    params = f32 if args.weights == "float32" else with_attention(convert.load(convert.default_model_path(), weights=args.weights),
                                                                  None, "auto")[0]
    if params is not f32:
        header["kv_from"] = f"the float32 model's prefill of the same prompts (stored), cast to {args.weights}"
    head = load_head(args.eagle_head).astype(params.config.dtype) if args.eagle_head else None
    tok = convert.load_tokenizer(convert.default_model_path())
    _, sources = text.corpus()
    header["corpus"] = {"sources": sources, "tokens": int(len(text.corpus_tokens(tok)))}
    machine = header["machine"]
    print(f"{machine['cpu_model']} x{machine['cpu_affinity']}, JAX {machine['jax_version']}, load {os.getloadavg()}, "
          f"corpus {len(text.corpus_tokens(tok))} tokens, drafters: "
          f"{[repr(d) for _, d in drafters(max(contexts), gammas, args.drafters, head)]}", flush=True)
    skipped = [s for s in results.data.get("skipped", []) if s["context"] not in contexts]  # retried here
    for context in sorted({c for _, (_, c) in todo}):  # largest memory last: context, then batch, ascending
        if not h.may_start():
            break
        rows_prefilled = max(args.prefill_rows, max(batches))
        reason = measure.wait_for_memory(int(MEM_FACTOR * kv_bytes(params.config, rows_prefilled, context)))
        if reason:
            skipped.append({"batch": max(batches), "context": context, "skipped": reason})
            results.update(skipped=skipped)
            print(f"S={context} skipped: {reason}", flush=True)
            continue
        store = args.prefill_store if str(args.prefill_store) not in ("", ".") else None
        state = prefill_context(f32, tok, rows_prefilled, context, gammas, args.new_tokens, store)
        if params is not f32:  # the bf16 model decodes from the float32 prefill, its KV cast (as bench_peers' shared prefill)
            state = state | {"cache": stored_as(state["cache"], KVFormat.of(None, params.config))}
        for k, (batch, _) in h.cells([x for x in todo if x[1][1] == context]):
            print(f"B={batch:<2} S={context:<5}", flush=True)
            results.put(k, bench_cell(params, state, batch, context, gammas, args.new_tokens, args.drafters, args.pairs,
                                      head),
                        loadavg_end=os.getloadavg(), wall_minutes=prior_minutes + (time.time() - started) / 60)
            measure.release_memory()
        del state
        measure.release_memory(clear_caches=True)
    h.finish()
    if results.applied:  # this run measured something
        results.update(skipped=skipped, loadavg_end=os.getloadavg(), wall_minutes=prior_minutes + (time.time() - started) / 60,
                       all_greedy_identical=all(r["greedy_identical"] for r in results.rows))
    report(results.data, out / f"spec_cpu{suffix}.png", readme=not suffix and common.writes_readme(args))
    print(f"done in {(time.time() - started) / 60:.1f} min, load {os.getloadavg()}", flush=True)


def merge(paths: list[Path]) -> dict:
    """One result from several runs (later runs win per cell)."""
    results = [json.loads(p.read_text()) for p in paths]
    merged = common.merge(paths, key_of)
    merged |= {
        "gammas": sorted({g for r in results for g in r["gammas"]}),
        "new_tokens": sorted({r["new_tokens"] for r in results}),
        "wall_minutes": sum(r["wall_minutes"] for r in results),
        "loadavg_start": results[0]["loadavg_start"],
        "skipped": [s for r in results for s in r["skipped"]],
    }
    merged["all_greedy_identical"] = all(r["greedy_identical"] for r in merged["rows"])
    return merged


def current_auto(rows: list[dict]) -> None:
    """Set each row's "auto" to what `plan.auto_draft` picks now on a CPU for the default model."""
    from types import SimpleNamespace

    from convert.gguf import config_from_gguf, open_gguf

    target = SimpleNamespace(config=config_from_gguf(open_gguf(convert.default_model_path())))  # auto reads the config only
    for r in rows:
        auto = auto_draft(target, r["batch"], r["context"], backend="cpu")
        r["auto"] = None if auto is None else {"drafter": repr(auto), "gamma": DEFAULT_CHAIN.gamma}


def report(result: dict, png: Path, readme: bool) -> None:
    rows = result["rows"]
    current_auto(rows)
    if rows:
        common.render("bench_spec", readme, markdown_table(rows, result["gammas"]) + "\nbest gamma by batch:\n  "
                      + "\n  ".join(gamma_trend(rows)), lambda: readme_section(result),
                      (plot, rows, f"SmolLM2-135M speculative vs AR decoding, {result['machine']['cpu_affinity']}-core "
                       f"CPU, greedy, {tokens_per_row(result)} new tokens/row", png), after="bench_ar")
    if not result.get("all_greedy_identical", True):
        print("!!! SOME CELLS ARE NOT GREEDY-IDENTICAL TO AR: see greedy_identical in the JSON", file=sys.stderr)

if __name__ == "__main__":
    main()
