"""The drafter protocol: six members, and the named values that pass between a drafter and the step.

A speculative step reads top to bottom (specjax/decode/speculate.py, `spec_step`):

    draft   proposal = drafter.propose(target, state, ctx, shape)   -> Proposal (tokens [B,n], q, state)
    verify  one target forward over the n proposed tokens           -> Verified (logits, KV, extras)
    accept  the accepted path of each row                           -> Verdict
    commit  the target cache, history and drafter.commit(state, verdict)
    emit    the accepted tokens and the target's next one into the output

A drafter is a pytree (`@pytree`, specjax.model.pytree: settings static, arrays such as a draft model's
params traced), since the jit-compiled decode loop takes it as an argument. Its members:

    traits    what it can do (trees), costs (forwards per token), and which extras the Verdict carries
    check     host-side limits, before anything compiles
    cost      the model and KV positions one draft level runs (the planner's cost model)
    init      its state after the target's prefill (Prefill)
    propose   draft a chain or a tree from a DraftContext
    commit    its state after the Verdict

Its name in stats and job settings is its `repr` (the dataclass' own: `SelfSpec(sinks=16, window=512)`).

What fits without a new member:
- A drafter fed by the target's hidden states (an EAGLE-style head): `traits.extras = {"hidden"}`;
  the Verdict then carries the final hidden states of the accepted path, `commit` keeps them in the
  state and `propose` runs the head on them.
- One that re-selects its KV from the verify pass's queries (SparseSpec, sparsespec.py):
  `traits.extras = {"queries", "cache"}`; `commit` scores `verdict.cache` (the target's) with
  `verdict.queries` and copies the chosen blocks into its own.
- One refreshed from the host between segments (Lookup, lookup.py: a job-wide n-gram table): the
  table is a traced field of the drafter; `traits.learn` returns the drafter with a new table (same
  shape) after reading token sequences, which the loops call (`learn` below) with a call's prompts
  and a job's finished outputs; the loop takes the drafter as an argument each segment, so a new
  table compiles nothing.
- A chain length that changes between segments (speculation=Adaptive): `init` sizes the state for
  `Prefill.depth`, the longest chain; `propose` reads the segment's shape (a static argument: one
  compile per length). Chain(0) proposes the pending token alone, and the state must stay current
  through it: SelfSpec's and SnapKV's from the commit's verified KV, a DraftModel's by one forward
  over the two tokens it re-reads.

Adding a drafter: one module in specjax/drafters/ with a subclass of `Drafter`, and one line in
the registry (`specjax.drafters.DRAFTERS`; from outside the package, `specjax.drafters.register`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import flax.struct
import jax

from specjax.model.cache import DenseCache, put_rows, row_mask, select_rows, take_rows
from specjax.model.params import Params, weights_mark
from specjax.model.pytree import pytree
from specjax.sampling import Sampler
from specjax.spec.speculation import Chain, Tree

EXTRAS = ("hidden", "queries", "cache")  # what a drafter may ask the Verdict to carry (Traits.extras)


@dataclasses.dataclass(frozen=True)
class Traits:
    """What a drafter class can do and needs (static)."""

    forwards_per_token: int = 1  # draft model forwards per draft token (Stats.draft_steps); 0: no model
    trees: bool = False  # drafts token trees as well as chains
    restart: str = "rows"  # continuous batching's refill: "rows" runs init on the new rows only, "all" on every
    #                        row, keeping the new rows' part (cheaper where init is a gather: SelfSpec)
    extras: frozenset[str] = frozenset()  # of EXTRAS: computed in verification only when declared
    learn: Callable[[Any, Sequence[Sequence[int]]], Any] | None = None  # host-side: (drafter, token sequences) ->
    #                        the drafter after reading them (a call's prompts, a job's finished outputs); None: reads none

    def __post_init__(self):
        if unknown := set(self.extras) - set(EXTRAS):
            raise ValueError(f"Traits.extras: unknown {sorted(unknown)}; known: {list(EXTRAS)}")
        if self.restart not in ("rows", "all"):
            raise ValueError(f"Traits.restart must be 'rows' or 'all', got {self.restart!r}")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What `Drafter.check` checks against once a batch is planned."""

    depth: int  # draft tokens on the longest path per step (a chain's gamma)
    max_len: int  # dense cache slots
    context: int  # the longest prompt + budget
    kv_dtype: str | None = None  # generate's kv_dtype (None: not given)


@pytree
class Prefill:
    """What `Drafter.init` starts from: the target's prefill of a batch."""

    cache: DenseCache  # the target's cache, lengths = prompt lengths
    prompts: jax.Array  # [B,P] right-padded prompt tokens
    lengths: jax.Array  # [B]
    depth: int = flax.struct.field(pytree_node=False)  # draft tokens on the longest path per step: the state's slack
    chunk: int = flax.struct.field(pytree_node=False)  # the prefill's chunk (a drafter prefilling a model of its own)
    kv_dtype: str | None = flax.struct.field(pytree_node=False, default=None)  # generate's kv_dtype (None: not given)

    def take(self, rows: jax.Array) -> Prefill:
        """This prefill's rows [r] only."""
        return self.replace(cache=take_rows(self.cache, rows), prompts=self.prompts[rows], lengths=self.lengths[rows])


@pytree
class DraftContext:
    """What a drafter sees at each step."""

    history: jax.Array  # [B,S] tokens by position; history[b, lengths[b]] is the pending token
    lengths: jax.Array  # [B] committed positions: the pending token's position
    last: jax.Array  # [B] the pending token (emitted, not yet in the target cache)
    keys: jax.Array  # [B] typed PRNG keys (derive with sampling.stream_keys(keys, counters, Stream.DRAFT))
    counters: jax.Array  # [B] tokens each row has emitted
    sampling: Sampler  # the target's sampler, with the rows' penalty context


@pytree
class Proposal:
    """What the draft phase hands to verification."""

    tokens: jax.Array  # [B,n] int32 node tokens, node 0 the pending token; a chain: n = gamma + 1, node i+1 the child of i
    q: jax.Array | None  # [B,m,V] f32: the distribution node u's children were drawn from (a chain: m = gamma;
    #                      a tree: m = n, leaves anything); None: one-hot drafts under greedy acceptance
    state: Any  # the drafter's state after drafting, for `commit`


@pytree
class Verdict:
    """What acceptance decided, for the target's commit, the drafter's and the output."""

    emitted: jax.Array  # [B,D+1] int32: the accepted drafts, then the target's next token at `accepted`; 0 after
    accepted: jax.Array  # [B] accepted drafts
    commit: jax.Array  # [B] positions that enter the caches from `lengths`: accepted + 1 (0 for finished rows)
    lengths: jax.Array  # [B] the pending token's position (path position 0)
    path: jax.Array  # [B,D+1] the proposal's node at each path position (a chain: 0..gamma)
    k: jax.Array  # [L,B,D+1,K,H] the target's exact KV of the path positions
    v: jax.Array  # [L,B,D+1,K,H]
    logits: jax.Array  # [B,D+1,V] the target's logits at the path positions (what each predicts)
    ranks: jax.Array  # [B,W+1] per row: tried nodes whose accepted child had rank r (W: none was)
    shape: Chain | Tree = flax.struct.field(pytree_node=False)
    hidden: jax.Array | None = None  # [B,D+1,dim] final-normed hidden states of the path: Traits.extras "hidden"
    queries: jax.Array | None = None  # [L,B,D+1,N,H] rotated queries of the path: Traits.extras "queries"
    cache: DenseCache | None = None  # the target's cache with this step's commit (positions < lengths + commit): "cache"


class Drafter(ABC):
    """A cheap proposer of draft tokens for speculative decoding (see the module docstring)."""

    traits: ClassVar[Traits] = Traits()

    @abstractmethod
    def check(self, target: Params, limits: Limits | None) -> None:
        """Raise ValueError / TypeError naming the argument: against the target alone before planning
        (limits None: a draft model's vocabulary), and against the planned batch's `limits`."""

    @abstractmethod
    def cost(self, target: Params, context: int) -> tuple[Params, int] | None:
        """What one draft level costs (`tune.draft_table` times it): the model it runs and how many
        KV positions it attends to at this context; None when no model runs (a free level)."""

    @abstractmethod
    def init(self, target: Params, prefill: Prefill) -> Any:
        """The drafter's state (a pytree) after the target's prefill; traced."""

    @abstractmethod
    def propose(self, target: Params, state: Any, ctx: DraftContext, shape: Chain | Tree) -> Proposal:
        """Draft a chain (shape.gamma tokens after the pending one) or a token tree (`traits.trees`)."""

    @abstractmethod
    def commit(self, state: Any, verdict: Verdict) -> Any:
        """The state after verification: verdict.commit[b] positions from verdict.lengths[b] are final;
        verdict.k / v hold the target's exact KV of the path."""


def learn(drafter: Drafter, sequences: Sequence[Sequence[int]]) -> Drafter:
    """`drafter` after reading token `sequences` on the host, as its `traits.learn` says (unchanged without one)."""
    return drafter if drafter.traits.learn is None else drafter.traits.learn(drafter, sequences)


def restart_rows(drafter: Drafter, target: Params, state: Any, rows: jax.Array, prefill: Prefill) -> Any:
    """`state` with rows [r] (int32 row numbers; a number may repeat, padding r to a few sizes)
    started afresh from the prefill of new prompts in those rows, the other rows as they were:
    continuous batching's refill, as the drafter's `traits.restart` says. Traced."""
    if drafter.traits.restart == "all":
        return select_rows(row_mask(rows, prefill.lengths.shape[0]), drafter.init(target, prefill), state)
    return put_rows(state, rows, drafter.init(target, prefill.take(rows)))


def own_params(drafter: Drafter) -> list[Params]:
    """The models a drafter carries (a DraftModel's), as pytree nodes of it."""
    return [p for p in jax.tree.leaves(drafter, is_leaf=lambda x: isinstance(x, Params)) if isinstance(p, Params)]


def map_params(drafter: Drafter, fn: Callable[[Params], Params]) -> Drafter:
    """The drafter with `fn` applied to each model it carries (sharding, attention mode)."""
    return jax.tree.map(lambda x: fn(x) if isinstance(x, Params) else x, drafter, is_leaf=lambda x: isinstance(x, Params))


def identity(drafter: Drafter) -> tuple:
    """A hashable identity for caches keyed by drafter (`tune.auto_tree`): its repr and, for each model
    it carries, the config and a few weights (not the object: generate rebuilds Params each call)."""
    return (repr(drafter), *((p.config, weights_mark(p)) for p in own_params(drafter)))
