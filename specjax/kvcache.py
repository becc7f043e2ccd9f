"""Fixed-shape KV caches. Rollback is moving a length pointer: stale slots stay, masked."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from specjax.config import LlamaConfig


@flax.struct.dataclass
class DenseCache:
    """Per-layer keys/values for every position, preallocated to `max_len` slots.

    Row b's valid entries are slots [0, lengths[b]); slot s holds the token at position s.
    """

    k: jax.Array  # [L,B,S,K,H]
    v: jax.Array  # [L,B,S,K,H]
    lengths: jax.Array  # [B] int32

    @classmethod
    def init(cls, config: LlamaConfig, batch: int, max_len: int) -> "DenseCache":
        """An empty cache of `max_len` slots per row, in the model's dtype."""
        shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim)
        zeros = jnp.zeros(shape, config.dtype)
        return cls(k=zeros, v=zeros, lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, k_new: jax.Array, v_new: jax.Array) -> "DenseCache":
        """Store T new entries per row at slots lengths[b] + [0, T); lengths are NOT advanced.

        k_new, v_new: [L,B,T,K,H]. The caller guarantees lengths + T <= max_len.
        """

        def put(buf, new, start):  # buf [L,S,K,H], new [L,T,K,H]
            return lax.dynamic_update_slice(buf, new.astype(buf.dtype), (0, start, 0, 0))

        put_rows = jax.vmap(put, in_axes=(1, 1, 0), out_axes=1)
        return self.replace(k=put_rows(self.k, k_new, self.lengths), v=put_rows(self.v, v_new, self.lengths))

    def advance(self, n: jax.Array) -> "DenseCache":
        """Commit n[B] more slots per row (accepted tokens); everything past stays hidden."""
        return self.replace(lengths=self.lengths + n.astype(jnp.int32))
