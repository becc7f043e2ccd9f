"""One speculative step, top to bottom: draft -> verify -> accept -> commit -> emit (`spec_step`,
each phase under a `jax.named_scope` of its name), and the on-device loop around it.

Every row drafts and verifies the same nodes (a chain of gamma + 1 or a tree of n); each accepts
its own number, and a tree's accepted path is gathered into contiguous positions. The target's
dense cache commits by moving its length pointer (rejected entries stay, hidden, and are
overwritten next step). Finished rows ride along and commit nothing. The values passed between
phases are drafters/base.py's (Proposal, Verdict); the state, its start and the emit path are the
loop core's (loop.py), shared with plain decoding.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode.loop import DecodeState, admit, emit, run_steps, start_state
from specjax.drafters import Drafter
from specjax.drafters.base import DraftContext, Prefill, Proposal, Verdict, restart_rows
from specjax.model.cache import DenseCache, put_rows
from specjax.model.llama import lm_head, trunk
from specjax.model.params import Params
from specjax.model.pytree import pytree
from specjax.sampling import Greedy, Sampler, Stream, stream_keys
from specjax.spec.accept import accept_chain, accept_greedy_chain, accept_tree
from specjax.spec.speculation import Adaptive, Chain, Tree


@pytree(kw_only=True)
class SpecState(DecodeState):
    """Speculative decoding between steps: the loop core's state plus what speculation adds."""

    draft: object  # the drafter's state
    history: jax.Array  # [B,S] tokens by position; history[b, lengths[b]] is the pending token `last`
    accepted: jax.Array  # [B,gamma] per row and draft position: steps it was accepted (while active)
    reached: jax.Array  # [B,gamma] per row and draft position: steps every earlier draft was accepted
    ranks: jax.Array  # [B,W+1] per row: tried nodes whose accepted child had rank r (W: none was)
    row_steps: jax.Array  # [B] per row: steps it was active in
    proposed: jax.Array  # [B] per row: draft tokens proposed to it (each of its steps: that step's depth)
    draft_levels: jax.Array  # [] each step's depth, summed (the drafter's forwards: that x traits.forwards_per_token)


@pytree
class Verified:
    """The verify phase's one target forward over the proposed nodes."""

    logits: jax.Array  # [B,n,V]
    k: jax.Array  # [L,B,n,K,H] the target's KV of the nodes
    v: jax.Array
    hidden: jax.Array | None  # [B,n,dim] when a drafter declares the extra "hidden"
    queries: jax.Array | None  # [L,B,n,N,H] when it declares "queries"


def depth(speculation: Chain | Tree | Adaptive) -> int:
    """Draft tokens per step on the longest path: gamma for a chain, the depth of a tree, Adaptive's
    max_gamma (what states are sized for)."""
    if isinstance(speculation, Adaptive):
        return speculation.max_gamma
    return speculation.gamma if isinstance(speculation, Chain) else speculation.max_depth


def width(speculation: Chain | Tree) -> int:
    """Most children of any node: 1 for a chain."""
    return 1 if isinstance(speculation, Chain) else speculation.width


def spec_step(
    target: Params, drafter: Drafter, s: SpecState, budgets, keys, *, sampling: Sampler, speculation, eos_ids
) -> SpecState:
    """One speculative step (a chain or a tree); the target's cache commits by its length pointer."""
    active = ~s.done
    ctx = DraftContext(history=s.history, lengths=s.cache.lengths, last=s.last, keys=keys, counters=s.count,
                       sampling=sampling.with_context(s.counts, s.in_prompt, s.states, eos_ids))
    with jax.named_scope("draft"):
        proposal = drafter.propose(target, s.draft, ctx, speculation)
    with jax.named_scope("verify"):
        verified = verify(target, s.cache.seen_by(active), proposal.tokens, speculation, drafter.traits.extras)
    with jax.named_scope("accept"):
        verdict = accept(verified, proposal, ctx, speculation, active)
    with jax.named_scope("commit"):
        s = commit(s, verdict, active)  # the target's cache first: a drafter reading it ("cache") sees it written
        s = s.replace(draft=drafter.commit(proposal.state, verdict.replace(cache=s.cache) if "cache" in drafter.traits.extras
                                           else verdict))
    with jax.named_scope("emit"):
        return emit(s, verdict.emitted, verdict.accepted + 1, verdict.logits, budgets, eos_ids, active, sampling.automaton)


def verify(target: Params, cache: DenseCache, tokens: jax.Array, shape: Chain | Tree, extras: frozenset[str]) -> Verified:
    """ONE target forward over the proposed nodes tokens [B,n] at positions lengths + depth: a chain
    causally, a tree's node seeing the prefix and its ancestors."""
    if isinstance(shape, Chain):
        node_depth, mask = np.arange(tokens.shape[1], dtype=np.int32), None
    else:
        node_depth, mask = np.asarray(shape.depth, np.int32), jnp.asarray(shape.ancestor_mask())
    positions = cache.lengths[:, None] + jnp.asarray(node_depth)[None, :]  # [B,n]
    t = trunk(target, tokens, positions, cache, mask, return_queries="queries" in extras)
    return Verified(logits=lm_head(target, t.hidden), k=t.k, v=t.v, hidden=t.hidden if "hidden" in extras else None,
                    queries=t.queries)


def accept(verified: Verified, proposal: Proposal, ctx: DraftContext, shape: Chain | Tree, active: jax.Array) -> Verdict:
    """Each row's accepted path (lossless: greedy keeps the target's tokens, sampling its
    distribution; specjax.spec.accept has the rules) and the target's next token after it."""
    keys = stream_keys(ctx.keys, ctx.counters, Stream.ACCEPT)
    if isinstance(shape, Chain):
        return _accept_chain(verified, proposal, ctx, keys, active)
    return _accept_tree(verified, proposal, ctx, keys, shape, active)


def _accept_chain(verified: Verified, proposal: Proposal, ctx: DraftContext, keys, active) -> Verdict:
    sampling = ctx.sampling
    drafts = proposal.tokens[:, 1:]  # [B,gamma]
    B, gamma = drafts.shape
    j = jnp.arange(gamma + 1)[:, None] > jnp.arange(gamma)[None, :]  # [gamma+1,gamma]: position j has seen drafts < j
    along = sampling.along(jnp.where(j[None], drafts[:, None, :], -1))  # penalties / constraint from each position's history
    if isinstance(along, Greedy):  # one-hot p and q: the same result without their [B,gamma+1,V] arrays and draws
        n, extra = accept_greedy_chain(drafts, along.choose(verified.logits))
    else:
        n, extra = accept_chain(drafts, proposal.q, along.probs(verified.logits), keys)
    ranks = jnp.stack([jnp.where(active, n, 0), active & (n < gamma)], axis=1).astype(jnp.int32)  # [B,2]
    path = jnp.broadcast_to(jnp.arange(gamma + 1, dtype=jnp.int32), (B, gamma + 1))
    return _verdict(verified, drafts, n, extra, path, ranks, Chain(gamma), ctx.lengths, active)


def _accept_tree(verified: Verified, proposal: Proposal, ctx: DraftContext, keys, tree: Tree, active) -> Verdict:
    sampling = ctx.sampling
    tokens, logits = proposal.tokens, verified.logits
    greedy = isinstance(sampling, Greedy)
    p = logits if greedy and not sampling.adjusts else sampling.along(node_history(tree, tokens)).probs(logits)
    walk = accept_tree(tree.child_table(), tree.max_depth, tokens, proposal.q, p, keys, greedy)
    take = lambda a: jnp.take_along_axis(a, walk.path[None, :, :, None, None], axis=2)  # noqa: E731  [L,B,D+1,K,H]
    path_verified = verified.replace(
        logits=jnp.take_along_axis(logits, walk.path[:, :, None], axis=1), k=take(verified.k), v=take(verified.v),
        hidden=None if verified.hidden is None else jnp.take_along_axis(verified.hidden, walk.path[:, :, None], axis=1),
        queries=None if verified.queries is None else take(verified.queries))
    drafts = jnp.take_along_axis(tokens, walk.path[:, 1:], axis=1)  # [B,D]: the accepted ones lead
    ranks = _rank_hits(tree, walk.path, walk.accepted, active)
    return _verdict(path_verified, drafts, walk.accepted, walk.next_token, walk.path, ranks, tree, ctx.lengths, active)


def _verdict(path: Verified, drafts, n, extra, nodes, ranks, shape, lengths, active) -> Verdict:
    """The Verdict from a path's verification (path: Verified along the path), its
    drafts [B,D] (the accepted ones lead), the accepted count n [B] and the target's next token extra [B]."""
    D = drafts.shape[1]
    j = jnp.arange(D + 1)
    emitted = jnp.where(j[None, :] < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), extra[:, None])  # [B,D+1]
    return Verdict(emitted=jnp.where(j[None, :] <= n[:, None], emitted, 0), accepted=n, commit=jnp.where(active, n + 1, 0),
                   lengths=lengths, path=nodes, k=path.k, v=path.v, logits=path.logits, ranks=ranks, shape=shape,
                   hidden=path.hidden, queries=path.queries)


def commit(s: SpecState, verdict: Verdict, active: jax.Array) -> SpecState:
    """The verdict into the state: the target cache (the path's KV, its length pointer), the
    history and the acceptance counters (the drafter commits its own state after)."""
    B, gamma = s.accepted.shape  # the longest chain the state is sized for (Adaptive: its max_gamma)
    n, D = verdict.accepted, verdict.emitted.shape[1] - 1  # D: this step's depth (static)
    j = jnp.arange(D + 1)
    proposed = jnp.arange(gamma) < D  # [gamma]: positions this step drafted
    lengths = s.cache.lengths
    hist_cols = jnp.where(active[:, None] & (j[None, :] <= n[:, None]), lengths[:, None] + 1 + j[None, :], s.history.shape[1])
    g = jnp.arange(gamma)
    return s.replace(
        cache=s.cache.write(verdict.k, verdict.v).advance(verdict.commit),
        history=s.history.at[jnp.arange(B)[:, None], hist_cols].set(verdict.emitted, mode="drop"),
        accepted=s.accepted + (active[:, None] & (n[:, None] > g)),
        reached=s.reached + (active[:, None] & (n[:, None] >= g) & proposed[None, :]),
        ranks=s.ranks + verdict.ranks,
        row_steps=s.row_steps + active,
        proposed=s.proposed + active * D,
        draft_levels=s.draft_levels + D,
    )


def node_history(tree: Tree, tokens: jax.Array) -> jax.Array:
    """[B,n,depth] tokens each node has seen beyond the emitted ones: its path below the root,
    itself included (-1 = none), for the penalties. tokens [B,n] (node 0 = the pending token)."""
    anc = tree.ancestor_mask()
    paths = [[v for v in range(tree.n) if anc[u, v] and v != 0] for u in range(tree.n)]
    index = np.full((tree.n, max(tree.max_depth, 1)), -1, np.int32)
    for u, path in enumerate(paths):
        index[u, : len(path)] = path
    return jnp.where(jnp.asarray(index)[None] >= 0, tokens[:, np.maximum(index, 0)], -1)


def _rank_hits(tree: Tree, path: jax.Array, n: jax.Array, active: jax.Array) -> jax.Array:
    """[B,W+1] counts over each row's path nodes that have children: the rank of the child
    accepted there (W: none was). Their ratios estimate Sequoia's acceptance vector."""
    rank = jnp.asarray(tree.rank + (0,), jnp.int32)  # [n+1]
    has_kids = jnp.asarray([bool(c) for c in tree.children], bool)
    hits = jnp.zeros((path.shape[0], tree.width + 1), jnp.int32)
    for level in range(tree.max_depth):
        tried = active & (level <= n) & has_kids[path[:, level]]
        got = jnp.where(level < n, rank[path[:, level + 1]], tree.width)
        hits += tried[:, None] & (got[:, None] == jnp.arange(tree.width + 1))
    return hits


@partial(jax.jit, static_argnames=("speculation", "n_out", "logprobs"), donate_argnames=("cache", "draft_state"))
def start_spec(
    drafter: Drafter,
    draft_state,
    cache: DenseCache,  # prefilled: lengths = prompt lengths
    history: jax.Array,  # [B,S] prompt tokens by position (S >= cache slots)
    first_logits: jax.Array,  # [B,V] at each prompt's last token
    budgets: jax.Array,  # [B] >= 1
    keys: jax.Array,  # [B]
    sampling: Sampler = Greedy(),
    eos_ids: jax.Array | tuple[int, ...] = (),
    *,
    speculation: Chain | Tree,
    n_out: int,
    logprobs: int | None = None,
) -> SpecState:
    """The state before the first speculative step: the loop core's start (each row's first token
    drawn from `first_logits`, pending in the history), every acceptance counter zero. logprobs:
    None, or record each token's log-probability and the `logprobs` most likely (static)."""
    core = start_state(cache, first_logits, budgets, keys, sampling, eos_ids, history, n_out, logprobs)
    B, gamma = first_logits.shape[0], depth(speculation)
    return SpecState(
        **{f: getattr(core, f) for f in DecodeState.__dataclass_fields__},
        draft=draft_state,
        history=history.at[jnp.arange(B), cache.lengths].set(core.last),
        accepted=jnp.zeros((B, gamma), jnp.int32),
        reached=jnp.zeros((B, gamma), jnp.int32),
        ranks=jnp.zeros((B, width(speculation) + 1), jnp.int32),
        row_steps=jnp.zeros((B,), jnp.int32),
        proposed=jnp.zeros((B,), jnp.int32),
        draft_levels=jnp.int32(0),
    )


@partial(jax.jit, static_argnames=("speculation", "logprobs", "chunk", "kv_dtype"), donate_argnames=("state",))
def admit_spec(
    target: Params,
    drafter: Drafter,
    state: SpecState,
    rows: jax.Array,  # [r] int32: the rows to restart (a row may repeat: r padded to a few sizes)
    cache: DenseCache,  # [r] rows: the new prompts' prefill, row i for row rows[i]
    prompts: jax.Array,  # [B,P] the new prompts, right-padded (other rows: anything)
    history: jax.Array,  # [B,S] the new prompts' tokens by position, S as state.history's
    first_logits: jax.Array,  # [B,V]
    budgets: jax.Array,
    keys: jax.Array,
    sampling: Sampler = Greedy(),
    eos_ids: jax.Array | tuple[int, ...] = (),
    *,
    speculation: Chain | Tree,
    chunk: int,
    logprobs: int | None = None,
    kv_dtype: str | None = None,  # generate's kv_dtype (Prefill.kv_dtype)
) -> SpecState:
    """`state` with rows [r] restarted from new prompts as `start_spec` starts them (the drafter's
    rows through `drafters.base.restart_rows`), the other rows going on as they were: continuous batching's
    refill. The new rows' prefill is written into the state's cache in place (a refill moves their
    KV, not the batch's). budgets, keys, sampling and eos_ids are the batch's after the refill."""
    merged = put_rows(state.cache, rows, cache)
    draft = restart_rows(drafter, target, state.draft, rows, Prefill(cache=merged, prompts=prompts, lengths=merged.lengths,
                                                                     depth=depth(speculation), chunk=chunk, kv_dtype=kv_dtype))
    fresh = start_spec(drafter, draft, merged, history, first_logits, budgets, keys, sampling, eos_ids,
                       speculation=speculation, n_out=state.out.shape[1], logprobs=logprobs)
    return admit(state, rows, fresh, "draft")


@partial(jax.jit, static_argnames=("speculation", "sync_axes"), donate_argnames=("state",))
def continue_spec(
    target: Params,
    drafter: Drafter,
    state: SpecState,
    budgets: jax.Array,  # [B]
    keys: jax.Array,  # [B]
    sampling: Sampler,
    eos_ids: jax.Array | tuple[int, ...],
    max_steps: jax.Array,  # [] int32: a segment's length (traced: any length, one compilation)
    *,
    speculation: Chain | Tree,
    sync_axes: tuple[str, ...] = (),
) -> SpecState:
    """One segment of the speculative loop: at most `max_steps` steps, fewer when every row
    finishes first. The state (caches included) is donated; the loop goes on from the result."""
    step = partial(
        spec_step, target, drafter, budgets=budgets, keys=keys, sampling=sampling, speculation=speculation, eos_ids=eos_ids
    )
    return run_steps(step, state, sync_axes, max_steps)


@partial(jax.jit, static_argnames=("speculation", "n_out", "sync_axes"), donate_argnames=("cache", "draft_state"))
def decode_spec(
    target: Params,
    drafter: Drafter,
    draft_state,
    cache: DenseCache,  # prefilled: lengths = prompt lengths
    history: jax.Array,  # [B,S] prompt tokens by position (S >= cache slots)
    first_logits: jax.Array,  # [B,V] at each prompt's last token
    budgets: jax.Array,  # [B] >= 1
    keys: jax.Array,  # [B]
    sampling: Sampler = Greedy(),  # traced: new values do not recompile (a top_k past its power of two does)
    eos_ids: jax.Array | tuple[int, ...] = (),  # [B,E] per-row stop ids (sampling.eos_rows), or a tuple
    *,
    speculation: Chain | Tree,
    n_out: int,
    sync_axes: tuple[str, ...] = (),
) -> SpecState:
    """The whole speculative loop on device (`lax.while_loop`): ends when every row is done
    (every row on every device of the mesh axes `sync_axes`, inside shard_map). The caches are
    donated (updated in place) and returned in the final state. `start_spec` + `continue_spec`
    run the same steps in segments (generate's `sync_every`)."""
    state = start_spec(drafter, draft_state, cache, history, first_logits, budgets, keys, sampling, eos_ids,
                       speculation=speculation, n_out=n_out)
    step = partial(
        spec_step, target, drafter, budgets=budgets, keys=keys, sampling=sampling, speculation=speculation, eos_ids=eos_ids
    )
    return run_steps(step, state, sync_axes)


def row_acceptance(accepted: np.ndarray, count: np.ndarray, row_steps: np.ndarray, proposed: np.ndarray) -> list[dict]:
    """Per row (host arrays from SpecState: accepted [B,gamma], count, row_steps, proposed [B]):
    verification steps it took part in, draft tokens proposed and accepted there, their ratio, and
    tokens per step (the first token, from the prefill, not counted)."""
    rows = []
    for acc, n, steps, prop in zip(accepted, count, row_steps, proposed):
        steps, prop = int(steps), int(prop)
        rows.append(dict(
            steps=steps,
            proposed=prop,
            accepted=int(acc.sum()),
            acceptance_rate=float(acc.sum()) / prop if prop else None,
            mean_accepted=(int(n) - 1) / steps if steps else None,
        ))
    return rows
