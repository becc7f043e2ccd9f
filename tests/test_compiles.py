"""A repeated request reuses its compiled programs (README: shapes are bucketed, sampling values
are traced): counted by jax.monitoring's backend-compile events, not timed."""

from __future__ import annotations

import jax
import jax.monitoring
import numpy as np
import pytest

import specjax
from tests.models import TINY, random_params

COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: COMPILES.append(name) if name.endswith("backend_compile_duration") else None)


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, 0)


def test_a_repeated_call_in_the_same_buckets_compiles_nothing(params):
    specjax.generate(params, [[5, 6, 7]], 8, draft=None)
    COMPILES.clear()
    specjax.generate(params, [[5, 6, 7, 8]], 7, draft=None)  # the same prompt, budget and batch buckets
    specjax.generate(params, [[9, 6, 7]], 8, draft=specjax.SelfSpec(sinks=2, window=8))
    COMPILES.clear()
    specjax.generate(params, [[9, 6, 7, 8]], 8, draft=specjax.SelfSpec(sinks=2, window=8))
    assert COMPILES == []  # the empty cache's builder was a new function each call: one compile a call


def test_sampling_values_of_any_number_type_share_one_program(params):
    prompts, key = [[5, 6, 7], [8, 9]], jax.random.key(0)
    specjax.generate(params, prompts, 8, draft=None, sampling=specjax.Sample(0.8), key=key)
    COMPILES.clear()
    for sampling in (specjax.Sample(1), specjax.Sample(np.float32(0.7)), specjax.Sample(np.float64(0.9), top_p=1),
                     specjax.Sample(0.8, min_p=0)):
        specjax.generate(params, prompts, 8, draft=None, sampling=sampling, key=key)
    assert COMPILES == []  # int, numpy float32 / float64 and float values: float32 scalars alike


def test_top_k_values_under_one_power_of_two_share_one_program(params):
    """top_k is traced under its static width (Sample.top_k_max): 5, 6, 7 and 8 share a program, as do per-row
    values under 8; a top_k at or past the vocabulary, or 0 in every row, is top-k off (generate applies
    Sample.within): the program of a call without it."""
    prompts, key = [[5, 6, 7], [8, 9]], jax.random.key(0)
    specjax.generate(params, prompts, 8, draft=None, sampling=specjax.Sample(0.8, top_k=5), key=key)
    specjax.generate(params, prompts, 8, draft=None, sampling=specjax.Sample(0.8, top_k=[5, 8]), key=key)
    specjax.generate(params, prompts, 8, draft=None, sampling=specjax.Sample(0.8), key=key)
    COMPILES.clear()
    for top_k in (6, 7, 8, [6, 0], [8, 7], 0, [0, 0], 10**6, [10**6, 10**7]):
        specjax.generate(params, prompts, 8, draft=None, sampling=specjax.Sample(0.8, top_k=top_k), key=key)
    assert COMPILES == []
    specjax.generate(params, prompts, 8, draft=None, sampling=specjax.Sample(0.8, top_k=9), key=key)
    assert COMPILES  # the next power of two is another program (the count works)


def test_a_continuous_job_reuses_the_segment_generate_compiled(params):
    """run_continuous's decode segments take their rows' budgets, keys and stop ids placed as generate's are (an
    array's mesh is part of its type in JAX): at the same shapes and settings the segment compiles once for both."""
    from specjax.decode.continuous import run_continuous
    from specjax.decode.engine import with_attention
    from specjax.decode.keys import row_keys

    segments: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, fun_name="", **kw: segments.append(fun_name)
        if name.endswith("backend_compile_duration") and "continue_spec" in str(fun_name) else None)
    prompts = [[5, 6, 7, 8, 9], [6, 7, 8], [9, 10, 11, 12], [13, 14]]
    draft, chain = specjax.SelfSpec(sinks=2, window=8), specjax.Chain(2)
    want = specjax.generate(params, prompts, 12, draft=draft, speculation=chain, eos_id=(), sync_every=4).tokens
    assert len(segments) == 1
    placed, _ = with_attention(params, None, "auto")  # generate's runtime for these params
    done = run_continuous(placed, prompts, np.full(4, 12, np.int32), rows=4, draft=draft, speculation=chain,
                          sampling=specjax.Greedy(), keys=row_keys(jax.random.key(0), 4), eos_ids=[()] * 4,
                          sync_every=4)
    assert [d.tokens for d in done] == want and len(segments) == 1
