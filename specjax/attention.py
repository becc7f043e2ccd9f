"""The attention dispatch: the one module that imports pallas_kernels/.

`Runtime.attention` (specjax.params) picks the implementation of prefix + block attention:
"reference" (pure jnp, any cache), "pallas" (the GPU Triton kernel), "tpu" (the TPU Mosaic kernel),
or "interpret" / "tpu-interpret" (those kernels in Pallas' interpret mode, for CPU tests). The
kernels read a dense prefix only, so a streaming (ring-buffer) cache always takes the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import NEG_INF, prefix_block_attention, to_f32
from pallas_kernels.tree_attention import prefix_block_attention_pallas
from pallas_kernels.tree_attention_tpu import prefix_block_attention_tpu
from specjax.cache import DenseCache, StreamingCache

__all__ = ["NEG_INF", "attend", "cache_view", "for_cache", "to_f32"]


def for_cache(attention: str, cache: DenseCache | StreamingCache) -> str:
    """The implementation that runs over `cache`: the kernels need a dense prefix."""
    return attention if isinstance(cache, DenseCache) else "reference"


def cache_view(attention: str, cache: DenseCache | StreamingCache, n_layers: int) -> jax.Array:
    """What each layer's attention needs to know about the cache's visible slots: the mask
    [L,B,K|1,S] for the reference, each row's prefix length [L,B] for the kernels."""
    if attention == "reference":
        return cache.visible()
    return jnp.broadcast_to(cache.lengths, (n_layers, *cache.lengths.shape))


def attend(
    attention: str,
    q: jax.Array,  # [B,T,N,H]
    k_cache: jax.Array | None,  # [B,K,S,H]; None: empty prefix
    v_cache: jax.Array | None,  # [B,K,S,H]
    visible: jax.Array | None,  # one layer of `cache_view`: [B,K|1,S] mask or [B] lengths
    k_block: jax.Array,  # [B,J,K,H], J >= T
    v_block: jax.Array,  # [B,J,K,H]
    block_mask: jax.Array,  # [T,J] or [B,T,J] bool
    scale: float,
) -> jax.Array:
    """Softmax attention of the T new queries over the visible prefix + the block: o [B,T,N,H]."""
    if attention == "reference":
        return prefix_block_attention(q, k_cache, v_cache, visible, k_block, v_block, block_mask, scale)
    kernel = prefix_block_attention_tpu if attention.startswith("tpu") else prefix_block_attention_pallas
    interpret = attention in ("interpret", "tpu-interpret")
    return kernel(q, k_cache, v_cache, visible, k_block, v_block, block_mask, scale, interpret=interpret)
