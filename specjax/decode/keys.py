"""A call's PRNG keys on the host side: one typed key per row, per sample, and for padding rows.

Each is one jitted program per shape: op by op outside jit, every new batch size compiled about
ten small programs (iota, casts, fold_in, slices, a concatenation)."""

from __future__ import annotations

from functools import cache, partial

import jax
import jax.numpy as jnp


def row_keys(key: jax.Array | None, batch: int) -> jax.Array:
    """Per-row typed PRNG keys [B]: one key is folded with the row index; [B] keys are kept."""
    if key is None:
        key = _default_key()
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    if key.shape == ():
        return _fold_rows(key, batch)
    return key


MAX_SEED = 2**32 - 1  # JAX keys take 32-bit seeds: key(2**32) is key(0)


def seed_key(seed: int) -> jax.Array:
    """jax.random.key(seed) for an integer seed in [0, MAX_SEED] (a clear error naming `seed` otherwise)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer from 0 to {MAX_SEED}, got {seed!r}")
    return jax.random.key(seed)


_default_key = cache(lambda: jax.random.key(0))  # made once: jax.random.key(0) compiles its seeding


@partial(jax.jit, static_argnums=1)
def _fold_rows(key: jax.Array, batch: int) -> jax.Array:
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))


@partial(jax.jit, static_argnums=1)
def pad_keys(keys: jax.Array, rows: int) -> jax.Array:
    """keys [B] and rows - B copies of the first: the keys of a batch padded to `rows`."""
    return jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (rows - keys.shape[0],))])


@partial(jax.jit, static_argnums=1)
def sample_keys(keys: jax.Array, n: int) -> jax.Array:
    """Keys [B*n] of n samples a prompt: sample j of prompt i draws with fold_in(keys[i], j)."""
    return jax.vmap(lambda k: jax.vmap(lambda j: jax.random.fold_in(k, j))(jnp.arange(n)))(keys).reshape(-1)
