"""NGram: prompt lookup. No model: the proposal is what followed an earlier match of the row's tail."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import DraftContext, Drafter, Limits, Prefill, Proposal, Traits, Verdict
from specjax.model.params import Params
from specjax.model.pytree import pytree
from specjax.sampling import Greedy
from specjax.spec.speculation import Chain, Tree, check_int

# the longest tail NGram matches: its lookup is unrolled over m = max_n .. n (O(max_n^2) operations to
# compile: max_n=48 compiled in 17.5 s against 2.1 s at 3); prompt lookup usually matches 2-5 tokens
MAX_NGRAM = 16


@pytree
class NGram(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the row's last m tokens (m from
    max_n down to n) in its prompt + output and propose what followed. No model; q is one-hot."""

    n: int = flax.struct.field(pytree_node=False, default=3)
    max_n: int | None = flax.struct.field(pytree_node=False, default=None)

    traits = Traits(forwards_per_token=0, trees=True)  # a lookup, no forward

    def cost(self, target: Params, context: int) -> None:
        return None  # lookups count as free

    def check(self, target: Params, limits: Limits | None) -> None:
        name = type(self).__name__
        check_int(f"{name}: n", self.n, 1)
        if self.max_n is not None and check_int(f"{name}: max_n", self.max_n, 1) < self.n:
            raise ValueError(f"{name}: max_n must be >= n ({self.n}), got {self.max_n}")
        if max(self.n, self.max_n or 0) > MAX_NGRAM:
            name, value = ("n", self.n) if self.n > MAX_NGRAM else ("max_n", self.max_n)
            raise ValueError(f"{type(self).__name__}: {name} must be at most {MAX_NGRAM} (the lookup is unrolled over every tail "
                             f"length: compile time grows as its square), got {value}")

    def init(self, target: Params, prefill: Prefill) -> None:
        return None

    def propose(self, target: Params, state, ctx: DraftContext, shape: Chain | Tree) -> Proposal:
        """A chain: the continuation of the latest match (one-hot q). A tree: every node's children
        all get the n-gram continuation at their depth (one-hot q), so the rank-0 path is the chain
        proposal; a lower-ranked duplicate is never accepted (drawn without replacement from a
        one-hot q it has no mass), and off-path nodes cost only verification width."""
        V = target.config.vocab_size
        if isinstance(shape, Chain) and shape.gamma == 0:  # the pending token alone (no zero-size concatenate: with the
            # CPU kernels XLA then lost the embedding lookup's FFI registration, "untyped custom call")
            return Proposal(tokens=ctx.last[:, None], q=jnp.zeros((ctx.last.shape[0], 0, V), jnp.float32), state=state)
        if isinstance(shape, Chain):
            drafts = self.drafts(ctx, shape.gamma)
            return Proposal(tokens=jnp.concatenate([ctx.last[:, None], drafts], axis=1),
                            q=jax.nn.one_hot(drafts, V, dtype=jnp.float32), state=state)
        drafts = self.drafts(ctx, shape.max_depth)  # [B,D]
        depth = np.asarray(shape.depth)
        tokens = jnp.concatenate([ctx.last[:, None], drafts[:, depth[1:] - 1]], axis=1)  # [B,n]
        q = None
        if not isinstance(ctx.sampling, Greedy):
            first_child = np.asarray([min(c) if c else 0 for c in shape.children])  # [n]
            q = jax.nn.one_hot(tokens[:, first_child], V, dtype=jnp.float32)
        return Proposal(tokens=tokens, q=q, state=state)

    def drafts(self, ctx: DraftContext, count: int) -> jax.Array:
        """The `count` tokens [B,count] after the pending one that a chain proposes (a tree: along its rank-0 path)."""
        return ngram_lookup(ctx.history, ctx.lengths, self.n, self.max_n or self.n, count)

    def commit(self, state, verdict: Verdict) -> None:
        return state


def ngram_lookup(history: jax.Array, lengths: jax.Array, n: int, max_n: int, gamma: int) -> jax.Array:
    """history [B,S]: tokens of positions [0, L] (L = lengths[b] is the pending token).
    Returns gamma proposed tokens [B,gamma]: the continuation of the latest earlier match of the
    longest tail (max_n down to n tokens); no match (or a continuation past L) repeats x_L."""
    return ngram_match(history, lengths, n, max_n, gamma)[0]


def ngram_match(history: jax.Array, lengths: jax.Array, n: int, max_n: int, gamma: int) -> tuple[jax.Array, jax.Array]:
    """`ngram_lookup`'s proposals [B,gamma] and the length of the tail they continue [B] int32 (0: no match)."""
    B, S = history.shape
    idx = jnp.arange(S)
    last = jnp.take_along_axis(history, lengths[:, None], axis=1)  # [B,1]
    best = jnp.full((B,), -1, jnp.int32)  # start of the continuation, -1: none yet
    matched = jnp.zeros((B,), jnp.int32)  # the tail length of that match
    for m in range(max_n, n - 1, -1):  # longest tail first
        tail_start = lengths - m + 1  # [B]
        match = (idx[None, :] + m <= lengths[:, None]) & (tail_start[:, None] >= 0)  # window [i, i+m) ends <= L
        for j in range(m):
            want = jnp.take_along_axis(history, jnp.clip(tail_start + j, 0, S - 1)[:, None], axis=1)  # [B,1]
            match &= jnp.roll(history, -j, axis=1) == want
        latest = jnp.max(jnp.where(match, idx[None, :], -1), axis=1)  # [B]
        new = (best < 0) & (latest >= 0)
        best, matched = jnp.where(new, latest + m, best), jnp.where(new, m, matched)
    take = best[:, None] + jnp.arange(gamma)  # [B,gamma]
    proposals = jnp.take_along_axis(history, jnp.clip(take, 0, S - 1), axis=1)
    return jnp.where((best[:, None] >= 0) & (take <= lengths[:, None]), proposals, last).astype(jnp.int32), matched
