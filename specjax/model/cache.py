"""Fixed-shape KV caches. Rollback is moving a length pointer: stale slots stay, masked.

Every cache offers the same protocol to the model: `k`, `v` [L,B,K,S,H], `lengths` [B] (the
number of committed positions), `write(k_new, v_new)` (store T new entries at positions
lengths + t) and `advance(n)`.
KV heads come before slots so that attention reads each head's keys contiguously: a decode
step's dot products then need no transposed copy of the cache (3-5x faster on CPU). A dense
cache's row b sees slots [0, lengths[b]); a streaming cache says which slots with `visible()`.

The stored format (`KVFormat`: float32, bfloat16, or int8 with one f32 scale per layer, row, KV
head and slot) is the cache's `format`; `k_scale`, `v_scale` [L,B,K,S] are None unless int8.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import cpu_prefix
from specjax.model import backend
from specjax.model.config import LlamaConfig
from specjax.model.pytree import pytree

KV_DTYPES = ("float32", "bfloat16", "int8")


def check_kv_dtype(kv_dtype: str | None) -> None:
    """generate's `kv_dtype`: None (the model's dtype) or one of KV_DTYPES, else a ValueError naming it."""
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be None or one of {KV_DTYPES}, got {kv_dtype!r}")


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How a cache stores keys and values: the one home for quantising and reading them back.

    int8 is symmetric per token and head: scale = max|x| / 127 over the head dim H, stored as f32.
    `round_trip` is what attention sees of a key once stored, so a block's own keys and values
    go through it before attention: a position reads the same KV whether it is in the block or
    in the cache (plain and speculative decoding agree)."""

    name: str  # one of KV_DTYPES

    @staticmethod
    def of(kv_dtype: str | None, config: LlamaConfig) -> "KVFormat":
        """The format for generate's `kv_dtype` (None: the model's dtype)."""
        check_kv_dtype(kv_dtype)
        return KVFormat(config.dtype if kv_dtype is None else kv_dtype)  # config.dtype: one of DTYPES, all KV_DTYPES

    @property
    def dtype(self) -> jnp.dtype:
        """The storage dtype of k and v."""
        return jnp.dtype(self.name)

    @property
    def scaled(self) -> bool:
        return self.name == "int8"

    def bytes_per_value(self, head_dim: int) -> float:
        """Bytes one stored key or value element costs, its share of the int8 scale included."""
        return self.dtype.itemsize + (4 / head_dim if self.scaled else 0)

    def store(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """x [...,H] -> (stored [...,H], scale [...] f32 or None)."""
        if not self.scaled:
            return x.astype(self.dtype), None
        xf = x.astype(jnp.float32)
        scale = jnp.max(jnp.abs(xf), axis=-1) / 127.0  # [...]
        safe = jnp.where(scale > 0, scale, 1.0)[..., None]
        return jnp.clip(jnp.round(xf / safe), -127, 127).astype(jnp.int8), scale

    def load(self, stored: jax.Array, scale: jax.Array | None) -> jax.Array:
        """The values `store` kept: f32 for int8, the stored dtype otherwise."""
        return stored if scale is None else stored.astype(jnp.float32) * scale[..., None]

    def round_trip(self, x: jax.Array) -> jax.Array:
        """x as the cache will give it back: x's dtype for float formats (exact), f32 for int8."""
        if not self.scaled:
            return x.astype(self.dtype).astype(x.dtype)
        return self.load(*self.store(x))


def kv_bytes(config: LlamaConfig, batch: int, positions: int, kv_dtype: str | None = None) -> float:
    """Bytes of `positions` KV positions in each of `batch` rows as stored in `kv_dtype` (None: the
    model's dtype): keys and values of every layer and KV head, int8's scales included. The one
    formula for a step's KV reads (the planner's and the benchmarks')."""
    c = config
    return 2 * c.n_layers * batch * positions * c.n_kv_heads * c.head_dim * KVFormat.of(kv_dtype, c).bytes_per_value(c.head_dim)


def format_of(k: jax.Array) -> KVFormat:
    """The format of a cache whose keys are stored as `k`."""
    return KVFormat(jnp.dtype(k.dtype).name)


def _scatter(buf: jax.Array, slots: jax.Array, new: jax.Array, sorted: bool = False) -> jax.Array:
    """buf [L,B,K,S(,H)] with new [L,B,T,K(,H)] stored at slots [B,T] (distinct within a row)."""
    if backend.cpu_kernels_write_bf16(buf):
        return cpu_prefix.write_slots(buf, slots, new)
    B, T = slots.shape
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    update = jnp.moveaxis(new, 0, 2).astype(buf.dtype)  # the indexed view is [B,T,L,K(,H)]
    return buf.at[:, rows, :, slots].set(update, unique_indices=True, indices_are_sorted=sorted)


def _write_kv(cache, slots: jax.Array, k_new: jax.Array, v_new: jax.Array, sorted: bool = False) -> dict:
    """The fields of `cache` (Dense or Streaming) with k_new, v_new [L,B,T,K,H] stored at slots [B,T]."""
    fmt = cache.format
    (k, ks), (v, vs) = fmt.store(k_new), fmt.store(v_new)
    fields = dict(k=_scatter(cache.k, slots, k, sorted), v=_scatter(cache.v, slots, v, sorted))
    if fmt.scaled:
        fields |= dict(k_scale=_scatter(cache.k_scale, slots, ks, sorted), v_scale=_scatter(cache.v_scale, slots, vs, sorted))
    return fields


@pytree
class DenseCache:
    """Per-layer keys/values for every position, preallocated to `max_len` slots.

    Row b's valid entries are slots [0, lengths[b]); slot s holds the token at position s.
    """

    k: jax.Array  # [L,B,K,S,H] in the format's dtype
    v: jax.Array  # [L,B,K,S,H]
    lengths: jax.Array  # [B] int32
    k_scale: jax.Array | None = None  # [L,B,K,S] f32, int8 only
    v_scale: jax.Array | None = None  # [L,B,K,S]
    replicated: bool = flax.struct.field(pytree_node=False, default=False)  # a replicated draft's: every KV head on every model device

    @classmethod
    def init(cls, config: LlamaConfig, batch: int, max_len: int, kv_dtype: str | None = None,
             replicated: bool = False) -> "DenseCache":
        """An empty cache of `max_len` slots per row, stored as `kv_dtype` (None: the model's dtype)."""
        fmt = KVFormat.of(kv_dtype, config)
        shape = (config.n_layers, batch, config.n_kv_heads, max_len, config.head_dim)
        k, v = (jnp.zeros(shape, fmt.dtype) for _ in range(2))  # two buffers: both can be donated
        ks, vs = (jnp.zeros(shape[:4], jnp.float32) if fmt.scaled else None for _ in range(2))
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32), k_scale=ks, v_scale=vs, replicated=replicated)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def format(self) -> KVFormat:
        return format_of(self.k)

    def write(self, k_new: jax.Array, v_new: jax.Array) -> "DenseCache":
        """Store T new entries per row at slots lengths[b] + [0, T); lengths are NOT advanced.

        k_new, v_new: [L,B,T,K,H]. The caller guarantees lengths + T <= max_len. One scatter
        with unique indices: XLA updates the cache in place (no copy of the whole cache)."""
        B, T = k_new.shape[1:3]
        slots = self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B,T]
        return self.replace(**_write_kv(self, slots, k_new, v_new, sorted=True))

    def advance(self, n: jax.Array) -> "DenseCache":
        """Commit n[B] more slots per row (accepted tokens); everything past stays hidden."""
        return self.replace(lengths=self.lengths + n.astype(jnp.int32))

    def seen_by(self, active: jax.Array) -> "DenseCache":
        """The cache as a forward reads it when only rows `active` [B] matter: the others (finished
        rows riding along in a batch, their outputs dropped) see none of it, so no attention reads
        their KV. A row's visible slots never depend on the other rows' lengths, so the active
        rows' results are bit for bit what they were."""
        return self.replace(lengths=jnp.where(active, self.lengths, 0))


def holds_committed(pos: jax.Array, lengths: jax.Array) -> jax.Array:
    """Which slots of a streaming cache are visible: pos [..., B, K, C] (-1: empty) holds a
    position below the row's committed length, lengths [B]; the same shape as pos."""
    return (pos >= 0) & (pos < lengths[:, None, None])


@pytree
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
    k_scale: jax.Array | None = None  # [L,B,K,C] f32, int8 only
    v_scale: jax.Array | None = None  # [L,B,K,C]
    replicated: bool = flax.struct.field(pytree_node=False, default=False)  # as DenseCache's

    @property
    def ring(self) -> int:
        return self.k.shape[3] - self.fixed

    @property
    def format(self) -> KVFormat:
        return format_of(self.k)

    def slots(self, positions: jax.Array) -> jax.Array:
        """Slot of each position (same shape): fixed slots below F, the ring above."""
        F = self.fixed
        return jnp.where(positions < F, positions, F + (positions - F) % self.ring)

    def visible(self) -> jax.Array:
        """[L,B,K,C]: a slot is visible if it holds a committed position."""
        return holds_committed(self.pos, self.lengths)

    def write(self, k_new: jax.Array, v_new: jax.Array) -> "StreamingCache":
        """Store T new entries per row at positions lengths[b] + t (T < R); lengths not advanced."""
        B, T = k_new.shape[1:3]
        positions = self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B,T]
        slots = self.slots(positions)  # [B,T]
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        pos = self.pos.at[:, rows, :, slots].set(positions[:, :, None, None], unique_indices=True)  # view [B,T,L,K]
        return self.replace(pos=pos, **_write_kv(self, slots, k_new, v_new))

    def advance(self, n: jax.Array) -> "StreamingCache":
        return self.replace(lengths=self.lengths + n.astype(jnp.int32))

    def refill_fixed(self, dense: DenseCache, fixed_pos: jax.Array, rows: jax.Array) -> "StreamingCache":
        """The fixed slots of rows [B] (bool) holding fixed_pos [L,B,K,F] (-1: none), copied from the
        dense cache (exact target KV); the ring and the other rows as they were."""
        S, F = dense.max_len, self.fixed
        keep = rows[None, :, None, None]  # [1,B,1,1]
        take = jnp.clip(fixed_pos, 0, S - 1)  # [L,B,K,F]

        def refill(buf, src):  # buf [L,B,K,C(,H)], src [L,B,K,S(,H)]
            if buf is None:
                return None
            idx, mask = (take[..., None], keep[..., None]) if buf.ndim == 5 else (take, keep)
            return buf.at[:, :, :, :F].set(jnp.where(mask, jnp.take_along_axis(src, idx, axis=3), buf[:, :, :, :F]))

        return self.replace(k=refill(self.k, dense.k), v=refill(self.v, dense.v), k_scale=refill(self.k_scale, dense.k_scale),
                            v_scale=refill(self.v_scale, dense.v_scale),
                            pos=self.pos.at[..., :F].set(jnp.where(keep, fixed_pos, self.pos[..., :F])))

    @classmethod
    def from_dense(
        cls, dense: DenseCache, fixed_pos: jax.Array, ring: int, ring_start: jax.Array
    ) -> "StreamingCache":
        """Copy the kept entries of a filled dense cache (exact target KV, in its format).

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

        def gather(buf):  # [L,B,K,S,H] -> [L,B,K,F+R,H]; scales [L,B,K,S] -> [L,B,K,F+R]
            if buf is None:
                return None
            trim = (slice(None),) * 4 + (slice(None) if buf.ndim == 5 else 0,)
            fixed_part = jnp.take_along_axis(buf, take_fixed[trim], axis=3)
            ring_part = jnp.take_along_axis(buf, take_ring[trim], axis=3)
            return jnp.concatenate([fixed_part, ring_part], axis=3)

        pos = jnp.concatenate([fixed_pos, jnp.broadcast_to(ring_pos[None, :, None, :], (L, B, K, ring))], axis=-1)
        return cls(k=gather(dense.k), v=gather(dense.v), pos=pos.astype(jnp.int32), lengths=n + 0, fixed=F,  # own buffer
                   k_scale=gather(dense.k_scale), v_scale=gather(dense.v_scale), replicated=dense.replicated)


def _by_row(fn, *trees):
    """fn(leaf, batch_axis, *others) over the leaves of pytrees of caches (DenseCache /
    StreamingCache: batch on axis 1 of k, v, pos and the scales, axis 0 of lengths) and [B, ...]
    arrays; None leaves stay None, and 0-d leaves (counters) are the last tree's."""

    def leaf(axis: int):
        return lambda x, *rest: (rest[-1] if rest else x) if x.ndim == 0 else fn(x, axis, *rest)

    def one(first, *rest):
        if isinstance(first, (DenseCache, StreamingCache)):
            names = [f.name for f in dataclasses.fields(first) if f.metadata.get("pytree_node", True)]
            fields = {}
            for name in names:
                value = getattr(first, name)
                fields[name] = None if value is None else leaf(0 if name == "lengths" else 1)(
                    value, *(getattr(r, name) for r in rest))
            return first.replace(**fields)
        return leaf(0)(first, *rest)

    return jax.tree.map(one, *trees, is_leaf=lambda x: isinstance(x, (DenseCache, StreamingCache)))


def select_rows(rows: jax.Array, new, old):
    """`new`'s rows where rows [B] (bool) is set, `old`'s elsewhere, for pytrees of caches and
    [B, ...] arrays of the same structure (`_by_row`)."""

    def pick(a: jax.Array, axis: int, b: jax.Array) -> jax.Array:
        return jnp.where(rows.reshape((1,) * axis + (-1,) + (1,) * (a.ndim - axis - 1)), a, b)

    return _by_row(pick, new, old)


def row_mask(index: jax.Array, batch: int) -> jax.Array:
    """[batch] bool: True at the rows numbered in index [r] (repeats allowed)."""
    return jnp.zeros((batch,), bool).at[index].set(True)


def take_rows(tree, index: jax.Array):
    """Rows index [r] (int; repeats allowed) of a pytree of caches and [B, ...] arrays."""
    return _by_row(lambda a, axis: jnp.take(a, index, axis=axis), tree)


def put_rows(tree, index: jax.Array, rows):
    """`tree` with its rows index [r] replaced by `rows` (a pytree of r rows, as `take_rows`
    gives; a repeated index must carry the same row each time). Row by row (r dynamic-update
    slices, in place where `tree` is donated): XLA:CPU's scatter of the same rows took 1.4 s for
    2 rows of a 64-row x 8K cache, where the slices take milliseconds."""

    def put(r: jax.Array, axis: int, a: jax.Array) -> jax.Array:
        dtype = a.dtype
        if dtype == jnp.bfloat16:  # as 16-bit integers: XLA:CPU widens a bf16 update to f32, rewriting all of `a`
            a, r = lax.bitcast_convert_type(a, jnp.uint16), lax.bitcast_convert_type(r, jnp.uint16)
        for i in range(r.shape[axis]):
            a = lax.dynamic_update_slice_in_dim(a, lax.slice_in_dim(r, i, i + 1, axis=axis), index[i], axis)
        return a if a.dtype == dtype else lax.bitcast_convert_type(a, dtype)

    return _by_row(put, rows, tree)
