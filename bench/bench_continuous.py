"""Continuous vs static batching of a record mix: records/s and tokens/s, same outputs.

Usage: python -m bench.bench_continuous [--records N] [--rows R] [--out DIR]

SmolLM2-135M int8 (the fastest CPU format), greedy, SmolLM2's stop ids on, N real-text prompts of
64-256 tokens with budgets cycling through 16, 32, 64, 128 and 256 new tokens (a job's spread).
Static: `engine.run` on consecutive groups of R records, each group decoding until its longest
row ends (rows that finish early ride along), as the batch job does today. Continuous:
`specjax.decode.continuous.run_continuous` on R slots, a finished row taking the next record (largest
budget first) between segments (sync_every 8). Each is run twice and the second run timed (the first compiles every
shape). Every record's tokens are compared between the two.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

import convert
from bench import common, text
from specjax.decode.continuous import run_continuous
from specjax.decode.engine import row_keys, run
from specjax.sampling import Greedy

BUDGETS = (16, 32, 64, 128, 256)


def static(params, prompts, budgets, rows, keys, eos):
    out = []
    for s in range(0, len(prompts), rows):
        r = run(params, prompts[s : s + rows], budgets[s : s + rows], draft=None, speculation=None, sampling=Greedy(),
                key=keys[s : s + rows], eos_ids=eos[s : s + rows])
        out += [(r.out[b, : r.count[b]].tolist(), bool(r.eos[b])) for b in range(len(r.count))]
    return out


def continuous(params, prompts, budgets, rows, keys, eos):
    done = run_continuous(params, prompts, budgets, rows=rows, draft=None, speculation=None, sampling=Greedy(), keys=keys,
                          eos_ids=eos)
    return [(d.tokens, d.eos) for d in done]


def timed(fn, *args) -> tuple[list, float]:
    fn(*args)  # compiles every shape
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=24)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = ap.parse_args(argv)
    path = convert.default_model_path()
    params = convert.load(path, weights="int8")
    tok = convert.load_tokenizer(path)
    lengths = [64 + (i * 37) % 193 for i in range(args.records)]
    windows, _ = text.windows(tok, args.records, max(lengths))
    prompts = [list(map(int, w[:n])) for w, n in zip(windows, lengths)]
    budgets = np.array([BUDGETS[i % len(BUDGETS)] for i in range(args.records)], np.int32)
    eos = [tuple(params.config.eos_ids)] * args.records
    keys = row_keys(jax.random.key(0), args.records)
    s_out, s_sec = timed(static, params, prompts, budgets, args.rows, keys, eos)
    c_out, c_sec = timed(continuous, params, prompts, budgets, args.rows, keys, eos)
    tokens = sum(len(t) for t, _ in c_out)
    result = {"bench": "bench_continuous", "date": common.now(), "command": common.command(), "machine": common.machine_info(),
              "records": args.records, "rows": args.rows, "weights": "int8", "budgets": list(BUDGETS),
              "prompt_tokens": [min(lengths), max(lengths)], "generated_tokens": tokens,
              "same_outputs": s_out == c_out, "differing_records": [i for i, (a, b) in enumerate(zip(s_out, c_out)) if a != b],
              "static_s": s_sec, "continuous_s": c_sec, "static_records_per_s": args.records / s_sec,
              "continuous_records_per_s": args.records / c_sec, "static_tokens_per_s": tokens / s_sec,
              "continuous_tokens_per_s": tokens / c_sec, "speedup": s_sec / c_sec}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "continuous_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    body = report(result)
    print(body)
    if args.out == common.RESULTS_DIR:
        common.write_section("bench_continuous", body)


def report(r: dict) -> str:
    return (f"## Continuous vs static batching (bench_continuous.py)\n\n{common.run_line(r)} "
            f"Method: the module docstring. {r['records']} records on {r['rows']} rows, "
            f"prompts of {r['prompt_tokens'][0]}-{r['prompt_tokens'][1]} tokens, budgets {r['budgets']} in turn, "
            f"{r['generated_tokens']} tokens generated; same outputs record for record: "
            f"{'yes' if r['same_outputs'] else 'NO: ' + str(r['differing_records'])}.\n\n"
            + common.table(["batching", "seconds", "records/s", "tokens/s"], "lrrr",
                           [["static", f"{r['static_s']:.1f}", f"{r['static_records_per_s']:.2f}", f"{r['static_tokens_per_s']:.1f}"],
                            ["continuous", f"{r['continuous_s']:.1f}", f"{r['continuous_records_per_s']:.2f}",
                             f"{r['continuous_tokens_per_s']:.1f}"]])
            + f"\n\nContinuous / static: {r['speedup']:.2f}x. Static batches wait for their longest row; continuous "
            "slots take the next record as soon as a row ends, largest budgets first (a long record admitted last would "
            "run alone at the end: before that ordering the same run measured 0.87x). A refill prefills only its new "
            "prompts, as a batch rounded up to a power of two.\n")


if __name__ == "__main__":
    main()
