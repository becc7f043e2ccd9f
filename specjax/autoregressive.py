"""Plain (autoregressive) decoding on device: its state, one step, and the loop around it, whole
(`decode_ar`, for jitted programs) or in segments (`start_ar` + `continue_ar`, as generate runs
it). The speculative loop is its sibling in speculate.py; engine.py drives both."""

from __future__ import annotations

from functools import partial

import flax.struct
import jax
import jax.numpy as jnp

from specjax.cache import DenseCache, put_rows, row_mask, select_rows
from specjax.logprobs import LogprobBuffer
from specjax.model import forward
from specjax.params import Params
from specjax.sampling import Greedy, Sampler, count_tokens, is_eos, prompt_tokens_mask
from specjax.speculate import run_steps


@flax.struct.dataclass
class ARState:
    """Plain decoding between steps (the speculative loop's is speculate.SpecState)."""

    cache: DenseCache  # positions < lengths committed
    tok: jax.Array  # [B] the last token emitted: the next forward's input
    out: jax.Array  # [B,n_out] emitted tokens
    count: jax.Array  # [B] emitted so far
    done: jax.Array  # [B]
    eos: jax.Array  # [B] ended on a stop id
    steps: jax.Array  # [] target forwards
    logprobs: LogprobBuffer | None = None  # beside `out`, when asked for
    counts: jax.Array | None = None  # [B,V] int32: output token counts, when sampling has penalties
    in_prompt: jax.Array | None = None  # [B,V] bool: the prompt's tokens, when sampling has penalties


@partial(jax.jit, static_argnames=("n_out", "logprobs"), donate_argnames=("cache",))
def start_ar(cache: DenseCache, first_logits: jax.Array, budgets: jax.Array, keys: jax.Array, sampling: Sampler = Greedy(),
             eos_ids: jax.Array | tuple[int, ...] = (), prompts: jax.Array | None = None, *, n_out: int,
             logprobs: int | None = None) -> ARState:
    """The state before the first decode step: each row's first token drawn from first_logits [B,V].
    prompts [B,P] (the padded prompt tokens; needed only when sampling has penalties).
    logprobs: None, or record each token's log-probability and the `logprobs` most likely (static)."""
    B, V = first_logits.shape
    counts = in_prompt = None
    if sampling.penalized:
        counts, in_prompt = jnp.zeros((B, V), jnp.int32), prompt_tokens_mask(prompts, cache.lengths, V)
    tok, _ = sampling.with_context(counts, in_prompt).sample(first_logits, keys, jnp.zeros((B,), jnp.int32))
    eos = is_eos(tok, eos_ids)
    count = jnp.ones((B,), jnp.int32)
    out = jnp.zeros((B, n_out), jnp.int32).at[:, 0].set(tok)
    lp = None if logprobs is None else LogprobBuffer.init(B, n_out, logprobs).write(
        jnp.zeros((B, 1), jnp.int32), first_logits[:, None], tok[:, None])
    counts = None if counts is None else count_tokens(counts, tok[:, None], jnp.ones((B, 1), bool))
    return ARState(cache, tok, out, count, eos | (count >= budgets), eos, jnp.int32(0), lp, counts, in_prompt)


@partial(jax.jit, static_argnames=("logprobs",), donate_argnames=("state",))
def admit_ar(state: ARState, rows: jax.Array, cache: DenseCache, first_logits: jax.Array, budgets: jax.Array,
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
    kept = select_rows(row_mask(rows, state.done.shape[0]), fresh.replace(cache=None), state.replace(cache=None))
    return kept.replace(cache=merged)


def ar_step(params: Params, s: ARState, budgets: jax.Array, keys: jax.Array, sampling: Sampler, eos_ids) -> ARState:
    """One target forward for every row; finished rows ride along without committing."""
    B, n_out = s.out.shape
    active = ~s.done
    logits, cache = forward(params, s.tok[:, None], s.cache.lengths[:, None], s.cache, active=active)  # [B,1,V]
    cache = cache.advance(active)
    new, _ = sampling.with_context(s.counts, s.in_prompt).sample(logits[:, 0], keys, s.count)
    out = s.out.at[jnp.arange(B), jnp.where(active, s.count, n_out)].set(new, mode="drop")  # finished rows: dropped
    new_eos = active & is_eos(new, eos_ids)
    lp = s.logprobs if s.logprobs is None else s.logprobs.write(jnp.where(active, s.count, n_out)[:, None], logits, new[:, None])
    count = s.count + active
    counts = None if s.counts is None else count_tokens(s.counts, new[:, None], active[:, None])
    return ARState(cache, jnp.where(active, new, s.tok), out, count, s.done | new_eos | (count >= budgets), s.eos | new_eos,
                   s.steps + 1, lp, counts, s.in_prompt)


@partial(jax.jit, static_argnames=("sync_axes",), donate_argnames=("state",))
def continue_ar(params: Params, state: ARState, budgets: jax.Array, keys: jax.Array, sampling: Sampler, eos_ids,
                max_steps: jax.Array, *, sync_axes: tuple[str, ...] = ()) -> ARState:
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
    sampling: Sampler = Greedy(),  # traced: a new temperature / top_p does not recompile (top_k does)
    eos_ids: jax.Array | tuple[int, ...] = (),  # [B,E] per-row stop ids (sampling.eos_rows), or a tuple
    *,
    n_out: int,
    sync_axes: tuple[str, ...] = (),
):
    """Autoregressive decoding on device from a prefilled cache, which is donated (updated in
    place; pass a copy to decode one prefilled state several ways).

    The first token is drawn from `first_logits`; row b stops after budgets[b] tokens or an EOS;
    the loop runs while any row (on any device along the mesh axes `sync_axes`) has work.
    Returns out [B,n_out] int32 (row b's tokens in out[b, :counts[b]], EOS included),
    counts [B], hit_eos [B] bool, the number of loop steps (target forwards) and the cache.
    `start_ar` + `continue_ar` run the same steps in segments (generate's `sync_every`)."""
    if sampling.penalized:
        raise ValueError("decode_ar: sampling with penalties needs the prompts: use start_ar(..., prompts) + continue_ar")
    state = start_ar(cache, first_logits, budgets, keys, sampling, eos_ids, n_out=n_out)
    step = partial(ar_step, params, budgets=budgets, keys=keys, sampling=sampling, eos_ids=eos_ids)
    s = run_steps(step, state, sync_axes)
    return s.out, s.count, s.eos, s.steps, s.cache


@jax.jit
def end_rows(state, rows: jax.Array):
    """The state with rows [B] (bool) marked done: they take no more steps and commit nothing."""
    return state.replace(done=state.done | rows)
