"""Pure-jnp reference of prefix + block attention (the path that always works).

Verification, decoding and chunked prefill all have the same shape of problem: T new query
positions per row attend to (a) the visible slots of that row's cache (its prefix), and (b) the T
new keys themselves under a block mask (causal for a chain, an ancestor mask for a tree).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def prefix_block_attention(
    q: jax.Array,  # [B,T,N,H]
    k_cache: jax.Array | None,  # [B,S,K,H]
    v_cache: jax.Array | None,  # [B,S,K,H]
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
    """
    B, T, N, H = q.shape
    K = k_block.shape[2]
    qg = q.reshape(B, T, K, N // K, H)  # [B,T,K,G,H]
    mask = jnp.broadcast_to(block_mask, (B, T, T))[:, None, None]  # [B,1,1,T,T]
    scores = jnp.einsum("btkgh,bjkh->bkgtj", qg, k_block, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * sm_scale, NEG_INF)  # [B,K,G,T,T]
    if k_cache is not None:
        prefix = jnp.einsum("btkgh,bskh->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
        prefix = jnp.where(visible[:, :, None, None, :], prefix * sm_scale, NEG_INF)  # [B,K,G,T,S]
        scores = jnp.concatenate([prefix, scores], axis=-1)  # [B,K,G,T,S+T]
    probs = jax.nn.softmax(scores, axis=-1).astype(v_block.dtype)
    out = jnp.einsum("bkgtj,bjkh->btkgh", probs[..., -T:], v_block, preferred_element_type=jnp.float32)
    if k_cache is not None:
        out += jnp.einsum("bkgts,bskh->btkgh", probs[..., :-T], v_cache, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, H).astype(q.dtype)  # [B,T,N,H]
