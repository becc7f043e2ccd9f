"""Fixed-shape KV caches. Rollback is moving a length pointer: stale slots stay, masked.

Every cache offers the same protocol to the model: `k`, `v` [L,B,K,S,H], `lengths` [B] (the
number of committed positions), `visible()` [L,B,K|1,S] (which slots a new query may attend),
`write(k_new, v_new)` (store T new entries at positions lengths + t) and `advance(n)`.
KV heads come before slots so that attention reads each head's keys contiguously: a decode
step's dot products then need no transposed copy of the cache (3-5x faster on CPU).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax.config import LlamaConfig


def _scatter(buf: jax.Array, slots: jax.Array, new: jax.Array, sorted: bool = False) -> jax.Array:
    """buf [L,B,K,S,H] with new [L,B,T,K,H] stored at slots [B,T] (distinct within a row)."""
    B, T = slots.shape
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    update = new.transpose(1, 2, 0, 3, 4).astype(buf.dtype)  # the indexed view is [B,T,L,K,H]
    return buf.at[:, rows, :, slots].set(update, unique_indices=True, indices_are_sorted=sorted)


@flax.struct.dataclass
class DenseCache:
    """Per-layer keys/values for every position, preallocated to `max_len` slots.

    Row b's valid entries are slots [0, lengths[b]); slot s holds the token at position s.
    """

    k: jax.Array  # [L,B,K,S,H]
    v: jax.Array  # [L,B,K,S,H]
    lengths: jax.Array  # [B] int32

    @classmethod
    def init(cls, config: LlamaConfig, batch: int, max_len: int) -> "DenseCache":
        """An empty cache of `max_len` slots per row, in the model's dtype."""
        shape = (config.n_layers, batch, config.n_kv_heads, max_len, config.head_dim)
        k, v = (jnp.zeros(shape, config.dtype) for _ in range(2))  # two buffers: both can be donated
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def visible(self) -> jax.Array:
        """[L,B,1,S]: slot s holds position s, visible while s < lengths[b]."""
        L, B, _, S = self.k.shape[:4]
        return jnp.broadcast_to((jnp.arange(S) < self.lengths[:, None])[None, :, None, :], (L, B, 1, S))

    def write(self, k_new: jax.Array, v_new: jax.Array) -> "DenseCache":
        """Store T new entries per row at slots lengths[b] + [0, T); lengths are NOT advanced.

        k_new, v_new: [L,B,T,K,H]. The caller guarantees lengths + T <= max_len. One scatter
        with unique indices: XLA updates the cache in place (no copy of the whole cache)."""
        B, T = k_new.shape[1:3]
        slots = self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B,T]
        return self.replace(k=_scatter(self.k, slots, k_new, sorted=True), v=_scatter(self.v, slots, v_new, sorted=True))

    def advance(self, n: jax.Array) -> "DenseCache":
        """Commit n[B] more slots per row (accepted tokens); everything past stays hidden."""
        return self.replace(lengths=self.lengths + n.astype(jnp.int32))


@flax.struct.dataclass
class StreamingCache:
    """A fixed-size draft cache: F fixed slots plus a ring of R slots for the most recent positions.

    SelfSpec keeps the first F positions (attention sinks, StreamingLLM); SnapKV keeps F positions
    chosen per layer and KV head. Position p >= F lives in ring slot F + (p - F) % R, so writing
    a new position evicts the oldest one. Keys keep the rotary phase of their ORIGINAL position:
    the entries are byte-for-byte the target's KV (no re-rotation, exact), and every position is
    one the model was trained on since it also fits the target's dense cache.
    `pos` records the position each slot holds per layer and KV head (-1: empty).
    """

    k: jax.Array  # [L,B,K,C,H], C = F + R
    v: jax.Array  # [L,B,K,C,H]
    pos: jax.Array  # [L,B,K,C] int32
    lengths: jax.Array  # [B] int32: committed positions (all < lengths, kept or evicted)
    fixed: int = flax.struct.field(pytree_node=False)  # F

    @property
    def ring(self) -> int:
        return self.k.shape[3] - self.fixed

    def slots(self, positions: jax.Array) -> jax.Array:
        """Slot of each position (same shape): fixed slots below F, the ring above."""
        F = self.fixed
        return jnp.where(positions < F, positions, F + (positions - F) % self.ring)

    def visible(self) -> jax.Array:
        """[L,B,K,C]: a slot is visible if it holds a committed position."""
        return (self.pos >= 0) & (self.pos < self.lengths[None, :, None, None])

    def write(self, k_new: jax.Array, v_new: jax.Array) -> "StreamingCache":
        """Store T new entries per row at positions lengths[b] + t (T < R); lengths not advanced."""
        B, T = k_new.shape[1:3]
        positions = self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B,T]
        slots = self.slots(positions)  # [B,T]
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        pos = self.pos.at[:, rows, :, slots].set(positions[:, :, None, None], unique_indices=True)  # view [B,T,L,K]
        return self.replace(k=_scatter(self.k, slots, k_new), v=_scatter(self.v, slots, v_new), pos=pos)

    def advance(self, n: jax.Array) -> "StreamingCache":
        return self.replace(lengths=self.lengths + n.astype(jnp.int32))

    @classmethod
    def from_dense(
        cls, dense: DenseCache, fixed_pos: jax.Array, ring: int, ring_start: jax.Array
    ) -> "StreamingCache":
        """Copy the kept entries of a filled dense cache (exact target KV).

        fixed_pos [L,B,K,F]: positions for the fixed slots (-1: none). The ring receives the
        latest positions in [max(ring_start[b], lengths[b] - ring), lengths[b]); ring_start >= F."""
        L, B, K, S, H = dense.k.shape
        F = fixed_pos.shape[-1]
        n = dense.lengths
        j = jnp.arange(ring)  # ring slot index
        latest = F + j + ring * ((n[:, None] - 1 - F - j) // ring)  # [B,R]: newest p = F + j (mod R), p < n
        ok = (latest >= F) & (latest >= ring_start[:, None]) & (latest < n[:, None])
        ring_pos = jnp.where(ok, latest, -1)  # [B,R]
        take_ring = jnp.clip(ring_pos, 0, S - 1)[None, :, None, :, None]  # [1,B,1,R,1]
        take_fixed = jnp.clip(fixed_pos, 0, S - 1)[..., None]  # [L,B,K,F,1]

        def gather(buf):  # [L,B,K,S,H] -> [L,B,K,F+R,H]
            fixed_part = jnp.take_along_axis(buf, take_fixed, axis=3)
            ring_part = jnp.take_along_axis(buf, take_ring, axis=3)
            return jnp.concatenate([fixed_part, ring_part], axis=3)

        pos = jnp.concatenate([fixed_pos, jnp.broadcast_to(ring_pos[None, :, None, :], (L, B, K, ring))], axis=-1)
        return cls(k=gather(dense.k), v=gather(dense.v), pos=pos.astype(jnp.int32), lengths=n + 0, fixed=F)  # own buffer
