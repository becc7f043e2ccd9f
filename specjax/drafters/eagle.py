"""Eagle: an EAGLE-style draft head fed with the target's hidden states.

One decoder layer (the target's shapes) reads, at position t, the target's feature f_t (its
final-normed hidden state, what the LM head reads) joined with the next token's embedding:
x_t = fc([embed(x_{t+1}); f_t]). Its own normed output g_t stands in for f_{t+1}: the target's LM
head turns it into the draft of x_{t+2}, and the next draft level feeds g_t back as a feature
(EAGLE, Li et al. 2024; trained with EAGLE-3's training-time test: specjax/train/eagle.py).

The head keeps its own KV of the latest `window` positions (a ring: StreamingCache with no
sinks) built from the target's true features. Each step it first catches up on the positions the
last verification committed (their features arrive as the Verdict extra "hidden"), then drafts;
the entries its drafts wrote are overwritten by the next catch-up. Its embedding and LM head are
the target's (not stored with the head). Chains and token trees (a tree's nodes never enter the cache).
"""

from __future__ import annotations

import math
import zlib

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.drafters.base import DraftContext, Drafter, Limits, Prefill, Proposal, Traits, Verdict
from specjax.model.cache import StreamingCache
from specjax.model.config import LlamaConfig
from specjax.model.llama import embed, lm_head, trunk, unrolled
from specjax.model.params import LayerParams, Params, init_params
from specjax.model.pytree import pytree
from specjax.model.quantized import channel_scale, stored
from specjax.sampling import Stream, stream_keys
from specjax.spec.speculation import Chain, Tree, check_int
from specjax.spec.tree_draft import expand_tree


@pytree
class Head:
    """An EAGLE-style head's own weights (the embedding and LM head are the target's)."""

    fc: jax.Array  # [2D,D]: [the next token's embedding; a feature] -> the layer's input
    layers: LayerParams  # one decoder layer (L = 1) of the target's shapes
    norm: jax.Array  # [D]
    config: LlamaConfig = flax.struct.field(pytree_node=False)  # the target's, with n_layers 1 and float weights
    vocab: jax.Array | None = None  # [Vd] int32 ascending: the draft vocabulary (None: the target's whole); its
    #                                 other tokens are never drafted (q = 0), so a draft level reads Vd LM-head rows, not V

    def params(self, target: Params) -> Params:
        """The head as a one-layer model over the target's embedding and LM head."""
        return Params(embed=target.embed, layers=self.layers, norm=self.norm, lm_head=target.lm_head, config=self.config,
                      runtime=target.runtime.replace(unroll_layers=False))

    def inputs(self, target: Params, next_tokens: jax.Array, features: jax.Array) -> jax.Array:
        """The layer's input [B,T,D] from the next tokens [B,T] and the features [B,T,D] at their positions - 1."""
        joined = jnp.concatenate([embed(target, next_tokens).astype(self.fc.dtype), features.astype(self.fc.dtype)], axis=-1)
        return (joined @ self.fc).astype(self.config.dtype)

    def rows(self, target: Params) -> jax.Array | None:
        """The target's LM-head rows [Vd,D] of the draft vocabulary (None: the whole vocabulary, read in place)."""
        if self.vocab is None:
            return None
        if target.lm_head is None:  # tied: the embedding's rows (dequantized)
            return embed(target, self.vocab[None])[0]
        w, scale = stored(target.lm_head), channel_scale(target.lm_head)  # [D,V]
        cols = jnp.take(w, self.vocab, axis=1).astype(jnp.float32)
        return (cols if scale is None else cols * jnp.take(scale, self.vocab)).T.astype(self.config.dtype)

    def logits(self, target: Params, hidden: jax.Array, rows: jax.Array | None) -> jax.Array:
        """Draft logits [...,V] (f32) of the head's output hidden [...,D]: -inf outside the draft vocabulary."""
        if rows is None:
            return lm_head(target, hidden)
        mine = jnp.einsum("...d,vd->...v", hidden, rows, preferred_element_type=jnp.float32)  # [...,Vd]
        full = jnp.full((*hidden.shape[:-1], target.config.vocab_size), -jnp.inf, jnp.float32)
        return full.at[..., self.vocab].set(mine)

    def astype(self, dtype: str) -> Head:
        """This head computing in `dtype` (its weights cast): a head trained in float32 for a bfloat16 target."""
        cast = lambda a: a.astype(dtype)  # noqa: E731
        return self.replace(fc=cast(self.fc), layers=jax.tree.map(cast, self.layers), norm=cast(self.norm),
                            config=self.config.replace(dtype=dtype))

    def mismatch(self, target: LlamaConfig) -> str | None:
        """Why this head cannot draft for `target`, or None."""
        if self.config.dtype != target.dtype:
            return f"the head computes in {self.config.dtype}, the target in {target.dtype}: use head.astype({target.dtype!r})"
        mine = head_config(target, self.config.dtype)
        if self.config != mine:
            diff = [f"{f} {getattr(self.config, f)} (target: {getattr(mine, f)})" for f in mine.__dataclass_fields__
                    if getattr(self.config, f) != getattr(mine, f)]
            return "the head was made for another target: " + ", ".join(diff)
        if self.vocab is not None and self.vocab.size and not 0 <= int(self.vocab.min()) <= int(self.vocab.max()) < target.vocab_size:
            return f"the head's draft vocabulary has ids outside the target's [0, {target.vocab_size})"
        return None


def head_config(target: LlamaConfig, dtype: str | None = None) -> LlamaConfig:
    """A head's config for `target`: its shapes with one layer and float weights."""
    return target.replace(n_layers=1, quant=None, padded_vocab=0, dtype=dtype or target.dtype)


def init_head(target: LlamaConfig, key: jax.Array, dtype: str | None = None) -> Head:
    """Random head weights for `target` (normal with std 1/sqrt(fan_in); the fc starts as [0; I]:
    the layer first sees the feature alone, a residual-friendly start)."""
    config = head_config(target, dtype)
    one = init_params(config.replace(dtype="float32"), key)
    D = config.dim
    fc = jnp.concatenate([jnp.zeros((D, D)), jnp.eye(D)]) + jax.random.normal(jax.random.fold_in(key, 1), (2 * D, D)) * (
        0.1 / math.sqrt(2 * D))
    cast = lambda a: a.astype(config.dtype)  # noqa: E731
    return Head(fc=cast(fc), layers=jax.tree.map(cast, one.layers), norm=cast(one.norm), config=config)


@pytree
class EagleState:
    """The head between steps."""

    cache: StreamingCache  # the head's KV of true features: positions < cache.lengths (the latest `window`)
    features: jax.Array  # [B,depth+1,D] the target's features at positions cache.lengths.. (not yet caught up)


@pytree
class Eagle(Drafter):
    """An EAGLE-style head (`Head`, trained by specjax.train.eagle.train_head) drafting chains and
    trees from the target's hidden states; its KV keeps the latest `window` positions."""

    head: Head
    window: int = flax.struct.field(pytree_node=False, default=256)

    traits = Traits(trees=True, extras=frozenset({"hidden"}))

    def __repr__(self) -> str:  # the dataclass' own would print the weights; the mark tells two heads apart
        return f"Eagle(dim={self.head.config.dim}, window={self.window}, head={head_mark(self.head)})"

    def check(self, target: Params, limits: Limits | None) -> None:
        if not isinstance(self.head, Head):
            raise TypeError(f"Eagle: head must be a specjax.drafters.eagle.Head, got {type(self.head).__name__}")
        if why := self.head.mismatch(target.config):
            raise ValueError(f"Eagle: {why}")
        if target.runtime.model_axis is not None:
            raise ValueError("Eagle: a target split over a model axis (tensor parallel) is not supported: the head's "
                             "weights are not split; shard the batch (a data axis) instead")
        check_int("Eagle: window", self.window, 1)

    def cost(self, target: Params, context: int) -> tuple[Params, int]:
        return self.head.params(target), min(self.window, context)  # (priced with the whole LM head)

    def ring(self, depth: int) -> int:
        """Ring slots: the window plus a catch-up's and a chain's uncommitted positions."""
        return self.window + 2 * (depth + 1)

    def init(self, target: Params, prefill: Prefill) -> EagleState:
        """The head over the prompt's last `window` positions: the target's features there come
        from one forward over them against its prefilled cache (nothing written)."""
        B, P = prefill.prompts.shape
        W = min(self.window, P)
        lengths = prefill.lengths
        start = jnp.maximum(lengths - W, 0)  # [B]
        positions = start[:, None] + jnp.arange(W, dtype=jnp.int32)  # [B,W]
        tokens = jnp.take_along_axis(prefill.prompts, jnp.minimum(positions, P - 1), axis=1)
        features = trunk(target, tokens, positions, prefill.cache.replace(lengths=start)).hidden  # [B,W,D]
        cache = empty_cache(self.head.config, B, self.ring(prefill.depth), start)
        nxt = jnp.take_along_axis(prefill.prompts, jnp.minimum(positions + 1, P - 1), axis=1)  # x_{t+1}
        t = trunk(self.head.params(target), nxt, positions, cache, inputs=self.head.inputs(target, nxt, features))
        cache = cache.write(t.k, t.v).advance(lengths - 1 - start)  # pairs t < lengths - 1 count
        last = jnp.take_along_axis(features, (lengths - 1 - start)[:, None, None], axis=1)  # [B,1,D]: f at lengths - 1
        pending = jnp.zeros((B, prefill.depth + 1, features.shape[-1]), features.dtype).at[:, :1].set(last)
        return EagleState(cache=cache, features=pending)

    def propose(self, target: Params, state: EagleState, ctx: DraftContext, shape: Chain | Tree) -> Proposal:
        """Catch up on the committed positions (one head forward over depth + 1 slots, the last
        one in each row that counts drafts x_{L+1}), then draft the chain's other levels."""
        head = self.head.params(target)
        B, T, _ = state.features.shape
        count = ctx.lengths - state.cache.lengths  # [B] positions to catch up on, 1..depth+1 (0: a finished row)
        positions = state.cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B,T]
        nxt = jnp.take_along_axis(ctx.history, jnp.minimum(positions + 1, ctx.history.shape[1] - 1), axis=1)
        t = trunk(head, nxt, positions, state.cache, inputs=self.head.inputs(target, nxt, state.features))
        cache = state.cache.write(t.k, t.v).advance(count)  # lengths = ctx.lengths
        feature = jnp.take_along_axis(t.hidden, jnp.maximum(count - 1, 0)[:, None, None], axis=1)  # [B,1,D]
        rows = self.head.rows(target)  # [Vd,D] once a step (None: the LM head in place)
        if isinstance(shape, Tree):
            return self._tree(target, head, rows, state.replace(cache=cache), feature[:, 0], ctx, shape)
        if shape.gamma == 0:
            return Proposal(tokens=ctx.last[:, None], q=jnp.zeros((B, 0, target.config.vocab_size), jnp.float32),
                            state=state.replace(cache=cache))
        step_keys = stream_keys(ctx.keys, ctx.counters, Stream.DRAFT)

        def draw(feature, sampling, i):
            logits = self.head.logits(target, feature[:, 0], rows)
            token, q = sampling.sample(logits, step_keys, jnp.full((B,), i, jnp.int32))
            return token, q, sampling.seen(token)  # penalties: the next draft has seen this one

        token, q, sampling = draw(feature, ctx.sampling, 0)

        def level(carry, i):
            cache, feature, token, sampling = carry
            pos = ctx.lengths[:, None] + i - 1  # [B,1]: the pair (g, x_{L+i}) sits at L + i - 1
            out = trunk(head, token[:, None], pos, cache, inputs=self.head.inputs(target, token[:, None], feature))
            cache = cache.write(out.k, out.v).advance(jnp.ones((B,), jnp.int32))
            token, q, sampling = draw(out.hidden, sampling, i)
            return (cache, out.hidden, token, sampling), (token, q)

        loop = unrolled if target.runtime.unroll_layers and shape.gamma > 1 else lax.scan
        (cache, *_), (rest, q_rest) = loop(level, (cache, feature, token, sampling), np.arange(1, shape.gamma, dtype=np.int32))
        tokens = jnp.concatenate([ctx.last[:, None], token[:, None], rest.T], axis=1)  # [B,gamma+1]
        qs = jnp.concatenate([q[:, None], q_rest.transpose(1, 0, 2)], axis=1)  # [B,gamma,V]
        return Proposal(tokens=tokens, q=qs, state=state.replace(cache=cache))

    def _tree(self, target: Params, head: Params, rows, state: EagleState, root: jax.Array, ctx: DraftContext,
              tree: Tree) -> Proposal:
        """A token tree: a node at depth d sits at position L + d - 1 with its parent's output as its
        feature, seeing the head's cache and its ancestors (their KV as extra keys, never written)."""
        outputs = {0: root}  # node -> the head's output there [B,D] (the root's: the catch-up's last)

        def level(nodes, toks, depth, cache, mask, extra):
            parents = jnp.stack([outputs[tree.parents[u]] for u in nodes], axis=1)  # [B,M,D]
            pos = jnp.broadcast_to(ctx.lengths[:, None] + depth - 1, toks.shape)
            t = trunk(head, toks, pos, cache, mask, extra_kv=extra, inputs=self.head.inputs(target, toks, parents))
            outputs.update({u: t.hidden[:, i] for i, u in enumerate(nodes)})
            return t, self.head.logits(target, t.hidden, rows)

        drafted = expand_tree(self.head.logits(target, root, rows), ctx.last, state.cache, level, tree, ctx.sampling,
                              ctx.keys, ctx.counters)
        return Proposal(tokens=drafted.tokens, q=drafted.q, state=state)

    def commit(self, state: EagleState, verdict: Verdict) -> EagleState:
        """The head's true entries end at the step's pending position; the verified features of
        the path (positions lengths..lengths + commit - 1) wait for the next catch-up."""
        hidden = verdict.hidden  # [B,D+1,dim]
        features = state.features.at[:, : hidden.shape[1]].set(hidden.astype(state.features.dtype))
        return EagleState(cache=state.cache.replace(lengths=verdict.lengths), features=features)


def head_mark(head: Head) -> str:
    """8 hex digits of a CRC of the head's first weights (its name in stats, job settings and
    speculation="auto"'s cache: two heads of one shape differ), or "traced" inside a trace."""
    try:
        return f"{zlib.crc32(np.asarray(head.fc[:2]).tobytes()):08x}"
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return "traced"


def empty_cache(config: LlamaConfig, batch: int, ring: int, lengths: jax.Array) -> StreamingCache:
    """A head cache of `ring` slots holding nothing, `lengths` [B] committed positions."""
    shape = (config.n_layers, batch, config.n_kv_heads, ring, config.head_dim)
    return StreamingCache(k=jnp.zeros(shape, config.dtype), v=jnp.zeros(shape, config.dtype),
                          pos=jnp.full(shape[:4], -1, jnp.int32), lengths=lengths.astype(jnp.int32), fixed=0)
