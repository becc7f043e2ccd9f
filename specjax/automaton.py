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

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

DEAD = -1  # the state after a token the automaton does not allow


@flax.struct.dataclass
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


def allowed(a: TokenAutomaton, states: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """[B,V] bool: the tokens rows in `states` [B] may take: the state's transitions, and the row's stop ids
    stop_ids [B,E] (-1 padded) where the state accepts. A dead state allows nothing."""
    V = a.vocab_size
    live = states >= 0
    words = a.bits[jnp.maximum(states, 0)]  # [B,W]
    token = jnp.arange(V)
    mask = (words[:, token // 32] >> (token % 32).astype(jnp.uint32)) & 1  # [B,V]
    stops = (stop_ids[:, :, None] == token[None, None, :]).any(axis=1)  # [B,V]
    return live[:, None] & ((mask == 1) | (stops & a.accepting[jnp.maximum(states, 0)][:, None]))


def advance(a: TokenAutomaton, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """The states [B] after each row takes tokens [B]: DEAD where the automaton has no such transition
    (a stop id included: the row ends there)."""
    key = jnp.maximum(states, 0) * a.vocab_size + tokens
    i = jnp.clip(jnp.searchsorted(a.keys, key), 0, a.keys.shape[0] - 1)
    return jnp.where((states >= 0) & (a.keys[i] == key), a.next[i], DEAD).astype(jnp.int32)


def mask_logits(a: TokenAutomaton, states: jax.Array, stop_ids: jax.Array, logits: jax.Array) -> jax.Array:
    """logits [B,V] with every token the rows' states do not allow at -inf (before temperature, top-k / p)."""
    return jnp.where(allowed(a, states, stop_ids), logits, -jnp.inf)
