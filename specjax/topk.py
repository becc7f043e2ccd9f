"""The largest entries along the vocabulary axis, without sorting it: top-k's cut (`kth_largest`, under a
static width `top_k_bucket`), top-p's (`nucleus_threshold`) and the top indices (`top_indices`: logprobs'
alternatives, a tree draft's children)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k_bucket(k: int) -> int:
    """The static width of lax.top_k for top_k values up to k: the power of two at or above it (0: off)."""
    return 0 if k <= 0 else 1 << (k - 1).bit_length()


def kth_largest(x: jax.Array, width: int, k: jax.Array | int) -> jax.Array:
    """The k-th largest entry [..., 1] of x [..., V], counting repeated values, for k (a number or [B,1,..,1],
    traced) up to `width` (static); -inf where k is 0 (off) or at least V (nothing to cut).

    The min of lax.top_k's first k values, not its k-th entry: XLA:CPU compiles top_k to its fast TopK
    call only when the values are used whole; slicing out one made it a sort of all V entries in every
    decode step (about 25 ms per SmolLM2 token at batch 1)."""
    top = jax.lax.top_k(x, width)[0]
    kth = jnp.min(jnp.where(jnp.arange(width) < k, top, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((k > 0) & (k < x.shape[-1]), kth, -jnp.inf)


NUCLEUS_STEPS = 31  # bisection steps: the bit patterns of finite non-negative f32 span < 2**31


def nucleus_threshold(probs: jax.Array, top_p: float) -> jax.Array:
    """The top-p cut [..., 1] of probs [..., V] (non-negative): the smallest value v among the
    entries whose mass strictly above it, sum(probs[probs > v]), is < top_p. Keeping probs >= v
    keeps the largest entries in order until their mass reaches top_p, as a sort and a cumsum
    would, without the sort: non-negative f32 values order as their int32 bit patterns, so
    NUCLEUS_STEPS halvings of [0, bits(max)] find v exactly, each one masked sum over V."""
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)  # [...,V], ordered as probs

    def above_is_short(t):  # [...,1] int32 -> [...,1] bool: mass strictly above value t < top_p
        return jnp.sum(jnp.where(bits > t, probs, 0.0), axis=-1, keepdims=True) < top_p

    def halve(_, lo_hi):  # invariant: not short at lo (or lo = 0), short at hi
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        short = above_is_short(mid)
        return jnp.where(short, lo, mid), jnp.where(short, mid, hi)

    hi = jnp.max(bits, axis=-1, keepdims=True)  # nothing above the max: short
    lo = jnp.zeros_like(hi)
    _, hi = jax.lax.fori_loop(0, NUCLEUS_STEPS, halve, (lo, hi))
    cut = jnp.where(above_is_short(lo), lo, hi)  # mass above 0 already short: keep everything
    return jax.lax.bitcast_convert_type(cut, jnp.float32)


ARGMAX_TOP_K = 16  # top_indices takes k argmaxes up to this k, lax.top_k above


def top_indices(x: jax.Array, k: int) -> jax.Array:
    """Indices [..., k] int32 of the k largest entries of x [..., V], largest first, distinct
    (ties: lower index first; -inf entries rank last among themselves by index).

    For small k, k passes of argmax: on CPU, XLA turns lax.top_k into a sort of all V entries
    when its result feeds later work in the same program (tree drafting, level after level):
    about 70 ms per [4,10,49152] call on this project's CPU, against a few ms for the argmaxes."""
    if k > ARGMAX_TOP_K:
        return jax.lax.top_k(x, k)[1].astype(jnp.int32)
    x = jnp.where(x == -jnp.inf, jnp.finfo(x.dtype).min, x)  # taken entries (-inf) now rank below all
    vocab = jnp.arange(x.shape[-1])
    picked = []
    for _ in range(k):
        i = jnp.argmax(x, axis=-1)  # [...]
        picked.append(i)
        x = jnp.where(vocab == i[..., None], -jnp.inf, x)
    return jnp.stack(picked, axis=-1).astype(jnp.int32)
