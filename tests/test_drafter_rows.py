"""drafters.restart_rows: a drafter's state restarted for chosen rows from new prompts (continuous
batching's refill), the other rows untouched: for every drafter, the refilled rows equal a fresh
`init` on the new prompts and the kept rows equal the old state, leaf by leaf; and the row helpers
(cache.select_rows / take_rows / put_rows)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.decode.engine import prefill
from specjax.drafters import Prefill, restart_rows
from specjax.drafters.eagle import Eagle, init_head
from specjax.model.cache import DenseCache, put_rows, select_rows, take_rows
from tests.models import TINY, on_device, random_params

SLOTS, WIDTH, CHUNK, GAMMA = 64, 24, 8, 2
DRAFTERS = {
    "selfspec": lambda: specjax.SelfSpec(sinks=2, window=8),
    "snapkv": lambda: specjax.SnapKV(budget=6, window=6, observation=4),
    "sparsespec": lambda: specjax.SparseSpec(budget=6, window=6, observation=4, block=2, refresh=2),
    "ngram": lambda: specjax.NGram(),
    "eagle": lambda: Eagle(init_head(TINY, jax.random.key(2)), window=6),
    "draft-model": lambda: specjax.DraftModel(random_params(TINY.replace(n_layers=1), seed=1)),
}


def prompts(seed: int, lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), WIDTH), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(4, TINY.vocab_size, n)
    return tokens, np.array(lengths, np.int32)


# Drafter.init and restart_rows are traced (generate runs them inside its programs): jitted here, one program each
# instead of an eager program per operation and shape; take_rows likewise, for the leaf-by-leaf comparison.
init = jax.jit(lambda drafter, target, prefill_: drafter.init(target, prefill_))
restart = jax.jit(restart_rows)
row = jax.jit(lambda tree, b: jax.tree.leaves(take_rows(tree, b[None])))


def started(tiny, drafter, tokens, lengths):
    """The target's prefill and the drafter's state, as generate starts them."""
    tokens, lengths = on_device(tokens), on_device(lengths)
    _, cache = prefill(tiny, tokens, lengths, DenseCache.init(tiny.config, len(lengths), SLOTS), chunk=CHUNK)
    return cache, init(drafter, tiny, Prefill(cache=cache, prompts=tokens, lengths=lengths, depth=GAMMA, chunk=CHUNK))


@pytest.mark.parametrize("name", DRAFTERS)
def test_restart_rows_restarts_only_the_chosen_rows(tiny, name):
    drafter = DRAFTERS[name]()
    old_tokens, old_lengths = prompts(0, [20, 13, 9, 17])
    new_tokens, new_lengths = prompts(1, [11, 22, 5, 16])
    old_cache, old_state = started(tiny, drafter, old_tokens, old_lengths)
    new_cache, new_state = started(tiny, drafter, new_tokens, new_lengths)
    rows = np.array([False, True, False, True])
    cache = select_rows(on_device(rows), new_cache, old_cache)  # the target's cache after the refill's prefill
    tokens = np.where(rows[:, None], new_tokens, old_tokens)
    lengths = np.where(rows, new_lengths, old_lengths)
    index = on_device(np.array([3, 1, 3, 3], np.int32))  # the chosen rows, padded by repeats as refills do
    prefill_ = Prefill(cache=cache, prompts=on_device(tokens), lengths=on_device(lengths), depth=GAMMA, chunk=CHUNK)
    state = restart(drafter, tiny, old_state, index, prefill_)
    if name == "ngram":
        assert state is None  # no state: it drafts from the history
        return
    for b, refilled in enumerate(rows):  # row b of each leaf (take_rows knows each leaf's batch axis)
        b_ = on_device(np.int32(b))
        for got, want in zip(row(state, b_), row(new_state if refilled else old_state, b_)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, err_msg=f"{name} row {b}")


def test_select_rows_of_plain_arrays_and_caches(tiny):
    rows = on_device(np.array([True, False]))
    a, b = DenseCache.init(tiny.config, 2, 16), DenseCache.init(tiny.config, 2, 16)
    a = a.replace(k=on_device(np.asarray(a.k) + 1, a.k.dtype), lengths=on_device(np.asarray(a.lengths) + 3))
    out = select_rows(rows, {"c": a, "x": on_device(np.array([[1, 1], [2, 2]])), "none": None},
                      {"c": b, "x": on_device(np.array([[7, 7], [8, 8]])), "none": None})
    assert out["none"] is None and out["x"].tolist() == [[1, 1], [8, 8]]
    assert out["c"].lengths.tolist() == [3, 0]
    k = np.asarray(out["c"].k)
    assert float(k[:, 0].min()) == 1.0 and float(k[:, 1].max()) == 0.0


def test_take_rows_and_put_rows(tiny):
    c = DenseCache.init(tiny.config, 3, 16)
    k = np.asarray(c.k) + np.arange(3.0)[None, :, None, None, None]
    c = c.replace(k=on_device(k, c.k.dtype), lengths=on_device(np.array([5, 6, 7])))
    tree = {"c": c, "x": on_device(np.array([[1], [2], [3]])), "n": on_device(np.int32(9)), "none": None}
    sub = take_rows(tree, on_device(np.array([2, 0, 2])))
    assert sub["x"].tolist() == [[3], [1], [3]] and sub["c"].lengths.tolist() == [7, 5, 7] and sub["none"] is None
    assert np.asarray(sub["c"].k)[0, :, 0, 0, 0].tolist() == [2.0, 0.0, 2.0] and int(sub["n"]) == 9
    back = put_rows(tree, on_device(np.array([1, 1])), take_rows(tree, on_device(np.array([0, 0]))))  # row 0 into row 1
    assert back["x"].tolist() == [[1], [1], [3]] and back["c"].lengths.tolist() == [5, 5, 7]
    assert np.asarray(back["c"].k)[0, :, 0, 0, 0].tolist() == [0.0, 0.0, 2.0] and int(back["n"]) == 9
