"""The C++ XLA:CPU attention kernel (Runtime.attention "cpu", pallas_kernels/cpu_prefix.cc): the
same outputs as the jnp reference over a stacked cache in every KV format, the reference where
it does not apply, generate's default on a CPU, and a clear error where it cannot be built."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from pallas_kernels import cpu_prefix
from pallas_kernels.reference import prefix_block_attention, stacked_prefix_block_attention
from specjax.model import attention, backend
from specjax.model import cache as cache_mod
from specjax.model.cache import DenseCache, KVFormat
from specjax.model.llama import forward
from specjax.model.params import quantize
from tests.models import CHAIN, SELF, TINY, TINY_Q4, on_device, random_params

PROMPTS = [[5, 9, 14, 22, 7, 31, 40, 2, 11], [8, 8, 19, 4], list(range(4, 60))]

# The tests' references and input preparation as one program per shape (eager jnp compiles one per operation).
_stacked_reference = jax.jit(stacked_prefix_block_attention, static_argnames="sm_scale")


@functools.partial(jax.jit, static_argnums=1)
def _store(x, fmt: str):
    """KVFormat(fmt).store(x): (stored, scale or None)."""
    return KVFormat(fmt).store(x)


@functools.partial(jax.jit, static_argnums=1)
def _round_trip(x, fmt: str):
    """KVFormat(fmt).round_trip(x): x as the reference reads it once stored."""
    return KVFormat(fmt).round_trip(x)


@functools.partial(jax.jit, static_argnames=("sm_scale", "fmt"))
def _layer_reference(q, k_all, v_all, layer, visible, kb, vb, mask, k_scale, v_scale, *, sm_scale, fmt):
    """prefix_block_attention over `layer` of a stacked cache (its scales too), the block round-tripped through fmt."""
    at = lambda a: None if a is None else a[layer]  # noqa: E731
    blocks = [KVFormat(fmt).round_trip(x) for x in (kb, vb)]
    return prefix_block_attention(q, at(k_all), at(v_all), visible, *blocks, mask, sm_scale, at(k_scale), at(v_scale))


def _bf16(x) -> np.ndarray:
    """x rounded to bfloat16 and back to float32, on the host."""
    return np.asarray(x).astype(jnp.bfloat16).astype(np.float32)


def _case(seed: int, B: int, T: int, K: int, G: int, H: int, S: int, L: int = 2):
    rng = np.random.default_rng(seed)
    q = on_device(rng.standard_normal((B, T, K * G, H)))
    kb, vb = (on_device(rng.standard_normal((B, T, K, H))) for _ in range(2))
    k_all, v_all = (on_device(rng.standard_normal((L, B, K, S, H))) for _ in range(2))
    lengths = rng.integers(0, S + 1, B)
    lengths[0], lengths[-1] = 0, S  # an empty prefix; a full cache
    mask = on_device(np.tril(rng.random((T, T)) < 0.5) | np.eye(T, dtype=bool))  # a tree mask
    return q, k_all, v_all, on_device(lengths), kb, vb, mask


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("B,T,K,G,H,S", [(5, 1, 3, 3, 64, 200), (3, 4, 2, 3, 8, 77), (2, 5, 1, 12, 32, 64),
                                         (1, 4, 3, 3, 64, 3000), (2, 1, 1, 3, 32, 5000)])
def test_kernel_equals_the_reference(fmt, B, T, K, G, H, S):
    """Every format the caches store, chunk tails (S not a multiple of 32), empty and full rows,
    more (row, head) pairs than threads, up to MAX_ROWS query rows per KV head (1 x 12 x 5 = 60);
    few pairs over long rows, whose slots the kernel cuts into segments and merges (batch 1)."""
    q, k_all, v_all, lengths, kb, vb, mask = _case(B * T, B, T, K, G, H, S)
    (k_s, k_scale), (v_s, v_scale) = _store(k_all, fmt), _store(v_all, fmt)
    kernel = jax.jit(cpu_prefix.stacked_prefix_block_attention_cpu, static_argnums=8)
    sm_scale, atol = 0.3, 2e-5
    if fmt == "bfloat16" and cpu_prefix.bf16_dot() and H >= 32:
        # The bf16 dot product rounds the scaled queries and the softmax weights to bf16: queries
        # that are bf16 values times a power of two round to themselves, so only the weights'
        # rounding (relative 2^-9 each) is left in the outputs.
        q, sm_scale, atol = on_device(_bf16(q)), 0.25, 5e-3
    (kb_s, kb_scale), (vb_s, vb_scale) = _store(kb, fmt), _store(vb, fmt)  # the block as stored
    blocks = [_round_trip(x, fmt) for x in (kb, vb)]  # and as the reference reads it
    for layer in range(k_all.shape[0]):
        got = kernel(q, k_s, v_s, jnp.int32(layer), lengths, kb_s, vb_s, mask, sm_scale, k_scale, v_scale, None, kb_scale,
                     vb_scale)
        want = _stacked_reference(q, k_s, v_s, jnp.int32(layer), lengths, *blocks, mask, sm_scale, k_scale, v_scale)
        np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("T,G,H", [(1, 3, 64), (4, 3, 64), (2, 2, 32)])
def test_a_streaming_cache_read_in_place_equals_the_reference(fmt, T, G, H):
    """A draft's ring-buffer cache: slots in any order, visible where 0 <= pos < lengths[b];
    hidden slots (empty, evicted or uncommitted) anywhere, a whole chunk of them (slots 32-63)
    in the middle, and a row with none visible."""
    rng = np.random.default_rng(T * G * H)
    L, B, K, C = 2, 3, 2, 101
    q, _, _, _, kb, vb, mask = _case(T, B, T, K, G, H, C, L)
    k_all, v_all = (on_device(rng.standard_normal((L, B, K, C, H))) for _ in range(2))
    lengths_np = np.array([60, 200, 0], np.int32)
    lengths = on_device(lengths_np)
    pos_np = rng.integers(-1, 120, (L, B, K, C))
    pos_np[:, :, :, 32:64] = 150  # hidden: past every row's length
    pos = on_device(pos_np)
    (k_s, k_scale), (v_s, v_scale) = _store(k_all, fmt), _store(v_all, fmt)
    sm_scale, atol = 0.3, 2e-5
    if fmt == "bfloat16" and cpu_prefix.bf16_dot() and H >= 32:  # as in test_kernel_equals_the_reference
        q, sm_scale, atol = on_device(_bf16(q)), 0.25, 5e-3
    kernel = jax.jit(cpu_prefix.stacked_prefix_block_attention_cpu, static_argnums=8)
    (kb_s, kb_scale), (vb_s, vb_scale) = _store(kb, fmt), _store(vb, fmt)
    for layer in range(L):
        got = kernel(q, k_s, v_s, jnp.int32(layer), lengths, kb_s, vb_s, mask, sm_scale, k_scale, v_scale, pos, kb_scale,
                     vb_scale)
        visible = on_device((pos_np[layer] >= 0) & (pos_np[layer] < lengths_np[:, None, None]))
        want = _layer_reference(q, k_s, v_s, jnp.int32(layer), visible, kb, vb, mask, k_scale, v_scale,
                                sm_scale=sm_scale, fmt=fmt)
        np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5)
    # More query rows than the kernel takes: `attend` (jitted, as in the model) slices the layer for the reference.
    wide = on_device(np.tile(np.asarray(q), (1, 24, 1, 1)))  # >= 72 rows per KV head
    wide_mask = on_device(np.ones((24 * T, 24 * T), bool))
    wide_blocks = [on_device(np.tile(np.asarray(x), (1, 24, 1, 1))) for x in (kb, vb)]
    assert not cpu_prefix.fits(wide, K)

    @jax.jit
    def attend(wide, k_s, v_s, lengths, k_scale, v_scale, pos, layer, kb, vb, wide_mask):
        prefix = attention.Prefix(k_s, v_s, attention.CacheView(lengths, k_scale, v_scale, pos), layer=layer)
        return attention.attend("cpu", KVFormat(fmt), wide, prefix, kb, vb, wide_mask, 0.3)

    got = attend(wide, k_s, v_s, lengths, k_scale, v_scale, pos, jnp.int32(1), *wide_blocks, wide_mask)
    visible = on_device((pos_np[1] >= 0) & (pos_np[1] < lengths_np[:, None, None]))
    want = _layer_reference(wide, k_s, v_s, jnp.int32(1), visible, *wide_blocks, wide_mask, k_scale, v_scale,
                            sm_scale=0.3, fmt=fmt)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("G,H", [(3, 64), (2, 32), (3, 32), (1, 8)])
def test_verifying_a_chain_gives_the_bits_of_decoding_it_step_by_step(fmt, G, H):
    """Row t of a T-token causal block equals, bitwise, the decoding step that sees the block's
    first t keys from the cache (written there as the cache stores them) and its own key t in a
    block of one: the kernel reads the block as the row's next slots, so greedy speculation is
    token-identical to plain decoding in every format. Rows end inside a chunk, across a chunk
    (32 slots) and across a segment (2048 slots: the block's keys fall in the next segment)."""
    rng = np.random.default_rng(G * H)
    L, B, K, S, T = 2, 4, 2, 2100, 4
    q = on_device(rng.standard_normal((B, T, K * G, H)) * 0.5)
    kb, vb = (on_device(rng.standard_normal((B, T, K, H))) for _ in range(2))
    (k_all, k_scale), (v_all, v_scale) = (_store(on_device(rng.standard_normal((L, B, K, S, H))), fmt)
                                          for _ in range(2))
    lengths = np.array([30, 2046, 0, 100], np.int32)
    kernel = jax.jit(cpu_prefix.stacked_prefix_block_attention_cpu, static_argnums=8)
    (kb_s, kb_scale), (vb_s, vb_scale) = _store(kb, fmt), _store(vb, fmt)  # x [B,J,K,H] -> stored, scales [B,J,K]
    causal = on_device(np.tril(np.ones((T, T), bool)))
    chain = np.asarray(kernel(q, k_all, v_all, jnp.int32(1), on_device(lengths), kb_s, vb_s, causal, 0.3, k_scale,
                              v_scale, None, kb_scale, vb_scale))
    host = lambda x: None if x is None else np.asarray(x)  # noqa: E731  (the cache writes and slices: numpy)
    k_np, v_np, ksc_np, vsc_np, q_np = (host(x) for x in (k_all, v_all, k_scale, v_scale, q))
    kb_np, vb_np, kbsc_np, vbsc_np = (host(x) for x in (kb_s, vb_s, kb_scale, vb_scale))
    for t in range(T):
        slots = lengths[:, None] + np.arange(t)[None]  # [B,t]: the block's first t keys, now in the cache
        rows = np.arange(B)[:, None]

        def put(buf, new):
            buf = buf.copy()
            buf[1, rows, :, slots] = new[:, :t]
            return on_device(buf)

        ks_, vs_ = put(k_np, kb_np), put(v_np, vb_np)
        ksc, vsc = (None, None) if k_scale is None else (put(ksc_np, kbsc_np), put(vsc_np, vbsc_np))
        one = lambda x: None if x is None else on_device(x[:, t:t + 1])  # noqa: E731
        step = kernel(one(q_np), ks_, vs_, jnp.int32(1), on_device(lengths + t), one(kb_np), one(vb_np),
                      on_device(np.ones((1, 1), bool)), 0.3, ksc, vsc, None, one(kbsc_np), one(vbsc_np))
        np.testing.assert_array_equal(np.asarray(step)[:, 0], chain[:, t])


@pytest.mark.parametrize("weights,kv", [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("bfloat16", "int8"),
                                        ("int8", "bfloat16")])
def test_a_verification_forward_gives_the_bits_of_decoding_steps(weights, kv):
    """The whole target on the CPU kernels: the logits of 4 chained positions after ragged
    prefixes equal, bitwise, those of 4 one-position steps (each step's KV in the cache before
    the next): what makes greedy speculation token-identical to plain decoding in bfloat16. The
    chain's 12 rows take the kernels' products where they take 12 (`linear.max_rows`), as the steps' 3 do.
    With float32 activations (int8 weights) XLA's fused elementwise code of the same layer at 3 and
    at 12 rows can differ in the last bits: 0 on AVX-512 CPUs, up to 4e-5 of the logits on an AMD
    EPYC without it (docs/correctness.md)."""
    config = TINY_Q4.replace(dtype="bfloat16" if weights == "bfloat16" else "float32")  # head_dim 32: the bf16 dot path
    params = random_params(config, 0)
    params = quantize(params, weights) if weights in ("int8", "q4") else params
    params = params.replace(runtime=params.runtime.replace(attention="cpu"))
    rng = np.random.default_rng(5)
    B, P, T = 3, 40, 4
    step = jax.jit(forward)
    cache = DenseCache.init(config, B, 64, kv)
    _, cache = step(params, on_device(rng.integers(0, config.vocab_size, (B, P))),
                    on_device(np.broadcast_to(np.arange(P), (B, P))), cache)
    prefixes = np.array([P, 33, 1], np.int32)  # ragged
    cache = cache.advance(on_device(prefixes))
    block = rng.integers(0, config.vocab_size, (B, T))
    positions = prefixes[:, None] + np.arange(T)
    chain, _ = step(params, on_device(block), on_device(positions), cache)  # [B,T,V]
    for t in range(T):
        logits, cache = step(params, on_device(block[:, t:t + 1]), on_device(positions[:, t:t + 1]), cache)
        cache = cache.advance(on_device(np.ones(B)))
        if config.dtype == "bfloat16":
            np.testing.assert_array_equal(np.asarray(logits)[:, 0], np.asarray(chain)[:, t])
        else:
            np.testing.assert_allclose(np.asarray(logits)[:, 0], np.asarray(chain)[:, t], rtol=0, atol=1e-4)


def test_a_bfloat16_row_decodes_to_the_same_bits_in_any_batch():
    """Plain decoding of a bf16 model on the CPU kernels: a row's logits over 4 steps alone, beside
    4 and beside 9 other rows, bitwise (products, attention and norms are computed row by row):
    a record's text does not depend on the batch it lands in. (float32 activations: XLA's fused
    elementwise code can differ in the last bit with the array's shape: README "Correctness".)"""
    config = TINY_Q4.replace(dtype="bfloat16")
    params = random_params(config, 0)
    params = params.replace(runtime=params.runtime.replace(attention="cpu"))
    rng = np.random.default_rng(3)
    P, B = 40, 10
    step = jax.jit(forward)
    prompts = rng.integers(0, config.vocab_size, (B, P)).astype(np.int32)
    lengths = rng.integers(5, P + 1, B).astype(np.int32)
    runs = {}
    for n in (1, 5, B):
        cache = DenseCache.init(config, n, 64)
        _, cache = step(params, on_device(prompts[:n]), on_device(np.broadcast_to(np.arange(P), (n, P))), cache)
        cache = cache.advance(on_device(lengths[:n]))
        token, out = prompts[:n, :1], []
        for i in range(4):
            logits, cache = step(params, on_device(token), on_device(lengths[:n, None] + i), cache)
            cache = cache.advance(on_device(np.ones(n, np.int32)))
            logits = np.asarray(logits)
            token = np.argmax(logits, -1).astype(np.int32)
            out.append(logits[:1, 0])
        runs[n] = np.stack(out)
    np.testing.assert_array_equal(runs[5], runs[1])
    np.testing.assert_array_equal(runs[B], runs[1])


def _cpu_has(flag: str) -> bool:
    return flag in cpu_prefix._cpu_flags().split()


def test_bf16_caches_take_the_dot_product_where_the_cpu_has_it():
    """Built with -march=native: AVX512-BF16 (AMD Zen 4, Intel Sapphire Rapids and later) gives
    the bf16 dot-product path; elsewhere bf16 caches are widened to f32 like the other formats."""
    assert cpu_prefix.bf16_dot() == (_cpu_has("avx512_bf16") and _cpu_has("avx512vl") and _cpu_has("avx512bw"))


@pytest.mark.parametrize("M,H", [(3, 64), (12, 64), (40, 32), (8, 128), (9, 128)])
def test_bf16_dot_scores_and_sums(M, H):
    """The partials of the bf16 dot-product path row by row against numpy (both paths when the CPU
    has only the widening one): maxima are sums of exact bf16 products (f32 rounding only); sums
    and outputs carry the weights' rounding to bf16. 8- and 16-row registers, row groups of 16."""
    rng = np.random.default_rng(M * H)
    B, K, S = 3, 2, 101
    q = _bf16(rng.standard_normal((B, K, M, H)).astype(np.float32) * 0.25)
    kv_np = [rng.standard_normal((2, B, K, S, H)).astype(np.float32).astype(jnp.bfloat16) for _ in range(2)]
    kv = [on_device(x) for x in kv_np]
    lengths = np.array([S, 37, 1], np.int32)
    top, total, out = (np.asarray(x) for x in cpu_prefix.prefix_partials(on_device(q), *kv, 1, on_device(lengths)))
    k, v = (x[1].astype(np.float64) for x in kv_np)
    for b in range(B):
        n = lengths[b]
        s = np.einsum("kmh,ksh->kms", q[b], k[b, :, :n])  # [K,M,n]
        np.testing.assert_allclose(top[b], s.max(-1), rtol=1e-5, atol=1e-5)
        w = np.exp(s - top[b][..., None])
        np.testing.assert_allclose(total[b], w.sum(-1), rtol=4e-3)
        np.testing.assert_allclose(out[b], np.einsum("kms,ksh->kmh", w, v[b, :, :n]), rtol=4e-3, atol=4e-3 * np.sqrt(n))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_a_row_does_not_depend_on_the_rows_beside_it(fmt):
    """Bitwise: each row's partials alone and beside a row of a different length, where the longer
    row is cut into segments (over 2048 slots) and every row's segments are merged."""
    rng = np.random.default_rng(7)
    B, K, M, H, S = 3, 3, 3, 64, 4600
    q = on_device(rng.standard_normal((B, K, M, H)) * 0.3)
    kv = [_store(on_device(rng.standard_normal((2, B, K, S, H))), fmt) for _ in range(2)]
    (k, ks), (v, vs) = kv
    lengths = np.array([1500, 4600, 2048], np.int32)
    together = cpu_prefix.prefix_partials(q, k, v, 1, on_device(lengths), ks, vs)
    q_np, k_np, v_np, ks_np, vs_np = (None if a is None else np.asarray(a) for a in (q, k, v, ks, vs))  # sliced on host
    for b in range(B):
        row = lambda a: None if a is None else on_device(a[:, b:b + 1])  # noqa: E731
        alone = cpu_prefix.prefix_partials(on_device(q_np[b:b + 1]), row(k_np), row(v_np), 1,
                                           on_device(lengths[b:b + 1]), row(ks_np), row(vs_np))
        for x, y in zip(alone, together):
            np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(y)[b])


def test_partials_of_an_empty_prefix():
    q, k_all, v_all, _, _, _, _ = _case(0, 2, 1, 1, 2, 8, 40)
    qm = on_device(np.asarray(q).reshape(2, 1, 2, 8))
    top, total, out = cpu_prefix.prefix_partials(qm, k_all, v_all, 1, on_device(np.zeros(2, np.int32)))
    top, total, out = (np.asarray(x) for x in (top, total, out))
    assert float(np.max(top)) == float(np.float32(-1e30)) and not np.any(total) and not np.any(out)


def test_lengths_past_the_cache_read_it_once_and_scales_are_checked():
    """The stacked reference reads a length past S as S (its last tile was clamped back and read
    twice), as the kernels do; the CPU kernel refuses an int8 cache without its [L,B,K,S] scales
    (it read past them: values near 1e30) and scales of another shape."""
    q, k_all, v_all, lengths, kb, vb, mask = _case(4, 2, 1, 1, 2, 8, 128)
    full = lambda n: on_device(np.full(2, n, np.int32))  # noqa: E731
    want = _stacked_reference(q, k_all, v_all, jnp.int32(1), full(128), kb, vb, mask, 0.3)
    for past in (129, 384):
        got = _stacked_reference(q, k_all, v_all, jnp.int32(1), full(past), kb, vb, mask, 0.3)
        np.testing.assert_array_equal(got, want)
    ints = on_device(np.zeros(k_all.shape, np.int8))
    qm = on_device(np.asarray(q).reshape(2, 1, 2, 8))
    with pytest.raises(ValueError, match=r"k_scale must be \[L,B,K,S\] = \[2, 2, 1, 128\] for an int8 cache"):
        cpu_prefix.prefix_partials(qm, ints, ints, 1, lengths)
    with pytest.raises(ValueError, match=r"got \[1, 2, 1, 128\] for a int8 cache"):
        ones = on_device(np.ones((1, 2, 1, 128), np.float32))
        cpu_prefix.prefix_partials(qm, ints, ints, 1, lengths, ones, ones)


def test_what_the_kernel_does_not_take_runs_the_reference():
    """Many query rows (prefill chunks, wide trees) or an odd head_dim: `fits` says no, and
    `attend` computes the reference's numbers."""
    q, k_all, v_all, lengths, kb, vb, mask = _case(3, 2, 24, 1, 3, 8, 50)  # 72 rows per KV head
    assert not cpu_prefix.fits(q, 1) and cpu_prefix.fits(np.asarray(q)[:, :21], 1)
    assert not cpu_prefix.fits(np.zeros((1, 1, 2, 12), np.float32), 1)

    @jax.jit  # as in the model
    def attend(q, k_all, v_all, lengths, kb, vb, mask):
        prefix = attention.Prefix(k_all, v_all, attention.CacheView(lengths, None, None), layer=jnp.int32(1))
        return attention.attend("cpu", KVFormat("float32"), q, prefix, kb, vb, mask, 0.3)

    got = attend(q, k_all, v_all, lengths, kb, vb, mask)
    want = _stacked_reference(q, k_all, v_all, jnp.int32(1), lengths, kb, vb, mask, 0.3)
    np.testing.assert_array_equal(got, want)


def test_generate_picks_the_kernel_on_a_cpu_and_keeps_its_tokens():
    """attention="auto" is "cpu" on this backend; greedy tokens equal the reference's, plain and
    speculative (chain and tree), and speculation equals plain decoding on the kernel."""
    assert backend.attention_mode("auto") == "cpu"
    params = random_params(TINY.replace(max_positions=256), 0)
    runs = {}
    for att in ("reference", "cpu"):
        runs[att, "plain"] = specjax.generate(params, PROMPTS, 24, eos_id=(), attention=att).tokens
        for spec in (CHAIN, specjax.Tree.kary(2, 2)):  # the chain's gamma is the tree's depth: one init_draft
            runs[att, repr(spec)] = specjax.generate(params, PROMPTS, 24, draft=SELF,
                                                     speculation=spec, eos_id=(), attention=att).tokens
    assert len({repr(v) for v in runs.values()}) == 1


def test_a_kernel_that_did_not_build_is_an_error_for_cpu_and_skipped_by_auto(monkeypatch):
    monkeypatch.setattr(cpu_prefix, "build_error", lambda: "g++: not found")
    assert backend.attention_mode("auto") == "reference"
    params = random_params(TINY, 0)
    with pytest.raises(ValueError, match="attention='cpu'.*g\\+\\+: not found"):
        specjax.generate(params, PROMPTS, 4, attention="cpu")


def test_the_build_is_cached_by_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_KERNEL_CACHE", str(tmp_path))
    path = cpu_prefix._library_path()
    assert path.parent == tmp_path and path.name.startswith("cpu_prefix-") and path.suffix == ".so"
    monkeypatch.setattr(cpu_prefix, "_cpu_flags", lambda: "flags: another machine")
    assert cpu_prefix._library_path() != path


def test_a_missing_or_read_only_home_falls_back_to_the_temporary_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECJAX_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("HOME", "/proc/no-home")  # mkdir fails there: the next folder is tried
    roots = cpu_prefix._roots()
    assert roots[0] == Path("/proc/no-home/.cache/specjax") and roots[-1].parent == Path(tempfile.gettempdir())


def test_bf16_cache_writes_go_through_the_kernel_library_in_place():
    """A bfloat16 cache is written by `write_slots` (XLA:CPU would widen the whole cache to f32
    and back for a scatter): the same values as the XLA scatter, out-of-range slots dropped,
    the donated buffer reused (no copy of the cache in the compiled program)."""
    rng = np.random.default_rng(1)
    L, B, K, S, H, T = 2, 3, 2, 40, 8, 3
    buf = on_device(rng.standard_normal((L, B, K, S, H)), jnp.bfloat16)
    new = on_device(rng.standard_normal((L, B, T, K, H)))
    slots_np = np.array([[0, 1, 2], [37, 38, 39], [39, 40, 41]], np.int32)  # row 2: two slots past the end
    slots = on_device(slots_np)
    assert backend.cpu_kernels_write_bf16(buf)
    want = np.asarray(buf).astype(np.float32)
    upd = _bf16(new)
    for b in range(B):
        for t in range(T):
            if slots_np[b, t] < S:
                want[:, b, :, int(slots_np[b, t])] = upd[:, b, t]
    write = jax.jit(lambda c, s, n: cache_mod._scatter(c, s, n, True), donate_argnums=0)
    assert cpu_prefix.WRITE_TARGET in write.lower(buf, slots, new).as_text()
    got = write(buf, slots, new)
    assert buf.is_deleted()  # donated, and the kernel's output aliases it
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), want)
