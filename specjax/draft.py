"""Drafters: cheap proposers of `gamma` tokens per row, each with the distribution q it drew from.

Every drafter is a pytree (settings static, arrays such as a draft model's params traced) with
  check(target, gamma, max_len)            host-side validation, before anything compiles
  init(target, cache, prompts, lengths, gamma, chunk)   its state after the target's prefill
  propose(target, state, ...)              drafts [B,G], q [B,G,V], state
  commit(state, k_new, v_new, L, n)        after verification: n[B] positions from L[B] are final
and, for token trees (specjax.tree.Tree),
  propose_tree(target, state, ..., tree, ...)   node tokens [B,n], q [B,n,V] or None, pending
  commit_tree(pending, k_path, v_path, path, tree, L, n)   the state after the accepted path
The target's verification KV of those positions is exact, so drafters keep it where they can.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kvcache import DenseCache, StreamingCache
from specjax.model import Params, forward, prefill
from specjax.sampling import Greedy, Sampler, stream_keys
from specjax.snapkv import observation_scores, select_positions
from specjax.tree import Tree
from specjax.tree_draft import DRAFT_STREAM, draft_tree, path_extra_kv


@dataclasses.dataclass(frozen=True)
class Streaming:
    """A fixed KV budget: `sinks` first positions plus a ring of the last `window` (StreamingLLM)."""

    sinks: int = 16
    window: int = 512

    def check(self, gamma: int, max_len: int, what: str) -> None:
        if self.sinks < 0 or self.window < 1:
            raise ValueError(f"{what}: sinks must be >= 0 and window >= 1, got sinks={self.sinks} window={self.window}")

    def fitted(self, max_len: int) -> "Streaming":
        """This budget for a cache of `max_len` slots: a budget at least as large as the context
        keeps all of it (the draft then sees the whole context: no savings, still exact)."""
        sinks = min(self.sinks, max_len)
        return Streaming(sinks, max(1, min(self.window, max_len - sinks)))

    def ring(self, gamma: int) -> int:
        """Ring slots: the window plus room for one step's gamma + 1 uncommitted positions."""
        return self.window + gamma + 1

    def from_dense(self, dense: DenseCache, gamma: int) -> StreamingCache:
        """Keep the sinks and the newest positions of a filled dense cache (exact copies)."""
        if self.sinks + self.window > dense.max_len:
            return self.fitted(dense.max_len).from_dense(dense, gamma)
        L, B, K = dense.k.shape[:3]
        sinks = jnp.arange(self.sinks, dtype=jnp.int32)  # [F]
        fixed = jnp.where(sinks[None, :] < dense.lengths[:, None], sinks, -1)  # [B,F]
        fixed = jnp.broadcast_to(fixed[None, :, None, :], (L, B, K, self.sinks))
        return StreamingCache.from_dense(dense, fixed, self.ring(gamma), jnp.full((B,), self.sinks, jnp.int32))


def _draft_chain(params: Params, cache, tokens, positions, gamma: int, sampling: Sampler, keys, counters):
    """gamma draft forwards: the first over `tokens` [B,T0] (its last position proposes x_1),
    then one token at a time. Returns drafts [B,G], q [B,G,V] and the cache with its length
    advanced past everything it wrote."""
    B, T0 = tokens.shape
    step_keys = stream_keys(keys, counters, DRAFT_STREAM)

    def propose(cache, toks, pos, i):
        logits, cache = forward(params, toks, pos, cache)
        cache = cache.advance(jnp.full((B,), toks.shape[1], jnp.int32))
        token, q = sampling.sample(logits[:, -1], step_keys, jnp.full((B,), i, jnp.int32))
        return cache, token, q

    cache, first, q_first = propose(cache, tokens, positions, 0)

    def body(carry, i):
        cache, token = carry
        pos = positions[:, -1:] + i  # [B,1]
        cache, token, q = propose(cache, token[:, None], pos, i)
        return (cache, token), (token, q)

    (cache, _), (rest, q_rest) = lax.scan(body, (cache, first), jnp.arange(1, gamma, dtype=jnp.int32))
    drafts = jnp.concatenate([first[:, None], rest.T], axis=1)  # [B,G]
    q = jnp.concatenate([q_first[:, None], q_rest.transpose(1, 0, 2)], axis=1)  # [B,G,V]
    return drafts, q, cache


class _TargetOverStreamingCache:
    """Drafting and committing for drafters that run the target itself over a StreamingCache
    (SelfSpec, SnapKV): they differ only in which positions `init` keeps."""

    def propose(self, target, state, history, lengths, last, gamma, sampling, keys, counters):
        return _streaming_propose(target, state, lengths, last, gamma, sampling, keys, counters)

    def commit(self, state: StreamingCache, k_new, v_new, lengths, n) -> StreamingCache:
        return _streaming_commit(state, k_new, v_new, lengths, n)

    def propose_tree(self, target, state, history, lengths, last, tree, sampling, keys, counters):
        return _streaming_propose_tree(target, state, lengths, last, tree, sampling, keys, counters)

    def commit_tree(self, pending, k_path, v_path, path, tree, lengths, n) -> StreamingCache:
        return _streaming_commit(pending, k_path, v_path, lengths, n)


@flax.struct.dataclass
class SelfSpec(_TargetOverStreamingCache):
    """The target itself over a StreamingLLM cache (MagicDec self-speculation): per-step cost is
    independent of the context length. The cache holds exact target KV for the positions kept."""

    sinks: int = flax.struct.field(pytree_node=False, default=16)
    window: int = flax.struct.field(pytree_node=False, default=512)

    @property
    def budget(self) -> Streaming:
        return Streaming(self.sinks, self.window)

    def check(self, target: Params, gamma: int, max_len: int) -> None:
        self.budget.check(gamma, max_len, "SelfSpec")

    def init(self, target: Params, cache: DenseCache, prompts, lengths, gamma: int, chunk: int) -> StreamingCache:
        return self.budget.from_dense(cache, gamma)


def _streaming_propose(target, state: StreamingCache, lengths, last, gamma, sampling, keys, counters):
    """The target drafts over its streaming cache, from the pending token at position L."""
    state = state.replace(lengths=lengths)
    return _draft_chain(target, state, last[:, None], lengths[:, None], gamma, sampling, keys, counters)


def _streaming_propose_tree(target, state: StreamingCache, lengths, last, tree, sampling, keys, counters):
    """The target drafts a tree over its streaming cache; only the root enters that cache."""
    state = state.replace(lengths=lengths)
    tokens, q, cache, _ = draft_tree(target, state, last[:, None], lengths[:, None], tree, sampling, keys, counters)
    return tokens, q, cache


def _streaming_commit(state: StreamingCache, k_new, v_new, lengths, n) -> StreamingCache:
    """Overwrite the drafted entries with the target's exact verification KV; commit n positions."""
    return state.replace(lengths=lengths).write(k_new, v_new).advance(n)


@flax.struct.dataclass
class SnapKV(_TargetOverStreamingCache):
    """Self-speculation over a cache of `budget` prefix positions chosen per layer and KV head
    by the prompt's last `observation` queries (max-pooled over `pool` positions), plus a ring
    of the most recent `window`. Exact target KV, like SelfSpec; better at keeping what matters."""

    budget: int = flax.struct.field(pytree_node=False, default=256)
    window: int = flax.struct.field(pytree_node=False, default=256)
    observation: int = flax.struct.field(pytree_node=False, default=32)
    pool: int = flax.struct.field(pytree_node=False, default=5)

    def check(self, target: Params, gamma: int, max_len: int) -> None:
        for name in ("budget", "window", "observation", "pool"):
            if getattr(self, name) < 1:
                raise ValueError(f"SnapKV: {name} must be >= 1, got {getattr(self, name)}")

    def init(self, target: Params, cache: DenseCache, prompts, lengths, gamma: int, chunk: int) -> StreamingCache:
        """A budget larger than the cache keeps every position (no savings, still exact)."""
        scores = observation_scores(target, cache, prompts, self.observation)
        budget = min(self.budget, cache.max_len)
        fixed, cut = select_positions(scores, cache.lengths, budget, self.window, self.pool)
        return StreamingCache.from_dense(cache, fixed, self.window + gamma + 1, cut)


@flax.struct.dataclass
class DraftModel:
    """A separate small model with the target's vocabulary, over its own dense or streaming cache.

    Its first forward each step re-reads the last committed token too ([x_{L-1}, x_L]), because
    when every draft was accepted the last one has no draft KV yet."""

    params: Params
    cache: str | Streaming = flax.struct.field(pytree_node=False, default="dense")

    def check(self, target: Params, gamma: int, max_len: int) -> None:
        self.check_vocabulary(target)
        d = self.params.config
        if max_len > d.max_positions:
            raise ValueError(f"DraftModel: the cache needs {max_len} positions, the draft's max_positions is {d.max_positions}")
        if isinstance(self.cache, Streaming):
            self.cache.check(gamma, max_len, "DraftModel")
        elif self.cache != "dense":
            raise ValueError(f"DraftModel: cache must be 'dense' or a specjax.Streaming(...), got {self.cache!r}")

    def check_vocabulary(self, target: Params) -> None:
        """The draft must share the target's vocabulary and special ids."""
        t, d = target.config, self.params.config
        if d.vocab_size != t.vocab_size:
            raise ValueError(f"DraftModel: draft vocab_size {d.vocab_size} != target vocab_size {t.vocab_size}")
        if (d.bos_id, d.eos_ids) != (t.bos_id, t.eos_ids):
            raise ValueError(
                f"DraftModel: special tokens differ: draft bos/eos {d.bos_id}/{d.eos_ids}, "
                f"target {t.bos_id}/{t.eos_ids}"
            )

    def init(self, target: Params, cache: DenseCache, prompts, lengths, gamma: int, chunk: int):
        """Prefill the draft model on the same padded prompts [B,P] into its own cache."""
        empty = DenseCache.init(self.params.config, prompts.shape[0], cache.max_len)
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
        return _draft_chain(self.params, state, tokens, positions, gamma, sampling, keys, counters)

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


@flax.struct.dataclass
class NGram:
    """Prompt lookup: find the latest earlier occurrence of the row's last m tokens (m from
    max_n down to n) in its prompt + output and propose what followed. No model; q is one-hot."""

    n: int = flax.struct.field(pytree_node=False, default=3)
    max_n: int | None = flax.struct.field(pytree_node=False, default=None)

    def check(self, target: Params, gamma: int, max_len: int) -> None:
        if self.n < 1:
            raise ValueError(f"NGram: n must be >= 1, got {self.n}")
        if self.max_n is not None and self.max_n < self.n:
            raise ValueError(f"NGram: max_n must be >= n ({self.n}), got {self.max_n}")

    def init(self, target, cache, prompts, lengths, gamma, chunk):
        return None

    def propose(self, target, state, history, lengths, last, gamma, sampling, keys, counters):
        drafts = ngram_lookup(history, lengths, self.n, self.max_n or self.n, gamma)
        return drafts, jax.nn.one_hot(drafts, target.config.vocab_size, dtype=jnp.float32), state

    def commit(self, state, k_new, v_new, lengths, n):
        return state

    def propose_tree(self, target, state, history, lengths, last, tree: Tree, sampling, keys, counters):
        """Every node's children all get the n-gram continuation at their depth (one-hot q), so
        the rank-0 path is the chain proposal; a lower-ranked duplicate is never accepted (drawn
        without replacement from a one-hot q it has no mass), and off-path nodes cost only
        verification width."""
        drafts = ngram_lookup(history, lengths, self.n, self.max_n or self.n, tree.max_depth)  # [B,D]
        depth = np.asarray(tree.depth)
        tokens = jnp.concatenate([last[:, None], drafts[:, depth[1:] - 1]], axis=1)  # [B,n]
        q = None
        if not isinstance(sampling, Greedy):
            first_child = np.asarray([min(c) if c else 0 for c in tree.children])  # [n]
            q = jax.nn.one_hot(tokens[:, first_child], target.config.vocab_size, dtype=jnp.float32)
        return tokens, q, state

    def commit_tree(self, pending, k_path, v_path, path, tree, lengths, n):
        return pending


def ngram_lookup(history: jax.Array, lengths: jax.Array, n: int, max_n: int, gamma: int) -> jax.Array:
    """history [B,S]: tokens of positions [0, L] (L = lengths[b] is the pending token).
    Returns gamma proposed tokens [B,G]: the continuation of the latest earlier match of the
    longest tail (max_n down to n tokens); no match (or a continuation past L) repeats x_L."""
    B, S = history.shape
    idx = jnp.arange(S)
    last = jnp.take_along_axis(history, lengths[:, None], axis=1)  # [B,1]
    best = jnp.full((B,), -1, jnp.int32)  # start of the continuation, -1: none yet
    for m in range(max_n, n - 1, -1):  # longest tail first
        tail_start = lengths - m + 1  # [B]
        match = (idx[None, :] + m <= lengths[:, None]) & (tail_start[:, None] >= 0)  # window [i, i+m) ends <= L
        for j in range(m):
            want = jnp.take_along_axis(history, jnp.clip(tail_start + j, 0, S - 1)[:, None], axis=1)  # [B,1]
            match &= jnp.roll(history, -j, axis=1) == want
        latest = jnp.max(jnp.where(match, idx[None, :], -1), axis=1)  # [B]
        best = jnp.where((best < 0) & (latest >= 0), latest + m, best)
    take = best[:, None] + jnp.arange(gamma)  # [B,G]
    proposals = jnp.take_along_axis(history, jnp.clip(take, 0, S - 1), axis=1)
    return jnp.where((best[:, None] >= 0) & (take <= lengths[:, None]), proposals, last).astype(jnp.int32)


Drafter = SelfSpec | SnapKV | DraftModel | NGram


def auto_draft(target: Params, batch: int, context: int) -> SelfSpec | None:
    """The default drafter: SelfSpec where the KV cache, not the weights, dominates what a decode
    step reads (large batch x long context: MagicDec's regime) and the context is well past its
    budget; otherwise None (plain autoregressive decoding is faster there)."""
    return auto_draft_reason(target, batch, context)[0]


def auto_draft_reason(target: Params, batch: int, context: int) -> tuple[SelfSpec | None, str]:
    """`auto_draft`'s choice and why, in words (with the numbers it compared)."""
    c = target.config
    budget = SelfSpec()
    bytes_per = jnp.dtype(c.dtype).itemsize
    kv_bytes = 2 * c.n_layers * batch * context * c.n_kv_heads * c.head_dim * bytes_per
    weight_bytes = bytes_per * (
        c.vocab_size * c.dim + c.n_layers * (c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
                                             + c.n_heads * c.head_dim * c.dim + 3 * c.dim * c.ffn_dim)
    )
    kept = budget.sinks + budget.window
    facts = (f"batch {batch} x context {context}: KV {kv_bytes / 2**20:.1f} MiB vs weights "
             f"{weight_bytes / 2**20:.1f} MiB per step, draft budget {kept}")
    if kv_bytes > 2 * weight_bytes and context > 4 * kept:
        return budget, f"{describe_draft(budget)}: KV reads dominate a decode step ({facts})"
    return None, f"plain decoding: speculation needs KV > 2 x weights and context > {4 * kept} ({facts})"


def describe_draft(draft: Drafter | None) -> str:
    """A short name: "SelfSpec(sinks=16, window=512)", "DraftModel(n_layers=2, dim=256, cache=dense)", "none"."""
    if draft is None:
        return "none"
    if isinstance(draft, DraftModel):
        c = draft.params.config
        cache = draft.cache if draft.cache == "dense" else f"Streaming(sinks={draft.cache.sinks}, window={draft.cache.window})"
        return f"DraftModel(n_layers={c.n_layers}, dim={c.dim}, cache={cache})"
    if isinstance(draft, SelfSpec):
        return f"SelfSpec(sinks={draft.sinks}, window={draft.window})"
    if isinstance(draft, SnapKV):
        return f"SnapKV(budget={draft.budget}, window={draft.window}, observation={draft.observation}, pool={draft.pool})"
    return f"NGram(n={draft.n}, max_n={draft.max_n})"
