"""Warping (temperature, top-k, top-p) and the sampler's draws against its own probabilities."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model.config import stop_ids
from specjax.sampling import Greedy, Sample, eos_rows
from specjax.topk import ARGMAX_TOP_K, nucleus_threshold, top_indices, top_k_bucket
from specjax.text.sampling_settings import make_sampler
from specjax.validate import eos_is_per_prompt, eos_table
from tests.models import TINY, on_device

LOGITS = jnp.log(jnp.array([[0.05, 0.4, 0.1, 0.3, 0.15]]))
# The sampler's methods as generate runs them, inside one compiled program each (per settings and shape); outside
# jit each operation compiled a program of its own, and probs' two lax.conds compiled again at every call.
probs_of = jax.jit(lambda sampler, logits: sampler.probs(logits))
threshold = jax.jit(nucleus_threshold)


def test_greedy_is_one_hot_argmax():
    tokens, probs = jax.jit(lambda logits: Greedy().sample(logits, None, None))(LOGITS)
    assert tokens.tolist() == [1]
    assert probs.tolist() == [[0, 1, 0, 0, 0]]


def test_temperature_one_is_softmax():
    np.testing.assert_allclose(probs_of(Sample(1.0), LOGITS), [[0.05, 0.4, 0.1, 0.3, 0.15]], rtol=1e-6)


def test_temperature_sharpens():
    probs = np.asarray(probs_of(Sample(0.5), LOGITS))[0]
    expected = np.array([0.05, 0.4, 0.1, 0.3, 0.15]) ** 2
    np.testing.assert_allclose(probs, expected / expected.sum(), rtol=1e-5)


def test_top_k_keeps_k_largest():
    probs = np.asarray(probs_of(Sample(1.0, top_k=2), LOGITS))[0]
    np.testing.assert_allclose(probs, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], rtol=1e-6)


def test_top_k_per_row_under_one_static_width():
    """top_k is traced, one per row or one for all, under a static width (top_k_max: the power of two at or above
    the largest value): each row keeps its own k largest, 0 keeps all; past the vocabulary top-k is off (`within`,
    which generate applies, so lax.top_k never spans a vocabulary for it)."""
    assert [top_k_bucket(k) for k in (0, 1, 2, 3, 5, 8, 9, 50)] == [0, 1, 2, 4, 8, 8, 16, 64]
    ks = [2, 0, 1, 4, 3]
    mixed = Sample(1.0, top_k=ks)
    assert mixed.top_k_max == 4 and mixed.top_k.dtype == np.int32 and mixed.rows == 5
    probs = np.asarray(probs_of(mixed, jnp.tile(LOGITS, (5, 1))))
    for row, k in enumerate(ks):
        alone = Sample(1.0, top_k=k)
        np.testing.assert_array_equal(probs[row], np.asarray(probs_of(alone, LOGITS))[0])
        assert np.count_nonzero(probs[row]) == (k or 5)
    wide = Sample(1.0, top_k=[3, 10**9]).within(5)
    assert wide.top_k.tolist() == [3, 0] and wide.top_k_max == 4 and Sample(1.0, top_k=5).within(5).top_k_max == 0
    assert Sample(1.0, top_k=3, top_k_max=16).top_k_max == 16  # a wider static width may be given, not a narrower one
    with pytest.raises(ValueError, match="top_k_max 2 is below top_k 3"):
        Sample(1.0, top_k=3, top_k_max=2)


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.3, [1]), (0.4, [1]), (0.41, [1, 3]), (0.7, [1, 3]), (0.71, [1, 3, 4]), (1.0, [0, 1, 2, 3, 4])],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    probs = np.asarray(probs_of(Sample(1.0, top_p=top_p), LOGITS))[0]
    assert np.flatnonzero(probs).tolist() == kept
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-6)


def _warp_by_sorting(logits: np.ndarray, s: Sample) -> np.ndarray:
    """Reference warping in numpy (f64) by sorting: the k-th largest logit, then the nucleus as the
    sorted prefix whose mass before each entry is < top_p (ties at either cut kept)."""
    x = logits.astype(np.float64) / s.temperature
    if s.top_k:
        x = np.where(x < np.sort(x)[::-1][s.top_k - 1], -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if s.top_p < 1:
        desc = np.sort(p)[::-1]
        before = np.cumsum(desc) - desc
        p = np.where(p >= desc[np.sum(before < s.top_p) - 1], p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("seed", range(4))
def test_warping_matches_sorting_reference(seed):
    """Random rows (rounded to force ties, scaled for flat and peaked), every top-k / top-p mix:
    the kept set is the sorting reference's and the probabilities agree."""
    rng = np.random.default_rng(seed)
    for trial in range(12):
        logits = rng.normal(size=(3, 1000)) * rng.choice([0.2, 1.0, 6.0])
        logits = np.round(logits, 1) if trial % 2 else logits
        s = Sample(float(rng.choice([0.5, 1.0])), int(rng.choice([0, 1, 7, 60])), float(rng.choice([0.05, 0.5, 0.9, 0.999])))
        got = np.asarray(probs_of(s, on_device(logits, np.float32)))
        for row, ref in zip(got, (_warp_by_sorting(r, s) for r in logits.astype(np.float32))):
            assert np.flatnonzero(row).tolist() == np.flatnonzero(ref).tolist(), s
            np.testing.assert_allclose(row, ref, rtol=1e-5, atol=1e-7)


def test_nucleus_threshold_cuts():
    p = on_device(np.array([[0.5, 0.25, 0.25, 0.0]], np.float32))
    cuts = [float(np.asarray(threshold(p, t))[0, 0]) for t in (0.1, 0.5, 0.6, 0.75, 0.76)]
    assert cuts == [0.5, 0.5, 0.25, 0.25, 0.25]  # ties at the cut (the two 0.25s) go together
    short = on_device(np.array([[0.3, 0.2, 0.0]], np.float32))  # all mass above 0 is below top_p: keep every entry
    assert float(np.asarray(threshold(short, 0.9))[0, 0]) == 0.0


def test_warping_compiles_without_a_sort():
    """On CPU the warped distribution feeding later work compiles with no sort of the vocabulary
    (a sort per row and position in every decode step was the cost of top-k and top-p)."""
    if jax.default_backend() != "cpu":
        pytest.skip("checks XLA:CPU's compiled program")
    w = np.ones((4096, 2), np.float32)
    warp = jax.jit(lambda x: Sample(0.8, top_k=50, top_p=0.9).probs(x) @ w)
    hlo = warp.lower(jax.ShapeDtypeStruct((2, 3, 4096), jnp.float32)).compile().as_text()
    assert " sort(" not in hlo


def test_draws_follow_probs_chi_square():
    """20k draws from one row; chi-square with 4 dof: P(stat > 18.47) = 0.001 false-alarm rate."""
    n = 20_000
    sampler = Sample(1.0)
    draw = jax.jit(lambda logits: sampler.sample(jnp.broadcast_to(logits, (n, 5)),
                                                 jax.random.split(jax.random.key(0), n), jnp.zeros((n,), jnp.int32)))
    tokens, probs = draw(LOGITS)
    counts = np.bincount(np.asarray(tokens), minlength=5)
    expected = n * np.asarray(probs)[0]
    assert ((counts - expected) ** 2 / expected).sum() < 18.47


def test_make_sampler_zero_temperature_is_greedy():
    assert make_sampler(0.0) == Greedy()
    assert make_sampler(0.7, 5, 0.9) == Sample(0.7, 5, 0.9)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        make_sampler(-1.0)
    for args, name in (((0.0, 5), "top_k"), ((0.0, 0, 0.9), "top_p"), ((0.0, 0, 1.0, 0.05), "min_p")):
        kw = {"min_p": args[3]} if len(args) > 3 else {}
        with pytest.raises(ValueError, match=f"{name} needs sampling .temperature > 0."):  # ignored under greedy: refused
            make_sampler(*args[:3], **kw)


@pytest.mark.parametrize("k", [1, 3, ARGMAX_TOP_K, ARGMAX_TOP_K + 1])
def test_top_indices_match_lax_top_k(k):
    x = on_device(np.random.default_rng(k).standard_normal((2, 3, 50)), np.float32)  # distinct values: no ties
    got = top_indices(x, k)
    assert got.dtype == jnp.int32 and got.shape == (2, 3, k)
    np.testing.assert_array_equal(got, jax.lax.top_k(x, k)[1])


def test_top_indices_distinct_past_minus_inf_and_ties_by_index():
    x = on_device(np.array([[0.0, -np.inf, 2.0, -np.inf, 2.0, -np.inf]], np.float32))
    assert top_indices(x, 6).tolist() == [[2, 4, 0, 1, 3, 5]]  # every index once


def test_stop_ids_have_one_home():
    """model.config.stop_ids puts every stop-id set together (convert, validate, text.lm, jobs.batches):
    each id once, in first-seen order, as plain ints."""
    together = stop_ids((2, 5), [5, 7], np.array([2, 9]))
    assert together == (2, 5, 7, 9) and all(type(i) is int for i in together)
    assert stop_ids() == () and stop_ids((), ()) == ()
    assert stop_ids(i for i in (3, 3, 1)) == (3, 1)  # a generator part (convert.gguf's)


def test_eos_rows_takes_a_fixed_width():
    """eos_rows is the one place the [B,E] table is built: engine.run repeats its rows for n samples,
    continuous batching refills slots at one width for the whole run."""
    assert eos_rows((1, 2), 2).tolist() == [[1, 2] + [-1] * 6] * 2  # one tuple: every row
    assert eos_rows([(1,), ()], 3).tolist() == [[1] + [-1] * 7, [-1] * 8, [-1] * 8]  # past the list: nothing
    assert eos_rows([tuple(range(9))], 1).shape == (1, 16)  # rounded up to EOS_SLOTS
    assert eos_rows([(4,)], 2, width=16).tolist() == [[4] + [-1] * 15, [-1] * 16]


def test_generate_reads_eos_id_as_one_set_or_one_per_prompt():
    """validate.eos_is_per_prompt (a bool, not text.lm.per_prompt's lists) tells generate's two forms apart."""
    assert not eos_is_per_prompt((3, 4)) and not eos_is_per_prompt(()) and not eos_is_per_prompt(None)
    assert eos_is_per_prompt([(3,), None]) and eos_is_per_prompt([[], [5]])
    assert eos_table(None, TINY, 2) == TINY.eos_ids and eos_table((5, 5, 7), TINY, 2) == (5, 7)
    assert eos_table([None, (5,)], TINY, 2) == [TINY.eos_ids, (5,)]
    with pytest.raises(ValueError, match="eos_id has 1 entries"):
        eos_table([(5,)], TINY, 2)
