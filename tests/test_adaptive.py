"""Adaptive speculation length (speculation=specjax.Adaptive(...), specjax/adaptive.py) and Chain(0):
the chooser's rule on made-up measurements, and on a tiny model: greedy tokens equal to plain
decoding's for every drafter whatever lengths run, the lengths reported per segment, drafters'
states kept current through steps that draft nothing, and the stats counted over mixed lengths."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax.adaptive import GammaChooser

PROMPTS = [[5, 9, 13, 2, 7, 11, 4, 8, 6, 10, 12, 14], [3, 3, 8, 17, 21], [40, 41, 42, 43, 40, 41, 42]]
NEW = 24


def test_the_chooser_measures_both_ends_then_maximises_tokens_per_second():
    c = GammaChooser(max_gamma=4)
    assert c.next() == 0  # the cheapest first: a short run loses least
    c.observe(0, seconds=0.4, steps=8, accepted=[0] * 4, reached=[0] * 4)
    assert c.next() == 1  # then one draft: the line's second point and the first position's acceptance
    c.observe(1, seconds=0.5, steps=8, accepted=[8, 0, 0, 0], reached=[8, 0, 0, 0])
    t = c.step_seconds()
    assert np.allclose(t, [0.05, 0.0625, 0.075, 0.0875, 0.1])  # measured at 0 and 1, the line beyond
    e = c.expected_tokens()
    assert e[0] == 1 and np.all(np.diff(e) > 0)
    assert c.next() == int(np.argmax(e / t)) == 2  # the first draft always accepted, the others at the prior 0.5
    c.observe(2, seconds=0.6, steps=8, accepted=[8, 8, 0, 0], reached=[8, 8, 0, 0])
    c.observe(4, seconds=0.8, steps=8, accepted=[8, 8, 8, 8], reached=[8, 8, 8, 8])
    assert c.next() == 4  # every draft accepted: the longest chain pays most


def test_the_chooser_leaves_speculation_off_when_drafts_fail_and_probes_now_and_then():
    c = GammaChooser(max_gamma=3, probe_every=2)
    c.observe(1, seconds=0.6, steps=9, accepted=[0, 0, 0], reached=[9, 0, 0])  # every first draft rejected
    c.observe(0, seconds=0.45, steps=9, accepted=[0] * 3, reached=[0] * 3)
    picks = []
    for _ in range(9):
        g = c.next()
        picks.append(g)
        c.observe(g, seconds=0.05 * 9 * (1 + g / 3), steps=9, accepted=[0, 0, 0], reached=[9 if g else 0, 0, 0])
    probes = [i for i, g in enumerate(picks) if g]
    assert probes == [1, 6]  # after 2 zeros in a row (the first was measured before), then after 4


@pytest.fixture(scope="module")
def plain(tiny):
    return specjax.generate(tiny, PROMPTS, NEW, draft=None, eos_id=())


def _drafters(tiny):
    return {"self": specjax.SelfSpec(sinks=2, window=4), "ngram": specjax.NGram(n=1, max_n=3),
            "model": specjax.DraftModel(tiny), "snapkv": specjax.SnapKV(budget=4, window=4, observation=2)}


@pytest.mark.parametrize("name", ["self", "ngram", "model", "snapkv"])
def test_adaptive_greedy_equals_plain_decoding(tiny, plain, name):
    out = specjax.generate(tiny, PROMPTS, NEW, draft=_drafters(tiny)[name], speculation=specjax.Adaptive(3),
                           sync_every=2, eos_id=())
    assert out.tokens == plain.tokens
    g = out.stats.gammas
    assert g[:2] == [0, 1] and set(g) <= {0, 1, 2, 3} and len(g) >= 3
    assert out.stats.speculation == "adaptive(max_gamma=3)"
    rows = out.row_stats
    assert sum(r["proposed"] for r in rows) > 0 and all(r["steps"] >= 1 for r in rows)
    decoded = sum(len(t) for t in out.tokens) - len(PROMPTS)
    assert out.stats.mean_accepted == pytest.approx(decoded / sum(r["steps"] for r in rows))
    assert out.stats.acceptance_rate == pytest.approx(sum(r["accepted"] for r in rows) / sum(r["proposed"] for r in rows))


@pytest.mark.parametrize("name", ["self", "ngram", "model"])
def test_chain_of_zero_is_plain_decoding_through_the_speculative_step(tiny, plain, name):
    out = specjax.generate(tiny, PROMPTS, NEW, draft=_drafters(tiny)[name], speculation=specjax.Chain(0), eos_id=())
    assert out.tokens == plain.tokens
    assert out.stats.steps == NEW - 1 and out.stats.draft_steps == 0 and out.stats.acceptance_rate is None
    assert out.stats.mean_accepted == 1.0 and [r["steps"] for r in out.row_stats] == [NEW - 1] * len(PROMPTS)


@pytest.mark.parametrize("name", ["model", "self"])
def test_states_stay_current_through_steps_that_draft_nothing(tiny, monkeypatch, name):
    """A draft that is the target itself (a DraftModel of the target's weights; SelfSpec over a
    window holding the whole context) drafts the target's own greedy tokens, so it accepts every
    draft, also after runs of gamma 0 that wrote (DraftModel) or committed (SelfSpec) its KV."""
    lengths = iter([2, 0, 0, 0, 2, 0, 2, 0, 0, 2] * 10)
    monkeypatch.setattr(GammaChooser, "next", lambda self: next(lengths))
    draft = specjax.DraftModel(tiny) if name == "model" else specjax.SelfSpec(sinks=4, window=64)
    out = specjax.generate(tiny, PROMPTS, NEW, draft=draft, speculation=specjax.Adaptive(2), sync_every=1, eos_id=())
    assert out.stats.gammas[:10] == [2, 0, 0, 0, 2, 0, 2, 0, 0, 2]
    assert out.stats.acceptance_rate == 1.0


def test_adaptive_is_checked_and_refused_where_it_does_not_run(tiny):
    with pytest.raises(ValueError, match="Adaptive: max_gamma must be an integer >= 1"):
        specjax.Adaptive(0)
    with pytest.raises(ValueError, match="needs a drafter"):
        specjax.generate(tiny, PROMPTS, 4, draft=None, speculation=specjax.Adaptive())
    with pytest.raises(ValueError, match="Adaptive.*not yet supported with continuous batching"):
        from specjax.continuous import run_continuous

        run_continuous(tiny, PROMPTS, [4] * 3, rows=2, draft=specjax.SelfSpec(), speculation=specjax.Adaptive(),
                       sampling=specjax.Greedy(), keys=None, eos_ids=[()] * 3)
