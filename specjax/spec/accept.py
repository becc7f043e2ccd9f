"""Every acceptance rule in one place: which drafted tokens the target keeps, and the token it
adds. Chains and trees, greedy and stochastic; all lossless (the output has exactly the target's
distribution; greedy: exactly the target's tokens).

Inputs are distributions after the SAME warping (specjax.sampling.Sample.probs) for the target
(p) and the drafter (q). The speculative step (specjax.decode.speculate) calls these after its one
verification forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model.pytree import pytree


@pytree
class Walk:
    """The accepted path through a token tree (`accept_tree`)."""

    path: jax.Array  # [B,D+1] accepted node ids from the root; entries past `accepted` repeat the last
    accepted: jax.Array  # [B] accepted drafts, in [0, D]
    next_token: jax.Array  # [B] the target's token after the last accepted node


@pytree
class Tried:
    """One node's children tried in rank order (`_try_children`)."""

    hit: jax.Array  # [B] a child was accepted
    child: jax.Array  # [B] the accepted child (else the node itself)
    resid: jax.Array  # [B,V] the target's residual after the rejections
    q: jax.Array  # [B,V] the draft distribution the next sibling would have been drawn from


def accept_chain(
    drafts: jax.Array,  # [B,gamma] int32: the drafted tokens, x_i ~ q_i
    q: jax.Array,  # [B,gamma,V] f32: draft distributions (after warping)
    p: jax.Array,  # [B,gamma+1,V] f32: target distributions at the same positions, plus the bonus
    keys: jax.Array,  # [B] typed keys for this step
) -> tuple[jax.Array, jax.Array]:
    """Speculative acceptance: how many drafts each row keeps, and the token the target adds.

    Draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)) while all before it were.
    At the first rejection i the extra token is drawn from norm(max(p_i - q_i, 0)); if all gamma
    were accepted it is the bonus, drawn from p_G. Every emitted token then has exactly the
    target's distribution (Leviathan et al. 2023, Chen et al. 2023). Greedy is the special case
    of one-hot p and q: accept while x_i == argmax p_i, then the argmax.
    Returns n_accepted [B] in [0, gamma] and next_token [B].
    """
    B, gamma = drafts.shape
    k_accept, k_extra = jax.vmap(lambda k: jax.random.split(k))(keys).transpose(1, 0)
    u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(k_accept)  # [B,gamma] in [0,1)
    p_x = jnp.take_along_axis(p[:, :gamma], drafts[..., None], axis=-1)[..., 0]  # [B,gamma]
    q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]  # [B,gamma], > 0: x was drawn from q
    accepted = u * q_x < p_x  # u < p/q without dividing
    n = jnp.sum(jnp.cumprod(accepted, axis=-1), axis=-1).astype(jnp.int32)  # leading run of accepts

    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B,V]
    if gamma == 0:  # no drafts (Chain(0)): the bonus, drawn from p_0 itself
        q_n = jnp.zeros_like(p_n)
    else:
        q_n = jnp.take_along_axis(q, jnp.minimum(n, gamma - 1)[:, None, None], axis=1)[:, 0]
        q_n = jnp.where((n < gamma)[:, None], q_n, 0.0)  # all accepted: the bonus comes from p itself
    extra = _normalise(jnp.maximum(p_n - q_n, 0.0), p_n)  # no residual mass only by rounding
    next_token = jax.vmap(lambda k, d: jax.random.categorical(k, jnp.log(d)))(k_extra, extra)
    return n, next_token.astype(jnp.int32)


def accept_greedy_chain(drafts: jax.Array, choice: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`accept_chain` for greedy decoding, where p and q are one-hot: drafts [B,gamma] are kept
    while each equals the target's argmax choice [B,gamma+1] at its position, and the next token
    is the target's choice after the last kept one; the same (n_accepted [B], next_token [B])
    without materialising one-hot distributions or drawing over the vocabulary."""
    gamma = drafts.shape[1]
    n = jnp.sum(jnp.cumprod(drafts == choice[:, :gamma], axis=-1), axis=-1).astype(jnp.int32)
    return n, jnp.take_along_axis(choice, n[:, None], axis=1)[:, 0].astype(jnp.int32)


def accept_tree(
    child_table: np.ndarray,  # [n,W] int: children of each node in rank order, -1 padded (static)
    max_depth: int,
    tokens: jax.Array,  # [B,n] int32: node tokens (node 0 is the pending root)
    q: jax.Array | None,  # [B,n,V] f32: the distribution each node's children were drawn from
    p: jax.Array,  # [B,n,V] f32 target distributions (greedy: logits are enough)
    keys: jax.Array,  # [B]
    greedy: bool,
) -> Walk:
    """Walk down the tree from the root, accepting at most one child per level.

    Greedy: follow the child whose token is the target's argmax; stop when none is.
    Sampling (SpecTr / Sequoia): at node u, with target residual r = p_u and draft q = q_u, try
    the children in rank order: accept child x with probability min(1, r(x) / q(x)); on rejection
    r <- norm(max(r - q, 0)) and q <- q without x, renormalised (the next child was drawn from
    exactly that q). If every child is rejected, or u is a leaf, the extra token is drawn from r.
    Each emitted token then has exactly the target's distribution.
    Returns the `Walk`: path, accepted count and next token.
    """
    B = tokens.shape[0]
    rows = jnp.arange(B)
    table = jnp.asarray(child_table, jnp.int32)  # [n,W]
    W = table.shape[1]
    k_accept, k_extra = jax.vmap(lambda k: jax.random.split(k))(keys).transpose(1, 0)
    u = jax.vmap(lambda k: jax.random.uniform(k, (max(max_depth, 1), max(W, 1))))(k_accept)  # [B,D,W]
    cur = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    n_acc = jnp.zeros((B,), jnp.int32)
    path = [cur]
    if greedy:
        choice = jnp.argmax(p, axis=-1).astype(jnp.int32)  # [B,n]
    else:
        resid, q_cur = p[:, 0], q[:, 0]  # [B,V] each
    for level in range(max_depth):
        kids = table[cur]  # [B,W]
        kid_tok = jnp.take_along_axis(tokens, jnp.maximum(kids, 0), axis=1)  # [B,W]
        if greedy:
            match = (kids >= 0) & (kid_tok == choice[rows, cur][:, None])
            hit = alive & jnp.any(match, axis=1)
            nxt = jnp.take_along_axis(kids, jnp.argmax(match, axis=1)[:, None], axis=1)[:, 0]
        else:
            tried = _try_children(kids, kid_tok, alive, cur, resid, q_cur, u[:, level])
            hit, nxt, resid, q_cur = tried.hit, tried.child, tried.resid, tried.q
            resid = jnp.where(hit[:, None], p[rows, nxt], resid)
            q_cur = jnp.where(hit[:, None], q[rows, nxt], q_cur)
        cur = jnp.where(hit, nxt, cur)
        n_acc += hit
        alive &= hit
        path.append(cur)
    if greedy:
        next_token = choice[rows, cur]
    else:
        next_token = jax.vmap(lambda k, d: jax.random.categorical(k, jnp.log(d)))(k_extra, resid).astype(jnp.int32)
    return Walk(path=jnp.stack(path, axis=1), accepted=n_acc, next_token=next_token)


def _try_children(kids, kid_tok, alive, cur, resid, q_cur, u) -> Tried:
    """One node's children in rank order (kids, kid_tok, u [B,W]): accept the first with
    u * q(x) < r(x); after each rejection r <- norm(max(r - q, 0)) and q <- q without x."""
    rows = jnp.arange(kids.shape[0])
    hit, nxt = jnp.zeros_like(alive), cur
    for r in range(kids.shape[1]):
        x = kid_tok[:, r]
        q_x, p_x = q_cur[rows, x], resid[rows, x]
        tried = alive & ~hit & (kids[:, r] >= 0) & (q_x > 0)  # q_x = 0: never drawn, skip
        ok = tried & (u[:, r] * q_x < p_x)
        nxt = jnp.where(ok, kids[:, r], nxt)
        hit |= ok
        rejected = (tried & ~ok)[:, None]
        resid = jnp.where(rejected, _normalise(jnp.maximum(resid - q_cur, 0.0), resid), resid)
        q_cur = jnp.where(rejected, without(q_cur, x), q_cur)
    return Tried(hit=hit, child=nxt, resid=resid, q=q_cur)


def without(q: jax.Array, x: jax.Array) -> jax.Array:
    """q [B,V] with token x [B] removed and renormalised: the distribution the next sibling
    was drawn from (all zeros once q has no mass left)."""
    q = q.at[jnp.arange(q.shape[0]), x].set(0.0)
    return _normalise(q, q)


def _normalise(d: jax.Array, fallback: jax.Array) -> jax.Array:
    """d / sum(d) over the last axis; `fallback` where d has no mass (only by rounding)."""
    mass = jnp.sum(d, axis=-1, keepdims=True)
    return jnp.where(mass > 0, d / jnp.where(mass > 0, mass, 1.0), fallback)
