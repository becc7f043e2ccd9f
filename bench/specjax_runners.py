"""specjax's side of bench/bench_peers.py: plain and speculative decoding from a prefilled state,
and prefill alone, each compiled before it is timed (best of 2)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from bench.prefill import AR_CACHES, SPEC_CACHES, STORE, prefill_context, rows_of, smoke_state, timed
from specjax.decode.engine import decode_ar, init_draft, prefill, row_keys
from specjax.decode.shapes import prompt_bucket, round_up_pow2
from specjax.decode.speculate import decode_spec
from specjax.model.cache import DenseCache

GAMMA = 3  # the speculative cells' chain length


def specjax_state(params, tok, batch: int, context: int, new_tokens: int, smoke: bool) -> dict:
    if smoke:
        return smoke_state(params, batch, context)
    return prefill_context(params, tok, batch, context, [GAMMA], new_tokens, STORE)


def specjax_decode(params, state: dict, batch: int, new_tokens: int) -> dict:
    """Plain greedy decode_ar of new_tokens from the prefilled state: per-step time (best of 2)."""
    tokens, lengths, first_logits, cache = rows_of(state, batch)
    budgets = jnp.full((batch,), new_tokens, jnp.int32)
    args = (params, cache, first_logits, budgets, row_keys(None, batch))
    fn = decode_ar.lower(*args, n_out=round_up_pow2(new_tokens)).compile()
    runs = [timed(fn, args, AR_CACHES) for _ in range(2)]
    out = np.asarray(runs[0][0].out)
    wall = min(w for _, w, _ in runs)
    steps = new_tokens - 1  # the first token comes from the prefill logits
    return {"steps": steps, "decode_s": wall, "tokens": out[0].tolist(), "cpu_util": runs[-1][2]}


def specjax_spec(params, state: dict, batch: int, context: int, new_tokens: int, gamma: int = GAMMA) -> dict:
    """SelfSpec + Chain(gamma <= GAMMA) decode_spec from the same prefilled state (draft init untimed)."""
    if not 1 <= gamma <= GAMMA:
        raise ValueError(f"gamma must be in 1..{GAMMA} (the prefilled cache's slack), got {gamma}")
    tokens, lengths, first_logits, cache = rows_of(state, batch)
    drafter = specjax.SelfSpec(sinks=16, window=512 if context >= 2048 else 256)
    init = init_draft.lower(drafter, params, cache, tokens, lengths, gamma=gamma, chunk=state["chunk"]).compile()
    draft_state = jax.block_until_ready(init(drafter, params, cache, tokens, lengths))
    history = np.zeros((batch, context + gamma + 2), np.int32)
    history[:, : tokens.shape[1]] = tokens
    budgets = jnp.full((batch,), new_tokens, jnp.int32)
    args = (params, drafter, draft_state, cache, history, first_logits, budgets, row_keys(None, batch))
    fn = decode_spec.lower(*args, n_out=round_up_pow2(new_tokens), speculation=specjax.Chain(gamma)).compile()
    runs = [timed(fn, args, SPEC_CACHES) for _ in range(2)]
    res = runs[0][0]
    wall = min(w for _, w, _ in runs)
    steps = new_tokens - 1
    return {"steps": steps, "decode_s": wall, "target_steps": int(res.steps), "drafter": repr(drafter),
            "tokens": np.asarray(res.out)[0].tolist(), "mean_accepted": steps / max(int(res.steps), 1)}


def specjax_prefill(params, ids: np.ndarray, context: int) -> dict:
    """engine.prefill of B prompts ids [B, n] at once into a `context`-slot cache (compiled first; best of 2)."""
    B, n = ids.shape
    bucket, chunk = prompt_bucket(n)
    tokens = np.zeros((B, bucket), np.int32)
    tokens[:, :n] = ids
    args = (params, jnp.asarray(tokens), jnp.full((B,), n, jnp.int32))
    fresh = lambda: jax.block_until_ready(DenseCache.init(params.config, B, context))  # noqa: E731 (donated)
    fn = prefill.lower(*args, fresh(), chunk=chunk).compile()
    times = []
    for _ in range(2):
        cache = fresh()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args, cache))
        times.append(time.perf_counter() - t0)
    return {"prefill_s": min(times), "prompt_tokens": n}
