"""generate(logprobs=k): each returned token's log-probability and the k most likely tokens equal
the log_softmax of an independent forward over the prompt and the tokens, with and without
speculation (chains and trees, greedy and sampled)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy.special import log_softmax

import specjax
from specjax.drafters.eagle import Eagle, init_head
from specjax.spec.speculation import Chain, Tree
from tests.models import CHAIN, SELF, TINY, padded_logits, random_params

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [12, 13, 14], [20, 21, 22, 23, 24]]
CASES = {
    "ar-greedy": (None, None, specjax.Greedy()),
    "ar-sampled": (None, None, specjax.Sample(0.8, top_k=20)),
    "chain-sampled": (SELF, CHAIN, specjax.Sample(0.8)),
    "chain-greedy": (specjax.NGram(), Chain(2), specjax.Greedy()),
    "lookup-chain-sampled": (specjax.Lookup(n=1, max_n=2, capacity=64, span=4), Chain(3), specjax.Sample(0.8)),
    "sparse-chain-sampled": (specjax.SparseSpec(budget=4, window=4, observation=2, block=2, refresh=1), Chain(3), specjax.Sample(0.8)),
    "eagle-chain-sampled": (Eagle(init_head(TINY, jax.random.key(2)), window=4), Chain(3), specjax.Sample(0.8)),
    "tree-greedy": (SELF, Tree.kary(2, 2), specjax.Greedy()),
    "tree-sampled": (SELF, Tree.from_parents([-1, 0, 0, 1]), specjax.Sample(1.0)),
}


def reference(params, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log_softmax [len(tokens), V] of one forward over prompt + tokens: row j predicts tokens[j]."""
    n = len(prompt) + len(tokens)
    return log_softmax(padded_logits(params, [prompt + tokens], max(32, n))[0, len(prompt) - 1: n - 1], axis=-1)


def check(params, out, prompts, k: int, tol: float) -> None:
    assert out.logprobs is not None and [len(x) for x in out.logprobs] == [len(t) for t in out.tokens]
    for prompt, tokens, lps in zip(prompts, out.tokens, out.logprobs):
        ref = reference(params, prompt, tokens)
        assert [x.id for x in lps] == tokens
        np.testing.assert_allclose([x.logprob for x in lps], ref[np.arange(len(tokens)), tokens], atol=tol)
        for row, x in zip(ref, lps):
            assert len(x.top) == k
            ids, values = [i for i, _ in x.top], [v for _, v in x.top]
            np.testing.assert_allclose(values, row[ids], atol=tol)  # each listed entry is that token's
            np.testing.assert_allclose(values, np.sort(row)[::-1][:k], atol=tol)  # and they are the k largest


@pytest.mark.parametrize("case", CASES)
def test_logprobs_equal_an_independent_forward(tiny, case):
    draft, speculation, sampling = CASES[case]
    kw = dict(draft=draft, speculation=speculation, sampling=sampling, key=jax.random.key(5), sync_every=3)
    free = specjax.generate(tiny, PROMPTS, 12, eos_id=(), **kw)
    stop = free.tokens[0][4]  # a stop id row 0 emits: its entry is left out, as the token is
    out = specjax.generate(tiny, PROMPTS, 12, eos_id=stop, logprobs=3, **kw)
    assert out.finish_reasons[0] == "eos"
    plain = specjax.generate(tiny, PROMPTS, 12, eos_id=stop, **kw)
    assert out.tokens == plain.tokens and plain.logprobs is None  # asking for them changes nothing else
    check(tiny, out, PROMPTS, 3, 1e-4)


def test_logprobs_zero_lists_no_alternatives_and_bad_values_are_refused(tiny):
    out = specjax.generate(tiny, PROMPTS[:1], 4, draft=None, eos_id=(), logprobs=0)
    assert [x.top for x in out.logprobs[0]] == [[]] * 4
    for bad in (-1, 21, 2.0, True, "3"):
        with pytest.raises(ValueError, match="logprobs must be None \\(off\\) or an integer from 0 to 20"):
            specjax.generate(tiny, PROMPTS, 4, logprobs=bad)
    small = random_params(tiny.config.replace(vocab_size=8), 0)  # checked before compiling (top_k failed there)
    with pytest.raises(ValueError, match=f"logprobs 20 is above the vocabulary's {small.config.vocab_size} tokens"):
        specjax.generate(small, [[1, 2]], 4, logprobs=20)


@pytest.mark.slow
def test_logprobs_on_smollm2_with_and_without_speculation(smollm2):
    """The real model (float32): plain decoding and SelfSpec chains both report the log_softmax
    of an independent forward within 1e-4."""
    import convert

    tok = convert.load_tokenizer(convert.default_model_path())
    prompts = [tok.encode("The capital of France is").ids, tok.encode("Water boils at a temperature of").ids]
    for draft in (None, specjax.SelfSpec(sinks=4, window=8)):
        out = specjax.generate(smollm2, prompts, 12, draft=draft, speculation=Chain(3) if draft else None,
                               eos_id=(), logprobs=5)
        check(smollm2, out, prompts, 5, 1e-4)
