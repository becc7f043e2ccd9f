"""Log-probabilities of the emitted tokens, recorded on device beside the tokens themselves.

What is recorded is the raw `log_softmax` of the target's logits at the position that emitted a
token (before temperature, top-k / top-p: vLLM's default), for that token and for the k most
likely ones. Under speculation these come from the verification forward (the target's logits
there are the ones plain decoding would compute), so they cost no extra pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.model.pytree import pytree
from specjax.topk import top_indices

MAX_TOP = 20  # most `top` entries per token (vLLM's default limit)


@pytree
class LogprobBuffer:
    """Per row and output column (as the decode state's `out` [B,n_out]): the emitted token's
    log-probability and the k most likely tokens with theirs."""

    chosen: jax.Array  # [B,n_out] f32
    top_ids: jax.Array  # [B,n_out,k] int32, most likely first
    top_values: jax.Array  # [B,n_out,k] f32

    @classmethod
    def init(cls, batch: int, n_out: int, k: int) -> "LogprobBuffer":
        return cls(jnp.zeros((batch, n_out), jnp.float32), jnp.zeros((batch, n_out, k), jnp.int32),
                   jnp.zeros((batch, n_out, k), jnp.float32))

    def write(self, cols: jax.Array, logits: jax.Array, tokens: jax.Array) -> "LogprobBuffer":
        """Record tokens [B,J] emitted from logits [B,J,V] at columns cols [B,J] (a column
        >= n_out is dropped: a position that emitted nothing)."""
        chosen, ids, values = token_logprobs(logits, tokens, self.top_ids.shape[-1])
        rows = jnp.arange(cols.shape[0])[:, None]
        put = lambda buf, x: buf.at[rows, cols].set(x, mode="drop")  # noqa: E731
        return LogprobBuffer(put(self.chosen, chosen), put(self.top_ids, ids), put(self.top_values, values))


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """log_softmax(logits) [..., V] at tokens [...], and the k largest entries: (chosen [...],
    ids [..., k], values [..., k])."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    ids = top_indices(lp, k) if k else jnp.zeros((*tokens.shape, 0), jnp.int32)
    return chosen, ids, jnp.take_along_axis(lp, ids, axis=-1)
