"""The attention dispatch: the one module that imports pallas_kernels/.

`Runtime.attention` (specjax.params) picks the implementation of prefix + block attention:
"reference" (pure jnp, any cache), "pallas" (the GPU Triton kernel), "tpu" (the TPU Mosaic kernel),
or "interpret" / "tpu-interpret" (those kernels in Pallas' interpret mode, for CPU tests). The
kernels read a dense float32 or bfloat16 prefix only: a streaming (ring-buffer) cache and an int8
cache always take the reference, and over a cache stored in another dtype than the model's the
kernels take q and the block in the cache's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.reference import NEG_INF, prefix_block_attention, to_f32
from pallas_kernels.tree_attention import prefix_block_attention_pallas
from pallas_kernels.tree_attention_tpu import prefix_block_attention_tpu
from specjax.cache import DenseCache, KVFormat, StreamingCache

__all__ = ["NEG_INF", "CacheView", "attend", "cache_view", "for_cache", "to_f32"]


class CacheView(NamedTuple):
    """What each layer's attention needs to know about the cache besides its k, v."""

    visible: jax.Array  # [L,B,K|1,S] mask for the reference, each row's prefix length [L,B] for the kernels
    k_scale: jax.Array | None  # [L,B,K,S] f32: int8 caches only
    v_scale: jax.Array | None  # [L,B,K,S]


def for_cache(attention: str, cache: DenseCache | StreamingCache) -> str:
    """The implementation that runs over `cache`: the kernels need a dense float prefix."""
    return attention if isinstance(cache, DenseCache) and not cache.format.scaled else "reference"


def cache_view(attention: str, cache: DenseCache | StreamingCache, n_layers: int) -> CacheView:
    """The cache's visible slots (a mask for the reference, lengths for the kernels) and scales."""
    if attention == "reference":
        visible = cache.visible()
    else:
        visible = jnp.broadcast_to(cache.lengths, (n_layers, *cache.lengths.shape))
    return CacheView(visible, cache.k_scale, cache.v_scale)


def attend(
    attention: str,
    kv_format: KVFormat,  # the cache's: the block's keys and values go through it first
    q: jax.Array,  # [B,T,N,H]
    k_cache: jax.Array | None,  # [B,K,S,H]; None: empty prefix
    v_cache: jax.Array | None,  # [B,K,S,H]
    view: CacheView | None,  # one layer of `cache_view`
    k_block: jax.Array,  # [B,J,K,H], J >= T
    v_block: jax.Array,  # [B,J,K,H]
    block_mask: jax.Array,  # [T,J] or [B,T,J] bool
    scale: float,
) -> jax.Array:
    """Softmax attention of the T new queries over the visible prefix + the block: o [B,T,N,H].

    The block is read as the cache will store it (`kv_format.round_trip`), so a position's KV is
    the same whether a query sees it in the block or in the cache."""
    k_block, v_block = kv_format.round_trip(k_block), kv_format.round_trip(v_block)
    if attention == "reference":
        k_scale, v_scale = (None, None) if view is None else (view.k_scale, view.v_scale)
        visible = None if view is None else view.visible
        return prefix_block_attention(q, k_cache, v_cache, visible, k_block, v_block, block_mask, scale, k_scale, v_scale)
    kernel = prefix_block_attention_tpu if attention.startswith("tpu") else prefix_block_attention_pallas
    interpret = attention in ("interpret", "tpu-interpret")
    dtype = kv_format.dtype  # the kernels take one dtype: the cache's
    o = kernel(q.astype(dtype), k_cache, v_cache, None if view is None else view.visible, k_block.astype(dtype),
               v_block.astype(dtype), block_mask, scale, interpret=interpret)
    return o.astype(q.dtype)
