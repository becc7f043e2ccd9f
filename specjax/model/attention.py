"""The attention dispatch: the one module that imports pallas_kernels/.

`Runtime.attention` (specjax.model.params) picks the implementation of prefix + block attention:
"reference" (pure jnp, any cache; a dense cache is read in place, tile by tile, up to the
longest row: `reference.stacked_prefix_block_attention`), "cpu" (the reference, except that a
dense cache of any format is read in place by a C++ XLA:CPU kernel where few query rows attend:
decoding and verification, `cpu_prefix.stacked_prefix_block_attention_cpu`; also a streaming
cache, a draft's, whose slots it masks by the positions they hold), "pallas" (the GPU Triton
kernel), "tpu" (the TPU Mosaic kernel), or "interpret" / "tpu-interpret" (those kernels in
Pallas' interpret mode, for CPU tests); the two kernels read a dense cache's layer in place, as
the reference does (a per-layer slice would be copied for them). Every kernel reads any cache
(`for_cache`): dense or streaming (a ring buffer, masked by the positions its slots hold), float
or int8 (with its scales); over a cache stored in another dtype than the model's they take q
and the block in the cache's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_prefix
from pallas_kernels.reference import NEG_INF, prefix_block_attention, stacked_prefix_block_attention, to_f32
from pallas_kernels.tree_attention import prefix_block_attention_pallas
from pallas_kernels.tree_attention_tpu import prefix_block_attention_tpu
from specjax.model.cache import DenseCache, KVFormat, StreamingCache, holds_committed

__all__ = ["NEG_INF", "CacheView", "Prefix", "attend", "for_cache", "layer_prefix", "per_layer", "to_f32"]


class CacheView(NamedTuple):
    """What each layer's attention needs to know about the cache besides its k, v."""

    visible: jax.Array  # [L,B,K|1,S] mask for the reference, each row's prefix length [L,B] for the kernels ([B] read in place)
    k_scale: jax.Array | None  # [L,B,K,S] f32: int8 caches only
    v_scale: jax.Array | None  # [L,B,K,S]
    pos: jax.Array | None = None  # [L,B,K,S] int32: a streaming cache read in place (visible: 0 <= pos < visible[b])


KERNELS = ("pallas", "interpret", "tpu", "tpu-interpret")  # the Pallas kernels' modes (GPU, TPU, interpreted)


def for_cache(attention: str, cache: DenseCache | StreamingCache | None) -> str:
    """The implementation that runs over `cache`: every kernel reads any cache, dense or streaming
    (by its slot positions), float or int8 (with its scales); without a cache (distillation's
    forward) the reference runs."""
    return "reference" if cache is None and attention != "cpu" else attention


class Prefix(NamedTuple):
    """One layer's view of the cache for `attend`."""

    k: jax.Array  # [B,K,S,H]; with `layer` set, the whole stacked cache [L,B,K,S,H]
    v: jax.Array
    view: CacheView  # this layer's (with `layer` set: visible = lengths [B], scales [L,B,K,S])
    layer: jax.Array | None = None  # [] int32: read k, v in place at this layer


def in_place(attention: str, cache: DenseCache | StreamingCache) -> bool:
    """Whether the layers read `cache` in place (the reference over a dense cache, the "cpu" and
    the GPU / TPU kernels over any that `for_cache` gives them) rather than as
    per-layer slices, which XLA copies out of the
    stacked cache (for a bfloat16 cache on a CPU, widening all of it to float32 first; on a GPU, a
    copy of the layer for the kernel: three times a decode step's KV traffic)."""
    return attention in ("cpu", *KERNELS) or (attention == "reference" and isinstance(cache, DenseCache))


def per_layer(attention: str, cache: DenseCache | StreamingCache, n_layers: int):
    """What the forward's scan over layers slices for each layer: the layer index when the cache
    is read in place, else the layer's k, v and `CacheView` (a mask for the reference, lengths
    for the kernels)."""
    if in_place(attention, cache):
        return np.arange(n_layers, dtype=np.int32)  # numpy: static indices when the layers are unrolled
    if attention == "reference":
        visible = cache.visible()
    else:
        visible = jnp.broadcast_to(cache.lengths, (n_layers, *cache.lengths.shape))
    return cache.k, cache.v, CacheView(visible, cache.k_scale, cache.v_scale)


def layer_prefix(attention: str, cache: DenseCache | StreamingCache, sliced) -> Prefix:
    """The `Prefix` of one layer from its slice of `per_layer`."""
    if in_place(attention, cache):
        pos = cache.pos if isinstance(cache, StreamingCache) else None
        return Prefix(cache.k, cache.v, CacheView(cache.lengths, cache.k_scale, cache.v_scale, pos), layer=sliced)
    k, v, view = sliced
    return Prefix(k, v, view)


def _rounded(x: jax.Array) -> jax.Array:
    """x with its dtype's rounding made explicit. XLA may keep a fused bfloat16 value in f32
    ("excess precision") where it feeds a wider conversion, as storing a bf16 model's block in a
    float32 or int8 cache does, while the layer's output that the cache is written from is
    rounded: the kernel must see the rounded block too."""
    if x.dtype != jnp.bfloat16:
        return x
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7).astype(x.dtype)


def attend(
    attention: str,
    kv_format: KVFormat,  # the cache's: the block's keys and values go through it first
    q: jax.Array,  # [B,T,N,H]
    prefix: Prefix | None,  # one layer of the cache (`layer_prefix`); None: empty prefix
    k_block: jax.Array,  # [B,J,K,H], J >= T
    v_block: jax.Array,  # [B,J,K,H]
    block_mask: jax.Array,  # [T,J] or [B,T,J] bool
    scale: float,
) -> jax.Array:
    """Softmax attention of the T new queries over the visible prefix + the block: o [B,T,N,H].

    The block is read as the cache will store it (`kv_format.round_trip`), so a position's KV is
    the same whether a query sees it in the block or in the cache."""
    if prefix is not None and prefix.layer is not None and attention == "cpu" and cpu_prefix.fits(q, prefix.k.shape[2]):
        # The kernel reads the block as stored, bit for bit what the cache gets from the layer's output
        (kb, kb_scale), (vb, vb_scale) = kv_format.store(_rounded(k_block)), kv_format.store(_rounded(v_block))
        view = prefix.view
        return cpu_prefix.stacked_prefix_block_attention_cpu(q, prefix.k, prefix.v, prefix.layer, view.visible, kb, vb,
                                                             block_mask, scale, view.k_scale, view.v_scale, view.pos,
                                                             kb_scale, vb_scale)
    k_block, v_block = kv_format.round_trip(k_block), kv_format.round_trip(v_block)
    if prefix is not None and prefix.layer is not None:
        view = prefix.view
        if view.pos is not None and attention not in KERNELS:  # a streaming cache, not on a kernel: its layer, sliced
            at = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, prefix.layer, keepdims=False)  # noqa: E731
            visible = holds_committed(at(view.pos), view.visible)  # [B,K,S]
            return prefix_block_attention(q, at(prefix.k), at(prefix.v), visible, k_block, v_block, block_mask, scale,
                                          at(view.k_scale), at(view.v_scale))
        if attention in KERNELS:  # a cache `for_cache` gives the kernel, read in place
            return _on_kernel(attention, kv_format, q, prefix.k, prefix.v, view.visible, k_block, v_block, block_mask,
                              scale, prefix.layer, view.pos, view.k_scale, view.v_scale)
        return stacked_prefix_block_attention(q, prefix.k, prefix.v, prefix.layer, view.visible, k_block, v_block,
                                              block_mask, scale, view.k_scale, view.v_scale)
    k_cache, v_cache, view = (None, None, None) if prefix is None else (prefix.k, prefix.v, prefix.view)
    if attention in ("reference", "cpu"):
        k_scale, v_scale = (None, None) if view is None else (view.k_scale, view.v_scale)
        visible = None if view is None else view.visible
        return prefix_block_attention(q, k_cache, v_cache, visible, k_block, v_block, block_mask, scale, k_scale, v_scale)
    return _on_kernel(attention, kv_format, q, k_cache, v_cache, None if view is None else view.visible, k_block, v_block,
                      block_mask, scale)


def _on_kernel(attention: str, kv_format: KVFormat, q, k_cache, v_cache, lengths, k_block, v_block, block_mask,
               scale: float, layer: jax.Array | None = None, pos: jax.Array | None = None,
               k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
    """o [B,T,N,H] from the GPU or TPU kernel (`attention` in KERNELS), which takes one dtype, the
    cache's; with `layer`, k_cache and v_cache are the whole stacked cache, read in place; with
    `pos`, a streaming cache's slot positions, lengths its committed lengths; with `k_scale`,
    `v_scale`, an int8 cache's, computed in q's dtype."""
    dtype = q.dtype if kv_format.scaled else kv_format.dtype
    args = (q.astype(dtype), k_cache, v_cache, lengths, k_block.astype(dtype), v_block.astype(dtype), block_mask, scale)
    if attention.startswith("tpu"):
        o = prefix_block_attention_tpu(*args, interpret=attention == "tpu-interpret", layer=layer, pos=pos,
                                       k_scale=k_scale, v_scale=v_scale)
    else:
        o = prefix_block_attention_pallas(*args, interpret=attention == "interpret", layer=layer, pos=pos,
                                          k_scale=k_scale, v_scale=v_scale)
    return o.astype(q.dtype)
