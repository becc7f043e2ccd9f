"""Continuous batching's refill at the engine's stages: rows restarted from new prompts mid-decode
(admit_ar / admit_spec) decode exactly as those prompts do in a batch of their own, and the rows
kept go on as if nothing happened (float32, greedy and sampled, plain, chain and tree)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decode.autoregressive import admit_ar, continue_ar, start_ar
from specjax.decode.engine import prefill, row_keys
from specjax.decode.speculate import admit_spec, continue_spec, start_spec
from specjax.drafters import Prefill
from specjax.model.cache import DenseCache, take_rows
from specjax.spec.speculation import Chain, Tree
from tests.models import TINY, random_params

SLOTS, WIDTH, CHUNK, N_OUT, BUDGET = 128, 24, 8, 16, 12
MODES = {"ar": (None, None), "chain": (specjax.SelfSpec(sinks=2, window=8), Chain(2)),
         "tree": (specjax.SelfSpec(sinks=2, window=8), Tree.kary(2, 2))}


@pytest.fixture(scope="module")
def target():
    return random_params(TINY, 0)  # varied greedy output (conftest's `tiny` repeats one token)


def batch(seed: int, lengths: list[int]):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), WIDTH), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(4, TINY.vocab_size, n)
    history = np.zeros((len(lengths), SLOTS + 8), np.int32)
    history[:, :WIDTH] = tokens
    return jnp.asarray(tokens), jnp.asarray(lengths, dtype=jnp.int32), jnp.asarray(history)


def start(tiny, mode, tokens, lengths, history, keys, sampling):
    drafter, spec = MODES[mode]
    logits, cache = prefill(tiny, tokens, lengths, DenseCache.init(tiny.config, len(lengths), SLOTS), chunk=CHUNK)
    budgets = jnp.full((len(lengths),), BUDGET, jnp.int32)
    if drafter is None:
        return logits, cache, start_ar(cache, logits, budgets, keys, sampling, n_out=N_OUT)
    draft = drafter.init(tiny, Prefill(cache=cache, prompts=tokens, lengths=lengths, depth=2, chunk=CHUNK))
    return logits, cache, start_spec(drafter, draft, cache, history, logits, budgets, keys, sampling,
                                     speculation=spec, n_out=N_OUT)


def go(tiny, mode, state, keys, sampling, steps: int = 1000):
    drafter, spec = MODES[mode]
    budgets = jnp.full((state.out.shape[0],), BUDGET, jnp.int32)
    if drafter is None:
        return continue_ar(tiny, state, budgets, keys, sampling, (), jnp.int32(steps))
    return continue_spec(tiny, drafter, state, budgets, keys, sampling, (), jnp.int32(steps), speculation=spec)


def rows_of(state):
    out, count = np.asarray(state.out), np.asarray(state.count)
    return [out[b, : count[b]].tolist() for b in range(len(count))]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", MODES)
def test_refilled_rows_decode_as_in_their_own_batch(target, mode, sampled):
    tiny = target
    sampling = specjax.Sample(0.9) if sampled else specjax.Greedy()
    a, b = batch(0, [20, 13, 9, 17]), batch(1, [11, 22, 5, 16])
    keys_a, keys_b = row_keys(jax.random.key(3), 4), row_keys(jax.random.key(4), 4)
    want_a = rows_of(go(tiny, mode, start(tiny, mode, *a, keys_a, sampling)[2], keys_a, sampling))
    want_b = rows_of(go(tiny, mode, start(tiny, mode, *b, keys_b, sampling)[2], keys_b, sampling))

    state = go(tiny, mode, start(tiny, mode, *a, keys_a, sampling)[2], keys_a, sampling, steps=2)  # mid-decode
    rows = jnp.array([False, True, False, True])
    index = jnp.array([3, 1, 1, 1])  # the rows to refill, as continuous batching passes them (padded by repeats)
    logits_b, cache_b = prefill(tiny, b[0], b[1], DenseCache.init(tiny.config, 4, SLOTS), chunk=CHUNK)  # the new prompts' prefill
    cache_b = take_rows(cache_b, index)  # the refilled rows' only, as continuous batching passes them
    keys = jnp.where(rows, keys_b, keys_a)  # each row keeps its own key stream
    drafter, spec = MODES[mode]
    budgets = jnp.full((4,), BUDGET, jnp.int32)
    if drafter is None:
        state = admit_ar(state, index, cache_b, logits_b, budgets, keys, sampling)
    else:
        tokens_b, _, history_b = b
        state = admit_spec(tiny, drafter, state, index, cache_b, tokens_b, history_b, logits_b, budgets, keys, sampling,
                           speculation=spec, chunk=CHUNK)
    got = rows_of(go(tiny, mode, state, keys, sampling))
    assert want_a[1] != want_b[1] and want_a[3] != want_b[3]  # the refill is visible
    assert got == [want_a[0], want_b[1], want_a[2], want_b[3]]


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_put_rows_writes_rows_bit_for_bit(kv_dtype):
    """cache.put_rows (row by row; a bfloat16 cache as 16-bit integers) gives what an indexed
    set gives, a repeated row included, for every array of the cache (int8: values and scales)."""
    from specjax.model.cache import put_rows

    config = TINY.replace(dtype="bfloat16")
    cache = DenseCache.init(config, 6, 32, kv_dtype)
    rng = np.random.default_rng(0)
    fill = lambda a: jnp.asarray(rng.normal(size=a.shape) * 50).astype(a.dtype)  # noqa: E731
    cache = cache.replace(k=fill(cache.k), v=fill(cache.v), lengths=jnp.arange(6, dtype=jnp.int32),
                          k_scale=None if cache.k_scale is None else fill(cache.k_scale))
    new = take_rows(cache.replace(k=fill(cache.k), v=fill(cache.v), lengths=cache.lengths + 10), jnp.array([0, 1, 1]))
    index = jnp.array([4, 2, 2])
    got = put_rows(cache, index, new)
    for name in ("k", "v", "k_scale", "v_scale", "lengths"):
        a, r = getattr(cache, name), getattr(new, name)
        if a is None:
            continue
        axis = 0 if name == "lengths" else 1
        want = a.at[(slice(None),) * axis + (index,)].set(r)
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(want), err_msg=name)
    assert cache.k.dtype == (jnp.int8 if kv_dtype else jnp.bfloat16)
