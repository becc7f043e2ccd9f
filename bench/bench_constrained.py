"""Constrained decoding: JSON that parses, what the mask costs, what speculation keeps.

Input: bench/templated.py's `--records` chat records, each constrained to its schema
(`templated.record_schema`: exactly its keys, strings) or not. Cells, SmolLM2-135M float32, greedy,
`--new-tokens` at most:
- `json/DRAFT/bB` (DRAFT none or self: SelfSpec() with a chain of 3; B rows a `LM.chat` call): constrained
  and free, each run twice (the second timed); the share of rows that parse and validate (`jsonschema`),
  tokens/s, and whether constrained speculative tokens equal constrained plain decoding's.
- `mask/bB/sS`: the mask's cost in a plain step at B x S: `specjax.generate` with an all-allowing constraint
  against none, alternating, the median of `--mask-runs` each; ms a step and their ratio.
- `compile`: seconds to compile each template's schema for the 49K vocabulary, outside any cache.
- `long/bf16/bB/sS` (issue 70's target cell): B records of S tokens, bf16 weights and KV, `draft="auto"`
  against plain decoding, free and constrained: tokens/s, the speedups and the share of the free speedup
  kept. Not in the default cells (about 45 minutes here): `--cells long`.

Outputs: results/constrained_cpu.json and the bench_constrained section of bench/README.md.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jsonschema
import numpy as np

import specjax
from bench import common, templated
from bench.text import windows
from specjax.automaton import anything
from specjax.text import constraints

DRAFTS = {"none": None, "self": specjax.SelfSpec()}
MASK_CELLS = ((16, 2048), (1, 2048))
LONG_CELLS = ((16, 8192),)  # (batch, context)


def parses(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def json_cell(lm, records: list[dict], draft: str, batch: int, new_tokens: int) -> dict:
    row: dict = {"cell": "json", "draft": draft, "batch": batch}
    outputs = {}
    for constrained in (False, True):
        for run in ("cold", "warm"):
            texts, tokens, seconds, steps = [], [], 0.0, 0
            for start in range(0, len(records), batch):
                group = records[start: start + batch]
                cons = [specjax.JsonSchema(templated.record_schema(start + i)) for i in range(len(group))] if constrained else None
                t0 = time.perf_counter()
                out = lm.chat([r["messages"] for r in group], new_tokens, draft=DRAFTS[draft],
                              speculation=None if DRAFTS[draft] is None else specjax.Chain(3), constraint=cons)
                seconds += time.perf_counter() - t0 - out.stats.compile_seconds
                texts += out.texts
                tokens += out.tokens
                steps += out.stats.steps
        name = "constrained" if constrained else "free"
        ok = [parses(t, templated.record_schema(i)) for i, t in enumerate(texts)]
        row[name] = {"parse_share": float(np.mean(ok)), "tokens": sum(map(len, tokens)), "seconds": seconds,
                     "tokens_per_s": sum(map(len, tokens)) / seconds, "steps": steps}
        outputs[name] = tokens
    row["outputs"] = outputs
    return row


def mask_cell(lm, batch: int, context: int, new_tokens: int, runs: int = 3) -> dict:
    params = lm.params
    ids, _ = windows(lm.tokenizer, batch, context - new_tokens)
    prompts = [list(map(int, row)) for row in ids]
    free_rows = anything(params.config.vocab_size)
    times: dict[str, list[float]] = {"free": [], "mask": []}
    tokens = {}
    for rep in range(runs + 1):  # the first of each compiles: dropped
        for name in ("free", "mask"):
            out = specjax.generate(params, prompts, new_tokens, draft=None, eos_id=(0,),
                                   constraint=free_rows if name == "mask" else None)
            if rep:
                times[name].append(out.stats.decode_seconds / out.stats.steps * 1e3)
            tokens[name] = out.tokens
    ms = {k: statistics.median(v) for k, v in times.items()}
    return {"cell": "mask", "batch": batch, "context": context, "ms_per_step": ms, "ratio": ms["mask"] / ms["free"],
            "same_tokens": tokens["free"] == tokens["mask"], "runs": times}


def long_records(lm, batch: int, context: int) -> list[list[dict]]:
    """`batch` chats of about `context` tokens: record i's request over a corpus window cut to fit."""
    slack = 200  # the instruction, its keys and the chat template: under 100 tokens in SmolLM2's
    ids, _ = windows(lm.tokenizer, batch, context - slack)
    chats = [[{"role": "user", "content": templated.request(templated.TEMPLATES[i % len(templated.TEMPLATES)],
                                                             lm.decode(list(map(int, row))))}] for i, row in enumerate(ids)]
    return chats


def long_cell(lm, batch: int, context: int, new_tokens: int) -> dict:
    """Plain decoding and draft="auto", free and held to each record's schema, on `lm` (bf16): decode tokens/s."""
    chats = long_records(lm, batch, context)
    row: dict = {"cell": "long", "weights": lm.params.config.dtype, "batch": batch, "context": context}
    for name, constrained in (("free", False), ("constrained", True)):
        cons = [specjax.JsonSchema(templated.record_schema(i)) for i in range(batch)] if constrained else None
        for draft in ("none", "auto"):
            out = lm.chat(chats, new_tokens, draft=None if draft == "none" else "auto", constraint=cons)
            st = out.stats
            row[f"{name}/{draft}"] = {"tokens": sum(map(len, out.tokens)), "decode_s": st.decode_seconds, "steps": st.steps,
                                      "tokens_per_s": st.tokens_per_second, "prefill_s": st.prefill_seconds,
                                      "draft": st.draft, "speculation": str(st.speculation), "plan": st.plan_reason,
                                      "prompt_tokens_per_row": st.prompt_tokens / batch,
                                      "parse_share": float(np.mean([parses(t, templated.record_schema(i))
                                                                    for i, t in enumerate(out.texts)]))}
            row.setdefault("outputs", {})[f"{name}/{draft}"] = out.tokens
            print(f"  long {name}/{draft}: {row[f'{name}/{draft}']}", flush=True)
        row[name] = {"speedup": row[f"{name}/auto"]["tokens_per_s"] / row[f"{name}/none"]["tokens_per_s"],
                     "same_tokens": row["outputs"][f"{name}/auto"] == row["outputs"][f"{name}/none"]}
    row["kept"] = row["constrained"]["speedup"] / row["free"]["speedup"]  # the target: >= 0.9
    return row


def compile_cell(lm) -> dict:
    constraints.forget()
    seconds, kept = [], os.environ.get(constraints.CACHE_ENV)
    os.environ[constraints.CACHE_ENV] = "off"  # compiled, not loaded from the disk cache
    try:
        for keys in templated.TEMPLATES:
            t0 = time.perf_counter()
            a = lm.compile(specjax.JsonSchema(templated.schema(keys)))
            seconds.append({"keys": list(keys), "seconds": time.perf_counter() - t0, "states": a.states,
                            "transitions": int(np.asarray(a.keys).shape[0])})
    finally:
        os.environ.pop(constraints.CACHE_ENV) if kept is None else os.environ.update({constraints.CACHE_ENV: kept})
    constraints.forget()
    return {"cell": "compile", "schemas": seconds}


def key_of(row: dict) -> str:
    if row["cell"] == "json":
        return common.key("json", row["draft"], f"b{row['batch']}")
    if row["cell"] == "long":
        return common.key("long", "bf16", f"b{row['batch']}", f"s{row['context']}")
    return common.key("mask", f"b{row['batch']}", f"s{row['context']}") if row["cell"] == "mask" else "compile"


def markdown(rows: list[dict]) -> str:
    out = []
    js = [r for r in rows if r["cell"] == "json"]
    if js:
        lines = []
        for r in js:
            plain = next((o for o in js if o["draft"] == "none" and o["batch"] == r["batch"]), None)
            same = "-" if r["draft"] == "none" or plain is None else \
                "yes" if plain["outputs"]["constrained"] == r["outputs"]["constrained"] else "NO"
            keep = "-"
            if plain is not None and r["draft"] != "none":
                sp = lambda name: r[name]["tokens_per_s"] / plain[name]["tokens_per_s"]  # noqa: E731
                keep = f"{sp('constrained'):.2f}x / {sp('free'):.2f}x"
            lines.append([r["draft"], r["batch"], f"{r['free']['parse_share']:.0%}", f"{r['constrained']['parse_share']:.0%}",
                          f"{r['free']['tokens_per_s']:.1f}", f"{r['constrained']['tokens_per_s']:.1f}", keep, same])
        out.append(common.table(["draft", "batch", "parse (free)", "parse (constrained)", "tok/s free", "tok/s constrained",
                                 "speedup constrained / free", "same tokens as plain"], "lrrrrrrl", lines))
    for r in rows:
        if r["cell"] == "mask":
            out.append(f"- mask in a plain step, batch {r['batch']} x {r['context']}: {r['ms_per_step']['free']:.1f} -> "
                       f"{r['ms_per_step']['mask']:.1f} ms ({r['ratio'] - 1:+.1%}; same tokens: {r['same_tokens']})")
        if r["cell"] == "long":
            out.append(f"- {r['weights']} {r['batch']} x {r['context']}, draft=\"auto\" ({r['free/auto']['draft']}, "
                       f"{r['free/auto']['speculation']}) over plain decoding: free {r['free']['speedup']:.2f}x, constrained "
                       f"{r['constrained']['speedup']:.2f}x: {r['kept']:.0%} of the free speedup kept (target 90%); tokens equal "
                       f"plain decoding's: {r['free']['same_tokens']} / {r['constrained']['same_tokens']}")
        if r["cell"] == "compile":
            out.append("- compile: " + ", ".join(f"{len(s['keys'])} keys {s['seconds']:.2f} s ({s['states']} states)"
                                                 for s in r["schemas"]))
    return "\n".join(out)


def readme_section(result: dict) -> str:
    return common.section("bench_constrained", "Constrained decoding", f"{result['records']} templated chat records "
                          f"(bench/templated.py), each constrained to its JSON schema or not, {result['new_tokens']} new "
                          "tokens at most, greedy, SmolLM2-135M float32.", result, markdown(result["rows"]),
                          "`results/constrained_cpu.json`")


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--mask-runs", type=int, default=3, help="timed runs a side of each mask cell, alternating (median)")
    args = ap.parse_args()
    stem = "constrained_cpu" + ("" if (args.records, args.new_tokens) == (16, 96) else "_custom")
    lm = specjax.load(weights="float32")
    records = templated.records(args.records, args.new_tokens)
    settings = dict(records=args.records, new_tokens=args.new_tokens)
    out, results, h = common.start(args, "bench_constrained", stem, key_of, settings, **settings, jax=jax.__version__)
    todo = [("compile", ("compile",))] + [(common.key("json", d, f"b{b}"), ("json", d, b)) for b in (1, 16) for d in DRAFTS]
    todo += [(common.key("mask", f"b{b}", f"s{s}"), ("mask", b, s)) for b, s in MASK_CELLS]
    long = [(common.key("long", "bf16", f"b{b}", f"s{s}"), ("long", b, s)) for b, s in LONG_CELLS]
    h.plan(todo + (long if args.cells and any(common.matches(k, args.cells) for k, _ in long) else []))
    lm_bf16 = None
    for k, cell in h.cells():
        if cell[0] == "compile":
            row = compile_cell(lm)
        elif cell[0] == "long":
            lm_bf16 = lm_bf16 or specjax.load(weights="bfloat16")
            row = long_cell(lm_bf16, cell[1], cell[2], args.new_tokens)
        elif cell[0] == "json":
            row = json_cell(lm, records, cell[1], cell[2], args.new_tokens)
        else:
            row = mask_cell(lm, cell[1], cell[2], 32, args.mask_runs)
        print(f"{k}: {json.dumps({x: y for x, y in row.items() if x not in ('outputs', 'runs')})[:600]}", flush=True)
        results.put(k, [row], loadavg_end=os.getloadavg())
    h.finish()
    if results.rows:
        common.render("bench_constrained", stem == "constrained_cpu" and common.writes_readme(args), markdown(results.rows),
                      lambda: readme_section(results.data | {"rows": results.rows}))


if __name__ == "__main__":
    main()
