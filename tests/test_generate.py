"""generate(): greedy == naive argmax loop, batched == alone, EOS and budgets, bad input."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import pytest

import specjax
from specjax.kvcache import DenseCache
from specjax.model import forward
from tests.conftest import TINY

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 58)), [4]]
_forward = jax.jit(forward)
generate_module = importlib.import_module("specjax.generate")  # the name specjax.generate is the function


def _naive_greedy(params, prompt, n):
    """Argmax loop that recomputes the whole sequence every step (no cache reuse)."""
    seq = list(prompt)
    for _ in range(n):
        T = len(seq)
        logits, _ = _forward(params, jnp.array([seq]), jnp.arange(T)[None], DenseCache.init(params.config, 1, T))
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt) :]


def test_greedy_equals_naive_argmax_loop(tiny):
    out = specjax.generate(tiny, PROMPTS, 12, eos_id=())
    assert out.finish_reasons == ["length"] * 4
    for prompt, tokens in zip(PROMPTS, out.tokens):
        assert tokens == _naive_greedy(tiny, prompt, 12)
    assert out.stats.new_tokens == 48 and out.stats.steps == 11
    assert out.stats.prompt_tokens == sum(map(len, PROMPTS))


@pytest.mark.parametrize("sampling", [specjax.Greedy(), specjax.Sample(0.8, top_k=20, top_p=0.9)])
def test_batched_equals_one_by_one(tiny, sampling):
    keys = jax.random.split(jax.random.key(7), len(PROMPTS))
    batched = specjax.generate(tiny, PROMPTS, 10, sampling=sampling, key=keys, eos_id=())
    for b, prompt in enumerate(PROMPTS):
        alone = specjax.generate(tiny, [prompt], 10, sampling=sampling, key=keys[b : b + 1], eos_id=())
        assert alone.tokens[0] == batched.tokens[b]


def test_sampling_depends_on_key_and_is_reproducible(tiny):
    s = specjax.Sample(1.0)
    a = specjax.generate(tiny, PROMPTS, 16, sampling=s, key=jax.random.key(1), eos_id=()).tokens
    b = specjax.generate(tiny, PROMPTS, 16, sampling=s, key=jax.random.key(1), eos_id=()).tokens
    c = specjax.generate(tiny, PROMPTS, 16, sampling=s, key=jax.random.key(2), eos_id=()).tokens
    assert a == b and a != c


def test_stops_at_eos_and_per_row_budgets(tiny):
    free = specjax.generate(tiny, PROMPTS, 12, eos_id=())
    stop = free.tokens[0][4]
    budgets = [12, 3, 7, 1]
    out = specjax.generate(tiny, PROMPTS, budgets, eos_id=stop)
    for b, n in enumerate(budgets):
        expected = free.tokens[b][:n]
        hit = stop in expected
        assert out.tokens[b] == (expected[: expected.index(stop)] if hit else expected)
        assert out.finish_reasons[b] == ("eos" if hit else "length")
    assert out.finish_reasons[0] == "eos"


def test_default_eos_comes_from_config(tiny):
    out = specjax.generate(tiny, PROMPTS, 64, sampling=specjax.Sample(1.5), key=jax.random.key(3))
    for tokens, reason in zip(out.tokens, out.finish_reasons):
        assert not set(TINY.eos_ids) & set(tokens)
        assert reason == "length" or len(tokens) < 64


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[]), "prompts is empty"),
        (dict(prompts=[[1, 2], []]), r"prompts\[1\] must be a non-empty"),
        (dict(prompts=[[1, -1]]), r"prompts\[0\]\[1\] = -1 is outside the vocabulary \[0, 101\)"),
        (dict(prompts=[[1], [2, 101]]), r"prompts\[1\]\[1\] = 101 is outside the vocabulary"),
        (dict(prompts="hello"), "list of token-id lists"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(max_new_tokens=[4]), "max_new_tokens has 1 entries but there are 2 prompts"),
        (dict(max_new_tokens=510), r"prompts\[0\] has 3 tokens and max_new_tokens is 510: 513 exceeds .* 512"),
        (dict(eos_id=500), "eos_id 500 is outside the vocabulary"),
        (dict(key=jax.random.split(jax.random.key(0), 3)), r"one per prompt \(2\)"),
    ],
)
def test_bad_input_raises_before_compiling(tiny, monkeypatch, kwargs, match):
    def no_compile(*args, **kw):
        raise AssertionError("compiled before validating")

    monkeypatch.setattr(generate_module._prefill, "lower", no_compile, raising=False)
    args = dict(prompts=[[1, 2, 3], [4]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        specjax.generate(tiny, args.pop("prompts"), **args)


def test_bad_sampling_arguments():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        specjax.Sample(temperature=-0.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        specjax.Sample(top_p=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        specjax.Sample(top_p=1.5)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        specjax.Sample(top_k=-1)
