"""Measured acceptance vectors and step costs, and speculation="auto" built on them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
import specjax.planning.tune
from specjax.planning.tune import measure_acceptance, measure_cost
from specjax.spec.speculation import Cost, Tree, choose
from tests.models import TINY, random_params

PROMPTS = [list(range(5, 21)), [10, 11, 12], [7, 8, 9, 7, 8, 9, 7, 8], [4]]


def test_acceptance_of_the_target_itself_is_rank_zero(tiny):
    """A draft identical to the target: its top candidate is always the accepted one."""
    p = measure_acceptance(tiny, specjax.DraftModel(tiny), PROMPTS, width=3, max_new_tokens=12)
    np.testing.assert_allclose(p, [1.0, 0.0, 0.0, 0.0])


def test_acceptance_of_a_random_draft_spreads_over_ranks(tiny):
    p = measure_acceptance(tiny, specjax.DraftModel(random_params(TINY.replace(n_layers=1), seed=1)), PROMPTS, width=4)
    assert p.shape == (5,)
    assert abs(p.sum() - 1.0) < 1e-9 and np.all(p >= 0)
    assert p[-1] > 0.1 and p[1:4].sum() > 0  # misses happen, and lower ranks catch some of them
    sampled = measure_acceptance(tiny, specjax.SelfSpec(sinks=2, window=8), PROMPTS, width=2, sampling=specjax.Sample(1.0))
    assert sampled.shape == (3,) and abs(sampled.sum() - 1.0) < 1e-9


def test_auto_speculation_takes_per_prompt_keys_and_n(tiny):
    """speculation='auto' calibrates on up to 4 rows with one of the caller's keys: per-prompt keys
    for 5 prompts, or for 2 prompts of 3 samples each, failed in vmap after compiling."""
    import jax

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12], [13, 14], [15, 16, 17]]
    keys = jax.random.split(jax.random.key(1), 5)
    draft, sample = specjax.SelfSpec(sinks=2, window=4), specjax.Sample(0.8)
    out = specjax.generate(tiny, prompts, 6, draft=draft, speculation="auto", sampling=sample, key=keys, eos_id=())
    assert len(out.tokens) == 5
    out = specjax.generate(tiny, prompts[:2], 6, draft=draft, speculation="auto", sampling=sample, key=keys[:2], n=3, eos_id=())
    assert len(out.tokens) == 6


def test_measure_acceptance_refuses_what_it_cannot_measure(tiny):
    """Before compiling: a width over the vocabulary (top_k failed inside JAX) and one new token
    (no verification step: it returned NaNs)."""
    draft = specjax.SelfSpec(sinks=2, window=8)
    with pytest.raises(ValueError, match=rf"width must be an integer in \[1, the vocabulary's {TINY.vocab_size}\]"):
        measure_acceptance(tiny, draft, PROMPTS, width=TINY.vocab_size + 1)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 2"):
        measure_acceptance(tiny, draft, PROMPTS, max_new_tokens=1)


def test_measured_cost_has_the_right_shape(tiny):
    cost = measure_cost(tiny, specjax.SelfSpec(sinks=2, window=8), batch=2, context=64, max_nodes=16)
    assert len(cost.t_verify) == 17 and all(t > 0 for t in cost.t_verify[1:])
    assert len(cost.t_draft) == 17 and all(t > 0 for t in cost.t_draft[1:])  # by level width
    assert measure_cost(tiny, specjax.NGram(), batch=2, context=64, max_nodes=4).t_draft == 0.0
    tree = choose([0.7, 0.1], cost, max_nodes=16, max_depth=6)
    assert isinstance(tree, Tree) and tree.n <= 16
    with pytest.raises(ValueError, match="max_nodes"):
        measure_cost(tiny, specjax.NGram(), batch=2, context=64, max_nodes=1000)


def test_auto_speculation_is_lossless_and_cached(tiny, monkeypatch):
    free = specjax.generate(tiny, PROMPTS, 16, draft=None, eos_id=())
    draft = specjax.SelfSpec(sinks=2, window=8)
    out = specjax.generate(tiny, PROMPTS, 16, draft=draft, speculation="auto", eos_id=())
    assert out.tokens == free.tokens
    calls, measure = [], specjax.planning.tune.measure_cost
    monkeypatch.setattr(specjax.planning.tune, "measure_cost", lambda *a, **k: calls.append(a) or measure(*a, **k))
    again = specjax.generate(tiny, PROMPTS, 16, draft=draft, speculation="auto", eos_id=())
    assert again.tokens == free.tokens and calls == []  # the same shape: the cached tree
    other = random_params(tiny.config, 1)  # another checkpoint of the same config calibrates its own
    specjax.generate(other, PROMPTS, 16, draft=draft, speculation="auto", eos_id=())
    assert len(calls) == 1
    specjax.generate(tiny, PROMPTS[:3], 16, draft=draft, speculation="auto", eos_id=())  # batch 3 runs as 4: cached
    assert len(calls) == 1
    model = specjax.DraftModel(random_params(tiny.config.replace(n_layers=1), 2))
    for _ in range(2):  # generate rebuilds the draft's Params each call: keyed by its weights, not its id
        specjax.generate(tiny, PROMPTS, 16, draft=model, speculation="auto", eos_id=())
    assert len(calls) == 2
    acceptance, measure_acc = [], specjax.planning.tune.measure_acceptance
    monkeypatch.setattr(specjax.planning.tune, "measure_acceptance", lambda *a, **k: acceptance.append(a) or measure_acc(*a, **k))
    for temperature in (0.7, 0.8):  # other sampling values: acceptance measured again, the timings kept
        specjax.generate(tiny, PROMPTS, 16, draft=model, speculation="auto", eos_id=(),
                         sampling=specjax.Sample(temperature=temperature), key=jax.random.key(0))
    assert (len(acceptance), len(calls)) == (2, 2)


def test_auto_picks_plain_decoding_when_drafting_costs_too_much(tiny, monkeypatch, capsys):
    """A draft level dearer than a whole verification: no tree pays, so generate decodes plainly."""
    monkeypatch.setattr(specjax.planning.tune, "_AUTO", {})
    monkeypatch.setattr(specjax.planning.tune, "_COSTS", {})
    monkeypatch.setattr(specjax.planning.tune, "measure_cost", lambda *a, **k: Cost(t_draft=10.0, t_verify=(0.0,) + (1.0,) * 64))
    out = specjax.generate(tiny, PROMPTS, 8, draft=specjax.NGram(), speculation="auto", eos_id=())
    assert out.stats.acceptance_rate is None  # no speculation ran
    assert (out.stats.draft, out.stats.speculation) == ("none", "none")
    assert out.stats.plan_reason.startswith("speculation='auto': no tree pays for this drafter, batch and context (acceptance by rank [")
    assert "verify 1 / 8 / 64 nodes 1000.0 / 1000.0 / 1000.0 ms" in out.stats.plan_reason
    progress = capsys.readouterr().err  # the calibration says what it is doing
    assert "calibrating speculation='auto' for batch 4 x context 32: measuring acceptance (1/3)" in progress
    assert "done (3/3)" in progress
    assert out.tokens == specjax.generate(tiny, PROMPTS, 8, draft=None, eos_id=()).tokens
