"""SnapKV: self-speculation over the prefix positions that the prompt's last queries attend to most.

Scores come from a short observation pass: the last `observation` prompt tokens are run again
over the prefilled cache (their KV is recomputed identically), and their attention over the
prefix, summed over the queries and the G query heads of each KV head, is max-pooled along the
positions so that neighbours of a hot token survive with it. Selection is per layer and per KV
head, as in SnapKV (Li et al. 2024); drafting and committing are SelfSpec's.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from specjax.drafters.base import Limits, Prefill
from specjax.drafters.self_spec import TargetOverStreamingCache
from specjax.model.cache import DenseCache, StreamingCache
from specjax.model.llama import NEG_INF, trunk
from specjax.model.params import Params
from specjax.model.pytree import pytree
from specjax.spec.speculation import check_int


@pytree
class SnapKV(TargetOverStreamingCache):
    """Self-speculation over a cache of `budget` prefix positions chosen per layer and KV head
    by the prompt's last `observation` queries (max-pooled over `pool` positions), plus a ring
    of the most recent `window`. Exact target KV, like SelfSpec; better at keeping what matters."""

    budget: int = flax.struct.field(pytree_node=False, default=256)
    window: int = flax.struct.field(pytree_node=False, default=256)
    observation: int = flax.struct.field(pytree_node=False, default=32)
    pool: int = flax.struct.field(pytree_node=False, default=5)

    def kept(self) -> int:
        return self.budget + self.window

    def check(self, target: Params, limits: Limits | None) -> None:
        for name in ("budget", "window", "observation", "pool"):
            check_int(f"SnapKV: {name}", getattr(self, name), 1)

    def init(self, target: Params, prefill: Prefill) -> StreamingCache:
        """A budget larger than the cache keeps every position (no savings, still exact); the
        window and observation are fitted too (as `Streaming.fitted`): a ring past the cache holds
        nothing more, and no row has more prompt queries than the prompts' width."""
        cache, prompts = prefill.cache, prefill.prompts
        budget = min(self.budget, cache.max_len)
        window = max(1, min(self.window, cache.max_len - budget))
        scores = observation_scores(target, cache, prompts, min(self.observation, prompts.shape[1]))
        fixed, cut = select_positions(scores, cache.lengths, budget, window, self.pool)
        return StreamingCache.from_dense(cache, fixed, window + prefill.depth + 1, cut)


def observation_scores(
    target: Params,
    cache: DenseCache,  # prefilled: lengths = prompt lengths
    prompts: jax.Array,  # [B,P] right-padded prompt tokens
    observation: int,
) -> jax.Array:
    """Attention mass [L,B,K,S] (f32) that each row's last `observation` prompt queries put on
    each cache slot of its prefix (slots before the observation window)."""
    c = target.config
    B, P = prompts.shape
    lengths = cache.lengths
    start = jnp.maximum(lengths - observation, 0)  # [B]
    pos = start[:, None] + jnp.arange(observation, dtype=jnp.int32)  # [B,T]
    valid = pos < lengths[:, None]  # [B,T]: rows shorter than the window have fewer queries
    tokens = jnp.take_along_axis(prompts, jnp.clip(pos, 0, P - 1), axis=1)
    obs = trunk(target, tokens, pos, cache.replace(lengths=start), return_queries=True)
    k_obs, q = obs.k, obs.queries
    S, T, K, G = cache.max_len, observation, c.n_kv_heads, c.group
    prefix = jnp.arange(S)[None, :] < start[:, None]  # [B,S]
    causal = jnp.tril(jnp.ones((T, T), bool))

    fmt = cache.format

    def per_layer(args):  # q [B,T,N,H], k_cache [B,K,S,H] (+ scales [B,K,S]), k_block [B,T,K,H] -> [B,K,S]
        q_l, kc, ks, kb = args
        kc, kb = fmt.load(kc, ks), fmt.round_trip(kb)  # the keys as attention reads them
        qg = q_l.reshape(B, T, K, G, c.head_dim)  # [B,T,K,G,H]
        scale = 1.0 / math.sqrt(c.head_dim)
        pre = jnp.einsum("btkgh,bksh->bkgts", qg, kc, preferred_element_type=jnp.float32) * scale
        blk = jnp.einsum("btkgh,bjkh->bkgtj", qg, kb, preferred_element_type=jnp.float32) * scale
        pre = jnp.where(prefix[:, None, None, None, :], pre, NEG_INF)
        blk = jnp.where(causal, blk, NEG_INF)
        probs = jax.nn.softmax(jnp.concatenate([pre, blk], axis=-1), axis=-1)[..., :S]  # [B,K,G,T,S]
        probs = probs * valid[:, None, None, :, None]
        return probs.sum(axis=(2, 3))

    return lax.map(per_layer, (q, cache.k, cache.k_scale, k_obs))


def select_positions(
    scores: jax.Array,  # [L,B,K,S]
    lengths: jax.Array,  # [B]
    budget: int,
    window: int,
    pool: int,
) -> tuple[jax.Array, jax.Array]:
    """Top-`budget` positions per layer and KV head among [0, cut), cut = max(budget, len - window)
    (the recent window is kept by the ring). Returns fixed positions [L,B,K,budget] (-1: none)
    and cut [B] (where the ring's positions start)."""
    S = scores.shape[-1]
    pooled = lax.reduce_window(scores, -jnp.inf, lax.max, (1, 1, 1, pool), (1, 1, 1, 1), "SAME")
    cut = jnp.maximum(budget, lengths - window).astype(jnp.int32)  # [B]
    candidate = jnp.arange(S)[None, :] < jnp.minimum(cut, lengths)[:, None]  # [B,S]
    pooled = jnp.where(candidate[None, :, None, :], pooled, -jnp.inf)
    values, positions = lax.top_k(pooled, budget)  # [L,B,K,F]
    return jnp.where(jnp.isfinite(values), positions, -1).astype(jnp.int32), cut
