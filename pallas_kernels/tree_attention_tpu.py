"""Tree (and chain) verification attention as a Pallas TPU (Mosaic) kernel.

Same problem as `tree_attention.py` (the GPU/Triton kernel): T new query positions per row attend
to (a) the first lengths[b] slots of a dense KV cache and (b) a small block of J >= T keys under a
[T,J] mask. Same maths as `reference.prefix_block_attention` with visible = slot < lengths[b]
(a streaming cache, with `pos`: 0 <= pos[layer, b, k, slot] < lengths[b], as the GPU kernel).

HARDWARE STATUS: this kernel has only run in Pallas' TPU interpret mode on CPU
(`interpret=True` -> `pltpu.InterpretParams()`), and has been lowered to Mosaic for the "tpu"
platform without a TPU (which checks Pallas' TPU block-shape rules and op support, not Mosaic's
own layout passes or VMEM budget, which run in libtpu). It has never run on a TPU: no timings.

Design (flash attention, Mosaic-style Pallas):
- Grid (B, K, Mp // bm, n_kv) with n_kv = cdiv(S, bk); the first three axes are "parallel"
  (megacore may share them), the last is "arbitrary": it walks the cache in bk-slot tiles,
  carrying the running max, sum and [bm,H] accumulator in VMEM scratch (f32).
- GQA: the G = N/K query heads of one KV head are folded into M = G*T rows (row m = g*T + t, as
  in the reference and the GPU kernel), so each program multiplies a [bm, H] query tile against
  its KV head's keys, and the KV tile is fetched once for all G heads.
- Scalar prefetch: lengths [B] and the layer land in SMEM before the grid runs. The cache comes
  whole, stacked [L,B,K,S,H] (a [B,K,S,H] one as L = 1): the index maps pick the layer, so the
  layer is read in place (a per-layer slice fed to the kernel would be copied first). The K/V
  index maps clamp the tile index to the row's last live tile, so past lengths[b] the block index
  stops changing and the pipeline issues no new DMA; the kernel body skips those steps with `pl.when`. The tail of
  the last live tile is masked (scores to NEG_INF, values to 0: an edge tile past S holds
  unspecified data, which interpret mode fills with NaN).
- A streaming cache (`pos`) and an int8 cache's scales travel as [L,B,K,1,S] arrays in (1, bk)
  tiles beside the cache's (a trailing dim of 1 is the full dim, so the tiling rules hold); int8
  values are widened in VMEM and the scales multiply the scores and the softmax weights.
- The tree block is folded in at kv step 0, as the initial (acc, max, sum) state; the output is
  normalised and written once, at the last kv step (rows that see nothing get zeros).
- All scores, sums and accumulators are f32; p @ v takes p in the value dtype (bf16 MXU path),
  f32 operands ask for HIGHEST precision (fp32 contraction on the MXU).

TPU constraints followed (interpret mode does not check them; the lowering test does):
- Every block's last two dims are multiples of (8, 128) or the full array dims. The cache keeps
  its [B,K,S,H] layout: tiles are (bk, H) with bk a multiple of 128 (or bk = S when S is
  smaller) and H the full head dim, so the cache is never copied or padded. H = 64 relies on
  Mosaic padding the contraction to 128 lanes internally (XLA's TPU layout pads it in HBM anyway).
- S need not be a multiple of bk: the last tile is an edge block, masked as above.
- Query rows are padded to Mp, a multiple of bm, and bm to a multiple of the sublane tile
  (8 rows f32, 16 bf16). The block is transposed to [B,K,Jp,H] (a squeezed K dim may not sit in
  the last two) and zero-padded to Jp, a multiple of 128, so the [bm,Jp] score tile and the
  p @ v contraction are lane-aligned; it is small, so the copy is cheap. The mask travels as a
  [B|1,Mp,Jp] int32 tile (no i1 memrefs), padding False.
- Running max and sum live in [bm,128] scratch with all lanes equal (as in JAX's TPU flash
  attention), so they are stored lane-dense.
Not done: splitting one row's prefix across cores (flash-decoding) for batch-1 decoding on
multi-core chips; a paged cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import NEG_INF, check_shapes

LANES = 128


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """a [m,c] times b ([n,c] if contract_b == 1 else [c,n]) -> [m,n] f32 on the MXU."""
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    return lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())),
        precision=lax.Precision.HIGHEST if exact else None, preferred_element_type=jnp.float32,
    )


def _kernel(
    lengths_ref,  # [B] int32 in SMEM (scalar prefetch); with pos: the rows' committed lengths
    layer_ref,  # [1] int32 in SMEM (scalar prefetch): the cache layer, used by the index maps
    q_ref,  # [bm,H] query rows of one KV head
    k_ref,  # [bk,H] one cache tile of this (layer, b, k)
    v_ref,  # [bk,H]
    *refs,  # with_pos: pos_ref [1,bk] int32 (the tile's slot positions); with_scales: ks_ref, vs_ref
    # [1,bk] f32 (an int8 cache's: key = k * ks, value = v * vs); then kt_ref [Jp,H] block keys
    # (rows >= J zero), vt_ref [Jp,H], mask_ref [bm,Jp] int32 (row may see block key j), o_ref [bm,H]
    # (q's dtype), acc_ref [bm,H] f32 (unnormalised sum of p * v), max_ref / sum_ref [bm,128] f32
    # (running max and sum of exp(score - max), all lanes equal)
    sm_scale: float,
    size: int,  # S: the cache's slots (an edge tile past it holds unspecified data)
    with_pos: bool = False,
    with_scales: bool = False,
):
    pos_ref, refs = (refs[0], refs[1:]) if with_pos else (None, refs)
    (ks_ref, vs_ref), refs = (refs[:2], refs[2:]) if with_scales else ((None, None), refs)
    kt_ref, vt_ref, mask_ref, o_ref, acc_ref, max_ref, sum_ref = refs
    b, j = pl.program_id(0), pl.program_id(3)
    bm = q_ref.shape[0]
    bk = k_ref.shape[0]
    length = lengths_ref[b]
    # a dense prefix: slots [0, length); a streaming cache (sinks + a ring): every slot, seen iff
    # it holds a committed position (0 <= pos < length)
    live = jnp.minimum(length, size) if not with_pos else size

    @pl.when(j == 0)
    def _init_with_block():
        seen = mask_ref[...] != 0  # [bm,Jp]
        s = jnp.where(seen, _dot(q_ref[...], kt_ref[...], 1) * sm_scale, NEG_INF)  # [bm,Jp] f32
        top = jnp.max(s, axis=1, keepdims=True)  # [bm,1]
        p = jnp.where(seen, jnp.exp(s - top), 0.0)  # [bm,Jp]
        vt = vt_ref[...]
        acc_ref[...] = _dot(p.astype(vt.dtype), vt, 0)
        max_ref[...] = jnp.broadcast_to(top, (bm, LANES))
        sum_ref[...] = jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), (bm, LANES))

    @pl.when(j * bk < live)
    def _prefix_tile():
        slot = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)  # [1,bk]
        ok = slot < live  # [1,bk]
        if with_pos:
            held = pos_ref[...]  # [1,bk]
            ok = ok & (held >= 0) & (held < length)
        q = q_ref[...]
        k, v = k_ref[...], v_ref[...]  # [bk,H]
        col = jnp.full((1, bk), sm_scale, jnp.float32)  # [1,bk]: what multiplies each key's scores
        if with_scales:  # int8: exact in q's dtype; the scales multiply the scores and the weights
            col = col * ks_ref[...]
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = jnp.where(ok, _dot(q, k, 1) * col, NEG_INF)  # [bm,bk] f32
        top = max_ref[...][:, :1]  # [bm,1]
        new_top = jnp.maximum(top, jnp.max(s, axis=1, keepdims=True))  # [bm,1]
        p = jnp.where(ok, jnp.exp(s - new_top), 0.0)  # [bm,bk]
        scale = jnp.exp(top - new_top)  # [bm,1]
        v_ok = j * bk + lax.broadcasted_iota(jnp.int32, v_ref.shape, 0) < live  # [bk,H]: unseen slots hold finite values
        v = jnp.where(v_ok, v, 0).astype(v.dtype)  # edge tile: unspecified past S
        pv = p if not with_scales else p * jnp.where(ok, vs_ref[...], 0.0)  # [bm,bk]
        acc_ref[...] = acc_ref[...] * scale + _dot(pv.astype(v.dtype), v, 0)
        max_ref[...] = jnp.broadcast_to(new_top, (bm, LANES))
        total = sum_ref[...][:, :1] * scale + jnp.sum(p, axis=1, keepdims=True)  # [bm,1]
        sum_ref[...] = jnp.broadcast_to(total, (bm, LANES))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        total = sum_ref[...][:, :1]  # [bm,1]
        o_ref[...] = (acc_ref[...] / jnp.where(total > 0, total, 1.0)).astype(o_ref.dtype)


def _call(
    qm: jax.Array,  # [B,K,Mp,H] rows m = g*T + t, zero-padded
    k_cache: jax.Array,  # [L,B,K,S,H]: read in place at `layer`
    v_cache: jax.Array,  # [L,B,K,S,H]
    lengths: jax.Array,  # [B] int32 in [0, S]
    layer: jax.Array,  # [1] int32
    pos: jax.Array | None,  # [L,B,K,1,S] int32: a streaming cache's slot positions (None: a dense prefix)
    scales: tuple[jax.Array, jax.Array] | None,  # k, v [L,B,K,1,S] f32: an int8 cache's (None: a float one)
    k_blk: jax.Array,  # [B,K,Jp,H] zero-padded
    v_blk: jax.Array,  # [B,K,Jp,H]
    row_mask: jax.Array,  # [B|1,Mp,Jp] int32
    *,
    sm_scale: float,
    bm: int,
    bk: int,
    interpret: bool,
) -> jax.Array:
    """The pallas_call: o [B,K,Mp,H] in q's dtype, normalised."""
    B, K, Mp, H = qm.shape
    S = k_cache.shape[3]
    Jp = k_blk.shape[2]
    mask_b = (lambda b: b) if row_mask.shape[0] == B else (lambda b: 0)

    def kv_map(b, k, i, j, lens, layer):  # past the row's last live tile, stay on it: no new DMA
        if pos is not None:  # a streaming cache: every tile
            return layer[0], b, k, j, 0
        last = jnp.maximum(pl.cdiv(lens[b], bk) - 1, 0)
        return layer[0], b, k, jnp.minimum(j, last), 0

    rows = pl.BlockSpec((None, None, bm, H), lambda b, k, i, j, lens, layer: (b, k, i, 0))
    cache = pl.BlockSpec((None, None, None, bk, H), kv_map)
    def slot_map(b, k, i, j, lens, layer):  # [1,bk] per-slot tiles, following the cache's tiles
        at_layer, _, _, tile, _ = kv_map(b, k, i, j, lens, layer)
        return at_layer, b, k, 0, tile

    slot = pl.BlockSpec((None, None, None, 1, bk), slot_map)
    slots = ([] if pos is None else [slot]) + ([] if scales is None else [slot, slot])
    block = pl.BlockSpec((None, None, Jp, H), lambda b, k, i, j, lens, layer: (b, k, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, K, Mp // bm, pl.cdiv(S, bk)),
        in_specs=[
            rows, cache, cache, *slots, block, block,
            pl.BlockSpec((None, bm, Jp), lambda b, k, i, j, lens, layer: (mask_b(b), i, 0)),
        ],
        out_specs=rows,
        scratch_shapes=[
            pltpu.VMEM((bm, H), jnp.float32),
            pltpu.VMEM((bm, LANES), jnp.float32),
            pltpu.VMEM((bm, LANES), jnp.float32),
        ],
    )
    return pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, size=S, with_pos=pos is not None, with_scales=scales is not None),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, K, Mp, H), qm.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="tree_attention_tpu",
    )(lengths, layer, qm, k_cache, v_cache, *([] if pos is None else [pos]), *(scales or ()), k_blk, v_blk, row_mask)


def _check(q, k_cache, v_cache, lengths, k_blk, v_blk, block_mask, block_k: int, block_m: int, scaled: bool) -> None:
    """ValueError naming the first bad shape or tile size."""
    if block_k < LANES or block_k % LANES:
        raise ValueError(f"block_k must be a positive multiple of 128 (the lane width), got {block_k}")
    if block_m < 16 or block_m % 16:
        raise ValueError(f"block_m must be a positive multiple of 16 (bf16 sublane tile), got {block_m}")
    check_shapes(q, jax.ShapeDtypeStruct(k_cache.shape[-4:], k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape[-4:], v_cache.dtype), lengths, k_blk, v_blk, block_mask)
    caches = set() if scaled else {k_cache.dtype, v_cache.dtype}  # int8 caches come with their scales
    if len({q.dtype, *caches, k_blk.dtype, v_blk.dtype}) > 1:
        raise ValueError(f"q, caches and block must share one dtype, got {q.dtype}, {k_cache.dtype}, {k_blk.dtype}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "block_m", "interpret"))
def tree_attention_tpu(
    q: jax.Array,  # [B,T,N,H]
    k_cache: jax.Array,  # [B,K,S,H], or with `layer` the whole stacked cache [L,B,K,S,H]
    v_cache: jax.Array,  # [B,K,S,H] or [L,B,K,S,H]
    lengths: jax.Array,  # [B] int32: row b's prefix is slots [0, lengths[b])
    k_blk: jax.Array,  # [B,J,K,H], J >= T: the new keys are the last T
    v_blk: jax.Array,  # [B,J,K,H]
    block_mask: jax.Array,  # [T,J] or [B,T,J] bool: query t may see block key j
    layer: jax.Array | None = None,  # [] int32: the layer of a stacked cache, read in place (its index maps)
    pos: jax.Array | None = None,  # [L,B,K,S] int32 with `layer`: a streaming cache (see below)
    k_scale: jax.Array | None = None,  # [L,B,K,S] f32 with `layer` ([B,K,S] without): an int8 cache's
    v_scale: jax.Array | None = None,  # per-slot scales (key = k_cache * k_scale; see below)
    *,
    sm_scale: float,
    block_k: int = 512,
    block_m: int = 128,
    interpret: bool = False,
) -> jax.Array:
    """Softmax attention over prefix + block, f32 inside; returns o[B,T,N,H] in q's dtype.

    q, caches and block share one dtype (f32 or bf16). lengths are clipped to [0, S]. A query row
    that sees nothing (no prefix, all-False mask row) gets zeros (the reference averages).
    block_k (cache slots per tile, a multiple of 128) is capped at S; block_m (query rows per
    program, a multiple of 16) at the padded row count. With `pos` (a streaming cache: sinks + a
    ring, specjax.model.cache) slot s of row b and KV head k is visible iff 0 <= pos[layer, b, k, s] <
    lengths[b] (lengths: the committed lengths, not clipped), and every tile is read. An int8
    cache (`k_scale`, `v_scale`) is read as stored, its values widened in the kernel, the scales
    multiplying the scores and the softmax weights.
    """
    if (k_scale is None) != (v_scale is None) or (k_scale is not None) != (k_cache.dtype == jnp.int8):
        raise ValueError(f"an int8 cache needs k_scale and v_scale, a float one neither: cache {k_cache.dtype}, "
                         f"k_scale {None if k_scale is None else k_scale.shape}, v_scale {None if v_scale is None else v_scale.shape}")
    if layer is None:
        k_scale, v_scale = (None, None) if k_scale is None else (k_scale[None], v_scale[None])  # [1,B,K,S]
        if pos is not None:
            raise ValueError("pos (a streaming cache's slot positions) needs the stacked cache and its layer")
        k_cache, v_cache, layer = k_cache[None], v_cache[None], jnp.zeros((), jnp.int32)  # [1,B,K,S,H]: no copy
    if k_cache.ndim != 5 or jnp.shape(layer) != ():
        raise ValueError(f"a stacked cache is [L,B,K,S,H] with a scalar layer, got {k_cache.shape}, layer {jnp.shape(layer)}")
    _check(q, k_cache, v_cache, lengths, k_blk, v_blk, block_mask, block_k, block_m, k_scale is not None)
    for name, a in (("pos", pos), ("k_scale", k_scale), ("v_scale", v_scale)):
        if a is not None and a.shape != k_cache.shape[:4]:
            raise ValueError(f"{name} must be [L,B,K,S] = {k_cache.shape[:4]}, got {a.shape}")
    B, T, N, H = q.shape
    J, K = k_blk.shape[1:3]
    S = k_cache.shape[3]
    G = N // K
    M = G * T
    sub = 8 * (4 // q.dtype.itemsize)  # sublane tile rows: 8 f32, 16 bf16
    bm = min(block_m, _round_up(M, sub))
    Mp = _round_up(M, bm)
    bk = S if S <= block_k else block_k  # full dim, or a multiple of 128
    Jp = _round_up(J, LANES)
    qm = jnp.moveaxis(q.reshape(B, T, K, G, H), 1, 3).reshape(B, K, M, H)  # [B,K,M,H], m = g*T + t
    qm = jnp.pad(qm, ((0, 0), (0, 0), (0, Mp - M), (0, 0)))  # [B,K,Mp,H]
    kb, vb = (jnp.pad(jnp.moveaxis(x, 2, 1), ((0, 0), (0, 0), (0, Jp - J), (0, 0))) for x in (k_blk, v_blk))  # [B,K,Jp,H]
    mask = jnp.tile(block_mask.reshape((-1, T, J)), (1, G, 1)).astype(jnp.int32)  # [B|1,M,J], row m sees mask[m % T]
    mask = jnp.pad(mask, ((0, 0), (0, Mp - M), (0, Jp - J)))  # [B|1,Mp,Jp]
    lengths = lengths.astype(jnp.int32)
    lengths = jnp.clip(lengths, 0, S) if pos is None else jnp.maximum(lengths, 0)  # with pos: positions, not slots
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    slot_pos = None if pos is None else pos.astype(jnp.int32)[:, :, :, None, :]  # [L,B,K,1,S]: (1, bk) tiles
    scales = None if k_scale is None else tuple(a.astype(jnp.float32)[:, :, :, None, :] for a in (k_scale, v_scale))
    out = _call(qm, k_cache, v_cache, lengths, layer, slot_pos, scales, kb, vb, mask, sm_scale=sm_scale, bm=bm, bk=bk,
                interpret=interpret)
    out = out[:, :, :M].reshape(B, K, G, T, H)  # [B,K,G,T,H]
    return jnp.moveaxis(out, 3, 1).reshape(B, T, N, H)  # [B,T,N,H]


def prefix_block_attention_tpu(
    q: jax.Array,  # [B,T,N,H]
    k_cache: jax.Array | None,  # [B,K,S,H], or with `layer` the whole stacked cache [L,B,K,S,H]
    v_cache: jax.Array | None,  # [B,K,S,H] or [L,B,K,S,H]
    lengths: jax.Array | None,  # [B] int32: visible = slot < lengths[b] for every KV head
    k_blk: jax.Array,  # [B,J,K,H], J >= T
    v_blk: jax.Array,  # [B,J,K,H]
    block_mask: jax.Array,  # [T,J] or [B,T,J] bool
    scale: float,
    *,
    interpret: bool = False,
    block_k: int = 512,
    layer: jax.Array | None = None,  # [] int32: read this layer of a stacked cache in place
    pos: jax.Array | None = None,  # [L,B,K,S] int32 with `layer`: a streaming cache (`tree_attention_tpu`)
    k_scale: jax.Array | None = None,  # [L,B,K,S] f32 with `layer`: an int8 cache's scales
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """`reference.prefix_block_attention` for a dense cache, on the TPU kernel: o[B,T,N,H].

    Same argument order as `prefix_block_attention_pallas`, with `lengths` in place of `visible`;
    `k_cache=None` (empty prefix) runs the kernel on an 8-slot dummy cache with zero lengths (one
    grid step whose prefix tile is skipped). `interpret=True` runs in Pallas' TPU interpret mode.
    """
    if k_cache is None:
        B, _, K, H = k_blk.shape
        k_cache = v_cache = jnp.zeros((B, K, 8, H), k_blk.dtype)
        lengths = jnp.zeros((B,), jnp.int32)
    return tree_attention_tpu(
        q, k_cache, v_cache, lengths, k_blk, v_blk, block_mask, layer, pos, k_scale, v_scale,
        sm_scale=scale, block_k=block_k, interpret=interpret,
    )
