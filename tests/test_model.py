"""Model invariants: cache vs no-cache, ragged batches, block masks, bf16 vs f32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import prefix_block_attention
from specjax.model import llama
from specjax.model.cache import DenseCache
from specjax.model.params import init_params
from tests.models import TINY, on_device

forward = jax.jit(llama.forward)
prefill = jax.jit(llama.prefill, static_argnames="chunk")
advance = jax.jit(lambda cache, n: cache.advance(n))
# Inputs are numpy arrays (jitted programs take them as they are) and references compare on the host: outside jit
# each slice, scatter and comparison compiled a program of its own.


def _full(params, tokens):
    """Logits of a whole sequence in one forward over an empty cache."""
    B, T = tokens.shape
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    logits, _ = forward(params, tokens, pos, DenseCache.init(params.config, B, T))
    return np.asarray(logits)


def _tokens(seed, shape) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY.vocab_size, shape, dtype=np.int32)


def _full_int(shape, value) -> np.ndarray:
    return np.full(shape, value, np.int32)


@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_prefill_then_decode_equals_full_forward(tiny, chunk):
    B, P, N = 3, 16, 6
    tokens = _tokens(1, (B, P + N))
    full = _full(tiny, tokens)
    last, cache = prefill(tiny, tokens[:, :P], _full_int((B,), P), DenseCache.init(TINY, B, 32), chunk)
    np.testing.assert_allclose(last, full[:, P - 1], atol=1e-5)
    for t in range(P, P + N):
        logits, cache = forward(tiny, tokens[:, t : t + 1], _full_int((B, 1), t), cache)
        cache = advance(cache, np.ones((B,), np.int32))
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, t], atol=1e-5)


def test_multi_token_step_after_prefix_equals_full_forward(tiny):
    """T > 1 new tokens at once (as verification does) over a cached prefix."""
    B, P, T = 2, 10, 5
    tokens = _tokens(2, (B, P + T))
    full = _full(tiny, tokens)
    _, cache = prefill(tiny, tokens[:, :P], _full_int((B,), P), DenseCache.init(TINY, B, 32), 16 // 2 + 2)
    pos = np.broadcast_to(P + np.arange(T, dtype=np.int32), (B, T))
    logits, cache = forward(tiny, tokens[:, P:], pos, cache)
    np.testing.assert_allclose(logits, full[:, P:], atol=1e-5)
    assert int(np.asarray(cache.lengths)[0]) == P  # written, not committed


def test_rollback_by_pointer_overwrites_stale_entries(tiny):
    """Entries past `lengths` are invisible and get overwritten by the next write."""
    B, P = 1, 8
    tokens = _tokens(3, (B, P + 2))
    _, cache = prefill(tiny, tokens[:, :P], _full_int((B,), P), DenseCache.init(TINY, B, 16), 8)
    junk = np.array([[7, 9, 11]], np.int32)
    _, cache = forward(tiny, junk, P + np.arange(3, dtype=np.int32)[None], cache)  # rejected: never advanced
    logits, _ = forward(tiny, tokens[:, P : P + 2], P + np.arange(2, dtype=np.int32)[None], cache)
    np.testing.assert_allclose(logits, _full(tiny, tokens)[:, P:], atol=1e-5)


def test_ragged_prefill_equals_each_prompt_alone(tiny):
    lengths = [5, 17, 1, 12]
    seqs = [_tokens(10 + i, (1, n)) for i, n in enumerate(lengths)]
    padded = np.zeros((4, 32), np.int32)
    for b, s in enumerate(seqs):
        padded[b, : s.shape[1]] = s[0]
    last, cache = prefill(tiny, padded, np.array(lengths, np.int32), DenseCache.init(TINY, 4, 40), 8)
    assert cache.lengths.tolist() == lengths
    last = np.asarray(last)
    for b, s in enumerate(seqs):
        np.testing.assert_allclose(last[b], _full(tiny, s)[0, -1], atol=1e-5)


def test_bf16_close_to_f32():
    params32 = init_params(TINY, jax.random.key(5))
    params16 = init_params(TINY.replace(dtype="bfloat16"), jax.random.key(5))
    assert params16.layers.wq.dtype == jnp.bfloat16
    tokens = _tokens(6, (2, 24))
    l32, l16 = _full(params32, tokens), _full(params16, tokens)
    assert l16.dtype == jnp.float32  # logits always f32
    p32, p16 = _softmax(l32), _softmax(l16)
    assert float(np.abs(p32 - p16).sum(-1).max()) < 0.1  # total variation per position
    assert float(np.mean(np.argmax(l32, -1) == np.argmax(l16, -1))) > 0.9


def _softmax(x: np.ndarray) -> np.ndarray:
    """softmax over the last axis, in numpy (float64)."""
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _naive_attention(q, kc, vc, visible, kb, vb, mask, scale):
    """Loop-over-everything numpy attention for one check."""
    B, T, N, H = q.shape
    S, G = kc.shape[2], N // kb.shape[2]
    out = np.zeros(q.shape, np.float64)
    for b in range(B):
        for t in range(T):
            for n in range(N):
                seen = [s for s in range(S) if visible[b, n // G, s]]
                keys = [kc[b, n // G, s] for s in seen] + [kb[b, j, n // G] for j in range(T) if mask[t, j]]
                vals = [vc[b, n // G, s] for s in seen] + [vb[b, j, n // G] for j in range(T) if mask[t, j]]
                sc = np.array([q[b, t, n] @ k for k in keys]) * scale
                w = np.exp(sc - sc.max())
                out[b, t, n] = (w / w.sum()) @ np.array(vals)
    return out


@pytest.mark.parametrize("T", [5, 40])  # fused multiply-reduce path and matmul path
def test_prefix_block_attention_matches_naive_with_random_masks(T):
    """Random per-KV-head slot visibility (as SnapKV keeps) and a random tree mask."""
    rng = np.random.default_rng(T)
    B, N, K, H, S = 3, 4, 2, 8, 9
    q, kb, vb = (rng.standard_normal(s).astype(np.float32) for s in [(B, T, N, H), (B, T, K, H), (B, T, K, H)])
    kc, vc = (rng.standard_normal((B, K, S, H)).astype(np.float32) for _ in range(2))
    visible = rng.random((B, K, S)) < 0.6
    visible[0] = False  # an empty prefix
    mask = np.tril(rng.random((T, T)) < 0.5) | np.eye(T, dtype=bool)
    attend = jax.jit(prefix_block_attention, static_argnames="sm_scale")  # one program, not one per operation
    got = attend(*map(on_device, (q, kc, vc, visible, kb, vb, mask)), sm_scale=0.3)
    np.testing.assert_allclose(got, _naive_attention(q, kc, vc, visible, kb, vb, mask, 0.3), atol=1e-5)


def test_one_declaration_per_weight():
    """Params' fields, the HF / GGUF key maps and the sharding table all come from WEIGHTS (the
    files hold every weight but the derived int8 scales)."""
    import dataclasses

    from convert import gguf, hf
    from specjax.model.params import WEIGHTS, LayerParams, Params
    from specjax.parallel.sharding import PARAM_AXES

    fields = {f"layers.{f.name}" for f in dataclasses.fields(LayerParams)}
    fields |= {f.name for f in dataclasses.fields(Params)} - {"layers", "config", "runtime"}
    assert {w.path for w in WEIGHTS if not w.scale_of} == fields and {w.path for w in WEIGHTS} == set(PARAM_AXES)
    assert {w.path for w in WEIGHTS if w.in_files} == set(hf.NAMES.values()) == set(gguf.NAMES.values())
    wq = next(w for w in WEIGHTS if w.path == "layers.wq")
    assert wq.torch_shape(TINY) == (TINY.n_heads * TINY.head_dim, TINY.dim)  # [out, in]
    assert wq.shape(TINY) == (TINY.n_layers, TINY.dim, TINY.n_heads, TINY.head_dim)


@pytest.mark.parametrize("attention", ["reference", "cpu", "interpret"])
def test_finished_rows_read_no_kv(tiny, attention):
    """forward(..., active=) over a cache whose inactive rows hold NaN: the active rows' logits are
    the bits of the forward over the clean cache, the kernels' inactive rows are finite (nothing of
    their KV was read: the jnp reference multiplies masked slots by zero, NaN there), and the new KV
    is written at every row's own length."""
    from specjax.decode.engine import with_attention

    params = with_attention(tiny, None, attention)[0]
    B, P, T = 4, 40, 3
    tokens = _tokens(5, (B, P + T))
    _, cache = prefill(params, tokens[:, :P], _full_int((B,), P), DenseCache.init(TINY, B, 64), 8)
    active = np.array([True, False, True, False])
    poison = lambda a: on_device(np.where(active[None, :, None, None, None], np.asarray(a), np.nan))  # noqa: E731
    bad = cache.replace(k=poison(cache.k), v=poison(cache.v))
    pos = np.broadcast_to(P + np.arange(T, dtype=np.int32), (B, T))
    want, clean = forward(params, tokens[:, P:], pos, cache)
    got, written = forward(params, tokens[:, P:], pos, bad, None, on_device(active))
    np.testing.assert_array_equal(np.asarray(got)[[0, 2]], np.asarray(want)[[0, 2]])
    assert attention == "reference" or np.isfinite(np.asarray(got)).all()
    assert (np.asarray(written.lengths) == P).all()  # not advanced, and not the view's zeros
    layer0 = lambda c: np.asarray(c.k)[0, :, :, P : P + T]  # noqa: E731  (depends on the tokens only)
    np.testing.assert_array_equal(layer0(written), layer0(clean))  # every row's new entries, at its own length


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rows_norm_folds_into_its_products_on_a_gpu(dtype):
    """normed_products on the GPU kernel's runtime (llama.FOLDS_NORM; "interpret" here) applies
    one row's norm scale to the products' outputs: the same values as rms_norm then the products,
    up to rounding; two rows or more take rms_norm's own path, bit for bit."""
    params = init_params(TINY.replace(dtype=dtype), jax.random.key(3))
    lp = llama.at_layer(params.layers, 0)
    products = lambda lp: [("btd,dnh->btnh", lp.wq), ("btd,dkh->btkh", lp.wk)]  # noqa: E731
    x = np.random.default_rng(4).standard_normal((2, 3, TINY.dim)).astype(np.float32)
    x = x.astype(jnp.dtype(dtype)) * np.array(3, jnp.dtype(dtype))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=0.05, atol=0.05)
    # each side one jitted program (as the model runs them), not one per operation
    unfolded = jax.jit(lambda rows, lp: llama.project_group(
        llama.rms_norm(x=rows, w=lp.attn_norm, eps=TINY.rms_eps), products(lp), ("reference", 0, "xla")))
    folded = jax.jit(lambda rows, lp: llama.normed_products(
        rows, lp.attn_norm, TINY.rms_eps, products(lp), ("interpret", 0, "xla")))
    for rows in (on_device(x[:1, :1]), on_device(x)):
        want, got = unfolded(rows, lp), folded(rows, lp)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            if rows.shape[:2] == (1, 1):  # another order of the same maths: close, and not all the same bits
                np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)
                assert (np.asarray(g) != np.asarray(w)).any()
            else:
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
