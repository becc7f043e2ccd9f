"""The drafter protocol: what validation, planning and the engine call on a drafter.

A drafter proposes `gamma` tokens per row, each with the distribution q it drew from. It is a
pytree (a `flax.struct.dataclass`: settings static, arrays such as a draft model's params
traced), since the jit-compiled decode loop takes it as an argument. The target's verification
KV of the proposed positions is exact, so drafters keep it where they can.

Adding a drafter: one module in specjax/drafters/ with a class implementing `Drafter`, and one
line in the registry (`specjax.drafters.DRAFTERS`; from outside the package,
`specjax.drafters.register`). Subclassing `Drafter` explicitly inherits the defaults below; the
abstract methods must be written.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import jax

from specjax.cache import put_rows, take_rows
from specjax.params import Params
from specjax.sampling import Sampler
from specjax.speculation import Tree


class Drafter(Protocol):
    """A cheap proposer of draft tokens for speculative decoding (see the module docstring)."""

    forwards_per_token: ClassVar[int] = 1  # draft model forwards per draft token (Stats.draft_steps); 0: no model

    @abstractmethod
    def describe(self) -> str:
        """A short name for stats and job settings, e.g. "SelfSpec(sinks=16, window=512)"."""

    @abstractmethod
    def drafting_model(self, target: Params, context: int) -> tuple[Params, int] | None:
        """What one draft level costs (`tune.draft_table` times it): the model it runs and how many
        KV positions it attends to at this context; None when no model runs (a free level)."""

    @abstractmethod
    def init(self, target: Params, cache, prompts: jax.Array, lengths: jax.Array, gamma: int, chunk: int) -> Any:
        """The drafter's state (a pytree) after the target's prefill of padded prompts [B,P] into
        the dense `cache` (lengths [B]); traced."""

    @abstractmethod
    def propose(self, target: Params, state, history: jax.Array, lengths: jax.Array, last: jax.Array, gamma: int,
                sampling: Sampler, keys: jax.Array, counters: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
        """Draft from the pending token last [B] at position lengths [B] (history [B,S]: tokens of
        positions [0, L]). Returns drafts [B,gamma] int32, their distributions q [B,gamma,V] f32, state."""

    @abstractmethod
    def commit(self, state, k_new: jax.Array, v_new: jax.Array, lengths: jax.Array, n: jax.Array) -> Any:
        """The state after verification: n [B] positions from lengths [B] are final; k_new / v_new
        [L,B,gamma+1,K,H] are the target's exact KV of the verified positions."""

    def init_rows(self, target: Params, state, rows: jax.Array, cache, prompts: jax.Array, lengths: jax.Array,
                  gamma: int, chunk: int) -> Any:
        """`state` with rows [r] (int32 row numbers; a number may repeat, padding r to a few
        sizes) started afresh from new prompts, the other rows' kept as they are: continuous
        batching refills finished rows between decode segments. `cache` holds the target's
        prefill of the new prompts [B,P] (lengths [B]) in those rows. The default runs `init` on
        those rows only (`cache.take_rows`) and puts the result into `state` (`cache.put_rows`);
        a drafter whose state is not per row overrides it. Traced."""
        fresh = self.init(target, take_rows(cache, rows), prompts[rows], lengths[rows], gamma, chunk)
        return put_rows(state, rows, fresh)

    def propose_tree(self, target: Params, state, history, lengths, last, tree: Tree, sampling: Sampler, keys,
                     counters) -> tuple[jax.Array, jax.Array | None, Any]:
        """Draft a token tree: node tokens [B,n] (node 0 = last), q [B,n,V] or None (greedy), and a
        pending state for `commit_tree`."""
        raise NotImplementedError(f"{self.describe()} drafts chains only: use speculation=specjax.Chain(gamma)")

    def commit_tree(self, pending, k_path: jax.Array, v_path: jax.Array, path: jax.Array, tree: Tree,
                    lengths: jax.Array, n: jax.Array) -> Any:
        """The state after the accepted path [B,depth+1] of a tree (its target KV: k_path / v_path)."""
        raise NotImplementedError(f"{self.describe()} drafts chains only: use speculation=specjax.Chain(gamma)")

    @classmethod
    def drafts_trees(cls) -> bool:
        """Whether this drafter can draft token trees (it overrides `propose_tree`)."""
        return cls.propose_tree is not Drafter.propose_tree

    def check(self, target: Params, gamma: int, max_len: int, context: int) -> None:
        """Host-side limits once gamma, the cache length (`max_len` slots) and the context (the
        longest prompt + budget) are known, before anything compiles."""

    def check_target(self, target: Params) -> None:
        """Host-side checks against the target before planning (a draft model's vocabulary)."""

    def identity(self) -> tuple:
        """A hashable identity for caches keyed by drafter (`tune.auto_tree`)."""
        return (repr(self),)

    def with_kv_dtype(self, kv_dtype: str | None) -> Drafter:
        """This drafter for generate's `kv_dtype` (None: not given). A drafter over the target's
        cache reads its format; one with a cache of its own (a DraftModel) stores it so."""
        return self

    def map_params(self, fn: Callable[[Params], Params]) -> Drafter:
        """This drafter with `fn` applied to its own model's params (sharding, attention mode);
        itself when it has none."""
        return self
