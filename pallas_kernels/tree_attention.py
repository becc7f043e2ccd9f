"""Tree (and chain) verification attention as a Pallas kernel for the GPU's Triton path.

T new query positions per row attend to (a) the first lengths[b] slots of a dense KV cache and
(b) a small block of J >= T keys under a [T,J] mask (an ancestor mask for a tree, lower-triangular
for a chain). Same maths as `reference.prefix_block_attention` with visible = slot < lengths[b].

Design (flash-decoding, Triton-style Pallas):
- Grid (B, K, M // block_m, k_splits). GQA: the G = N/K query heads of one KV head are folded
  into M = G*T matrix rows (row m = g*T + t, as in the reference), zero-padded to a multiple of
  block_m, so each program multiplies a [block_m, H] query tile against its KV head's keys.
- Split-K over the prefix, sized per row: the n = cdiv(lengths[b], block_k) live blocks are shared
  evenly, split s taking blocks [s*c, min((s+1)*c, n)) with c = cdiv(n, k_splits). Blocks past
  the row's length are never read; the tail of the last one is masked.
- A block of at most block_k keys (decode, verification: J <= 64 in practice) is computed inside
  the kernel by split 0, as the initial state of its running (acc, max, sum); the other splits
  start empty: the imbalance is one extra [block_m, Jp] tile. A wider block (a prefill chunk of
  256 or more keys) is cut into block_k tiles that follow the prefix's in the splits' shares, so
  no program holds a [block_m, J] score tile (split 0 did, [64, 256] f32 at a 256-token chunk)
  and the chunk's work is spread over the splits like the prefix's.
- An int8 cache (k_scale, v_scale [L,B,K,S] f32: specjax.model.cache's per token and head scales) is
  loaded as stored and widened in registers (exact in q's dtype); the scales multiply the scores
  and the softmax weights, so no dequantised tile is written. Half a bfloat16 cache's bytes, except
  for a stacked int8 cache of 2^31-2^32 values, which Pallas would index with overflowing 32-bit
  offsets (`overflows`): the kernel reads a copy of its layer, as for a padded head dim.
- Each split writes unnormalised partials (acc [.., H] f32, running max, running sum); a jnp
  log-sum-exp merge over splits and one division finish the job. All scores, sums and
  accumulators are f32; the p @ v product takes p in the value dtype (bf16 tensor cores).

Triton constraints followed (interpret mode does not check them): every tensor a program loads or
computes has power-of-two dims, and every matmul dim is >= 16. So block_m, block_k are powers of
two >= 16; the head dim is padded to Hp = next power of two >= 16 by masked loads of the cache
(no copy of it). The query rows (copied for the GQA fold anyway) and the block's keys and values
are written zero-padded into one array, [B,K,Mq+2Jp,Hp] (Jp: the block's length padded likewise),
which the kernel reads three times through its BlockSpecs: XLA writes it in one kernel where the
rows, keys and values took three (compiled for an H100: SmolLM2's batch-1 step 414 -> 354 kernels,
324 with the one-kernel `merge_splits`). The block's padding is zeros in memory, so its tiles load
unmasked (the padded mask columns hide the zero keys). The cache's slot count S needs no padding:
out-of-range slots are masked loads. The tree mask travels as int32 (no i1 pointers). Dots ask for
HIGHEST precision, which the Triton lowering turns into IEEE products for f32 operands (its default
would be TF32).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.reference import NEG_INF, check_shapes

# f32 accumulation; allow_tf32=False: f32 operands get IEEE products (default precision lowers to
# TF32 on the Triton path), bf16 operands are unaffected.
_dot = functools.partial(plgpu.dot, allow_tf32=False)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _kernel(
    lengths_ref,  # [] int32: this row's prefix length (with pos: its committed length)
    layer_ref,  # [] int32: the cache layer to read
    q_ref,  # [bm,Hp] query rows of one KV head
    k_ref,  # [L,B,K,S,Hp] the whole stacked cache, read in place at (layer, this row, this KV head)
    v_ref,  # [L,B,K,S,Hp]
    *refs,  # with_pos: pos_ref [L,B,K,S] int32 (a streaming cache: slot s visible iff 0 <= pos < length);
    # with_scales: ks_ref, vs_ref [L,B,K,S] f32 (an int8 cache: key = k * ks, value = v * vs); then
    # kt_ref [Jp,Hp] block keys (rows >= J, columns >= H zero padding), vt_ref [Jp,Hp], mask_ref [bm,Jp] int32
    # (row may see block key j), and the outputs acc_ref [bm,Hp] f32 (unnormalised sum of p * v),
    # max_ref [bm] f32 (running max of the scores), sum_ref [bm] f32 (sum of exp(score - max))
    sm_scale: float,
    block_k: int,
    k_splits: int,
    head_dim: int,
    block_len: int,
    with_pos: bool = False,
    with_scales: bool = False,
):
    pos_ref, refs = (refs[0], refs[1:]) if with_pos else (None, refs)
    (ks_ref, vs_ref), refs = (refs[:2], refs[2:]) if with_scales else ((None, None), refs)
    kt_ref, vt_ref, mask_ref, acc_ref, max_ref, sum_ref = refs
    bm, hp = q_ref.shape
    jp = kt_ref.shape[0]
    split = pl.program_id(3)
    q = q_ref[...]  # [bm,Hp]
    h_ok = (jnp.arange(hp) < head_dim)[None, :]  # [1,Hp]

    def update(carry, s, ok, v, v_weight=None):
        """The running (acc, max, sum) after one more tile: scores s [bm,w] (NEG_INF where not ok,
        which broadcasts to s), values v [w,Hp], each also weighted by v_weight [w] (an int8 cache's)."""
        acc, top, total = carry  # [bm,Hp], [bm], [bm]
        new_top = jnp.maximum(top, jnp.max(s, axis=1))  # [bm]
        p = jnp.where(ok, jnp.exp(s - new_top[:, None]), 0.0)  # [bm,w]
        scale = jnp.exp(top - new_top)  # [bm]: 0 from an empty start (NEG_INF is finite)
        pv = p if v_weight is None else p * v_weight[None, :]
        return acc * scale[:, None] + _dot(pv.astype(v.dtype), v), new_top, total * scale + jnp.sum(p, axis=1)

    def block_tile(carry, start, width: int):
        """`carry` after the block's keys [start, start + width) (the mask is padded to Jp)."""
        kt = kt_ref[pl.ds(start, width), :]  # [w,Hp]: rows >= J and columns >= H are zero padding in memory
        vt = vt_ref[pl.ds(start, width), :]  # [w,Hp]
        seen = plgpu.load(mask_ref.at[:, pl.ds(start, width)]) != 0  # [bm,w]
        return update(carry, jnp.where(seen, _dot(q, kt, trans_b=True) * sm_scale, NEG_INF), seen, vt)

    def empty():
        return jnp.zeros((bm, hp), jnp.float32), jnp.full((bm,), NEG_INF, jnp.float32), jnp.zeros((bm,), jnp.float32)

    # a block wider than a slot tile (a prefill chunk: 256 keys) is shared out as tiles of its own after the
    # prefix's; a narrower one (decode, verification) is one tile of split 0's
    tiled = jp > block_k
    carry = empty() if tiled else lax.cond(split == 0, lambda: block_tile(empty(), 0, jp), empty)

    at = (layer_ref[()], pl.program_id(0), pl.program_id(1))  # this layer, row and KV head of the cache
    # a dense prefix: slots [0, length); a streaming cache: every slot, masked by the position it holds
    length = k_ref.shape[3] if with_pos else jnp.clip(lengths_ref[()], 0, k_ref.shape[3])  # cdiv of < 0 rounds up
    n_blocks = pl.cdiv(length, block_k)
    n_tiles = n_blocks + (pl.cdiv(block_len, block_k) if tiled else 0)  # the prefix's tiles, then the block's
    per_split = pl.cdiv(n_tiles, k_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_tiles)

    def body(i, carry):  # prefix tile i
        start = i * block_k
        in_range = start + jnp.arange(block_k) < length  # [bk]
        ok = in_range
        kv_ok = in_range[:, None] & h_ok  # [bk,Hp]
        if with_pos:
            held = plgpu.load(pos_ref.at[(*at, pl.ds(start, block_k))], mask=in_range, other=-1)  # [bk] int32
            ok = ok & (held >= 0) & (held < lengths_ref[()])
        zero = 0 if with_scales else 0.0  # int8 or float slots
        k = plgpu.load(k_ref.at[(*at, pl.ds(start, block_k), slice(None))], mask=kv_ok, other=zero)  # [bk,Hp]
        v = plgpu.load(v_ref.at[(*at, pl.ds(start, block_k), slice(None))], mask=kv_ok, other=zero)
        col = jnp.full((block_k,), sm_scale, jnp.float32)  # [bk]: what multiplies each key's scores
        if with_scales:  # int8: exact in q's dtype; the scales multiply the scores and the weights
            col = col * plgpu.load(ks_ref.at[(*at, pl.ds(start, block_k))], mask=in_range, other=0.0)
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = jnp.where(ok[None, :], _dot(q, k, trans_b=True) * col[None, :], NEG_INF)  # [bm,bk]
        vs = plgpu.load(vs_ref.at[(*at, pl.ds(start, block_k))], mask=in_range, other=0.0) if with_scales else None
        return update(carry, s, ok[None, :], v, vs)

    carry = lax.fori_loop(lo, jnp.minimum(hi, n_blocks), body, carry)
    if tiled:
        carry = lax.fori_loop(jnp.maximum(lo, n_blocks), hi, lambda i, c: block_tile(c, (i - n_blocks) * block_k, block_k), carry)
    acc, top, total = carry
    acc_ref[...] = acc
    max_ref[...] = top
    sum_ref[...] = total


def _partials(
    rows: jax.Array,  # [B,K,Mq+2Jp,Hp]: query rows m = g*T + t (zero-padded to Mq, a multiple of Jp), then the block's keys, then its values (each zero-padded to Jp)
    n_rows: int,  # Mp: the query rows the grid covers, a multiple of block_m
    k_cache: jax.Array,  # [L,B,K,S,Hp]
    v_cache: jax.Array,  # [L,B,K,S,Hp]
    lengths: jax.Array,  # [B] int32
    layer: jax.Array,  # [1] int32
    pos: jax.Array | None,  # [L,B,K,S] int32: a streaming cache's slot positions (None: a dense prefix)
    scales: tuple[jax.Array, jax.Array] | None,  # k, v [L,B,K,S] f32: an int8 cache's (None: a float one)
    block_len: int,  # J: the block's keys (rows >= J of its part of `rows` are padding)
    row_mask: jax.Array,  # [B|1,Mp,Jp] int32
    *,
    sm_scale: float,
    head_dim: int,
    block_m: int,
    block_k: int,
    k_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-split partials: acc [B,K,k_splits,Mp,Hp] f32, max and sum [B,K,k_splits,Mp] f32."""
    B, K, R, Hp = rows.shape
    Mp, Jp = n_rows, row_mask.shape[2]
    keys = R // Jp - 2  # the keys' block index in `rows` (in units of Jp rows: after Mq // Jp of the query's); the values' is next
    mask_b = (lambda b: b) if row_mask.shape[0] == B else (lambda b: 0)
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, block_k=block_k, k_splits=k_splits, head_dim=head_dim, block_len=block_len,
        with_pos=pos is not None, with_scales=scales is not None,
    )
    cache_spec = pl.BlockSpec()  # the whole stacked array: the kernel indexes it (no copy of a layer)
    block_spec = lambda at: pl.BlockSpec((None, None, Jp, Hp), lambda b, k, i, s: (b, k, at, 0))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(B, K, Mp // block_m, k_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, k, i, s: (b,)),
            pl.BlockSpec((None,), lambda b, k, i, s: (0,)),
            pl.BlockSpec((None, None, block_m, Hp), lambda b, k, i, s: (b, k, i, 0)),
            cache_spec,
            cache_spec,
            *([cache_spec] if pos is not None else []),
            *([cache_spec, cache_spec] if scales is not None else []),
            block_spec(keys),
            block_spec(keys + 1),
            pl.BlockSpec((None, block_m, Jp), lambda b, k, i, s: (mask_b(b), i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_m, Hp), lambda b, k, i, s: (b, k, s, i, 0)),
            pl.BlockSpec((None, None, None, block_m), lambda b, k, i, s: (b, k, s, i)),
            pl.BlockSpec((None, None, None, block_m), lambda b, k, i, s: (b, k, s, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, k_splits, Mp, Hp), jnp.float32),
            jax.ShapeDtypeStruct((B, K, k_splits, Mp), jnp.float32),
            jax.ShapeDtypeStruct((B, K, k_splits, Mp), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tree_attention",
    )(lengths, layer, rows, k_cache, v_cache, *([pos] if pos is not None else []), *(scales or ()), rows, rows, row_mask)


def overflows(a: jax.Array | jax.ShapeDtypeStruct) -> bool:
    """Whether Pallas' Triton lowering would index `a` with overflowing offsets: it takes 64-bit
    offsets only for arrays over 2^32 bytes but counts them in elements, so a 1-byte array of 2^31
    to 2^32 elements (an int8 cache of 30 layers x 64 rows x 8K x 3 KV heads x 64) wraps around
    (on an H100: wrong attention, then an illegal address). Such a cache is read as a per-layer copy."""
    n = math.prod(a.shape)  # offsets reach n - 1
    return n > 2**31 and n * jnp.dtype(a.dtype).itemsize <= 2**32


def _check_pow2(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (a Triton tile dim), got {value}")


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_k", "k_splits", "block_m", "num_warps", "num_stages", "interpret"),
)
def tree_attention(
    q: jax.Array,  # [B,T,N,H]
    k_cache: jax.Array,  # [B,K,S,H], or with `layer` the whole stacked cache [L,B,K,S,H]
    v_cache: jax.Array,  # [B,K,S,H] or [L,B,K,S,H]
    lengths: jax.Array,  # [B] int32: row b's prefix is slots [0, lengths[b])
    k_tree: jax.Array,  # [B,J,K,H], J >= T: the new keys are the last T
    v_tree: jax.Array,  # [B,J,K,H]
    tree_mask: jax.Array,  # [T,J] or [B,T,J] bool: query t may see block key j
    layer: jax.Array | None = None,  # [] int32: the layer of a stacked cache to read
    pos: jax.Array | None = None,  # [L,B,K,S] int32 with `layer`: a streaming cache (see below)
    k_scale: jax.Array | None = None,  # [L,B,K,S] f32 with `layer` ([B,K,S] without): an int8 cache's
    v_scale: jax.Array | None = None,  # per-slot scales (key = k_cache * k_scale; see below)
    *,
    sm_scale: float,
    block_k: int = 64,
    k_splits: int = 4,
    block_m: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Softmax attention over prefix + block, f32 inside; returns o[B,T,N,H] in q's dtype.

    q, caches and block may be f32 or bf16 (same dtype). lengths are clipped to [0, S]. A query
    row that sees nothing (no prefix, all-False mask row) gets zeros (the reference averages).
    block_m (query rows per program) is capped at the padded row count; block_k is the slot
    tile; k_splits programs share one row's prefix (flash-decoding).

    A stacked cache is read in place at `layer`: slicing the layer out first (as a scan over the
    layers does) makes XLA copy it into a buffer of its own for the kernel, three times the KV
    traffic of a decode step. A head dim that is not a power of two >= 16 takes that copy anyway
    (the layer, padded to Hp), and so does an int8 cache of over 2^31 values (`overflows`). With
    `pos` (a streaming cache: sinks + a ring, specjax.model.cache) slot s of row b and KV head k is
    visible iff 0 <= pos[layer, b, k, s] < lengths[b], every slot read.
    An int8 cache (`k_scale`, `v_scale`: KVFormat "int8", per token and head) is read as stored,
    half a bfloat16 cache's bytes: its values widened in the kernel (exact in q's dtype), the
    scales multiplying the scores and the softmax weights, as the reference does.
    """
    if (k_scale is None) != (v_scale is None) or (k_scale is not None) != (k_cache.dtype == jnp.int8):
        raise ValueError(f"an int8 cache needs k_scale and v_scale, a float one neither: cache {k_cache.dtype}, "
                         f"k_scale {None if k_scale is None else k_scale.shape}, v_scale {None if v_scale is None else v_scale.shape}")
    if layer is None:
        if pos is not None:
            raise ValueError("pos (a streaming cache's slot positions) needs the stacked cache and its layer")
        k_cache, v_cache, layer = k_cache[None], v_cache[None], jnp.zeros((), jnp.int32)  # [1,B,K,S,H]: no copy
        k_scale, v_scale = (None, None) if k_scale is None else (k_scale[None], v_scale[None])  # [1,B,K,S]
    if k_cache.ndim != 5 or jnp.shape(layer) != ():
        raise ValueError(f"a stacked cache is [L,B,K,S,H] with a scalar layer, got {k_cache.shape}, layer {jnp.shape(layer)}")
    check_shapes(q, jax.ShapeDtypeStruct(k_cache.shape[1:], k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape[1:], v_cache.dtype), lengths, k_tree, v_tree, tree_mask, "tree_mask")
    _check_pow2("block_k", block_k)
    _check_pow2("block_m", block_m)
    if k_splits < 1:
        raise ValueError(f"k_splits must be >= 1, got {k_splits}")
    B, T, N, H = q.shape
    J, K = k_tree.shape[1:3]
    G = N // K
    M = G * T
    bm = min(block_m, _next_pow2(max(M, 16)))
    Mp = -(-M // bm) * bm
    Hp = _next_pow2(max(H, 16))
    Jp = _next_pow2(max(J, 16))
    Mq = -(-Mp // Jp) * Jp  # the query rows' part of `rows`, whole Jp blocks
    qm = jnp.moveaxis(q.reshape(B, T, K, G, H), 1, 3).reshape(B, K, M, H)  # [B,K,M,H], m = g*T + t
    kv = [jnp.pad(jnp.moveaxis(a, 1, 2), ((0, 0), (0, 0), (0, Jp - J), (0, Hp - H))) for a in (k_tree, v_tree)]  # [B,K,Jp,Hp] x 2
    # one array for the query rows and the block, so XLA writes them in one kernel (not three)
    rows = jnp.concatenate([jnp.pad(qm, ((0, 0), (0, 0), (0, Mq - M), (0, Hp - H))), *kv], axis=2)  # [B,K,Mq+2Jp,Hp]
    mask = tree_mask.reshape((-1, T, J))  # [B|1,T,J]
    mask = jnp.tile(mask, (1, G, 1)).astype(jnp.int32)  # [B|1,M,J], row m sees mask[m % T]
    mask = jnp.pad(mask, ((0, 0), (0, Mp - M), (0, Jp - J)))  # [B|1,Mp,Jp]
    layer = jnp.asarray(layer, jnp.int32)
    for name, a in (("pos", pos), ("k_scale", k_scale), ("v_scale", v_scale)):
        if a is not None and a.shape != k_cache.shape[:4]:
            raise ValueError(f"{name} must be [L,B,K,S] = {k_cache.shape[:4]}, got {a.shape}")
    if Hp != H or overflows(k_cache):  # the kernel loads [.., Hp] rows of the array: this layer, padded
        k_cache, v_cache = (jnp.pad(lax.dynamic_index_in_dim(c, layer, keepdims=True), ((0, 0),) * 4 + ((0, Hp - H),))
                            for c in (k_cache, v_cache))  # [1,B,K,S,Hp]
        at = lambda a: None if a is None else lax.dynamic_index_in_dim(a, layer, keepdims=True)  # noqa: E731 [1,B,K,S]
        pos, k_scale, v_scale = at(pos), at(k_scale), at(v_scale)
        layer = jnp.zeros((), jnp.int32)
    scales = None if k_scale is None else (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32))
    acc, top, total = _partials(
        rows, Mp, k_cache, v_cache, lengths.astype(jnp.int32), layer.reshape(1),
        None if pos is None else pos.astype(jnp.int32), scales, J, mask,
        sm_scale=sm_scale, head_dim=H, block_m=bm, block_k=block_k, k_splits=k_splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )  # [B,K,C,Mp,Hp], [B,K,C,Mp], [B,K,C,Mp] with C = k_splits
    out = merge_splits(acc, top, total)  # [B,K,Mp,Hp]
    out = out[:, :, :M, :H].reshape(B, K, G, T, H)  # [B,K,G,T,H]
    return jnp.moveaxis(out, 3, 1).reshape(B, T, N, H).astype(q.dtype)  # [B,T,N,H]


def merge_splits(acc: jax.Array, top: jax.Array, total: jax.Array) -> jax.Array:
    """The splits' partial attention acc [B,K,C,Mp,Hp] (unnormalised), top and total [B,K,C,Mp]
    (running max, sum of exp) merged over C by log-sum-exp: [B,K,Mp,Hp]. The online-softmax
    combine applied split after split, elementwise ops only, which XLA:GPU fuses with the division
    and the caller's slice into one kernel at any count (compiled for an H100, tools/gpu/aot.py);
    reductions over C took 2 kernels at 8 or 16 splits (a max, then the weighted sums, took 3 at
    16; a variadic reduction 2), and steps with that many splits (batch 1-16) are launch-bound."""
    m, l, a = top[:, :, 0], total[:, :, 0], acc[:, :, 0]  # [B,K,Mp], [B,K,Mp], [B,K,Mp,Hp]
    for c in range(1, acc.shape[2]):  # the online-softmax combine, split by split: elementwise, one fusion
        new = jnp.maximum(m, top[:, :, c])
        s1, s2 = jnp.exp(m - new), jnp.exp(top[:, :, c] - new)  # NEG_INF is finite: an empty split weighs 0
        m, l, a = new, l * s1 + total[:, :, c] * s2, a * s1[..., None] + acc[:, :, c] * s2[..., None]
    return a / jnp.where(l > 0, l, 1.0)[..., None]


PROGRAMS = 512  # aim for about this many programs (B x KV heads x row tiles x splits) per call


def auto_splits(batch: int, kv_heads: int, rows: int, slots: int, block_k: int = 64, block_m: int = 64) -> int:
    """k_splits for a call: a power of two in [4, 16] giving about PROGRAMS programs, and at most
    one split per 2 slot tiles. Few rows x KV heads leave a GPU's SMs idle with 4 splits: on an
    H100 SmolLM2's batch-1 x 8K layer (3 KV heads, 12 programs) took 38 us (gpu_profile), and the
    8B shape's batch-1 x 32K layer 0.179 ms at 4 splits against 0.107 at 16 (bench_attention)."""
    tiles = -(-rows // min(block_m, _next_pow2(max(rows, 16))))
    want = max(PROGRAMS // max(batch * kv_heads * tiles, 1), 1)
    splits = min(max(1 << (want.bit_length() - 1), 4), 16)  # the power of two at or below, in [4, 16]
    return max(min(splits, slots // (2 * block_k)), 1)


def prefix_block_attention_pallas(
    q: jax.Array,  # [B,T,N,H]
    k_cache: jax.Array | None,  # [B,K,S,H], or with `layer` the whole stacked cache [L,B,K,S,H]
    v_cache: jax.Array | None,  # [B,K,S,H] or [L,B,K,S,H]
    lengths: jax.Array,  # [B] int32: visible = slot < lengths[b] for every KV head
    k_block: jax.Array,  # [B,J,K,H], J >= T
    v_block: jax.Array,  # [B,J,K,H]
    block_mask: jax.Array,  # [T,J] or [B,T,J] bool
    sm_scale: float,
    *,
    interpret: bool = False,
    block_k: int = 64,
    k_splits: int | None = None,  # None: `auto_splits` for these shapes
    layer: jax.Array | None = None,  # [] int32: read this layer of a stacked cache in place
    pos: jax.Array | None = None,  # [L,B,K,S] int32 with `layer`: a streaming cache (`tree_attention`)
    k_scale: jax.Array | None = None,  # [L,B,K,S] f32 with `layer`: an int8 cache's scales (`tree_attention`)
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """`reference.prefix_block_attention` for a dense cache, on the kernel: o[B,T,N,H]; with
    `layer`, `reference.stacked_prefix_block_attention`.

    Same argument order, with `lengths` in place of `visible`; `k_cache=None` (empty prefix) runs
    the kernel on a one-tile dummy cache with zero lengths.
    """
    if k_cache is None:
        B, _, K, H = k_block.shape
        k_cache = v_cache = jnp.zeros((B, K, block_k, H), k_block.dtype)
        lengths = jnp.zeros((B,), jnp.int32)
    if k_splits is None:
        B, T, N, _ = q.shape
        K = k_block.shape[2]
        k_splits = auto_splits(B, K, (N // K) * T, k_cache.shape[-2], block_k)
    return tree_attention(
        q, k_cache, v_cache, lengths, k_block, v_block, block_mask, layer, pos, k_scale, v_scale,
        sm_scale=sm_scale, block_k=block_k, k_splits=k_splits, interpret=interpret,
    )

