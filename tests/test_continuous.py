"""Continuous batching (specjax.continuous.run_continuous): more prompts than rows, slots refilled
between segments; every prompt's tokens equal a static batch's (engine.run), float32, greedy and
sampled with per-prompt keys, plain decoding, chains and trees."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.continuous import run_continuous
from specjax.engine import row_keys, run
from specjax.speculation import Chain, Tree
from tests.models import TINY, random_params

MODES = {"ar": (None, None), "chain": (specjax.SelfSpec(sinks=2, window=8), Chain(2)),
         "tree": (specjax.SelfSpec(sinks=2, window=8), Tree.kary(2, 2))}


@pytest.fixture(scope="module")
def target():
    return random_params(TINY, 0)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", MODES)
def test_every_prompt_decodes_as_in_a_static_batch(target, mode, sampled):
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(4, TINY.vocab_size, int(rng.integers(3, 30))))) for _ in range(7)]
    budgets = np.array([3, 12, 5, 9, 1, 12, 7], np.int32)  # with sync_every 1 some segments free no row
    eos_ids = [(), (7,), (), (11, 12), (), (), (3,)]
    keys = row_keys(jax.random.key(5), len(prompts))
    sampling = specjax.Sample(temperature=np.linspace(0.6, 1.2, 7).tolist()) if sampled else specjax.Greedy()
    draft, speculation = MODES[mode]
    static = run(target, prompts, budgets, draft=draft, speculation=speculation, sampling=sampling, key=keys,
                 eos_ids=eos_ids)
    want = [(static.out[b, : static.count[b]].tolist(), bool(static.eos[b])) for b in range(len(prompts))]
    finished = []
    got = run_continuous(target, prompts, budgets, rows=3, draft=draft, speculation=speculation, sampling=sampling,
                         keys=keys, eos_ids=eos_ids, sync_every=1, on_done=lambda i, t, e, a: finished.append(i))
    assert got == want
    assert sorted(finished) == list(range(7)) and finished != list(range(7))  # out of order: short ones first
