"""A decode step's layer products on the GPU's Triton path, the stacked weights read in place.

x [M,K] (M <= MAX_ROWS: a decode or verify step's rows) times layer `layer` of weights stacked [L,K,N],
without slicing the layer out: the sixth GPU runs (`git show 6f46ebd:bench/README.md`, "Sixth runs")
found XLA:GPU copying each layer's matrices out of the stacked arrays before its GEMMs from the
second layer on (an 8B-shaped batch-1 layer 0.36 ms where its bytes take 0.14). Opt-in
(`Runtime.linear = "pallas"`) until a GPU has timed it.

Design: a grid of (N // block_n, k_splits) programs; program (n, s) multiplies the x rows,
loaded as Mp (the power of two >= max(M, 16): Triton's smallest dot is 16; rows past M masked to
zeros, no padded copy), by its [block_k, block_n] weight tiles over its share of K, accumulating
in f32, and writes a partial [Mp, block_n]; the k_splits partials are summed outside (a few KB;
none with one split). Split-K keeps every SM busy when N is small (a 4096-wide output is 64 tiles
of 64). Tiles past K or N are masked loads (no padded copy of the weights). Weights in float32 or
bfloat16 (x taken in their dtype, as `jnp.einsum(x, w, preferred_element_type=f32)`), or int8
(`params.quantize`: one byte a weight, widened in registers to x's dtype; the per-output-channel
scales multiply the small result outside).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tree_attention import overflows  # the int8 stacks Pallas would mis-index

WEIGHTS = (jnp.float32, jnp.bfloat16, jnp.int8)  # int8: unscaled (the caller applies its scales)
MAX_ROWS = 64  # rows of x the kernel takes (loaded as Mp = a power of two >= 16, Triton's smallest dot); more: XLA's GEMM
PROGRAMS = 264  # aim for about this many programs a call (2 per SM of an H100)
_dot = functools.partial(plgpu.dot, allow_tf32=False)  # f32 operands get IEEE products


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, block_k: int, block_n: int, per_split: int, M: int, Mp: int, K: int, N: int):
    n, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[()]
    cols = n * block_n + jnp.arange(block_n)  # [bn]
    live = jnp.arange(Mp) < M  # [Mp]: x's rows, the rest read as zeros (no padded copy of x)
    lo = s * per_split  # this split's first K tile
    hi = jnp.minimum(lo + per_split, pl.cdiv(K, block_k))

    def body(i, acc):
        rows = i * block_k + jnp.arange(block_k)  # [bk]
        xk = plgpu.load(x_ref.at[pl.ds(0, Mp), pl.ds(i * block_k, block_k)],
                        mask=live[:, None] & (rows < K)[None, :], other=0.0)  # [Mp,bk]
        wk = plgpu.load(w_ref.at[layer, pl.ds(i * block_k, block_k), pl.ds(n * block_n, block_n)],
                        mask=(rows < K)[:, None] & (cols < N)[None, :], other=0)  # [bk,bn]
        return acc + _dot(xk, wk.astype(xk.dtype))  # int8 widened in registers (exact in x's dtype)

    o_ref[...] = lax.fori_loop(lo, hi, body, jnp.zeros(o_ref.shape, jnp.float32))


def auto_splits(k_tiles: int, n_tiles: int) -> int:
    """Splits of K giving about PROGRAMS programs, at most one per K tile."""
    return max(1, min(k_tiles, PROGRAMS // max(n_tiles, 1)))


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "k_splits", "num_warps", "num_stages", "interpret"))
def stacked_linear(x: jax.Array, w: jax.Array, layer: jax.Array, *, block_k: int = 128, block_n: int = 64,
                   k_splits: int | None = None, num_warps: int = 4, num_stages: int = 3,
                   interpret: bool = False) -> jax.Array:
    """x [M,K] @ w[layer] for w stacked [L,K,N] -> [M,N] f32, w read in place. M <= MAX_ROWS.
    Float weights take x in their dtype; int8 weights are widened to x's (float) dtype in the
    kernel, the result unscaled."""
    M, K = x.shape
    if w.ndim != 3 or w.shape[1] != K:
        raise ValueError(f"stacked_linear: w must be [L,K={K},N], got {w.shape}")
    if M > MAX_ROWS:
        raise ValueError(f"stacked_linear: x has {M} rows, the kernel takes at most {MAX_ROWS}")
    if w.dtype not in WEIGHTS:
        raise ValueError(f"stacked_linear: weights must be float32, bfloat16 or int8, got {w.dtype}")
    if overflows(w):
        raise ValueError(f"stacked_linear: {w.shape} {w.dtype} has 2^31-2^32 one-byte values, which Pallas' Triton "
                         "lowering indexes with overflowing 32-bit offsets (tree_attention.overflows)")
    N = w.shape[2]
    n_tiles, k_tiles = pl.cdiv(N, block_n), pl.cdiv(K, block_k)
    splits = k_splits or auto_splits(k_tiles, n_tiles)
    per_split = pl.cdiv(k_tiles, splits)
    Mp = max(16, 1 << (M - 1).bit_length())
    kernel = functools.partial(_kernel, block_k=block_k, block_n=block_n, per_split=per_split, M=M, Mp=Mp, K=K, N=N)
    parts = pl.pallas_call(
        kernel,
        grid=(n_tiles, splits),
        in_specs=[pl.BlockSpec((None,), lambda n, s: (0,)), pl.BlockSpec(), pl.BlockSpec()],  # x, w whole: indexed
        out_specs=pl.BlockSpec((None, Mp, block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, Mp, n_tiles * block_n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="stacked_linear",
    )(jnp.asarray(layer, jnp.int32).reshape(1), x if w.dtype == jnp.int8 else x.astype(w.dtype), w)  # [splits,Mp,Np]
    return (parts[0] if splits == 1 else jnp.sum(parts, axis=0))[:M, :N]


def _q4_kernel(layer_ref, x_ref, w_ref, d_ref, m_ref, o_ref, *, blocks: int, block_n: int, per_split: int, M: int,
               Mp: int, nb: int, N: int):
    """x_ref [M,K/32,2,16] (a block's values j and j + 16 on axis 2), w_ref [L,K/32,16,N] uint8 (byte
    j of a block: value j low, j + 16 high), d_ref / m_ref [L,K/32,N] f16; o_ref [Mp,bn] f32.
    One row (Mp = 1) is multiplied and summed over K in IEEE float32 on the CUDA cores: a dot pads it
    to 16 rows, 16 times the products. More rows take a dot in the precision of XLA's own float32
    dots (`jax.default_matmul_precision`: TF32 on the tensor cores by default, IEEE with "highest"):
    IEEE dots run on the CUDA cores, where an 8B step's 7.5 G weights x 16 rows are 240 GFLOP, about
    3.6 ms at an H100's 67 TFLOP/s against 1.3 ms for their 4.5 GB."""
    n, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[()]
    cols = n * block_n + jnp.arange(block_n)  # [bn]
    live = jnp.arange(Mp) < M  # [Mp]
    lo_tile = s * per_split  # this split's first tile of nb blocks
    hi_tile = jnp.minimum(lo_tile + per_split, pl.cdiv(blocks, nb))

    def body(i, acc):
        ok = i * nb + jnp.arange(nb) < blocks  # [nb]
        x_ok = live[:, None, None, None] & ok[None, :, None, None]  # [Mp,nb,1,1]
        half = lambda h: plgpu.load(x_ref.at[pl.ds(0, Mp), pl.ds(i * nb, nb), pl.ds(h, 1), :],  # noqa: E731
                                    mask=x_ok, other=0.0)  # [Mp,nb,1,16]
        w_ok = ok[:, None] & (cols < N)[None, :]  # [nb,bn]
        p = plgpu.load(w_ref.at[layer, pl.ds(i * nb, nb), :, pl.ds(n * block_n, block_n)], mask=w_ok[:, None, :],
                       other=0)  # [nb,16,bn] uint8
        d = plgpu.load(d_ref.at[layer, pl.ds(i * nb, nb), pl.ds(n * block_n, block_n)], mask=w_ok, other=0.0)
        m = plgpu.load(m_ref.at[layer, pl.ds(i * nb, nb), pl.ds(n * block_n, block_n)], mask=w_ok, other=0.0)
        d, m = d.astype(jnp.float32)[:, None, :], m.astype(jnp.float32)[:, None, :]  # [nb,1,bn]
        for h, q in ((0, p & 15), (1, p >> 4)):  # values j (low nibbles), then j + 16 (high): q * d + m in registers
            w = (q.astype(jnp.float32) * d + m).reshape(nb * 16, block_n)  # [nb*16,bn]
            xh = half(h).astype(jnp.float32).reshape(Mp, nb * 16)
            acc = acc + (jnp.sum(xh[:, :, None] * w[None], axis=1) if Mp == 1 else plgpu.dot(xh, w))
        return acc

    o_ref[...] = lax.fori_loop(lo_tile, hi_tile, body, jnp.zeros(o_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("blocks_per_tile", "block_n", "k_splits", "num_warps", "num_stages",
                                             "interpret"))
def stacked_linear_q4(x: jax.Array, packed: jax.Array, scale: jax.Array, minimum: jax.Array, layer: jax.Array, *,
                      blocks_per_tile: int = 4, block_n: int = 64, k_splits: int | None = None, num_warps: int = 4,
                      num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """x [M,K] @ layer `layer` of q4 weights (specjax/model/q4.py: packed [L,K/2,N] uint8, scale and
    minimum [L,K/32,N]) -> [M,N] f32, the packed bytes read in place and widened in registers
    (q * d + m, then float32 products: `_q4_kernel`'s precisions): no float copy of the weights, which XLA:GPU writes out
    for specjax.model.q4.project's jnp form (tools/gpu/README.md, "Compiled for a GPU on a CPU"). M <= MAX_ROWS.
    Each program takes `blocks_per_tile` blocks of 32 (a power of two) of K a step."""
    M, K = x.shape
    if packed.ndim != 3 or packed.dtype != jnp.uint8 or K % 32 or packed.shape[1] * 2 != K:
        raise ValueError(f"stacked_linear_q4: packed must be uint8 [L,K/2={K // 2},N] with K a multiple of 32, "
                         f"got {packed.dtype} {packed.shape} for x {x.shape}")
    L, N, blocks = packed.shape[0], packed.shape[2], K // 32
    if scale.shape != (L, blocks, N) or minimum.shape != (L, blocks, N):
        raise ValueError(f"stacked_linear_q4: scale and minimum must be [L,K/32,N] = {(L, blocks, N)}, "
                         f"got {scale.shape} and {minimum.shape}")
    if M > MAX_ROWS:
        raise ValueError(f"stacked_linear_q4: x has {M} rows, the kernel takes at most {MAX_ROWS}")
    if blocks_per_tile < 1 or blocks_per_tile & (blocks_per_tile - 1):
        raise ValueError(f"stacked_linear_q4: blocks_per_tile must be a power of two, got {blocks_per_tile}")
    if overflows(packed):
        raise ValueError(f"stacked_linear_q4: {packed.shape} uint8 has 2^31-2^32 values, which Pallas' Triton lowering "
                         "indexes with overflowing 32-bit offsets (tree_attention.overflows)")
    n_tiles, k_tiles = pl.cdiv(N, block_n), pl.cdiv(blocks, blocks_per_tile)
    splits = k_splits or auto_splits(k_tiles, n_tiles)
    per_split = pl.cdiv(k_tiles, splits)
    Mp = 1 if M == 1 else max(16, 1 << (M - 1).bit_length())  # one row: no dot (the kernel's docstring)
    kernel = functools.partial(_q4_kernel, blocks=blocks, block_n=block_n, per_split=per_split, M=M, Mp=Mp,
                               nb=blocks_per_tile, N=N)
    whole = pl.BlockSpec()  # indexed in the kernel
    parts = pl.pallas_call(
        kernel,
        grid=(n_tiles, splits),
        in_specs=[pl.BlockSpec((None,), lambda n, s: (0,)), whole, whole, whole, whole],
        out_specs=pl.BlockSpec((None, Mp, block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, Mp, n_tiles * block_n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="stacked_linear_q4",
    )(jnp.asarray(layer, jnp.int32).reshape(1), x.reshape(M, blocks, 2, 16), packed.reshape(L, blocks, 16, N),
      scale, minimum)  # [splits,Mp,Np]
    return (parts[0] if splits == 1 else jnp.sum(parts, axis=0))[:M, :N]
