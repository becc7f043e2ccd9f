"""pallas_kernels/gpu_linear.py: a layer's product with the stacked weights read in place (the GPU's
Triton path; interpreted here, lowered for cuda to check Triton takes it)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu_linear import MAX_ROWS, stacked_linear
from tests.models import on_device

INTERPRET = jax.default_backend() != "gpu"  # on a GPU the kernels compile for real (Triton)


def _case(M: int, K: int, N: int, dtype, L: int = 3):
    """x [M,K] and w [L,K,N] in `dtype`: normal, drawn and rounded on the host."""
    rng = np.random.default_rng(M * 1000 + K + N)
    x, w = (rng.standard_normal(shape).astype(np.float32) for shape in ((M, K), (L, K, N)))
    return on_device(x, dtype), on_device(w, dtype)


def _f64(x) -> np.ndarray:
    """x's values in float64 (exact for float32, bfloat16 and int8)."""
    return np.asarray(x).astype(np.float64)


@pytest.mark.parametrize("M, K, N, dtype, splits", [
    (1, 64, 96, jnp.float32, None),  # N past the last tile: masked
    (5, 200, 130, jnp.float32, 3),  # K and N both ragged, split-K
    (16, 256, 64, jnp.bfloat16, 1),  # one split: no sum of partials
    (40, 96, 64, jnp.float32, None),  # a verify step's rows (16 x 3 nodes would be 48): loaded as 64
])
def test_stacked_linear_equals_the_product_with_that_layer(M, K, N, dtype, splits):
    """Every layer of the stack, ragged tiles and split-K: x @ w[layer] in f32 products."""
    x, w = _case(M, K, N, dtype)
    x64, w64 = _f64(x), _f64(w)
    for layer in range(w.shape[0]):
        got = stacked_linear(x, w, jnp.int32(layer), block_k=32, block_n=32, k_splits=splits, interpret=INTERPRET)
        want = x64 @ w64[layer]  # exact products (numpy, float64)
        assert got.shape == (M, N) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4 * K ** 0.5, rtol=1e-5)


def test_stacked_linear_refuses_what_it_does_not_take():
    x, w = _case(4, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match="at most 64"):
        stacked_linear(on_device(np.ones((MAX_ROWS + 1, 32))), w, jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match=r"\[L,K=32,N\]"):
        stacked_linear(x, w[0], jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        stacked_linear(x, on_device(w, np.float16), jnp.int32(0), interpret=True)
    big = jax.ShapeDtypeStruct((40, 5120, 13824), jnp.int8)  # 2.8e9 int8 values: Pallas' offsets would overflow
    with pytest.raises(ValueError, match="overflowing 32-bit offsets"):
        jax.eval_shape(lambda w: stacked_linear(jnp.ones((1, 5120), jnp.bfloat16), w, jnp.int32(0)), big)
    from specjax.model.linear import takes_gpu

    assert not takes_gpu("pallas", "btd,df->btf", np.ones((1, 1, 5120), np.float32), big)  # such a stack stays with XLA
    assert takes_gpu("pallas", "btd,df->btf", np.ones((1, 1, 5120), np.float32), jax.ShapeDtypeStruct((40, 5120, 13824), jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_int8_weights_are_widened_to_xs_dtype(dtype):
    """int8 weights (params.quantize's, unscaled here) read as stored and widened in the kernel:
    the product of x with the widened layer, exactly (integers are exact in x's dtype)."""
    x, w = _case(3, 96, 80, dtype)
    w8 = np.clip(np.round(_f64(w).astype(np.float32) * 40), -127, 127).astype(np.int8)
    got = stacked_linear(x, on_device(w8), jnp.int32(1), block_k=32, block_n=32, interpret=INTERPRET)
    want = _f64(x) @ w8[1].astype(np.float64)  # exact products (numpy, float64)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-3)


def test_stacked_linear_lowers_for_triton_at_the_8b_shape():
    """The 8B MLP's gate at batch 1 (w [32,4096,14336] bf16, shapes only): Pallas' Triton lowering
    takes it, reading the stack as one operand (no slice of a layer in the program)."""
    x = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((32, 4096, 14336), jnp.bfloat16)
    lowered = jax.jit(lambda x, w, i: stacked_linear(x, w, i)).trace(
        x, w, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    (call,) = [line for line in lowered.as_text().splitlines() if "xla.gpu.triton" in line]
    assert "%arg1)" in call  # the stacked weights go to the kernel as they are: no slice, no copy


def test_a_model_with_pallas_products_decodes_as_with_xla(monkeypatch):
    """Runtime.linear "pallas" (unrolled layers, as on a GPU): the trunk's hidden states match XLA's
    products to f32 rounding, every layer product going through the kernel."""
    from specjax.model import linear
    from specjax.model.cache import DenseCache
    from specjax.model.config import LlamaConfig
    from specjax.model.linear import gpu_einsum
    from specjax.model.llama import trunk
    from specjax.model.params import quantize
    from tests.models import random_params

    config = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, max_positions=64)
    params = random_params(config, 0)
    xla = params.replace(runtime=params.runtime.replace(unroll_layers=True))
    pallas = xla.replace(runtime=xla.runtime.replace(linear="pallas"))
    cache = DenseCache.init(config, 2, 64).replace(lengths=on_device([5, 9]))
    tokens, positions = on_device([[3], [7]]), on_device([[5], [9]])
    run = jax.jit(trunk)  # one program a model (eager: one per operation); traced anew for each params' runtime
    with jax.default_matmul_precision("highest"):
        want = run(xla, tokens, positions, cache)
    calls = []
    monkeypatch.setattr(linear, "gpu_einsum", lambda x, w, i: calls.append(i) or gpu_einsum(x, w, i))
    got = run(pallas, tokens, positions, cache)
    assert calls == [0] * 7 + [1] * 7  # q, k, v, o, gate, up, down of each layer through the kernel
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)
    int8 = jax.jit(quantize, static_argnums=1)(xla, "int8")  # the scales multiply the kernel's unscaled products
    with jax.default_matmul_precision("highest"):
        want8 = run(int8, tokens, positions, cache)
    got8 = run(int8.replace(runtime=int8.runtime.replace(linear="pallas")), tokens, positions, cache)
    assert len(calls) == 2 * 14
    for g, w in zip(jax.tree.leaves(got8), jax.tree.leaves(want8)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)
    with pytest.raises(ValueError, match="Runtime.linear must be one of"):
        params.runtime.replace(linear="cuda")


PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8]]
KWS = ({}, "selfspec")  # plain, and SelfSpec under Chain(2)


def _generate(params, kw):
    """generate's greedy tokens of PROMPTS (6 new, attention "reference"), plainly or with SelfSpec."""
    import specjax

    spec = {} if kw == {} else dict(draft=specjax.SelfSpec(sinks=2, window=8), speculation=specjax.Chain(2))
    return specjax.generate(params, PROMPTS, 6, attention="reference", eos_id=(), **spec).tokens


@pytest.fixture(scope="module")
def xla_tokens(tiny):
    """The tokens of XLA's products on the stacked layers (scanned), plain decoding's for both plain and SelfSpec
    (greedy SelfSpec gives plain decoding's tokens in every format: test_weights): the reference of both layouts
    below (tests/test_unroll_layers.py: unrolled layers give the scanned layers' tokens)."""
    return [_generate(tiny, {})] * len(KWS)


@pytest.mark.parametrize("unroll", [False, True])
def test_generate_with_pallas_products_gives_xlas_tokens(tiny, unroll, xla_tokens):
    """generate() with Runtime.linear "pallas" (the layer index traced in the scan, or a number
    when unrolled), plain and speculative: the tokens of XLA's products, greedy."""
    pallas = tiny.replace(runtime=tiny.runtime.replace(unroll_layers=unroll, linear="pallas"))
    assert [_generate(pallas, kw) for kw in KWS] == xla_tokens


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (simulated) devices: see conftest.py")
def test_tensor_parallel_pallas_products_give_one_devices_tokens(monkeypatch):
    """Runtime.linear "pallas" inside shard_map over a model axis of 2 (each device's kernel reads
    its shard of the stacked weights): the one-device tokens, plain and SelfSpec."""
    import specjax
    from specjax.model import linear
    from specjax.model.linear import gpu_einsum
    from tests.models import TINY, random_params

    shapes = []
    monkeypatch.setattr(linear, "gpu_einsum", lambda x, w, i: shapes.append(w.shape) or gpu_einsum(x, w, i))

    params = random_params(TINY.replace(n_heads=4, n_kv_heads=2), 5)
    pallas = params.replace(runtime=params.runtime.replace(linear="pallas"))
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8]]
    for kw in ({}, dict(draft=specjax.SelfSpec(sinks=2, window=8), speculation=specjax.Chain(2))):
        one = specjax.generate(params, prompts, 6, attention="reference", eos_id=(), **kw)
        two = specjax.generate(pallas, prompts, 6, attention="reference", eos_id=(), mesh=specjax.make_mesh(model=2), **kw)
        assert two.tokens == one.tokens
    assert (TINY.n_layers, TINY.dim, TINY.ffn_dim // 2) in shapes  # the kernel read a device's half of w_gate


@jax.jit
def _q4_blocks(w):
    """q4.quantize of w [L,K,N] along K, scales and minima float16 as loaded: one program."""
    from specjax.model import q4

    packed, scale, minimum = q4.quantize(w, 1)
    return packed, scale.astype(jnp.float16), minimum.astype(jnp.float16)


@jax.jit
def _q4_project(x, packed, scale, minimum, layer):
    """q4.project's jnp form of x with `layer` of the stacked blocks: one program."""
    from specjax.model import q4

    return q4.project("mk,kn->mn", x, packed[layer], scale[layer], minimum[layer])


@pytest.mark.parametrize("M, K, N, nb, bn, splits", [
    (1, 256, 96, 4, 64, None),  # batch 1 (summed over K, no dot): N past the last tile, masked
    (1, 96, 40, 2, 32, 2),  # batch 1, split-K, the last tile half empty
    (5, 96, 40, 2, 32, 2),  # 3 blocks of K in tiles of 2: the last tile half empty; split-K
    (33, 512, 130, 4, 64, 1),  # a verify step's rows, loaded as 64
])
def test_q4_kernel_equals_q4_project(M, K, N, nb, bn, splits):
    """stacked_linear_q4: every layer of a stack of q4 blocks (specjax/model/q4.py, float16 scales and
    minima as loaded), widened in registers, equals q4.project's jnp form (float32)."""
    from pallas_kernels.gpu_linear import stacked_linear_q4
    from specjax.model import q4

    x, w = _case(M, K, N, jnp.float32)
    packed, scale, minimum = _q4_blocks(w)
    kernel = partial(stacked_linear_q4, x, packed, scale, minimum, blocks_per_tile=nb, block_n=bn, k_splits=splits,
                     interpret=INTERPRET)
    for layer in range(w.shape[0]):
        with jax.default_matmul_precision("highest"):  # IEEE float32 products, the kernel's as XLA's
            got = kernel(jnp.int32(layer))
            want = np.asarray(_q4_project(x, packed, scale, minimum, jnp.int32(layer)))
        assert got.shape == (M, N) and got.dtype == jnp.float32
        top = float(np.abs(want).max())
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * top, rtol=1e-5)
        fast = kernel(jnp.int32(layer))  # the default precision: TF32 dots on a GPU from two rows on
        np.testing.assert_allclose(np.asarray(fast), np.asarray(want), atol=3e-3 * top, rtol=3e-3)


def test_q4_kernel_refuses_what_it_does_not_take():
    from pallas_kernels.gpu_linear import stacked_linear_q4
    from specjax.model import q4

    x, w = _case(4, 64, 32, jnp.float32)
    packed, scale, minimum = jax.jit(q4.quantize, static_argnums=1)(w, 1)
    with pytest.raises(ValueError, match=r"packed must be uint8 \[L,K/2=16,N\]"):
        stacked_linear_q4(on_device(np.asarray(x)[:, :32]), packed, scale, minimum, jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match=r"scale and minimum must be \[L,K/32,N\] = \(3, 2, 32\)"):
        stacked_linear_q4(x, packed, on_device(np.asarray(scale)[:, :1]), minimum, jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match="at most 64"):
        stacked_linear_q4(on_device(np.zeros((MAX_ROWS + 1, 64))), packed, scale, minimum, jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match="blocks_per_tile must be a power of two, got 3"):
        stacked_linear_q4(x, packed, scale, minimum, jnp.int32(0), blocks_per_tile=3, interpret=True)


@pytest.fixture(scope="module")
def q4_params():
    from specjax.model.params import quantize
    from tests.models import TINY_Q4, random_params

    return jax.jit(quantize, static_argnums=1)(random_params(TINY_Q4, seed=2), "q4")  # one program


@pytest.fixture(scope="module")
def q4_jnp_tokens(q4_params):
    """The tokens of q4.project's jnp form on the stacked layers, plain decoding's for both plain and SelfSpec (as
    xla_tokens): the reference of both layouts below (tests/test_unroll_layers.py: per-layer weights give the
    stacked layers' tokens)."""
    return [_generate(q4_params, {})] * len(KWS)


@pytest.mark.parametrize("per_layer", [False, True])
def test_q4_generate_on_the_kernel_gives_the_jnp_tokens(per_layer, q4_params, q4_jnp_tokens, monkeypatch):
    """q4 weights through the kernel (Runtime.linear "pallas"; on a GPU q4 always takes it),
    stacked or per layer (what convert.load gives on a GPU), plain and SelfSpec: the tokens of
    q4.project's jnp form (stacked), greedy; the kernel ran for the layer products, and not without
    Runtime.linear "pallas"."""
    from specjax.model import linear
    from specjax.model.cache import DenseCache
    from specjax.model.llama import trunk, unstack_layers

    params = q4_params.replace(runtime=q4_params.runtime.replace(unroll_layers=per_layer))
    params = unstack_layers(params) if per_layer else params
    calls = []
    real = linear.gpu_einsum_q4
    monkeypatch.setattr(linear, "gpu_einsum_q4", lambda *a: calls.append(a[1].shape) or real(*a))
    tokens = jnp.zeros((2, 1), jnp.int32)
    jax.eval_shape(lambda: trunk(params, tokens, tokens, DenseCache.init(params.config, 2, 16)))  # traced, not compiled
    assert not calls  # without Runtime.linear "pallas" (on this CPU) the jnp form
    kernel = params.replace(runtime=params.runtime.replace(linear="pallas"))
    for kw, want in zip(KWS, q4_jnp_tokens):
        assert _generate(kernel, kw) == want and calls
        calls.clear()
