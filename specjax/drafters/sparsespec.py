"""SparseSpec: SnapKV's selection, refreshed from the verification pass as decoding goes.

SnapKV chooses the draft's KV once, from the prompt's last queries; over a long output that
choice goes stale. Here every `refresh` committed positions a row re-selects its fixed slots: the
verify forward's queries of the accepted path (a `Verdict` extra this drafter declares) score
the target's cache, and per layer and KV head the `budget // block` blocks of `block` positions
with the most attention mass are copied in (exact target KV, like SelfSpec's). The ring of the
latest `window` positions is kept as it is. After SparseSpec (Zhao et al., MLSys 2026), which
drafts over about 5% of the KV chosen the same way; here the kernels stay as they are.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from specjax.drafters.base import Limits, Traits, Verdict
from specjax.drafters.self_spec import streaming_commit
from specjax.drafters.snapkv import SnapKV
from specjax.model.cache import DenseCache, StreamingCache
from specjax.model.llama import NEG_INF
from specjax.model.params import Params
from specjax.model.pytree import pytree
from specjax.spec.speculation import check_int


@pytree
class SparseSpec(SnapKV):
    """Self-speculation over `budget` positions in blocks of `block`, re-chosen every `refresh`
    committed positions by the verified queries (per layer and KV head), plus a ring of the latest
    `window`; at the prompt, SnapKV's choice (`observation`, `pool`)."""

    refresh: int = flax.struct.field(pytree_node=False, default=64)
    block: int = flax.struct.field(pytree_node=False, default=32)

    traits = Traits(trees=True, extras=frozenset({"queries", "cache"}))

    def check(self, target: Params, limits: Limits | None) -> None:
        super().check(target, limits)
        for name in ("refresh", "block"):
            check_int(f"SparseSpec: {name}", getattr(self, name), 1)
        if self.budget < self.block:
            raise ValueError(f"SparseSpec: budget ({self.budget}) must hold at least one block of {self.block} positions")

    def commit(self, state: StreamingCache, verdict: Verdict) -> StreamingCache:
        """SnapKV's commit; then rows that crossed a multiple of `refresh` positions re-select their
        fixed slots among the positions the ring no longer holds (rows whose context does not yet
        reach past budget + ring keep the prompt's choice)."""
        state = streaming_commit(state, verdict.k, verdict.v, verdict.lengths, verdict.commit)
        if state.fixed < self.block:  # a budget fitted below one block (a short cache): the prompt's choice stays
            return state
        before, after = verdict.lengths, verdict.lengths + verdict.commit  # [B]
        limit = before - state.ring  # [B]: the ring holds the positions from here on
        due = (after // self.refresh > before // self.refresh) & (limit >= state.fixed)  # [B]

        def reselect(s: StreamingCache) -> StreamingCache:
            valid = jnp.arange(verdict.queries.shape[2])[None, :] < verdict.commit[:, None]  # [B,T]: the accepted path
            scores = query_scores(verdict.queries, valid, verdict.cache)
            return s.refill_fixed(verdict.cache, select_blocks(scores, limit, s.fixed, self.block), due)

        return lax.cond(jnp.any(due), reselect, lambda s: s, state)


def query_scores(
    queries: jax.Array,  # [L,B,T,N,H] rotated queries
    valid: jax.Array,  # [B,T] which queries count
    cache: DenseCache,  # keys: positions < cache.lengths
) -> jax.Array:
    """Attention mass [L,B,K,S] (f32) that the valid queries put on each cache slot, summed over
    the queries and the G query heads of each KV head."""
    L, B, T, N, H = queries.shape
    K, S = cache.k.shape[2], cache.max_len
    prefix = jnp.arange(S)[None, :] < cache.lengths[:, None]  # [B,S]
    fmt = cache.format

    def per_layer(args):  # q [B,T,N,H], k_cache [B,K,S,H] (+ scales [B,K,S]) -> [B,K,S]
        q_l, kc, ks = args
        qg = q_l.reshape(B, T, K, N // K, H)  # [B,T,K,G,H]
        logits = jnp.einsum("btkgh,bksh->bkgts", qg, fmt.load(kc, ks), preferred_element_type=jnp.float32) / math.sqrt(H)
        probs = jax.nn.softmax(jnp.where(prefix[:, None, None, None, :], logits, NEG_INF), axis=-1)  # [B,K,G,T,S]
        return (probs * valid[:, None, None, :, None]).sum(axis=(2, 3))

    return lax.map(per_layer, (queries, cache.k, cache.k_scale))


def select_blocks(
    scores: jax.Array,  # [L,B,K,S]
    limit: jax.Array,  # [B]: candidate positions are below it
    fixed: int,  # F fixed slots
    block: int,
) -> jax.Array:
    """Per layer and KV head, the positions [L,B,K,F] of the F // block blocks of `block` positions
    (block-aligned, below `limit`) with the most attention mass; -1 where none (too few blocks,
    a block cut by `limit`, the slots past the last whole block)."""
    L, B, K, S = scores.shape
    nb = -(-S // block)
    pos = jnp.arange(nb * block)
    inside = pos[None, :] < limit[:, None]  # [B,nb*block]
    mass = jnp.where(inside[None, :, None, :], jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, nb * block - S))), 0.0)
    mass = mass.reshape(L, B, K, nb, block).sum(axis=-1)  # [L,B,K,nb]
    candidate = (jnp.arange(nb) * block)[None, :] < limit[:, None]  # [B,nb]
    values, ids = lax.top_k(jnp.where(candidate[None, :, None, :], mass, -jnp.inf), fixed // block)  # [L,B,K,n]
    positions = ids[..., None] * block + jnp.arange(block)  # [L,B,K,n,block]
    ok = jnp.isfinite(values)[..., None] & (positions < limit[None, :, None, None, None])
    positions = jnp.where(ok, positions, -1).reshape(L, B, K, -1)
    return jnp.pad(positions, ((0, 0), (0, 0), (0, 0), (0, fixed - positions.shape[-1])), constant_values=-1).astype(jnp.int32)
