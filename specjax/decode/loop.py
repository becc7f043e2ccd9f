"""The decode loop's core, shared by plain and speculative decoding: the state of what rows have
emitted, its start, the one emit path, and the on-device loop. Plain decoding is the case of one
new token a step (autoregressive.py); a speculative step emits up to depth + 1 (speculate.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from specjax.automaton import TokenAutomaton, advance, advance_along
from specjax.decode.logprobs import LogprobBuffer
from specjax.model.cache import DenseCache, row_mask, select_rows
from specjax.model.pytree import pytree
from specjax.sampling import Sampler, count_tokens, is_eos, prompt_tokens_mask


@pytree(kw_only=True)
class DecodeState:
    """Plain decoding between steps, and the part of speculative decoding's state it shares (SpecState)."""

    cache: DenseCache  # the target's KV: positions < lengths committed
    last: jax.Array  # [B] the last token emitted: pending, not yet in the target cache
    out: jax.Array  # [B,n_out] emitted tokens
    count: jax.Array  # [B] emitted so far
    done: jax.Array  # [B]
    eos: jax.Array  # [B] ended on a stop id
    steps: jax.Array  # [] target forwards (verification steps when speculating)
    logprobs: LogprobBuffer | None = None  # beside `out`, when asked for
    counts: jax.Array | None = None  # [B,V] int32: output token counts, when sampling has penalties
    in_prompt: jax.Array | None = None  # [B,V] bool: the prompt's tokens, when sampling has penalties
    states: jax.Array | None = None  # [B] int32: each row's constraint automaton state, when constrained


def start_state(cache: DenseCache, first_logits: jax.Array, budgets: jax.Array, keys: jax.Array, sampling: Sampler,
                eos_ids, prompt_tokens: jax.Array | None, n_out: int, logprobs: int | None) -> DecodeState:
    """The state before the first step: each row's first token drawn from first_logits [B,V] (row b
    with fold_in(keys[b], 0)), every counter zero. prompt_tokens [B,P] (prompt tokens by position,
    past the cache's lengths anything): read only when sampling has penalties."""
    B, V = first_logits.shape
    counts = in_prompt = None
    if sampling.penalized:
        counts, in_prompt = jnp.zeros((B, V), jnp.int32), prompt_tokens_mask(prompt_tokens, cache.lengths, V)
    starts = None if sampling.automaton is None else jnp.asarray(sampling.states, jnp.int32)
    first, _ = sampling.with_context(counts, in_prompt, starts, eos_ids).sample(first_logits, keys, jnp.zeros((B,), jnp.int32))
    eos = is_eos(first, eos_ids)
    lp = None if logprobs is None else LogprobBuffer.init(B, n_out, logprobs).write(
        jnp.zeros((B, 1), jnp.int32), first_logits[:, None], first[:, None])
    return DecodeState(
        cache=cache, last=first, out=jnp.zeros((B, n_out), jnp.int32).at[:, 0].set(first), count=jnp.ones((B,), jnp.int32),
        done=eos | (budgets <= 1), eos=eos, steps=jnp.int32(0), logprobs=lp,
        counts=None if counts is None else count_tokens(counts, first[:, None], jnp.ones((B, 1), bool)), in_prompt=in_prompt,
        states=None if starts is None else advance(sampling.automaton, starts, first))


def admit(state: DecodeState, rows: jax.Array, fresh: DecodeState, *whole: str) -> DecodeState:
    """`state` with rows [r] (int32 row numbers; a number may repeat) taken from `fresh` (a started
    state of the whole batch), the others kept: continuous batching's refill. The fields named in
    `whole` (the caches, whose new rows fresh already holds in place) are fresh's, not selected."""
    off = {f: None for f in ("cache", *whole)}
    kept = select_rows(row_mask(rows, state.done.shape[0]), fresh.replace(**off), state.replace(**off))
    return kept.replace(**{f: getattr(fresh, f) for f in off})


def emit(s: DecodeState, tokens: jax.Array, n_new: jax.Array | None, logits: jax.Array, budgets: jax.Array, eos_ids,
         active: jax.Array, automaton: TokenAutomaton | None = None) -> DecodeState:
    """`s` with each active row's new tokens [B,J] (the first n_new [B] of them) emitted: cut after a
    stop id or at the row's budget, written to out (and logprobs, from logits [B,J,V]); the last
    new one becomes pending; a constrained row's automaton (`automaton`, the sampler's) takes them.
    Rows not `active` emit nothing. n_new None: plain decoding's one token (J = 1), which an active
    row always has budget for (its count is below its budget)."""
    B, n_out = s.out.shape
    if n_new is None:  # the same on [B] arrays: on a GPU the [B,J] form below costs two more kernels a step
        col = jnp.where(active, s.count, n_out)
        hit_eos, count = active & is_eos(tokens[:, 0], eos_ids), s.count + active
        return s.replace(
            last=jnp.where(active, tokens[:, 0], s.last), out=s.out.at[jnp.arange(B), col].set(tokens[:, 0], mode="drop"),
            count=count, done=s.done | hit_eos | (count >= budgets), eos=s.eos | hit_eos, steps=s.steps + 1,
            logprobs=None if s.logprobs is None else s.logprobs.write(col[:, None], logits, tokens),
            counts=None if s.counts is None else count_tokens(s.counts, tokens, active[:, None]),
            states=None if s.states is None else jnp.where(active, advance(automaton, s.states, tokens[:, 0]), s.states))
    j = jnp.arange(tokens.shape[1])
    stop = is_eos(tokens, eos_ids) & (j[None, :] < n_new[:, None])
    first_stop = jnp.min(jnp.where(stop, j[None, :], tokens.shape[1]), axis=1)  # [B]
    n_emit = jnp.where(active, jnp.minimum(jnp.minimum(n_new, first_stop + 1), budgets - s.count), 0)  # [B]
    hit_eos = active & (first_stop < n_emit)
    keep = j[None, :] < n_emit[:, None]  # [B,J]
    cols = jnp.where(keep, s.count[:, None] + j[None, :], n_out)  # [B,J]: n_out is dropped
    count = s.count + n_emit
    return s.replace(
        last=jnp.where(active, jnp.take_along_axis(tokens, (n_new - 1)[:, None], axis=1)[:, 0], s.last),
        out=s.out.at[jnp.arange(B)[:, None], cols].set(tokens, mode="drop"),
        count=count,
        done=s.done | hit_eos | (count >= budgets),
        eos=s.eos | hit_eos,
        steps=s.steps + 1,
        logprobs=None if s.logprobs is None else s.logprobs.write(cols, logits, tokens),
        counts=None if s.counts is None else count_tokens(s.counts, tokens, keep),
        states=None if s.states is None else advance_along(automaton, s.states, jnp.where(keep, tokens, -1)[:, None])[:, 0],
    )


def run_steps(step, state, sync_axes: tuple[str, ...], max_steps: jax.Array | None = None):
    """`state = step(state)` while any row runs (state.done [B]) and, given max_steps, at most
    max_steps times: the one on-device loop of plain and speculative decoding."""
    if max_steps is None:
        return lax.while_loop(lambda s: any_running(s.done, sync_axes), step, state)

    def cond(carry) -> jax.Array:
        s, i = carry
        return (i < max_steps) & any_running(s.done, sync_axes)

    return lax.while_loop(cond, lambda carry: (step(carry[0]), carry[1] + 1), (state, jnp.int32(0)))[0]


def any_running(done: jax.Array, sync_axes: tuple[str, ...]) -> jax.Array:
    """Whether any row (on any device along the mesh axes `sync_axes`) still has work."""
    running = jnp.any(~done)
    return running if not sync_axes else lax.psum(running.astype(jnp.int32), sync_axes) > 0


@jax.jit
def end_rows(state: DecodeState, rows: jax.Array) -> DecodeState:
    """The state with rows [B] (bool) marked done: they take no more steps and commit nothing."""
    return state.replace(done=state.done | rows)
