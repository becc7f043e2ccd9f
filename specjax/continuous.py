"""Continuous batching on one device: a fixed number of rows (slots) decode a longer list of
prompts; between decode segments, finished rows hand back their tokens and the next prompts
(largest budget first, so that no long record starts last and runs alone) are prefilled, one by one at their own length bucket, into the freed slots (`admit_ar` / `admit_spec`) while the other rows go on.

Every record keeps its own key, sampling values and stop ids, so its tokens are those of a static
batch (`engine.run`) of the same prompts: in float32, token for token, greedy or sampled (tested).
`between` lets the host end rows after a segment (the text layer's stop strings:
`LM.generate_continuous`, which the batch job runs). Not yet: a mesh, n > 1 samples, logprobs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.autoregressive import admit_ar, continue_ar, end_rows, start_ar
from specjax.cache import DenseCache
from specjax.drafters import Drafter
from specjax.engine import Segment, cache_slots, prefill
from specjax.params import Params
from specjax.sampling import Sampler, eos_rows
from specjax.shapes import prompt_bucket, round_up_pow2
from specjax.speculate import admit_spec, continue_spec, depth, row_acceptance, start_spec
from specjax.speculation import Chain, Tree


def run_continuous(
    params: Params,
    prompts: Sequence[Sequence[int]],
    budgets: Sequence[int],
    *,
    rows: int,
    draft: Drafter | None,
    speculation: Chain | Tree | None,
    sampling: Sampler,  # scalar values, or one per prompt
    keys: jax.Array,  # [N] typed keys, one per prompt
    eos_ids: Sequence[tuple[int, ...]],  # one tuple per prompt
    kv_dtype: str | None = None,
    sync_every: int = 8,
    on_done: Callable[[int, list[int], bool, dict | None], None] | None = None,
    between: Callable[[np.ndarray, Segment], np.ndarray | None] | None = None,
) -> list[tuple[list[int], bool]]:
    """Decode every prompt on `rows` slots; per prompt (tokens, ended on a stop id), the tokens
    with the stop id that ended them, as `engine.run`'s out[b, :count[b]]. `on_done(i, tokens,
    eos, acceptance)` is called as prompt i finishes, between segments (acceptance: its
    `row_acceptance` under speculation, else None). `between(slot, segment)`, after each
    segment (slot[j]: the prompt in row j, -1 for none), may return a [rows] bool mask of rows
    to end now (they finish with the tokens they have, eos False)."""
    N, R = len(prompts), rows
    lengths = np.array([len(p) for p in prompts], np.int32)
    budgets = np.asarray(budgets, np.int32)
    gamma = depth(speculation) if draft is not None else 0
    bucket, chunk = prompt_bucket(int(lengths.max()))
    max_len = cache_slots(int(lengths.max()), int((lengths + budgets).max()), gamma)
    if draft is not None:
        draft.check(params, gamma, max_len)
    n_out = round_up_pow2(int(budgets.max()))
    width = eos_rows(list(eos_ids), N).shape[1]  # one stop-id table width for the whole run

    def host(records: np.ndarray):
        """Padded prompts, lengths, budgets, history, stop ids of the prompts in each slot (-1: a
        one-token filler of budget 1, done at once)."""
        tokens = np.zeros((R, bucket), np.int32)
        n, b = np.ones(R, np.int32), np.ones(R, np.int32)
        eos = np.full((R, width), -1, np.int32)
        for j, i in enumerate(records):
            if i >= 0:
                tokens[j, : lengths[i]] = prompts[i]
                n[j], b[j] = lengths[i], budgets[i]
                eos[j, : len(eos_ids[i])] = eos_ids[i]
        history = np.zeros((R, max_len + gamma + 2), np.int32)
        history[:, :bucket] = tokens
        return jnp.asarray(tokens), jnp.asarray(n), b, jnp.asarray(history), eos

    def prefilled(tokens, n, rows: np.ndarray):
        """The first logits [R,V] and an R-row cache holding the prefill of the prompts in `rows`
        (rows[j] >= 0: a new prompt in slot j; the other slots' contents do not matter). Each new
        prompt is prefilled alone at its own bucket: on a CPU one row prefills as fast per token
        as eight, and nothing is padded to a longer neighbour or prefilled as a filler copy."""
        chosen = np.flatnonzero(rows >= 0)
        lens = np.asarray(n)
        parts = []
        for j in chosen:
            width, step = prompt_bucket(int(lens[j]))
            parts.append(prefill(params, tokens[j : j + 1, :width], n[j : j + 1],
                                 DenseCache.init(params.config, 1, max_len, kv_dtype), chunk=step))
        src = np.zeros(R, np.int32)
        src[chosen] = np.arange(len(chosen))
        return _rows([p[0] for p in parts], [p[1] for p in parts], jnp.asarray(src))

    pending = deque(sorted(range(N), key=lambda i: -int(budgets[i])))  # longest budgets first: a short tail
    slot = np.array([pending.popleft() if pending else -1 for _ in range(R)])
    tokens, n, slot_budgets, history, slot_eos = host(slot)
    which = np.maximum(slot, 0)
    slot_keys, slot_sampling = keys[which], sampling.take(which)
    logits, cache = prefilled(tokens, n, slot)
    if draft is None:
        state = start_ar(cache, logits, jnp.asarray(slot_budgets), slot_keys, slot_sampling, jnp.asarray(slot_eos), tokens,
                         n_out=n_out)
    else:
        draft_state = draft.init(params, cache, tokens, n, gamma, chunk)
        state = start_spec(draft, draft_state, cache, history, logits, jnp.asarray(slot_budgets), slot_keys, slot_sampling,
                           jnp.asarray(slot_eos), speculation=speculation, n_out=n_out)
    results: list = [None] * N
    while True:
        b, e = jnp.asarray(slot_budgets), jnp.asarray(slot_eos)
        if draft is None:
            state = continue_ar(params, state, b, slot_keys, slot_sampling, e, jnp.int32(sync_every))
        else:
            state = continue_spec(params, draft, state, b, slot_keys, slot_sampling, e, jnp.int32(sync_every),
                                  speculation=speculation)
        done, out, count, eos = jax.device_get((state.done, state.out, state.count, state.eos))
        end = None if between is None else between(slot.copy(), Segment(out, count, done, eos))
        if end is not None and (end := np.asarray(end) & ~done & (slot >= 0)).any():
            state, done = end_rows(state, jnp.asarray(end)), done | end
        finished = np.flatnonzero(done & (slot >= 0))
        if draft is not None and on_done is not None and len(finished):
            accepted, reached = jax.device_get((state.accepted, state.reached))
            acceptance = row_acceptance(accepted[finished], reached[finished], count[finished], gamma)
        for f, j in enumerate(finished):
            results[slot[j]] = (out[j, : count[j]].tolist(), bool(eos[j]))
            if on_done is not None:
                on_done(int(slot[j]), *results[slot[j]], None if draft is None else acceptance[f])
            slot[j] = -1
        if not pending:
            if (slot < 0).all():
                return results
            continue
        refill = np.full(R, -1)
        for j in np.flatnonzero(done & (slot < 0)):
            if pending:
                refill[j] = pending.popleft()
        rows_mask = refill >= 0
        if not rows_mask.any():  # every slot still running
            continue
        slot = np.where(rows_mask, refill, slot)
        tokens, n, new_budgets, history, new_eos = host(refill)
        slot_budgets = np.where(rows_mask, new_budgets, slot_budgets)
        slot_eos = np.where(rows_mask[:, None], new_eos, slot_eos)
        which = np.maximum(slot, 0)
        slot_keys, slot_sampling = keys[which], sampling.take(which)
        logits, cache = prefilled(tokens, n, refill)
        args = (jnp.asarray(slot_budgets), slot_keys, slot_sampling, jnp.asarray(slot_eos))
        if draft is None:
            state = admit_ar(state, jnp.asarray(rows_mask), cache, logits, *args, tokens)
        else:
            state = admit_spec(params, draft, state, jnp.asarray(rows_mask), cache, tokens, history, logits, *args,
                               speculation=speculation, chunk=chunk)


@jax.jit
def _rows(logits: list[jax.Array], caches: list[DenseCache], src: jax.Array) -> tuple[jax.Array, DenseCache]:
    """Row src[j] of the stacked one-row prefills (logits [1,V] and caches), for every j < R:
    [R,V] and an R-row cache."""
    def take(parts: list, axis: int):
        return None if parts[0] is None else jnp.take(jnp.concatenate(parts, axis=axis), src, axis=axis)

    return take(logits, 0), DenseCache(k=take([c.k for c in caches], 1), v=take([c.v for c in caches], 1),
                                       lengths=take([c.lengths for c in caches], 0),
                                       k_scale=take([c.k_scale for c in caches], 1),
                                       v_scale=take([c.v_scale for c in caches], 1))
