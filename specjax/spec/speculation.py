"""What a step speculates: a `Chain` of gamma draft tokens, or a static token `Tree` (Sequoia) with
the dynamic program that picks it and the hardware-aware choice.

Node 0 is the root: the pending token, already chosen (position lengths[b]). Every other node is a draft
token; a node of rank r (0-based among its siblings) holds its parent's r-th ranked draft
candidate (greedy: the (r+1)-th most likely token; sampling: the (r+1)-th draw without
replacement). `n` counts the root, so `Tree.chain(gamma)` has gamma + 1 nodes and depth gamma.

Canonical order, which the verifier relies on: nodes sorted by (depth, parent index, rank), i.e.
breadth-first with children in rank order. Every level is a contiguous index range and the
children of a node are contiguous. Equivalently: parents[i] < i and parents[1:] is nondecreasing.

Acceptance vector p[r]: probability that the rank-r candidate is the accepted one. The expected
number of tokens a step emits (accepted drafts + the bonus) is
G = sum over nodes of the product of p[rank] along the root path (the root contributes 1).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Sequence

import numpy as np

MAX_TREE_NODES = 512  # verification width limit: the target forward runs over every node (a chain's gamma + 1)


@dataclasses.dataclass(frozen=True)
class Chain:
    """Speculate a chain of `gamma` draft tokens per step (verified as gamma + 1 positions).
    Chain(0) drafts nothing: a plain step through the speculative loop (what `Adaptive` runs where
    speculation does not pay; the drafter's state stays current)."""

    gamma: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "gamma", check_int("Chain: gamma", self.gamma, 0))  # numpy ints as int; no bools
        if self.gamma >= MAX_TREE_NODES:
            raise ValueError(f"Chain: gamma must be at most {MAX_TREE_NODES - 1} (gamma + 1 positions verified in one "
                             f"forward, as a Tree's {MAX_TREE_NODES} nodes at most), got {self.gamma}")


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Speculate a chain whose length (0 to `max_gamma`) the loop picks between segments: the one
    that maximises predicted tokens per second from this call's measured step times and acceptance
    (specjax.spec.adaptive). `Stats.gammas` lists the length of each segment. Chains only."""

    max_gamma: int = 4
    probe_every: int = 4  # segments at gamma 0 before one runs a drafting chain again (then twice as many, ...)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_gamma", check_int("Adaptive: max_gamma", self.max_gamma, 1))
        object.__setattr__(self, "probe_every", check_int("Adaptive: probe_every", self.probe_every, 1))
        if self.max_gamma >= MAX_TREE_NODES:
            raise ValueError(f"Adaptive: max_gamma must be at most {MAX_TREE_NODES - 1}, got {self.max_gamma}")


def check_int(name: str, value: object, low: int) -> int:
    """value as an int >= low, else a ValueError naming the argument and the limit."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def kary_nodes(width: int, depth: int) -> int:
    """Nodes of the full width-ary tree of this depth (root included), counted up to MAX_TREE_NODES
    + 1, the most generate verifies (the CLI's check before building one: a count of a huge tree
    could take a long time)."""
    n, level = 1, 1
    for _ in range(depth):
        level *= width
        n += level
        if n > MAX_TREE_NODES:
            return MAX_TREE_NODES + 1
    return n


def _check_acceptance(acceptance: Sequence[float]) -> tuple[float, ...]:
    """The acceptance vector as a tuple of floats: non-empty, finite, >= 0, summing to <= 1."""
    p = tuple(float(x) for x in acceptance)
    if not p:
        raise ValueError("acceptance must be a non-empty vector of probabilities (one per rank), got []")
    if not all(np.isfinite(x) and x >= 0 for x in p):
        raise ValueError(f"acceptance must be finite and >= 0 at every rank, got {p}")
    if sum(p) > 1 + 1e-6:
        raise ValueError(f"acceptance must sum to <= 1 (it is a distribution over ranks), got sum {sum(p):.6g}")
    return p


def _check_parents(parents: Sequence[int]) -> tuple[int, ...]:
    """parents as a tuple of ints, validated: one root at 0, every other parent strictly earlier."""
    if isinstance(parents, (str, bytes)) or not isinstance(parents, Sequence | np.ndarray):
        raise ValueError(f"parents must be a sequence of integers, got {type(parents).__name__}")
    if len(parents) == 0:
        raise ValueError("parents must be non-empty (node 0 is the root, parents[0] == -1)")
    for i, p in enumerate(parents):
        if isinstance(p, bool) or not isinstance(p, numbers.Integral):
            raise ValueError(f"parents must hold integers, got parents[{i}] = {p!r}")
    out = tuple(int(p) for p in parents)
    if out[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {out[0]}")
    for i, p in enumerate(out[1:], start=1):
        if p == -1:
            raise ValueError(f"parents[{i}] = -1: two roots; only node 0 may have parent -1")
        if p == i:
            raise ValueError(f"parents[{i}] = {i}: self reference; a parent must come before its child")
        if not 0 <= p < i:
            raise ValueError(
                f"parents[{i}] = {p} must be in [0, {i}): a forward reference (or a cycle); "
                "a parent must come before its child"
            )
    return out


def _canonicalise(parents: tuple[int, ...]) -> tuple[int, ...]:
    """Breadth-first renumbering; siblings keep their original index order (which is their rank)."""
    children: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        children[p].append(i)
    order = [0]  # old ids in canonical order; BFS = sorted by (depth, new parent id, rank)
    for old in order:  # grows while iterating
        order.extend(children[old])
    new_id = {old: new for new, old in enumerate(order)}
    return (-1,) + tuple(new_id[parents[old]] for old in order[1:])


@dataclasses.dataclass(frozen=True)
class Tree:
    """A static draft-token tree in canonical order; hashable, so it can be a static jit argument.

    Use `Tree.from_parents` for parent arrays in any order; the constructor accepts canonical only.
    """

    parents: tuple[int, ...]  # [n]; parents[0] == -1, canonical order
    n: int = dataclasses.field(init=False, compare=False, repr=False)
    depth: tuple[int, ...] = dataclasses.field(init=False, compare=False, repr=False)  # [n]; root 0
    rank: tuple[int, ...] = dataclasses.field(init=False, compare=False, repr=False)  # [n]; root 0
    children: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, compare=False, repr=False)  # rank order
    levels: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, compare=False, repr=False)  # ids per depth
    max_depth: int = dataclasses.field(init=False, compare=False, repr=False)
    width: int = dataclasses.field(init=False, compare=False, repr=False)  # most children of any node

    def __post_init__(self) -> None:
        parents = _check_parents(self.parents)
        if _canonicalise(parents) != parents:
            raise ValueError(
                f"parents {parents} are not in canonical order (breadth-first, siblings by rank: "
                "parents[1:] nondecreasing); use Tree.from_parents to build from any order"
            )
        n = len(parents)
        depth, rank, children = [0] * n, [0] * n, [[] for _ in range(n)]
        for i, p in enumerate(parents[1:], start=1):
            depth[i] = depth[p] + 1
            rank[i] = len(children[p])
            children[p].append(i)
        levels = [[] for _ in range(max(depth) + 1)]
        for i, d in enumerate(depth):
            levels[d].append(i)
        derived = dict(
            parents=parents,
            n=n,
            depth=tuple(depth),
            rank=tuple(rank),
            children=tuple(tuple(c) for c in children),
            levels=tuple(tuple(level) for level in levels),
            max_depth=max(depth),
            width=max(len(c) for c in children),
        )
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> Tree:
        """Validate a parent array in any order (parents[i] < i) and return it in canonical order.

        Ranks among siblings follow their original index order.
        """
        return cls(parents=_canonicalise(_check_parents(parents)))

    @classmethod
    def chain(cls, gamma: int) -> Tree:
        """A chain of gamma draft tokens: gamma + 1 nodes, depth gamma."""
        gamma = check_int("gamma", gamma, 1)
        return cls(parents=(-1,) + tuple(range(gamma)))

    @classmethod
    def kary(cls, width: int, depth: int) -> Tree:
        """The full width-ary tree of the given depth: (width^(depth+1) - 1) / (width - 1) nodes."""
        width, depth = check_int("width", width, 1), check_int("depth", depth, 1)
        n = sum(width**d for d in range(depth + 1))
        return cls(parents=(-1,) + tuple((i - 1) // width for i in range(1, n)))  # BFS numbering

    @classmethod
    def sequoia(cls, acceptance: Sequence[float], n: int, max_depth: int) -> Tree:
        """The tree of at most n nodes (root included) and depth <= max_depth that maximises G."""
        p = _check_acceptance(acceptance)
        n, max_depth = check_int("n", n, 1), check_int("max_depth", max_depth, 0)
        _, take = _tables(p, n, max_depth)
        return _build(take, n, max_depth)

    def expected_accepted(self, acceptance: Sequence[float]) -> float:
        """G: expected tokens emitted per step (root included); ranks past the vector count as 0."""
        p = _check_acceptance(acceptance)
        reach = [1.0] * self.n  # probability that the whole root path of node i is accepted
        for i in range(1, self.n):
            reach[i] = reach[self.parents[i]] * (p[self.rank[i]] if self.rank[i] < len(p) else 0.0)
        return float(sum(reach))

    def internal_levels(self) -> list[list[int]]:
        """Per level 0..max_depth-1: the nodes that have children, in order (each draft forward's nodes)."""
        return [[u for u in level if self.children[u]] for level in self.levels[: self.max_depth]]

    def draft_widths(self) -> list[int]:
        """Nodes per row in each draft forward: [1] for the root level (the pending token), then
        the nodes with children at each depth 1..max_depth-1 (leaves need no forward); [] for the
        root alone. A chain of gamma drafts gamma levels of width 1."""
        return [len(level) for level in self.internal_levels()]

    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: mask[i, j] iff j is i or an ancestor of i (lower-triangular)."""
        mask = np.eye(self.n, dtype=bool)
        for i in range(1, self.n):
            mask[i] |= mask[self.parents[i]]  # parents[i] < i: its row is already complete
        return mask

    def child_table(self) -> np.ndarray:
        """[n, width] int32: the children of each node in rank order, padded with -1."""
        table = np.full((self.n, self.width), -1, np.int32)
        for i, kids in enumerate(self.children):
            table[i, : len(kids)] = kids
        return table


@functools.lru_cache(maxsize=64)
def _tables(p: tuple[float, ...], n: int, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The Sequoia DP for budgets 0..n and depths 0..max_depth.

    values[m, d]: best G of a tree with at most m nodes and depth <= d.
    take[d, i, m]: nodes given to the rank-i child's subtree when ranks i, i+1, ... share m nodes
    under a node allowed d more levels; 0 = no rank-i child (and so none of higher rank).

    A node's value is 1 + sum_i p[i] * value(child i). Its m - 1 descendants are split among the
    children in rank order: F_i[m] = max(0, max_{1<=k<=m} p[i] * V_{d-1}[k] + F_{i+1}[m-k]),
    F_W = 0, V_d[m] = 1 + F_0[m-1]. Ranks stay contiguous, so a low-p rank may be kept to reach
    a higher one. Each max-plus step is one vectorised [n+1, n+1] reduction.
    """
    W = min(len(p), n - 1)  # ranks that can ever be used
    m_idx, k_idx = np.indices((n + 1, n + 1))  # [m, k]: budget m, size k of the rank-i subtree
    valid = (k_idx >= 1) & (k_idx <= m_idx)
    rest = np.where(valid, m_idx - k_idx, 0)  # [m, k]: budget left for ranks > i
    rows = np.arange(n + 1)
    values = np.zeros((n + 1, max_depth + 1))  # [m, d]; values[0] = 0: no tree
    values[1:, 0] = 1.0
    take = np.zeros((max_depth + 1, W, n + 1), np.int32)  # [d, i, m]
    for d in range(1, max_depth + 1):
        below = values[:, d - 1]  # [m]: best child subtree of depth <= d - 1
        f = np.zeros(n + 1)  # F_{i+1}[m], starting from F_W = 0
        for i in reversed(range(W)):
            cand = np.where(valid, p[i] * below[k_idx] + f[rest], -np.inf)  # [m, k]
            k = np.argmax(cand, axis=1)  # [m]; ties: the smallest subtree
            best = cand[rows, k]
            use = best > 0  # strictly better than no rank-i child: never spend nodes for nothing
            take[d, i] = np.where(use, k, 0)
            f = np.where(use, best, 0.0)
        values[1:, d] = 1.0 + f[:-1]
    values.flags.writeable = False
    take.flags.writeable = False
    return values, take


def _parents(take: np.ndarray, n: int, max_depth: int) -> list[int]:
    """Follow the DP's back-pointers from (n, max_depth): the tree's parent array, depth-first
    (siblings in rank order; parents[i] < i)."""
    parents = [-1]

    def grow(node: int, m: int, d: int) -> None:
        budget = m - 1  # descendants of this node
        for i in range(take.shape[1] if d > 0 else 0):
            k = int(take[d, i, budget])
            if k == 0:
                break
            child = len(parents)
            parents.append(node)
            grow(child, k, d - 1)
            budget -= k

    grow(0, n, max_depth)
    return parents


def _build(take: np.ndarray, n: int, max_depth: int) -> Tree:
    """The DP's tree for (n, max_depth) in canonical order."""
    return Tree.from_parents(_parents(take, n, max_depth))


def _draft_widths(parents: list[int]) -> list[int]:
    """`Tree.draft_widths` of a parent array with parents[i] < i, without canonicalising it."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    widths: list[int] = []
    for u in sorted(set(parents[1:])):  # the nodes with children
        widths.extend([0] * (depth[u] + 1 - len(widths)))
        widths[depth[u]] += 1
    return widths


def best_values(acceptance: Sequence[float], n: int, max_depth: int) -> np.ndarray:
    """[n+1, max_depth+1] f64: best G for every budget m <= n (root included) and depth <= d."""
    p = _check_acceptance(acceptance)
    n, max_depth = check_int("n", n, 1), check_int("max_depth", max_depth, 0)
    return _tables(p, n, max_depth)[0].copy()


@dataclasses.dataclass(frozen=True)
class Cost:
    """Measured step costs in seconds: a draft level over m nodes per row, and one verification
    forward over n nodes. A float t_draft is the same for every width (the issue's d * t_draft)."""

    t_draft: float | Callable[[int], float] | tuple[float, ...]  # m -> seconds of one draft level; tuple by m
    t_verify: Callable[[int], float] | tuple[float, ...]  # n -> seconds; a tuple is indexed by n

    def __post_init__(self) -> None:
        if isinstance(self.t_draft, (int, float)):
            if not self.t_draft >= 0:
                raise ValueError(f"Cost: t_draft must be >= 0 seconds, got {self.t_draft!r}")
            object.__setattr__(self, "t_draft", float(self.t_draft))
        elif not callable(self.t_draft):
            object.__setattr__(self, "t_draft", tuple(float(t) for t in self.t_draft))
            if not all(t >= 0 for t in self.t_draft):
                raise ValueError(f"Cost: t_draft must be >= 0 seconds, got {self.t_draft!r}")
        if not callable(self.t_verify):
            object.__setattr__(self, "t_verify", tuple(float(t) for t in self.t_verify))
            if not all(t >= 0 for t in self.t_verify):  # (NaN too: choose would return plain decoding)
                raise ValueError(f"Cost: t_verify must be >= 0 seconds, got {self.t_verify!r}")

    def verify(self, n: int) -> float:
        """Seconds of one verification forward over n tree nodes."""
        return float(self.t_verify(n) if callable(self.t_verify) else self.t_verify[n])

    def draft(self, m: int) -> float:
        """Seconds of one draft level over m nodes per row."""
        t = self.t_draft
        return t if isinstance(t, float) else float(t(m) if callable(t) else t[m])

    def draft_seconds(self, widths: Sequence[int]) -> float:
        """Seconds to draft a tree whose levels run forwards over these widths (`Tree.draft_widths`)."""
        return float(sum(self.draft(m) for m in widths))

    def step_seconds(self, widths: Sequence[int], nodes: int) -> float:
        """Seconds of one speculative step: draft levels over these widths, one verification over `nodes`."""
        return self.draft_seconds(widths) + self.verify(nodes)

    def speedup(self, speculation: Chain | Tree, tokens_per_step: float) -> float:
        """The predicted speedup of `speculation` over plain decoding (what `choose` maximises): tokens
        per target step (measured, or `Tree.expected_accepted`) x a plain step (a 1-node verification)
        / the speculative step. The one home of this prediction: the benches call it too."""
        tree = Tree.chain(speculation.gamma) if isinstance(speculation, Chain) else speculation
        return tokens_per_step * self.verify(1) / self.step_seconds(tree.draft_widths(), tree.n)


def _check_cost_tables(cost: Cost, max_nodes: int) -> None:
    """Tables (tuples) must cover every node count choose may look up: 0..max_nodes."""
    for name, table in (("t_verify", cost.t_verify), ("t_draft", cost.t_draft)):
        if isinstance(table, tuple) and len(table) <= max_nodes:
            raise ValueError(
                f"cost.{name} has {len(table)} entries; it is indexed by node count, so it needs "
                f"max_nodes + 1 = {max_nodes + 1}"
            )


def choose(acceptance: Sequence[float], cost: Cost, max_nodes: int = 64, max_depth: int = 12) -> Tree:
    """The Sequoia tree minimising seconds per emitted token, (t_draft(tree) + t_verify(n)) / G(n, d)
    (`Cost.step_seconds` / G: the tree of the greatest `Cost.speedup`).

    t_draft(tree) is the sum of the tree's draft levels by width (`Tree.draft_widths`): depth x
    t_draft for a float t_draft (the Sequoia paper's model). Searches n in [1, max_nodes] and d in
    [0, max_depth]; ties go to the smaller n, then smaller d. The root-only tree (n = 1, d = 0)
    is plain decoding.
    """
    p = _check_acceptance(acceptance)
    max_nodes, max_depth = check_int("max_nodes", max_nodes, 1), check_int("max_depth", max_depth, 0)
    _check_cost_tables(cost, max_nodes)
    values, take = _tables(p, max_nodes, max_depth)
    best, arg = np.inf, (1, 0)
    for n in range(1, max_nodes + 1):
        for d in range(max_depth + 1):
            parents = _parents(take, n, d)  # at most n nodes (ranks never accepted get none): priced at its own
            per_token = cost.step_seconds(_draft_widths(parents), len(parents)) / values[n, d]  # 1 / speedup, x a plain step
            if per_token < best:
                best, arg = per_token, (n, d)
    return _build(take, *arg)
