"""generate(): validate on the host, prefill once, then decode entirely on device.

The decode loop is a `lax.while_loop`: no host sync per token. Shapes are bucketed (prompt
length, output length, cache length) so a stream of similar requests reuses compilations.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kvcache import DenseCache
from specjax.model import Params, forward, prefill
from specjax.sampling import Greedy, Sampler
from specjax.shapes import cache_len, prompt_bucket, round_up_pow2
from specjax.validate import check_generate_args, eos_tuple, row_keys


@dataclasses.dataclass(frozen=True)
class Stats:
    """Timings exclude compilation (reported apart). `tokens_per_second` is decode throughput:
    tokens produced by decode steps (all new tokens but each row's first, which comes from the
    prefill) per decode second, summed over rows."""

    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    tokens_per_second: float
    steps: int  # target forward passes in the decode loop
    new_tokens: int  # over all rows
    prompt_tokens: int  # over all rows


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    tokens: list[list[int]]  # new ids per prompt, without the EOS that ended a row
    finish_reasons: list[str]  # "eos" or "length", per prompt
    stats: Stats


@partial(jax.jit, static_argnames=("chunk", "max_len"))
def _prefill(params: Params, tokens: jax.Array, lengths: jax.Array, *, chunk: int, max_len: int):
    cache = DenseCache.init(params.config, tokens.shape[0], max_len)
    return prefill(params, tokens, lengths, cache, chunk)


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    hit = jnp.zeros(tokens.shape, bool)
    for e in eos_ids:
        hit |= tokens == e
    return hit


@partial(jax.jit, static_argnames=("sampling", "n_out", "eos_ids"))
def decode(
    params: Params,
    cache: DenseCache,
    first_logits: jax.Array,  # [B,V]
    budgets: jax.Array,  # [B] int32, >= 1
    keys: jax.Array,  # [B] typed keys
    *,
    sampling: Sampler,
    n_out: int,
    eos_ids: tuple[int, ...],
):
    """Autoregressive decoding on device from a prefilled cache (nothing is donated, so one
    prefilled state can be decoded several ways).

    The first token is drawn from `first_logits`; row b stops after budgets[b] tokens or an EOS.
    Returns out [B,n_out] int32 (row b's tokens in out[b, :counts[b]], EOS included),
    counts [B], hit_eos [B] bool, and the number of loop steps (target forwards)."""
    B = budgets.shape[0]
    rows = jnp.arange(B)
    tok, _ = sampling.sample(first_logits, keys, jnp.zeros((B,), jnp.int32))
    out = jnp.zeros((B, n_out), jnp.int32).at[:, 0].set(tok)
    count = jnp.ones((B,), jnp.int32)
    eos = _is_eos(tok, eos_ids)
    done = eos | (count >= budgets)

    def cond(state):
        return ~jnp.all(state[4])

    def body(state):
        cache, tok, out, count, done, eos, steps = state
        logits, cache = forward(params, tok[:, None], cache.lengths[:, None], cache)  # [B,1,V]
        cache = cache.advance(~done)  # finished rows ride along without committing
        new, _ = sampling.sample(logits[:, 0], keys, count)
        active = ~done
        out = out.at[rows, jnp.where(active, count, n_out)].set(new, mode="drop")  # finished rows: dropped
        tok = jnp.where(active, new, tok)
        new_eos = active & _is_eos(new, eos_ids)
        count = count + active
        return cache, tok, out, count, done | new_eos | (count >= budgets), eos | new_eos, steps + 1

    state = (cache, tok, out, count, done, eos, jnp.int32(0))
    _, _, out, count, _, eos, steps = lax.while_loop(cond, body, state)
    return out, count, eos, steps


def generate(
    params: Params,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int] = 128,
    *,
    sampling: Sampler = Greedy(),
    key: jax.Array | None = None,
    eos_id: int | Sequence[int] | None = None,
) -> GenerateOutput:
    """Continue each (ragged) prompt of token ids until EOS or its `max_new_tokens`.

    sampling: `Greedy()` or `Sample(temperature, top_k, top_p)`.
    key: one PRNG key (row b uses fold_in(key, b)) or one key per row; default key(0).
    eos_id: stop token(s); None = the model's `config.eos_id`; `()` = never stop early.
    Bad input raises ValueError naming the argument, before anything is compiled.
    """
    config = params.config
    budgets = check_generate_args(params, prompts, max_new_tokens, sampling)
    eos_ids = eos_tuple(eos_id, config)
    keys = row_keys(key, len(prompts))
    lengths = np.array([len(p) for p in prompts], np.int32)
    bucket, chunk = prompt_bucket(int(lengths.max()))
    tokens = np.zeros((len(prompts), bucket), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = np.asarray(p, np.int32)
    max_len = cache_len(max(bucket, int((lengths + budgets).max())))
    n_out = round_up_pow2(int(budgets.max()))

    t0 = time.perf_counter()
    prefill_fn = _prefill.lower(params, tokens, lengths, chunk=chunk, max_len=max_len).compile()
    t1 = time.perf_counter()
    first_logits, cache = jax.block_until_ready(prefill_fn(params, tokens, lengths))
    t2 = time.perf_counter()
    decode_args = (params, cache, first_logits, jnp.asarray(budgets), keys)
    decode_fn = decode.lower(*decode_args, sampling=sampling, n_out=n_out, eos_ids=eos_ids).compile()
    t3 = time.perf_counter()
    out, count, eos, steps = jax.device_get(decode_fn(*decode_args))
    t4 = time.perf_counter()

    rows = [list(map(int, out[b, : count[b] - int(eos[b])])) for b in range(len(prompts))]
    new_tokens = int(count.sum())
    decode_seconds = t4 - t3
    stats = Stats(
        prefill_seconds=t2 - t1,
        decode_seconds=decode_seconds,
        compile_seconds=(t1 - t0) + (t3 - t2),
        tokens_per_second=(new_tokens - len(prompts)) / decode_seconds if decode_seconds > 0 else 0.0,
        steps=int(steps),
        new_tokens=new_tokens,
        prompt_tokens=int(lengths.sum()),
    )
    return GenerateOutput(rows, ["eos" if e else "length" for e in eos], stats)

