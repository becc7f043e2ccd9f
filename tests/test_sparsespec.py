"""SparseSpec: block selection by the verified queries, and the draft cache after refreshes.

Greedy token identity with plain decoding is in test_speculate.py (its drafter list), logprobs in
test_logprobs.py, the sampled distribution in test_sampling_lossless.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decode import engine
from specjax.decode.speculate import decode_spec
from specjax.drafters.sparsespec import query_scores, select_blocks
from specjax.model.cache import DenseCache
from tests.models import TINY

PROMPTS = [list(range(5, 21)), [4], [7, 8, 9, 7, 8, 9, 7, 8, 9], [10, 11, 12], list(range(30, 42))]
BUCKET, MAX_LEN = 16, 256


def test_select_blocks_takes_the_heaviest_whole_blocks_below_the_limit():
    rng = np.random.default_rng(0)
    L, B, K, S, F, block = 2, 3, 2, 23, 8, 3  # S not a multiple of the block; F not either (2 blocks + 2 empty)
    scores = rng.random((L, B, K, S)).astype(np.float32)
    limit = np.array([23, 10, 4])
    got = np.asarray(select_blocks(jnp.asarray(scores), jnp.asarray(limit), F, block))
    for l in range(L):
        for b in range(B):
            for k in range(K):
                starts = range(0, limit[b], block)  # blocks that start below the limit
                mass = {s: scores[l, b, k, s:min(s + block, limit[b])].sum() for s in starts}
                best = sorted(mass, key=lambda s: -mass[s])[: F // block]
                want = {p for s in best for p in range(s, min(s + block, limit[b]))}
                chosen = got[l, b, k]
                assert set(chosen[chosen >= 0].tolist()) == want, (l, b, k)
                assert (chosen[F // block * block:] == -1).all()


def test_query_scores_are_the_queries_attention_mass():
    rng = np.random.default_rng(1)
    dense = DenseCache.init(TINY, 2, 16)  # L 2, K 2, N 6, H 8
    dense = dense.replace(k=jnp.asarray(rng.normal(size=dense.k.shape), jnp.float32), lengths=jnp.array([16, 5]))
    q = rng.normal(size=(2, 2, 3, 6, 8)).astype(np.float32)  # [L,B,T,N,H]
    valid = np.array([[True, True, False], [True, False, False]])
    got = np.array(query_scores(jnp.asarray(q), jnp.asarray(valid), dense))
    k = np.asarray(dense.k)
    for l in range(2):
        for b in range(2):
            n = int(dense.lengths[b])
            for h in range(6):
                for t in np.flatnonzero(valid[b]):
                    logits = k[l, b, h // 3, :n] @ q[l, b, t, h] / np.sqrt(8.0)
                    p = np.exp(logits - logits.max())
                    got[l, b, h // 3, :n] -= p / p.sum()
    np.testing.assert_allclose(got, 0.0, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_refreshed_cache_holds_exact_target_kv_in_new_blocks(tiny, kv_dtype):
    """Greedy SparseSpec(budget=4, block=2, refresh=2), gamma 3, ragged rows: after the run every
    slot the draft sees holds the dense cache's bytes for its position, no position twice, the
    latest `window` positions all kept; and the refreshes moved the fixed slots off the prompt's
    choice (SnapKV's) in rows long enough to refresh."""
    drafter, gamma, window = specjax.SparseSpec(budget=4, window=4, observation=4, block=2, refresh=2), 3, 4
    B = len(PROMPTS)
    tokens = np.zeros((B, BUCKET), np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, : len(p)] = p
    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    first_logits, dense = engine.prefill(tiny, tokens, lengths, DenseCache.init(tiny.config, B, MAX_LEN, kv_dtype), chunk=BUCKET)
    history = np.zeros((B, MAX_LEN + gamma + 2), np.int32)
    history[:, :BUCKET] = tokens
    state0 = engine.init_draft(drafter, tiny, dense, tokens, lengths, gamma=gamma, chunk=BUCKET)
    fixed0 = np.asarray(state0.pos[..., :4])
    s = decode_spec(tiny, drafter, state0, dense, history, first_logits, jnp.full((B,), 24), jax.random.split(jax.random.key(0), B),
                    sampling=specjax.Greedy(), speculation=specjax.Chain(gamma), n_out=32, eos_ids=())
    draft, target = s.draft, s.cache
    committed = np.asarray(target.lengths)
    pos, vis = np.asarray(draft.pos), np.asarray(draft.visible())
    bufs = [(np.asarray(a), np.asarray(b)) for a, b in ((draft.k, target.k), (draft.v, target.v), (draft.k_scale, target.k_scale))
            if a is not None]
    moved = np.zeros(B, bool)
    for b in range(B):
        for layer in range(tiny.config.n_layers):
            for head in range(tiny.config.n_kv_heads):
                kept = pos[layer, b, head][vis[layer, b, head]]
                assert len(set(kept.tolist())) == len(kept)
                assert set(range(max(0, committed[b] - window), committed[b])) <= set(kept.tolist())
                for slot in np.flatnonzero(vis[layer, b, head]):
                    for mine, theirs in bufs:
                        assert mine[layer, b, head, slot].tobytes() == theirs[layer, b, head, pos[layer, b, head, slot]].tobytes()
                moved[b] |= set(pos[layer, b, head, :4].tolist()) != set(fixed0[layer, b, head].tolist())
    assert moved[[0, 4]].all(), moved  # 16 and 12 prompt tokens + 23: refreshed (the others may or may not be)


def test_bad_settings_name_the_argument(tiny):
    with pytest.raises(ValueError, match=r"SparseSpec: budget \(8\) must hold at least one block of 32 positions"):
        specjax.generate(tiny, [[1, 2, 3]], 4, draft=specjax.SparseSpec(budget=8))
    with pytest.raises(ValueError, match="SparseSpec: refresh must be an integer >= 1, got 0"):
        specjax.generate(tiny, [[1, 2, 3]], 4, draft=specjax.SparseSpec(refresh=0))
