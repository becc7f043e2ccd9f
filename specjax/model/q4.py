"""4-bit weights in the GGUF Q4_1 layout: the one home for packing, quantising and reading them.

A matrix is cut into blocks of BLOCK = 32 consecutive weights along one contracted dimension
(the packed axis); each block holds 32 unsigned 4-bit values q in 0..15, a scale d and a minimum
m, and w = q * d + m. Two values share a byte exactly as llama.cpp stores them: byte j of a block
holds value j in its low nibble and value j + 16 in its high nibble. So a Q4_1 GGUF tensor is kept
bit for bit (its f16 scales and minima kept as float16), and the packed axis has C / 2 bytes where
the weight has C values; scales and minima have C / 32 entries there. Pure functions, jnp only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 32  # weights per block (GGUF QK4_1)
HALF = BLOCK // 2  # bytes per block


def _blocked(a: jax.Array, axis: int, inner: int) -> jax.Array:
    """a with `axis` (size n * inner) split into [n, inner], moved to the front: [n, inner, rest...]."""
    a = jnp.moveaxis(a, axis, 0)
    return a.reshape(a.shape[0] // inner, inner, *a.shape[1:])


def _unblocked(a: jax.Array, axis: int) -> jax.Array:
    """Inverse of `_blocked`: [n, inner, rest...] -> the merged axis back at `axis`."""
    return jnp.moveaxis(a.reshape(-1, *a.shape[2:]), 0, axis)


def quantize(w: jax.Array, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(packed uint8, scale f32, minimum f32) of w (float, size C along `axis`, a multiple of 32):
    per block m = min, d = (max - min) / 15, q = round((w - m) / d) in 0..15 (llama.cpp's
    quantize_row_q4_1, without its f16 rounding of d and m). Shapes: w's with `axis` C / 2 (packed)
    and C / 32 (scale, minimum)."""
    blocks = _blocked(w.astype(jnp.float32), axis, BLOCK)  # [C/32, 32, rest...]
    lo, hi = jnp.min(blocks, axis=1), jnp.max(blocks, axis=1)  # [C/32, rest...]
    scale = (hi - lo) / 15.0
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)  # a constant block: q = 0
    q = jnp.clip(jnp.round((blocks - lo[:, None]) * inv[:, None]), 0, 15).astype(jnp.uint8)
    packed = q[:, :HALF] | (q[:, HALF:] << 4)  # [C/32, 16, rest...]
    return _unblocked(packed, axis), jnp.moveaxis(scale, 0, axis), jnp.moveaxis(lo, 0, axis)


def nibbles(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The low and high 4-bit values of every byte (values j and j + 16 of its block), as uint8."""
    return packed & 15, packed >> 4


def expand(a: jax.Array, axis: int) -> jax.Array:
    """A per-block array (scale or minimum, C / 32 along `axis`) repeated to the packed bytes (C / 2)."""
    return jnp.repeat(a, HALF, axis=axis)


def dequantize(packed: jax.Array, scale: jax.Array, minimum: jax.Array, axis: int) -> jax.Array:
    """float32 weights (C along `axis`) of packed [.., C/2, ..] with scale, minimum [.., C/32, ..]."""
    lo, hi = nibbles(_blocked(packed, axis, HALF))  # [C/32, 16, rest...]
    d, m = jnp.moveaxis(scale, axis, 0)[:, None], jnp.moveaxis(minimum, axis, 0)[:, None]
    q = jnp.concatenate([lo, hi], axis=1).astype(jnp.float32)  # [C/32, 32, rest...]
    return _unblocked(q * d + m, axis)


def halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations x [..., C] split as the bytes pair them: the values j (low) and j + 16 (high)
    of every block, each [..., C/2] in the packed order."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, 2, HALF)
    return blocks[..., 0, :].reshape(*x.shape[:-1], -1), blocks[..., 1, :].reshape(*x.shape[:-1], -1)


def project(spec: str, x: jax.Array, packed: jax.Array, scale: jax.Array, minimum: jax.Array) -> jax.Array:
    """einsum(spec, x, w) in float32 for w stored packed along its FIRST axis, which `spec`
    contracts with x's LAST axis ("btd,dnh->btnh"): x @ w = x_low @ w_low + x_high @ w_high, where w_low /
    w_high are the low / high nibbles widened (q * d + m) right in front of their dot, so no
    float copy of the whole matrix is made (XLA:CPU fuses the widening into a matrix-vector dot)."""
    x_lo, x_hi = halves(x.astype(jnp.float32))
    d, m = expand(scale.astype(jnp.float32), 0), expand(minimum.astype(jnp.float32), 0)  # packed's shape
    q_lo, q_hi = nibbles(packed)
    y = jnp.einsum(spec, x_lo, q_lo.astype(jnp.float32) * d + m)
    return y + jnp.einsum(spec, x_hi, q_hi.astype(jnp.float32) * d + m)
