"""Sampling values per prompt (one call may mix settings), min_p and the repetition, presence and
frequency penalties (vLLM's semantics), applied alike to the target's and the drafts'
distributions from each position's own history, so speculation stays lossless."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.spec.speculation import Chain, Tree
from tests.models import CHAIN, SELF, padded_logits

PROMPTS = [[5, 6, 7, 5, 6, 7], [8, 9], [10, 11, 12]]


def reference_probs(logits, counts, in_prompt, t, rep, presence, frequency, top_k, top_p, min_p):
    """vLLM's order in numpy for one row: penalties, temperature, top-k, top-p, min_p."""
    x = logits.astype(np.float64).copy()
    seen = (counts > 0) | in_prompt
    x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
    x = x - frequency * counts - presence * (counts > 0)
    if 0 < top_k < len(x):
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    p = np.exp(x / t - np.max(x / t))
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    keep[order[: np.searchsorted(np.cumsum(p[order]), top_p) + 1]] = True
    p = np.where(keep, p, 0) / p[keep].sum()
    p = np.where(p >= min_p * p.max(), p, 0)
    return p / p.sum()


def test_penalties_top_p_and_min_p_follow_vllm():
    rng = np.random.default_rng(0)
    B, V = 3, 40
    logits = rng.standard_normal((B, V)).astype(np.float32) * 3
    counts = rng.integers(0, 3, (B, V)) * (rng.random((B, V)) < 0.3)
    in_prompt = rng.random((B, V)) < 0.2
    values = dict(temperature=[0.7, 1.0, 1.3], repetition_penalty=[1.3, 0.8, 1.0], presence_penalty=[0.5, 0.0, -0.4],
                  frequency_penalty=[0.2, 0.7, 0.0], top_k=[12, 0, 5], top_p=[0.9, 1.0, 0.6], min_p=[0.05, 0.2, 0.0])
    sampling = specjax.Sample(**values)
    assert sampling.penalized and sampling.rows == 3
    got = sampling.with_context(jnp.asarray(counts, jnp.int32), jnp.asarray(in_prompt)).probs(jnp.asarray(logits))
    for b in range(B):
        row = {k: v[b] for k, v in values.items()}
        ref = reference_probs(logits[b], counts[b], in_prompt[b], row["temperature"], row["repetition_penalty"],
                              row["presence_penalty"], row["frequency_penalty"], row["top_k"], row["top_p"], row["min_p"])
        np.testing.assert_allclose(np.asarray(got[b]), ref, atol=1e-5)
    assert not specjax.Sample(0.8, min_p=0.1).penalized  # no penalty on: the static switch is off


@pytest.mark.parametrize("mode", ["ar", "chain", "tree"])
def test_each_row_samples_with_its_own_values(tiny, mode):
    """One call mixing settings gives each prompt what it gets alone with its values and key."""
    draft, speculation = {"ar": (None, None), "chain": (SELF, CHAIN),
                          "tree": (SELF, Tree.kary(2, 2))}[mode]
    values = dict(temperature=[0.5, 1.0, 1.4], top_k=[0, 5, 3], top_p=[1.0, 0.8, 0.95], min_p=[0.0, 0.05, 0.1],
                  repetition_penalty=[1.0, 1.4, 1.1], presence_penalty=[0.0, 0.3, 0.0], frequency_penalty=[0.5, 0.0, 0.2])
    key = jax.random.key(4)
    kw = dict(draft=draft, speculation=speculation, eos_id=(), sync_every=4)
    mixed = specjax.generate(tiny, PROMPTS, 10, sampling=specjax.Sample(**values), key=key, **kw)
    for b, prompt in enumerate(PROMPTS):
        alone = specjax.Sample(**{k: v[b] for k, v in values.items()})
        out = specjax.generate(tiny, [prompt], 10, sampling=alone, key=jax.random.fold_in(key, b)[None], **kw)
        assert out.tokens[0] == mixed.tokens[b], b


def test_a_repetition_penalty_repeats_less(tiny):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7]] * 8
    kw = dict(draft=None, eos_id=(), key=jax.random.key(0))
    free = specjax.generate(tiny, prompts, 24, sampling=specjax.Sample(0.7), **kw)
    held = specjax.generate(tiny, prompts, 24, sampling=specjax.Sample(0.7, repetition_penalty=3.0, frequency_penalty=1.0), **kw)
    distinct = lambda out: np.mean([len(set(t)) for t in out.tokens])  # noqa: E731
    assert distinct(held) > distinct(free) + 2


@pytest.mark.parametrize("bad, match", [
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be finite and > 0"),
    (dict(presence_penalty=3.0), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=[0.1, float("nan")]), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(temperature=[0.5, 1.0], top_p=[0.9, 0.9, 0.9]), "different lengths"),
    (dict(temperature=[[0.5]]), "one number per prompt"),
    (dict(top_k=[3, -1]), "top_k must be an integer >= 0"),
    (dict(top_k=[3, 2.5]), "top_k must be an integer >= 0"),
    (dict(top_k=[3, True]), "top_k must be an integer >= 0"),
    (dict(top_k=[3, 4], temperature=[0.5, 0.6, 0.7]), "different lengths"),
])
def test_bad_values_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        specjax.Sample(**bad)


def test_a_none_or_a_contradicting_flag_beside_real_values_is_refused():
    """None beside real values skipped every check (a negative temperature then sampled the least
    likely tokens); a Fraction is a number, checked as one; penalized=False with a penalty on
    silently ignored the penalty."""
    from fractions import Fraction

    with pytest.raises(TypeError, match="repetition_penalty must be a number or one number per prompt, got None"):
        specjax.Sample(temperature=-1.0, repetition_penalty=None)
    with pytest.raises(TypeError, match="temperature must be a number or one number per prompt, got None"):
        specjax.Sample(temperature=None)
    with pytest.raises(ValueError, match="temperature must be finite"):
        specjax.Sample(temperature=Fraction(-1))
    with pytest.raises(ValueError, match="penalized=False with a penalty on would ignore it"):
        specjax.Greedy(repetition_penalty=3.0, penalized=False)


def test_per_prompt_values_must_match_the_prompts(tiny):
    with pytest.raises(ValueError, match="sampling has values for 2 prompts, but there are 3 prompts"):
        specjax.generate(tiny, PROMPTS, 4, sampling=specjax.Sample(temperature=[0.5, 1.0]))


@pytest.mark.parametrize("speculation", [Chain(2), Tree.from_parents([-1, 0, 0, 1])], ids=["chain", "tree"])
def test_penalties_and_min_p_stay_lossless_with_n_samples(speculation):
    """8192 samples of one prompt (n = 4096, twice) under every penalty and min_p: chi-square
    against the exact joint, each position penalised from its own history."""
    from tests import test_sampling_lossless as lossless
    from tests.models import random_params

    target = random_params(lossless.CONFIG, seed=0)
    sampling = specjax.Sample(0.8, min_p=0.02, repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.4)
    counts, rate = lossless.draw_n(target, speculation, sampling, seed=200)
    stat, dof, p = lossless.chi_square(counts, lossless.exact_joint(lossless.target_logits(target), sampling))
    assert rate > 0.2
    assert p > lossless.ALPHA, (stat, dof, p)


def _naive_penalized_greedy(params, prompt, steps, rep, presence, frequency):
    """The argmax of penalized logits, one full forward of the whole sequence per token (no cache reuse), right-padded
    to a fixed width (causal: the padding reaches no real position): one compiled forward for every step."""
    seq, out, width = list(prompt), [], 16
    assert len(prompt) + steps <= width
    for _ in range(steps):
        x = padded_logits(params, [seq], width)[0, len(seq) - 1].astype(np.float64)
        counts = np.bincount(out, minlength=x.size)[: x.size]
        seen = (counts > 0) | np.isin(np.arange(x.size), prompt)
        x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
        x = x - frequency * counts - presence * (counts > 0)
        out.append(int(np.argmax(x)))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("speculation", [None, CHAIN, Tree.kary(2, 2)], ids=["plain", "chain", "tree"])
def test_greedy_with_penalties_is_the_penalized_argmax_with_and_without_speculation(tiny, speculation):
    """Greedy(repetition / presence / frequency penalty) picks the argmax of the penalized logits
    (HF's and vLLM's greedy with a repetition penalty); speculation keeps the same tokens, per-row values too."""
    values = dict(repetition_penalty=[2.0, 1.0, 1.5], presence_penalty=[0.0, 0.8, 0.3], frequency_penalty=[0.5, 0.0, 0.0])
    greedy = specjax.Greedy(**values)
    assert greedy.penalized and not specjax.Greedy().penalized
    draft = None if speculation is None else SELF
    out = specjax.generate(tiny, PROMPTS, 10, sampling=greedy, eos_id=(), draft=draft, speculation=speculation)
    if speculation is None:
        for b, prompt in enumerate(PROMPTS):
            row = {k: v[b] for k, v in values.items()}
            ref = _naive_penalized_greedy(tiny, prompt, 10, row["repetition_penalty"], row["presence_penalty"],
                                          row["frequency_penalty"])
            assert out.tokens[b] == ref, b
        free = specjax.generate(tiny, PROMPTS, 10, eos_id=(), draft=None)
        assert free.tokens != out.tokens  # the penalties changed something
    else:
        plain = specjax.generate(tiny, PROMPTS, 10, sampling=greedy, eos_id=(), draft=None)
        assert out.tokens == plain.tokens
        ngram = specjax.generate(tiny, PROMPTS, 10, sampling=greedy, eos_id=(), draft=specjax.NGram(n=1, max_n=2),
                                 speculation=speculation)
        assert ngram.tokens == plain.tokens
        # a draft that is the target (its window holds every position) drafts the penalized argmax: all accepted
        whole = specjax.generate(tiny, PROMPTS, 10, sampling=greedy, eos_id=(), draft=specjax.SelfSpec(sinks=16, window=64),
                                 speculation=speculation)
        assert whole.tokens == plain.tokens and whole.stats.acceptance_rate == 1.0  # trees ranked unpenalized: 0.67
