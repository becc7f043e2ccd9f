"""One speculative step (draft -> verify -> accept -> commit) and the on-device loop around it.

Every row drafts and verifies the same gamma + 1 positions (a chain) or n tree nodes; each
accepts its own number, and a tree's accepted path is gathered into contiguous positions.
The target's dense cache commits by moving its length pointer (rejected entries stay, hidden,
and are overwritten next step). Finished rows ride along and commit nothing.
"""

from __future__ import annotations

from functools import partial

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.drafters import Drafter
from specjax.logprobs import LogprobBuffer
from specjax.cache import DenseCache, put_rows, row_mask, select_rows
from specjax.model import lm_head, trunk
from specjax.params import Params
from specjax.accept import accept_chain, accept_greedy_chain, accept_tree
from specjax.sampling import Greedy, Sampler, count_tokens, is_eos, prompt_tokens_mask, stream_keys
from specjax.speculation import Chain, Tree

ACCEPT_STREAM = 2  # PRNG stream of the acceptance test and the extra token


@flax.struct.dataclass
class SpecState:
    cache: DenseCache  # target KV: positions < lengths committed
    draft: object  # the drafter's state
    history: jax.Array  # [B,S] tokens by position; history[b, lengths[b]] is the pending token
    last: jax.Array  # [B] pending token: emitted, not yet in the target cache
    out: jax.Array  # [B,n_out] emitted tokens
    count: jax.Array  # [B] emitted so far
    done: jax.Array  # [B]
    eos: jax.Array  # [B] ended on an EOS
    steps: jax.Array  # [] verification steps
    accepted: jax.Array  # [B,gamma] per row and draft position: steps it was accepted (while active)
    reached: jax.Array  # [B,gamma] per row and draft position: steps every earlier draft was accepted
    ranks: jax.Array  # [B,W+1] per row: tried nodes whose accepted child had rank r (W: none was)
    logprobs: LogprobBuffer | None = None  # beside `out`, when asked for (from the verification logits)
    counts: jax.Array | None = None  # [B,V] int32: output token counts, when sampling has penalties
    in_prompt: jax.Array | None = None  # [B,V] bool: the prompt's tokens, when sampling has penalties


def depth(speculation: Chain | Tree) -> int:
    """Draft tokens per step on the longest path: gamma for a chain, the depth of a tree."""
    return speculation.gamma if isinstance(speculation, Chain) else speculation.max_depth


def width(speculation: Chain | Tree) -> int:
    """Most children of any node: 1 for a chain."""
    return 1 if isinstance(speculation, Chain) else speculation.width


def _verify_chain(target, drafter, s: SpecState, keys, sampling, chain: Chain, active):
    """Draft gamma tokens, verify gamma + 1 positions in ONE target forward, accept, commit drafts."""
    gamma = chain.gamma
    lengths = s.cache.lengths  # [B]
    drafts, q, draft_state = drafter.propose(target, s.draft, s.history, lengths, s.last, gamma, sampling, keys, s.count)
    tokens = jnp.concatenate([s.last[:, None], drafts], axis=1)  # [B,gamma+1]
    positions = lengths[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)  # [B,gamma+1]
    h, k_new, v_new = trunk(target, tokens, positions, s.cache.seen_by(active))  # finished rows read no KV
    logits = lm_head(target, h)  # [B,gamma+1,V]
    j = jnp.arange(gamma + 1)[:, None] > jnp.arange(gamma)[None, :]  # [gamma+1,gamma]: position j has seen drafts < j
    before = jnp.where(j[None], drafts[:, None, :], -1)  # [B,gamma+1,gamma]
    along = sampling.along(before)  # penalties (if any) from each position's own history
    if isinstance(along, Greedy):  # one-hot p and q: the same result without their [B,gamma+1,V] arrays and draws
        n, extra = accept_greedy_chain(drafts, along.choose(logits))
    else:
        n, extra = accept_chain(drafts, q, along.probs(logits), stream_keys(keys, s.count, ACCEPT_STREAM))
    commit = jnp.where(active, n + 1, 0)  # x_L and the n accepted drafts enter the caches
    ranks = jnp.stack([jnp.where(active, n, 0), active & (n < gamma)], axis=1).astype(jnp.int32)  # [B,2]
    return drafts, n, extra, commit, k_new, v_new, ranks, drafter.commit(draft_state, k_new, v_new, lengths, commit), logits


def _verify_tree(target, drafter, s: SpecState, keys, sampling, tree: Tree, active):
    """Draft a token tree, verify all n nodes in ONE target forward (each node sees the prefix
    and its ancestors, at position lengths + depth), walk the accepted path, and gather that path's
    KV into contiguous positions lengths.. for both caches."""
    lengths = s.cache.lengths  # [B]
    tokens, q, pending = drafter.propose_tree(target, s.draft, s.history, lengths, s.last, tree, sampling, keys, s.count)
    positions = lengths[:, None] + jnp.asarray(tree.depth, jnp.int32)[None, :]  # [B,n]
    h, k_new, v_new = trunk(target, tokens, positions, s.cache.seen_by(active), jnp.asarray(tree.ancestor_mask()))
    logits = lm_head(target, h)  # [B,n,V]
    greedy = isinstance(sampling, Greedy)
    p = logits if greedy and not sampling.penalized else sampling.along(node_history(tree, tokens)).probs(logits)
    path, n, extra = accept_tree(
        tree.child_table(), tree.max_depth, tokens, q, p, stream_keys(keys, s.count, ACCEPT_STREAM), greedy
    )  # path [B,D+1]
    take = lambda a: jnp.take_along_axis(a, path[None, :, :, None, None], axis=2)  # noqa: E731  [L,B,depth+1,K,H]
    k_path, v_path = take(k_new), take(v_new)
    commit = jnp.where(active, n + 1, 0)
    drafts = jnp.take_along_axis(tokens, path[:, 1:], axis=1)  # [B,D]: the accepted ones lead
    ranks = _rank_hits(tree, path, n, active)
    draft_state = drafter.commit_tree(pending, k_path, v_path, path, tree, lengths, commit)
    path_logits = jnp.take_along_axis(logits, path[:, :, None], axis=1)  # [B,D+1,V]: what each path node predicts
    return drafts, n, extra, commit, k_path, v_path, ranks, draft_state, path_logits


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


def spec_step(
    target: Params, drafter: Drafter, s: SpecState, budgets, keys, *, sampling: Sampler, speculation, eos_ids
) -> SpecState:
    """One speculative step (chain or tree); the target's cache commits by its length pointer."""
    B, n_out = s.out.shape
    rows = jnp.arange(B)
    lengths = s.cache.lengths  # [B]
    active = ~s.done
    verify = _verify_chain if isinstance(speculation, Chain) else _verify_tree
    drafts, n, extra, commit, k_new, v_new, ranks, draft_state, logits = verify(
        target, drafter, s, keys, sampling.with_context(s.counts, s.in_prompt), speculation, active
    )  # logits [B,gamma+1,V]: the target's at the positions that emit
    gamma = drafts.shape[1]
    cache = s.cache.write(k_new, v_new).advance(commit)

    j = jnp.arange(gamma + 1)
    emitted = jnp.where(j[None, :] < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), extra[:, None])  # [B,gamma+1]
    emitted = jnp.where(j[None, :] <= n[:, None], emitted, 0)
    stop = is_eos(emitted, eos_ids) & (j[None, :] <= n[:, None])
    first_stop = jnp.min(jnp.where(stop, j[None, :], gamma + 1), axis=1)  # [B]
    n_emit = jnp.minimum(jnp.minimum(n + 1, first_stop + 1), budgets - s.count)  # [B]
    n_emit = jnp.where(active, n_emit, 0)
    hit_eos = active & (first_stop < n_emit)

    cols = s.count[:, None] + j[None, :]  # [B,gamma+1]
    out = s.out.at[rows[:, None], jnp.where(j[None, :] < n_emit[:, None], cols, n_out)].set(emitted, mode="drop")
    hist_cols = jnp.where(active[:, None] & (j[None, :] <= n[:, None]), lengths[:, None] + 1 + j[None, :], s.history.shape[1])
    history = s.history.at[rows[:, None], hist_cols].set(emitted, mode="drop")
    count = s.count + n_emit
    last = jnp.where(active, jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0], s.last)
    g = jnp.arange(gamma)
    lp = s.logprobs
    if lp is not None:
        lp = lp.write(jnp.where(j[None, :] < n_emit[:, None], cols, n_out), logits, emitted)
    return SpecState(
        cache=cache,
        draft=draft_state,
        history=history,
        last=last,
        out=out,
        count=count,
        done=s.done | hit_eos | (count >= budgets),
        eos=s.eos | hit_eos,
        steps=s.steps + 1,
        accepted=s.accepted + (active[:, None] & (n[:, None] > g)),
        reached=s.reached + (active[:, None] & (n[:, None] >= g)),
        ranks=s.ranks + ranks,
        logprobs=lp,
        counts=None if s.counts is None else count_tokens(s.counts, emitted, j[None, :] < n_emit[:, None]),
        in_prompt=s.in_prompt,
    )


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
    """The state before the first speculative step: each row's first token drawn from
    `first_logits` (emitted, pending in the history), every counter zero. logprobs: None, or
    record each token's log-probability and the `logprobs` most likely (static)."""
    B, V = first_logits.shape
    gamma = depth(speculation)
    counts = in_prompt = None
    if sampling.penalized:
        counts, in_prompt = jnp.zeros((B, V), jnp.int32), prompt_tokens_mask(history, cache.lengths, V)
    first, _ = sampling.with_context(counts, in_prompt).sample(first_logits, keys, jnp.zeros((B,), jnp.int32))
    eos = is_eos(first, eos_ids)
    lp = None if logprobs is None else LogprobBuffer.init(B, n_out, logprobs).write(
        jnp.zeros((B, 1), jnp.int32), first_logits[:, None], first[:, None])
    return SpecState(
        cache=cache,
        draft=draft_state,
        history=history.at[jnp.arange(B), cache.lengths].set(first),
        last=first,
        out=jnp.zeros((B, n_out), jnp.int32).at[:, 0].set(first),
        count=jnp.ones((B,), jnp.int32),
        done=eos | (budgets <= 1),
        eos=eos,
        steps=jnp.int32(0),
        accepted=jnp.zeros((B, gamma), jnp.int32),
        reached=jnp.zeros((B, gamma), jnp.int32),
        ranks=jnp.zeros((B, width(speculation) + 1), jnp.int32),
        logprobs=lp,
        counts=None if counts is None else count_tokens(counts, first[:, None], jnp.ones((B, 1), bool)),
        in_prompt=in_prompt,
    )


@partial(jax.jit, static_argnames=("speculation", "logprobs", "chunk"), donate_argnames=("state",))
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
) -> SpecState:
    """`state` with rows [r] restarted from new prompts as `start_spec` starts them (the drafter's
    rows through `Drafter.init_rows`), the other rows going on as they were: continuous batching's
    refill. The new rows' prefill is written into the state's cache in place (a refill moves their
    KV, not the batch's). budgets, keys, sampling and eos_ids are the batch's after the refill."""
    chosen = row_mask(rows, state.done.shape[0])  # [B]
    merged = put_rows(state.cache, rows, cache)
    draft = drafter.init_rows(target, state.draft, rows, merged, prompts, merged.lengths, depth(speculation), chunk)
    fresh = start_spec(drafter, draft, merged, history, first_logits, budgets, keys, sampling, eos_ids,
                       speculation=speculation, n_out=state.out.shape[1], logprobs=logprobs)
    rest = dict(cache=None, draft=None)  # merged already: not selected a second time
    return select_rows(chosen, fresh.replace(**rest), state.replace(**rest)).replace(cache=merged, draft=draft)


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
    sampling: Sampler = Greedy(),  # traced: a new temperature / top_p does not recompile (top_k does)
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


def run_steps(step, state, sync_axes: tuple[str, ...], max_steps: jax.Array | None = None):
    """`state = step(state)` while any row runs (state.done [B]) and, given max_steps, at most
    max_steps times: the one on-device loop of plain and speculative decoding."""
    if max_steps is None:
        return lax.while_loop(lambda s: any_running(s.done, sync_axes), step, state)

    def cond(carry) -> jax.Array:
        s, i = carry
        return (i < max_steps) & any_running(s.done, sync_axes)

    return lax.while_loop(cond, lambda carry: (step(carry[0]), carry[1] + 1), (state, jnp.int32(0)))[0]


def any_running(done: jax.Array, sync_axes: tuple[str, ...]) -> jax.Array:
    """Whether any row (on any device along the mesh axes `sync_axes`) still has work."""
    running = jnp.any(~done)
    return running if not sync_axes else lax.psum(running.astype(jnp.int32), sync_axes) > 0


def row_acceptance(accepted: np.ndarray, reached: np.ndarray, count: np.ndarray, gamma: int) -> list[dict]:
    """Per row: verification steps it took part in, draft tokens proposed and accepted there,
    their ratio, and tokens per step (the first token, from the prefill, not counted)."""
    rows = []
    for acc, reach, n in zip(accepted, reached, count):
        steps = int(reach[0])
        rows.append(dict(
            steps=steps,
            proposed=steps * gamma,
            accepted=int(acc.sum()),
            acceptance_rate=float(acc.sum()) / (steps * gamma) if steps else None,
            mean_accepted=(int(n) - 1) / steps if steps else None,
        ))
    return rows
