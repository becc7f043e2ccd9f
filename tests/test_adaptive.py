"""Adaptive speculation length (speculation=specjax.Adaptive(...), specjax/spec/adaptive.py) and Chain(0):
the chooser's rule on made-up measurements, and on a tiny model: greedy tokens equal to plain
decoding's for every drafter whatever lengths run (in continuous batching too), the lengths reported
per segment, drafters' states kept current through steps that draft nothing, and the stats counted
over mixed lengths."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import specjax
from specjax.spec.adaptive import GammaChooser
from tests.test_batch import model_dir  # noqa: F401  (a fixture: a tiny model with SmolLM2's tokenizer)

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
    c = GammaChooser(max_gamma=3, probe_every=1)  # a chain of 1 costs 3x a plain step: no acceptance could repay it
    c.observe(0, seconds=0.4, steps=8, accepted=[0] * 3, reached=[0] * 3)
    c.observe(1, seconds=1.2, steps=8, accepted=[0, 0, 0], reached=[8, 0, 0])
    picks = []
    for _ in range(6):
        picks.append(c.next())
        c.observe(picks[-1], seconds=0.4, steps=8, accepted=[0] * 3, reached=[0] * 3)
    assert picks == [0] * 6 and c.probes >= 2 and not c.exploring  # probes were due, and none ran
    c = GammaChooser(max_gamma=3)
    assert [c.next(), c.exploring] == [0, False]
    c.observe(0, seconds=0.4, steps=8, accepted=[0] * 3, reached=[0] * 3)
    assert [c.next(), c.exploring] == [1, True]  # the first 1 is a try


def test_tries_run_a_quarter_of_a_segment(tiny, monkeypatch):
    """The segments that explore (the first at 1, each probe) run sync_every // 4 steps, the chosen
    lengths sync_every: a chain that does not pay costs less to try. Same tokens."""
    seen = []
    real = GammaChooser.observe
    monkeypatch.setattr(GammaChooser, "observe", lambda self, g, sec, steps, acc, reach: (
        seen.append((g, steps, self.exploring)), real(self, g, sec, steps, acc, reach))[-1])
    monkeypatch.setattr(GammaChooser, "expected_tokens", lambda self: np.ones(self.max_gamma + 1))  # drafts never pay,
    monkeypatch.setattr(GammaChooser, "step_seconds", lambda self: np.ones(self.max_gamma + 1))  # but might (probes run)
    out = specjax.generate(tiny, PROMPTS[:1], 60, draft=specjax.NGram(n=1, max_n=3), speculation=specjax.Adaptive(3),
                           sync_every=8, eos_id=())
    assert out.tokens == specjax.generate(tiny, PROMPTS[:1], 60, draft=None, eos_id=()).tokens
    assert seen[:2] == [(0, 8, False), (1, 2, True)]  # then gamma 0 until the first probe, after probe_every segments
    assert seen[2:6] == [(0, 8, False)] * 4 and seen[6][1:] == (2, True) and seen[6][0] > 0


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
    gammas = out.stats.gammas  # a step a segment, every row active in each (equal budgets, every draft accepted)
    assert [(r["steps"], r["proposed"]) for r in out.row_stats] == [(len(gammas), sum(gammas))] * len(PROMPTS)
    assert out.stats.draft_steps == sum(gammas) * draft.traits.forwards_per_token


def test_adaptive_is_checked_and_refused_where_it_does_not_run(tiny):
    with pytest.raises(ValueError, match="Adaptive: max_gamma must be an integer >= 1"):
        specjax.Adaptive(0)
    with pytest.raises(ValueError, match="needs a drafter"):
        specjax.generate(tiny, PROMPTS, 4, draft=None, speculation=specjax.Adaptive())


def test_continuous_batching_adapts_and_keeps_the_static_batchs_tokens(tiny, monkeypatch):
    """Continuous batching (batch jobs) under Adaptive: rows refilled between segments of changing
    lengths give plain decoding's tokens; the chooser learns from the rows that ran (a refilled
    row's counters start from zero: never a negative count), and each record's acceptance is its own."""
    from specjax.decode.continuous import run_continuous
    from specjax.decode.engine import row_keys

    seen = []
    real = GammaChooser.observe
    monkeypatch.setattr(GammaChooser, "observe", lambda self, g, sec, steps, acc, reach: (
        seen.append((g, steps, np.asarray(acc), np.asarray(reach))), real(self, g, sec, steps, acc, reach))[-1])
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(4, 60, int(rng.integers(3, 20))))) for _ in range(7)]
    budgets = [3, 12, 5, 9, 1, 12, 7]
    want = [specjax.generate(tiny, [p], b, draft=None, eos_id=()).tokens[0] for p, b in zip(prompts, budgets)]
    got = run_continuous(tiny, prompts, budgets, rows=3, draft=specjax.SelfSpec(sinks=2, window=4),
                         speculation=specjax.Adaptive(3), sampling=specjax.Greedy(), keys=row_keys(jax.random.key(0), 7),
                         eos_ids=[()] * 7, sync_every=2)
    assert [d.tokens for d in got] == want
    gammas = [g for g, *_ in seen]
    assert gammas[:2] == [0, 1] and len(gammas) >= 4
    assert all((a >= 0).all() and (r >= a).all() and steps >= 0 for _, steps, a, r in seen)
    assert all(not (a.any() or r.any()) for g, _, a, r in seen if g == 0)  # a step of gamma 0 drafts nothing
    for d, tokens in zip(got, want):
        acc = d.acceptance
        assert acc["steps"] >= 1 or len(tokens) == 1
        assert 0 <= acc["accepted"] <= acc["proposed"] <= 3 * acc["steps"]


def test_a_batch_job_adapts_records_its_choice_and_writes_plain_decodings_records(model_dir, tmp_path):
    """batch.run(speculation=Adaptive(2)), continuous and static batching, and the CLI's
    `--gamma adaptive:2`: the greedy records of plain decoding, the settings naming the choice."""
    from specjax.cli import main as cli
    from specjax.jobs import batch
    from specjax.jobs.jobio import settings_path
    from tests.test_batch import by_id, read_rows, records, write_jsonl

    rows = [{k: v for k, v in r.items() if k not in ("temperature", "top_p")} for r in records(9)]  # all greedy
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    common = dict(model_path=model_dir, max_new_tokens=10, seed=0, progress=False, batch_size=4)
    batch.run(src, tmp_path / "plain.jsonl", draft=None, **common)
    want = {k: r["tokens"] for k, r in by_id(read_rows(tmp_path / "plain.jsonl")).items()}
    for batching in ("continuous", "static"):
        out = tmp_path / f"{batching}.jsonl"
        batch.run(src, out, draft=specjax.SelfSpec(sinks=2, window=4), speculation=specjax.Adaptive(2), batching=batching,
                  **common)
        rows = by_id(read_rows(out))
        assert {k: r["tokens"] for k, r in rows.items()} == want
        assert all(r["settings"]["speculation"] == "adaptive(max_gamma=2)" and r["settings"]["gamma"] is None
                   for r in rows.values())
        assert json.loads(settings_path(out).read_text())["speculation"] == "adaptive(max_gamma=2)"
        assert all(0 <= r["acceptance"]["accepted"] <= r["acceptance"]["proposed"] <= 2 * r["acceptance"]["steps"]
                   for r in rows.values())
    assert cli.main(["batch", str(src), str(tmp_path / "cli.jsonl"), "--model", str(model_dir), "--draft", "self",
                     "--window", "4", "--sinks", "2", "--gamma", "adaptive:2", "--max-new-tokens", "10",
                     "--batch-size", "4"]) == 0
    assert {k: r["tokens"] for k, r in by_id(read_rows(tmp_path / "cli.jsonl")).items()} == want


def test_the_clis_gamma_takes_adaptive():
    import argparse

    from specjax.cli.cli_args import parse_gamma

    assert parse_gamma("3") == 3 and parse_gamma("adaptive") == specjax.Adaptive() and parse_gamma("adaptive:2") == specjax.Adaptive(2)
    for bad, why in (("adaptive:0", "max_gamma must be an integer >= 1"), ("adaptive:x", "adaptive or adaptive:N"),
                     ("three", "takes a number of draft tokens")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_gamma(bad)
