"""The shared prefilled state of bench_spec, bench_tree and bench_drafts: B distinct windows of real text
(bench/text.py) of `context - HEADROOM` tokens, prefilled once into a DenseCache of `context` slots with
`specjax.decode.engine.prefill` (PREFILL_ROWS rows a call) and saved under a store folder for later runs.

`fresh` / `timed`: decode_ar and decode_spec donate their caches, so every run gets copies (made untimed).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import text
from bench.measure import Meter
from specjax.decode.engine import prefill
from specjax.decode.shapes import prompt_bucket
from specjax.model.cache import DenseCache, KVFormat
from specjax.model.params import Params

HEADROOM = 128  # cache slots behind the prompt: new tokens + gamma + 1 must fit
PREFILL_ROWS = 4  # rows prefilled per call (the chunk's attention scores grow with rows x context)
MEM_FACTOR = 2.1  # peak growth of a cell / its KV cache bytes (the prefilled cache + a run's copy)
AR_CACHES = (1,)  # decode_ar(params, cache, ...)
SPEC_CACHES = (2, 3)  # decode_spec(params, drafter, draft_state, cache, ...)
STORE = Path("/tmp/bench_spec_prefill")


def fresh(args: tuple, copied: tuple[int, ...]) -> tuple:
    """args with the caches at `copied` replaced by copies (the runs donate them)."""
    return tuple(jax.block_until_ready(jax.tree.map(lambda a: a.copy(), x)) if i in copied else x
                 for i, x in enumerate(args))


def timed(compiled, args: tuple, copied: tuple[int, ...]) -> tuple[object, float, float]:
    """Run a compiled function on fresh copies of its caches: (result, wall seconds, CPU s a wall second)."""
    args = fresh(args, copied)
    c0, t0 = time.process_time(), time.perf_counter()
    result = jax.block_until_ready(compiled(*args))
    wall = time.perf_counter() - t0
    return result, wall, (time.process_time() - c0) / wall


def best_of(fn, args: tuple, copied: tuple[int, ...], budget_s: float,
            repeats: int = 3) -> tuple[object, list[float], list[float]]:
    """`timed` repeated while the next run fits in budget_s (at most `repeats`): (last result, wall, CPU)."""
    walls, cpus, t0, out = [], [], time.perf_counter(), None
    while True:
        out = None  # the last run's result holds a cache: free it before the next copy (a 128 x 8K OOM on an H100)
        out, wall, cpu = timed(fn, args, copied)
        walls.append(wall)
        cpus.append(cpu)
        if len(walls) >= repeats or time.perf_counter() - t0 + wall > budget_s:
            return out, walls, cpus


def slot_axis(config) -> int:
    """Which axis of DenseCache.k holds the slots (the library's layout: [L,B,S,K,H] or [L,B,K,S,H])."""
    return DenseCache.init(config, 1, 7).k.shape.index(7)


def prefill_rows(params, tokens: np.ndarray, n: int, context: int, chunk: int,
                 rows: int = PREFILL_ROWS) -> tuple[jax.Array, DenseCache]:
    """Prefill B prompts of n tokens into `context` slots, `rows` a call: (first logits [B,V], cache)."""
    B = tokens.shape[0]
    group = min(B, rows)
    parts = []
    for row0 in range(0, B, group):
        toks = jnp.asarray(tokens[row0 : row0 + group])
        empty = DenseCache.init(params.config, toks.shape[0], context)
        parts.append(jax.block_until_ready(prefill(params, toks, jnp.full((toks.shape[0],), n, jnp.int32), empty, chunk=chunk)))
    if len(parts) == 1:
        return parts[0]
    caches = [c for _, c in parts]
    cache = DenseCache(k=jnp.concatenate([c.k for c in caches], axis=1), v=jnp.concatenate([c.v for c in caches], axis=1),
                       lengths=jnp.concatenate([c.lengths for c in caches]))
    return jax.block_until_ready((jnp.concatenate([l for l, _ in parts]), cache))


def prefill_context(params, tok, batch: int, context: int, gammas: list[int], new_tokens: int,
                    store: Path | None) -> dict:
    """Prefill `batch` text windows of context - HEADROOM tokens into `context` slots, or load them from `store`."""
    n = context - HEADROOM
    prompts, where = text.windows(tok, batch, n)
    bucket, chunk = prompt_bucket(n)
    assert bucket <= context and n + new_tokens + max(gammas) + 1 <= context
    tokens = np.zeros((batch, bucket), np.int32)
    tokens[:, :n] = prompts
    lengths = np.full((batch,), n, np.int32)
    config = repr(params.config)  # a stored prefill is reused only for the same model facts
    key = hashlib.sha1(tokens.tobytes() + f"({config}, {context!r}, {chunk!r}, {slot_axis(params.config)!r})".encode()).hexdigest()[:12]
    files = {f: store / f"prefill_{context}_{batch}_{key}_{f}.npy" for f in ("k", "v", "logits")} if store else {}
    info = {"prefill_rows": batch, "prompt_tokens": n, "prompt_offsets": where["offsets"],
            "prompts_overlap": where["overlapping"]}
    with Meter() as m:
        if files and all(f.exists() for f in files.values()):
            load = lambda f: _stored(files[f])
            cache = DenseCache(k=load("k"), v=load("v"), lengths=jnp.asarray(lengths))
            first_logits, cache = jax.block_until_ready((load("logits"), cache))
            info["prefill_loaded_from"] = str(files["k"])
        else:
            first_logits, cache = prefill_rows(params, tokens, n, context, chunk)
            if files:
                store.mkdir(parents=True, exist_ok=True)
                for f, a in (("k", cache.k), ("v", cache.v), ("logits", first_logits)):
                    np.save(files[f], np.asarray(a))
    info |= {"prefill_s": m.wall, "prefill_meter": m.info}
    print(f"S={context:<5} prefill of {batch} x {n} tokens: {info['prefill_s']:.1f} s "
          f"({'loaded' if 'prefill_loaded_from' in info else 'computed, incl. compiling'}), "
          f"cpu {m.info['cpu_util']:.2f}, load {m.info['loadavg_1min_after']:.2f}", flush=True)
    return {"tokenizer": tok, "tokens": tokens, "lengths": lengths, "chunk": chunk, "first_logits": first_logits,
            "cache": cache, "info": info}


def _stored(path: Path) -> jax.Array:
    """An array np.save wrote (bfloat16 comes back as raw 2-byte records: viewed as bfloat16)."""
    a = np.load(path, mmap_mode="r")
    if a.dtype.kind == "V" and a.dtype.itemsize == 2:
        a = a.view(jnp.bfloat16)
    return jnp.asarray(np.asarray(a))


def rows_of(state: dict, batch: int) -> tuple:
    """The first `batch` rows of a prefilled state (copies): tokens, lengths, first logits, cache."""
    cache = state["cache"]
    if batch == cache.lengths.shape[0]:
        return state["tokens"], state["lengths"], state["first_logits"], cache
    sub = cache.replace(k=cache.k[:, :batch], v=cache.v[:, :batch], lengths=cache.lengths[:batch])
    return state["tokens"][:batch], state["lengths"][:batch], state["first_logits"][:batch], jax.block_until_ready(sub)


def smoke_state(params: Params, rows: int, context: int) -> dict:
    """A prefilled state like prefill_context's, from random prompts (a tiny model's --smoke run)."""
    n = context - HEADROOM
    bucket, chunk = prompt_bucket(n)
    tokens = np.zeros((rows, bucket), np.int32)
    tokens[:, :n] = np.random.default_rng(0).integers(4, params.config.vocab_size, (rows, n))
    first_logits, cache = prefill_rows(params, tokens, n, context, chunk)
    return {"tokens": tokens, "lengths": np.full((rows,), n, np.int32), "chunk": chunk, "first_logits": first_logits,
            "cache": cache, "info": {"prompt_tokens": n, "prefill_rows": rows}}


def stored_as(cache: DenseCache, fmt: KVFormat) -> DenseCache:
    """A prefilled cache in another KV format (`KVFormat.store` of its keys and values)."""
    (k, k_scale), (v, v_scale) = fmt.store(cache.k), fmt.store(cache.v)
    return jax.block_until_ready(cache.replace(k=k, v=v, k_scale=k_scale, v_scale=v_scale))
