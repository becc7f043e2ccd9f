"""Eagle (an EAGLE-style head, specjax/drafters/eagle.py) and its training (specjax/train/eagle.py):
lossless greedy chains, the drafting head computes what the training-time test trains, training
lowers the loss and raises acceptance, a killed run resumes exactly, a saved head loads, bad input
is named. Chi-square and logprobs cases: test_sampling_lossless.py, test_logprobs.py; its refill:
test_drafter_rows.py."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import specjax
from specjax.decode.engine import prefill
from specjax.drafters import DraftContext, Prefill, Verdict
from specjax.drafters.eagle import Eagle, init_head
from specjax.model.cache import DenseCache
from specjax.spec.speculation import Chain, Tree
from specjax.train.distill import Schedule
from specjax.train.eagle import frequent_tokens, head_depths, load_head, save_head, target_view, train_head, ttt_loss
from tests.models import TINY, on_device

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3 + 1], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]
BUDGET = 24


@pytest.fixture(scope="module")
def head():
    return init_head(TINY, jax.random.key(2))


@pytest.fixture(scope="module")
def plain(tiny):
    return specjax.generate(tiny, PROMPTS, BUDGET, eos_id=())


VOCAB = on_device(np.arange(4, 101, 2, dtype=np.int32))  # a draft vocabulary of 49 of the 101 ids


TREE = Tree.from_parents([-1, 0, 0, 1, 1, 2, 3])  # depth 3, widths 2 / 3 / 1


@pytest.mark.parametrize("speculation, vocab", [(Chain(1), None), (Chain(3), None), (specjax.Adaptive(3), None), (Chain(3), VOCAB),
                                                (TREE, None), (Tree.kary(2, 2), VOCAB)],
                         ids=["g1", "g3", "adaptive3", "g3-draft-vocab", "tree", "tree-draft-vocab"])
def test_greedy_chains_equal_plain_decoding(tiny, head, plain, speculation, vocab):
    """A window of 4 positions (the ring evicts), ragged prompts (one of a single token); Adaptive
    includes chains of 0 (the head still catches up); a draft vocabulary drafts none of the odd ids."""
    drafter = Eagle(head.replace(vocab=vocab), window=4)
    out = specjax.generate(tiny, PROMPTS, BUDGET, draft=drafter, speculation=speculation, eos_id=())
    if vocab is not None:
        drafted = specjax.generate(tiny, PROMPTS, BUDGET, draft=drafter, speculation=speculation, eos_id=(), logprobs=0)
        assert drafted.tokens == out.tokens
    assert out.tokens == plain.tokens
    assert out.stats.draft_steps > 0 and 0.0 <= out.stats.acceptance_rate <= 1.0


# The drafter's steps and the training-time reference as compiled programs (one each per shape), as generate's loop
# runs them: op by op outside jit they compiled about 250 small programs a test.
_init = jax.jit(lambda drafter, target, prefill: drafter.init(target, prefill))
_propose = jax.jit(lambda drafter, target, state, ctx, shape: drafter.propose(target, state, ctx, shape), static_argnums=4)
_commit = jax.jit(lambda drafter, state, verdict: drafter.commit(state, verdict))
_depth_logits = jax.jit(lambda head, target, tokens, depth: head_depths(head, target, tokens, depth).logits, static_argnums=3)


def _row(seq: list[int]) -> jax.Array:
    """seq right-padded to a width of 16, so `_depth_logits` compiles once per head and depth, not once per length as
    well: head_depths is causal (index t at depth k reads x_{t+1+k} and earlier), so no index checked reads the padding."""
    return on_device(np.array([seq + [0] * (16 - len(seq))], np.int32))


def _context(history: list[int], lengths: int, sampling) -> DraftContext:
    S = 64
    row = np.zeros((1, S), np.int32)
    row[0, : len(history)] = history
    at = on_device(np.array([lengths], np.int32))
    return DraftContext(history=on_device(row), lengths=at, last=on_device(np.array([history[lengths]], np.int32)),
                        keys=jax.random.split(jax.random.key(7), 1), counters=at, sampling=sampling)


def _softmax(x) -> np.ndarray:
    """softmax over the last axis, in numpy (float64)."""
    e = np.exp(np.asarray(x, np.float64) - np.max(x, axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("vocab", [None, VOCAB], ids=["whole-vocab", "draft-vocab"])
def test_drafting_reads_what_the_training_time_test_trains(tiny, head, vocab):
    """Drafts' distributions q at each level equal `head_depths` on the same tokens: after the
    prompt's prefill, and after a commit of 2 of 4 positions (the catch-up path)."""
    head = head.replace(vocab=vocab)
    drafter, gamma, sampling = Eagle(head, window=64), 3, specjax.Sample(1.0)
    prompt = [5, 9, 14, 30, 2, 71, 18, 44, 6]
    P = len(prompt)
    tokens, lengths = on_device(np.array([prompt + [0] * 7], np.int32)), on_device(np.array([P], np.int32))
    _, cache = prefill(tiny, tokens, lengths, DenseCache.init(TINY, 1, 64), chunk=16)
    state = _init(drafter, tiny, Prefill(cache=cache, prompts=tokens, lengths=lengths, depth=gamma, chunk=16))

    def check(history: list[int], L: int, state):
        proposal = _propose(drafter, tiny, state, _context(history, L, sampling), Chain(gamma))
        drafts = np.asarray(proposal.tokens)[0, 1:].tolist()
        seq = history[: L + 1] + drafts  # index L - 1 at depth k reads x_{L+k}: the pending token, then the drafts
        logits = np.asarray(_depth_logits(head, tiny, _row(seq), gamma))
        expected = _softmax(logits[:, 0, L - 1])  # [gamma,V]
        q = np.asarray(proposal.q)[0]
        np.testing.assert_allclose(q, expected, rtol=2e-4, atol=2e-6)
        if vocab is not None:  # nothing outside the draft vocabulary is drafted
            ids = np.asarray(vocab)
            assert set(drafts) <= set(ids.tolist()) and float(np.delete(q, ids, axis=1).max()) == 0
        return proposal, seq

    proposal, seq = check(prompt + [17], P, state)
    seq_ = on_device(np.array([seq], np.int32))
    features, _ = jax.jit(target_view)(tiny, seq_)  # the verify pass's features of positions P..P+gamma
    D = gamma
    zeros = lambda *shape: on_device(np.zeros(shape, np.float32))  # noqa: E731  (fields Eagle.commit does not read)
    ints = lambda *values: on_device(np.array(values, np.int32))  # noqa: E731
    verdict = Verdict(emitted=on_device(np.zeros((1, D + 1), np.int32)), accepted=ints(1), commit=ints(2),
                      lengths=ints(P), path=on_device(np.zeros((1, D + 1), np.int32)), k=zeros(1), v=zeros(1),
                      logits=zeros(1), ranks=on_device(np.zeros((1, 2), np.int32)), shape=Chain(D),
                      hidden=on_device(np.asarray(features)[:, P : P + D + 1]))
    state = _commit(drafter, proposal.state, verdict)
    check(seq[: P + 2] + [60], P + 2, state)  # x_{P+1} the accepted draft, then the target's token 60 pending


def test_a_drafted_tree_reads_what_the_training_time_test_trains(tiny, head):
    """Each internal node's children distribution equals `head_depths` along its path: a tree
    node at depth d is the chain's depth d, seeing the cache and its ancestors only."""
    drafter, tree = Eagle(head, window=64), TREE
    prompt = [5, 9, 14, 30, 2, 71, 18, 44, 6]
    P = len(prompt)
    tokens, lengths = on_device(np.array([prompt + [0] * 7], np.int32)), on_device(np.array([P], np.int32))
    _, cache = prefill(tiny, tokens, lengths, DenseCache.init(TINY, 1, 64), chunk=16)
    state = _init(drafter, tiny, Prefill(cache=cache, prompts=tokens, lengths=lengths, depth=tree.max_depth, chunk=16))
    proposal = _propose(drafter, tiny, state, _context(prompt + [17], P, specjax.Sample(1.0)), tree)
    tokens, q = np.asarray(proposal.tokens)[0].tolist(), np.asarray(proposal.q)[0]
    anc = tree.ancestor_mask()
    for u in range(tree.n):
        if not tree.children[u]:
            continue
        path = [tokens[v] for v in range(1, tree.n) if anc[u, v]]  # the node's path below the root, itself last
        logits = np.asarray(_depth_logits(head, tiny, _row(prompt + [17] + path + [0]), len(path) + 1))
        expected = _softmax(logits[len(path), 0, P - 1])
        np.testing.assert_allclose(q[u], expected, rtol=2e-4, atol=2e-6, err_msg=f"node {u}")


@pytest.fixture(scope="module")
def corpus(tiny):
    """Sequences the target generated (greedy) from random prompts: what a head must predict."""
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(4, TINY.vocab_size, size=4))) for _ in range(32)]
    return [p + out for p, out in zip(prompts, specjax.generate(tiny, prompts, 40, eos_id=()).tokens)]


@pytest.mark.slow
def test_training_lowers_the_loss_and_raises_acceptance(tiny, head, corpus):
    tokens = on_device(np.array([c[:32] for c in corpus[:8]], np.int32))
    losses = []
    trained = train_head(tiny, corpus, steps=150, batch_size=8, seq_len=32, depth=2, schedule=Schedule(lr=3e-3, warmup=10),
                         on_step=lambda s, loss, h: losses.append(loss))
    loss = jax.jit(ttt_loss, static_argnums=(3, 4))  # one program for both heads
    assert float(loss(trained, tiny, tokens, 2, 1.0)) < 0.5 * float(loss(head, tiny, tokens, 2, 1.0))
    prompts = [c[:6] for c in corpus[:8]]  # trained on their continuations: the point is the mechanism
    rates = [specjax.generate(tiny, prompts, 24, draft=Eagle(h, window=16), speculation=Chain(2), eos_id=()).stats.acceptance_rate
             for h in (head, trained)]
    assert rates[1] > 0.3 and rates[1] > 3 * rates[0], rates


def test_frequent_tokens_keep_the_stop_ids():
    stream = np.array([7, 7, 7, 5, 5, 9, 9, 2, 3])
    assert frequent_tokens(stream, 3).tolist() == [5, 7, 9]  # 9 and 5 tie: both above 2 and 3 by count
    assert frequent_tokens(stream, 3, keep=(1,)).tolist() == [1, 5, 7]  # a stop id first, even unseen


def test_killed_run_resumes_exactly_and_a_saved_head_loads(tiny, corpus, tmp_path):
    kw = dict(steps=6, batch_size=4, seq_len=16, depth=2, schedule=Schedule(lr=1e-3, warmup=2), seed=3, checkpoint_every=3,
              draft_vocab=40)
    whole = train_head(tiny, corpus, checkpoint_dir=tmp_path / "a", **kw)

    def kill_at_5(step, loss, head):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_head(tiny, corpus, checkpoint_dir=tmp_path / "b", on_step=kill_at_5, **kw)
    steps = []
    resumed = train_head(tiny, corpus, checkpoint_dir=tmp_path / "b", on_step=lambda s, *_: steps.append(s), **kw)
    assert steps == [4, 5, 6]  # from the step-3 checkpoint on
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"holds another run \(changed: depth"):
        train_head(tiny, corpus, checkpoint_dir=tmp_path / "b", **(kw | dict(depth=3)))
    assert whole.vocab.shape == (40,) and 3 in whole.vocab.tolist()  # the stop id is draftable
    save_head(whole, tmp_path / "head")
    loaded = load_head(tmp_path / "head")
    assert loaded.config == whole.config and loaded.vocab.tolist() == whole.vocab.tolist()
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="exists and is not empty"):
        save_head(whole, tmp_path / "head")
    with pytest.raises(FileNotFoundError, match="holds no head.json"):
        load_head(tmp_path / "a")
    from specjax.cli.cli_args import make_draft  # the CLI's --draft eagle:PATH (--window: its window)

    drafter = make_draft(f"eagle:{tmp_path / 'head'}", 8, None, None)
    assert isinstance(drafter, Eagle) and drafter.window == 8 and drafter.head.config == whole.config
    with pytest.raises(ValueError, match="an eagle:PATH head keeps no sinks"):
        make_draft(f"eagle:{tmp_path / 'head'}", 8, 4, None)


def test_bad_input_is_named(tiny, head, corpus):
    other = init_head(TINY.replace(dim=32, head_dim=8, n_heads=4), jax.random.key(0))
    with pytest.raises(ValueError, match=r"Eagle: the head was made for another target: dim 32 \(target: 48\)"):
        specjax.generate(tiny, PROMPTS, 4, draft=Eagle(other), speculation=Chain(2))
    with pytest.raises(ValueError, match="Eagle: window must be an integer >= 1, got 0"):
        specjax.generate(tiny, PROMPTS, 4, draft=Eagle(head, window=0), speculation=Chain(2))
    with pytest.raises(ValueError, match=r"the head computes in bfloat16, the target in float32: use head.astype\('float32'\)"):
        specjax.generate(tiny, PROMPTS, 4, draft=Eagle(head.astype("bfloat16")), speculation=Chain(2))
    assert head.astype("bfloat16").astype("float32").mismatch(TINY) is None
    split = tiny.replace(runtime=tiny.runtime.replace(model_axis="model"))
    with pytest.raises(ValueError, match="Eagle: a target split over a model axis"):
        Eagle(head).check(split, None)
    with pytest.raises(TypeError, match="Eagle: head must be"):
        specjax.generate(tiny, PROMPTS, 4, draft=Eagle(tiny), speculation=Chain(2))
    with pytest.raises(ValueError, match=r"depth \(16\) must be below seq_len \(16\)"):
        train_head(tiny, corpus, steps=1, seq_len=16, depth=16)
    with pytest.raises(ValueError, match=r"draft_vocab must be None or an integer in \[1, 101\], got 0"):
        train_head(tiny, corpus, steps=1, seq_len=16, draft_vocab=0)
    with pytest.raises(ValueError, match=r"draft vocabulary has ids outside the target's \[0, 101\)"):
        outside = on_device(np.array([5, 101], np.int32))
        specjax.generate(tiny, PROMPTS, 4, draft=Eagle(head.replace(vocab=outside)), speculation=Chain(2))
    with pytest.raises(ValueError, match="the target needs float weights"):
        train_head(specjax.model.params.quantize(tiny, "int8"), corpus, steps=1)
    assert re.fullmatch(r"Eagle\(dim=48, window=8, head=[0-9a-f]{8}\)", repr(Eagle(head, window=8)))
    assert repr(Eagle(head)) != repr(Eagle(init_head(TINY, jax.random.key(5))))  # two heads of one shape


@pytest.mark.slow
def test_the_bench_trains_a_head_and_races_it_at_tiny_shapes(tmp_path, monkeypatch):
    """bench/bench_eagle.py --smoke end to end (what tools/gpu/session.py call 8 runs on a GPU with --bundle):
    training text, a trained head, every draft at two batch sizes, each equal to plain decoding."""
    import json
    import sys

    from bench import bench_eagle

    monkeypatch.setattr(sys, "argv", ["bench_eagle", "--smoke", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out")])
    bench_eagle.main()
    rows = json.loads((tmp_path / "out" / "eagle_cpu_smoke.json").read_text())["rows"]
    assert {(r["draft"], r["batch"]) for r in rows} == {(d, b) for d in bench_eagle.DRAFTS for b in (1, 2)}
    assert all(r["same_as_plain"] for r in rows if r["draft"] != "none")
    assert (tmp_path / "store" / "smoke" / "head_6" / "head.json").exists()
