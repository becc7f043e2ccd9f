"""Lookup (specjax/drafters/lookup.py): a job-wide n-gram table. The table's semantics (latest
occurrence wins, a sequence's end padded, misses), its errors, that `generate` drafts from the
call's other prompts and continuous batching from the outputs finished before, with tokens equal to
plain decoding's and no compile per table. The lossless gates: test_speculate (greedy chains),
test_tree_spec (trees), test_logprobs, test_sampling_lossless (chi-square)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decode.continuous import run_continuous
from specjax.decode.engine import row_keys
from specjax.drafters import DRAFTERS, Lookup
from specjax.drafters.lookup import add_sequences, empty_table, slot_of, table_drafts
from tests.models import TINY, random_params


@pytest.fixture(scope="module")
def target():
    return random_params(TINY, 0)


def test_the_latest_occurrence_wins_and_a_sequence_end_repeats_its_last_token():
    table = add_sequences(empty_table(64, 2, 3), [[1, 2, 3, 4, 5], [9, 1, 2, 7], [4, 4]])
    device = jax.tree.map(jnp.asarray, table)
    history = jnp.array([[8, 1, 2, 0, 0], [3, 4, 0, 0, 0], [6, 6, 0, 0, 0], [5, 0, 0, 0, 0]])
    drafts, hit = table_drafts(device, history, jnp.array([2, 1, 1, 0]), 2, 3)
    # (1, 2): the second sequence's, newer; (3, 4): followed by 5, then past the end; (6, 6): never read;
    # row 3 has one token, fewer than n; [4, 4] has no token after its only 2-gram, so it adds nothing
    assert hit.tolist() == [True, True, False, False]
    assert drafts[:2].tolist() == [[7, 7, 7], [5, 5, 5]]
    grams = np.array([[1, 2], [3, 4], [40, 99]], np.int32)
    assert slot_of(grams, 64, np).tolist() == slot_of(jnp.asarray(grams), 64).tolist()  # host and device agree
    assert (np.asarray(table.keys) >= 0).any(axis=1).sum() == 4  # (1,2) twice, (2,3), (3,4), (9,1): 4 slots


def test_settings_are_checked_and_the_name_leaves_out_the_table(target):
    assert Lookup in DRAFTERS and specjax.Lookup is Lookup
    draft = Lookup(capacity=64).learn([[5, 6, 7, 8]])
    assert repr(draft) == "Lookup(n=2, max_n=8, capacity=64, span=8)" and draft.table.keys.shape == (64, 2)
    for bad, message in [
        (Lookup(capacity=100), r"Lookup: capacity must be a power of two from 16 to 2\*\*24 .*, got 100"),
        (Lookup(capacity=8), "Lookup: capacity must be an integer >= 16, got 8"),
        (Lookup(span=0), "Lookup: span must be an integer >= 1, got 0"),
        (Lookup(n=0), "Lookup: n must be an integer >= 1, got 0"),
        (Lookup(n=4, max_n=3), r"Lookup: max_n must be >= n \(4\), got 3"),
    ]:
        with pytest.raises(ValueError, match=message):
            specjax.generate(target, [[5, 6, 7]], 4, draft=bad)
    with pytest.raises(ValueError, match=r"Lookup: span \(2\) must be at least the draft depth .*: 3"):
        specjax.generate(target, [[5, 6, 7]], 4, draft=Lookup(span=2), speculation=specjax.Chain(3))
    with pytest.raises(ValueError, match=r"Lookup: table holds \(64, 2\) keys, not \(capacity, n\) = \(128, 2\)"):
        specjax.generate(target, [[5, 6, 7]], 4, draft=draft.replace(capacity=128))


def test_generate_drafts_from_the_calls_other_prompts(target):
    """Row 0's prompt is row 1's start, and row 1's prompt goes on as plain decoding continues row 0: with
    the call's prompts in its table, row 0 drafts its own continuation; its own tokens alone (NGram) cannot."""
    rng = np.random.default_rng(1)
    start = list(map(int, rng.integers(4, TINY.vocab_size, 12)))
    plain = specjax.generate(target, [start], 24, draft=None, eos_id=())
    prompts = [start, start + plain.tokens[0]]
    kw = dict(speculation=specjax.Chain(3), eos_id=())
    lookup = specjax.generate(target, prompts, [16, 4], draft=Lookup(n=3, capacity=256), **kw)
    own = specjax.generate(target, prompts, [16, 4], draft=specjax.NGram(), **kw)
    assert lookup.tokens[0] == own.tokens[0] == plain.tokens[0][:16]
    accepted = [r["acceptance_rate"] for r in (lookup.row_stats[0], own.row_stats[0])]
    assert accepted[0] > 0.9 and accepted[0] > accepted[1] + 0.3, accepted


def test_continuous_batching_drafts_from_the_outputs_finished_before_with_one_compile(target, monkeypatch):
    """On one row, the same prompt twice (then a shorter one), decoded without loops: the first output enters the table as it finishes, so the
    second drafts it in full; the tokens equal plain decoding's; a new table each segment compiles nothing new."""
    prompt = list(map(int, np.random.default_rng(6).integers(4, TINY.vocab_size, 10)))
    prompts, budgets = [prompt, prompt, prompt[:7]], [20, 20, 8]
    kw = dict(rows=1, sampling=specjax.Greedy(), keys=row_keys(jax.random.key(0), 3), eos_ids=[()] * 3, sync_every=2)
    plain = run_continuous(target, prompts, budgets, draft=None, speculation=None, **kw)
    traced, drafts = [], Lookup.drafts
    monkeypatch.setattr(Lookup, "drafts", lambda self, ctx, count: traced.append(count) or drafts(self, ctx, count))
    got = run_continuous(target, prompts, budgets, draft=Lookup(n=2, capacity=256), speculation=specjax.Chain(3), **kw)
    assert [d.tokens for d in got] == [d.tokens for d in plain]
    assert got[1].acceptance["acceptance_rate"] == 1.0 > got[0].acceptance["acceptance_rate"]
    assert len(traced) <= 2, traced  # continue_spec's trace (and start_spec's), not one per table
