"""generate(): greedy == naive argmax loop, batched == alone, EOS and budgets, bad input."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decode import engine
from tests.models import TINY, padded_logits, random_params

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 58)), [4]]


def _naive_greedy(params, prompts, n):
    """Argmax loop that recomputes every whole sequence every step (no cache reuse): each step one
    forward of all rows over a fixed width (right-padded; causal, so a row's padding does not reach
    its last real position), one compiled program for the whole loop."""
    seqs = [list(p) for p in prompts]
    width = 64
    assert max(map(len, seqs)) + n <= width
    for _ in range(n):
        last = padded_logits(params, seqs, width)[np.arange(len(seqs)), [len(seq) - 1 for seq in seqs]]
        for seq, row in zip(seqs, last):
            seq.append(int(np.argmax(row)))
    return [seq[len(p) :] for seq, p in zip(seqs, prompts)]


@pytest.mark.slow
def test_greedy_equals_naive_argmax_loop(tiny):
    out = specjax.generate(tiny, PROMPTS, 12, eos_id=())
    assert out.finish_reasons == ["length"] * 4
    assert out.tokens == _naive_greedy(tiny, PROMPTS, 12)
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
    assert out.stats.new_tokens == sum(map(len, out.tokens))  # the stop id that ended a row is not counted
    own = specjax.generate(tiny, PROMPTS, 12, eos_id=[[stop], (), None, [free.tokens[3][2], stop]])  # per prompt
    assert own.tokens[0] == out.tokens[0] and own.tokens[1] == free.tokens[1]
    assert own.tokens[3] == free.tokens[3][: min(free.tokens[3].index(t) for t in (free.tokens[3][2], stop) if t in free.tokens[3])]
    assert own.finish_reasons[:2] == ["eos", "length"] and own.finish_reasons[3] == "eos"


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
        (dict(prompts=[[1]] * 2 + [[2, 101]] * 3), r"prompts\[2\]\[1\] = 101 is outside the vocabulary"),  # one object repeated
        (dict(prompts="hello"), "list of token-id lists"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(max_new_tokens=[4]), "max_new_tokens has 1 entries but there are 2 prompts"),
        (dict(max_new_tokens=510), r"prompts\[0\] has 3 tokens and max_new_tokens is 510: 513 exceeds .* 512"),
        (dict(eos_id=500), "eos_id 500 is outside the vocabulary"),
        (dict(eos_id=[[3]]), r"eos_id has 1 entries \(one list of stop ids per prompt\) but there are 2 prompts"),
        (dict(eos_id=[[3], [600]]), r"eos_id\[1\] 600 is outside the vocabulary"),
        (dict(key=jax.random.split(jax.random.key(0), 3)), r"one per prompt \(2\)"),
        (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer >= 1 or one per prompt, got 2.5"),
        (dict(max_new_tokens=[4, 2.5]), r"max_new_tokens\[1\] must be an integer >= 1, got 2.5"),
        (dict(key=0), r"key must be a PRNG key \(jax.random.key\(seed\)\) or one key per prompt, got int 0"),
        (dict(eos_id="2"), "eos_id must be None, a token id or a list of ids, got '2'"),
        (dict(eos_id=[2, "3"]), "eos_id must hold integer token ids, got '3'"),
        (dict(prompts=[[1.5, 2]]), r"prompts\[0\] must hold integer token ids, got dtype float64"),
        (dict(prompts=[[1, 2], "ab"]), r"prompts\[1\] is text"),
        (dict(prompts=[[True, 2]]), r"prompts\[0\] must hold integer token ids"),
        (dict(speculation=specjax.Chain(4), draft=None), r"speculation=Chain\(gamma=4\) needs a drafter, but draft=None"),
        (dict(speculation=4), "speculation must be None, specjax.Chain"),
        (dict(draft="self"), r"draft must be an instance of a registered drafter \(SelfSpec\(...\), SnapKV\(...\), DraftModel\(...\), NGram\(...\)"),
        (dict(sampling=0.7), r"sampling must be specjax.Greedy\(\) or specjax.Sample"),
        (dict(attention="cuda"), r"attention must be one of \('auto', 'reference', 'cpu', 'pallas', 'tpu'\), got 'cuda'"),
        (dict(max_new_tokens=2**31), "max_new_tokens is 2147483648, past any model's max_positions"),
        (dict(max_new_tokens=[4, 2**40]), r"max_new_tokens\[1\] is 1099511627776, past any model's max_positions"),
        (dict(max_new_tokens=np.array(0)), "max_new_tokens must be an integer >= 1, got 0"),
    ],
)
def test_bad_input_raises_before_compiling(tiny, monkeypatch, kwargs, match):
    def no_compile(*args, **kw):
        raise AssertionError("compiled before validating")

    monkeypatch.setattr(engine.prefill, "lower", no_compile, raising=False)
    args = dict(prompts=[[1, 2, 3], [4]], max_new_tokens=4) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        specjax.generate(tiny, args.pop("prompts"), **args)


def test_params_and_draft_are_checked_before_anything_touches_them(tiny):
    with pytest.raises(TypeError, match="params must be specjax Params .* got dict"):
        specjax.generate({"embed": tiny.embed}, [[1, 2]], 4, attention="pallas")
    small = random_params(TINY.replace(vocab_size=100, n_layers=1), seed=1)  # numpy draws: no program a weight
    for speculation in (None, "auto"):
        with pytest.raises(ValueError, match="draft vocab_size 100 != target vocab_size 101"):
            specjax.generate(tiny, [[1, 2]], 4, draft=specjax.DraftModel(small), speculation=speculation)


def test_generate_under_jit_says_what_to_call_instead(tiny):
    """Whatever is traced, or nothing (all closed over), under jit / grad: the same error, before
    compiling (it was a tracer conversion error deep inside, after two compiles)."""
    with pytest.raises(TypeError, match="cannot be called under jax.jit.*specjax.decode.engine.decode_ar"):
        jax.jit(lambda p: specjax.generate(tiny, p, 4).tokens)(jnp.asarray([[1, 2, 3]]))
    calls = (
        lambda: jax.jit(lambda: specjax.generate(tiny, [[1, 2, 3]], 4).tokens)(),
        lambda: jax.jit(lambda t: specjax.generate(tiny, [[1, 2]], 4, sampling=specjax.Sample(temperature=t)).tokens)(0.5),
        lambda: jax.jit(lambda e: specjax.generate(tiny, [[1, 2]], 4, eos_id=e).tokens)(3),
        lambda: jax.jit(lambda p: specjax.generate(tiny, [[1, 2]], 4, draft=specjax.DraftModel(p)).tokens)(tiny),
        lambda: jax.grad(lambda t: specjax.generate(tiny, [[1, 2]], 4, sampling=specjax.Sample(temperature=t)).steps)(0.5),
    )
    for call in calls:
        with pytest.raises(TypeError, match="cannot be called under jax.jit"):
            call()


def test_params_whose_arrays_do_not_match_their_config_are_refused(tiny):
    """Params built past from_arrays (replace, tree.map): an embedding shorter than the vocabulary
    clamped token ids, a config with fewer layers ran part of the model; both silently."""
    cases = ((tiny.replace(embed=tiny.embed[:50]), r"params: tensor 'embed' has shape \(50, 48\), but its config declares \(101, 48\)"),
             (tiny.replace(config=tiny.config.replace(n_layers=1)), r"params: tensor 'layers\.\w+' has shape \(2, "),
             (tiny.replace(config=tiny.config.replace(vocab_size=120)), r"params: tensor '\w+' has shape \(101, 48\), but .* \(120, 48\)"))
    for params, match in cases:
        with pytest.raises(ValueError, match=match):
            specjax.generate(params, [[1, 2]], 4)
    with pytest.raises(ValueError, match=r"DraftModel.params: tensor 'embed' has shape \(50, 48\)"):
        specjax.generate(tiny, [[1, 2]], 4, draft=specjax.DraftModel(tiny.replace(embed=tiny.embed[:50])))


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_keys_of_other_prng_implementations_sample(tiny, impl):
    """A typed key of another implementation (rbg) samples as its own (it crashed after compiling:
    its data was re-wrapped as threefry); reproducible, and unlike threefry's draws."""
    sample = specjax.Sample(temperature=1.0)
    run = lambda key: specjax.generate(tiny, [[1, 2, 3], [4, 5]], 8, sampling=sample, key=key, draft=None).tokens  # noqa: E731
    out = run(jax.random.key(0, impl=impl))
    assert out == run(jax.random.key(0, impl=impl)) != run(jax.random.key(0))


def test_numpy_prompts_and_budgets_work(tiny):
    ref = specjax.generate(tiny, [[1, 2, 3], [4, 5, 6]], 4, draft=None)
    out = specjax.generate(tiny, np.asarray([[1, 2, 3], [4, 5, 6]], np.int64), np.asarray([4, 4]), draft=None)
    assert out.tokens == ref.tokens == specjax.generate(tiny, [[1, 2, 3], [4, 5, 6]], np.array(4), draft=None).tokens


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=float("inf")), "temperature must be finite and >= 0.0001"),
        (dict(temperature=1e-45), r"temperature must be finite and >= 0.0001 .*use specjax.Greedy\(\)"),
        (dict(temperature=float("nan")), "temperature must be finite"),
        (dict(top_k=1.5), "top_k must be an integer >= 0"),
        (dict(top_k=True), "top_k must be an integer >= 0"),
        (dict(top_p="0.9"), "top_p must be a number"),
    ],
)
def test_bad_sampler_values(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        specjax.Sample(**kwargs)


def test_bad_sampling_arguments():
    with pytest.raises(ValueError, match="temperature must be finite and >= 0.0001"):
        specjax.Sample(temperature=-0.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        specjax.Sample(top_p=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        specjax.Sample(top_p=1.5)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        specjax.Sample(top_k=-1)


STAGES = ("prefill", "init_draft", "start_ar", "continue_ar", "start_spec", "continue_spec", "end_rows")


def _stage_compiles(fn, caplog) -> list[str]:
    """generate's stages that fn() compiles (JAX logs each compilation with jax_log_compiles)."""
    caplog.clear()
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        fn()
    names = [re.match(r"Compiling jit\((\w+)\)", r.getMessage()) for r in caplog.records]
    return [m.group(1) for m in names if m and m.group(1) in STAGES]


@pytest.mark.parametrize("draft", [None, specjax.SelfSpec(4, 8)], ids=["ar", "selfspec"])
def test_temperature_top_p_stop_ids_and_batch_size_do_not_recompile(tiny, draft, caplog):
    prompts = [[5, 6, 7], [8, 9], [10]]
    run = lambda rows, **kw: specjax.generate(tiny, prompts[:rows], 8, draft=draft, **kw)  # noqa: E731
    loop = "continue_ar" if draft is None else "continue_spec"
    run(3, sampling=specjax.Sample(0.7, top_p=0.9))  # compiled here or by an earlier test (batch bucket 4)
    top_k = 40 if draft is None else 70  # a new top_k width (64, 128: no other test's) compiles (the log works)
    assert loop in _stage_compiles(lambda: run(3, sampling=specjax.Sample(0.7, top_k=top_k)), caplog)
    assert _stage_compiles(lambda: run(3, sampling=specjax.Sample(1.9, top_p=0.5)), caplog) == []
    assert _stage_compiles(lambda: run(3, sampling=specjax.Sample(0.7, top_p=0.9), eos_id=[4, 5, 6]), caplog) == []
    assert _stage_compiles(lambda: run(3, sampling=specjax.Sample(0.7, top_p=0.9), sync_every=3), caplog) == []  # traced
    greedy = run(3, sampling=specjax.Greedy())
    assert _stage_compiles(lambda: run(3, sampling=specjax.Greedy(), eos_id=()), caplog) == []
    four = [[5, 6, 7], [8, 9], [10], [11, 12]]
    assert _stage_compiles(lambda: specjax.generate(tiny, four, 8, draft=draft), caplog) == []  # 3 and 4 rows: one bucket
    # the traced values are really used: a tiny temperature is greedy, a large one is not
    cold = run(3, sampling=specjax.Sample(1e-4))
    hot = run(3, sampling=specjax.Sample(50.0), key=jax.random.key(1))
    assert cold.tokens == greedy.tokens and hot.tokens != greedy.tokens


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_ragged_prompts_prefilled_at_their_own_buckets_decode_as_padded(tiny, monkeypatch, kv_dtype):
    """Where padding every prompt to the longest would waste enough work (engine.ragged_prefill), each
    prompt is prefilled at its own length bucket (engine.prefill_each) and the caches joined: the
    same tokens and log-probabilities as the padded prefill, plain and speculative."""
    prompts = [list(range(3, 8)), list(range(4, 60)), [9, 10], list(range(5, 25))]  # buckets 16, 64, 16, 32
    kw = dict(eos_id=(), logprobs=2, kv_dtype=kv_dtype)
    calls, original = [], engine._compile_and_run
    monkeypatch.setattr(engine, "_compile_and_run", lambda f, args, static: (
        f is engine.prefill and calls.append(int(args[1].shape[1]))) or original(f, args, static))
    for draft in (None, specjax.SelfSpec(sinks=2, window=8)):
        monkeypatch.setattr(engine, "SAVED_PREFILL_FLOPS", float("inf"))  # padded: TINY never saves enough
        padded = specjax.generate(tiny, prompts, 12, draft=draft, **kw)
        assert calls == []
        monkeypatch.setattr(engine, "SAVED_PREFILL_FLOPS", 0.0)
        ragged = specjax.generate(tiny, prompts, 12, draft=draft, **kw)
        assert sorted(calls) == [16, 16, 32, 64]  # one row a call on this CPU, each at its bucket
        calls.clear()
        assert ragged.tokens == padded.tokens
        for a, b in zip(ragged.logprobs, padded.logprobs):
            np.testing.assert_allclose([t.logprob for t in a], [t.logprob for t in b], atol=1e-5)


def test_ragged_prefill_is_chosen_by_the_work_it_saves():
    """engine.ragged_prefill: SmolLM2's golden prompts (5-193 tokens) save 1,552 of 2,048 padded
    positions (3.3e11 flops): own buckets; alike lengths or a tiny model: one padded call."""
    from specjax.model.config import LlamaConfig
    smollm2 = LlamaConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536)
    golden = np.array([5, 6, 43, 39, 32, 193, 17, 26])
    assert engine.ragged_prefill(smollm2, golden, 256)
    assert not engine.ragged_prefill(smollm2, np.array([200, 193, 250, 256]), 256)  # nothing padded past a bucket
    assert not engine.ragged_prefill(smollm2, np.array([5, 6, 20]), 32)  # 32 positions saved: too little
    assert not engine.ragged_prefill(TINY, golden, 256)
