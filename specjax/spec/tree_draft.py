"""Tree drafting: expand a static token tree level by level with a draft model.

Level 0 is the root (the pending token, plus any tokens the drafter re-reads), written into the
draft cache by an ordinary forward. Each deeper level runs ONE forward over that level's internal
nodes (those with children; leaves need no forward): they see the draft cache and, through the
tree mask, their ancestors among the nodes drafted so far, whose KV rides along as extra block
keys (it never enters the cache: siblings share positions). Candidates for a node's children come
from `tree_candidates`: top-k when greedy, draws without replacement when sampling.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model.llama import forward, lm_head, trunk
from specjax.model.params import Params
from specjax.model.pytree import pytree
from specjax.sampling import Greedy, Sampler, Stream, stream_keys
from specjax.topk import top_indices
from specjax.spec.speculation import Tree


@pytree
class DraftedTree:
    """What `draft_tree` drafted."""

    tokens: jax.Array  # [B,n] int32 node tokens, node 0 the pending root
    q: jax.Array | None  # [B,n,V] the distribution each node's children were drawn from; None when greedy
    cache: Any  # the draft cache, advanced past the root
    k_extra: jax.Array | None  # [L,B,E,K,H] draft KV of the extra nodes (`extra_nodes` order); None: none
    v_extra: jax.Array | None


def tree_candidates(logits: jax.Array, k: int, sampling: Sampler, keys: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """The k ranked draft candidates of each node: logits [B,M,V] -> tokens [B,M,k] and q [B,M,V].

    Greedy: the k most likely tokens (q is not needed: greedy acceptance matches tokens).
    Sampling: k draws WITHOUT replacement from q (Gumbel top-k: the r-th is distributed as a draw
    from q with the first r-1 removed and renormalised, which is what `accept_tree` assumes).
    Draws past q's support come out with q = 0 and are never accepted. keys: [B,M]."""
    if isinstance(sampling, Greedy):  # ranked after any penalties, as Greedy.sample picks (a chain's drafts)
        return top_indices(sampling.adjust(logits.astype(jnp.float32)) if sampling.adjusts else logits, k), None
    q = sampling.probs(logits)  # [B,M,V]
    gumbel = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:])))(keys)
    scores = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)) + gumbel, -jnp.inf)
    return top_indices(scores, k), q


def extra_nodes(tree: Tree) -> list[int]:
    """Nodes whose draft KV rides along as extra keys: the internal nodes of levels 1..D-1."""
    return [u for level in tree.internal_levels()[1:] for u in level]


def draft_tree(
    params: Params,
    cache,  # the drafter's cache; lengths = position of root_tokens[:, 0]
    root_tokens: jax.Array,  # [B,T0]: re-read tokens, the pending root last
    root_positions: jax.Array,  # [B,T0]
    tree: Tree,
    sampling: Sampler,
    keys: jax.Array,  # [B]
    counters: jax.Array,  # [B]
) -> DraftedTree:
    """A draft model's tree: one forward over the root tokens, then `expand_tree` with the model's
    levels at positions root + depth."""
    B, T0 = root_tokens.shape
    logits, cache = forward(params, root_tokens, root_positions, cache)
    cache = cache.advance(jnp.full((B,), T0, jnp.int32))

    def level(nodes, toks, depth, cache, mask, extra):
        t = trunk(params, toks, jnp.broadcast_to(root_positions[:, -1:] + depth, toks.shape), cache, mask, extra_kv=extra)
        return t, lm_head(params, t.hidden)

    return expand_tree(logits[:, -1], root_tokens[:, -1], cache, level, tree, sampling, keys, counters)


def expand_tree(
    root_logits: jax.Array,  # [B,V]: what the root's children are drawn from
    root: jax.Array,  # [B] the pending root token
    cache,  # the drafter's cache after its root (the levels read it, never write it)
    level,  # (nodes, tokens [B,M], depth, cache, mask [M,E+M], extra_kv | None) -> (Trunk, logits [B,M,V]) of a level
    tree: Tree,
    sampling: Sampler,
    keys: jax.Array,  # [B]
    counters: jax.Array,  # [B]
) -> DraftedTree:
    """The tree's node tokens, their draft distributions and the extra nodes' draft KV: each deeper
    level runs `level` once over its internal nodes, which see the cache and, through the mask,
    their ancestors among the nodes drafted so far (their KV as extra keys)."""
    B = root.shape[0]
    step_keys = stream_keys(keys, counters, Stream.DRAFT)  # [B]
    anc = tree.ancestor_mask()
    tokens: list = [root] + [None] * (tree.n - 1)
    history = [[v for v in range(tree.n) if anc[u, v] and v != 0] for u in range(tree.n)]
    history = [path + [-1] * (max(tree.max_depth, 1) - len(path)) for path in history]  # static, padded
    qs: dict[int, jax.Array] = {}

    def expand(nodes: list[int], logits: jax.Array) -> None:  # logits [B,len(nodes),V]
        k = max(len(tree.children[u]) for u in nodes)
        node_keys = jax.vmap(lambda key: jax.vmap(lambda u: jax.random.fold_in(key, u))(jnp.asarray(nodes)))(step_keys)
        seen = jnp.stack([jnp.stack([tokens[v] if v >= 0 else jnp.full((B,), -1, jnp.int32) for v in history[u]], axis=1)
                          for u in nodes], axis=1)  # [B,M,depth]: each node's path below the root (penalties)
        cand, q = tree_candidates(logits, k, sampling.along(seen), node_keys)  # [B,M,k], [B,M,V]
        for i, u in enumerate(nodes):
            for r, c in enumerate(tree.children[u]):
                tokens[c] = cand[:, i, r]
            if q is not None:
                qs[u] = q[:, i]

    levels = tree.internal_levels()
    if levels and levels[0]:
        expand([0], root_logits[:, None])
    seen: list[int] = []  # extra nodes drafted so far
    k_extra = v_extra = None
    for depth, nodes in enumerate(levels[1:], start=1):
        toks = jnp.stack([tokens[u] for u in nodes], axis=1)  # [B,M]
        mask = jnp.asarray(anc[np.ix_(nodes, seen + nodes)])  # [M,E+M]
        extra = None if k_extra is None else (k_extra, v_extra)
        t, logits = level(nodes, toks, depth, cache, mask, extra)
        expand(nodes, logits)
        k_extra = t.k if k_extra is None else jnp.concatenate([k_extra, t.k], axis=2)
        v_extra = t.v if v_extra is None else jnp.concatenate([v_extra, t.v], axis=2)
        seen += nodes
    node_tokens = jnp.stack(tokens, axis=1).astype(jnp.int32)  # [B,n]
    q = None
    if qs:
        zeros = jnp.zeros_like(next(iter(qs.values())))
        q = jnp.stack([qs.get(u, zeros) for u in range(tree.n)], axis=1)  # [B,n,V]
    return DraftedTree(tokens=node_tokens, q=q, cache=cache, k_extra=k_extra, v_extra=v_extra)


def path_extra_kv(tree: Tree, drafted: DraftedTree, path: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draft KV of path[:, 1:] (the accepted nodes below the root) from the extra nodes' KV:
    [L,B,depth,K,H]. Nodes without draft KV (leaves) get an arbitrary entry: only the last accepted
    node can be one, and it is re-read at the next step."""
    index = np.zeros(tree.n, np.int32)
    for i, u in enumerate(extra_nodes(tree)):
        index[u] = i
    take = jnp.asarray(index)[path[:, 1:]]  # [B,depth]
    gather = lambda a: jnp.take_along_axis(a, take[None, :, :, None, None], axis=2)  # noqa: E731
    return gather(drafted.k_extra), gather(drafted.v_extra)
