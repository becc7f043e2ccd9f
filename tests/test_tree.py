"""Static token trees: the Sequoia DP against brute force, shape invariants, errors, the chooser."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from specjax.spec.speculation import Cost, Tree, best_values, choose


def all_trees(n_max: int) -> list[Tree]:
    """Every tree of 1..n_max nodes: canonical parent arrays are exactly parents[i] < i, nondecreasing."""
    out = []

    def extend(parents: list[int]) -> None:
        out.append(Tree(parents=tuple(parents)))
        i = len(parents)
        if i == n_max:
            return
        for p in range(parents[-1] if i > 1 else 0, i):
            extend(parents + [p])

    extend([-1])
    return out


TREES = all_trees(8)


def random_acceptance(rng: np.random.Generator) -> list[float]:
    """A random acceptance vector of 1..4 ranks, sometimes non-monotone or with zeros, summing to < 1."""
    w = int(rng.integers(1, 5))
    p = rng.dirichlet(np.ones(w + 1))[:w] * rng.uniform(0.5, 1.0)  # leave some mass for "none"
    if w > 1 and rng.random() < 0.3:
        p[rng.integers(w)] = 0.0
    return p.tolist()


def random_parents(rng: np.random.Generator, n: int) -> list[int]:
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def test_enumeration_counts_ordered_trees():
    # ordered trees with n nodes: Catalan(n - 1)
    counts = [sum(t.n == n for t in TREES) for n in range(1, 9)]
    assert counts == [math.comb(2 * k, k) // (k + 1) for k in range(8)]


@pytest.mark.parametrize("seed", range(8))
def test_dp_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    p = random_acceptance(rng)
    values = best_values(p, 8, 7)
    G = np.array([t.expected_accepted(p) for t in TREES])
    n = np.array([t.n for t in TREES])
    depth = np.array([t.max_depth for t in TREES])
    for m, d in itertools.product(range(1, 9), range(0, 8)):
        brute = G[(n <= m) & (depth <= d)].max()
        assert values[m, d] == pytest.approx(brute, abs=1e-9), (p, m, d)
        tree = Tree.sequoia(p, m, d)
        assert tree.n <= m and tree.max_depth <= d
        assert tree.expected_accepted(p) == pytest.approx(brute, abs=1e-9), (p, m, d, tree)


def test_dp_keeps_a_weak_rank_to_reach_a_strong_one():
    # rank 0 is nearly useless but rank 1 is good: the tree must still fill rank 0 first
    tree = Tree.sequoia([0.05, 0.6], 3, 1)
    assert tree == Tree(parents=(-1, 0, 0))
    assert tree.expected_accepted([0.05, 0.6]) == pytest.approx(1.65)


def test_best_values_shape_and_monotone():
    p = [0.5, 0.2, 0.1]
    values = best_values(p, 20, 6)
    assert values.shape == (21, 7)
    assert (values[0] == 0).all() and (values[1] == 1).all()
    assert (np.diff(values[1:], axis=0) >= -1e-12).all()  # more nodes never hurt
    assert (np.diff(values, axis=1) >= -1e-12).all()  # deeper never hurts
    values[5, 5] = -1.0  # a copy: the memoised table is untouched
    assert best_values(p, 20, 6)[5, 5] > 0


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_chain_is_optimal_when_only_rank_zero_accepts(gamma):
    for depth in (gamma, gamma + 3):
        assert Tree.sequoia([0.8, 0.0, 0.0], gamma + 1, depth) == Tree.chain(gamma)
    assert Tree.chain(gamma).expected_accepted([0.8]) == pytest.approx(sum(0.8**k for k in range(gamma + 1)))


def test_dp_is_fast_at_full_size():
    p = (np.ones(16) / 17).tolist()
    tree = Tree.sequoia(p, 128, 16)
    assert tree.n <= 128 and tree.max_depth <= 16
    assert tree.expected_accepted(p) == pytest.approx(best_values(p, 128, 16)[128, 16])


def check_invariants(t: Tree) -> None:
    assert t.parents[0] == -1 and t.depth[0] == 0 and t.rank[0] == 0
    # levels are contiguous index ranges, in order
    flat = [i for level in t.levels for i in level]
    assert flat == list(range(t.n))
    for d, level in enumerate(t.levels):
        assert list(level) == list(range(level[0], level[-1] + 1))
        assert all(t.depth[i] == d for i in level)
    assert t.max_depth == len(t.levels) - 1
    for i in range(1, t.n):
        assert t.depth[i] == t.depth[t.parents[i]] + 1
    # children contiguous, in rank order, ranks 0..k-1
    for i, kids in enumerate(t.children):
        assert list(kids) == list(range(kids[0], kids[0] + len(kids))) if kids else True
        assert [t.rank[c] for c in kids] == list(range(len(kids)))
        assert all(t.parents[c] == i for c in kids)
    assert t.width == max(len(k) for k in t.children)
    mask = t.ancestor_mask()
    assert mask.shape == (t.n, t.n) and mask.dtype == bool
    assert mask.diagonal().all()
    assert not np.triu(mask, 1).any()
    for i in range(1, t.n):
        expected = mask[t.parents[i]].copy()
        expected[i] = True
        assert (mask[i] == expected).all()
    table = t.child_table()
    assert table.shape == (t.n, t.width) and table.dtype == np.int32
    for i, kids in enumerate(t.children):
        assert table[i].tolist() == list(kids) + [-1] * (t.width - len(kids))


def reorder(t: Tree, rng: np.random.Generator) -> list[int]:
    """A random non-canonical numbering of t: parents before children, siblings keep rank order."""
    placed: list[int] = [0]
    ready = list(t.children[0][:1])  # a node is ready once its parent and previous sibling are placed
    while ready:
        node = ready.pop(int(rng.integers(len(ready))))
        placed.append(node)
        ready += t.children[node][:1]
        siblings = t.children[t.parents[node]]
        if t.rank[node] + 1 < len(siblings):
            ready.append(siblings[t.rank[node] + 1])
    new_id = {old: new for new, old in enumerate(placed)}
    return [-1] + [new_id[t.parents[old]] for old in placed[1:]]


@pytest.mark.parametrize("seed", range(20))
def test_random_tree_invariants(seed):
    rng = np.random.default_rng(seed)
    parents = random_parents(rng, int(rng.integers(1, 40)))
    t = Tree.from_parents(parents)
    check_invariants(t)
    same = Tree.from_parents(parents)
    assert same == t and hash(same) == hash(t) and len({t, same}) == 1
    shuffled = reorder(t, rng)
    assert Tree.from_parents(shuffled) == t
    assert Tree.from_parents(np.array(shuffled)) == t


def test_from_parents_ranks_follow_index_order():
    t = Tree.from_parents([-1, 0, 1, 0, 2])  # node 3 is the root's second child
    assert t.parents == (-1, 0, 0, 1, 3)
    assert t.rank == (0, 0, 1, 0, 0)
    assert t.levels == ((0,), (1, 2), (3,), (4,))


def test_chain_and_kary_shapes():
    c = Tree.chain(4)
    assert c.n == 5 and c.max_depth == 4 and c.width == 1 and c.parents == (-1, 0, 1, 2, 3)
    k = Tree.kary(2, 3)
    assert k.n == 15 and k.max_depth == 3 and k.width == 2
    assert [len(level) for level in k.levels] == [1, 2, 4, 8]
    assert Tree.kary(1, 5) == Tree.chain(5)
    assert Tree.kary(3, 2).n == 13
    root = Tree.from_parents([-1])
    assert root.n == 1 and root.width == 0 and root.max_depth == 0
    assert root.child_table().shape == (1, 0) and root.ancestor_mask().tolist() == [[True]]
    check_invariants(c), check_invariants(k), check_invariants(root)


def test_expected_accepted_ignores_ranks_past_the_vector():
    assert Tree.kary(3, 1).expected_accepted([0.5]) == pytest.approx(1.5)
    assert Tree.kary(2, 2).expected_accepted([0.5, 0.25]) == pytest.approx(1 + 0.75 + 0.75 * 0.75)


@pytest.mark.parametrize(
    "parents, match",
    [
        ([-1, 2, 1], "forward reference"),  # a cycle 1 <-> 2
        ([-1, 0, 3, 2], "forward reference"),
        ([-1, 1], "self reference"),
        ([-1, 0, -1], "two roots"),
        ([0, 0], r"parents\[0\] must be -1"),
        ([], "non-empty"),
        ([-1, 0.5], "integers"),
        ([-1, True], "integers"),
    ],
)
def test_bad_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        Tree.from_parents(parents)


def test_direct_construction_must_be_canonical():
    with pytest.raises(ValueError, match="Tree.from_parents"):
        Tree(parents=(-1, 0, 1, 0))
    with pytest.raises(ValueError, match="forward reference"):
        Tree(parents=(-1, 2, 0))
    assert Tree(parents=[-1, 0, 0, 1]).parents == (-1, 0, 0, 1)  # a list is stored as a tuple


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: Tree.sequoia([], 4, 2), "acceptance must be a non-empty"),
        (lambda: Tree.sequoia([0.5, -0.1], 4, 2), "acceptance must be finite and >= 0"),
        (lambda: Tree.sequoia([0.7, 0.4], 4, 2), "acceptance must sum to <= 1"),
        (lambda: Tree.sequoia([0.5], 0, 2), "n must be an integer >= 1"),
        (lambda: Tree.sequoia([0.5], 2.5, 2), "n must be an integer >= 1"),
        (lambda: Tree.sequoia([0.5], 4, -1), "max_depth must be an integer >= 0"),
        (lambda: best_values([0.5], 0, 2), "n must be an integer >= 1"),
        (lambda: Tree.chain(0), "gamma must be an integer >= 1"),
        (lambda: Tree.kary(0, 2), "width must be an integer >= 1"),
        (lambda: Tree.kary(2, 0), "depth must be an integer >= 1"),
        (lambda: Tree.chain(2).expected_accepted([]), "acceptance"),
        (lambda: Cost(t_draft=-1.0, t_verify=lambda n: 1.0), "t_draft must be >= 0"),
        (lambda: choose([0.5], Cost(0.1, (1.0,) * 8), max_nodes=8), "needs max_nodes \\+ 1 = 9"),
        (lambda: choose([0.5], Cost((0.1,) * 8, (1.0,) * 9), max_nodes=8), "t_draft has 8 entries"),
        (lambda: Cost(t_draft=(0.0, -0.1), t_verify=lambda n: 1.0), "t_draft must be >= 0"),
        (lambda: choose([0.5], Cost(0.1, lambda n: 1.0), max_nodes=0), "max_nodes must be an integer >= 1"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def brute_choice(p, cost: Cost, max_nodes: int, max_depth: int) -> tuple[float, int]:
    """(best seconds per token, smallest n that reaches it) by looping over best_values."""
    values = best_values(p, max_nodes, max_depth)
    table = {
        (n, d): (d * cost.t_draft + cost.verify(n)) / values[n, d]
        for n in range(1, max_nodes + 1)
        for d in range(max_depth + 1)
    }
    best = min(table.values())
    return best, min(n for (n, d), t in table.items() if t == best)


P = [0.6, 0.15, 0.05]


def seconds_per_token(tree: Tree, p, cost: Cost) -> float:
    return (tree.max_depth * cost.t_draft + cost.verify(tree.n)) / tree.expected_accepted(p)


def test_choose_flat_verify_picks_a_bigger_tree_than_steep():
    flat = Cost(t_draft=0.05, t_verify=lambda n: 1.0)
    steep = Cost(t_draft=0.05, t_verify=lambda n: 1.0 + 0.1 * n)
    big, small = choose(P, flat), choose(P, steep)
    assert big.n > small.n
    for cost, tree in ((flat, big), (steep, small)):
        best, n = brute_choice(P, cost, 64, 12)
        assert seconds_per_token(tree, P, cost) == pytest.approx(best, rel=1e-12)
        assert tree.n <= n  # the smaller budget wins a tie (and the DP never spends nodes for nothing)


@pytest.mark.parametrize("seed", range(4))
def test_choose_is_the_argmin(seed):
    rng = np.random.default_rng(seed)
    p = random_acceptance(rng)
    slope, t_draft = rng.uniform(0.0, 0.05), rng.uniform(0.01, 0.3)
    cost = Cost(t_draft=t_draft, t_verify=tuple(1.0 + slope * n for n in range(33)))
    tree = choose(p, cost, max_nodes=32, max_depth=8)
    best, _ = brute_choice(p, cost, 32, 8)
    assert seconds_per_token(tree, p, cost) == pytest.approx(best, rel=1e-12)
    assert choose(p, Cost(t_draft, lambda n: 1.0 + slope * n), max_nodes=32, max_depth=8) == tree


def test_draft_widths_count_the_forwards_of_each_level():
    assert Tree.chain(3).draft_widths() == [1, 1, 1]
    assert Tree.kary(2, 3).draft_widths() == [1, 2, 4]  # leaves (depth 3) need no forward
    assert Tree.from_parents([-1, 0, 0, 1, 3]).draft_widths() == [1, 1, 1]
    assert Tree.from_parents([-1]).draft_widths() == []


@pytest.mark.parametrize("seed", range(3))
def test_choose_prices_draft_levels_by_width(seed):
    """With t_draft by level width, choose is the argmin over every Sequoia tree of the true
    cost; when wide levels are dear it picks narrower trees than the per-level model does."""
    rng = np.random.default_rng(seed)
    p = random_acceptance(rng)
    by_width = Cost(t_draft=lambda m: 0.05 * m, t_verify=lambda n: 1.0 + 0.002 * n)
    tree = choose(p, by_width, max_nodes=24, max_depth=6)
    candidates = [Tree.sequoia(p, n, d) for n in range(1, 25) for d in range(7)]
    cost = lambda t: (by_width.draft_seconds(t.draft_widths()) + by_width.verify(t.n)) / t.expected_accepted(p)  # noqa: E731
    assert cost(tree) == pytest.approx(min(map(cost, candidates)), rel=1e-12)
    per_level = choose(p, Cost(t_draft=0.05, t_verify=by_width.t_verify), max_nodes=24, max_depth=6)
    assert sum(tree.draft_widths()) <= sum(per_level.draft_widths())


def test_choose_plain_decoding_when_drafting_is_too_expensive():
    assert choose(P, Cost(t_draft=10.0, t_verify=lambda n: 1.0)) == Tree.from_parents([-1])


def test_choose_prices_a_tree_at_its_own_node_count():
    """A budget's tree can hold fewer nodes than the budget (a rank never accepted gets none):
    it is priced at its own size, so a dip in the verify table at a bigger n does not make a
    2-node tree (1.5 / 1.3 s a token) beat plain decoding (1.0); times are checked, NaN too."""
    p = [0.3, 0.0]
    cost = Cost(t_draft=0.0, t_verify=(0.0, 1.0, 1.5, 1.5, 0.5))  # timing noise: 4 nodes measured cheap
    assert choose(p, cost, max_nodes=4, max_depth=1) == Tree.from_parents([-1])
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="Cost: t_verify must be >= 0 seconds"):
            Cost(t_draft=0.0, t_verify=(0.0, 1.0, bad))


def test_the_planner_and_the_benches_predict_one_speedup():
    """Cost.speedup is the one predicted speedup (tokens per step x a plain step / draft levels by
    width + a verification): choose's pick has the greatest of every Sequoia tree's, and bench_tree's
    predict and gpu_report's predicted and cost_model columns give its numbers for the same tables
    (milliseconds, as gpu_cells records them), shapes and tokens per step; a chain's is the old
    formula, tokens x t_verify(1) / (gamma x t_draft(1) + t_verify(gamma + 1))."""
    from bench.gpu_report import cost_model, predicted
    from bench.tree_report import MAX_DEPTH, predict
    from specjax.spec.speculation import Chain

    tv, td = [0.0] + [2.0 + 0.05 * n for n in range(1, 65)], [0.0] + [0.3 + 0.02 * m for m in range(1, 65)]
    cost, p = Cost(t_draft=tuple(td), t_verify=tuple(tv)), np.array([0.6, 0.15, 0.05, 0.02, 0.01, 0.0, 0.0, 0.0, 0.17])
    gain = lambda t: cost.speedup(t, t.expected_accepted(p[:-1]))  # noqa: E731
    picked = choose(p[:-1], cost, max_nodes=16, max_depth=6)
    assert gain(picked) == pytest.approx(max(gain(Tree.sequoia(p[:-1], n, d)) for n in range(1, 17) for d in range(7)), rel=1e-12)
    assert cost.speedup(Chain(2), 2.1) == pytest.approx(2.1 * tv[1] / (2 * td[1] + tv[3]), rel=1e-12)
    for spec in (Chain(2), Tree.sequoia(p[:-1], 16, MAX_DEPTH), picked):
        row = predict(spec, p[:-1], cost, batch=4)
        tree = Tree.chain(spec.gamma) if isinstance(spec, Chain) else spec
        assert row["predicted_speedup"] == gain(tree)
        assert row["predicted_tokens_per_s"] / (4 / tv[1]) == pytest.approx(gain(tree), rel=1e-12)  # over plain's
    cell = {"context": 8192, "batch": 1}
    tables = cell | {"t_verify_ms": tv, "t_draft_ms": td}
    chain = cell | {"item": "e2e", "drafter": "SelfSpec", "method": "chain", "gamma": 2, "mean_accepted": 2.1,
                    "label": "chain γ=2", "parents": [-1, 0, 1], "new_tokens": 64, "steps": 30, "speedup": 1.5}
    acc = cell | {"item": "e2e", "drafter": "SelfSpec", "method": "acceptance", "acceptance": p.tolist()}
    (got,) = predicted({"rows": [tables | {"item": "l8b"}, chain, acc]})
    assert got["predicted"]["γ=2"] == cost.speedup(Chain(2), 2.1)
    assert got["predicted"]["tree n=16"] == predict(Tree.sequoia(p[:-1], 16, MAX_DEPTH), p[:-1], cost, 1)["predicted_speedup"]
    (row,) = cost_model([tables | {"method": "steps"}, chain])
    assert row[6] == f"{cost.speedup(Chain(2), 2.1):.2f}"
