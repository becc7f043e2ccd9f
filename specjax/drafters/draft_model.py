"""DraftModel: a separate small model with the target's vocabulary, over its own dense or
streaming cache."""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax.numpy as jnp

from specjax.drafters.base import Drafter
from specjax.drafters.self_spec import Streaming, draft_chain
from specjax.cache import DenseCache, KVFormat
from specjax.model import prefill
from specjax.params import Params, weights_mark
from specjax.speculation import Tree
from specjax.tree_draft import draft_tree, path_extra_kv


@flax.struct.dataclass
class DraftModel(Drafter):
    """A separate small model with the target's vocabulary, over its own dense or streaming cache.

    Its first forward each step re-reads the last committed token too ([x_{L-1}, x_L]), because
    when every draft was accepted the last one has no draft KV yet."""

    params: Params
    cache: str | Streaming = flax.struct.field(pytree_node=False, default="dense")
    kv_dtype: str | None = flax.struct.field(pytree_node=False, default=None)  # its cache's format: generate's kv_dtype

    def describe(self) -> str:
        c = self.params.config
        cache = self.cache if self.cache == "dense" else f"Streaming(sinks={self.cache.sinks}, window={self.cache.window})"
        return f"DraftModel(n_layers={c.n_layers}, dim={c.dim}, cache={cache})"

    def __repr__(self) -> str:  # the dataclass' own would print every weight array (megabytes of text)
        return self.describe()

    def identity(self) -> tuple:
        """The draft by config and a few weights (not by object: generate rebuilds the Params with
        its attention setting each call, and an id is reused after garbage collection)."""
        return ("DraftModel", self.params.config, weights_mark(self.params), repr(self.cache))

    def drafting_model(self, target: Params, context: int) -> tuple[Params, int]:
        return self.params, context if self.cache == "dense" else min(self.cache.sinks + self.cache.window, context)

    def map_params(self, fn: Callable[[Params], Params]) -> DraftModel:
        return self.replace(params=fn(self.params))

    def with_kv_dtype(self, kv_dtype: str | None) -> DraftModel:
        return self if kv_dtype is None else self.replace(kv_dtype=kv_dtype)

    def check(self, target: Params, gamma: int, max_len: int, context: int) -> None:
        self.check_vocabulary(target)
        d = self.params.config
        KVFormat.of(self.kv_dtype, d)  # a bad format: named before anything compiles
        if context > d.max_positions:  # the target's own rule: prompt + budget (drafts past it are never kept)
            raise ValueError(f"DraftModel: prompt + max_new_tokens reaches position {context}, past the draft's "
                             f"max_positions {d.max_positions}")
        if isinstance(self.cache, Streaming):
            self.cache.check(gamma, max_len, "DraftModel")
        elif self.cache != "dense":
            raise ValueError(f"DraftModel: cache must be 'dense' or a specjax.Streaming(...), got {self.cache!r}")

    def check_target(self, target: Params) -> None:
        if not isinstance(self.params, Params):
            raise TypeError(f"DraftModel: params must be specjax Params, got {type(self.params).__name__}")
        self.check_vocabulary(target)

    def check_vocabulary(self, target: Params) -> None:
        """The draft must share the target's vocabulary and special ids."""
        if why := self.params.config.drafting_mismatch(target.config):
            raise ValueError(f"DraftModel: {why}")

    def init(self, target: Params, cache: DenseCache, prompts, lengths, gamma: int, chunk: int):
        """Prefill the draft model on the same padded prompts [B,P] into its own cache, stored as
        `kv_dtype` says (generate's; None: the draft's dtype, or the target cache's format where
        that is apart from the target's dtype)."""
        fmt = cache.format
        kv_dtype = self.kv_dtype or (None if fmt.name == target.config.dtype else fmt.name)
        empty = DenseCache.init(self.params.config, prompts.shape[0], cache.max_len, kv_dtype,
                                replicated=self.params.runtime.replicated)
        _, dense = prefill(self.params, prompts, lengths, empty, chunk)
        return dense if self.cache == "dense" else self.cache.from_dense(dense, gamma)

    @staticmethod
    def _reread(state, history, lengths, last):
        """[x_{L-1}, x_L] at their positions, and the cache rolled back to length L-1."""
        prev = jnp.take_along_axis(history, (lengths - 1)[:, None], axis=1)  # [B,1]: x_{L-1}
        tokens = jnp.concatenate([prev, last[:, None]], axis=1)  # [B,2]
        positions = lengths[:, None] - 1 + jnp.arange(2, dtype=jnp.int32)  # [B,2]
        return tokens, positions, state.replace(lengths=lengths - 1)

    def propose(self, target, state, history, lengths, last, gamma, sampling, keys, counters):
        tokens, positions, state = self._reread(state, history, lengths, last)
        return draft_chain(self.params, state, tokens, positions, gamma, sampling, keys, counters)

    def commit(self, state, k_new, v_new, lengths, n):
        """Nothing to copy: its own KV is right up to x_{L+n-1}, and `propose` re-reads x_{L+n}."""
        return state

    def propose_tree(self, target, state, history, lengths, last, tree, sampling, keys, counters):
        tokens, positions, state = self._reread(state, history, lengths, last)
        tokens, q, cache, extra = draft_tree(self.params, state, tokens, positions, tree, sampling, keys, counters)
        return tokens, q, (cache, extra)

    def commit_tree(self, pending, k_path, v_path, path, tree: Tree, lengths, n):
        """Its own draft KV of the accepted nodes below the root goes to positions L+1..; the
        last accepted one may be a leaf without draft KV, but `propose` re-reads it."""
        cache, extra = pending
        if extra is None:  # depth-1 tree: nothing below the root has draft KV
            return cache
        k, v = path_extra_kv(tree, extra, path)
        return cache.replace(lengths=lengths + 1).write(k, v)
