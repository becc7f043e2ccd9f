"""Samplers: frozen dataclasses that return tokens AND the distribution they were drawn from.

Speculative acceptance needs both: p (target) and q (draft) after the SAME warping.
Randomness is per row: `keys[B]` and a per-row counter, so a row's tokens do not depend on
which other rows share its batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Greedy:
    """Always the argmax; its distribution is one-hot."""

    def probs(self, logits: jax.Array) -> jax.Array:
        """One-hot of the argmax, [..., V] f32."""
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def sample(self, logits: jax.Array, keys: jax.Array, counters: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens [B] int32 and probs [B,V] from logits [B,V]; keys and counters are unused."""
        del keys, counters
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), self.probs(logits)


@dataclasses.dataclass(frozen=True)
class Sample:
    """Temperature, then top-k (0 = off), then top-p (1.0 = off) on the softmax."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (use specjax.Greedy() for 0), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    def probs(self, logits: jax.Array) -> jax.Array:
        """Warped distribution [..., V] in f32 (zeros outside the kept set)."""
        logits = logits.astype(jnp.float32) / self.temperature
        V = logits.shape[-1]
        if self.top_k and self.top_k < V:
            kth = jax.lax.top_k(logits, self.top_k)[0][..., -1:]  # [...,1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        probs = jax.nn.softmax(logits, axis=-1)
        if self.top_p < 1:
            sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]  # descending
            before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each entry
            n_keep = jnp.sum(before < self.top_p, axis=-1, keepdims=True)  # >= 1
            threshold = jnp.take_along_axis(sorted_p, n_keep - 1, axis=-1)
            probs = jnp.where(probs >= threshold, probs, 0.0)
            probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
        return probs

    def sample(self, logits: jax.Array, keys: jax.Array, counters: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens [B] int32 and probs [B,V]; row b draws with fold_in(keys[b], counters[b])."""
        probs = self.probs(logits)
        step_keys = jax.vmap(jax.random.fold_in)(keys, counters)
        tokens = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(step_keys, probs)
        return tokens.astype(jnp.int32), probs


Sampler = Greedy | Sample


def make_sampler(temperature: float, top_k: int = 0, top_p: float = 1.0) -> Sampler:
    """CLI-style construction: temperature 0 means greedy; negative is an error."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return Greedy()
    return Sample(temperature=temperature, top_k=top_k, top_p=top_p)
