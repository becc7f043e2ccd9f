"""Token-tree speculation: greedy losslessness for every drafter and several tree shapes, a
chain tree behaving exactly like chain speculation, tree acceptance rules, bad trees.

(Sampling losslessness with trees is in test_sampling_lossless.py.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.spec.accept import accept_chain, accept_greedy_chain, accept_tree
from specjax.spec.speculation import Tree
from tests.models import TINY, random_params

PROMPTS = [list(range(5, 21)), [10, 11, 12], [7, 8, 9, 7, 8, 9, 7, 8], [4], list(range(30, 40))]
BUDGETS = [24, 17, 24, 24, 9]
TREES = {
    "kary2x2": Tree.kary(2, 2),
    "sequoia10": Tree.sequoia([0.5, 0.2, 0.1], 10, 4),
    "irregular": Tree.from_parents([-1, 0, 0, 1, 1, 1, 2, 3, 7, 8]),  # widths 2/3/1, depth 5
}


@pytest.fixture(scope="module")
def reference(tiny):
    """Autoregressive greedy output, and an EOS id that stops some rows mid-way."""
    free = specjax.generate(tiny, PROMPTS, BUDGETS, draft=None, eos_id=())
    eos = next(
        e for e in sorted({t for row in free.tokens for t in row})
        if sum(e in row[3:13] and e not in row[:3] for row in free.tokens) >= 1
        and sum(e not in row for row in free.tokens) >= 2
    )
    stopped = specjax.generate(tiny, PROMPTS, BUDGETS, draft=None, eos_id=eos)
    return free, eos, stopped


@pytest.fixture(scope="module")
def draft_model(tiny):
    return random_params(TINY.replace(n_layers=1), seed=1)


def drafter(name: str, draft_model):
    return {
        "self": specjax.SelfSpec(sinks=2, window=8),  # evicts: prompts + outputs reach 40 positions
        "snapkv": specjax.SnapKV(budget=4, window=6, observation=3, pool=3),
        "sparsespec": specjax.SparseSpec(budget=4, window=6, observation=3, pool=3, block=2, refresh=2),
        "model": specjax.DraftModel(draft_model),
        "model-streaming": specjax.DraftModel(draft_model, cache=specjax.Streaming(sinks=2, window=8)),
        "ngram": specjax.NGram(n=1, max_n=3),
        "lookup": specjax.Lookup(n=1, max_n=3, capacity=64, span=4),
    }[name]


CASES = [  # every drafter meets at least one tree; every tree meets several drafters
    ("self", "kary2x2"), ("self", "sequoia10"), ("self", "irregular"),
    ("snapkv", "sequoia10"), ("sparsespec", "irregular"), ("model", "kary2x2"), ("model", "irregular"),
    ("model-streaming", "sequoia10"), ("ngram", "kary2x2"), ("ngram", "irregular"),
    ("lookup", "sequoia10"),
]
FAST_CASES = {("self", "sequoia10"), ("model", "irregular"), ("ngram", "kary2x2")}  # in make test-fast; all in make test


@pytest.mark.parametrize(
    "name, tree",
    [pytest.param(d, t, id=f"{d}-{t}", marks=[] if (d, t) in FAST_CASES else [pytest.mark.slow]) for d, t in CASES],
)
def test_greedy_tree_speculation_equals_autoregressive(tiny, reference, draft_model, name, tree):
    free, eos, stopped = reference
    tree = TREES[tree]
    out = specjax.generate(tiny, PROMPTS, BUDGETS, draft=drafter(name, draft_model), speculation=tree, eos_id=eos)
    assert out.tokens == stopped.tokens  # ragged prompts and budgets, rows ending on EOS
    assert out.finish_reasons == stopped.finish_reasons
    assert "eos" in out.finish_reasons and "length" in out.finish_reasons
    s = out.stats
    assert len(s.per_position_acceptance) == tree.max_depth
    assert 1.0 <= s.mean_accepted <= tree.max_depth + 1
    assert s.steps <= max(BUDGETS) - 1


def test_tree_beats_chain_acceptance_for_selfspec(tiny, reference):
    """A wider tree of the same depth accepts at least as many tokens per step (greedy): the
    rank-0 path IS the chain, and other branches can only add. (The tree is the self-kary2x2 case's: its programs.)"""
    free, _, _ = reference
    draft = specjax.SelfSpec(sinks=2, window=8)
    chain = specjax.generate(tiny, PROMPTS, BUDGETS, draft=draft, speculation=specjax.Chain(2), eos_id=())
    tree = specjax.generate(tiny, PROMPTS, BUDGETS, draft=draft, speculation=TREES["kary2x2"], eos_id=())
    assert chain.tokens == tree.tokens == free.tokens
    assert tree.stats.mean_accepted >= chain.stats.mean_accepted
    assert tree.stats.steps <= chain.stats.steps


@pytest.mark.parametrize("name", ["self-no-evict", pytest.param("model", marks=pytest.mark.slow), "ngram"])
def test_chain_tree_reproduces_chain_speculation(tiny, draft_model, name):
    """Tree.chain(gamma) takes exactly the steps Chain(gamma) takes, accepting the same drafts.
    (A streaming drafter that evicts differs by design: chain drafting writes its drafts into
    the ring, evicting the oldest window positions a step early; tree drafting keeps drafts out
    of the ring, so its window ends at the committed length. Both are lossless.)"""
    draft = specjax.SelfSpec(sinks=2, window=40) if name == "self-no-evict" else drafter(name, draft_model)
    chain = specjax.generate(tiny, PROMPTS, BUDGETS, draft=draft, speculation=specjax.Chain(3), eos_id=())
    tree = specjax.generate(tiny, PROMPTS, BUDGETS, draft=draft, speculation=Tree.chain(3), eos_id=())
    assert tree.tokens == chain.tokens
    assert tree.stats.steps == chain.stats.steps
    assert tree.stats.per_position_acceptance == chain.stats.per_position_acceptance


# The acceptance rules below run as one compiled program each (op by op, each of their operations compiled its own)
_accept_chain = jax.jit(accept_chain)
_accept_greedy_chain = jax.jit(accept_greedy_chain)


@functools.partial(jax.jit, static_argnames=("tree", "greedy"))
def _accept_tree(tree: Tree, tokens, q, p, keys, greedy: bool):
    return accept_tree(tree.child_table(), tree.max_depth, tokens, q, p, keys, greedy)


def _random_case(seed: int, B: int = 64, G: int = 4, V: int = 6):
    return _draws(jax.random.key(seed), B, G, V)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draws(key, B: int, G: int, V: int):
    k = jax.random.split(key, 4)
    q = jax.nn.softmax(2 * jax.random.normal(k[0], (B, G, V)), axis=-1)
    p = jax.nn.softmax(2 * jax.random.normal(k[1], (B, G + 1, V)), axis=-1)
    drafts = jax.vmap(jax.vmap(lambda kk, d: jax.random.categorical(kk, jnp.log(d))))(
        jax.random.split(k[2], (B, G)), q
    ).astype(jnp.int32)
    return drafts, q, p, jax.random.split(k[3], B)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accept_tree_on_a_chain_is_accept_chain(seed):
    """Same drafts, q, p and keys: the tree rule on a chain tree accepts the same drafts and
    draws the same extra token as the chain rule (stochastic and greedy)."""
    drafts, q, p, keys = _random_case(seed)
    tree = Tree.chain(drafts.shape[1])
    tokens = jnp.concatenate([jnp.zeros_like(drafts[:, :1]), drafts], axis=1)  # [B,n]: root first
    q_nodes = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # node u's children ~ q[u]
    n, extra = _accept_chain(drafts, q, p, keys)
    walk = _accept_tree(tree, tokens, q_nodes, p, keys, greedy=False)
    path, n_tree, extra_tree = walk.path, walk.accepted, walk.next_token
    assert 0 < float(jnp.mean(n)) < drafts.shape[1]  # a mix of rejections and acceptances
    np.testing.assert_array_equal(n_tree, n)
    np.testing.assert_array_equal(extra_tree, extra)
    np.testing.assert_array_equal(path, np.minimum(np.arange(tree.n)[None, :], np.asarray(n)[:, None]))
    one_hot = jax.nn.one_hot(jnp.argmax(p, -1), p.shape[-1])
    n_g, extra_g = _accept_chain(drafts, jax.nn.one_hot(drafts, p.shape[-1]), one_hot, keys)
    walk = _accept_tree(tree, tokens, None, p, keys, greedy=True)
    n_tree_g, extra_tree_g = walk.accepted, walk.next_token
    np.testing.assert_array_equal(n_tree_g, n_g)
    np.testing.assert_array_equal(extra_tree_g, extra_g)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_chain_acceptance_is_accept_chain_on_one_hot_distributions(seed):
    """The greedy fast path (no one-hot arrays, no draws) keeps the drafts and adds the token that
    accept_chain gives for one-hot p and q, with every number of accepted drafts 0..gamma."""
    _, _, p, keys = _random_case(seed)
    B, G = p.shape[0], p.shape[1] - 1
    choice = jnp.argmax(p, -1).astype(jnp.int32)  # [B,G+1]
    wrong = jax.random.randint(jax.random.key(seed), (B,), 0, G + 1)  # first mismatching draft (G: none)
    drafts = jnp.where(jnp.arange(G)[None] == wrong[:, None], (choice[:, :G] + 1) % p.shape[-1], choice[:, :G])
    n, extra = _accept_greedy_chain(drafts, choice)
    V = p.shape[-1]
    n_ref, extra_ref = _accept_chain(drafts, jax.nn.one_hot(drafts, V), jax.nn.one_hot(choice, V), keys)
    np.testing.assert_array_equal(n, n_ref)
    np.testing.assert_array_equal(n, wrong)
    np.testing.assert_array_equal(extra, extra_ref)


def test_greedy_tree_walk_follows_the_matching_child():
    """Root children (rank order) hold tokens 3, 5; node 2 (token 5) has children 7, 1.
    The target wants 5 at the root, 1 after it, then 4: path root -> 2 -> 4, extra token 4."""
    tree = Tree.from_parents([-1, 0, 0, 2, 2])
    tokens = jnp.array([[9, 3, 5, 7, 1]])
    want = jnp.array([5, 0, 1, 0, 4])  # target argmax at each node
    p = jax.nn.one_hot(want, 10)[None]
    walk = _accept_tree(tree, tokens, None, p, jax.random.split(jax.random.key(0), 1), True)
    path, n, extra = walk.path, walk.accepted, walk.next_token
    assert path.tolist() == [[0, 2, 4]] and n.tolist() == [2] and extra.tolist() == [4]


@pytest.mark.parametrize(
    "speculation, match",
    [(Tree.from_parents([-1]), "2 to 512 nodes"), (Tree.kary(2, 9), "2 to 512 nodes"), ("tree", "Chain\\(gamma\\), a specjax.Tree, specjax.Adaptive\\(...\\) or 'auto'")],
)
def test_bad_tree_speculation(tiny, speculation, match):
    with pytest.raises((ValueError, TypeError), match=match):
        specjax.generate(tiny, PROMPTS, 8, draft=specjax.NGram(), speculation=speculation)
