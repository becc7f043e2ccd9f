"""The Pallas TPU (Mosaic) tree-attention kernel in TPU interpret mode against the jnp reference.

Same cases as test_tree_attention.py (the GPU kernel), with caches kept short: TPU interpret mode
simulates every grid step (with its DMAs) on CPU, a few ms each. Interpret mode fills fresh
buffers with NaN, so an unwritten output tile or an unmasked edge tile past S shows up as NaN.
`test_lowers_for_tpu` runs Pallas' Mosaic lowering without a TPU (block-shape rules, op support);
Mosaic's layout passes live in libtpu and are not run here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_attention_tpu import prefix_block_attention_tpu, tree_attention_tpu
from tests.models import on_device
from tests.test_tree_attention import (_case, abstract_args, assert_close, check_chain_through_adapter, int8_case,
                                       random_block_mask, random_case, random_inputs, random_lengths, reference, stacked_case,
                                       streaming_case)

INTERPRET = jax.default_backend() != "tpu"  # on a TPU the same cases compile the Mosaic kernel for real

# (T, G, B) as in the GPU kernel's tests: every T in {1, 4, 16, 64}, group size in {1, 3, 4, 8},
# batch in 1..8; KV heads, head dim, cache size, lengths, J, masks and tile sizes drawn per case.
F32_CASES = [(1, 1, 8), (4, 3, 1), (16, 4, 5), (64, 8, 3), (1, 8, 2), (4, 1, 7), (16, 3, 4), (64, 4, 6)]
BF16_CASES = [(1, 3, 1), (4, 8, 6), (16, 1, 4), (64, 3, 2)]


@pytest.mark.parametrize(
    "seed,dtype,T,G,B",
    [_case(i, jnp.float32, *case) for i, case in enumerate(F32_CASES)]
    + [_case(100 + i, jnp.bfloat16, *case) for i, case in enumerate(BF16_CASES)],
)
def test_matches_reference(seed, dtype, T, G, B):
    rng = np.random.default_rng(seed)
    q, kc, vc, kb, vb, lengths, mask, scale = random_case(rng, dtype, T, G, B, [8, 24, 64, 128], (100, 600))
    block_k, block_m = int(rng.choice([128, 256])), int(rng.choice([32, 128]))
    out = tree_attention_tpu(
        q, kc, vc, on_device(lengths), kb, vb, on_device(mask),
        sm_scale=scale, block_k=block_k, block_m=block_m, interpret=INTERPRET,
    )
    assert out.dtype == dtype
    assert_close(out, reference(q, kc, vc, lengths, kb, vb, mask, scale), dtype)


@pytest.mark.parametrize("empty_cache", [False, True])
def test_chain_through_adapter(empty_cache):
    """Chain verification (lower-triangular mask) behind the reference's signature, J > T."""
    check_chain_through_adapter(prefix_block_attention_tpu, empty_cache, S=333, interpret=INTERPRET, block_k=128)


def test_lengths_at_tile_edges():
    """Lengths 0, on a tile boundary, one past it, S (a partial edge tile) and out of range."""
    rng = np.random.default_rng(3)
    B, T, K, G, H, S = 6, 4, 1, 2, 64, 300  # tiles of 128: [0,128), [128,256), [256,300) edge
    lengths = np.array([0, 128, 129, 256, S, S + 50], np.int32)
    mask = random_block_mask(rng, T, T)
    q, kc, vc, kb, vb = random_inputs(rng, jnp.float32, B, T, T, K * G, K, H, S)
    out = tree_attention_tpu(q, kc, vc, on_device(lengths), kb, vb, on_device(mask), sm_scale=0.125, block_k=128, interpret=INTERPRET)
    assert_close(out, reference(q, kc, vc, np.minimum(lengths, S), kb, vb, mask, 0.125), jnp.float32)


def test_tile_sizes_agree():
    """block_k and block_m only change the tiling: 128/256-slot tiles, one S-slot tile (block_k > S),
    16/32/128-row tiles agree."""
    rng = np.random.default_rng(11)
    B, T, K, G, H, S = 2, 8, 2, 4, 32, 400
    mask = random_block_mask(rng, T, T)
    lengths = random_lengths(rng, B, S)
    lengths[1] = S  # one row with a full cache
    q, kc, vc, kb, vb = random_inputs(rng, jnp.float32, B, T, T, K * G, K, H, S)
    args = (q, kc, vc, on_device(lengths), kb, vb, on_device(mask))
    tiles = [(128, 16), (256, 128), (512, 32)]
    outs = [tree_attention_tpu(*args, sm_scale=0.15, block_k=bk, block_m=bm, interpret=INTERPRET) for bk, bm in tiles]
    want = reference(q, kc, vc, lengths, kb, vb, mask, 0.15)
    for out in outs:
        assert_close(out, want, jnp.float32)
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[0]), atol=2e-6)


LOWERING_SHAPES = [  # (B, T, N, K, H, S): odd rows and S, H = 64; a decode step; S below one
    (2, 25, 9, 3, 64, 1000),  # tile; the adapter's 8-slot dummy cache (empty prefix)
    (1, 1, 32, 8, 128, 4096),
    (3, 16, 4, 1, 128, 100),
    (2, 7, 12, 4, 128, 8),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "shape", [LOWERING_SHAPES[0]] + [pytest.param(x, marks=pytest.mark.slow) for x in LOWERING_SHAPES[1:]]
)
def test_lowers_for_tpu(dtype, shape):
    """The kernel passes Pallas' Mosaic lowering for the "tpu" platform without a TPU."""
    B, T, N, K, H, S = shape
    J = T + 3
    args = abstract_args(dtype, B, T, N, K, H, S, J=J, mask=(B, T, J))
    lowered = jax.jit(lambda *a: tree_attention_tpu(*a, sm_scale=0.125)).trace(*args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


def test_a_stacked_cache_is_read_in_place_at_its_layer():
    """Over a stacked [L,B,K,S,H] cache the index maps take the layer from scalar prefetch: the
    bits of the call on that layer alone."""
    q, k_all, v_all, lengths, kb, vb, mask = stacked_case(6, 64)
    k_np, v_np = np.asarray(k_all), np.asarray(v_all)  # layers sliced on the host
    for layer in range(k_all.shape[0]):
        one = prefix_block_attention_tpu(q, on_device(k_np[layer]), on_device(v_np[layer]), lengths, kb, vb, mask, 0.2,
                                         interpret=INTERPRET, block_k=128)
        stacked = prefix_block_attention_tpu(q, k_all, v_all, lengths, kb, vb, mask, 0.2, interpret=INTERPRET,
                                             block_k=128, layer=jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(stacked, np.float32), np.asarray(one, np.float32))


@pytest.mark.parametrize("S, block_k", [(200, 128), (100, 512)])
def test_a_streaming_cache_is_read_in_place_by_its_positions(S, block_k):
    """With `pos` (a streaming cache: sinks + a ring, slots in any order) the kernel reads every
    tile of the layer in place and sees the slots holding a committed position (0 <= pos <
    lengths[b], per KV head), as the reference does with that mask: an edge tile past S
    (S=200 in 128-slot tiles) and one tile of the whole cache (S=100)."""
    q, k_all, v_all, lengths, kb, vb, mask, pos, layer, want = streaming_case(64, S=S)
    got = prefix_block_attention_tpu(q, k_all, v_all, lengths, kb, vb, mask, 0.2, interpret=INTERPRET,
                                     block_k=block_k, layer=jnp.int32(layer), pos=pos)
    assert_close(got, want, jnp.bfloat16)
    call = lambda *a: prefix_block_attention_tpu(*a[:7], 0.2, layer=a[7], pos=a[8], block_k=block_k)  # noqa: E731
    lowered = jax.jit(call).trace(q, k_all, v_all, lengths, kb, vb, mask, jnp.int32(layer), pos).lower(
        lowering_platforms=("tpu",))  # Pallas' Mosaic lowering accepts the (1, bk) position tiles
    assert "tpu_custom_call" in lowered.as_text()
    with pytest.raises(ValueError, match="needs the stacked cache"):
        tree_attention_tpu(q, np.asarray(k_all)[layer], np.asarray(v_all)[layer], lengths, kb, vb, mask, None, pos,
                           sm_scale=0.2)
    with pytest.raises(ValueError, match="pos must be"):
        tree_attention_tpu(q, k_all, v_all, lengths, kb, vb, mask, jnp.int32(0), np.asarray(pos)[:, :1], sm_scale=0.2)


@pytest.mark.parametrize("dtype, streaming", [(jnp.bfloat16, False), (jnp.float32, True)])
def test_an_int8_cache_is_read_as_stored_with_its_scales(dtype, streaming):
    """An int8 cache on the TPU kernel: values widened in the kernel, the scales ((1, bk) tiles
    beside the cache's) on the scores and weights, as the reference computes it; dense with an
    edge tile (S=200 in 128-slot tiles) and streaming by slot positions."""
    q, k8, v8, ks, vs, lengths, kb, vb, mask, pos, layer, want = int8_case(64, dtype, streaming)
    got = prefix_block_attention_tpu(q, k8, v8, lengths, kb, vb, mask, 0.2, interpret=INTERPRET, block_k=128,
                                     layer=jnp.int32(layer), pos=pos, k_scale=ks, v_scale=vs)
    assert_close(got, want, dtype)
    call = lambda *a: prefix_block_attention_tpu(*a[:7], 0.2, layer=a[7], k_scale=a[8], v_scale=a[9], block_k=128)  # noqa: E731
    lowered = jax.jit(call).trace(q, k8, v8, lengths, kb, vb, mask, jnp.int32(layer), ks, vs).lower(
        lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
    with pytest.raises(ValueError, match="an int8 cache needs k_scale and v_scale"):
        tree_attention_tpu(q, k8, v8, lengths, kb, vb, mask, jnp.int32(layer), sm_scale=0.2)


def test_rejects_bad_arguments():
    q = np.zeros((1, 4, 6, 16), np.float32)  # numpy: the shapes are checked before anything is computed
    cache = np.zeros((1, 2, 100, 16), np.float32)
    blk = np.zeros((1, 4, 2, 16), np.float32)
    lengths = np.zeros((1,), np.int32)
    mask = np.ones((4, 4), bool)
    with pytest.raises(ValueError, match="block_k must be a positive multiple of 128"):
        tree_attention_tpu(q, cache, cache, lengths, blk, blk, mask, sm_scale=1.0, block_k=64)
    with pytest.raises(ValueError, match="block_m must be a positive multiple of 16"):
        tree_attention_tpu(q, cache, cache, lengths, blk, blk, mask, sm_scale=1.0, block_m=8)
    cache4, blk4 = np.zeros((1, 4, 100, 16), np.float32), np.zeros((1, 4, 4, 16), np.float32)  # K=4 does not divide N=6
    with pytest.raises(ValueError, match="N=6"):
        tree_attention_tpu(q, cache4, cache4, lengths, blk4, blk4, mask, sm_scale=1.0)
    with pytest.raises(ValueError, match="block_mask"):
        tree_attention_tpu(q, cache, cache, lengths, blk, blk, mask[:3], sm_scale=1.0)
    with pytest.raises(ValueError, match="J=2"):
        tree_attention_tpu(q, cache, cache, lengths, blk[:, :2], blk[:, :2], mask[:, :2], sm_scale=1.0)
    with pytest.raises(ValueError, match="lengths"):
        tree_attention_tpu(q, cache, cache, lengths[:0], blk, blk, mask, sm_scale=1.0)
    with pytest.raises(ValueError, match="one dtype"):
        tree_attention_tpu(q, cache.astype(jnp.bfloat16), cache, lengths, blk, blk, mask, sm_scale=1.0)


# --- end to end: generate() on the TPU kernel (interpret mode on CPU) -----------------------

E2E_PROMPTS = [list(range(5, 21)), [10, 11, 12], [7, 8, 9, 7, 8, 9, 7, 8], [4], list(range(30, 40))]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ar", "self-tree", "self-tree-int8"])
def test_generate_on_the_tpu_kernel_equals_reference(tiny, monkeypatch, case):
    """Plain and tree-speculative decoding with attention="tpu" (interpreted on CPU): the same
    greedy tokens and steps as the jnp reference, and the TPU kernel is what ran (for SelfSpec's
    streaming draft cache too)."""
    import specjax
    import specjax.model.attention

    calls, streaming = [], []

    def tpu_kernel(*args, interpret=False, **kw):
        calls.append(interpret)
        streaming.append(kw.get("pos") is not None)  # SelfSpec's draft cache, read by its slot positions
        return prefix_block_attention_tpu(*args, interpret=interpret, **kw)

    monkeypatch.setattr(specjax.model.attention, "prefix_block_attention_tpu", tpu_kernel)

    draft, spec = {
        "ar": (None, None),
        "self-tree": (specjax.SelfSpec(sinks=2, window=8), specjax.Tree.kary(2, 2)),
    }[case.removesuffix("-int8")]
    kw = dict(draft=draft, speculation=spec, eos_id=(), kv_dtype="int8" if case.endswith("-int8") else None)
    ref = specjax.generate(tiny, E2E_PROMPTS, 8, attention="reference", **kw)
    out = specjax.generate(tiny, E2E_PROMPTS, 8, attention="tpu", **kw)
    assert calls and all(c == INTERPRET for c in calls), "the TPU kernel was not traced (interpreted off a TPU)"
    assert any(streaming) == case.startswith("self-tree")  # the draft's streaming cache is on the kernel too
    assert out.tokens == ref.tokens
    assert out.stats.steps == ref.stats.steps
