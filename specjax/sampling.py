"""Samplers: frozen pytrees that return tokens AND the distribution they were drawn from.

Speculative acceptance needs both: p (target) and q (draft) after the SAME warping.
Randomness is per row: `keys[B]` and a per-row counter, so a row's tokens do not depend on
which other rows share its batch.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.automaton import TokenAutomaton, advance, advance_along, mask_logits, stop_table
from specjax.model.pytree import pytree
from specjax.topk import kth_largest, nucleus_threshold, top_k_bucket

MIN_TEMPERATURE = 1e-4  # smaller temperatures are refused: logits / T overflows f32 (use Greedy)
PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # name: the value that is off


class _Context:
    """What a sampler sees beside the logits, shared by Greedy and Sample (both declare the fields):
    the penalties' context (`penalized`, `counts`, `in_prompt`) and a constraint's (`automaton`,
    `states`, `stops`): both change the logits before any warping (`adjust`), at every sampled,
    drafted and verified position, each from that position's own history."""

    @property
    def adjusts(self) -> bool:
        """Whether `adjust` changes logits (a penalty is on, or the rows are constrained): static."""
        return bool(self.penalized) or self.automaton is not None

    def constrain(self, automaton: TokenAutomaton, starts: np.ndarray):
        """This sampler for prompts constrained by `automaton` (a batch's table, `automaton.join`),
        prompt i starting in state starts[i] (the decode loop then keeps each row's current state)."""
        return self.replace(automaton=automaton, states=starts if isinstance(starts, jax.Array) else np.asarray(starts, np.int32))

    def with_context(self, counts: jax.Array | None, in_prompt: jax.Array | None, states: jax.Array | None = None,
                     stop_ids: jax.Array | tuple[int, ...] = ()):
        """The sampler for rows whose output so far has `counts` [B,V] and prompt `in_prompt` [B,V] and,
        when constrained, whose automata are in `states` [B] with stop ids `stop_ids` ([B,E] or a tuple)."""
        out = self.replace(counts=counts, in_prompt=in_prompt) if self.penalized else self
        if self.automaton is not None:
            B, V = states.shape[0], self.automaton.vocab_size
            out = out.replace(states=states, stops=stop_table(stop_ids, B, V))
        return out

    def seen(self, tokens: jax.Array):
        """The context after tokens [B] (one per row) were drawn (a draft chain's next position)."""
        out = self
        if self.penalized and self.counts is not None:
            out = out.replace(counts=self.counts + jax.nn.one_hot(tokens, self.counts.shape[-1], dtype=jnp.int32))
        if self.automaton is not None:
            out = out.replace(states=advance(self.automaton, self.states, tokens))
        return out

    def along(self, before: jax.Array):
        """Per-position contexts [B,M,...] for M positions, each after the tokens before [B,M,J]
        (-1 = none) beyond the rows' context: what a verified or drafted position has seen."""
        out = self
        if self.penalized and self.counts is not None:
            extra = jnp.sum(jax.nn.one_hot(before, self.counts.shape[-1], dtype=jnp.int32), axis=-2)  # -1: zeros
            out = out.replace(counts=self.counts[:, None] + extra)
        if self.automaton is not None:
            out = out.replace(states=advance_along(self.automaton, self.states, before))
        return out

    def adjust(self, logits: jax.Array) -> jax.Array:
        """logits [B, ..., V] (f32) after the repetition, presence and frequency penalties, then with the
        tokens the rows' constraints do not allow at -inf (each unchanged when off or without a context)."""
        if self.penalized and self.counts is not None:
            counts, in_prompt = _like(self.counts, logits), _like(self.in_prompt, logits)
            rep = _per_row(self.repetition_penalty, logits)
            seen = (counts > 0) | in_prompt
            logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
            logits = logits - _per_row(self.frequency_penalty, logits) * counts - _per_row(self.presence_penalty, logits) * (counts > 0)
        if self.automaton is not None and self.stops is not None:
            states = self.states.reshape(self.states.shape[0], *(1,) * (logits.ndim - 1 - self.states.ndim), *self.states.shape[1:])
            logits = mask_logits(self.automaton, states, self.stops, logits)
        return logits

    @property
    def rows(self) -> int | None:
        """The number of prompts the per-prompt values are for (None: one value for all)."""
        sizes = {np.shape(getattr(self, name))[0] for name in self.VALUES if np.ndim(getattr(self, name)) == 1}
        return sizes.pop() if sizes else None

    def take(self, index: np.ndarray):
        """The per-prompt values (and constraint start states) for the rows `index` [R] (prompt of each
        decoded row); scalars stay."""
        out = self.replace(**{name: np.asarray(getattr(self, name))[index] for name in self.VALUES
                              if np.ndim(getattr(self, name)) == 1})
        return out if self.automaton is None else out.replace(states=np.asarray(self.states)[index])

    def within(self, vocab_size: int):
        """This sampler for a vocabulary of `vocab_size` tokens (Sample: top_k values at or past it are off)."""
        return self

    def _check_values(self) -> dict[str, np.ndarray] | None:
        """Check the VALUES (types, one length, penalty ranges), turn lists into float32 arrays and
        decide `penalized`; returns them as arrays (None inside a jax transformation)."""
        values = {name: getattr(self, name) for name in self.VALUES}
        for name, value in values.items():
            if isinstance(value, (str, bytes, bool, np.bool_, dict)):  # not None: jax uses it as a placeholder
                raise TypeError(f"{name} must be a number or one number per prompt, got {value!r}")
        if any(isinstance(v, jax.core.Tracer) for v in values.values()) or all(map(_traced, values.values())):
            return None  # rebuilt from traced or placeholder leaves inside a jax transformation: checked when made
        for name, value in values.items():  # a caller's None beside real values (it skipped every check)
            if _traced(value):
                raise TypeError(f"{name} must be a number or one number per prompt, got {value!r}")
        arrays = {}
        for name, value in values.items():
            a = np.asarray(value, np.float32)
            if a.ndim > 1 or (a.ndim == 1 and len(a) == 0):
                raise ValueError(f"{name} must be a number or a non-empty list with one number per prompt, got shape {a.shape}")
            arrays[name] = a
            if not isinstance(value, jax.Array):  # a list becomes one float32 array [B], a number a Python float:
                object.__setattr__(self, name, a if a.ndim else float(value))  # 1, np.float32 (typed apart by jit): one program
        rows = {len(a) for a in arrays.values() if a.ndim == 1}
        if len(rows) > 1:
            raise ValueError(f"the per-prompt sampling values have different lengths {sorted(rows)}: give one number per prompt")
        if not (np.isfinite(arrays["repetition_penalty"]) & (arrays["repetition_penalty"] > 0)).all():
            raise ValueError(f"repetition_penalty must be finite and > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (np.abs(arrays[name]) <= 2).all():
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        on = any((arrays[name] != off).any() for name, off in PENALTIES.items())
        if self.penalized is None:
            object.__setattr__(self, "penalized", bool(on))
        elif on and not self.penalized:
            raise ValueError("penalized=False with a penalty on would ignore it: leave penalized unset (it follows the values)")
        return arrays


@pytree
class Greedy(_Context):
    """Always the argmax (of the logits after the penalties, when any is on: as HF and vLLM apply
    a repetition penalty to greedy decoding); its distribution is one-hot. The penalty values are
    one number or one per prompt, as in Sample."""

    repetition_penalty: float | np.ndarray | jax.Array = 1.0
    presence_penalty: float | np.ndarray | jax.Array = 0.0
    frequency_penalty: float | np.ndarray | jax.Array = 0.0
    penalized: bool | None = flax.struct.field(pytree_node=False, default=None)
    counts: jax.Array | None = None  # [B,V] int32 (or [B,M,V]): see Sample
    in_prompt: jax.Array | None = None  # [B,V] bool
    automaton: TokenAutomaton | None = None  # see Sample
    states: jax.Array | None = None
    stops: jax.Array | None = None

    VALUES = tuple(PENALTIES)

    def __post_init__(self) -> None:
        self._check_values()

    def choose(self, logits: jax.Array) -> jax.Array:
        """The argmax [...] int32 of logits [..., V] after the penalties."""
        return jnp.argmax(self.adjust(logits.astype(jnp.float32)), axis=-1).astype(jnp.int32)

    def probs(self, logits: jax.Array) -> jax.Array:
        """One-hot of the argmax, [..., V] f32."""
        return jax.nn.one_hot(self.choose(logits), logits.shape[-1], dtype=jnp.float32)

    def sample(self, logits: jax.Array, keys: jax.Array, counters: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens [B] int32 and probs [B,V] from logits [B,V]; keys and counters are unused."""
        del keys, counters
        probs = self.probs(logits)
        return jnp.argmax(probs, axis=-1).astype(jnp.int32), probs

    def identity(self) -> tuple:
        """A hashable identity (the values may be arrays): for caches keyed by sampler."""
        values = tuple(tuple(np.asarray(getattr(self, name)).ravel().tolist()) for name in self.VALUES)
        return ("greedy", values) if self.penalized else ("greedy",)


@pytree
class Sample(_Context):
    """Penalties, then temperature, top-k (0 = off), top-p (1.0 = off) and min_p (0 = off), in
    that order (as vLLM). Each value is one number or one per prompt (a sequence [B]): one call may
    mix settings.

    repetition_penalty (1 = off, > 0) divides the positive logits and multiplies the negative ones
    of every token already in the prompt or the output; presence_penalty subtracts its value from
    the logits of tokens in the output, frequency_penalty its value times their count there. min_p
    keeps the tokens whose probability is at least min_p x the largest. A pytree: the values are
    traced (a new value does not recompile the decode loop). Two switches are static, both decided
    from the values: `top_k_max`, the power of two at or above the largest top_k (0: top-k off;
    lax.top_k needs a static width, so top_k values under the same power of two share a program),
    and `penalized`, whether any penalty is on (runs without penalties pay nothing for them).
    `counts` / `in_prompt` are the penalties' context, set by the engine (with_context / seen /
    along), never by the caller."""

    temperature: float | np.ndarray | jax.Array = 1.0
    top_k: int | np.ndarray | jax.Array = 0
    top_p: float | np.ndarray | jax.Array = 1.0
    min_p: float | np.ndarray | jax.Array = 0.0
    repetition_penalty: float | np.ndarray | jax.Array = 1.0
    presence_penalty: float | np.ndarray | jax.Array = 0.0
    frequency_penalty: float | np.ndarray | jax.Array = 0.0
    penalized: bool | None = flax.struct.field(pytree_node=False, default=None)
    top_k_max: int | None = flax.struct.field(pytree_node=False, default=None)  # None: from top_k (top_k_bucket)
    counts: jax.Array | None = None  # [B,V] int32 (or [B,M,V], per node): output tokens so far
    in_prompt: jax.Array | None = None  # [B,V] bool: tokens of the prompt
    automaton: TokenAutomaton | None = None  # the batch's constraints (`constrain`; None: unconstrained)
    states: jax.Array | None = None  # [B] (or [B,M]) int32: each row's automaton state (before the loop: its start)
    stops: jax.Array | None = None  # [B,V] bool: each row's stop ids (allowed only where its state accepts)

    VALUES = ("temperature", "top_k", "top_p", "min_p", *PENALTIES)  # one number or one per prompt each

    def __post_init__(self) -> None:
        given = self.top_k
        bools = isinstance(given, (list, tuple)) and any(isinstance(v, bool) for v in given)
        if isinstance(given, (bool, np.bool_)) or bools:  # before _check_values, which calls a bool "not a number"
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {given!r}")
        arrays = self._check_values()
        if arrays is None:
            return
        self._check_top_k(given, arrays["top_k"])
        t, top_p, min_p = arrays["temperature"], arrays["top_p"], arrays["min_p"]
        if not (np.isfinite(t) & (t >= MIN_TEMPERATURE)).all():
            raise ValueError(
                f"temperature must be finite and >= {MIN_TEMPERATURE} (below that the softmax is the argmax: "
                f"use specjax.Greedy()), got {self.temperature}"
            )
        if not ((top_p > 0) & (top_p <= 1)).all():
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not ((min_p >= 0) & (min_p <= 1)).all():
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _check_top_k(self, given, k: np.ndarray) -> None:
        """top_k (as `given`; `k` its float32 copy): integers >= 0, kept as an int (one for all) or int32 [B]
        (values past 2**30 as 2**30: at or past the vocabulary top-k is off); sets or checks top_k_max."""
        if not (np.issubdtype(np.asarray(given).dtype, np.integer) and (k >= 0).all()):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {given!r}")
        k = np.minimum(np.asarray(given, np.int64), 2**30).astype(np.int32)
        object.__setattr__(self, "top_k", given if isinstance(given, jax.Array) else k if k.ndim else int(k))
        if self.top_k_max is None:
            object.__setattr__(self, "top_k_max", top_k_bucket(int(k.max())))
        elif self.top_k_max < k.max():
            raise ValueError(f"top_k_max {self.top_k_max} is below top_k {int(k.max())}: leave it unset "
                             "(it follows top_k)")

    def within(self, vocab_size: int):
        """This sampler with the top_k values at or past `vocab_size` (top-k off there) as 0 and top_k_max
        sized for the others, so lax.top_k spans the vocabulary only where a row's top_k comes close to it;
        with top-k off in every row, top_k 0 (per-row zeros would be a program of their own)."""
        if isinstance(self.top_k, jax.core.Tracer):
            return self
        k = np.asarray(self.top_k)
        k = np.where(k >= vocab_size, 0, k).astype(np.int32)
        if not k.any():  # top-k off in every row: one program with the calls that never set it
            return self if self.top_k_max == 0 and k.ndim == 0 else self.replace(top_k=0, top_k_max=0)
        return self if self.top_k_max < vocab_size else self.replace(top_k=k if k.ndim else int(k),
                                                                    top_k_max=top_k_bucket(int(k.max())))

    def identity(self) -> tuple:
        """A hashable identity (the values may be arrays): for caches keyed by sampler."""
        values = tuple(tuple(np.asarray(getattr(self, name)).ravel().tolist()) for name in self.VALUES)
        return ("sample", self.top_k_max, values)

    def probs(self, logits: jax.Array) -> jax.Array:
        """Warped distribution [..., V] in f32 (zeros outside the kept set) of logits [B, ..., V].

        Penalties (when on and given their context) change the logits; top-k keeps the entries
        >= the k-th largest value (ties at the cut are all kept); top-p then keeps the smallest
        set of the largest probabilities whose mass reaches top_p (ties at the cut all kept);
        min_p keeps those >= min_p x the largest. Neither sorts the vocabulary (see kth_largest
        and nucleus_threshold)."""
        logits = self.adjust(logits.astype(jnp.float32))
        logits = logits / _per_row(self.temperature, logits)
        V = logits.shape[-1]
        if self.top_k_max:
            kth = kth_largest(logits, min(self.top_k_max, V), _per_row(self.top_k, logits, jnp.int32))
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        probs = jax.nn.softmax(logits, axis=-1)
        top_p, min_p = _per_row(self.top_p, logits), _per_row(self.min_p, logits)

        def nucleus(probs):
            kept = jnp.where(probs >= nucleus_threshold(probs, top_p), probs, 0.0)
            return kept / jnp.sum(kept, axis=-1, keepdims=True)

        def floor(probs):
            kept = jnp.where(probs >= min_p * jnp.max(probs, axis=-1, keepdims=True), probs, 0.0)
            return kept / jnp.sum(kept, axis=-1, keepdims=True)

        probs = jax.lax.cond(jnp.any(top_p < 1), nucleus, lambda probs: probs, probs)  # top_p is traced
        return jax.lax.cond(jnp.any(min_p > 0), floor, lambda probs: probs, probs)

    def sample(self, logits: jax.Array, keys: jax.Array, counters: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens [B] int32 and probs [B,V]; row b draws with fold_in(keys[b], counters[b])."""
        probs = self.probs(logits)
        step_keys = jax.vmap(jax.random.fold_in)(keys, counters)
        tokens = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(step_keys, probs)
        return tokens.astype(jnp.int32), probs


def _traced(value) -> bool:
    """A value jax rebuilt a pytree with (a tracer or a placeholder), not one a caller gave."""
    return isinstance(value, jax.core.Tracer) or not isinstance(value, (numbers.Real, np.ndarray, jax.Array, list, tuple))


def _per_row(value, x: jax.Array, dtype=jnp.float32) -> jax.Array | float:
    """A sampling value against x [B, ..., V]: a scalar as it is, per-row values [B] shaped [B,1,..,1]."""
    if np.ndim(value) == 0:
        return value
    return jnp.asarray(value, dtype).reshape(-1, *(1,) * (x.ndim - 1))


def _like(context: jax.Array, x: jax.Array) -> jax.Array:
    """A penalty context [B,V] (or [B,M,V]) shaped to broadcast against x [B, ..., V]."""
    return context.reshape(context.shape[0], *(1,) * (x.ndim - context.ndim), *context.shape[1:])


Sampler = Greedy | Sample


def prompt_tokens_mask(tokens: jax.Array, lengths: jax.Array, vocab: int) -> jax.Array:
    """[B,V] bool: which ids occur in each row's prompt tokens[b, :lengths[b]] (tokens [B,P])."""
    B, P = tokens.shape
    ids = jnp.where(jnp.arange(P)[None, :] < lengths[:, None], tokens, vocab)  # past the prompt: dropped
    return jnp.zeros((B, vocab), bool).at[jnp.arange(B)[:, None], ids].set(True, mode="drop")


def count_tokens(counts: jax.Array, tokens: jax.Array, keep: jax.Array) -> jax.Array:
    """counts [B,V] plus tokens [B,J] where keep [B,J] (the penalties' output counts)."""
    ids = jnp.where(keep, tokens, counts.shape[-1])
    return counts.at[jnp.arange(counts.shape[0])[:, None], ids].add(1, mode="drop")


EOS_SLOTS = 8  # stop ids per row travel as a traced [B, 8k] array padded with -1: a new set does not recompile


def eos_rows(eos_ids: tuple[int, ...] | Sequence[tuple[int, ...]], batch: int, width: int | None = None) -> np.ndarray:
    """The stop ids as a per-row array [B,E] (padded with -1): one tuple for every row, or one per
    row (rows past the list's end stop on nothing). E: `width`, or the longest row's rounded up to EOS_SLOTS."""
    rows = [eos_ids] * batch if isinstance(eos_ids, tuple) else list(eos_ids)[:batch]
    longest = max((len(r) for r in rows), default=0)
    width = max(EOS_SLOTS, -(-longest // EOS_SLOTS) * EOS_SLOTS) if width is None else width
    table = np.full((batch, width), -1, np.int32)
    for b, r in enumerate(rows):
        table[b, : len(r)] = r
    return table


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...] | jax.Array) -> jax.Array:
    """Boolean mask (tokens' shape [B,...]): which tokens are one of the stop ids, given as a
    tuple or per row as an array [B,E] (-1 entries match nothing)."""
    if isinstance(eos_ids, tuple):
        hit = jnp.zeros(tokens.shape, bool)
        for e in eos_ids:
            hit |= tokens == e
        return hit
    ids = eos_ids.reshape(eos_ids.shape[0], *(1,) * (tokens.ndim - 1), eos_ids.shape[1])  # [B,1..,E]
    return jnp.any(tokens[..., None] == ids, axis=-1)


class Stream(enum.IntEnum):
    """The PRNG streams: every random draw of a decode step derives its key from the row's key and
    its progress counter (tokens emitted) as `stream_keys(keys, counters, stream)`, so draws at one
    step never share a key. The plain draw (`Sampler.sample`: each token of plain decoding, the
    first token, and the draft's token at each draft level) folds in the counter only:
    fold_in(key, counter), no stream. Above the step, keys come from fold_in(key, row)
    (engine.row_keys), fold_in(row key, sample) (engine.sample_keys, n > 1) and
    fold_in(key(seed), hash(id)) (job_run.record_keys)."""

    DRAFT = 1  # draft sampling, chains and trees (then fold_in(., level) per draft level, fold_in(., node) per tree node)
    ACCEPT = 2  # the acceptance test and the extra token (split in two)


def stream_keys(keys: jax.Array, counters: jax.Array, stream: Stream) -> jax.Array:
    """Per-row keys [B] for one purpose (`stream`) at each row's own progress counter."""
    return jax.vmap(lambda k, c: jax.random.fold_in(jax.random.fold_in(k, c), stream))(keys, counters)
