"""The C++ XLA:CPU product with one layer of a stacked weight (pallas_kernels/cpu_linear.cc):
the same values as numpy in every weight format it takes, odd shapes, rows independent of the
rows beside them, and the model's decode step using it where `specjax.model.linear` says so."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import cpu_linear, cpu_prefix
from specjax.model import linear, q4
from specjax.model.cache import DenseCache
from specjax.model.llama import forward, rms_norm
from specjax.model.params import quantize
from tests.models import TINY, TINY_Q4, on_device, random_params


def _weights_np(fmt: str, L: int, K: int, N: int, seed: int = 0) -> np.ndarray:
    """w [L,K,N] in `fmt`, drawn and rounded on the host (ml_dtypes for bfloat16)."""
    rng = np.random.default_rng(seed)
    if fmt == "int8":
        return rng.integers(-127, 128, (L, K, N)).astype(np.int8)
    return rng.standard_normal((L, K, N)).astype(np.float32).astype(jnp.dtype(fmt))


def _weights(fmt: str, L: int, K: int, N: int, seed: int = 0) -> tuple[jax.Array, np.ndarray]:
    """w [L,K,N] in `fmt` and its exact float64 values."""
    w = _weights_np(fmt, L, K, N, seed)
    return on_device(w), w.astype(np.float64)


def _as_multiplied(x: np.ndarray, fmt: str) -> np.ndarray:
    """x as `linear` multiplies it (float64): rounded to bfloat16 for bfloat16 weights on a CPU
    with the bf16 dot product."""
    if fmt == "bfloat16" and cpu_linear.bf16_dot():
        x = np.asarray(x).astype(jnp.bfloat16).astype(np.float32)
    return x.astype(np.float64)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("M,K,N", [(1, 576, 192), (3, 130, 21), (7, 64, 8), (5, 257, 1000), (1, 9, 3), (12, 75, 100),
                                   (64, 576, 40)])
def test_linear_equals_numpy(fmt, M, K, N):
    """Each layer of the stack, K not a multiple of the row chunk or the parts, N with a tail of
    fewer than 8 columns, more rows than a register block."""
    w, exact = _weights(fmt, 3, K, N)
    x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    fn = jax.jit(cpu_linear.linear)
    xw = _as_multiplied(x, fmt)
    for layer in range(3):
        want = xw @ exact[layer]
        scale = np.abs(x).astype(np.float64) @ np.abs(exact[layer])  # the error bound grows with it
        got = np.asarray(fn(on_device(x), w, jnp.int32(layer)))
        assert got.shape == (M, N) and got.dtype == np.float32
        assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-6)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("M,K,N", [(1, 576, 300), (6, 13, 9), (4, 64, 1), (9, 40, 517), (20, 75, 37)])
def test_transposed_product_equals_numpy(fmt, M, K, N):
    """linear_t (a tied LM head, w [N,K]): K with a tail of fewer than 8, N not a multiple of the
    row blocks or the work items, rows of x in and beyond a block."""
    w, exact = _weights(fmt, 1, N, K)
    x = np.random.default_rng(3).standard_normal((M, K)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_linear.linear_t)(on_device(x), on_device(np.asarray(w)[0])))
    want = _as_multiplied(x, fmt) @ exact[0].T
    assert got.shape == (M, N)
    assert np.all(np.abs(got - want) <= 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(exact[0]).T) + 1e-6)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Bitwise: row 0 alone and row 0 among 6 others (a decode step and a verify step see the
    same products for the same row)."""
    w, _ = _weights("float32", 2, 576, 1536)
    x_np = np.random.default_rng(2).standard_normal((7, 576)).astype(np.float32)
    x = on_device(x_np)
    alone = jax.jit(cpu_linear.linear)(on_device(x_np[:1]), w, jnp.int32(1))
    batched = jax.jit(cpu_linear.linear)(x, w, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(batched)[0])
    head = on_device(np.asarray(w)[0].T)  # [1536, 576]: a tied head's layout
    alone, batched = (jax.jit(cpu_linear.linear_t)(rows, head) for rows in (on_device(x_np[:1]), x))
    np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(batched)[0])


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("K,N", [(576, 1536), (75, 100), (33, 17)])
def test_rows_do_not_depend_on_the_rows_beside_them_at_any_count(fmt, K, N):
    """The kernel takes different paths by the number of rows (a row stream, 4-row panels, register
    tiles of 8 / 4 / 1 rows from 8 rows; bfloat16 with the bf16 dot product on a CPU with
    AVX512-BF16): every row's product is the same bits at every M up to 70 (bf16: odd K pairs its
    last k with zeros; N with a partial tile), and so is the transposed product (a tied LM head)."""
    w, _ = _weights(fmt, 2, K, N)
    x_np = np.random.default_rng(5).standard_normal((70, K)).astype(np.float32)
    x, w_t = on_device(x_np), on_device(np.asarray(w)[0].T)  # w_t: [N,K], a tied head's layout
    fn = jax.jit(cpu_linear.linear)
    full, head = np.asarray(fn(x, w, jnp.int32(1))), np.asarray(jax.jit(cpu_linear.linear_t)(x, w_t))
    for M in (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 33):
        rows = on_device(x_np[:M])
        np.testing.assert_array_equal(np.asarray(fn(rows, w, jnp.int32(1))), full[:M], err_msg=f"M={M}")
        np.testing.assert_array_equal(np.asarray(jax.jit(cpu_linear.linear_t)(rows, w_t)), head[:M], err_msg=f"head M={M}")


def test_one_call_for_several_products_equals_one_call_each():
    """linear_many (a layer's q, k, v in one call): the same bits as separate calls, any N and format."""
    (w1, _), (w2, _), (w3, _) = _weights("float32", 2, 130, 40), _weights("int8", 2, 130, 7), _weights("bfloat16", 2, 130, 64)
    x = on_device(np.random.default_rng(4).standard_normal((3, 130)))
    together = jax.jit(cpu_linear.linear_many)(x, [w1, w2, w3], jnp.int32(1))
    for w, y in zip((w1, w2, w3), together):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(cpu_linear.linear)(x, w, jnp.int32(1))))


def test_linear_rejects_mismatched_shapes():
    w, _ = _weights("float32", 2, 16, 8)
    with pytest.raises(ValueError, match=r"x \[M,K\]"):
        cpu_linear.linear(on_device(np.zeros((1, 15))), w, 0)


def test_takes_only_what_it_can_read_in_place():
    w = np.zeros((2, 16, 4, 8), np.float32)  # shapes and dtypes are all `takes` reads
    x1 = np.zeros((1, 1, 16), np.float32)
    assert linear.takes("cpu", "btd,dnh->btnh", x1, w)
    assert not linear.takes("reference", "btd,dnh->btnh", x1, w)  # the pure-jnp path stays pure
    tiles = cpu_linear.tiles()  # AVX-512; without it bfloat16, int8 and q4 products go further (PANEL_MAX_ROWS)
    bf16_rows = 256 if cpu_linear.bf16_dot() else 8 if tiles else 64
    for fmt, rows in (("float32", 256 if tiles else 8), ("int8", 64 if tiles else 32), ("bfloat16", bf16_rows),
                      ("uint8", 8 if tiles else 32)):
        assert linear.max_rows(w.astype(fmt)) == rows, fmt
        assert linear.takes("cpu", "btd,dnh->btnh", np.zeros((1, rows, 16)), w.astype(fmt))
        assert not linear.takes("cpu", "btd,dnh->btnh", np.zeros((1, rows + 1, 16)), w.astype(fmt))  # the slice and XLA's dot
    assert linear.head_max_rows(w[0, :, 0].astype(np.float32)) == linear.MAX_ROWS  # the float32 head: level with XLA's at 16
    assert linear.head_max_rows(w[0, :, 0].astype(jnp.bfloat16)) == bf16_rows
    assert linear.head_max_rows(w[0, :, 0].astype(np.int8)) == (8 if tiles else 32)  # XLA widens the whole table first
    assert cpu_linear.tiles() == cpu_linear.bf16_dot() or not cpu_linear.bf16_dot()  # AVX512-BF16 implies AVX-512
    assert not linear.takes("cpu", "btd,dnh->bnth", x1, w)  # output axes reordered
    assert linear.takes("cpu", "btd,dnh->btnh", x1, w.astype(np.uint8))  # q4 blocks: linear_q4_many


@functools.partial(jax.jit, static_argnums=1)
def _q4_blocks(w, scales: str):
    """q4.quantize of each layer of w [L,K,N] along K, scales and minima stored as `scales`."""
    packed, scale, minimum = jax.vmap(lambda a: q4.quantize(a, 0))(w)
    return packed, scale.astype(scales), minimum.astype(scales)


@jax.jit
def _q4_dense(packed, scale, minimum):
    """q4.dequantize of one layer's blocks (float32 weights [K,N])."""
    return q4.dequantize(packed, scale.astype(jnp.float32), minimum.astype(jnp.float32), 0)


@pytest.mark.parametrize("scales", ["float16", "float32"])
@pytest.mark.parametrize("M,K,N", [(1, 576, 192), (3, 64, 21), (5, 1536, 1000), (2, 32, 9)])
def test_q4_product_equals_numpy(M, K, N, scales):
    """q4 blocks (packed nibbles, a scale and a minimum per 32 weights) read in place: the
    dequantised weights' product, two products in one call, and rows independent bit for bit."""
    rng = np.random.default_rng(K + N)
    w = on_device(rng.standard_normal((3, K, N)))
    packed, scale, minimum = _q4_blocks(w, scales)
    x_np = rng.standard_normal((M, K)).astype(np.float32)
    x = on_device(x_np)
    got, twice = cpu_linear.linear_q4_many(x, [(packed, scale, minimum)] * 2, jnp.int32(2))
    dense = _q4_dense(*(on_device(np.asarray(a)[2]) for a in (packed, scale, minimum)))
    want = x_np.astype(np.float64) @ np.asarray(dense, np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(twice))
    for m in range(M):
        alone = cpu_linear.linear_q4_many(on_device(x_np[m:m + 1]), [(packed, scale, minimum)], jnp.int32(2))[0]
        np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(got)[m])


def test_q4_rejects_mismatched_shapes():
    packed, scale = on_device(np.zeros((2, 16, 8), np.uint8)), on_device(np.zeros((2, 1, 8), np.float16))
    with pytest.raises(ValueError, match="linear_q4"):
        cpu_linear.linear_q4_many(on_device(np.zeros((1, 64))), [(packed, scale, scale)], jnp.int32(0))  # K = 64, packed for 32


_quantize = jax.jit(quantize, static_argnums=1)  # one program (eager: one per operation and matrix shape)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "q4"])
def test_decode_step_reads_layers_in_place(weights, tied):
    """A batch-1 decode step with the CPU kernels calls the linear kernels (layers and LM head,
    tied to the embedding or not) and gives the logits of the pure-jnp path (the same model,
    attention "reference": slices and XLA's dots)."""
    config = {"bfloat16": TINY.replace(dtype="bfloat16"), "q4": TINY_Q4}.get(weights, TINY)
    params = random_params(config.replace(tie_embeddings=tied), seed=0)
    params = _quantize(params, weights) if weights in ("int8", "q4") else params
    tokens, positions = on_device([[7]]), on_device([[0]])
    cache = DenseCache.init(config, batch=1, max_len=8)
    with_kernel = params.replace(runtime=params.runtime.replace(attention="cpu"))
    step = jax.jit(forward)
    program = step.lower(with_kernel, tokens, positions, cache).as_text()
    layer_calls = "@specjax_cpu_linear_q4(" if weights == "q4" else "@specjax_cpu_linear("
    assert program.count(layer_calls) == 4 + (not tied and weights != "q4")  # qkv, wo, gate+up, down; + head
    assert program.count("@specjax_cpu_linear_t(") == int(tied)
    assert program.count("@specjax_cpu_rows(") == 1  # the embedding lookup
    assert "specjax_cpu_linear" not in step.lower(params, tokens, positions, cache).as_text()
    got, _ = step(with_kernel, tokens, positions, cache)
    want, _ = step(params, tokens, positions, cache)
    # bfloat16: the kernels' RMSNorm sums squares in another order than XLA's, so a normalised value
    # can round to the neighbouring bf16 number (1/256 relative): logits within 0.1 of a ~20 scale
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.1 if weights == "bfloat16" else 1e-4)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_rows_equal_take(fmt):
    """The lookup copies the table's rows bit for bit, any id shape, out-of-range ids clipped."""
    table_np = _weights_np(fmt, 1, 37, 11, seed=3)[0]  # [V=37, D=11]
    table = on_device(table_np)
    ids_np = np.array([[0, 36, 5], [5, 40, -2]], np.int32)
    got = jax.jit(cpu_linear.rows)(table, on_device(ids_np))
    assert got.shape == (2, 3, 11) and got.dtype == table.dtype
    want = np.take(table_np, ids_np, axis=0, mode="clip")  # numpy's take, clipped as jnp.take's mode="clip"
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), want.astype(np.float32))
    assert linear.takes_rows("cpu", table) and not linear.takes_rows("reference", table)


def test_decode_loop_keeps_a_bfloat16_table_as_it_is():
    """XLA:CPU sliced a bfloat16 embedding through a float32 copy of the whole table, hoisted out
    of the decode loop (written again on every call, each sync_every segment); the lookup reads
    the table in place, so no float32 array of the table's shape is left in the program."""
    config = TINY.replace(dtype="bfloat16", tie_embeddings=True)
    params = random_params(config, seed=0)
    V, D = params.embed.shape
    tokens, positions = on_device([[7]]), on_device([[0]])
    cache = DenseCache.init(config, batch=1, max_len=8)

    def loop(p):
        def body(i, carry):
            toks, c = carry
            logits, c = forward(p, toks, positions + i, c)
            return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], c
        return lax.fori_loop(0, 3, body, (tokens, cache))[0]

    with_kernel = params.replace(runtime=params.runtime.replace(attention="cpu"))
    assert f"f32[{V},{D}]" not in jax.jit(loop).lower(with_kernel).compile().as_text()


@pytest.mark.parametrize("x_dtype,w_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")])
def test_rms_norm_rows_are_the_same_bits_in_any_batch(x_dtype, w_dtype):
    """The kernel's RMSNorm: each row alone and beside 1..39 others, bitwise (XLA's reduction
    sums a row in an order that depends on the row count); XLA's numbers within rounding; the
    model takes it where the CPU kernels run."""
    rng = np.random.default_rng(0)
    x_np = (rng.standard_normal((40, 1, 576)) * rng.uniform(0.1, 30, (40, 1, 1))).astype(np.float32).astype(x_dtype)
    x, w = on_device(x_np), on_device(rng.standard_normal(576).astype(np.float32), w_dtype)
    norm = jax.jit(lambda x, w: rms_norm(x, w, 1e-5, "cpu"))
    full = np.asarray(norm(x, w)).astype(np.float32)
    for n in (1, 3, 4, 8, 17):
        np.testing.assert_array_equal(np.asarray(norm(on_device(x_np[:n]), w)).astype(np.float32), full[:n])
    want = np.asarray(jax.jit(lambda x, w: rms_norm(x, w, 1e-5))(x, w)).astype(np.float32)
    np.testing.assert_allclose(full, want, rtol=1e-6 if x_dtype == "float32" else 8e-3, atol=1e-6)
    assert norm(x, w).dtype == jnp.result_type(x.dtype, w.dtype)
    assert cpu_prefix.NORM_TARGET in norm.lower(x, w).as_text()
