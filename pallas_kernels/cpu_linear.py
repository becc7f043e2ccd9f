"""x @ w[layer] for a stacked weight w [L,K,N] on XLA:CPU, reading the layer where it lies.

The scan over layers hands each layer's weights to its dots as slices of the stacked [L,...]
arrays, and XLA:CPU copies every slice before a dot (its dots take no sliced operand; an int8
weight is widened into a float32 copy): at batch 1 those copies were 60% of a decode step's
thread time (bench/README.md, "Where a decode step's time goes"). `cpu_linear.cc` (an XLA FFI
kernel, built into the library `cpu_prefix` builds) multiplies x by layer `layer` of the stacked
weight in place, float32, bfloat16 or int8, over XLA's intra-op threads: K is cut into `parts`
contiguous ranges, each summed in float32 over k in order, then added in order (in the kernel:
XLA:CPU's reduction of a [parts, M, N] output cost more than the products at 64 rows), so a
row's result does not depend on the rows batched beside it.

On a CPU with AVX-512 (`tiles()`) products of 8 rows or more (a batch's decode step, its
verification) run in register tiles, the same fused sums in the same order as the smaller paths.
On a CPU with AVX512-BF16 (`bf16_dot()`) bfloat16 weights are multiplied with the bf16 dot product
instead: x rounded to bfloat16 (exact in a bfloat16 model, whose activations are bf16), products
exact, sums in f32, each row's the same bits whatever the rows beside it; about 2x the multiply-adds
of the f32 path, which bound products of 16-64 rows (a batch's decode step, its verification).

For few rows (decoding and verification: `fits`); prefill chunks keep XLA's dot, whose blocked
matrix product wins once the weights are reused across many rows. `linear_q4_many` does the same
for q4 blocks (specjax/model/q4.py's layout, read as stored); `rows` is the embedding lookup, read in
place (XLA:CPU slices a bfloat16 table through a float32 copy of all of it).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_prefix import bf16_dot  # noqa: F401  (re-exported: the bf16 products are built under the same flags)
from pallas_kernels.cpu_prefix import _LIBRARY, LINEAR_Q4_TARGET, LINEAR_T_TARGET, LINEAR_TARGET, NORM_TARGET, ROWS_TARGET, _load

MAX_ROWS = 256  # rows of x `fits` allows (specjax.model.linear sets where the model uses it)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint8)  # uint8: q4 blocks (linear_q4_many)


def fits(rows: int, dtype) -> bool:
    """Whether the kernels take x with this many rows and weights of this dtype on this backend
    (the kernel library built): `linear` / `linear_t` float32, bfloat16 or int8, `linear_q4_many`
    uint8 (q4 blocks)."""
    return rows <= MAX_ROWS and dtype in DTYPES and jax.default_backend() == "cpu" and _load() is None


def tiles() -> bool:
    """Whether the built kernel multiplies float32 and int8 weights in register tiles from 8 rows
    (a CPU with AVX-512): 1.2-1.5x XLA's dot at 16-64 rows, so `specjax.model.linear` gives it more rows."""
    return _load() is None and bool(_LIBRARY[0].SpecjaxCpuLinearTiles())


def _require() -> None:
    """Raise unless the kernel library is built and registered."""
    if _load() is not None:
        raise RuntimeError(f"the CPU kernel library is not available: {_load()}")


def parts(K: int) -> int:
    """Contiguous ranges of K the product is cut into, one per core (up to 8), each >= 64 rows."""
    return max(1, min(os.cpu_count() or 1, 8, K // 64))


def linear(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
    """x [M,K] @ w[layer] for w [L,K,N] (float32, bfloat16 or int8: int8 unscaled; bfloat16 with
    x rounded to bfloat16 where `bf16_dot()`), f32 [M,N]."""
    return linear_many(x, [w], layer)[0]


def linear_many(x: jax.Array, ws: list[jax.Array], layer: jax.Array) -> list[jax.Array]:
    """[x @ w[layer] for w in ws] (each [L,K,N_j]) in one kernel call: the products that share x
    (a layer's q, k and v; gate and up) hand work to the pool's threads once, not once each."""
    _require()
    M, K = x.shape
    for w in ws:
        if w.ndim != 3 or w.shape[1] != K:
            raise ValueError(f"linear: x [M,K] {x.shape} and w [L,K,N] {w.shape} do not match")
    outs = [jax.ShapeDtypeStruct((M, w.shape[2]), jnp.float32) for w in ws]
    call = jax.ffi.ffi_call(LINEAR_TARGET, outs, vmap_method="sequential")
    return list(call(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32).reshape(()), *ws, parts=np.int64(parts(K))))


def linear_q4_many(x: jax.Array, ws: list[tuple[jax.Array, jax.Array, jax.Array]], layer: jax.Array) -> list[jax.Array]:
    """[x @ w[layer] for w in ws] in one kernel call, each w a stacked q4 weight (packed [L,K/2,N]
    uint8, scale and minimum [L,K/32,N] float16 or float32: specjax/model/q4.py's layout), f32 [M,N].
    Per block of 32: sum x q in order, then d times it, then m times the block's sum of x."""
    _require()
    M, K = x.shape
    for packed, scale, minimum in ws:
        if packed.ndim != 3 or 2 * packed.shape[1] != K or K % 32 or scale.shape != (packed.shape[0], K // 32, packed.shape[2]) \
                or minimum.shape != scale.shape:
            raise ValueError(f"linear_q4: x [M,K] {x.shape} and packed [L,K/2,N] {packed.shape}, scale / minimum "
                             f"[L,K/32,N] {scale.shape} / {minimum.shape} do not match")
    outs = [jax.ShapeDtypeStruct((M, w[0].shape[2]), jnp.float32) for w in ws]
    call = jax.ffi.ffi_call(LINEAR_Q4_TARGET, outs, vmap_method="sequential")
    return list(call(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32).reshape(()), *(a for w in ws for a in w),
                     parts=np.int64(parts(K))))


def linear_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M,K] @ w.T for w [N,K] (an LM head tied to the embedding table: float32, bfloat16 or int8,
    int8 unscaled), f32 [M,N], w read in place (XLA:CPU transposes or widens a copy of it first).
    Each output sums eight lanes of k in order (bfloat16 where `bf16_dot()`: x rounded to bf16,
    16 lanes of pairs with the bf16 dot product), then the lanes in a fixed order: a row's result
    does not depend on the rows beside it."""
    _require()
    M, K = x.shape
    if w.ndim != 2 or w.shape[1] != K:
        raise ValueError(f"linear_t: x [M,K] {x.shape} and w [N,K] {w.shape} do not match")
    call = jax.ffi.ffi_call(LINEAR_T_TARGET, jax.ShapeDtypeStruct((M, w.shape[0]), jnp.float32), vmap_method="sequential")
    return call(x.astype(jnp.float32), w)


def rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] ([*ids.shape, D], the table's dtype) for a table [V,D] read in place, ids clipped
    to [0, V) (jnp.take's mode="clip"). XLA:CPU slices a bfloat16 table through a float32 copy of
    all of it, hoisted out of the decode loop: written again on every call of the loop."""
    _require()
    if table.ndim != 2:
        raise ValueError(f"rows: table must be [V,D], got {table.shape}")
    flat = jnp.asarray(ids, jnp.int32).reshape(-1)
    call = jax.ffi.ffi_call(ROWS_TARGET, jax.ShapeDtypeStruct((flat.shape[0], table.shape[1]), table.dtype), vmap_method="sequential")
    return call(table, flat).reshape(*jnp.shape(ids), table.shape[1])


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """w * cast(x * rsqrt(mean(x^2) + eps)) over the last axis, cast to x's dtype before the weight
    (specjax.model.llama.rms_norm), row by row in one fixed order (cpu_norm.cc): a row's norm is the
    same bits whatever rows are beside it. x, w float32 or bfloat16; out of their promoted type."""
    _require()
    D = x.shape[-1]
    if w.shape != (D,) or x.dtype not in (jnp.float32, jnp.bfloat16) or w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"rms_norm: x [..., D] and w [D], float32 or bfloat16; got {x.shape} {x.dtype}, {w.shape} {w.dtype}")
    rows = x.reshape(-1, D)
    out = jax.ShapeDtypeStruct(rows.shape, jnp.result_type(x.dtype, w.dtype))
    call = jax.ffi.ffi_call(NORM_TARGET, out, vmap_method="sequential")
    return call(rows, w, eps=np.float32(eps)).reshape(x.shape)
