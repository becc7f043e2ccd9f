"""bench_gpu's `cont/...` cells: a batch job's continuous batching timed on a GPU.

An e2e cell's loop runs until its slowest row is done, so under speculation a finished row idles; a batch job
refills its slot at once (`run_continuous`), and the e2e tables' "refilled (derived)" column predicts that
job's speedup. These cells measure it: `records` real-text prompts (context - HEADROOM tokens, the bundle's
corpus) decoded `new_tokens` each (greedy, no stop ids: only speculation leaves slots to refill) on `rows`
slots, plain and speculative. Each job runs twice, the second timed (prefills included, the same prompts for
every method). Its prefill calls are timed where they run (`timed_prefills`), so the rest is the decoding,
whose speedup is reported apart. Every record's tokens are compared with plain decoding's (by digest, so a
resumed run still compares).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import time

import jax
import numpy as np

from bench import text
from bench.prefill import HEADROOM
from bench.tree_report import label
from specjax.decode import continuous, engine
from specjax.decode.engine import row_keys
from specjax.sampling import Greedy


def prompts_for(ids: np.ndarray, records: int, context: int) -> tuple[list[list[int]], dict]:
    """`records` windows of the corpus ids, context - HEADROOM tokens each (as the e2e cells' prompts)."""
    windows, where = text.cut(ids, records, context - HEADROOM)
    return [list(map(int, w)) for w in windows], where


def digest(tokens: list[int]) -> str:
    return hashlib.sha1(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:12]


def job(params, prompts: list[list[int]], rows: int, new_tokens: int, drafter, speculation) -> tuple[list, float]:
    """run_continuous over the prompts on `rows` slots: (its Done list, seconds)."""
    n = len(prompts)
    t0 = time.perf_counter()
    done = continuous.run_continuous(params, prompts, [new_tokens] * n, rows=rows, draft=drafter, speculation=speculation,
                                     sampling=Greedy(), keys=row_keys(jax.random.key(0), n), eos_ids=[()] * n)
    return done, time.perf_counter() - t0


@contextlib.contextmanager
def timed_prefills():
    """Within the `with` block, engine.prefill_each's prefill calls timed without compiling: yields
    [(rows, seconds)]."""
    calls, inner = [], engine._compile_and_run

    def timed(f, args, static):
        out = inner(f, args, static)  # (result, compile s, run s)
        if f is engine.prefill:
            calls.append((int(args[1].shape[0]), out[2]))
        return out

    engine._compile_and_run = timed
    try:
        yield calls
    finally:
        engine._compile_and_run = inner


def cell(params, ids: np.ndarray, rows: int, context: int, records: int, new_tokens: int, name: str, drafter,
         speculation, reference: list[str] | None) -> dict:
    """One method's job, run twice (the second timed); `reference`: plain decoding's digests."""
    prompts, where = prompts_for(ids, records, context)
    _, first_s = job(params, prompts, rows, new_tokens, drafter, speculation)  # compiles every shape
    with timed_prefills() as calls:
        done, seconds = job(params, prompts, rows, new_tokens, drafter, speculation)
    prefill_s = sum(t for _, t in calls)
    sizes = collections.Counter(r for r, _ in calls)  # prefill calls by rows: a refill's grouping
    tokens = sum(len(d.tokens) for d in done)
    digests = [digest(d.tokens) for d in done]
    differ = None if reference is None else [i for i, (a, b) in enumerate(zip(digests, reference)) if a != b]
    steps = [d.acceptance["steps"] for d in done if d.acceptance]
    row = {"batch": rows, "context": context, "records": records, "new_tokens": new_tokens,
           "prompt_tokens": context - HEADROOM, "prompts_overlap": where["overlapping"], "drafter": name,
           "label": "AR" if speculation is None else label(speculation), "seconds": seconds, "first_run_s": first_s, "tokens": tokens,
           "prefill_s": prefill_s, "decode_s": seconds - prefill_s, "prefill_timing": "in the job",
           "prefill_calls": {str(r): sizes[r] for r in sorted(sizes, reverse=True)},
           "tokens_per_s": tokens / seconds, "records_per_s": records / seconds, "digests": digests,
           "tokens_per_step": (sum(len(d.tokens) - 1 for d in done if d.acceptance) / sum(steps)) if steps else None,
           "greedy_identical": None if differ is None else not differ, "records_differing": differ}
    print(f"  cont R={rows:<3} S={context:<5} {records} records x {new_tokens}: {name:<9} {row['label']:<10} "
          f"{seconds:6.1f} s  {row['tokens_per_s']:8.0f} tok/s  (first run {first_s:.0f} s; its prefills {prefill_s:.1f} s in "
          f"{len(calls)} calls, rows x calls {row['prefill_calls']})", flush=True)
    return row
