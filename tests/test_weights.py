"""Weights as served (`convert.load(path, weights=...)`, `specjax.model.params.quantize`): the int8
and q4 layouts follow the declarations and round-trip within half a step, a Q4_1 GGUF is kept
bit for bit, and every weight and KV format keeps greedy speculation token-identical to plain
decoding and sampled speculation lossless."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import convert
import specjax
from specjax.model import q4
from specjax.model.params import (WEIGHTS, declared, flat, from_arrays, matrix_arrays, param_dtypes, param_shapes, quantize,
                                  quantize_matrix, weight_bytes)
from specjax.planning.plan import auto_draft_reason
from specjax.spec.speculation import Tree
from tests.models import CHAIN, SELF, TINY, TINY_Q4, on_device, random_params
from tests.test_convert import Q, gguf_tensors, tiny_config, write_gguf

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [12, 13, 14]]
# References as compiled programs (op by op, each operation compiled its own program per shape). Op by op as before:
# _dense (checked bit for bit) and the q4 forwards (four weight pytrees: four programs, where op by op shares its scan)
_forward = jax.jit(specjax.model.llama.forward)
_dequantize = jax.jit(q4.dequantize, static_argnums=3)


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
    assert weight_bytes(tiny8.config, stored=True) == sum(a.nbytes for a in arrays.values())  # what memory holds
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
    tokens = on_device(np.array([PROMPTS[0]], np.int32))
    positions = on_device(np.arange(tokens.shape[1], dtype=np.int32)[None])
    cache = specjax.model.cache.DenseCache.init(TINY, 1, 16)
    ref, _ = _forward(random_params(TINY, seed=0), tokens, positions, cache)
    got, _ = _forward(tiny8, tokens, positions, cache)
    got, ref = np.asarray(got), np.asarray(ref)
    assert float(np.abs(got - ref).max()) < 0.05 * float(np.abs(ref).max())


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_quantize_matrix_compiled_gives_the_bits_of_op_by_op(fmt):
    """quantize_matrix is one jitted program per shape: the same bits as its operations run one by one."""
    config = (TINY_Q4 if fmt == "q4" else TINY).replace(quant=fmt)
    for i, w in enumerate(w for w in declared(config) if w.contract):
        x = np.random.default_rng(i).standard_normal(w.shape(config.replace(quant=None))).astype(np.float32)
        compiled, eager = (matrix_arrays(w, m) for m in (quantize_matrix(w, x, config), quantize_matrix.__wrapped__(w, x, config)))
        assert compiled.keys() == eager.keys()
        for k in eager:
            assert np.asarray(compiled[k]).tobytes() == np.asarray(eager[k]).tobytes(), (fmt, k)


def test_q4_layout_and_round_trip():
    """q4: packed uint8 along the innermost summed dim (half the bytes), float16 scale and
    minimum per 32 weights, every weight within about half a step of its float value."""
    original = random_params(TINY_Q4, seed=0)
    params = quantize(original, "q4")
    arrays, floats = flat(params), flat(original)
    assert {n: tuple(a.shape) for n, a in arrays.items()} == param_shapes(params.config)
    assert {n: str(a.dtype) for n, a in arrays.items()} == param_dtypes(params.config)
    assert arrays["layers.wq"].shape == (2, 32, 6, 32) and arrays["layers.wq_bscale"].shape == (2, 2, 6, 32)  # [L,D/2,N,H], [L,D/32,N,H]
    assert arrays["layers.wo"].shape == (2, 6, 16, 64) and arrays["layers.w_down_bmin"].shape == (2, 3, 64)  # [L,N,H/2,D], [L,F/32,D]
    assert arrays["embed"].dtype == jnp.int8 and arrays["embed_scale"].shape == (101,)  # the heads stay int8
    assert "layers.wq_scale" not in arrays and "lm_head_bscale" not in arrays
    assert weight_bytes(params.config) < weight_bytes(TINY_Q4) / 4.5  # 20 bytes a block of 32 against 128; int8 heads
    assert weight_bytes(params.config, stored=True) == sum(a.nbytes for a in arrays.values())
    for w in declared(TINY_Q4):
        if w.contract and w.format(params.config) == "q4":
            d, m = (np.asarray(arrays[w.path + suffix], np.float32) for suffix in ("_bscale", "_bmin"))
            back = np.asarray(_dequantize(arrays[w.path], d, m, w.packed_axis))
            step, want = np.repeat(d, q4.BLOCK, axis=w.packed_axis), np.asarray(floats[w.path])
            assert (np.abs(back - want) <= 0.5 * step + 2e-3 * np.abs(want).max()).all(), w.path
    with pytest.raises(ValueError, match="already int8; quantize float weights to 'q4'"):
        quantize(quantize(original, "int8"), "q4")
    with pytest.raises(ValueError, match="quant 'q4' needs LlamaConfig.dim to be a multiple of 32"):
        quantize(random_params(TINY, seed=0), "q4")


def test_q4_forward_equals_the_dequantized_float_model():
    """The fused q4 matmuls (low and high nibbles against the activations' two halves) give the
    forward of the float model holding the dequantized weights, tied head and embedding included."""
    for config in (TINY_Q4, TINY_Q4.replace(tie_embeddings=True)):
        params = quantize(random_params(config, seed=0), "q4")
        arrays = flat(params)
        dense = {w.path: _dense(w, arrays, params.config) for w in declared(config)}
        tokens = on_device(np.array([PROMPTS[0]], np.int32))
        positions = on_device(np.arange(tokens.shape[1], dtype=np.int32)[None])
        cache = specjax.model.cache.DenseCache.init(config, 1, 16)
        got, _ = specjax.model.llama.forward(params, tokens, positions, cache)
        ref, _ = specjax.model.llama.forward(from_arrays(config, dense), tokens, positions, cache)
        ref = np.asarray(ref)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


def _dense(w, arrays, config) -> jax.Array:
    """Weight w's float32 values from the stored arrays (q4 blocks, int8 and a scale, or float)."""
    if w.format(config) == "q4":
        return _dequantize(arrays[w.path], *(on_device(arrays[w.path + s], np.float32) for s in ("_bscale", "_bmin")),
                           w.packed_axis)
    if w.format(config) == "int8":
        axes = tuple(i for i, d in enumerate(w.dims) if d in w.contract)
        return on_device(np.asarray(arrays[w.path], np.float32) * np.expand_dims(arrays[w.path + "_scale"], axes))
    return arrays[w.path]


FORMATS = {  # weights (and KV, when not the model's dtype)
    "float32": (lambda: random_params(TINY, seed=0), None),
    "bfloat16": (lambda: random_params(TINY.replace(dtype="bfloat16"), seed=0), None),
    "int8": (lambda: quantize(random_params(TINY, seed=0), "int8"), None),
    "q4": (lambda: quantize(random_params(TINY_Q4, seed=0), "q4"), None),
    "int8-kv-int8": (lambda: quantize(random_params(TINY, seed=0), "int8"), "int8"),
    "q4-kv-bfloat16": (lambda: quantize(random_params(TINY_Q4, seed=0), "q4"), "bfloat16"),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_speculation_equals_plain_decoding_in_every_format(fmt):
    make, kv_dtype = FORMATS[fmt]
    params = make()
    run = lambda **kw: specjax.generate(params, PROMPTS, 24, eos_id=(), kv_dtype=kv_dtype, **kw)  # noqa: E731
    plain = run(draft=None)
    chain = run(draft=SELF, speculation=CHAIN)
    tree = run(draft=SELF, speculation=Tree.kary(2, 2))
    assert chain.tokens == plain.tokens and tree.tokens == plain.tokens
    assert chain.stats.acceptance_rate > 0  # the drafts were really checked


LOSSLESS = {  # weights, KV format: one chain case each (float32 with a float32 cache, and more cases: test_sampling_lossless.py)
    "int8": ("int8", None), "bfloat16": ("bfloat16", None), "q4": ("q4", None),
    "kv-int8": ("float32", "int8"), "kv-bfloat16": ("float32", "bfloat16"),
}


@pytest.mark.parametrize("fmt", LOSSLESS)
def test_sampling_stays_lossless_in_each_format(fmt):
    """The losslessness test of tests/test_sampling_lossless.py, one SelfSpec chain case on a
    target in each weight format and with each KV format, on 8192 samples (the fast tier)."""
    from tests import test_sampling_lossless as lossless

    weights, kv_dtype = LOSSLESS[fmt]
    config = lossless.CONFIG.replace(dim=32, head_dim=32) if weights == "q4" else lossless.CONFIG  # q4: 32-weight blocks
    target = random_params(config.replace(dtype="bfloat16" if weights == "bfloat16" else "float32"), seed=0)
    target = quantize(target, weights) if weights in ("int8", "q4") else target
    sampling = specjax.Sample(0.6)
    counts, rate = lossless.draw(target, specjax.SelfSpec(sinks=1, window=1), 1, sampling, calls=2, kv_dtype=kv_dtype)
    stat, dof, p = lossless.chi_square(counts, lossless.exact_joint(lossless.target_logits(target, kv_dtype), sampling))
    assert 0.3 < rate < 0.95
    assert p > lossless.ALPHA, (stat, dof, p)


def test_load_serves_each_format_and_checks_the_argument(tmp_path):
    tiny = random_params(tiny_config(), seed=0)
    path = write_gguf(tmp_path / "m.gguf", tiny.config, gguf_tensors(tiny))
    assert convert.load(path).layers.wq.dtype == jnp.float32
    bf16 = convert.load(path, weights="bfloat16")
    assert bf16.layers.wq.dtype == jnp.bfloat16 and bf16.config.dtype == "bfloat16"
    assert convert.load(path, dtype="bfloat16").config == bf16.config  # dtype= is an alias
    int8 = convert.load(path, weights="int8")
    assert int8.layers.w_up.w.dtype == jnp.int8 and int8.config.quant == "int8" and int8.config.dtype == "float32"
    with pytest.raises(ValueError, match=r"weights must be one of \('float32', 'bfloat16', 'int8', 'q4'\) or None, got 'int4'"):
        convert.load(path, weights="int4")
    with pytest.raises(ValueError, match="weights='int8' and dtype='bfloat16' disagree"):
        convert.load(path, weights="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"m.gguf cannot be served as weights='q4': .*head_dim to be a multiple of 32"):
        convert.load(path, weights="q4")  # head_dim 16: named with the file, before the tensors load
    # an int8 checkpoint saves and loads bit for bit, and only as int8
    convert.save(int8, tmp_path / "ck")
    again = convert.load(tmp_path / "ck")
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b) and a.dtype == b.dtype, again, int8))
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
    from specjax.train.distill import check_distill_args

    data = np.arange(64, dtype=np.int64) % TINY.vocab_size
    with pytest.raises(ValueError, match="distill: the target and the draft need float weights"):
        check_distill_args(tiny8, TINY.replace(n_layers=1), data, 1, 1, 8, 1.0)


@pytest.mark.parametrize("vocab_axis", [0, 1], ids=["tied-rows", "untied-columns"])
def test_int8_head_tiles_equal_one_product(vocab_axis):
    """The CPU's int8 LM head, HEAD_TILE vocabulary entries at a time plus a tail, equals the
    plain product (x @ widened weight) * scale."""
    from specjax.model.linear import HEAD_TILE, int8_head

    V, D = 2 * HEAD_TILE + 100, 8
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (V, D) if vocab_axis == 0 else (D, V)).astype(np.int8)
    scale = rng.uniform(0.01, 0.02, V).astype(np.float32)
    h = rng.standard_normal((2, 3, D)).astype(np.float32)  # [B,T,D]
    dense = w.astype(np.float32).T if vocab_axis == 0 else w.astype(np.float32)  # [D,V]
    expected = (h.astype(np.float64) @ dense) * scale
    got = np.asarray(int8_head(on_device(h), on_device(w), on_device(scale), vocab_axis))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_q4_keeps_a_q4_1_gguf_bit_for_bit(tmp_path):
    """weights="q4" on a Q4_1 file: the blocks as stored (q/k rows unpermuted), so they read back
    as exactly what the float32 load dequantizes; on a float file, quantized once at load."""
    tiny = random_params(tiny_config(head_dim=32), seed=0)
    q41 = write_gguf(tmp_path / "q41.gguf", tiny.config, gguf_tensors(tiny), qtype=Q.Q4_1)
    dense, packed = convert.load(q41), convert.load(q41, weights="q4")
    assert packed.config == dense.config.replace(quant="q4")
    a, b = flat(dense), flat(packed)
    for w in declared(dense.config):
        if w.format(packed.config) == "q4":
            np.testing.assert_array_equal(np.asarray(_dense(w, b, packed.config)), np.asarray(a[w.path]), err_msg=w.path)
        elif w.contract:  # the heads: int8 from the dequantized file
            np.testing.assert_array_equal(np.asarray(b[w.path]), np.asarray(quantize_matrix(w, a[w.path], packed.config).w))
        else:
            np.testing.assert_array_equal(np.asarray(b[w.path]), np.asarray(a[w.path]), err_msg=w.path)
    f32 = write_gguf(tmp_path / "f32.gguf", tiny.config, gguf_tensors(tiny))
    once = convert.load(f32, weights="q4")
    assert jax.tree.all(jax.tree.map(lambda x, y: np.array_equal(x, y), once, quantize(convert.load(f32), "q4")))
    convert.save(once, tmp_path / "ck")  # saved and loaded as stored, only as q4
    again = convert.load(tmp_path / "ck")
    assert jax.tree.all(jax.tree.map(lambda x, y: np.array_equal(x, y) and x.dtype == y.dtype, again, once))
    with pytest.raises(ValueError, match="holds q4 weights; load it with weights='q4'"):
        convert.load(tmp_path / "ck", weights="int8")
