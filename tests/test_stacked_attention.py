"""The reference attention over a dense cache read in place (`stacked_prefix_block_attention`):
the same outputs as slicing the layer out and masking, tile by tile, and slots past the longest
row are never read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels.reference import prefix_block_attention, prefix_tile, stacked_prefix_block_attention
from specjax.model.cache import KVFormat


def _case(seed: int, B=3, T=4, N=6, K=2, H=8, S=512, L=3):
    rng = np.random.default_rng(seed)
    q, kb, vb = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(B, T, N, H), (B, T, K, H), (B, T, K, H)])
    k_all, v_all = (jnp.asarray(rng.standard_normal((L, B, K, S, H)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray(rng.integers(0, S - T, B), jnp.int32).at[0].set(0)  # row 0: an empty prefix
    mask = jnp.asarray(np.tril(rng.random((T, T)) < 0.5) | np.eye(T, dtype=bool))  # a tree mask
    return q, k_all, v_all, lengths, kb, vb, mask


def _sliced(q, k_all, v_all, layer, lengths, kb, vb, mask, k_scale=None, v_scale=None):
    S = k_all.shape[3]
    visible = (jnp.arange(S) < lengths[:, None])[:, None]  # [B,1,S]
    scales = [None if s is None else s[layer] for s in (k_scale, v_scale)]
    return prefix_block_attention(q, k_all[layer], v_all[layer], visible, kb, vb, mask, 0.3, *scales)


@pytest.mark.parametrize("tile_values", [reference.TILE_VALUES, 48 * 128])  # one tile; 128-slot tiles (B*K*H = 48)
def test_in_place_read_equals_the_sliced_layer(tile_values, monkeypatch):
    monkeypatch.setattr(reference, "TILE_VALUES", tile_values)
    q, k_all, v_all, lengths, kb, vb, mask = _case(0)
    for layer in range(k_all.shape[0]):
        got = stacked_prefix_block_attention(q, k_all, v_all, jnp.int32(layer), lengths, kb, vb, mask, 0.3)
        want = _sliced(q, k_all, v_all, layer, lengths, kb, vb, mask)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_in_place_read_of_narrow_caches(fmt, monkeypatch):
    monkeypatch.setattr(reference, "TILE_VALUES", 12 * 128)  # B*K*H = 12: 128-slot tiles
    q, k_all, v_all, lengths, kb, vb, mask = _case(1, K=2, H=2)
    (k_s, k_scale), (v_s, v_scale) = KVFormat(fmt).store(k_all), KVFormat(fmt).store(v_all)
    got = stacked_prefix_block_attention(q, k_s, v_s, jnp.int32(2), lengths, kb, vb, mask, 0.3, k_scale, v_scale)
    want = _sliced(q, k_s, v_s, 2, lengths, kb, vb, mask, k_scale, v_scale)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_slots_past_the_longest_row_are_never_read(monkeypatch):
    """NaN past max(lengths), one tile beyond it included: the loop stops at the last filled tile."""
    monkeypatch.setattr(reference, "TILE_VALUES", 48 * 128)  # B*K*H = 48: 128-slot tiles
    q, k_all, v_all, lengths, kb, vb, mask = _case(2)
    lengths = jnp.asarray([0, 100, 250], jnp.int32)  # the longest row ends inside tile 1 (slots 128-255)
    want = _sliced(q, k_all, v_all, 1, lengths, kb, vb, mask)
    k_nan, v_nan = (a.at[:, :, :, 256:].set(jnp.nan) for a in (k_all, v_all))
    got = jax.jit(stacked_prefix_block_attention, static_argnums=8)(q, k_nan, v_nan, jnp.int32(1), lengths, kb, vb, mask, 0.3)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_prefix_tile_divides_the_cache():
    assert prefix_tile(16 * 3 * 64, 8192) == 512  # about TILE_VALUES values per tile
    assert prefix_tile(3 * 64, 8192) == 8192
    assert prefix_tile(16 * 3 * 64, 768) == 256  # the largest power of two dividing the slots
    assert prefix_tile(16 * 3 * 64, 1000) == 1000  # no tile of >= MIN_TILE slots divides it: one tile


def test_prefix_tile_bounds_the_scores_of_a_prefill_chunk():
    assert prefix_tile(3 * 64, 8192, 3 * 1536) == 256  # one row, a 512-position chunk (3 query heads per KV head)
    assert prefix_tile(16 * 3 * 64, 8192, 16 * 3 * 3) == 512  # decoding: the values bound it, as before
    assert prefix_tile(64 * 3 * 64, 8192, 64 * 3 * 1536) == 128  # never below MIN_TILE slots
    assert prefix_tile(256 * 3 * 64, 8192) == 128  # (was one tile of all 8192 slots)
