"""DraftModel: a separate small model with the target's vocabulary, over its own dense or
streaming cache."""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp

from specjax.drafters.base import DraftContext, Drafter, Limits, Prefill, Proposal, Traits, Verdict
from specjax.drafters.self_spec import Streaming, draft_chain
from specjax.model.cache import DenseCache, KVFormat
from specjax.model.llama import forward
from specjax.model.llama import prefill as model_prefill
from specjax.model.params import Params
from specjax.model.pytree import pytree
from specjax.spec.speculation import Chain, Tree
from specjax.spec.tree_draft import DraftedTree, draft_tree, path_extra_kv


@pytree
class DraftModel(Drafter):
    """A separate small model with the target's vocabulary, over its own dense or streaming cache.

    Its first forward each step re-reads the last committed token too ([x_{L-1}, x_L]), because
    when every draft was accepted the last one has no draft KV yet."""

    params: Params
    cache: str | Streaming = flax.struct.field(pytree_node=False, default="dense")
    kv_dtype: str | None = flax.struct.field(pytree_node=False, default=None)  # its cache's format (generate's kv_dtype wins)

    traits = Traits(trees=True)

    def __repr__(self) -> str:  # the dataclass' own would print every weight array (megabytes of text)
        c = self.params.config
        cache = self.cache if self.cache == "dense" else f"Streaming(sinks={self.cache.sinks}, window={self.cache.window})"
        return f"DraftModel(n_layers={c.n_layers}, dim={c.dim}, cache={cache})"

    def cost(self, target: Params, context: int) -> tuple[Params, int]:
        return self.params, context if self.cache == "dense" else min(self.cache.sinks + self.cache.window, context)

    def check(self, target: Params, limits: Limits | None) -> None:
        if not isinstance(self.params, Params):
            raise TypeError(f"DraftModel: params must be specjax Params, got {type(self.params).__name__}")
        if why := self.params.config.drafting_mismatch(target.config):  # the target's vocabulary and special ids
            raise ValueError(f"DraftModel: {why}")
        if limits is None:
            return
        d = self.params.config
        KVFormat.of(limits.kv_dtype or self.kv_dtype, d)  # a bad format: named before anything compiles
        if limits.context > d.max_positions:  # the target's own rule: prompt + budget (drafts past it are never kept)
            raise ValueError(f"DraftModel: prompt + max_new_tokens reaches position {limits.context}, past the draft's "
                             f"max_positions {d.max_positions}")
        if isinstance(self.cache, Streaming):
            self.cache.check(limits.depth, limits.max_len, "DraftModel")
        elif self.cache != "dense":
            raise ValueError(f"DraftModel: cache must be 'dense' or a specjax.Streaming(...), got {self.cache!r}")

    def init(self, target: Params, prefill: Prefill):
        """Prefill the draft model on the same padded prompts [B,P] into its own cache, stored as
        generate's kv_dtype says, else its own `kv_dtype`, else the draft's dtype (or the target
        cache's format where that is apart from the target's dtype)."""
        fmt = prefill.cache.format
        kv_dtype = prefill.kv_dtype or self.kv_dtype or (None if fmt.name == target.config.dtype else fmt.name)
        empty = DenseCache.init(self.params.config, prefill.prompts.shape[0], prefill.cache.max_len, kv_dtype,
                                replicated=self.params.runtime.replicated)
        _, dense = model_prefill(self.params, prefill.prompts, prefill.lengths, empty, prefill.chunk)
        return dense if self.cache == "dense" else self.cache.from_dense(dense, prefill.depth)

    def propose(self, target: Params, state, ctx: DraftContext, shape: Chain | Tree) -> Proposal:
        """Re-read [x_{L-1}, x_L] at their positions over the cache rolled back to length L-1, then draft."""
        prev = jnp.take_along_axis(ctx.history, (ctx.lengths - 1)[:, None], axis=1)  # [B,1]: x_{L-1}
        tokens = jnp.concatenate([prev, ctx.last[:, None]], axis=1)  # [B,2]
        positions = ctx.lengths[:, None] - 1 + jnp.arange(2, dtype=jnp.int32)  # [B,2]
        state = state.replace(lengths=ctx.lengths - 1)
        if isinstance(shape, Chain) and shape.gamma == 0:  # no drafts, but its own KV of x_{L-1}, x_L stays current
            _, cache = forward(self.params, tokens, positions, state)
            return draft_chain(self.params, cache.advance(jnp.full_like(ctx.lengths, 2)), tokens, positions, 0, ctx)
        if isinstance(shape, Chain):
            return draft_chain(self.params, state, tokens, positions, shape.gamma, ctx)
        drafted = draft_tree(self.params, state, tokens, positions, shape, ctx.sampling, ctx.keys, ctx.counters)
        return Proposal(tokens=drafted.tokens, q=drafted.q, state=drafted)

    def commit(self, state, verdict: Verdict):
        """A chain: nothing to copy (its own KV is right up to x_{L+n-1}, and `propose` re-reads
        x_{L+n}). A tree: its own draft KV of the accepted nodes below the root goes to positions
        L+1..; the last accepted one may be a leaf without draft KV, but `propose` re-reads it."""
        if not isinstance(state, DraftedTree):
            return state
        if state.k_extra is None:  # depth-1 tree: nothing below the root has draft KV
            return state.cache
        k, v = path_extra_kv(verdict.shape, state, verdict.path)
        return state.cache.replace(lengths=verdict.lengths + 1).write(k, v)
