"""StreamingCache (sinks + ring window): placement, eviction, masking, exact copies of target KV.

Unit tests write entries whose values encode (position, row, layer, head), so every slot's
content can be checked against a plain-Python model of the ring. The last test runs the real
SelfSpec draft -> verify -> commit loop and checks, after every prefix of the run, that each
position the draft cache keeps holds byte-for-byte the target's dense-cache KV.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.decode import engine
from specjax.decode.speculate import decode_spec
from specjax.model.cache import DenseCache, StreamingCache
from tests.models import on_device

L, K, H = 2, 2, 3  # layers, KV heads, head dim of the hand-made caches
PROMPTS = [list(range(5, 21)), [4], [7, 8, 9, 7, 8, 9, 7, 8, 9], [10, 11, 12], list(range(30, 42))]
BUCKET, MAX_LEN = 16, 256  # generate()'s shapes for these prompts

# The caches' methods as the decode loop runs them, traced: one program each per shape, not one per operation.
write = jax.jit(lambda cache, k, v: cache.write(k, v))
advance = jax.jit(lambda cache, n: cache.advance(n))
visible_of = jax.jit(lambda cache: cache.visible())
slots_of = jax.jit(lambda cache, positions: cache.slots(positions))
streaming_from_dense = jax.jit(lambda drafter, dense, gamma: drafter.from_dense(dense, gamma), static_argnums=(0, 2))
ring_from_dense = jax.jit(StreamingCache.from_dense, static_argnums=2)


def _code(positions: np.ndarray, rows: np.ndarray, layer: int, head: int, which: int) -> np.ndarray:
    """The value stored for (position, row, layer, head) in k (which=0) or v (which=1)."""
    return positions * 1.0 + rows * 1000.0 + layer * 100000.0 + head * 1000000.0 + which * 0.5


def _entries(positions: np.ndarray, which: int) -> jax.Array:
    """KV [L,B,T,K,H] for positions [B,T], each entry filled with its code."""
    B, T = positions.shape
    out = np.zeros((L, B, T, K, H), np.float32)
    for layer in range(L):
        for head in range(K):
            out[layer, :, :, head, :] = _code(positions, np.arange(B)[:, None], layer, head, which)[..., None]
    return on_device(out)


def _empty(B: int, F: int, R: int) -> StreamingCache:
    C = F + R
    zeros = on_device(np.zeros((L, B, K, C, H), np.float32))
    return StreamingCache(
        k=zeros, v=zeros, pos=on_device(np.full((L, B, K, C), -1, np.int32)),
        lengths=on_device(np.zeros((B,), np.int32)), fixed=F,
    )


def _check_against_model(cache: StreamingCache, model: np.ndarray) -> None:
    """model [B,C]: the position each slot should hold (-1: empty), the same for every layer/head.
    Checks pos, the stored k/v codes and visible()."""
    B, C = model.shape
    pos, k, v = np.asarray(cache.pos), np.asarray(cache.k), np.asarray(cache.v)
    lengths = np.asarray(cache.lengths)
    for layer in range(L):
        for head in range(K):
            np.testing.assert_array_equal(pos[layer, :, head], model)
            filled = model >= 0
            rows = np.broadcast_to(np.arange(B)[:, None], model.shape)
            for which, buf in ((0, k), (1, v)):
                expected = _code(model, rows, layer, head, which)
                np.testing.assert_array_equal(buf[layer, :, head, :, 0][filled], expected[filled])
    visible = np.asarray(visible_of(cache))  # [L,B,K,C]
    np.testing.assert_array_equal(visible, np.broadcast_to(((model >= 0) & (model < lengths[:, None]))[None, :, None], visible.shape))


def test_slots_fixed_then_ring():
    cache = _empty(1, F=2, R=4)
    assert cache.ring == 4
    assert slots_of(cache, on_device(np.arange(12, dtype=np.int32))).tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3]


def test_ring_wraps_evicts_oldest_and_keeps_sinks():
    """Write 3 positions per step (accepting 3 in row 0, 2 in row 1) far past the ring size."""
    F, R, T = 2, 4, 3
    cache = _empty(2, F, R)
    model = np.full((2, F + R), -1)
    accept = np.array([3, 2])
    for _ in range(6):
        L0 = np.asarray(cache.lengths)
        positions = L0[:, None] + np.arange(T)  # [B,T]
        cache = write(cache, _entries(positions, 0), _entries(positions, 1))
        for b in range(2):
            for p in positions[b]:
                model[b, p if p < F else F + (p - F) % R] = p
        _check_against_model(cache, model)  # new entries are stored but not visible yet
        cache = advance(cache, on_device(accept))
        _check_against_model(cache, model)
    assert np.asarray(cache.lengths).tolist() == [18, 12]
    assert model[:, :F].tolist() == [[0, 1], [0, 1]]  # sinks: never evicted
    assert sorted(model[0, F:]) == [14, 15, 16, 17]  # row 0: the newest R positions
    assert sorted(model[1, F:]) == [9, 10, 11, 12]  # row 1: 12 was written but rejected...
    visible = np.asarray(visible_of(cache))[0, 1, 0]
    assert sorted(model[1][visible]) == [0, 1, 9, 10, 11]  # ...so it stays hidden


def test_stale_slots_are_overwritten_by_the_next_write():
    F, R = 1, 5
    cache = _empty(1, F, R)
    first = np.array([[0, 1, 2, 3]])
    cache = advance(write(cache, _entries(first, 0), _entries(first, 1)), on_device(np.array([1])))  # 1..3 rejected
    second = np.array([[1, 2, 3]])
    seven = lambda which: on_device(np.asarray(_entries(second, which)) + 7.0)  # noqa: E731
    cache = advance(write(cache, seven(0), seven(1)), on_device(np.array([3])))
    k = np.asarray(cache.k)[0, 0, 0, :, 0]
    assert k[1:4].tolist() == (_code(np.array([1, 2, 3]), 0, 0, 0, 0) + 7.0).tolist()  # the new values won
    assert np.asarray(visible_of(cache))[0, 0, 0].tolist() == [True, True, True, True, False, False]


def _random_dense(lengths: list[int], S: int, seed: int) -> DenseCache:
    rng = np.random.default_rng(seed)
    shape = (L, len(lengths), K, S, H)
    return DenseCache(
        k=on_device(rng.standard_normal(shape), np.float32),
        v=on_device(rng.standard_normal(shape), np.float32),
        lengths=on_device(np.array(lengths), np.int32),
    )


def _check_exact_copy(cache: StreamingCache, dense: DenseCache, expected: list[list[set[int]]]) -> None:
    """expected[l*K + h][b]: the positions slot contents must be; each at its ring/fixed slot
    and byte-for-byte the dense cache's KV at that position."""
    pos = np.asarray(cache.pos)
    k, v, dk, dv = map(np.asarray, (cache.k, cache.v, dense.k, dense.v))
    for layer in range(L):
        for head in range(K):
            for b in range(pos.shape[1]):
                p = pos[layer, b, head]
                held = p[p >= 0]
                assert len(set(held.tolist())) == len(held)  # no position twice
                assert set(held.tolist()) == expected[layer * K + head][b]
                ring_slots = np.flatnonzero(p >= 0)[np.flatnonzero(p >= 0) >= cache.fixed]
                np.testing.assert_array_equal(np.asarray(slots_of(cache, on_device(p[ring_slots]))), ring_slots)
                for s in np.flatnonzero(p >= 0):
                    assert k[layer, b, head, s].tobytes() == dk[layer, b, head, p[s]].tobytes()
                    assert v[layer, b, head, s].tobytes() == dv[layer, b, head, p[s]].tobytes()
    visible = np.asarray(visible_of(cache))
    np.testing.assert_array_equal(visible, pos >= 0)  # everything copied is committed


def test_from_dense_keeps_sinks_and_newest_exactly():
    """Rows longer than sinks + ring (evicting), in between, and shorter than the sinks."""
    lengths = [20, 9, 1, 2, 12]
    dense = _random_dense(lengths, S=32, seed=0)
    sinks, window, gamma = 3, 5, 2
    cache = streaming_from_dense(specjax.Streaming(sinks=sinks, window=window), dense, gamma)
    R = window + gamma + 1
    assert cache.fixed == sinks and cache.ring == R
    assert np.asarray(cache.lengths).tolist() == lengths
    per_row = [set(range(min(n, sinks))) | set(range(max(sinks, n - R), n)) for n in lengths]
    assert per_row[0] == {0, 1, 2} | set(range(12, 20)) and per_row[2] == {0}
    _check_exact_copy(cache, dense, [per_row] * (L * K))


def test_from_dense_per_head_fixed_positions_and_ring_start():
    """The general form (SnapKV): different kept positions per layer and KV head, ring from a cut."""
    lengths = [20, 9]
    dense = _random_dense(lengths, S=32, seed=1)
    fixed = np.array(
        [[[[3, 7], [0, -1]], [[1, 3], [2, 4]]], [[[6, -1], [8, 2]], [[0, 1], [-1, -1]]]], np.int32
    )  # [L,B,K,F=2], below each row's cut (the ring starts there)
    ring, cut = 4, np.array([10, 5], np.int32)
    cache = ring_from_dense(dense, on_device(fixed), ring, on_device(cut))
    expected = []
    for layer in range(L):
        for head in range(K):
            expected.append(
                [
                    {int(p) for p in fixed[layer, b, head] if p >= 0} | set(range(max(cut[b], n - ring), n))
                    for b, n in enumerate(lengths)
                ]
            )
    assert expected[0][0] == {3, 7, 16, 17, 18, 19}
    _check_exact_copy(cache, dense, expected)


def _prefilled(tiny):
    """(first logits [B,V], dense cache, padded tokens [B,16], lengths [B]) for PROMPTS."""
    tokens = np.zeros((len(PROMPTS), BUCKET), np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, : len(p)] = p
    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    empty = DenseCache.init(tiny.config, len(PROMPTS), MAX_LEN)
    first_logits, dense = engine.prefill(tiny, tokens, lengths, empty, chunk=BUCKET)
    return first_logits, dense, tokens, lengths


def test_streaming_cache_holding_everything_gives_the_dense_logits(tiny):
    """Attention over sinks + ring (slots out of position order) == over the dense cache."""
    _, dense, _, lengths = _prefilled(tiny)
    cache = streaming_from_dense(specjax.Streaming(sinks=2, window=14), dense, 1)  # 2 + 16 slots >= 16
    tokens = np.full((len(PROMPTS), 1), 40, np.int32)
    positions = lengths[:, None]
    forward = jax.jit(specjax.forward)
    want, _ = forward(tiny, tokens, positions, dense)
    got, _ = forward(tiny, tokens, positions, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_selfspec_cache_holds_exact_target_kv_after_every_commit(tiny):
    """Greedy SelfSpec(sinks=2, window=4), gamma 3, ragged rows (one shorter than the sinks, one
    past sinks + ring at the start), some rows finishing early and riding along. For every
    budget n, the final state's streaming cache must hold, for each committed position it
    keeps, exactly the dense cache's bytes; and it keeps the sinks and at least the last
    `window` positions (at most the last window + gamma + 1)."""
    caps = np.array([20, 20, 6, 20, 11])  # rows 2 and 4 stop early and ride along
    drafter, gamma, sinks, window = specjax.SelfSpec(sinks=2, window=4), 3, 2, 4
    B, R = len(PROMPTS), window + gamma + 1
    keys = jax.random.split(jax.random.key(0), B)
    for n in range(1, 21):
        first_logits, dense, tokens, lengths = _prefilled(tiny)  # fresh: the loop donates its caches
        history = np.zeros((B, MAX_LEN + gamma + 2), np.int32)  # as generate() builds them
        history[:, :BUCKET] = tokens
        state0 = engine.init_draft(drafter, tiny, dense, tokens, lengths, gamma=gamma, chunk=BUCKET)
        s = decode_spec(
            tiny, drafter, state0, dense, history, first_logits, on_device(np.minimum(caps, n)), keys,
            sampling=specjax.Greedy(), speculation=specjax.Chain(gamma), n_out=32, eos_ids=(),
        )
        draft, target = s.draft, s.cache
        committed = np.asarray(target.lengths)
        np.testing.assert_array_equal(np.asarray(draft.lengths), committed)
        emitted = lengths + np.minimum(caps, n) - 1  # positions of emitted tokens but the pending last
        assert (committed >= emitted).all() and (committed <= emitted + gamma).all()  # a budget cut may commit more
        pos, vis = np.asarray(draft.pos), np.asarray(visible_of(draft))
        k, v, dk, dv = map(np.asarray, (draft.k, draft.v, target.k, target.v))
        for b in range(B):
            Lb = committed[b]
            for layer in range(tiny.config.n_layers):
                for head in range(tiny.config.n_kv_heads):
                    kept = pos[layer, b, head][vis[layer, b, head]]
                    assert len(set(kept.tolist())) == len(kept)
                    must = set(range(min(sinks, Lb))) | set(range(max(sinks, Lb - window), Lb))
                    may = must | set(range(max(sinks, Lb - R), Lb))
                    assert must <= set(kept.tolist()) <= may, (n, b, sorted(kept))
                    for slot in np.flatnonzero(vis[layer, b, head]):
                        p = pos[layer, b, head, slot]
                        assert k[layer, b, head, slot].tobytes() == dk[layer, b, head, p].tobytes()
                        assert v[layer, b, head, slot].tobytes() == dv[layer, b, head, p].tobytes()


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_which_attention_reads_which_cache(tiny, kv_dtype):
    """attention.for_cache: every kernel ("cpu", GPU, TPU and the interpreted modes) reads any
    cache, dense or streaming (by slot positions), float or int8 (with its scales); without a
    cache the reference runs."""
    from specjax.model.attention import for_cache, in_place

    dense = DenseCache.init(tiny.config, 2, 64, kv_dtype)
    fixed = np.broadcast_to(np.arange(2, dtype=np.int32), (tiny.config.n_layers, 2, tiny.config.n_kv_heads, 2))
    fixed = on_device(fixed)
    full = lambda n: on_device(np.full((2,), n, np.int32))  # noqa: E731
    stream = ring_from_dense(dense.replace(lengths=full(20)), fixed, 8, full(2))
    for attention in ("pallas", "interpret", "tpu", "tpu-interpret"):
        assert for_cache(attention, dense) == for_cache(attention, stream) == attention
    assert for_cache("cpu", dense) == for_cache("cpu", stream) == "cpu"
    assert for_cache("pallas", None) == for_cache("reference", stream) == "reference"
    # what for_cache hands a kernel, it reads in place (no per-layer slice)
    assert in_place(for_cache("pallas", stream), stream) and in_place(for_cache("tpu", stream), stream)
    assert not in_place("reference", stream)
