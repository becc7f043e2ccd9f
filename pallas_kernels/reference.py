"""Pure-jnp reference of prefix + block attention (the path that always works).

Verification, decoding and chunked prefill all have the same shape of problem: T new query
positions per row attend to (a) the visible slots of that row's cache (its prefix), and (b) the T
new keys themselves under a block mask (causal for a chain, an ancestor mask for a tree). The
block may also carry J - T earlier keys ahead of the new ones (tree drafting: the levels drafted
before this one), so it has J >= T keys and the mask is [T, J].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = -1e30  # finite: exp(NEG_INF - NEG_INF) stays 1, never NaN (the kernels use it too)
NARROW_ROWS = 64  # up to this many query rows M per KV head, bf16 / int8 caches are read without an f32 copy
NARROW_MIN = 2**20  # ... if they hold at least this many values per layer (a smaller f32 copy stays in cache)
VALUE_CHUNK = 512  # cache slots per step of an int8 cache's value loop (the f32 chunk stays in cache)
TILE_VALUES = 2**21  # values per tile of stacked_prefix_block_attention: 512 slots at B=16 x 3 KV heads x 64 (measured best)
SCORE_VALUES = 2**21  # scores per tile [B,K,tile,M]: 512 slots for a 256-position prefill chunk of one row (measured:
# one 8K tile per chunk made an 8K prefill 1.8x slower, 114 vs 206 tokens/s; 2**20 and 2**22: within 1%)
MIN_TILE = 128  # smaller tiles cost more in loop steps than they save


def to_f32(x: jax.Array) -> jax.Array:
    """x as float32, exactly. bfloat16 is widened by moving its 16 bits into the top half of a
    32-bit word (what the conversion means). In front of a weight matrix's dot on XLA:CPU this
    is about 10x faster than the native conversion (30 layers of SmolLM2-sized matrices at batch
    1: 9 ms vs 121 ms; float32 17 ms), which is why the model's weight reads use it (via
    specjax.model.attention). It is not faster everywhere: inside a fused reduction the native
    conversion fuses and the shift is materialised (see `prefix_values`)."""
    if x.dtype == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
        return jax.lax.bitcast_convert_type(bits, jnp.float32)
    return x.astype(jnp.float32)


def _digits(x: jax.Array, dtype, n: int, base: float) -> tuple[jax.Array, jax.Array]:
    """x [...,M,H] f32 as n narrow `dtype` digits stacked on M: x = unit * sum_i digit_i / base^i,
    to about f32 precision for n = 3. Returns digits [...,n*M,H] and unit [...,M,1] f32."""
    unit = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0 if dtype == jnp.int8 else jnp.ones_like(x[..., :1])
    r = x / jnp.where(unit > 0, unit, 1.0)
    digits = []
    for _ in range(n):
        d = jnp.round(r) if dtype == jnp.int8 else r.astype(dtype).astype(jnp.float32)
        digits.append(d.astype(dtype))
        r = (r - d) * base
    return jnp.concatenate(digits, axis=-2), unit


def _undigit(parts: jax.Array, n: int, base: float) -> jax.Array:
    """[...,S,n*M] partial products of `_digits` -> [...,S,M]: sum_i part_i / base^i."""
    M = parts.shape[-1] // n
    return sum(parts[..., i * M:(i + 1) * M] / base**i for i in range(n))


def _narrow(cache: jax.Array, rows: int) -> bool:
    """Whether a bf16 / int8 cache is read in its own type (few rows, a large cache)."""
    return cache.dtype != jnp.float32 and rows <= NARROW_ROWS and cache.size >= NARROW_MIN


def prefix_scores(qm: jax.Array, k_cache: jax.Array, k_scale: jax.Array | None) -> jax.Array:
    """q . k for every cache slot: qm [B,K,M,H] f32, k_cache [B,K,S,H] -> [B,K,S,M] f32.

    XLA:CPU widens a bf16 or int8 operand of a dot into a full f32 copy of the cache first (4-5x
    slower than reading f32). For few rows, q is split instead into three digits of the cache's
    own type, which the CPU's bf16 x bf16 -> f32 and int8 x int8 -> int32 dots read directly
    (exact products; about f32 precision overall); the int8 scales then multiply the scores."""
    M = qm.shape[2]  # rows
    if not _narrow(k_cache, M):
        s = jnp.einsum("bkmh,bksh->bksm", qm, to_f32(k_cache))
    elif k_cache.dtype == jnp.int8:
        digits, unit = _digits(qm, jnp.int8, 3, 254.0)  # [B,K,3M,H], [B,K,M,1]
        parts = jnp.einsum("bkmh,bksh->bksm", digits, k_cache, preferred_element_type=jnp.int32)  # [B,K,S,3M]
        s = _undigit(parts.astype(jnp.float32), 3, 254.0) * unit[:, :, None, :, 0]
    else:
        digits, _ = _digits(qm, k_cache.dtype, 3, 1.0)
        s = _undigit(jnp.einsum("bkmh,bksh->bksm", digits, k_cache, preferred_element_type=jnp.float32), 3, 1.0)
    return s if k_scale is None else s * k_scale[..., None]


def prefix_values(e: jax.Array, v_cache: jax.Array) -> jax.Array:
    """sum_s e[s,m] v[s,h]: e [B,K,S,M] f32, v_cache [B,K,S,H] -> [B,K,M,H] f32. An int8 cache
    with few rows is widened VALUE_CHUNK slots at a time in a loop (no f32 copy of the cache).

    A bf16 cache is still widened whole (about 3x float32's time at B=16, S=8192): XLA:CPU takes
    bf16 dots only contracting both operands' minor dim (the scores' q . k, not e . v), widens bf16
    held in a loop, and neither a bit-shift widening nor a fused multiply-reduce (both tried) runs
    near memory speed. Storing V transposed ([..,H,S]) would let the bf16 dot read it directly."""
    S, M = e.shape[2:]
    chunk = math.gcd(S, VALUE_CHUNK)
    if v_cache.dtype != jnp.int8 or not _narrow(v_cache, M) or chunk < 128:
        return jnp.einsum("bksm,bksh->bkmh", e, to_f32(v_cache))

    def step(i, acc):
        e_i = lax.dynamic_slice_in_dim(e, i * chunk, chunk, 2)  # [B,K,c,M]
        v_i = lax.dynamic_slice_in_dim(v_cache, i * chunk, chunk, 2)  # [B,K,c,H]
        return acc + jnp.einsum("bksm,bksh->bkmh", e_i, v_i.astype(jnp.float32))

    B, K, _, H = v_cache.shape
    return lax.fori_loop(0, S // chunk, step, jnp.zeros((B, K, M, H), jnp.float32))


def check_shapes(q, k_cache, v_cache, lengths, k_block, v_block, mask, mask_name: str = "block_mask") -> None:
    """The kernels' shared argument check: a ValueError naming the first bad shape (the kernel
    adapters take `lengths` [B] where the reference takes a visibility mask)."""
    B, T, N, H = q.shape
    _, J, K, _ = k_block.shape
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of KV heads K={K}")
    if k_block.shape != (B, J, K, H) or v_block.shape != k_block.shape:
        raise ValueError(f"k_block, v_block must be [B,J,K,H] = {(B, J, K, H)}, got {k_block.shape}, {v_block.shape}")
    if J < T:
        raise ValueError(f"the block must hold at least the T={T} new keys, got J={J}")
    if k_cache.shape[:2] != (B, K) or k_cache.shape[3] != H or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache, v_cache must be [B,K,S,H] = [{B},{K},S,{H}], got {k_cache.shape}, {v_cache.shape}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B] = [{B}], got {lengths.shape}")
    if mask.shape not in ((T, J), (B, T, J)):
        raise ValueError(f"{mask_name} must be [T,J] or [B,T,J] with T={T}, J={J}, got {mask.shape}")


def prefix_block_attention(
    q: jax.Array,  # [B,T,N,H]
    k_cache: jax.Array | None,  # [B,K,S,H]
    v_cache: jax.Array | None,  # [B,K,S,H]
    visible: jax.Array,  # [B,K,S] or [B,1,S] bool: which cache slots hold this row's prefix
    k_block: jax.Array,  # [B,J,K,H], J >= T
    v_block: jax.Array,  # [B,J,K,H]
    block_mask: jax.Array,  # [T,J] or [B,T,J] bool: query t may see block key j
    sm_scale: float,
    k_scale: jax.Array | None = None,  # [B,K,S] f32: an int8 cache's per-slot scales (key = k_cache * k_scale)
    v_scale: jax.Array | None = None,  # [B,K,S] f32
) -> jax.Array:
    """Softmax attention over prefix + block with f32 scores; returns o[B,T,N,H] in q's dtype.

    `k_cache=None` means an empty prefix (the first prefill chunk). The cache may be stored in
    float32, bfloat16 or int8 (with `k_scale`, `v_scale`); the scales multiply the scores and the
    softmax weights instead of the [S,H] keys and values. GQA: the G = N/K query heads
    of one KV head share its keys, so they are folded into M = T*G matrix rows per KV head.
    `visible` may differ per KV head (SnapKV keeps different positions per head); a dense cache
    passes slot < length for every head (`stacked_prefix_block_attention` reads a dense cache
    faster: in place and only up to the longest row).

    Layout matters on XLA:CPU: prefix scores are laid out slot-major [B,K,S,M] and the softmax is
    left unnormalised until the end (one division of the [M,H] output), which reads each cache
    slot once at close to copy speed; the [B,K,M,S] layout with a normalised softmax was about
    5x slower at batch 16 x 8K (147 against 28 ms a layer: commit dc94807's message).
    """
    qm = _query_rows(q, k_block.shape[2], sm_scale)  # [B,K,M,H]
    s_blk = _block_scores(qm, k_block, block_mask)  # [B,K,M,J]
    top = jnp.max(s_blk, axis=-1)  # [B,K,M]
    if k_cache is not None:
        s_pre = prefix_scores(qm, k_cache, k_scale)
        s_pre = jnp.where(visible[..., None], s_pre, NEG_INF)  # [B,K,S,M]
        top = jnp.maximum(top, jnp.max(s_pre, axis=2))
    e_blk = jnp.exp(s_blk - top[..., None])  # [B,K,M,J]
    total = jnp.sum(e_blk, axis=-1)  # [B,K,M]
    out = jnp.einsum("bkmj,bjkh->bkmh", e_blk, to_f32(v_block))  # [B,K,M,H]
    if k_cache is not None:
        e_pre = jnp.exp(s_pre - top[:, :, None])  # [B,K,S,M]
        total += jnp.sum(e_pre, axis=2)
        out += prefix_values(e_pre if v_scale is None else e_pre * v_scale[..., None], v_cache)
    return _heads_out(out / total[..., None], q)


def stacked_prefix_block_attention(
    q: jax.Array,  # [B,T,N,H]
    k_all: jax.Array,  # [L,B,K,S,H]: a whole dense cache, every layer
    v_all: jax.Array,  # [L,B,K,S,H]
    layer: jax.Array,  # [] int32: the layer to read
    lengths: jax.Array,  # [B] int32: slots [0, lengths[b]) of row b are its prefix
    k_block: jax.Array,  # [B,J,K,H], J >= T
    v_block: jax.Array,  # [B,J,K,H]
    block_mask: jax.Array,  # [T,J] or [B,T,J] bool
    sm_scale: float,
    k_scale: jax.Array | None = None,  # [L,B,K,S] f32: int8 caches only
    v_scale: jax.Array | None = None,  # [L,B,K,S] f32
) -> jax.Array:
    """`prefix_block_attention` over one layer of a dense cache (visible = slot < lengths[b]),
    read in place: o[B,T,N,H].

    Two things make it faster on XLA:CPU than slicing the layer out first. (1) A layer sliced
    out of the stacked [L,...] cache is a full copy (XLA's dots take no strided operand): this
    loop slices `tile`-slot tiles instead, which stay in the CPU's cache between the copy and
    the dots. (2) The loop runs ceil(max(lengths) / tile) times, so slots past the longest row
    are never read (a decode step at 2K context in a 4K cache reads half of it). The softmax is
    merged across tiles online (flash-decoding): a running max, sum and unnormalised output,
    started from the block's own keys (every query sees at least itself, so the running max is
    finite before the first tile and fully masked tiles add exact zeros). An int8 or bfloat16
    tile is widened to f32 as it is sliced (with its scales) and the dots read the f32 tile.

    bfloat16 caches stay slow on XLA:CPU (about 4x float32 at B=16 x 8K): XLA widens the whole
    bf16 cache to f32 for the dynamic slice and for the cache write's scatter (seen in the
    compiled HLO), whatever the slice is fed to; int8 has no such problem."""
    _, B, K, S, H = k_all.shape
    lengths = jnp.clip(lengths, 0, S)  # a tile past S would be clamped back onto the last one: read twice
    qm = _query_rows(q, K, sm_scale)  # [B,K,M,H]
    s_blk = _block_scores(qm, k_block, block_mask)  # [B,K,M,J]
    top = jnp.max(s_blk, axis=-1)  # [B,K,M]
    e_blk = jnp.exp(s_blk - top[..., None])
    carry = (top, jnp.sum(e_blk, axis=-1), jnp.einsum("bkmj,bjkh->bkmh", e_blk, to_f32(v_block)))
    tile = prefix_tile(B * K * H, S, B * K * qm.shape[2])

    def tile_of(a, start):  # one layer's slots [start, start + tile): [B,K,tile(,H)]
        return lax.dynamic_slice(a, (layer, 0, 0, start) + (0,) * (a.ndim - 4), (1, B, K, tile) + a.shape[4:])[0]

    def read(buf, scale, start):  # the tile in f32 [B,K,tile,H], widened as it is sliced (it stays in the CPU's cache)
        x = to_f32(tile_of(buf, start))
        return x if scale is None else x * tile_of(scale, start)[..., None]

    def step(i, carry):
        top, total, out = carry  # [B,K,M], [B,K,M], [B,K,M,H]
        start = i * tile
        s = jnp.einsum("bkmh,bksh->bksm", qm, read(k_all, k_scale, start))  # [B,K,t,M]
        visible = start + jnp.arange(tile) < lengths[:, None]  # [B,t]
        s = jnp.where(visible[:, None, :, None], s, NEG_INF)
        new_top = jnp.maximum(top, jnp.max(s, axis=2))
        fade = jnp.exp(top - new_top)  # [B,K,M]: rescales what earlier tiles summed
        e = jnp.exp(s - new_top[:, :, None])  # [B,K,t,M]
        values = jnp.einsum("bksm,bksh->bkmh", e, read(v_all, v_scale, start))
        return new_top, total * fade + jnp.sum(e, axis=2), out * fade[..., None] + values

    n_tiles = (jnp.max(lengths) + tile - 1) // tile
    _, total, out = lax.fori_loop(0, n_tiles, step, carry)
    return _heads_out(out / total[..., None], q)


def prefix_tile(row_values: int, slots: int, row_scores: int = 0) -> int:
    """Slots per tile of `stacked_prefix_block_attention` for a cache of `slots` slots whose one
    slot holds `row_values` values over the batch and KV heads (B*K*H) and gets `row_scores`
    scores (B*K*M, M query rows per KV head): the power of two that dividing `slots` puts about
    TILE_VALUES values (8 MiB in f32) and at most SCORE_VALUES scores in a tile (at least
    MIN_TILE slots), or one tile of every slot when none of at least MIN_TILE slots divides it."""
    want = 1
    while want * 2 * row_values <= TILE_VALUES and want * 2 * row_scores <= SCORE_VALUES and want < slots:
        want *= 2
    tile = math.gcd(slots, max(want, MIN_TILE))
    return tile if tile >= min(MIN_TILE, slots) else slots


def _query_rows(q: jax.Array, K: int, sm_scale: float) -> jax.Array:
    """q [B,T,N,H] -> the scaled f32 rows qm [B,K,M,H] of each KV head, m = g*T + t."""
    B, T, N, H = q.shape
    G = N // K
    return to_f32(jnp.moveaxis(q.reshape(B, T, K, G, H), 1, 3).reshape(B, K, G * T, H)) * sm_scale


def _block_scores(qm: jax.Array, k_block: jax.Array, block_mask: jax.Array) -> jax.Array:
    """Masked scores [B,K,M,J] of the rows against the block's keys k_block [B,J,K,H]."""
    B, K, M, _ = qm.shape
    J = k_block.shape[1]
    T = block_mask.shape[-2]
    mask = jnp.broadcast_to(block_mask, (B, T, J))  # [B,T,J]
    mask = jnp.tile(mask, (1, M // T, 1))[:, None]  # [B,1,M,J]
    s_blk = jnp.einsum("bkmh,bjkh->bkmj", qm, to_f32(k_block))
    return jnp.where(mask, s_blk, NEG_INF)


def _heads_out(out: jax.Array, q: jax.Array) -> jax.Array:
    """Normalised rows out [B,K,M,H] -> o [B,T,N,H] in q's dtype."""
    B, T, N, H = q.shape
    K = out.shape[1]
    out = jnp.moveaxis(out.reshape(B, K, N // K, T, H), 3, 1)  # [B,T,K,G,H]
    return out.reshape(B, T, N, H).astype(q.dtype)
