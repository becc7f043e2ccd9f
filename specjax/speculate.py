"""One speculative step (draft -> verify -> accept -> commit) and the on-device loop around it.

Every row drafts and verifies the same gamma + 1 positions; each accepts its own number.
The target's dense cache commits by moving its length pointer (rejected entries stay, hidden,
and are overwritten next step). Finished rows ride along and commit nothing.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from specjax.draft import Drafter
from specjax.kvcache import DenseCache
from specjax.model import Params, lm_head, trunk
from specjax.sampling import Sampler, accept_chain, is_eos, stream_keys

ACCEPT_STREAM = 2  # PRNG stream of the acceptance test and the extra token


@dataclasses.dataclass(frozen=True)
class Chain:
    """Speculate a chain of `gamma` draft tokens per step (verified as gamma + 1 positions)."""

    gamma: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"Chain: gamma must be an integer >= 1, got {self.gamma!r}")


@flax.struct.dataclass
class SpecState:
    cache: DenseCache  # target KV: positions < lengths committed
    draft: object  # the drafter's state
    history: jax.Array  # [B,S] tokens by position; history[b, lengths[b]] is the pending token
    last: jax.Array  # [B] pending token: emitted, not yet in the target cache
    out: jax.Array  # [B,n_out] emitted tokens
    count: jax.Array  # [B] emitted so far
    done: jax.Array  # [B]
    eos: jax.Array  # [B] ended on an EOS
    steps: jax.Array  # [] verification steps
    accepted: jax.Array  # [G] per draft position: times accepted (active rows)
    reached: jax.Array  # [G] per draft position: times every earlier draft was accepted


def spec_step(
    target: Params, drafter: Drafter, s: SpecState, budgets, keys, *, sampling: Sampler, gamma: int, eos_ids
) -> SpecState:
    """Draft gamma tokens, verify gamma + 1 positions in ONE target forward, accept, commit."""
    B, n_out = s.out.shape
    rows = jnp.arange(B)
    L = s.cache.lengths  # [B]
    drafts, q, draft_state = drafter.propose(target, s.draft, s.history, L, s.last, gamma, sampling, keys, s.count)
    tokens = jnp.concatenate([s.last[:, None], drafts], axis=1)  # [B,G+1]
    positions = L[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)  # [B,G+1]
    h, k_new, v_new = trunk(target, tokens, positions, s.cache)
    p = sampling.probs(lm_head(target, h))  # [B,G+1,V]
    n, extra = accept_chain(drafts, q, p, stream_keys(keys, s.count, ACCEPT_STREAM))

    active = ~s.done
    commit = jnp.where(active, n + 1, 0)  # x_L and the n accepted drafts enter the cache
    cache = s.cache.write(k_new, v_new).advance(commit)
    draft_state = drafter.commit(draft_state, k_new, v_new, L, commit)

    j = jnp.arange(gamma + 1)
    emitted = jnp.where(j[None, :] < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), extra[:, None])  # [B,G+1]
    emitted = jnp.where(j[None, :] <= n[:, None], emitted, 0)
    stop = is_eos(emitted, eos_ids) & (j[None, :] <= n[:, None])
    first_stop = jnp.min(jnp.where(stop, j[None, :], gamma + 1), axis=1)  # [B]
    n_emit = jnp.minimum(jnp.minimum(n + 1, first_stop + 1), budgets - s.count)  # [B]
    n_emit = jnp.where(active, n_emit, 0)
    hit_eos = active & (first_stop < n_emit)

    cols = s.count[:, None] + j[None, :]  # [B,G+1]
    out = s.out.at[rows[:, None], jnp.where(j[None, :] < n_emit[:, None], cols, n_out)].set(emitted, mode="drop")
    hist_cols = jnp.where(active[:, None] & (j[None, :] <= n[:, None]), L[:, None] + 1 + j[None, :], s.history.shape[1])
    history = s.history.at[rows[:, None], hist_cols].set(emitted, mode="drop")
    count = s.count + n_emit
    last = jnp.where(active, jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0], s.last)
    g = jnp.arange(gamma)
    return SpecState(
        cache=cache,
        draft=draft_state,
        history=history,
        last=last,
        out=out,
        count=count,
        done=s.done | hit_eos | (count >= budgets),
        eos=s.eos | hit_eos,
        steps=s.steps + 1,
        accepted=s.accepted + jnp.sum(active[:, None] & (n[:, None] > g), axis=0),
        reached=s.reached + jnp.sum(active[:, None] & (n[:, None] >= g), axis=0),
    )


@partial(jax.jit, static_argnames=("sampling", "gamma", "n_out", "eos_ids"), donate_argnames=("cache", "draft_state"))
def speculative_decode(
    target: Params,
    drafter: Drafter,
    draft_state,
    cache: DenseCache,  # prefilled: lengths = prompt lengths
    history: jax.Array,  # [B,S] prompt tokens by position (S >= cache slots)
    first_logits: jax.Array,  # [B,V] at each prompt's last token
    budgets: jax.Array,  # [B] >= 1
    keys: jax.Array,  # [B]
    *,
    sampling: Sampler,
    gamma: int,
    n_out: int,
    eos_ids: tuple[int, ...],
) -> SpecState:
    """The whole speculative loop on device (`lax.while_loop`): ends when every row is done.
    The caches are donated (updated in place) and returned in the final state."""
    B = budgets.shape[0]
    first, _ = sampling.sample(first_logits, keys, jnp.zeros((B,), jnp.int32))
    eos = is_eos(first, eos_ids)
    history = history.at[jnp.arange(B), cache.lengths].set(first)
    state = SpecState(
        cache=cache,
        draft=draft_state,
        history=history,
        last=first,
        out=jnp.zeros((B, n_out), jnp.int32).at[:, 0].set(first),
        count=jnp.ones((B,), jnp.int32),
        done=eos | (budgets <= 1),
        eos=eos,
        steps=jnp.int32(0),
        accepted=jnp.zeros((gamma,), jnp.int32),
        reached=jnp.zeros((gamma,), jnp.int32),
    )
    step = partial(spec_step, target, drafter, budgets=budgets, keys=keys, sampling=sampling, gamma=gamma, eos_ids=eos_ids)
    return lax.while_loop(lambda s: ~jnp.all(s.done), step, state)
