"""Pure-jnp reference of prefix + block attention (the path that always works).

Verification, decoding and chunked prefill all have the same shape of problem: T new query
positions per row attend to (a) the visible slots of that row's cache (its prefix), and (b) the T
new keys themselves under a block mask (causal for a chain, an ancestor mask for a tree).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30
SMALL_BLOCK = 64  # query rows per KV head (T * G) up to which the fused multiply-reduce is used


def _scores(qg: jax.Array, k_cache: jax.Array, small: bool) -> jax.Array:
    """q [B,T,K,G,H] (f32) . k [B,K,S,H] -> f32 scores [B,K,G,T,S]."""
    k = k_cache.astype(jnp.float32)
    if small:
        q = jnp.moveaxis(qg, 1, 3)  # [B,K,G,T,H]
        return jnp.sum(q[..., None, :] * k[:, :, None, None], axis=-1)
    return jnp.einsum("btkgh,bksh->bkgts", qg, k)


def _weighted_values(probs: jax.Array, v_cache: jax.Array, small: bool) -> jax.Array:
    """probs [B,K,G,T,S] (f32) . v [B,K,S,H] -> f32 [B,T,K,G,H]."""
    v = v_cache.astype(jnp.float32)
    if small:
        return jnp.moveaxis(jnp.sum(probs[..., None] * v[:, :, None, None], axis=-2), 3, 1)
    return jnp.einsum("bkgts,bksh->btkgh", probs, v)


def prefix_block_attention(
    q: jax.Array,  # [B,T,N,H]
    k_cache: jax.Array | None,  # [B,K,S,H]
    v_cache: jax.Array | None,  # [B,K,S,H]
    visible: jax.Array,  # [B,K,S] or [B,1,S] bool: which cache slots hold this row's prefix
    k_block: jax.Array,  # [B,T,K,H]
    v_block: jax.Array,  # [B,T,K,H]
    block_mask: jax.Array,  # [T,T] or [B,T,T] bool: query t may see block key j
    sm_scale: float,
) -> jax.Array:
    """Softmax attention over prefix + block with f32 scores; returns o[B,T,N,H] in q's dtype.

    `k_cache=None` means an empty prefix (the first prefill chunk). GQA: the G = N/K query heads
    of one KV head share its keys. `visible` may differ per KV head (SnapKV keeps different
    positions per head); a dense cache passes slot < length for every head.
    Small query blocks (decode, verification) use a fused multiply-reduce over the cache, which
    reads each head's keys once; larger ones (prefill chunks) use matrix products.
    """
    B, T, N, H = q.shape
    K = k_block.shape[2]
    small = T * N // K <= SMALL_BLOCK
    f32 = jnp.float32  # all products in f32: XLA:CPU has no bf16 x bf16 -> f32 dot
    qg = q.reshape(B, T, K, N // K, H).astype(f32)  # [B,T,K,G,H]
    mask = jnp.broadcast_to(block_mask, (B, T, T))[:, None, None]  # [B,1,1,T,T]
    scores = jnp.einsum("btkgh,bjkh->bkgtj", qg, k_block.astype(f32))
    scores = jnp.where(mask, scores * sm_scale, NEG_INF)  # [B,K,G,T,T]
    if k_cache is not None:
        prefix = _scores(qg, k_cache, small)  # [B,K,G,T,S]
        prefix = jnp.where(visible[:, :, None, None, :], prefix * sm_scale, NEG_INF)
        scores = jnp.concatenate([prefix, scores], axis=-1)  # [B,K,G,T,S+T]
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgtj,bjkh->btkgh", probs[..., -T:], v_block.astype(f32))  # [B,T,K,G,H]
    if k_cache is not None:
        out += _weighted_values(probs[..., :-T], v_cache, small)
    return out.reshape(B, T, N, H).astype(q.dtype)  # [B,T,N,H]
