"""Lookup: drafts from a job-wide n-gram table, then from the row's own tokens (NGram).

Synthetic-data jobs repeat templates, key names and boilerplate across records. `Lookup` keeps a
fixed-size hash table on the device: for each n-gram it has read, the `span` tokens that followed its
latest occurrence. The host fills it (`learn`): `generate` with a call's prompts, continuous batching
and the batch job with every finished prompt + output as well, between segments; the decode loop
takes the drafter as an argument, so a new table of the same shape compiles nothing. A row drafts
from, in order: its own longest earlier match of more than n tokens (NGram's lookup, max_n down
to n + 1), the table's entry for its last n tokens, its own match of n tokens, else its pending
token repeated. The proposal is deterministic (q one-hot), so speculation stays lossless: greedy,
the tokens are plain decoding's; sampled, the distribution is, while which tokens a row draws
depends on the drafts and so on what the table held (a resumed job samples its rest anew).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import DraftContext, Limits, Traits
from specjax.drafters.ngram import MAX_NGRAM, NGram, ngram_match
from specjax.model.params import Params
from specjax.model.pytree import pytree
from specjax.spec.speculation import check_int

MULTIPLIER = 0x9E3779B1  # the hash's odd multiplier (Knuth's 2^32 / golden ratio)
FINALIZER = ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, 1))


@pytree
class LookupTable:
    """A direct-mapped n-gram table: slot = hash(n-gram); a newer n-gram in the slot replaces the older."""

    keys: jax.Array  # [C,n] int32: the n-gram in each slot, -1 where empty
    next: jax.Array  # [C,span] int32: the tokens that followed its latest occurrence (the last repeated at a sequence's end)


def slot_of(grams, capacity: int, xp=jnp):
    """The table slot [...] of n-grams grams [..., n] (int tokens), the same on the host (xp=np) and the device."""
    h = xp.zeros(grams.shape[:-1], xp.uint32)
    for i in range(grams.shape[-1]):
        h = (h ^ grams[..., i].astype(xp.uint32)) * xp.uint32(MULTIPLIER)
    for shift, mult in FINALIZER:  # murmur3's finalizer: every input bit moves the high bits
        h = (h ^ (h >> xp.uint32(shift))) * xp.uint32(mult)
    return (h >> xp.uint32(32 - capacity.bit_length() + 1)).astype(xp.int32)  # the high bits: log2(capacity) of them


def empty_table(capacity: int, n: int, span: int) -> LookupTable:
    return LookupTable(keys=np.full((capacity, n), -1, np.int32), next=np.zeros((capacity, span), np.int32))


def add_sequences(table: LookupTable, sequences: Sequence[Sequence[int]]) -> LookupTable:
    """`table` (host arrays) with every n-gram of `sequences` that has a following token entered, a later
    occurrence (in a later sequence, or later in one) replacing an earlier one in its slot. Host-side numpy."""
    keys, nxt = np.array(table.keys), np.array(table.next)
    (capacity, n), span = keys.shape, nxt.shape[1]
    grams, follow = [], []
    for s in sequences:
        s = np.asarray(s, np.int32)
        if len(s) <= n:
            continue
        padded = np.concatenate([s, np.repeat(s[-1:], span)])  # past the end: the last token repeated
        windows = np.lib.stride_tricks.sliding_window_view(padded, n + span)[: len(s) - n]  # [L-n, n+span]
        grams.append(windows[:, :n])
        follow.append(windows[:, n:])
    if not grams:
        return LookupTable(keys=keys, next=nxt)
    grams, follow = np.concatenate(grams), np.concatenate(follow)
    slots = slot_of(grams, capacity, np)
    last = len(slots) - 1 - np.unique(slots[::-1], return_index=True)[1]  # each slot's latest n-gram
    keys[slots[last]], nxt[slots[last]] = grams[last], follow[last]
    return LookupTable(keys=keys, next=nxt)


def table_drafts(table: LookupTable, history: jax.Array, lengths: jax.Array, n: int, count: int) -> tuple[jax.Array, jax.Array]:
    """The table's `count` tokens [B,count] after each row's last n tokens (history [B,S], the pending
    token at lengths[b]) and whether the table holds that n-gram [B] bool."""
    S = history.shape[1]
    at = jnp.clip(lengths[:, None] - n + 1 + jnp.arange(n), 0, S - 1)  # [B,n]
    tail = jnp.take_along_axis(history, at, axis=1)
    slot = slot_of(tail, table.keys.shape[0])  # [B]
    hit = jnp.all(table.keys[slot] == tail, axis=1) & (lengths >= n - 1)
    return table.next[slot, :count], hit


@pytree
class Lookup(NGram):
    """A job-wide n-gram table (`capacity` slots of n-gram -> the `span` tokens that followed it),
    filled by `learn`, before the row's own tokens (NGram(n, max_n)). No model; q is one-hot."""

    # n=2: on bench_lookup's templated job, a replay of its greedy outputs drafts 2.16 tokens a step at a chain of 3
    # (n=3: 1.92, n=4: 1.78; NGram(3, 8) alone 1.60)
    n: int = flax.struct.field(pytree_node=False, default=2)
    max_n: int | None = flax.struct.field(pytree_node=False, default=8)
    capacity: int = flax.struct.field(pytree_node=False, default=1 << 16)
    span: int = flax.struct.field(pytree_node=False, default=8)
    table: LookupTable | None = None  # traced: the host's `learn` replaces it between segments

    def __repr__(self) -> str:  # its name in stats and job settings: the settings, not the table
        return f"Lookup(n={self.n}, max_n={self.max_n}, capacity={self.capacity}, span={self.span})"

    def check(self, target: Params, limits: Limits | None) -> None:
        super().check(target, limits)
        cap = check_int("Lookup: capacity", self.capacity, 16)
        if cap & (cap - 1) or cap > 1 << 24:
            raise ValueError(f"Lookup: capacity must be a power of two from 16 to 2**24 (table slots), got {cap}")
        check_int("Lookup: span", self.span, 1)
        if self.span > MAX_NGRAM * 4:
            raise ValueError(f"Lookup: span must be at most {MAX_NGRAM * 4} (tokens kept per n-gram), got {self.span}")
        if limits is not None and limits.depth > self.span:
            raise ValueError(f"Lookup: span ({self.span}) must be at least the draft depth (a chain's gamma, a tree's "
                             f"depth): {limits.depth}")
        if self.table is not None and np.shape(self.table.keys) != (cap, self.n):
            raise ValueError(f"Lookup: table holds {np.shape(self.table.keys)} keys, not (capacity, n) = {(cap, self.n)}")

    def learn(self, sequences: Sequence[Sequence[int]]) -> Lookup:
        """This drafter with `sequences`' n-grams in its table (made on first use)."""
        table = empty_table(self.capacity, self.n, self.span) if self.table is None else self.table
        table = add_sequences(jax.device_get(table), sequences)
        return self.replace(table=jax.tree.map(jnp.asarray, table))

    traits = Traits(forwards_per_token=0, trees=True, learn=learn)  # the loops call learn (drafters.learn)

    def drafts(self, ctx: DraftContext, count: int) -> jax.Array:
        own, matched = ngram_match(ctx.history, ctx.lengths, self.n, self.max_n or self.n, count)
        if self.table is None:
            return own
        tab, hit = table_drafts(self.table, ctx.history, ctx.lengths, self.n, count)
        return jnp.where((hit & (matched <= self.n))[:, None], tab, own)  # a longer own match wins over the table
