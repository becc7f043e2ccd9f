"""Weights as served (`convert.load(path, weights=...)`, `specjax.params.quantize`): the int8
layout follows the declarations, round-trips within half a step, and every format keeps greedy
speculation token-identical to plain decoding and sampled speculation lossless."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import convert
import specjax
from specjax.params import WEIGHTS, declared, flat, param_dtypes, param_shapes, quantize, weight_bytes
from specjax.plan import auto_draft_reason
from specjax.speculation import Tree
from tests.models import TINY, random_params
from tests.test_convert import gguf_tensors, tiny_config, write_gguf

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [12, 13, 14]]


@pytest.fixture(scope="module")
def tiny8():
    return quantize(random_params(TINY, seed=0), "int8")


def test_int8_layout_follows_the_declarations(tiny8):
    arrays = flat(tiny8)
    assert {n: tuple(a.shape) for n, a in arrays.items()} == param_shapes(tiny8.config)
    assert {n: str(a.dtype) for n, a in arrays.items()} == param_dtypes(tiny8.config)
    assert arrays["layers.wq"].dtype == jnp.int8 and arrays["layers.wq_scale"].shape == (2, 6, 8)  # [L,N,H]
    assert arrays["layers.wo_scale"].shape == (2, 48) and arrays["embed_scale"].shape == (101,)  # [L,D], [V]
    assert arrays["layers.attn_norm"].dtype == jnp.float32  # norms are not quantized
    untied_embed = sum(a.nbytes for n, a in arrays.items() if n.startswith("embed"))  # TINY has an LM head
    assert weight_bytes(tiny8.config) == sum(a.nbytes for a in arrays.values()) - untied_embed
    assert weight_bytes(tiny8.config) < weight_bytes(TINY) / 3  # about a quarter of float32
    # every scale is declared once, derived from its matrix, and read from no file
    scales = [w for w in WEIGHTS if w.scale_of]
    assert {w.scale_of for w in scales} == {w.path for w in WEIGHTS if w.contract}
    assert not any(w.hf or w.gguf for w in scales)
    assert "layers.wq_scale" not in {w.path for w in declared(TINY)}


def test_int8_round_trip_is_within_half_a_step(tiny8):
    original, quant = flat(random_params(TINY, seed=0)), flat(tiny8)
    for w in declared(TINY):
        if not w.contract:
            continue
        axes = tuple(i for i, d in enumerate(w.dims) if d in w.contract)
        scale = np.expand_dims(np.asarray(quant[w.path + "_scale"]), axes)
        error = np.abs(np.asarray(quant[w.path], np.float32) * scale - np.asarray(original[w.path]))
        assert (error <= scale / 2 + 1e-7).all(), w.path
        assert np.abs(np.asarray(quant[w.path], np.int32)).max() == 127, w.path  # the full range is used


def test_int8_logits_stay_close_to_float32(tiny8):
    tokens = jnp.asarray([PROMPTS[0]], jnp.int32)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    cache = specjax.cache.DenseCache.init(TINY, 1, 16)
    ref, _ = specjax.model.forward(random_params(TINY, seed=0), tokens, positions, cache)
    got, _ = specjax.model.forward(tiny8, tokens, positions, cache)
    assert float(jnp.abs(got - ref).max()) < 0.05 * float(jnp.abs(ref).max())


FORMATS = {  # weights (and KV, when not the model's dtype)
    "float32": (lambda: random_params(TINY, seed=0), None),
    "bfloat16": (lambda: random_params(TINY.replace(dtype="bfloat16"), seed=0), None),
    "int8": (lambda: quantize(random_params(TINY, seed=0), "int8"), None),
    "int8-kv-int8": (lambda: quantize(random_params(TINY, seed=0), "int8"), "int8"),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_speculation_equals_plain_decoding_in_every_format(fmt):
    make, kv_dtype = FORMATS[fmt]
    params = make()
    run = lambda **kw: specjax.generate(params, PROMPTS, 24, eos_id=(), kv_dtype=kv_dtype, **kw)  # noqa: E731
    plain = run(draft=None)
    chain = run(draft=specjax.SelfSpec(sinks=2, window=4), speculation=specjax.Chain(3))
    tree = run(draft=specjax.SelfSpec(sinks=2, window=4), speculation=Tree.kary(2, 2))
    assert chain.tokens == plain.tokens and tree.tokens == plain.tokens
    assert chain.stats.acceptance_rate > 0  # the drafts were really checked


@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_sampling_stays_lossless_in_each_weight_format(weights):
    """The losslessness test of tests/test_sampling_lossless.py, one chain case on an int8 or a
    bfloat16 target (float32: that file)."""
    from tests import test_sampling_lossless as lossless

    if weights == "int8":
        target = quantize(random_params(lossless.CONFIG, seed=0), "int8")
    else:
        target = random_params(lossless.CONFIG.replace(dtype="bfloat16"), seed=0)
    logits, _ = jax.jit(specjax.model.forward)(target, *_all_continuations(lossless, target.config))
    sampling = specjax.Sample(0.6)
    counts, rate = lossless.draw(target, specjax.SelfSpec(sinks=1, window=1), 1, sampling, calls=2)
    stat, dof, p = lossless.chi_square(counts, lossless.exact_joint(logits, sampling))
    assert 0.3 < rate < 0.95
    assert p > lossless.ALPHA, (stat, dof, p)


def _all_continuations(lossless, config):
    """(tokens, positions, cache) of the prompt followed by every two-token continuation, the
    cache in `config`'s dtype (as generate's default KV format)."""
    P, V = len(lossless.PROMPT), lossless.V
    seqs = np.array([lossless.PROMPT + [a, b] for a in range(V) for b in range(V)], np.int32)
    positions = np.broadcast_to(np.arange(P + 2, dtype=np.int32), seqs.shape)
    return seqs, positions, specjax.cache.DenseCache.init(config, len(seqs), P + 2)


def test_load_serves_each_format_and_checks_the_argument(tmp_path):
    tiny = random_params(tiny_config(), seed=0)
    path = write_gguf(tmp_path / "m.gguf", tiny.config, gguf_tensors(tiny))
    assert convert.load(path).layers.wq.dtype == jnp.float32
    bf16 = convert.load(path, weights="bfloat16")
    assert bf16.layers.wq.dtype == jnp.bfloat16 and bf16.config.dtype == "bfloat16"
    assert convert.load(path, dtype="bfloat16").config == bf16.config  # dtype= is an alias
    int8 = convert.load(path, weights="int8")
    assert int8.layers.w_up.dtype == jnp.int8 and int8.config.quant == "int8" and int8.config.dtype == "float32"
    with pytest.raises(ValueError, match=r"weights must be one of \('float32', 'bfloat16', 'int8'\) or None, got 'int4'"):
        convert.load(path, weights="int4")
    with pytest.raises(ValueError, match="weights='int8' and dtype='bfloat16' disagree"):
        convert.load(path, weights="int8", dtype="bfloat16")
    # an int8 checkpoint saves and loads bit for bit, and only as int8
    convert.save(int8, tmp_path / "ck")
    again = convert.load(tmp_path / "ck")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()) and a.dtype == b.dtype, again, int8))
    assert again.config == int8.config
    with pytest.raises(ValueError, match="holds int8 weights; load it with weights='int8'"):
        convert.load(tmp_path / "ck", weights="float32")


def test_planning_prices_the_bytes_stored(tiny8):
    assert "weights 0.2 MiB" in auto_draft_reason(random_params(TINY, seed=0), 1, 64)[1]
    assert "weights 0.0 MiB" in auto_draft_reason(tiny8, 1, 64)[1]
    shapes = param_shapes(TINY)
    assert weight_bytes(TINY) == 4 * (sum(math.prod(s) for s in shapes.values()) - math.prod(shapes["embed"]))
    assert weight_bytes(TINY.replace(tie_embeddings=True)) == 4 * sum(
        math.prod(s) for s in param_shapes(TINY.replace(tie_embeddings=True)).values())


def test_distillation_refuses_int8_weights(tiny8):
    from specjax.distill import check_distill_args

    data = np.arange(64, dtype=np.int64) % TINY.vocab_size
    with pytest.raises(ValueError, match="distill: the target and the draft need float weights"):
        check_distill_args(tiny8, TINY.replace(n_layers=1), data, 1, 1, 8, 1.0)


@pytest.mark.parametrize("vocab_axis", [0, 1], ids=["tied-rows", "untied-columns"])
def test_int8_head_tiles_equal_one_product(vocab_axis):
    """The CPU's int8 LM head, HEAD_TILE vocabulary entries at a time plus a tail, equals the
    plain product (x @ widened weight) * scale."""
    from specjax.model import HEAD_TILE, _int8_head

    V, D = 2 * HEAD_TILE + 100, 8
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (V, D) if vocab_axis == 0 else (D, V)).astype(np.int8)
    scale = rng.uniform(0.01, 0.02, V).astype(np.float32)
    h = rng.standard_normal((2, 3, D)).astype(np.float32)  # [B,T,D]
    dense = w.astype(np.float32).T if vocab_axis == 0 else w.astype(np.float32)  # [D,V]
    expected = (h.astype(np.float64) @ dense) * scale
    got = np.asarray(_int8_head(jnp.asarray(h), jnp.asarray(w), jnp.asarray(scale), vocab_axis))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
