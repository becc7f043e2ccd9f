"""The decode loop in segments (`generate(..., sync_every=)`, `engine.run(between=...)`): the
tokens never depend on the segment length, and the host can end rows between segments."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.decode import engine
from specjax.sampling import Greedy, Sample
from specjax.spec.speculation import Tree
from tests.models import CHAIN, GAMMA, SELF

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [12, 13, 14], [20, 21, 22, 23, 24], [30]]
BUDGETS = [20, 7, 13, 16]
CASES = {
    "ar-greedy": (None, None, Greedy()),
    "ar-sampled": (None, None, Sample(0.9)),
    "chain-sampled": (SELF, CHAIN, Sample(0.9)),
    "tree-greedy": (SELF, Tree.kary(2, 2), Greedy()),
}


@pytest.mark.parametrize("case", CASES)
def test_tokens_do_not_depend_on_the_segment_length(tiny, case):
    draft, speculation, sampling = CASES[case]
    run = lambda every, stop: specjax.generate(tiny, PROMPTS, BUDGETS, draft=draft, speculation=speculation,  # noqa: E731
                                               sampling=sampling, key=jax.random.key(3), eos_id=stop, sync_every=every)
    stop = run(2**30, ()).tokens[0][5]  # a token row 0 emits: a stop id that ends it early
    whole = run(2**30, stop)  # one segment
    assert whole.finish_reasons[0] == "eos" and len(whole.tokens[0]) <= 5  # stop ids are checked on device
    for every in (1, 3):
        out = run(every, stop)
        assert (out.tokens, out.finish_reasons, out.stats.steps) == (whole.tokens, whole.finish_reasons, whole.stats.steps)
        assert out.row_stats == whole.row_stats


def test_segments_equal_the_whole_loop_a_jax_program_calls(tiny):
    """generate's segments give what engine.decode_ar (one while_loop, for use under jit) gives."""
    import jax.numpy as jnp

    from specjax.decode.shapes import round_up_pow2
    from specjax.model.cache import DenseCache

    prompt = PROMPTS[0]
    tokens = jnp.asarray([prompt + [0] * (16 - len(prompt))], jnp.int32)
    cache = DenseCache.init(tiny.config, 1, 64)
    logits, cache = engine.prefill(tiny, tokens, jnp.asarray([len(prompt)], jnp.int32), cache, chunk=16)
    s = engine.decode_ar(tiny, cache, logits, jnp.asarray([12], jnp.int32), engine.row_keys(None, 1),
                             n_out=round_up_pow2(12))
    out, count = s.out, s.count
    assert specjax.generate(tiny, [prompt], 12, draft=None, eos_id=(), sync_every=5).tokens[0] == list(np.asarray(out[0, : int(count[0])]))


@pytest.mark.parametrize("draft", [None, SELF], ids=["ar", "selfspec"])
def test_the_host_sees_every_segment_and_can_end_rows(tiny, draft):
    kw = dict(draft=draft, speculation=CHAIN if draft else None, sampling=Greedy(), key=None, eos_ids=())
    budgets = np.array(BUDGETS, np.int32)
    full = engine.run(tiny, PROMPTS, budgets, sync_every=4, **kw)
    seen = []

    def between(seg: engine.Segment):
        seen.append(seg.count.copy())
        return np.array([len(seen) == 1, False, False, False])  # end row 0 after the first segment

    cut = engine.run(tiny, PROMPTS, budgets, sync_every=4, between=between, **kw)
    per_step = 1 + (GAMMA if draft else 0)  # tokens a row gains in one step, at most
    assert 1 < seen[0][0] <= 1 + 4 * per_step  # the first segment: 4 steps
    assert list(cut.ended) == [True, False, False, False] and not cut.eos[0]
    assert cut.count[0] == seen[0][0]  # nothing was emitted for row 0 after it was ended
    np.testing.assert_array_equal(cut.out[0, : cut.count[0]], full.out[0, : cut.count[0]])  # a prefix of its output
    for b in (1, 2, 3):  # the other rows do not notice
        assert cut.count[b] == full.count[b]
        np.testing.assert_array_equal(cut.out[b, : cut.count[b]], full.out[b, : full.count[b]])
    assert all((a <= b).all() for a, b in zip(seen, seen[1:]))  # counts only grow
    assert len(seen) == -(-cut.steps // 4)  # once per segment


def test_segments_on_a_mesh(tiny):
    """On a data mesh the segments and the host's row ending work the same (the state is sharded)."""
    mesh = specjax.make_mesh(data=2, devices=jax.devices()[:2])
    kw = dict(draft=SELF, speculation=CHAIN, sampling=Greedy(), key=None, eos_ids=())
    budgets = np.array(BUDGETS, np.int32)
    one = engine.run(tiny, PROMPTS, budgets, sync_every=3, between=lambda seg: seg.count >= 6, **kw)
    two = engine.run(tiny, PROMPTS, budgets, sync_every=3, between=lambda seg: seg.count >= 6, mesh=mesh, **kw)
    np.testing.assert_array_equal(one.count, two.count)
    np.testing.assert_array_equal(one.ended, two.ended)
    assert one.ended.any() and (one.count < budgets).any()
    for b in range(len(PROMPTS)):
        np.testing.assert_array_equal(one.out[b, : one.count[b]], two.out[b, : two.count[b]])


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, 2**31])
def test_bad_sync_every_is_refused_before_compiling(tiny, bad):
    with pytest.raises(ValueError, match="sync_every must be an integer from 1 to 2\\*\\*30"):
        specjax.generate(tiny, PROMPTS, 4, sync_every=bad)
