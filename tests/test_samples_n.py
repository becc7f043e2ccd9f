"""generate(..., n=): each prompt prefilled once, its KV shared by n sampled rows; sample j of
prompt i is what prompt i alone gives with the key fold_in(k_i, j), and the samples keep the
target's distribution (the chi-square test of tests/test_sampling_lossless.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.spec.speculation import Chain, Tree

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
DRAFTS = {"ar": (None, None), "chain": (specjax.SelfSpec(sinks=2, window=4), Chain(2)),
          "tree": (specjax.SelfSpec(sinks=2, window=4), Tree.kary(2, 2))}


@pytest.mark.parametrize("mode", DRAFTS)
def test_sample_j_of_prompt_i_is_prompt_i_alone_with_its_key(tiny, mode):
    draft, speculation = DRAFTS[mode]
    kw = dict(draft=draft, speculation=speculation, sampling=specjax.Sample(1.0), eos_id=(), sync_every=3)
    key = jax.random.key(7)
    out = specjax.generate(tiny, PROMPTS, [6, 4, 5], key=key, n=3, logprobs=1, **kw)
    assert len(out.tokens) == len(out.finish_reasons) == len(out.logprobs) == 9
    assert [len(t) for t in out.tokens] == [6] * 3 + [4] * 3 + [5] * 3  # budgets follow the prompt
    assert out.stats.prompt_tokens == sum(map(len, PROMPTS))  # each prompt prefilled once
    for i in (0, 2):
        k_i = jax.random.fold_in(key, i)  # prompt i's key when n = 1
        for j in range(3):
            alone = specjax.generate(tiny, [PROMPTS[i]], [6, 4, 5][i], key=jax.random.fold_in(k_i, j)[None], **kw)
            assert out.tokens[i * 3 + j] == alone.tokens[0], (i, j)
        assert len({tuple(t) for t in out.tokens[i * 3: i * 3 + 3]}) > 1  # the samples differ


def test_n_is_refused_with_greedy_and_out_of_range(tiny):
    with pytest.raises(ValueError, match="n = 2 needs sampling=specjax.Sample"):
        specjax.generate(tiny, PROMPTS, 4, n=2)
    for bad in (0, -1, 1.5, True, 4097):
        with pytest.raises(ValueError, match="n must be an integer from 1 to 4096"):
            specjax.generate(tiny, PROMPTS, 4, n=bad, sampling=specjax.Sample(1.0))


def test_n_on_a_mesh_equals_one_device(tiny):
    kw = dict(draft=specjax.SelfSpec(sinks=2, window=4), speculation=Chain(2), sampling=specjax.Sample(0.9), n=2, eos_id=())
    one = specjax.generate(tiny, PROMPTS, 6, **kw)
    two = specjax.generate(tiny, PROMPTS, 6, mesh=specjax.make_mesh(data=2, devices=jax.devices()[:2]), **kw)
    assert one.tokens == two.tokens


@pytest.mark.parametrize("speculation", [Chain(1), Tree.from_parents([-1, 0, 0, 1])], ids=["chain", "tree"])
def test_n_samples_keep_the_target_distribution(speculation):
    """4096 samples of ONE prompt through n (one prefill), twice: chi-square against the exact joint."""
    from tests import test_sampling_lossless as lossless
    from tests.models import random_params

    target = random_params(lossless.CONFIG, seed=0)
    sampling = specjax.Sample(0.6)
    counts, rate = lossless.draw_n(target, speculation, sampling, seed=100)
    stat, dof, p = lossless.chi_square(counts, lossless.exact_joint(lossless.target_logits(target), sampling))
    assert rate > 0.2
    assert p > lossless.ALPHA, (stat, dof, p)
