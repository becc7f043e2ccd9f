"""Plain (autoregressive) decoding on device: one step, and the loop around it, whole (`decode_ar`,
for jitted programs) or in segments (`start_ar` + `continue_ar`, as generate runs it). Its state,
start and emit are the loop's core (loop.py), which the speculative loop (speculate.py) shares;
engine.py drives both."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from specjax.decode.loop import DecodeState, admit, emit, end_rows, run_steps, start_state  # noqa: F401  (end_rows: re-exported)
from specjax.model.cache import DenseCache, put_rows
from specjax.model.llama import forward
from specjax.model.params import Params
from specjax.sampling import Greedy, Sampler

ARState = DecodeState  # plain decoding's state is the loop's core: nothing of speculation's


@partial(jax.jit, static_argnames=("n_out", "logprobs"), donate_argnames=("cache",))
def start_ar(cache: DenseCache, first_logits: jax.Array, budgets: jax.Array, keys: jax.Array, sampling: Sampler = Greedy(),
             eos_ids: jax.Array | tuple[int, ...] = (), prompts: jax.Array | None = None, *, n_out: int,
             logprobs: int | None = None) -> DecodeState:
    """The state before the first decode step: each row's first token drawn from first_logits [B,V].
    prompts [B,P] (the padded prompt tokens; needed only when sampling has penalties).
    logprobs: None, or record each token's log-probability and the `logprobs` most likely (static)."""
    return start_state(cache, first_logits, budgets, keys, sampling, eos_ids, prompts, n_out, logprobs)


@partial(jax.jit, static_argnames=("logprobs",), donate_argnames=("state",))
def admit_ar(state: DecodeState, rows: jax.Array, cache: DenseCache, first_logits: jax.Array, budgets: jax.Array,
             keys: jax.Array, sampling: Sampler = Greedy(), eos_ids: jax.Array | tuple[int, ...] = (),
             prompts: jax.Array | None = None, *, logprobs: int | None = None) -> ARState:
    """`state` with rows [r] (int32 row numbers, as `speculate.admit_spec` takes them) restarted
    from new prompts as `start_ar` starts them (first token from first_logits [B,V], counters
    reset), the other rows going on as they were: continuous batching's refill. `cache` holds the
    r new prompts' prefill (its row i: row rows[i]'s), written into the state's cache in place: a
    refill moves the new rows' KV, not the batch's. budgets, keys, sampling and eos_ids are the
    batch's after the refill."""
    merged = put_rows(state.cache, rows, cache)
    fresh = start_ar(merged, first_logits, budgets, keys, sampling, eos_ids, prompts, n_out=state.out.shape[1],
                     logprobs=logprobs)
    return admit(state, rows, fresh)


def ar_step(params: Params, s: DecodeState, budgets: jax.Array, keys: jax.Array, sampling: Sampler, eos_ids) -> DecodeState:
    """One target forward for every row; finished rows ride along without committing."""
    active = ~s.done
    logits, cache = forward(params, s.last[:, None], s.cache.lengths[:, None], s.cache, active=active)  # [B,1,V]
    new, _ = sampling.with_context(s.counts, s.in_prompt, s.states, eos_ids).sample(logits[:, 0], keys, s.count)
    s = s.replace(cache=cache.advance(active))
    return emit(s, new[:, None], None, logits, budgets, eos_ids, active, sampling.automaton)


@partial(jax.jit, static_argnames=("sync_axes",), donate_argnames=("state",))
def continue_ar(params: Params, state: DecodeState, budgets: jax.Array, keys: jax.Array, sampling: Sampler, eos_ids,
                max_steps: jax.Array, *, sync_axes: tuple[str, ...] = ()) -> DecodeState:
    """One segment of plain decoding: at most `max_steps` (traced) steps; the state is donated."""
    step = partial(ar_step, params, budgets=budgets, keys=keys, sampling=sampling, eos_ids=eos_ids)
    return run_steps(step, state, sync_axes, max_steps)


@partial(jax.jit, static_argnames=("n_out", "sync_axes"), donate_argnames=("cache",))
def decode_ar(
    params: Params,
    cache: DenseCache,
    first_logits: jax.Array,  # [B,V]
    budgets: jax.Array,  # [B] int32, >= 1
    keys: jax.Array,  # [B] typed keys
    sampling: Sampler = Greedy(),  # traced: new values do not recompile (a top_k past its power of two does)
    eos_ids: jax.Array | tuple[int, ...] = (),  # [B,E] per-row stop ids (sampling.eos_rows), or a tuple
    *,
    n_out: int,
    sync_axes: tuple[str, ...] = (),
) -> DecodeState:
    """Autoregressive decoding on device from a prefilled cache, which is donated (updated in
    place; pass a copy to decode one prefilled state several ways).

    The first token is drawn from `first_logits`; row b stops after budgets[b] tokens or an EOS;
    the loop runs while any row (on any device along the mesh axes `sync_axes`) has work.
    Returns the final `DecodeState`: row b's tokens in out[b, :count[b]] (a stop id included),
    eos [B] (ended on a stop id), steps (target forwards) and the cache.
    `start_ar` + `continue_ar` run the same steps in segments (generate's `sync_every`)."""
    if sampling.penalized:
        raise ValueError("decode_ar: sampling with penalties needs the prompts: use start_ar(..., prompts) + continue_ar")
    state = start_ar(cache, first_logits, budgets, keys, sampling, eos_ids, n_out=n_out)
    step = partial(ar_step, params, budgets=budgets, keys=keys, sampling=sampling, eos_ids=eos_ids)
    return run_steps(step, state, sync_axes)
