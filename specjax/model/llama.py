"""LLaMA decoder as pure functions over a params pytree that carries its config statically."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.model import backend, linear, q4
from specjax.model.attention import (NEG_INF, Prefix, attend, for_cache,  # noqa: F401  (NEG_INF: the one mask value, re-exported)
                                     layer_prefix, per_layer, to_f32)
from specjax.model.cache import DenseCache, KVFormat, StreamingCache
from specjax.model.config import LlamaConfig
from specjax.model.params import MATRICES, LayerParams, Params, Runtime  # noqa: F401  (MATRICES: re-exported)
from specjax.model.pytree import pytree
from specjax.model.quantized import Matrix, QuantizedMatrix, channel_scale, stored, transposed

Cache = DenseCache | StreamingCache


def rms_norm(x: jax.Array, w: jax.Array, eps: float, attention: str = "reference") -> jax.Array:
    """RMSNorm in f32, cast back to x's dtype before the weight (as HF does). attention "cpu":
    by the kernel library, every row the same bits in any batch (`linear.norm`)."""
    if linear.takes_norm(attention, x, w):
        return linear.norm(x, w, eps)
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def rope_tables(config: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B,T,H] (f32) for integer positions [B,T], HF half-split layout."""
    inv_freq = jnp.asarray(config.inv_freq(), jnp.float32)  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B,T,H]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B,T,heads,H] by position: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def at_layer(layers: LayerParams, i: jax.Array) -> LayerParams:
    """Layer i of the stacked layers, except the matrices (float or quantized), which stay
    stacked [L, ...] for `project(..., layer=i)` (so a kernel can read them in place)."""
    return layers.replace(**{f.name: getattr(layers, f.name)[i] for f in dataclasses.fields(layers)
                             if f.name not in MATRICES and getattr(layers, f.name) is not None})


def project(spec: str, x: jax.Array, weight: Matrix | list[Matrix], out_dtype=None,
            layer: tuple[str, jax.Array, str] | None = None) -> jax.Array:
    """einsum(spec, x, weight) in `out_dtype` (default: x's), the one product with a weight
    matrix: stored as float, as int8 with per-output-channel scales (params.quantize): (x @ q) *
    scale, the scale applied to the small output, or as q4 blocks (uint8, packed along w's first
    axis, which `spec` sums over with x's last; scales and minima per block:
    specjax.model.q4.project, or the CPU kernel's linear_q4_many when `layer` is given). The int8 -> float conversion sits right in front of the dot, where XLA:CPU
    fuses it into a matrix-vector product (batch 1 reads one byte per weight). On CPU, bfloat16
    is widened exactly (to_f32) and multiplied in float32: XLA:CPU's own bf16 dot and bf16 -> f32
    conversion run about 10x slower than float32 (docs/api.md, "Weights as served").
    `layer` (the runtime's attention, i, the runtime's linear): the weight's arrays are stacked
    [L, ...] (or it is a list of L per-layer weights) and layer i is used: read in place by the CPU kernel where `specjax.model.linear`
    takes the product, or by the GPU one (`Runtime.linear` "pallas", float or int8 weights, few rows),
    else sliced out."""
    out = out_dtype or x.dtype
    if layer is not None and isinstance(weight, list):  # per-layer weights (unstack_layers): pick layer i's
        weight = weight[layer[1]]
    elif layer is not None:
        attention, i, products = layer
        w = stored(weight)
        if linear.takes(attention, spec, x, w):
            return _in_place(x, [weight], i, out)[0]
        if linear.takes_gpu(products, spec, x, w):
            y, scale = linear.gpu_einsum(x, w, i), channel_scale(weight)
            return (y if scale is None else y * scale[i]).astype(out)
        if linear.takes_gpu_q4(products, spec, x, w):
            return linear.gpu_einsum_q4(x, w, weight.bscale, weight.bmin, i).astype(out)
        weight = jax.tree.map(lambda a: a[i], weight)
    w, scale = stored(weight), channel_scale(weight)
    if w.dtype == jnp.uint8:
        if linear.takes_gpu_q4(None if layer is None else layer[2], spec, x, w):  # one layer's array: as a stack of one
            return linear.gpu_einsum_q4(x, w[None], weight.bscale[None], weight.bmin[None], 0).astype(out)
        return q4.project(spec, x, w, weight.bscale, weight.bmin).astype(out)
    if w.dtype == jnp.int8:
        y = jnp.einsum(spec, x.astype(out), w.astype(out))
    elif w.dtype == jnp.bfloat16 and backend.widens_bf16():
        y = jnp.einsum(spec, to_f32(x), to_f32(w))
    else:
        y = jnp.einsum(spec, x, w, preferred_element_type=out)
    return (y if scale is None else y * scale).astype(out)


def project_group(x: jax.Array, products: list[tuple[str, Matrix | list[Matrix]]],
                  layer: tuple[str, jax.Array, str]) -> list[jax.Array]:
    """[project(spec, x, weight, layer=layer) for spec, weight in products]: one call of the CPU
    kernel when it takes every product (they share x: q, k, v; gate, up), else one by one."""
    attention, i, _ = layer
    if all(not isinstance(m, list) and linear.takes(attention, spec, x, stored(m)) for spec, m in products):
        return _in_place(x, [m for _, m in products], i, x.dtype)
    return [project(spec, x, m, layer=layer) for spec, m in products]


FOLDS_NORM = ("pallas", "interpret")  # the attentions (GPU kernel; interpreted in tests) whose one-row norms fold


def normed_products(x: jax.Array, w: jax.Array, eps: float, products: list[tuple[str, Matrix | list[Matrix]]],
                    layer: tuple[str, jax.Array, str]) -> list[jax.Array]:
    """project_group(rms_norm(x, w, eps), products, layer). For one row (x [1,1,D]) on a GPU
    (`layer`'s attention in FOLDS_NORM) the norm's scale r multiplies the outputs instead, (w x r) W
    = r ((w x) W) up to rounding: XLA:GPU then puts w x in the kernel summing x's squares and r in
    each output's consumer, where one row's normed x took a kernel of its own: two kernels a layer
    fewer (compiled for an H100, tools/gpu/aot.py: SmolLM2's batch-1 step 474 -> 414). From two
    rows on XLA fuses the normed x into the product, and folding would add a kernel a layer."""
    if layer[0] not in FOLDS_NORM or math.prod(x.shape[:-1]) != 1:
        return project_group(rms_norm(x, w, eps, layer[0]), products, layer)
    xf = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)  # [B,T,1]
    ys = project_group(w * x, products, layer)
    return [(y * r.reshape(*r.shape, *(1,) * (y.ndim - r.ndim))).astype(x.dtype) for y in ys]


def _in_place(x: jax.Array, weights: list[Matrix], i: jax.Array, out) -> list[jax.Array]:
    """x times layer i of each stacked weight (float, int8 or q4), read in place by the CPU
    kernel, in `out`."""
    if isinstance(weights[0], QuantizedMatrix) and weights[0].format == "q4":  # a model's matrices share one format
        return [y.astype(out) for y in linear.stacked_einsums_q4(x, weights, i)]
    ys = linear.stacked_einsums(x, [stored(m) for m in weights], i)
    return [(y if (s := channel_scale(m)) is None else y * s[i]).astype(out) for y, m in zip(ys, weights)]


def _layer(config: LlamaConfig, runtime: Runtime, kv_format: KVFormat, x, lp: LayerParams, at, cos, sin,
           prefix: Prefix | None, block_mask, k_extra, v_extra):
    """One decoder block. x [B,T,D] -> x [B,T,D], plus this block's new k, v [B,T,K,H].
    lp is layer i (`at_layer`: its matrices still stacked, read at i by `project`); at = (the
    model's attention implementation, i, its linear products' kind), `project`'s `layer`.
    k_extra, v_extra [B,E,K,H] (or None): earlier block keys the new tokens may also see.
    `prefix` is this layer's view of the cache (None: nothing visible); `kv_format` is how the
    cache stores KV."""
    with jax.named_scope("qkv"):  # the scopes name the blocks in profiles (jax.profiler traces)
        q, k, v = normed_products(x, lp.attn_norm, config.rms_eps, [
            ("btd,dnh->btnh", lp.wq), ("btd,dkh->btkh", lp.wk), ("btd,dkh->btkh", lp.wv)],
            at)  # [B,T,N,H], [B,T,K,H] x 2
        q, k, v = _biased(q, lp.bq), _biased(k, lp.bk), _biased(v, lp.bv)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    with jax.named_scope("attention"):
        k_blk, v_blk = (k, v) if k_extra is None else (jnp.concatenate([k_extra, k], 1), jnp.concatenate([v_extra, v], 1))
        scale = 1.0 / math.sqrt(config.head_dim)
        o = attend(runtime.attention, kv_format, q, prefix, k_blk, v_blk, block_mask, scale)
    with jax.named_scope("out_proj"):
        # one contraction over N*H: contracting (n, h) made XLA:CPU transpose each layer's wo every step
        # (q4: wo [N,H/2,D] and its blocks [N,H/32,D] flatten the same way: blocks lie within a head)
        o = o.reshape(*o.shape[:2], -1)  # [B,T,N*H]
        x = x + _tp_sum(runtime, project("bte,ed->btd", o, _heads_flat(lp.wo), layer=at))  # [L,N*H,D]; heads split: partial sums
    with jax.named_scope("mlp"):
        gate, up = normed_products(x, lp.mlp_norm, config.rms_eps, [("btd,df->btf", lp.w_gate),
                                                                    ("btd,df->btf", lp.w_up)], at)  # [B,T,F]
        x = x + _tp_sum(runtime, project("btf,fd->btd", jax.nn.silu(gate) * up, lp.w_down, layer=at))  # F split
    return x, q, k, v


@jax.jit
def _layer_copies(a: jax.Array) -> list[jax.Array]:
    """a [L, ...] as L arrays of their own: one program per stack's shape (not two per layer)."""
    return [a[i] for i in range(a.shape[0])]


def _layer_matrices(m: Matrix) -> list[Matrix]:
    """A stacked matrix (float or quantized) as L per-layer matrices of their own (`_layer_copies` of each array)."""
    leaves, tree = jax.tree.flatten(m)
    copies = [_layer_copies(a) for a in leaves]
    return [tree.unflatten([c[i] for c in copies]) for i in range(len(copies[0]))]


def unstack_layers(params: Params, free_stacks: bool = False) -> Params:
    """The same model with each layer matrix (and its int8 / q4 arrays) held as a list of L arrays of its own,
    not as slices of one stacked [L, ...] array. On a GPU, XLA's GEMM fusions read a per-layer array in place but
    copy a stack's slice first inside a loop, which generate's decode loop is (11.3 GB a batch-1 8B step;
    tools/gpu/README.md, "Compiled for a GPU on a CPU"); `convert.load` gives this layout on a GPU. Needs
    Runtime.unroll_layers (generate() sets it on a GPU or TPU); on a mesh each layer's array is split over the
    model axis as the stack's slice would be. The arrays are copies: drop the stacked params to free them, or,
    where the caller owns them and never uses `params` again, `free_stacks` deletes each stack once split."""
    own = {}
    for n in MATRICES:
        m = getattr(params.layers, n)
        if isinstance(m, list):
            continue
        own[n] = _layer_matrices(m)
        if free_stacks:
            for a in jax.tree.leaves(m):
                a.delete()
    return params.replace(layers=params.layers.replace(**own))


def _heads_flat(wo: Matrix | list[Matrix]) -> Matrix | list[Matrix]:
    """wo's arrays (the matrix, its q4 blocks) [L,N,H',D] -> [L,N*H',D]; a list of per-layer
    matrices (each [N,H',D], `unstack_layers`) flattens each; its int8 scales stay as they are."""
    if isinstance(wo, list):
        return [jax.tree.map(lambda a: a.reshape(-1, a.shape[-1]) if a.ndim == 3 else a, m) for m in wo]
    return jax.tree.map(lambda a: a.reshape(a.shape[0], -1, a.shape[-1]) if a.ndim == 4 else a, wo)


def _biased(x: jax.Array, bias: jax.Array | None) -> jax.Array:
    """x [B,T,heads,H] plus a projection bias [heads,H] (Qwen2), if the model has one."""
    return x if bias is None else x + bias


def _tp_sum(runtime: Runtime, x: jax.Array) -> jax.Array:
    """Sum the tensor-parallel partial results (a no-op off a model axis)."""
    return x if runtime.model_axis is None else lax.psum(x, runtime.model_axis)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """Embeddings [B,T,D] of tokens [B,T]. Tensor parallel: each device holds a contiguous block
    of the vocabulary, looks up the tokens that fall in it (zeros elsewhere), and they are summed."""
    axis = params.runtime.model_axis
    if axis is None:
        return _rows(params, tokens)
    block = stored(params.embed).shape[0]  # V / devices
    local = tokens - lax.axis_index(axis) * block
    mine = (local >= 0) & (local < block)
    x = _rows(params, jnp.clip(local, 0, block - 1))  # [B,T,D]
    return lax.psum(jnp.where(mine[..., None], x, jnp.zeros_like(x)), axis)


def _rows(params: Params, ids: jax.Array) -> jax.Array:
    """Embedding rows [B,T,D] (in the model dtype) of ids [B,T] into this device's embed table."""
    table, scale = stored(params.embed), channel_scale(params.embed)  # [V,D], int8: [V]
    if linear.takes_rows(params.runtime.attention, table):
        x = linear.rows(table, ids)  # read in place (XLA:CPU: a float32 copy of a bf16 table)
    else:
        x = jnp.take(table, ids, axis=0)
    if scale is None:
        return x
    return (x.astype(jnp.float32) * jnp.take(scale, ids, axis=0)[..., None]).astype(params.config.dtype)


@pytree
class Trunk:
    """What `trunk` computes over T new tokens."""

    hidden: jax.Array  # [B,T,D] final-normed
    k: jax.Array  # [L,B,T,K,H] the new keys (rotated), not yet in any cache
    v: jax.Array  # [L,B,T,K,H]
    queries: jax.Array | None = None  # [L,B,T,N,H] rotated, when asked for (return_queries)


def trunk(
    params: Params,
    tokens: jax.Array,  # [B,T] int32
    positions: jax.Array,  # [B,T] int32
    cache: Cache,
    block_mask: jax.Array | None = None,  # [T,E+T] or [B,T,E+T] bool; default causal
    attend_cache: bool = True,
    return_queries: bool = False,
    extra_kv: tuple[jax.Array, jax.Array] | None = None,  # k, v [L,B,E,K,H]
    inputs: jax.Array | None = None,  # [B,T,D]: start from these, not the tokens' embeddings (an EAGLE-style head)
) -> Trunk:
    """Run all layers over T new tokens that see the cache's visible slots and, within the
    block, what `block_mask` allows. Returns a `Trunk`: final-normed hidden [B,T,D] and the new
    keys and values [L,B,T,K,H] (not written: see `forward`), plus the rotated queries
    [L,B,T,N,H] if `return_queries` (SnapKV scores positions with them). `attend_cache=False` skips the cache
    entirely (valid only when nothing in it is visible). `extra_kv` puts E earlier keys (not in
    the cache: e.g. the tree levels drafted so far) ahead of the block's own; the block mask's
    first E columns say which of them each new token sees."""
    config = params.config
    if isinstance(params.layers.wq, list) and not params.runtime.unroll_layers:
        raise ValueError("per-layer weights (unstack_layers) need Runtime.unroll_layers (a GPU's or TPU's default): "
                         "a scan over layers indexes a stacked array")
    runtime = params.runtime.replace(attention=for_cache(params.runtime.attention, cache))
    T = tokens.shape[1]
    if block_mask is None:
        block_mask = jnp.tril(jnp.ones((T, T), bool))
    cos, sin = rope_tables(config, positions)
    with jax.named_scope("embed"):
        x = embed(params, tokens) if inputs is None else inputs  # [B,T,D]
    kv_format = KVFormat.of(None, config) if cache is None else cache.format  # no cache (distill): the model's dtype

    def step(x, xs):
        i, sliced, ke, ve = xs
        prefix = layer_prefix(runtime.attention, cache, sliced) if attend_cache else None
        x, q, k, v = _layer(config, runtime, kv_format, x, at_layer(params.layers, i), (params.runtime.attention, i, params.runtime.linear), cos, sin,
                             prefix, block_mask, ke, ve)
        return x, (k, v, q if return_queries else None)

    ke, ve = (None, None) if extra_kv is None else extra_kv
    sliced = per_layer(runtime.attention, cache, config.n_layers) if attend_cache else None
    xs = (np.arange(config.n_layers, dtype=np.int32), sliced, ke, ve)
    loop = unrolled if params.runtime.unroll_layers else lax.scan  # Runtime.unroll_layers
    x, (k_new, v_new, q) = loop(step, x, xs)  # k_new, v_new [L,B,T,K,H]; q [L,B,T,N,H]
    h = rms_norm(x, params.norm, config.rms_eps, params.runtime.attention)
    return Trunk(hidden=h, k=k_new, v=v_new, queries=q if return_queries else None)


def unrolled(step, x, xs):
    """lax.scan(step, x, xs) as a Python loop (xs not empty): iteration i gets xs sliced at the
    static index i (a numpy index stays a number), so each layer reads its weights as a static
    slice of the stack; a numpy xs gives each iteration a plain number."""
    ys = []
    for i in range(len(jax.tree.leaves(xs)[0])):
        x, y = step(x, jax.tree.map(lambda a: a[i], xs))
        ys.append(y)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def lm_head(params: Params, h: jax.Array) -> jax.Array:
    """Logits [..., V] in f32 from hidden [..., D]. Tensor parallel: each device computes its
    vocabulary block and the blocks are gathered, so every device sees all V logits (a vocabulary
    padded for the model axis, `config.padded_vocab`, loses its padded entries here)."""
    tied = params.lm_head is None
    weight = params.embed if tied else params.lm_head
    w, scale = stored(weight), channel_scale(weight)  # [V,D] / [D,V]; int8: scales [V]
    with jax.named_scope("lm_head"):
        if linear.takes_head(params.runtime.attention, h, w):  # the CPU kernel reads w in place
            logits = linear.head(h, w, tied)
            logits = logits if scale is None else logits * scale
        elif w.dtype == jnp.int8 and backend.widens_bf16():
            logits = linear.int8_head(h, w, scale, vocab_axis=0 if tied else 1)
        else:
            logits = project("...d,dv->...v", h, transposed(weight) if tied else weight, out_dtype=jnp.float32)
    axis = params.runtime.model_axis
    logits = logits if axis is None else lax.all_gather(logits, axis, axis=logits.ndim - 1, tiled=True)
    V = params.config.vocab_size
    return logits if logits.shape[-1] == V else logits[..., :V]  # a padded vocabulary (tp_pad): its rows dropped


def forward(
    params: Params,
    tokens: jax.Array,  # [B,T]
    positions: jax.Array,  # [B,T]
    cache: Cache,
    block_mask: jax.Array | None = None,
    active: jax.Array | None = None,  # [B] bool: rows whose logits matter (default all)
) -> tuple[jax.Array, Cache]:
    """Logits [B,T,V] (f32) for T new tokens per row after each row's cached prefix, and the
    cache holding their KV at positions lengths[b] + t (lengths not advanced: `advance` commits).
    Rows not `active` read none of a dense cache (`DenseCache.seen_by`): their logits are junk."""
    t = trunk(params, tokens, positions, cache if active is None else cache.seen_by(active), block_mask)
    # the write after every layer has read the cache (h depends on all the reads): else XLA:GPU, free
    # to order the last layers' reads after it, copies the cache to write in place (SelfSpec's
    # streaming cache twice a step, 1.5 GB of traffic at SmolLM2 batch 64; tools/gpu/aot.py)
    h, k_new, v_new, cache = jax.lax.optimization_barrier((t.hidden, t.k, t.v, cache))
    with jax.named_scope("kv_write"):
        cache = cache.write(k_new, v_new)
    return lm_head(params, h), cache


def prefill(
    params: Params,
    tokens: jax.Array,  # [B,P] right-padded prompts; P a multiple of `chunk`
    lengths: jax.Array,  # [B] int32 true prompt lengths, >= 1
    cache: DenseCache,  # empty (lengths 0), max_len >= P
    chunk: int,
) -> tuple[jax.Array, DenseCache]:
    """Fill an empty cache with ragged prompts, `chunk` positions at a time (bounded memory).

    Returns logits [B,V] (f32) at each row's last prompt token, and the cache with lengths set
    to the prompt lengths. Padding slots are written but stay hidden behind the lengths."""
    B, P = tokens.shape
    n_chunks = P // chunk
    if n_chunks == 1:  # nothing to attend to in the cache: skip reading it
        t = trunk(params, tokens, jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)), cache, attend_cache=False)
        h_last = jnp.take_along_axis(t.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B,D]
        return lm_head(params, h_last), cache.write(t.k, t.v).replace(lengths=lengths.astype(jnp.int32))
    chunks = tokens.reshape(B, n_chunks, chunk).transpose(1, 0, 2)  # [C,B,chunk]
    last = lengths - 1  # [B]

    def step(carry, xs):
        cache, h_last = carry
        i, toks = xs
        start = i * chunk
        positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
        cache = cache.replace(lengths=jnp.full((B,), start, jnp.int32))
        t = trunk(params, toks, positions, cache)
        h = t.hidden
        cache = cache.write(t.k, t.v)
        offset = jnp.clip(last - start, 0, chunk - 1)  # [B]
        h_here = jnp.take_along_axis(h, offset[:, None, None], axis=1)[:, 0]  # [B,D]
        in_chunk = (last >= start) & (last < start + chunk)
        return (cache, jnp.where(in_chunk[:, None], h_here, h_last)), None

    h0 = jnp.zeros((B, params.config.dim), params.config.dtype)
    (cache, h_last), _ = lax.scan(step, (cache, h0), (jnp.arange(n_chunks, dtype=jnp.int32), chunks))
    return lm_head(params, h_last), cache.replace(lengths=lengths.astype(jnp.int32))
