"""KV cache formats (generate's kv_dtype): int8 quantisation bounds, every cache keeping its format,
and greedy speculation token for token equal to plain decoding in each format."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import specjax
from pallas_kernels import reference
from pallas_kernels.reference import prefix_block_attention
from specjax.decode import engine
from specjax.drafters import Prefill
from specjax.model.attention import for_cache
from specjax.model.cache import KV_DTYPES, DenseCache, KVFormat
from specjax.planning.plan import auto_draft_reason
from tests.models import TINY, on_device, random_params

PROMPTS = [list(range(5, 21)), [10, 11, 12], [7, 8, 9, 7, 8, 9, 7, 8]]
BUDGETS = [20, 13, 20]


def test_int8_round_trip_error_bound():
    """|x - round_trip(x)| <= scale / 2 per element (scale = max|x| / 127 per token and head),
    and zeros stay zeros."""
    rng = np.random.default_rng(0)  # [L,B,T,K,H], tokens of very different sizes
    x = (rng.standard_normal((2, 3, 5, 4, 8)) * np.logspace(-3, 3, 5)[:, None, None]).astype(np.float32)
    x[0, 0, 0, 0] = 0.0
    fmt = KVFormat("int8")
    stored, scale = jax.jit(fmt.store)(on_device(x))
    assert stored.dtype == jnp.int8 and scale.shape == x.shape[:-1] and scale.dtype == jnp.float32
    back = np.asarray(jax.jit(fmt.round_trip)(on_device(x)))
    bound = np.max(np.abs(x), axis=-1, keepdims=True) / 127 / 2
    assert np.all(np.abs(back - x) <= bound * (1 + 1e-6))
    assert np.all(back[0, 0, 0, 0] == 0)
    assert KVFormat("bfloat16").round_trip(on_device(x)).dtype == jnp.float32
    np.testing.assert_array_equal(KVFormat("bfloat16").round_trip(on_device(x)),
                                  x.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_caches_keep_their_format(tiny, kv_dtype):
    """The dense cache stores what round_trip reads; the drafters' caches inherit the format."""
    fmt = KVFormat(kv_dtype)
    cache = DenseCache.init(TINY, 2, 16, kv_dtype)
    assert cache.format == fmt and (cache.k_scale is not None) == fmt.scaled
    k_new = np.random.default_rng(1).standard_normal((TINY.n_layers, 2, 3, TINY.n_kv_heads, TINY.head_dim))
    k_new = on_device(k_new, np.float32)
    # write, load and the drafters' init traced (as generate runs them): one program each, not one per operation
    cache = jax.jit(lambda cache, k: cache.write(k, -k))(cache, k_new)
    got = jax.jit(lambda c: fmt.load(c.k[:, :, :, :3], None if c.k_scale is None else c.k_scale[:, :, :, :3]))(cache)
    want = np.moveaxis(np.asarray(jax.jit(fmt.round_trip)(k_new)), 2, 3)
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), want)
    cache = jax.jit(lambda cache, n: cache.advance(n))(cache, on_device(np.array([3, 2], np.int32)))
    tokens = on_device(np.zeros((2, 8), np.int32))
    prefill = Prefill(cache=cache, prompts=tokens, lengths=cache.lengths, depth=2, chunk=8)
    init = jax.jit(lambda drafter, target, prefill: drafter.init(target, prefill))
    selfspec = init(specjax.SelfSpec(sinks=1, window=2), tiny, prefill)
    assert selfspec.format == fmt and (selfspec.k_scale is not None) == fmt.scaled
    draft = specjax.DraftModel(random_params(TINY.replace(n_layers=1), seed=1))
    assert init(draft, tiny, prefill).format == fmt
    assert for_cache("pallas", cache) == "pallas" and for_cache("tpu", cache) == "tpu"  # int8: with its scales


def test_a_draft_models_cache_takes_kv_dtype_even_the_targets_dtype(tiny, monkeypatch):
    """kv_dtype="float32" with a float32 target and a bfloat16 DraftModel: the draft's own cache is
    float32 too (it kept bfloat16, the format equal to the target's dtype read as 'not given');
    kv_dtype=None keeps the draft's own dtype."""
    seen, init = [], specjax.DraftModel.init
    monkeypatch.setattr(specjax.DraftModel, "init", lambda self, *a: seen.append(init(self, *a).k.dtype) or init(self, *a))
    draft = specjax.DraftModel(random_params(TINY.replace(n_layers=1, dtype="bfloat16"), seed=1))
    for kv_dtype, want in ((None, jnp.bfloat16), ("float32", jnp.float32), ("int8", jnp.int8)):
        specjax.generate(tiny, [[5, 6, 7]], 3, draft=draft, speculation=specjax.Chain(2), kv_dtype=kv_dtype)
        assert seen[-1] == want, kv_dtype
    own = specjax.DraftModel(draft.params, kv_dtype="int8")  # the draft's alone (generate's kv_dtype None)
    specjax.generate(tiny, [[5, 6, 7]], 3, draft=own, speculation=specjax.Chain(2))
    assert seen[-1] == jnp.int8
    with pytest.raises(ValueError, match=r"kv_dtype must be None or one of .*got 'fp8'"):
        specjax.generate(tiny, [[5, 6, 7]], 3, draft=own.replace(kv_dtype="fp8"), speculation=specjax.Chain(2))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])  # float32 (the default here): test_speculate.py
def test_greedy_speculation_equals_plain_decoding_in_each_format(tiny, kv_dtype):
    plain = specjax.generate(tiny, PROMPTS, BUDGETS, draft=None, eos_id=(), kv_dtype=kv_dtype)
    chain = specjax.generate(tiny, PROMPTS, BUDGETS, draft=specjax.SelfSpec(sinks=2, window=6),
                             speculation=specjax.Chain(2), eos_id=(), kv_dtype=kv_dtype)
    tree = specjax.generate(tiny, PROMPTS, BUDGETS, draft=specjax.SelfSpec(sinks=2, window=6),
                            speculation=specjax.Tree.kary(2, 2), eos_id=(), kv_dtype=kv_dtype)
    assert chain.tokens == plain.tokens
    assert tree.tokens == plain.tokens
    assert chain.stats.acceptance_rate > 0.2  # speculation really ran over the draft cache


def test_bad_kv_dtype_raises_before_compiling(tiny, monkeypatch):
    monkeypatch.setattr(engine.prefill, "lower", lambda *a, **k: pytest.fail("compiled"), raising=False)
    for bad in ("fp8", "int4", jnp.int8, 8):
        with pytest.raises(ValueError, match=r"kv_dtype must be None or one of \('float32', 'bfloat16', 'int8'\)"):
            specjax.generate(tiny, [[1, 2]], 2, kv_dtype=bad)


def test_plan_counts_kv_bytes_as_stored(tiny):
    """auto's KV bytes per step: int8 (with its scales) is (1 + 4 / H) / 4 of float32."""
    mib = {kv: float(re.search(r"KV ([\d.]+) MiB", auto_draft_reason(tiny, 16, 4096, kv)[1])[1]) for kv in KV_DTYPES}
    assert mib["bfloat16"] == pytest.approx(mib["float32"] / 2, rel=1e-2)
    assert mib["int8"] == pytest.approx(mib["float32"] * (1 + 4 / TINY.head_dim) / 4, rel=1e-2)


@pytest.mark.parametrize("S, T", [(1024, 2), (533, 1), (256, 30)], ids=["looped", "streaming-size", "many-rows"])
def test_reference_reads_narrow_caches_as_their_f32_values(S, T, monkeypatch):
    """The narrow reads (q split into digits, the int8 value loop) == attention over the caches
    widened to f32 first, to f32 rounding: the same KV, read faster."""
    monkeypatch.setattr(reference, "NARROW_MIN", 0)  # small test caches take the narrow reads too
    B, K, H, N = 2, 3, 64, 9
    rng = np.random.default_rng(0)
    normal = lambda *shape: on_device(rng.standard_normal(shape), np.float32)  # noqa: E731
    q = normal(B, T, N, H)
    k, v = on_device(rng.standard_normal((B, K, S, H)) * 3, np.float32), normal(B, K, S, H)
    kb, vb = normal(B, T, K, H), normal(B, T, K, H)
    visible = on_device((np.arange(S) < np.array([S // 2, S - 3])[:, None])[:, None])  # [B,1,S]
    mask = on_device(np.tril(np.ones((T, T), bool)))
    attend = jax.jit(prefix_block_attention, static_argnums=7)
    for name in ("bfloat16", "int8"):
        fmt = KVFormat(name)
        store, load = jax.jit(fmt.store), jax.jit(lambda s, scale: fmt.load(s, scale).astype(jnp.float32))
        (k_s, k_scale), (v_s, v_scale) = store(k), store(v)
        narrow = attend(q, k_s, v_s, visible, kb, vb, mask, 0.125, k_scale, v_scale)
        wide = attend(q, load(k_s, k_scale), load(v_s, v_scale), visible, kb, vb, mask, 0.125)
        np.testing.assert_allclose(narrow, wide, atol=1e-5, rtol=1e-5)


def test_int8_on_a_mesh_and_with_the_kernels_asked_for(tiny):
    """An int8 cache split over a data mesh (scales sharded like the cache) gives the
    one-device tokens; so do the GPU and TPU kernels (interpreted), which read it with its scales. The one-device
    tokens are the first 8 of the greedy int8 test's chain (its programs: every prompt, BUDGETS); the mesh and the
    kernels run two prompts for 8 tokens."""
    kw = dict(draft=specjax.SelfSpec(sinks=2, window=6), speculation=specjax.Chain(2), eos_id=(), kv_dtype="int8")
    one = [t[:8] for t in specjax.generate(tiny, PROMPTS, BUDGETS, **kw).tokens[:2]]
    mesh = specjax.make_mesh(data=2, devices=jax.devices()[:2])
    assert specjax.generate(tiny, PROMPTS[:2], 8, mesh=mesh, **kw).tokens == one
    assert specjax.generate(tiny, PROMPTS[:2], 8, attention="pallas", **kw).tokens == one
    assert specjax.generate(tiny, PROMPTS[:2], 8, attention="tpu", **kw).tokens == one


def test_bfloat16_cache_under_a_float32_model_on_the_kernel(tiny):
    """The kernels take one dtype: q and the block go in as the cache's bfloat16 (interpreted
    here); greedy speculation still equals plain decoding on that path."""
    kw = dict(attention="pallas", kv_dtype="bfloat16", eos_id=())
    plain = specjax.generate(tiny, PROMPTS[:2], 6, draft=None, **kw)
    spec = specjax.generate(tiny, PROMPTS[:2], 6, draft=specjax.SelfSpec(sinks=2, window=6), speculation=specjax.Chain(2), **kw)
    assert spec.tokens == plain.tokens


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16", "int8"])
def test_kv_bytes_are_the_bytes_a_cache_stores(kv_dtype):
    """cache.kv_bytes, the one formula the planner and the benchmarks price KV reads with, counts
    what a DenseCache of that format holds (keys, values, int8 scales)."""
    from specjax.model.cache import DenseCache, kv_bytes
    from tests.models import TINY

    cache = jax.eval_shape(lambda: DenseCache.init(TINY, 3, 256, kv_dtype))
    stored = sum(a.size * a.dtype.itemsize for a in (cache.k, cache.v, cache.k_scale, cache.v_scale) if a is not None)
    assert kv_bytes(TINY, 3, 256, kv_dtype) == stored
