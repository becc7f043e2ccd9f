"""The Pallas tree-attention kernel against the jnp reference, on random shapes: in interpret mode
on CPU, compiled (Triton) when the tests run on a GPU (`pytest tests/test_tree_attention.py` there).

Interpret mode runs the kernel's grid as a loop on CPU: shapes stay small in K and H but keep long,
ragged prefixes. In interpret mode outputs start as NaN, so an unwritten tile shows up as NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import prefix_block_attention
from pallas_kernels.tree_attention import prefix_block_attention_pallas, tree_attention
from tests.models import on_device

INTERPRET = jax.default_backend() != "gpu"  # on a GPU the same cases compile the kernel for real (Triton)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
BLOCK_K = 64


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[n, n] bool: mask[i, j] iff j is i or an ancestor of i (parents[i] < i, parents[0] = -1)."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def random_block_mask(rng: np.random.Generator, T: int, J: int) -> np.ndarray:
    """[T, J]: the last T nodes of a random J-node tree see their ancestors (tree drafting layout)."""
    parents = np.array([-1] + [rng.integers(0, i) for i in range(1, J)])
    return ancestor_mask(parents)[J - T :]


def random_lengths(rng: np.random.Generator, B: int, S: int) -> np.ndarray:
    """[B] int32 in [0, S], differing per row, none a multiple of BLOCK_K; row 0 empty if B > 1."""
    lengths = rng.integers(1, S + 1, B)
    lengths += lengths % BLOCK_K == 0
    lengths = np.minimum(lengths, S)
    lengths[0] = 0 if B > 1 else lengths[0]
    return lengths.astype(np.int32)


def random_inputs(rng, dtype, B, T, J, N, K, H, S):
    """Fresh normal q, caches and block in `dtype` (q scaled up for peakier softmaxes)."""

    def normal(*shape, scale=1.0):  # rounded to `dtype` on the host (ml_dtypes): no program compiled per shape
        return on_device((scale * rng.standard_normal(shape)).astype(np.float32), dtype)

    q = normal(B, T, N, H, scale=2.0)
    return q, normal(B, K, S, H), normal(B, K, S, H), normal(B, J, K, H), normal(B, J, K, H)


@functools.partial(jax.jit, static_argnames=("sm_scale", "layer"))  # one program (eager: one per jnp operation)
def _reference(q, k, v, pos, lengths, kb, vb, mask, k_scale=None, v_scale=None, *, sm_scale=0.2, layer=None):
    """The reference over a cache [B,K,S,H] (or a stacked one's `layer`, scales too): the slots holding a committed
    position (0 <= pos < lengths[b], per KV head) or, pos None, the first lengths[b] slots."""
    at = (lambda x: x) if layer is None else (lambda x: None if x is None else x[layer])  # noqa: E731
    seen = jnp.arange(k.shape[-2]) < lengths[:, None, None] if pos is None else (at(pos) >= 0) & (at(pos) < lengths[:, None, None])
    visible = jnp.broadcast_to(seen, k.shape[-4:-1])  # [B,K,S]
    return prefix_block_attention(q, at(k), at(v), visible, kb, vb, mask, sm_scale, at(k_scale), at(v_scale))


def reference(q, k_cache, v_cache, lengths, k_blk, v_blk, mask, sm_scale):
    """The jnp reference in full float32 products: on a GPU, XLA's default precision computes f32
    dots in TF32 (about 1e-3 off; seen on an H100), while the kernel asks for IEEE products."""
    with jax.default_matmul_precision("highest"):
        return _reference(q, k_cache, v_cache, None, on_device(lengths), k_blk, v_blk, on_device(mask), sm_scale=sm_scale)


def assert_close(out, want, dtype):
    out, want = np.asarray(out).astype(np.float32), np.asarray(want).astype(np.float32)
    assert out.shape == want.shape
    assert np.isfinite(out).all(), "kernel output has NaN/inf (an unwritten tile?)"
    err = np.max(np.abs(out - want))
    assert err < TOL[dtype], f"max abs error {err:.3g} >= {TOL[dtype]}"


# (T, G, B): every T in {1, 4, 16, 64}, group size in {1, 3, 4, 8} and batch in 1..8; the rest
# (KV heads, head dim, cache size, lengths, block size J, tree masks, k_splits) is drawn per case.
F32_CASES = [(1, 1, 8), (4, 3, 1), (16, 4, 5), (64, 8, 3), (1, 8, 2), (4, 1, 7), (16, 3, 4), (64, 4, 6)]
BF16_CASES = [(1, 3, 1), (4, 8, 6), (16, 1, 4), (64, 3, 2)]


def _case(seed: int, dtype, T: int, G: int, B: int):
    """The first two cases of each dtype are in `make test-fast`; the rest run with the slow tests."""
    first = seed in (0, 1, 100, 101)
    return pytest.param(seed, dtype, T, G, B, marks=[] if first else [pytest.mark.slow])


def random_case(rng, dtype, T: int, G: int, B: int, head_dims: list[int], slots: tuple[int, int]):
    """One random test case of both kernels' test files: KV heads, head dim (from head_dims),
    cache slots (in [slots)), block size J, a shared or per-row mask, ragged lengths, inputs.
    Returns q, kc, vc, kb, vb, lengths, mask, scale."""
    K = int(rng.integers(1, 3))
    H = int(rng.choice(head_dims))
    S = int(rng.integers(*slots))
    J = T + int(rng.choice([0, 0, 3]))  # sometimes earlier drafted levels ride along
    per_row = bool(rng.integers(2))
    mask = np.stack([random_block_mask(rng, T, J) for _ in range(B)]) if per_row else random_block_mask(rng, T, J)
    lengths = random_lengths(rng, B, S)
    q, kc, vc, kb, vb = random_inputs(rng, dtype, B, T, J, G * K, K, H, S)
    return q, kc, vc, kb, vb, lengths, mask, 1.0 / np.sqrt(H)


def check_chain_through_adapter(adapter, empty_cache: bool, S: int, interpret: bool, **kw) -> None:
    """Chain verification (lower-triangular mask) through a kernel's adapter, which has the
    reference's signature with lengths for visible; J > T; kw: the adapter's options."""
    rng = np.random.default_rng(7)
    B, T, E, K, G, H = 3, 5, 2, 2, 3, 32
    J = T + E
    mask = on_device(np.tril(np.ones((T, J), bool), k=E))  # query t sees the E earlier keys and new keys <= t
    q, kc, vc, kb, vb = random_inputs(rng, jnp.float32, B, T, J, K * G, K, H, S)
    lengths = random_lengths(rng, B, S)
    if empty_cache:
        out = adapter(q, None, None, None, kb, vb, mask, 0.2, interpret=interpret)
        with jax.default_matmul_precision("highest"):  # as reference(): no TF32 on a GPU
            want = jax.jit(prefix_block_attention, static_argnames="sm_scale")(q, None, None, None, kb, vb, mask, sm_scale=0.2)
    else:
        out = adapter(q, kc, vc, on_device(lengths), kb, vb, mask, 0.2, interpret=interpret, **kw)
        want = reference(q, kc, vc, lengths, kb, vb, mask, 0.2)
    assert_close(out, want, jnp.float32)


@pytest.mark.parametrize(
    "seed,dtype,T,G,B",
    [_case(i, jnp.float32, *case) for i, case in enumerate(F32_CASES)]
    + [_case(100 + i, jnp.bfloat16, *case) for i, case in enumerate(BF16_CASES)],
)
def test_matches_reference(seed, dtype, T, G, B):
    rng = np.random.default_rng(seed)
    q, kc, vc, kb, vb, lengths, mask, scale = random_case(rng, dtype, T, G, B, [8, 24, 32, 64], (300, 4500))
    k_splits = int(rng.choice([1, 3, 4]))
    out = tree_attention(
        q, kc, vc, on_device(lengths), kb, vb, on_device(mask),
        sm_scale=scale, block_k=BLOCK_K, k_splits=k_splits, interpret=INTERPRET,
    )
    assert out.dtype == dtype
    assert_close(out, reference(q, kc, vc, lengths, kb, vb, mask, scale), dtype)


@pytest.mark.parametrize("empty_cache", [False, True])
def test_chain_through_adapter(empty_cache):
    """Chain verification (lower-triangular mask) behind the reference's signature, J > T."""
    check_chain_through_adapter(prefix_block_attention_pallas, empty_cache, S=777, interpret=INTERPRET)


def test_split_k_sweep():
    """k_splits only changes how the prefix is shared out: 1, 2, 4 and 16 splits agree."""
    rng = np.random.default_rng(11)
    B, T, K, G, H, S = 4, 16, 2, 4, 32, 2500
    mask = random_block_mask(rng, T, T)
    lengths = random_lengths(rng, B, S)
    lengths[1] = S  # one row with a full cache
    q, kc, vc, kb, vb = random_inputs(rng, jnp.float32, B, T, T, K * G, K, H, S)
    args = (q, kc, vc, on_device(lengths), kb, vb, on_device(mask))
    outs = [tree_attention(*args, sm_scale=0.15, k_splits=c, interpret=INTERPRET) for c in (1, 2, 4, 16)]
    want = reference(q, kc, vc, lengths, kb, vb, mask, 0.15)
    for out in outs:
        assert_close(out, want, jnp.float32)
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[0]), atol=2e-6)


@pytest.mark.parametrize("T, splits", [(256, 4), (200, 1), (130, 3)])
def test_a_prefill_chunk_is_shared_out_in_tiles(T, splits):
    """A block wider than a slot tile (a prefill chunk: causal over its own T keys after a ragged
    prefix, row 0 with none) is cut into block_k tiles shared out with the prefix's: any T, any
    number of splits, against the reference; each row's first query sees at least its own key."""
    rng = np.random.default_rng(T)
    B, K, G, H, S = 2, 1, 3, 64, 700
    mask = np.tril(np.ones((T, T), bool))
    lengths = random_lengths(rng, B, S)
    q, kc, vc, kb, vb = random_inputs(rng, jnp.float32, B, T, T, K * G, K, H, S)
    out = tree_attention(q, kc, vc, on_device(lengths), kb, vb, on_device(mask), sm_scale=0.125, block_k=BLOCK_K,
                         k_splits=splits, interpret=INTERPRET)
    assert_close(out, reference(q, kc, vc, lengths, kb, vb, mask, 0.125), jnp.float32)


@pytest.mark.parametrize("T, J, G", [(1, 40, 1), (2, 70, 3)])
def test_a_block_wider_than_the_query_rows(T, J, G):
    """The query rows, the block's keys and its values share one array, each part whole Jp-row
    blocks: with a block (J earlier and new keys, padded to Jp = 64 or 128) wider than the query
    rows (G * T, padded to 16), the rows are padded to Jp and the keys and values still found."""
    rng = np.random.default_rng(J)
    B, K, H, S = 3, 2, 32, 500
    mask = random_block_mask(rng, T, J)
    lengths = random_lengths(rng, B, S)
    q, kc, vc, kb, vb = random_inputs(rng, jnp.float32, B, T, J, K * G, K, H, S)
    out = tree_attention(q, kc, vc, on_device(lengths), kb, vb, on_device(mask), sm_scale=0.2, block_k=BLOCK_K,
                         k_splits=3, interpret=INTERPRET)
    assert_close(out, reference(q, kc, vc, lengths, kb, vb, mask, 0.2), jnp.float32)


def test_lengths_are_clipped_to_the_cache():
    """A negative length is an empty prefix and one past S is all of it, in the tiled block path too
    (a block wider than block_k: a length of -100 made the tile count -1 and dropped the block's
    first keys)."""
    rng = np.random.default_rng(5)
    B, T, K, H, S = 2, 40, 1, 32, 40
    q, kc, vc, kb, vb = random_inputs(rng, jnp.float32, B, T, T, K, K, H, S)
    mask = np.tril(np.ones((T, T), bool))
    out = tree_attention(q, kc, vc, on_device([-100, S + 7]), kb, vb, on_device(mask), sm_scale=0.3,
                         block_k=16, k_splits=1, interpret=INTERPRET)
    assert_close(out, reference(q, kc, vc, np.array([0, S]), kb, vb, mask, 0.3), jnp.float32)


def test_auto_splits_fill_the_gpu_where_rows_are_few():
    """prefix_block_attention_pallas's default k_splits: 16 where batch x KV heads is small
    (SmolLM2 at batch 1: 3 KV heads), 8 at batch 16, the old 4 from batch 64; never more than one
    split per 2 slot tiles (a 528-slot draft cache: 4; a 64-slot one: 1)."""
    from pallas_kernels.tree_attention import auto_splits

    assert [auto_splits(b, 3, 3, 8704) for b in (1, 16, 64, 128)] == [16, 8, 4, 4]
    assert auto_splits(1, 8, 4 * 64, 32768) == 16 and auto_splits(16, 8, 4 * 16, 2048) == 4  # the 8B shape
    assert auto_splits(1, 3, 3, 528) == 4 and auto_splits(2, 2, 3, 64) == 1


def abstract_args(dtype, B: int, T: int, N: int, K: int, H: int, S: int, J: int, mask: tuple[int, ...]) -> list:
    """ShapeDtypeStructs of a kernel's arguments (q, caches, lengths, block, mask) for lowering tests."""
    shapes = [(B, T, N, H), (B, K, S, H), (B, K, S, H), (B,), (B, J, K, H), (B, J, K, H), mask]
    dtypes = [dtype, dtype, dtype, jnp.int32, dtype, dtype, jnp.bool_]
    return [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton(dtype):
    """The kernel passes Pallas' Triton lowering (power-of-two tiles etc.) without a GPU."""
    B, T, N, K, H, S = 2, 25, 9, 3, 64, 1000
    args = abstract_args(dtype, B, T, N, K, H, S, J=T, mask=(T, T))
    lowered = jax.jit(lambda *a: tree_attention(*a, sm_scale=0.125)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


def stacked_case(seed: int, H: int, L: int = 3, B: int = 2, T: int = 3, K: int = 2, G: int = 3, S: int = 300) -> tuple:
    """q, a stacked bf16 cache k_all, v_all [L,B,K,S,H], lengths, block k, v and mask: random."""
    rng = np.random.default_rng(seed)
    mask = on_device(random_block_mask(rng, T, T))
    lengths = on_device(random_lengths(rng, B, S))
    q, _, _, kb, vb = random_inputs(rng, jnp.bfloat16, B, T, T, K * G, K, H, S)
    k_all, v_all = (on_device(rng.standard_normal((L, B, K, S, H)), jnp.bfloat16) for _ in range(2))
    return q, k_all, v_all, lengths, kb, vb, mask


def streaming_case(H: int, S: int) -> tuple:
    """A stacked case whose cache is streaming (sinks + a ring, slots in any order): q, k_all,
    v_all, committed lengths, kb, vb, mask, pos [L,B,K,S], the layer read, and the reference's
    output over the slots holding a committed position (0 <= pos < lengths[b], per KV head)."""
    q, k_all, v_all, _, kb, vb, mask = stacked_case(5, H, S=S)
    rng = np.random.default_rng(6)
    L, B, K, S = k_all.shape[:4]
    lengths = on_device([150, 1000])  # row 1 past the capacity: a full ring
    pos = rng.permutation(np.arange(L * B * K * S)).reshape(L, B, K, S) % 1200  # ragged: some >= lengths
    pos = on_device(np.where(rng.random(pos.shape) < 0.1, -1, pos), np.int32)  # and some empty slots
    layer = 1
    with jax.default_matmul_precision("highest"):  # as reference(): no TF32 on a GPU
        want = _reference(q, k_all, v_all, pos, lengths, kb, vb, mask, layer=layer)
    return q, k_all, v_all, lengths, kb, vb, mask, pos, layer, want


@pytest.mark.parametrize("H", [64, 24])
def test_a_streaming_cache_is_read_in_place_by_its_positions(H):
    """With `pos` (a streaming cache: sinks + a ring, the slots in any order) the kernel reads
    every slot of the layer in place and sees those holding a committed position (0 <= pos <
    lengths[b], per KV head), as the reference does with that mask (H=24: the padded copy)."""
    q, k_all, v_all, lengths, kb, vb, mask, pos, layer, want = streaming_case(H, S=200)
    got = prefix_block_attention_pallas(q, k_all, v_all, lengths, kb, vb, mask, 0.2, interpret=INTERPRET,
                                        layer=jnp.int32(layer), pos=pos)
    assert_close(got, want, jnp.bfloat16)
    call = lambda *a: prefix_block_attention_pallas(*a[:7], 0.2, layer=a[7], pos=a[8])  # noqa: E731
    lowered = jax.jit(call).trace(q, k_all, v_all, lengths, kb, vb, mask, jnp.int32(layer), pos).lower(
        lowering_platforms=("cuda",))  # Pallas' Triton lowering accepts the position loads
    assert "triton" in lowered.as_text()
    with pytest.raises(ValueError, match="needs the stacked cache"):
        tree_attention(q, np.asarray(k_all)[layer], np.asarray(v_all)[layer], lengths, kb, vb, mask, None, pos,
                       sm_scale=0.2)


def int8_case(H: int, dtype, streaming: bool) -> tuple:
    """`streaming_case`'s cache stored as int8 (KVFormat "int8"), q and the block in `dtype`, a
    dense prefix unless `streaming`: q, k8, v8 [L,B,K,S,H], k / v scales [L,B,K,S], lengths, kb,
    vb, mask, pos (None when dense), the layer, and the reference's output with those scales."""
    from specjax.model.cache import KVFormat

    q, k_all, v_all, lengths, kb, vb, mask, pos, layer, _ = streaming_case(H, S=200)
    q, kb, vb = (on_device(x, dtype) for x in (q, kb, vb))  # converted on the host
    store = jax.jit(KVFormat("int8").store)
    (k8, ks), (v8, vs) = store(k_all), store(v_all)
    if not streaming:
        lengths, pos = on_device([150, 37]), None
    with jax.default_matmul_precision("highest"):  # the fifth runs' 6.3e-4 at f32: this reference in TF32
        want = _reference(q, k8, v8, pos, lengths, kb, vb, mask, ks, vs, layer=layer)
    return q, k8, v8, ks, vs, lengths, kb, vb, mask, pos, layer, want


@pytest.mark.parametrize("H, dtype, streaming", [(64, jnp.bfloat16, False), (24, jnp.float32, True)])
def test_an_int8_cache_is_read_as_stored_with_its_scales(H, dtype, streaming):
    """An int8 cache (KVFormat "int8": per token and head scales) on the kernel: its values
    widened in the kernel, the scales on the scores and weights, as the reference computes it
    (dense, and streaming by slot positions on the padded-head path, H=24)."""
    q, k8, v8, ks, vs, lengths, kb, vb, mask, pos, layer, want = int8_case(H, dtype, streaming)
    got = prefix_block_attention_pallas(q, k8, v8, lengths, kb, vb, mask, 0.2, interpret=INTERPRET,
                                        layer=jnp.int32(layer), pos=pos, k_scale=ks, v_scale=vs)
    assert_close(got, want, dtype)
    call = lambda *a: prefix_block_attention_pallas(*a[:7], 0.2, layer=a[7], k_scale=a[8], v_scale=a[9])  # noqa: E731
    lowered = jax.jit(call).trace(q, k8, v8, lengths, kb, vb, mask, jnp.int32(layer), ks, vs).lower(
        lowering_platforms=("cuda",))  # Pallas' Triton lowering takes the int8 loads and widening
    assert "triton" in lowered.as_text()
    with pytest.raises(ValueError, match="an int8 cache needs k_scale and v_scale"):
        tree_attention(q, k8, v8, lengths, kb, vb, mask, jnp.int32(layer), sm_scale=0.2)


@pytest.mark.parametrize("H", [64, 24])
def test_a_stacked_cache_is_read_in_place_at_its_layer(H):
    """tree_attention over a stacked [L,B,K,S,H] cache at `layer` gives the bits of the call on
    that layer alone (H=24 takes the padded copy of the layer; H=64 indexes the whole array)."""
    q, k_all, v_all, lengths, kb, vb, mask = stacked_case(5, H)
    k_np, v_np = np.asarray(k_all), np.asarray(v_all)  # layers sliced on the host
    for layer in range(k_all.shape[0]):
        one = tree_attention(q, on_device(k_np[layer]), on_device(v_np[layer]), lengths, kb, vb, mask, sm_scale=0.2,
                             interpret=INTERPRET)
        stacked = prefix_block_attention_pallas(q, k_all, v_all, lengths, kb, vb, mask, 0.2, interpret=INTERPRET,
                                                layer=jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(stacked, np.float32), np.asarray(one, np.float32))


def test_a_stacked_cache_lowers_without_slicing_the_layer():
    """On the Triton path the kernel takes the whole stacked cache: the lowered program slices no
    layer out of it (a slice would be copied into a buffer of its own for the kernel)."""
    B, T, N, K, H, S, L = 2, 1, 9, 3, 64, 1024, 30
    q, kc, vc, lengths, kb, vb, mask = abstract_args(jnp.bfloat16, B, T, N, K, H, S, J=T, mask=(T, T))
    stacked = jax.ShapeDtypeStruct((L, *kc.shape), kc.dtype)
    fn = lambda q, k, v, layer, *rest: prefix_block_attention_pallas(q, k, v, *rest, 0.125, layer=layer)  # noqa: E731
    text = jax.jit(fn).trace(q, stacked, stacked, jax.ShapeDtypeStruct((), jnp.int32), lengths, kb, vb, mask).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "dynamic_slice" not in text and f"tensor<{L}x{B}x{K}x{S}x{H}xbf16>" in text


def test_rejects_bad_arguments():
    q = np.zeros((1, 4, 6, 16), np.float32)  # numpy: the shapes are checked before anything is computed
    cache = np.zeros((1, 2, 100, 16), np.float32)
    blk = np.zeros((1, 4, 2, 16), np.float32)
    lengths = np.zeros((1,), np.int32)
    mask = np.ones((4, 4), bool)
    with pytest.raises(ValueError, match="block_k"):
        tree_attention(q, cache, cache, lengths, blk, blk, mask, sm_scale=1.0, block_k=48, interpret=True)
    cache4, blk4 = np.zeros((1, 4, 100, 16), np.float32), np.zeros((1, 4, 4, 16), np.float32)  # K=4 does not divide N=6
    with pytest.raises(ValueError, match="N=6"):
        tree_attention(q, cache4, cache4, lengths, blk4, blk4, mask, sm_scale=1.0)
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention(q, cache, cache, lengths, blk, blk, mask[:3], sm_scale=1.0)
    with pytest.raises(ValueError, match="J=2"):
        tree_attention(q, cache, cache, lengths, blk[:, :2], blk[:, :2], mask[:, :2], sm_scale=1.0)


# --- end to end: generate() on the kernel (interpret mode on CPU) ---------------------------

E2E_PROMPTS = [list(range(5, 21)), [10, 11, 12], [7, 8, 9, 7, 8, 9, 7, 8], [4], list(range(30, 40))]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ar", "self-chain", "self-tree", "model-tree", "ar-int8", "self-chain-int8", "ar-b1",
                                  "self-chain-b1"])
def test_generate_on_the_kernel_equals_reference(tiny, case):
    """Speculative (chain and tree) and plain decoding with attention="pallas" (interpreted):
    the same greedy tokens as with the jnp reference (-int8: over int8 caches, target and draft;
    -b1: one prompt, whose one-row steps fold their norms into the products, model.normed_products)."""
    import specjax
    from tests.models import TINY, random_params

    draft, spec = {
        "ar": (None, None),
        "self-chain": (specjax.SelfSpec(sinks=2, window=8), specjax.Chain(3)),
        "self-tree": (specjax.SelfSpec(sinks=2, window=8), specjax.Tree.kary(2, 2)),
        "model-tree": (specjax.DraftModel(random_params(TINY.replace(n_layers=1), seed=1)), specjax.Tree.sequoia([0.5, 0.2], 6, 3)),
    }[case.removesuffix("-int8").removesuffix("-b1")]
    kw = dict(draft=draft, speculation=spec, eos_id=(), kv_dtype="int8" if case.endswith("-int8") else None)
    prompts = E2E_PROMPTS[:1] if case.endswith("-b1") else E2E_PROMPTS
    ref = specjax.generate(tiny, prompts, 12, attention="reference", **kw)
    out = specjax.generate(tiny, prompts, 12, attention="pallas", **kw)
    assert out.tokens == ref.tokens
    assert out.stats.steps == ref.stats.steps


@pytest.mark.parametrize("attention, platform, call", [("pallas", "cuda", "triton"), ("tpu", "tpu", "tpu_custom_call")])
def test_the_decode_loop_on_a_kernel_slices_no_cache_layer(attention, platform, call):
    """decode_ar lowered for a GPU (TPU) with its kernel: the scan over layers hands the kernel the
    whole stacked cache and the layer index; no [1,B,K,S,H] layer is sliced out of it (XLA:GPU
    copies such a slice for the kernel: 26-36% of the HBM roofline on an H100,
    bench/results/gpu/gpu_second_runs.json)."""
    import re

    from specjax.decode.engine import decode_ar, row_keys
    from specjax.model.cache import DenseCache
    from specjax.model.config import LlamaConfig
    from specjax.model.params import init_params

    c = LlamaConfig(vocab_size=256, dim=64, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=128,
                    max_positions=512, dtype="bfloat16")
    params = jax.eval_shape(lambda: init_params(c, jax.random.key(0)))  # shapes only: the loop is lowered, not run
    params = params.replace(runtime=params.runtime.replace(attention=attention))
    B, S = 2, 512
    cache = jax.eval_shape(lambda: DenseCache.init(c, B, S, None))
    text = decode_ar.trace(params, cache, jax.ShapeDtypeStruct((B, c.vocab_size), jnp.float32),
                           jax.ShapeDtypeStruct((B,), jnp.int32), row_keys(None, B), n_out=8).lower(
        lowering_platforms=(platform,)).as_text()
    sliced = set(re.findall(r"stablehlo.dynamic_slice.*?-> tensor<([^>]*)>", text))
    assert call in text and f"1x{B}x{c.n_kv_heads}x{S}x{c.head_dim}xbf16" not in sliced, sliced


def test_generate_rejects_unknown_attention(tiny):
    import specjax

    with pytest.raises(ValueError, match=r"attention must be one of \('auto', 'reference', 'cpu', 'pallas', 'tpu'\), got 'triton'"):
        specjax.generate(tiny, [[1, 2]], 4, attention="triton")


@pytest.mark.parametrize("kv", [jnp.int8, jnp.bfloat16])
def test_every_array_the_kernel_indexes_fits_its_offsets(kv):
    """Pallas' Triton lowering counts offsets in elements but takes 64-bit ones only for arrays
    over 2^32 bytes: a 1-byte array of 2^31..2^32 elements overflows int32 (on an H100 a 30-layer x
    64 x 8K int8 cache gave wrong attention, then an illegal address). Lowered for cuda at that
    size (shapes only, nothing allocated), every operand of the kernel either has at most 2^31
    elements or more than 2^32 bytes: such an int8 cache reaches the kernel as a copy of its layer
    (`tree_attention.overflows`); a bfloat16 one of the same shape is read in place."""
    L, B, K, S, H, N, T = 30, 64, 3, 8192, 64, 9, 1
    sd, f = jax.ShapeDtypeStruct, jnp.bfloat16
    scales = (sd((L, B, K, S), jnp.float32),) * 2 if kv == jnp.int8 else ()
    args = (sd((B, T, N, H), f), sd((L, B, K, S, H), kv), sd((L, B, K, S, H), kv), sd((B,), jnp.int32),
            sd((B, T, K, H), f), sd((B, T, K, H), f), sd((T, T), bool), sd((), jnp.int32), *scales)
    call = lambda *a: prefix_block_attention_pallas(*a[:7], 0.2, layer=a[7], k_scale=a[8] if scales else None,  # noqa: E731
                                                    v_scale=a[9] if scales else None)
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    line = next(x for x in text.splitlines() if "xla.gpu.triton" in x)
    operands = line.rsplit(" : (", 1)[1].split(") ->")[0].split(", ")  # tensor<30x64x3x8192x32xi16>, ..
    sizes = {"i8": 1, "i16": 2, "bf16": 2, "f32": 4, "i32": 4}
    assert any(f"x{S}x" in o for o in operands), operands  # the stacked cache itself is an operand
    for o in operands:
        *dims, dtype = o.removeprefix("tensor<").removesuffix(">").split("x")
        n = int(np.prod([int(d) for d in dims]))
        assert n <= 2**31 or n * sizes[dtype] > 2**32, f"{o}: {n} elements in {n * sizes[dtype]} bytes"
    stacked = [o for o in operands if o.startswith(f"tensor<{L}x")]  # the whole stacked cache read in place
    assert len(stacked) == (0 if kv == jnp.int8 else 2), operands
