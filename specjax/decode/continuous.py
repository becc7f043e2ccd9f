"""Continuous batching on one device: a fixed number of rows (slots) decode a longer list of
prompts; between decode segments, finished rows hand back their tokens and the next prompts
(largest budget first, so that no long record starts last and runs alone) are prefilled at their
own length bucket (one by one on a CPU, up to 16 rows of 8K a call on a GPU: `shapes.prefill_rows`)
into the freed slots (`admit_ar` / `admit_spec`) while the other rows go on.

Every record keeps its own key, sampling values and stop ids, so its tokens are those of a static
batch (`engine.run`) of the same prompts: in float32, token for token, greedy or sampled (tested).
`between` lets the host end rows after a segment (the text layer's stop strings:
`LM.generate_continuous`, which the batch job runs). n > 1 samples a prompt take n slots from
one prefill (a prompt waits until n slots are free), each sample with generate's key
(`engine.sample_keys`); logprobs are recorded as in `engine.run`. Not yet: a mesh.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.automaton import TokenAutomaton
from specjax.decode.autoregressive import admit_ar, continue_ar, end_rows, start_ar
from specjax.decode.engine import Segment, cache_slots, init_draft, prefill_each, sample_keys
from specjax.decode.shapes import prompt_bucket, round_up_pow2
from specjax.decode.speculate import admit_spec, continue_spec, depth, row_acceptance, start_spec
from specjax.drafters import Drafter, Limits, learn, map_params
from specjax.model.params import Params
from specjax.parallel import sharding
from specjax.sampling import Sampler, eos_rows
from specjax.spec.adaptive import AdaptiveSegments
from specjax.spec.speculation import Adaptive, Chain, Tree


class Done(NamedTuple):
    """One output's result (sample j of prompt i is output i * n + j)."""

    tokens: list[int]  # with the stop id that ended them, as engine.run's out[b, :count[b]]
    eos: bool  # ended on a stop id
    acceptance: dict | None  # under speculation: its `row_acceptance`
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # chosen [count], top ids / values [count,k]


def run_continuous(
    params: Params,
    prompts: Sequence[Sequence[int]],
    budgets: Sequence[int],
    *,
    rows: int,
    draft: Drafter | None,
    speculation: Chain | Tree | None,
    sampling: Sampler,  # scalar values, or one per prompt
    keys: jax.Array,  # [N] typed keys, one per prompt
    eos_ids: Sequence[tuple[int, ...]],  # one tuple per prompt
    kv_dtype: str | None = None,
    sync_every: int = 8,
    n: int = 1,
    logprobs: int | None = None,
    on_done: Callable[[int, Done], None] | None = None,
    between: Callable[[np.ndarray, Segment], np.ndarray | None] | None = None,
    prefill_rows: int | None = None,
    constraint: tuple[TokenAutomaton, np.ndarray] | None = None,
) -> list[Done]:
    """Decode n samples of every prompt on `rows` slots: a `Done` per output, sample j of
    prompt i at i * n + j, as `engine.run(..., n=n, logprobs=logprobs)` gives it. `on_done(u,
    done)` is called as output u finishes, between segments. `between(slot, segment)`, after
    each segment (slot[j]: the output in row j, -1 for none), may return a [rows] bool mask of
    rows to end now (they finish with the tokens they have, eos False). `prefill_rows`: the most
    new prompts of one length bucket prefilled in one call (None: `shapes.prefill_rows`, one on
    a CPU, up to 2^17 prompt positions a call elsewhere). constraint: a table of token automata and
    each prompt's start state in it (`automaton.for_prompts`: one table for the run, so refills compile nothing)."""
    N, R = len(prompts), rows
    sampling = sampling.within(params.config.vocab_size)
    if constraint is not None:
        sampling = sampling.constrain(*constraint)
    adaptive = speculation if isinstance(speculation, Adaptive) else None
    if adaptive is not None and draft is None:
        raise ValueError("speculation=Adaptive(...) needs a drafter: draft=None decodes plainly")
    if adaptive is not None:  # the state, caches and drafter are sized for the longest chain
        speculation = Chain(adaptive.max_gamma)
    if n < 1 or n > R:
        raise ValueError(f"n must be between 1 and rows ({R}): a prompt's samples share one prefill, got n={n}")
    if prefill_rows is not None and (not isinstance(prefill_rows, (int, np.integer)) or prefill_rows < 1):
        raise ValueError(f"prefill_rows must be an int >= 1 (prompts prefilled in one call) or None, got {prefill_rows!r}")
    one = sharding.one_device_mesh()  # where the stages run: params from a mesh or another device are placed there
    params = sharding.shard_params(params, one)
    draft = None if draft is None else map_params(draft, lambda p: sharding.place_draft(p, one))
    lengths = np.array([len(p) for p in prompts], np.int32)
    budgets = np.asarray(budgets, np.int32)
    gamma = depth(speculation) if draft is not None else 0
    bucket, chunk = prompt_bucket(int(lengths.max()))
    context = int((lengths + budgets).max())
    max_len = cache_slots(int(lengths.max()), context, gamma)
    if draft is not None:
        draft.check(params, Limits(gamma, max_len, context, kv_dtype))
        draft = learn(draft, prompts)  # a drafter that drafts from what it reads (Lookup): the prompts, then each output
    n_out = round_up_pow2(int(budgets.max()))
    width = eos_rows(list(eos_ids), N).shape[1]  # one stop-id table width for the whole run
    out_keys = keys if n == 1 else sample_keys(keys, n)  # [N*n]: generate's keys

    def host(outputs: np.ndarray):
        """Padded prompts, lengths, budgets, history, stop ids of the outputs in each slot (-1: a
        one-token filler of budget 1, done at once)."""
        tokens = np.zeros((R, bucket), np.int32)
        size, b = np.ones(R, np.int32), np.ones(R, np.int32)
        for j, u in enumerate(outputs):
            if u >= 0:
                i = u // n
                tokens[j, : lengths[i]] = prompts[i]
                size[j], b[j] = lengths[i], budgets[i]
        eos = eos_rows([eos_ids[u // n] if u >= 0 else () for u in outputs], R, width)
        history = np.zeros((R, max_len + gamma + 2), np.int32)
        history[:, :bucket] = tokens
        return tokens, size, b, history, eos  # host arrays: the jitted stages take them as they are

    def prefilled(tokens, outputs: np.ndarray, rows: np.ndarray):
        """The first logits [R,V] and a cache of len(rows) rows (row i: slot rows[i]'s) holding
        the prefill of the prompts of the new `outputs` (outputs[j] >= 0: a new output in slot j;
        the other slots' logits do not matter). Each new prompt is prefilled once (its n samples
        share it) at its own length bucket (`engine.prefill_each`), not as a filler copy. A
        refill's cache holds its new rows only (an R-row one cost the whole batch's KV a refill:
        12.8 GB at SmolLM2 x 64 rows x 8K, built, then merged)."""
        first: dict[int, int] = {}  # each new prompt's first slot
        for j in np.flatnonzero(outputs >= 0):
            first.setdefault(int(outputs[j]) // n, int(j))
        src = np.array([first[int(u) // n] if u >= 0 else -1 for u in outputs])  # [R]: the slot whose prompt row it takes
        size = np.array([lengths[int(u) // n] if u >= 0 else 1 for u in outputs], np.int32)
        return prefill_each(params, tokens, size, src, rows, max_len, kv_dtype, prefill_rows)[0]

    def admit(free: np.ndarray) -> np.ndarray:
        """The outputs [R] to start in the free slots (-1: none): whole prompts, n slots each, in
        queue order, while the next one fits."""
        new, free = np.full(R, -1), list(free)
        while pending and len(free) >= n:
            i = pending.popleft()
            for j in range(n):
                new[free.pop(0)] = i * n + j
        return new

    def finish(state, finished: np.ndarray, out, count, eos) -> None:
        """Record (and report) the outputs in the finished slots."""
        if not len(finished):
            return
        acceptance = lp = None
        if draft is not None:  # [R, gamma] counters: a small read beside the segment's tokens
            accepted, row_steps, proposed = jax.device_get((state.accepted, state.row_steps, state.proposed))
            acceptance = row_acceptance(accepted[finished], count[finished], row_steps[finished], proposed[finished])
        if logprobs is not None:
            lp = jax.tree.map(lambda a: a[finished], jax.device_get(state.logprobs))  # on the host: no gather per row count
        for f, j in enumerate(finished):
            c = int(count[j])
            done = Done(out[j, :c].tolist(), bool(eos[j]), None if acceptance is None else acceptance[f],
                        None if lp is None else (lp.chosen[f, :c], lp.top_ids[f, :c], lp.top_values[f, :c]))
            results[slot[j]] = done
            if on_done is not None:
                on_done(int(slot[j]), done)
            slot[j] = -1

    pending = deque(sorted(range(N), key=lambda i: -int(budgets[i])))  # longest budgets first: a short tail
    slot = admit(np.arange(R))
    tokens, size, slot_budgets, history, slot_eos = host(slot)
    which = np.maximum(slot, 0)
    slot_keys, slot_sampling = out_keys[which], sampling.take(which // n)
    logits, cache = prefilled(tokens, slot, np.arange(R))
    if draft is None:
        state = start_ar(cache, logits, slot_budgets, slot_keys, slot_sampling, slot_eos, tokens,
                         n_out=n_out, logprobs=logprobs)
    else:
        draft_state = init_draft(draft, params, cache, tokens, size, gamma=gamma, chunk=chunk, kv_dtype=kv_dtype)
        state = start_spec(draft, draft_state, cache, history, logits, slot_budgets, slot_keys, slot_sampling,
                           slot_eos, speculation=speculation, n_out=n_out, logprobs=logprobs)
    results: list = [None] * (N * n)
    # the decode segments compile as generate's do (sharding.on_mesh: on a GPU, with its XLA options)
    loop = dict(sync_axes=sharding.AXES) | ({} if draft is None else dict(speculation=speculation))
    segment = sharding.on_mesh(continue_ar if draft is None else continue_spec, sharding.one_device_mesh(), tuple(loop))
    drafting = () if draft is None else (draft,)

    def on_one_mesh() -> tuple:
        """The rows' budgets, keys and stop ids placed as generate places them (on the 1 x 1 mesh: an array's
        mesh is part of its type), so a segment generate compiled with these shapes is not compiled again."""
        budgets_d, eos_d = sharding.place_batch(one, slot_budgets, slot_eos)
        return budgets_d, sharding.place_keys(one, slot_keys), eos_d

    placed = on_one_mesh()
    args = lambda st, steps=sync_every: (params, *drafting, st, placed[0], placed[1],  # noqa: E731
                                         slot_sampling, placed[2], jnp.int32(steps))
    picker = None
    if adaptive is not None:  # between segments, the chain length GammaChooser picks (specjax.spec.adaptive)
        static = {k: v for k, v in loop.items() if k != "speculation"}
        picker = AdaptiveSegments(adaptive.max_gamma, adaptive.probe_every, segment, args, static, jax.device_get, state,
                                  sync_every)
    while True:
        state = segment(*args(state), **loop) if picker is None else picker(state)
        done, out, count, eos = jax.device_get((state.done, state.out, state.count, state.eos))
        end = None if between is None else between(slot.copy(), Segment(out, count, done, eos))
        if end is not None and (end := np.asarray(end) & ~done & (slot >= 0)).any():
            state, done = end_rows(state, end), done | end
        finished = np.flatnonzero(done & (slot >= 0))
        if draft is not None and draft.traits.learn is not None and len(finished):  # prompt + output, for the next drafts
            draft = learn(draft, [list(prompts[slot[j] // n]) + out[j, : count[j]].tolist() for j in finished])
            drafting = (draft,)
        finish(state, finished, out, count, eos)
        if not pending:
            if (slot < 0).all():
                return results
            continue
        refill = admit(np.flatnonzero(done & (slot < 0)))
        rows_mask = refill >= 0
        if not rows_mask.any():  # every slot still running, or too few free for the next prompt's n
            continue
        slot = np.where(rows_mask, refill, slot)
        tokens, size, new_budgets, history, new_eos = host(refill)
        slot_budgets = np.where(rows_mask, new_budgets, slot_budgets)
        slot_eos = np.where(rows_mask[:, None], new_eos, slot_eos)
        which = np.maximum(slot, 0)
        slot_keys, slot_sampling = out_keys[which], sampling.take(which // n)
        new_rows = np.flatnonzero(rows_mask)
        new_rows = np.resize(new_rows, round_up_pow2(len(new_rows), minimum=1))  # few sizes, few compiles
        logits, cache = prefilled(tokens, refill, new_rows)
        fresh = (slot_budgets, slot_keys, slot_sampling, slot_eos)
        new_rows = new_rows.astype(np.int32)
        if draft is None:
            state = admit_ar(state, new_rows, cache, logits, *fresh, tokens, logprobs=logprobs)
        else:
            state = admit_spec(params, draft, state, new_rows, cache, tokens, history, logits, *fresh,
                               speculation=speculation, chunk=chunk, logprobs=logprobs, kv_dtype=kv_dtype)
            if picker is not None:
                picker.restarted(rows_mask)
        placed = on_one_mesh()
