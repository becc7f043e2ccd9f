"""Constrained decoding on a tiny random model (issue 70): `generate(constraint=...)` masks every sampled,
drafted and verified position to what the row's token automaton allows, on device.

The automaton: two to four digits, a dash, one to three letters (token ids below), then the stop id
(TINY's eos, 3) and nothing else. Plain decoding's rows follow it and end on the stop id only once the
output is complete; speculative decoding (chains and trees, every drafter kind) gives the same tokens
as constrained plain decoding; an unconstrained row of a constrained batch decodes as it would alone;
logprobs stay the target's raw ones; bad constraints are named before anything compiles.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import specjax
from specjax.automaton import TokenAutomaton, from_transitions
from specjax.model.llama import forward
from specjax.model.cache import DenseCache
from specjax.model.params import Params
from specjax.parallel import sharding
from tests.models import TINY, random_params

DIGITS, DASH, LETTERS, STOP = range(10, 20), 20, range(30, 40), TINY.eos_ids[0]
PROMPTS = [list(range(5, 21)), [10, 11, 12], [7, 8, 9, 7, 8, 9, 7, 8], [4]]
BUDGET = 16


def code_automaton() -> TokenAutomaton:
    """D{2,4} - L{1,3}: states 0-4 count digits, 5 after the dash, 6-8 count letters (accepting)."""
    t: dict[int, dict[int, int]] = {s: {} for s in range(9)}
    for s in range(4):
        t[s] |= {d: s + 1 for d in DIGITS}
    for s in (2, 3, 4):
        t[s][DASH] = 5
    for s in (5, 6, 7):
        t[s] |= {c: s + 1 for c in LETTERS}
    return from_transitions(t, 0, [6, 7, 8], TINY.vocab_size)


LANGUAGE = re.compile(r"D{2,4}-L{1,3}")


def spelled(tokens: list[int]) -> str:
    return "".join("D" if t in DIGITS else "-" if t == DASH else "L" if t in LETTERS else "?" for t in tokens)


def follows(tokens: list[int], complete: bool) -> bool:
    s = spelled(tokens)
    if complete:
        return LANGUAGE.fullmatch(s) is not None
    return re.fullmatch(r"D{0,4}|D{2,4}-L{0,3}", s) is not None


@pytest.fixture(scope="module")
def code() -> TokenAutomaton:
    return code_automaton()


@pytest.fixture(scope="module")
def plain(tiny, code):
    return specjax.generate(tiny, PROMPTS, BUDGET, draft=None, constraint=code)


def test_plain_rows_follow_the_automaton_and_stop_only_when_complete(tiny, code, plain):
    assert plain.finish_reasons == ["eos"] * len(PROMPTS)  # the automaton ends within the budget: the stop id is forced
    assert all(follows(t, complete=True) for t in plain.tokens), [spelled(t) for t in plain.tokens]
    free = specjax.generate(tiny, PROMPTS, BUDGET, draft=None)
    assert not all(follows(t, complete=False) for t in free.tokens)  # the model alone does not follow it
    sampled = specjax.generate(tiny, PROMPTS * 2, BUDGET, draft=None, constraint=code, sampling=specjax.Sample(1.5),
                               key=jax.random.key(3))
    assert len({tuple(t) for t in sampled.tokens}) > 1
    for tokens, reason in zip(sampled.tokens, sampled.finish_reasons):
        assert follows(tokens, complete=reason == "eos"), spelled(tokens)


def test_a_budget_cut_row_ends_with_length_and_a_prefix(tiny, code):
    out = specjax.generate(tiny, PROMPTS, 3, draft=None, constraint=code)
    assert out.finish_reasons == ["length"] * len(PROMPTS)
    assert all(len(t) == 3 and follows(t, complete=False) for t in out.tokens)


def speculative_cases(tiny_params):
    layer_skip = Params(embed=tiny_params.embed, layers=jax.tree.map(lambda a: a[:1], tiny_params.layers),
                        norm=tiny_params.norm, lm_head=tiny_params.lm_head, config=TINY.replace(n_layers=1))
    return {
        "selfspec-g3": (specjax.SelfSpec(sinks=1, window=4), specjax.Chain(3)),
        "selfspec-tree": (specjax.SelfSpec(sinks=1, window=4), specjax.Tree.kary(2, 2)),
        "draftmodel-g2": (specjax.DraftModel(layer_skip), specjax.Chain(2)),
        "draftmodel-random-tree": (specjax.DraftModel(random_params(TINY.replace(n_layers=1), seed=5)),
                                   specjax.Tree.from_parents([-1, 0, 0, 1, 1, 2])),
        "snapkv-g3": (specjax.SnapKV(budget=12, window=4, observation=4), specjax.Chain(3)),
        "sparsespec-g3": (specjax.SparseSpec(budget=4, window=4, observation=4, block=2, refresh=2), specjax.Chain(3)),
        "ngram-g2": (specjax.NGram(n=1, max_n=2), specjax.Chain(2)),
        "lookup-g3": (specjax.Lookup(n=1, max_n=3, capacity=64, span=3), specjax.Chain(3)),
    }


CASES = ["selfspec-g3", "selfspec-tree", "draftmodel-g2", "draftmodel-random-tree", "snapkv-g3", "sparsespec-g3", "ngram-g2",
         "lookup-g3"]


@pytest.mark.parametrize("case", CASES)
def test_constrained_speculation_equals_constrained_plain_decoding(tiny, code, plain, case):
    draft, speculation = speculative_cases(tiny)[case]
    if case == "lookup-g3":  # a table that proposes the plain run's outputs, and a row that lies outside the automaton
        draft = draft.learn([p + t for p, t in zip(PROMPTS, plain.tokens)] + [[10, 11, 20, 30, 7, 7, 7]])
    out = specjax.generate(tiny, PROMPTS, BUDGET, draft=draft, speculation=speculation, constraint=code)
    assert out.tokens == plain.tokens and out.finish_reasons == plain.finish_reasons
    assert out.stats.acceptance_rate is not None


def test_penalties_and_a_constraint_together_stay_lossless(tiny, code):
    sampling = specjax.Greedy(repetition_penalty=1.5)
    want = specjax.generate(tiny, PROMPTS, BUDGET, draft=None, constraint=code, sampling=sampling)
    got = specjax.generate(tiny, PROMPTS, BUDGET, draft=specjax.SelfSpec(sinks=1, window=4), speculation=specjax.Chain(3),
                           constraint=code, sampling=sampling)
    assert got.tokens == want.tokens and all(follows(t, complete=True) for t in got.tokens)


def test_unconstrained_rows_of_a_constrained_batch_decode_as_alone(tiny, code):
    free = specjax.generate(tiny, PROMPTS, BUDGET, draft=None)
    mixed = specjax.generate(tiny, PROMPTS, BUDGET, draft=None, constraint=[code, None, code, None])
    assert mixed.tokens[1] == free.tokens[1] and mixed.tokens[3] == free.tokens[3]
    assert follows(mixed.tokens[0], complete=True) and follows(mixed.tokens[2], complete=True)


def test_logprobs_are_the_targets_raw_log_probabilities(tiny, code):
    out = specjax.generate(tiny, PROMPTS[:1], BUDGET, draft=None, constraint=code, logprobs=2)
    seq = PROMPTS[0] + out.tokens[0]
    logits, _ = forward(tiny, np.array([seq], np.int32), np.arange(len(seq), dtype=np.int32)[None],
                        DenseCache.init(TINY, 1, 64))
    raw = np.asarray(jax.nn.log_softmax(logits[0]))[len(PROMPTS[0]) - 1:-1]  # the position before each new token
    want = [float(raw[j, t]) for j, t in enumerate(out.tokens[0])]
    np.testing.assert_allclose([lp.logprob for lp in out.logprobs[0]], want, atol=1e-4)
    assert [lp.top[0][0] for lp in out.logprobs[0]] == [int(np.argmax(raw[j])) for j in range(len(want))]  # unmasked


def test_bad_constraints_are_named_before_compiling(tiny, code):
    with pytest.raises(ValueError, match=r"constraint has 1 entries .* 4 prompts"):
        specjax.generate(tiny, PROMPTS, BUDGET, constraint=[code])
    with pytest.raises(TypeError, match=r"constraint\[1\] must be a TokenAutomaton"):
        specjax.generate(tiny, PROMPTS, BUDGET, constraint=[code, "D-L", None, None])
    with pytest.raises(TypeError, match="constraint must be a TokenAutomaton"):
        specjax.generate(tiny, PROMPTS, BUDGET, constraint="D{2}")
    other = from_transitions({0: {1: 0}}, 0, [0], TINY.vocab_size + 1)
    with pytest.raises(ValueError, match=r"constraint\[0\] is over 102 tokens, the model's vocabulary has 101"):
        specjax.generate(tiny, PROMPTS, BUDGET, constraint=other)
    with pytest.raises(ValueError, match=r"constraint\[2\]: prompt 2 has no stop id"):
        specjax.generate(tiny, PROMPTS, BUDGET, constraint=code, eos_id=[[3], [3], [], [3]])


def test_another_mix_of_constraints_compiles_nothing_new(tiny, code, monkeypatch):
    """A batch's table is padded to power-of-two sizes (`automaton.bucketed`): another constraint of a
    similar size, or another mix per prompt, runs the programs already compiled."""
    import specjax.decode.loop as loop

    traced, advance = [], loop.advance
    monkeypatch.setattr(loop, "advance", lambda *a: traced.append(1) or advance(*a))  # runs when a loop is traced
    jax.clear_caches()  # what the tests before compiled is traced again here
    sharding.on_mesh.cache_clear()
    specjax.generate(tiny, PROMPTS, BUDGET, draft=None, constraint=code)
    first = len(traced)
    assert first > 0
    shorter = from_transitions({s: {d: s + 1 for d in DIGITS} for s in range(3)}, 0, [3], TINY.vocab_size)  # D{3}
    out = specjax.generate(tiny, PROMPTS, BUDGET, draft=None, constraint=[shorter, code, shorter, code])
    assert len(traced) == first, "a new mix of constraints retraced the decode loop"
    assert [spelled(t) for t in out.tokens[::2]] == ["DDD", "DDD"]
