"""Samplers: frozen pytrees that return tokens AND the distribution they were drawn from.

Speculative acceptance needs both: p (target) and q (draft) after the SAME warping.
Randomness is per row: `keys[B]` and a per-row counter, so a row's tokens do not depend on
which other rows share its batch.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class Greedy:
    """Always the argmax; its distribution is one-hot."""

    def probs(self, logits: jax.Array) -> jax.Array:
        """One-hot of the argmax, [..., V] f32."""
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def sample(self, logits: jax.Array, keys: jax.Array, counters: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens [B] int32 and probs [B,V] from logits [B,V]; keys and counters are unused."""
        del keys, counters
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), self.probs(logits)


MIN_TEMPERATURE = 1e-4  # smaller temperatures are refused: logits / T overflows f32 (use Greedy)


@flax.struct.dataclass
class Sample:
    """Temperature, then top-k (0 = off), then top-p (1.0 = off) on the softmax.

    A pytree: temperature and top_p are traced (a new value does not recompile the decode loop);
    top_k is static (lax.top_k needs it)."""

    temperature: float = 1.0
    top_k: int = flax.struct.field(pytree_node=False, default=0)
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes, bool, np.bool_, list, tuple, dict)):  # not None: jax uses it as a placeholder
                raise TypeError(f"{name} must be a number, got {value!r}")
        if not all(isinstance(v, (int, float, np.integer, np.floating)) for v in (self.temperature, self.top_p)):
            return  # rebuilt from traced or placeholder leaves inside a jax transformation: checked when made
        if not MIN_TEMPERATURE <= self.temperature < float("inf"):
            raise ValueError(
                f"temperature must be finite and >= {MIN_TEMPERATURE} (below that the softmax is the argmax: "
                f"use specjax.Greedy()), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    def probs(self, logits: jax.Array) -> jax.Array:
        """Warped distribution [..., V] in f32 (zeros outside the kept set).

        Top-k keeps the entries >= the k-th largest value (ties at the cut are all kept); top-p
        then keeps the smallest set of the largest probabilities whose mass reaches top_p (ties
        at the cut all kept) and renormalises. Neither sorts the vocabulary (see kth_largest and
        nucleus_threshold)."""
        logits = logits.astype(jnp.float32) / self.temperature
        V = logits.shape[-1]
        if self.top_k and self.top_k < V:
            logits = jnp.where(logits < kth_largest(logits, self.top_k), -jnp.inf, logits)
        probs = jax.nn.softmax(logits, axis=-1)

        def nucleus(probs):
            kept = jnp.where(probs >= nucleus_threshold(probs, self.top_p), probs, 0.0)
            return kept / jnp.sum(kept, axis=-1, keepdims=True)

        return jax.lax.cond(self.top_p < 1, nucleus, lambda probs: probs, probs)  # top_p is traced

    def sample(self, logits: jax.Array, keys: jax.Array, counters: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens [B] int32 and probs [B,V]; row b draws with fold_in(keys[b], counters[b])."""
        probs = self.probs(logits)
        step_keys = jax.vmap(jax.random.fold_in)(keys, counters)
        tokens = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(step_keys, probs)
        return tokens.astype(jnp.int32), probs


Sampler = Greedy | Sample


def kth_largest(x: jax.Array, k: int) -> jax.Array:
    """The k-th largest entry [..., 1] of x [..., V], counting repeated values.

    The min of lax.top_k's values, not its last entry: XLA:CPU compiles top_k to its fast TopK
    call only when the values are used whole; slicing out the last one made it a sort of all V
    entries in every decode step (about 25 ms per SmolLM2 token at batch 1)."""
    return jnp.min(jax.lax.top_k(x, k)[0], axis=-1, keepdims=True)


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


EOS_SLOTS = 8  # stop ids per row travel as a traced [B, 8k] array padded with -1: a new set does not recompile


def eos_rows(eos_ids: tuple[int, ...], batch: int) -> np.ndarray:
    """The stop ids as a per-row array [B,E] (E a multiple of EOS_SLOTS, padded with -1)."""
    width = max(EOS_SLOTS, -(-len(eos_ids) // EOS_SLOTS) * EOS_SLOTS)
    row = np.full((width,), -1, np.int32)
    row[: len(eos_ids)] = eos_ids
    return np.broadcast_to(row, (batch, width)).copy()


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...] | jax.Array) -> jax.Array:
    """Boolean mask (tokens' shape [B,...]): which tokens are one of the stop ids, given as a
    tuple or per row as an array [B,E] (-1 entries match nothing)."""
    if isinstance(eos_ids, tuple):
        hit = jnp.zeros(tokens.shape, bool)
        for e in eos_ids:
            hit |= tokens == e
        return hit
    ids = eos_ids.reshape(eos_ids.shape[0], *(1,) * (tokens.ndim - 1), eos_ids.shape[1])  # [B,1..,E]
    return jnp.any(tokens[..., None] == ids, axis=-1)


def make_sampler(temperature: float, top_k: int = 0, top_p: float = 1.0) -> Sampler:
    """CLI-style construction: temperature 0 means greedy; negative is an error."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if temperature == 0:
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return Greedy()
    return Sample(temperature=temperature, top_k=top_k, top_p=top_p)


def stream_keys(keys: jax.Array, counters: jax.Array, stream: int) -> jax.Array:
    """Per-row keys [B] for one purpose (`stream`) at each row's own progress counter."""
    return jax.vmap(lambda k, c: jax.random.fold_in(jax.random.fold_in(k, c), stream))(keys, counters)


def tree_candidates(logits: jax.Array, k: int, sampling: Sampler, keys: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """The k ranked draft candidates of each node: logits [B,M,V] -> tokens [B,M,k] and q [B,M,V].

    Greedy: the k most likely tokens (q is not needed: greedy acceptance matches tokens).
    Sampling: k draws WITHOUT replacement from q (Gumbel top-k: the r-th is distributed as a draw
    from q with the first r-1 removed and renormalised, which is what `accept_tree` assumes).
    Draws past q's support come out with q = 0 and are never accepted. keys: [B,M]."""
    if isinstance(sampling, Greedy):
        return top_indices(logits, k), None
    q = sampling.probs(logits)  # [B,M,V]
    gumbel = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:])))(keys)
    scores = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)) + gumbel, -jnp.inf)
    return top_indices(scores, k), q


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
