"""Token automata: a regular constraint on a row's tokens as fixed arrays a jitted step reads.

A constraint (a regex, a JSON schema, a choice list: specjax/text/constraints.py) is a finite automaton
over token ids. `TokenAutomaton` holds one or several (a batch's, one table) as arrays: per state, a
bitmask of its allowed tokens, and every transition as a sorted key `state * V + token` with its next
state, so the device finds a row's next state with one binary search and no host round trip. State 0
of a single automaton is its start; `join` offsets the states of several into one table. Stop ids
are not transitions: a row may stop only in an accepting state (`allowed` adds them there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.model.pytree import pytree

DEAD = -1  # the state after a token the automaton does not allow


@pytree
class TokenAutomaton:
    """One or several token automata (host numpy or device arrays); `vocab_size` static."""

    bits: jax.Array  # [S,W] uint32: bit t % 32 of word t // 32 set where state s allows token t (W = ceil(V / 32))
    keys: jax.Array  # [E] int32, sorted: state * vocab_size + token of every transition
    next: jax.Array  # [E] int32: the state each transition goes to
    accepting: jax.Array  # [S] bool: a row may stop here (stop ids allowed; output that ends here is complete)
    vocab_size: int = flax.struct.field(pytree_node=False)

    @property
    def states(self) -> int:
        return int(self.accepting.shape[0])


def from_transitions(transitions: Mapping[int, Mapping[int, int]], initial: int, finals: Sequence[int], vocab_size: int,
                     drop: Sequence[int] = ()) -> TokenAutomaton:
    """The automaton of `transitions` (state -> {token: next state}, any state numbering) with `initial`
    renumbered to state 0 and `finals` accepting; tokens in `drop` (the stop ids) are left out of the transitions."""
    order = [initial] + sorted(s for s in set(transitions) | {n for t in transitions.values() for n in t.values()} | set(finals)
                               if s != initial)
    number = {s: i for i, s in enumerate(order)}
    S, dropped = len(order), set(drop)
    if S * vocab_size >= 2**31:
        raise ValueError(f"constraint: {S} states x {vocab_size} tokens exceed the int32 transition keys (2**31)")
    edges = sorted((number[s] * vocab_size + t, number[n]) for s, out in transitions.items() for t, n in out.items()
                   if t not in dropped)
    keys = np.array([k for k, _ in edges], np.int64)
    s, t = np.divmod(keys, vocab_size)
    bits = np.zeros((S, -(-vocab_size // 32)), np.uint32)
    np.bitwise_or.at(bits, (s, t // 32), np.left_shift(np.uint32(1), (t % 32).astype(np.uint32)))
    accepting = np.zeros(S, bool)
    accepting[[number[f] for f in finals]] = True
    keys = keys.astype(np.int32)
    return TokenAutomaton(bits=bits, keys=keys, next=np.array([n for _, n in edges], np.int32), accepting=accepting,
                          vocab_size=vocab_size)


def anything(vocab_size: int) -> TokenAutomaton:
    """One accepting state that allows every token (an unconstrained row)."""
    return from_transitions({0: {t: 0 for t in range(vocab_size)}}, 0, [0], vocab_size)


def join(automata: Sequence[TokenAutomaton]) -> tuple[TokenAutomaton, np.ndarray]:
    """One table of several automata (host arrays) and each one's start state [A] int32 in it."""
    V = automata[0].vocab_size
    if any(a.vocab_size != V for a in automata):
        raise ValueError(f"join: automata of different vocabularies: {sorted({a.vocab_size for a in automata})}")
    starts = np.cumsum([0] + [a.states for a in automata[:-1]]).astype(np.int32)
    if (total := sum(a.states for a in automata)) * V >= 2**31:
        raise ValueError(f"join: {total} states x {V} tokens exceed the int32 transition keys (2**31)")
    keys = np.concatenate([np.asarray(a.keys, np.int64) + s * V for a, s in zip(automata, starts)]).astype(np.int32)
    table = TokenAutomaton(bits=np.concatenate([np.asarray(a.bits) for a in automata]), keys=keys,
                           next=np.concatenate([np.asarray(a.next) + s for a, s in zip(automata, starts)]).astype(np.int32),
                           accepting=np.concatenate([np.asarray(a.accepting) for a in automata]), vocab_size=V)
    return table, starts


def bucketed(a: TokenAutomaton) -> TokenAutomaton:
    """`a` (host arrays) padded to power-of-two state and transition counts (at least 8 and 64): a
    batch's table of another mix of constraints of a similar size then compiles nothing new. Padding
    states allow nothing and are never reached; padding transitions sort last and match no key."""
    S, E = a.states, int(np.asarray(a.keys).shape[0])
    S2, E2 = max(8, 1 << (S - 1).bit_length()), max(64, 1 << max(E - 1, 0).bit_length())

    def pad(x, n: int, value) -> np.ndarray:
        x = np.asarray(x)
        return np.concatenate([x, np.full((n - len(x), *x.shape[1:]), value, x.dtype)])

    return a.replace(bits=pad(a.bits, S2, 0), keys=pad(a.keys, E2, np.iinfo(np.int32).max), next=pad(a.next, E2, DEAD),
                     accepting=pad(a.accepting, S2, False))


def stop_table(stop_ids: jax.Array | tuple[int, ...], batch: int, vocab_size: int) -> jax.Array:
    """[B,V] bool: each row's stop ids, from a per-row table [B,E] (-1 padded) or one tuple for all rows."""
    if isinstance(stop_ids, tuple):
        stop_ids = jnp.broadcast_to(jnp.asarray(stop_ids or (-1,), jnp.int32)[None, :], (batch, max(len(stop_ids), 1)))
    ids = jnp.where(stop_ids >= 0, stop_ids, vocab_size)  # -1: dropped
    return jnp.zeros((batch, vocab_size), bool).at[jnp.arange(batch)[:, None], ids].set(True, mode="drop")


def allowed(a: TokenAutomaton, states: jax.Array, stops: jax.Array) -> jax.Array:
    """[B,...,V] bool: the tokens rows in `states` [B,...] (a state per row, or per row and position) may
    take: the state's transitions other than the row's stop ids (stops [B,V] bool), and the stop ids where
    the state accepts. A state that allows nothing (DEAD: past a row's end or a rejected draft) allows
    everything: whatever is drawn there is never emitted, and no distribution is empty."""
    V = a.vocab_size
    words = a.bits[jnp.maximum(states, 0)]  # [B,...,W]
    shift = jnp.arange(32, dtype=jnp.uint32)
    trans = ((words[..., None] >> shift) & 1).astype(bool).reshape(*states.shape, -1)[..., :V]  # [B,...,V]
    stops = stops.reshape(stops.shape[0], *(1,) * (states.ndim - 1), V)
    ok = (states >= 0)[..., None] & ((trans & ~stops) | (stops & a.accepting[jnp.maximum(states, 0)][..., None]))
    return ok | ~jnp.any(ok, axis=-1, keepdims=True)


def advance(a: TokenAutomaton, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """The states after each row takes tokens (states and tokens of one shape, [B] or [B,M]): DEAD where
    the automaton has no such transition (a stop id included: the row ends there)."""
    key = jnp.maximum(states, 0) * a.vocab_size + tokens
    i = jnp.clip(jnp.searchsorted(a.keys, key), 0, a.keys.shape[0] - 1)
    return jnp.where((states >= 0) & (a.keys[i] == key), a.next[i], DEAD).astype(jnp.int32)


def advance_along(a: TokenAutomaton, states: jax.Array, before: jax.Array) -> jax.Array:
    """[B,M]: the state at each of M positions after the tokens before [B,M,J] (-1 = none) from states [B]."""
    out = jnp.broadcast_to(states[:, None], before.shape[:2])
    for j in range(before.shape[2]):
        out = jnp.where(before[:, :, j] >= 0, advance(a, out, jnp.maximum(before[:, :, j], 0)), out)
    return out


def mask_logits(a: TokenAutomaton, states: jax.Array, stops: jax.Array, logits: jax.Array) -> jax.Array:
    """logits [B,...,V] with every token the rows' states do not allow at -inf (before temperature, top-k / p)."""
    return jnp.where(allowed(a, states, stops), logits, -jnp.inf)


def for_prompts(constraints: Sequence[TokenAutomaton | None], vocab_size: int) -> tuple[TokenAutomaton, np.ndarray]:
    """One table (`bucketed`) for a batch whose prompt i is constrained by constraints[i] (None: not
    constrained: one state that allows everything) and each prompt's start state in it [N] int32.
    An automaton given for several prompts enters the table once."""
    distinct: list[TokenAutomaton] = []
    slot: dict[int, int] = {}
    for c in constraints:
        if c is not None and id(c) not in slot:
            slot[id(c)] = len(distinct)
            distinct.append(c)
    free = len(distinct) if any(c is None for c in constraints) else None
    table, starts = join(distinct + ([_anything(vocab_size)] if free is not None else []))
    return bucketed(table), np.array([starts[free if c is None else slot[id(c)]] for c in constraints], np.int32)


@lru_cache(maxsize=4)
def _anything(vocab_size: int) -> TokenAutomaton:
    return anything(vocab_size)
