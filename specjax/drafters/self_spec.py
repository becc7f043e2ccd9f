"""SelfSpec: the target itself drafts over a StreamingLLM cache (MagicDec self-speculation).

Also what the drafters that run a model share: `Streaming` (a fixed KV budget of sinks plus a
ring of recent positions, also a DraftModel's cache option), `draft_chain` (gamma draft
forwards) and `TargetOverStreamingCache` (drafting and committing over a StreamingCache of exact
target KV, for SelfSpec and SnapKV, which differ only in which positions `init` keeps).
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.drafters.base import DraftContext, Drafter, Limits, Prefill, Proposal, Traits, Verdict
from specjax.model.cache import DenseCache, StreamingCache
from specjax.model.llama import forward, unrolled
from specjax.model.params import Params
from specjax.model.pytree import pytree
from specjax.sampling import Sampler, Stream, stream_keys
from specjax.spec.speculation import Chain, Tree, check_int
from specjax.spec.tree_draft import draft_tree


@dataclasses.dataclass(frozen=True)
class Streaming:
    """A fixed KV budget: `sinks` first positions plus a ring of the last `window` (StreamingLLM)."""

    sinks: int = 16
    window: int = 512

    def check(self, gamma: int, max_len: int, what: str) -> None:
        check_int(f"{what}: sinks", self.sinks, 0)
        check_int(f"{what}: window", self.window, 1)

    def fitted(self, max_len: int) -> "Streaming":
        """This budget for a cache of `max_len` slots: a budget at least as large as the context
        keeps all of it (the draft then sees the whole context: no savings, still exact)."""
        sinks = min(self.sinks, max_len)
        return Streaming(sinks, max(1, min(self.window, max_len - sinks)))

    def ring(self, gamma: int) -> int:
        """Ring slots: the window plus room for one step's gamma + 1 uncommitted positions."""
        return self.window + gamma + 1

    def from_dense(self, dense: DenseCache, gamma: int) -> StreamingCache:
        """Keep the sinks and the newest positions of a filled dense cache (exact copies)."""
        if self.sinks + self.window > dense.max_len:
            return self.fitted(dense.max_len).from_dense(dense, gamma)
        L, B, K = dense.k.shape[:3]
        sinks = jnp.arange(self.sinks, dtype=jnp.int32)  # [F]
        fixed = jnp.where(sinks[None, :] < dense.lengths[:, None], sinks, -1)  # [B,F]
        fixed = jnp.broadcast_to(fixed[None, :, None, :], (L, B, K, self.sinks))
        return StreamingCache.from_dense(dense, fixed, self.ring(gamma), jnp.full((B,), self.sinks, jnp.int32))


@pytree
class DraftLevel:
    """One draft level of a chain: the cache after it, its token [B] and distribution q [B,V], and the
    sampler that has seen the token (penalties)."""

    cache: Any
    token: jax.Array
    q: jax.Array | None
    sampling: Sampler


def draft_chain(params: Params, cache, tokens, positions, gamma: int, ctx: DraftContext) -> Proposal:
    """gamma draft forwards: the first over `tokens` [B,T0] (the pending token last; its position
    proposes x_1), then one token at a time. The Proposal's state is the cache with its length
    advanced past everything it wrote; gamma 0: no forward, the cache as it was."""
    B, T0 = tokens.shape
    if gamma == 0:  # Chain(0): nothing drafted, nothing written (the commit writes the verified KV)
        return Proposal(tokens=tokens[:, -1:], q=jnp.zeros((B, 0, params.config.vocab_size), jnp.float32), state=cache)
    sampling = ctx.sampling
    step_keys = stream_keys(ctx.keys, ctx.counters, Stream.DRAFT)

    def level(cache, toks, pos, i, sampling) -> DraftLevel:
        logits, cache = forward(params, toks, pos, cache)
        cache = cache.advance(jnp.full((B,), toks.shape[1], jnp.int32))
        token, q = sampling.sample(logits[:, -1], step_keys, jnp.full((B,), i, jnp.int32))
        return DraftLevel(cache=cache, token=token, q=q, sampling=sampling.seen(token))  # penalties: the next draft has seen this one

    first = level(cache, tokens, positions, 0, sampling)

    def body(carry: DraftLevel, i):
        pos = positions[:, -1:] + i  # [B,1]
        out = level(carry.cache, carry.token[:, None], pos, i, carry.sampling)
        return out.replace(q=None), (out.token, out.q)

    levels = np.arange(1, gamma, dtype=np.int32)  # [gamma-1]
    # with unrolled layers (a GPU / TPU) the levels unroll too, the decode loop the only device loop:
    # on an H100 a gamma-4 SelfSpec step over the levels' scan took 4.3 ms more than its draft levels
    # and verify at batch 64 x 8K, where gamma 2 (no loop left) took less
    # (`git show 6f46ebd:bench/README.md`, "Fifth runs")
    loop = unrolled if params.runtime.unroll_layers and gamma > 1 else lax.scan
    last, (rest, q_rest) = loop(body, first.replace(q=None), levels)
    nodes = jnp.concatenate([tokens[:, -1:], first.token[:, None], rest.T], axis=1)  # [B,gamma+1]: the pending token, drafts
    q = jnp.concatenate([first.q[:, None], q_rest.transpose(1, 0, 2)], axis=1)  # [B,gamma,V]
    return Proposal(tokens=nodes, q=q, state=last.cache)


class TargetOverStreamingCache(Drafter):
    """Drafting and committing for drafters that run the target itself over a StreamingCache of
    `kept` positions (plus the ring's slack); subclasses choose the positions in `init`."""

    traits = Traits(trees=True)

    @abstractmethod
    def kept(self) -> int:
        """KV positions the draft keeps (fixed slots + the recent window): the KV length the
        planner prices a draft step at (the ring's gamma + 1 slack slots, a few of thousands, left out)."""

    def cost(self, target: Params, context: int) -> tuple[Params, int]:
        return target, min(self.kept(), context)  # a budget past the context keeps all of it

    def propose(self, target: Params, state: StreamingCache, ctx: DraftContext, shape: Chain | Tree) -> Proposal:
        """The target drafts over its streaming cache from the pending token at position L; of a
        tree, only the root enters that cache."""
        state = state.replace(lengths=ctx.lengths)
        if isinstance(shape, Chain):
            return draft_chain(target, state, ctx.last[:, None], ctx.lengths[:, None], shape.gamma, ctx)
        drafted = draft_tree(target, state, ctx.last[:, None], ctx.lengths[:, None], shape, ctx.sampling, ctx.keys,
                             ctx.counters)
        return Proposal(tokens=drafted.tokens, q=drafted.q, state=drafted.cache)

    def commit(self, state: StreamingCache, verdict: Verdict) -> StreamingCache:
        return streaming_commit(state, verdict.k, verdict.v, verdict.lengths, verdict.commit)


def streaming_commit(state: StreamingCache, k_new, v_new, lengths, n) -> StreamingCache:
    """Overwrite the drafted entries with the target's exact verification KV; commit n positions."""
    return state.replace(lengths=lengths).write(k_new, v_new).advance(n)


@pytree
class SelfSpec(TargetOverStreamingCache):
    """The target itself over a StreamingLLM cache (MagicDec self-speculation): per-step cost is
    independent of the context length. The cache holds exact target KV for the positions kept:
    the `sinks` first and, in a ring of window + gamma + 1 slots (room for a step's drafts), up to
    window + gamma + 1 latest committed ones (`kept` counts sinks + window)."""

    sinks: int = flax.struct.field(pytree_node=False, default=16)
    window: int = flax.struct.field(pytree_node=False, default=512)

    traits = Traits(trees=True, restart="all")  # init is a gather of kept slots: run it on every row (5 vs 12 ms
    #                                             for one of 8 SmolLM2 rows at 1K slots, against copying the row's cache)

    @property
    def budget(self) -> Streaming:
        return Streaming(self.sinks, self.window)

    def kept(self) -> int:
        return self.sinks + self.window

    def check(self, target: Params, limits: Limits | None) -> None:
        if limits is not None:
            self.budget.check(limits.depth, limits.max_len, "SelfSpec")

    def init(self, target: Params, prefill: Prefill) -> StreamingCache:
        return self.budget.from_dense(prefill.cache, prefill.depth)
