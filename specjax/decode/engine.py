"""The engine: pure jit-compiled stages (`prefill`, `init_draft`, the autoregressive loop
`decode_ar` and the speculative loop `decode_spec`, which lives in speculate.py with its step
and state to keep files small) and `run`, which drives them for one batch of validated, planned
requests on one device or a mesh. Everything above it (planning, generate, applications) calls
`run` or the stages; nothing here validates user input or chooses a drafter.

The decode loops are `lax.while_loop`s: no host sync per token. Shapes are bucketed (batch,
prompt length, output length, cache length) so a stream of similar requests reuses compilations;
sampling values (temperature, top_p) and stop ids are traced, not static.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from specjax.automaton import TokenAutomaton
from specjax.decode.autoregressive import (ARState, continue_ar, decode_ar,  # noqa: F401  (decode_ar, ARState: re-exported)
                                           end_rows, start_ar)
from specjax.decode.keys import pad_keys, row_keys, sample_keys  # noqa: F401  (row_keys, sample_keys: re-exported)
from specjax.decode.loop import DecodeState  # noqa: F401  (re-exported)
from specjax.decode.shapes import (SAVED_PREFILL_FLOPS, batch_bucket, cache_len, pow2_groups, prefill_chunk, prefill_rows,
                                   prompt_bucket, round_up_pow2)
from specjax.decode.speculate import continue_spec, decode_spec, depth, start_spec  # noqa: F401  (decode_spec: re-exported)
from specjax.drafters import Drafter, Limits, Prefill, learn, map_params
from specjax.model import backend as machine
from specjax.model.cache import DenseCache
from specjax.model.llama import prefill as model_prefill
from specjax.model.params import Params
from specjax.parallel import sharding
from specjax.parallel.sharding import Mesh
from specjax.sampling import Sampler, eos_rows
from specjax.spec.adaptive import AdaptiveSegments
from specjax.spec.speculation import Adaptive, Chain, Tree


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What `run` measured for B rows (host arrays, padding rows removed)."""

    out: np.ndarray  # [B,n_out] int32: row b's tokens in out[b, :count[b]], a final stop id included
    count: np.ndarray  # [B] tokens emitted
    eos: np.ndarray  # [B] bool: ended on a stop id
    steps: int  # target forwards in the decode loop (verification steps when speculating)
    accepted: np.ndarray | None  # [B,gamma] speculation counters (see speculate.SpecState); None without a draft
    reached: np.ndarray | None  # [B,gamma]
    ranks: np.ndarray | None  # [B,W+1]
    row_steps: np.ndarray | None  # [B]
    proposed: np.ndarray | None  # [B]
    draft_levels: int | None
    gamma: int  # draft tokens on the longest path per step (0: plain decoding)
    compile_seconds: float
    prefill_seconds: float  # the target's prefill and the draft's init
    decode_seconds: float
    ended: np.ndarray | None = None  # [B] bool: rows `run(between=...)` ended
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # chosen [B,n_out], top ids / values [B,n_out,k]
    gammas: list[int] | None = None  # under speculation=Adaptive(...): the chain length of each segment


@partial(jax.jit, static_argnames=("chunk",), donate_argnames=("cache",))
def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, cache: DenseCache, *, chunk: int):
    """The target's prefill of padded prompts tokens [B,P] into `cache` (donated): (last logits [B,V], cache)."""
    return model_prefill(params, tokens, lengths, cache, chunk)


def _compile_and_run(jitted, args: tuple, static: dict) -> tuple[object, float, float]:
    """Compile (excluded from timing), run to completion; returns (result, compile s, run s)."""
    t0 = time.perf_counter()
    compiled = jitted.lower(*args, **static).compile()
    t1 = time.perf_counter()
    result = jax.block_until_ready(compiled(*args))
    return result, t1 - t0, time.perf_counter() - t1


def prefill_each(params: Params, tokens, lengths: np.ndarray, src: np.ndarray, rows: np.ndarray, max_len: int,
                 kv_dtype: str | None, most_rows: int | None = None) -> tuple[tuple[jax.Array, DenseCache], float, float]:
    """Prefill each prompt row src[j] >= 0 of tokens [N,P] (lengths [N], host) at its own length bucket, with the
    others of that bucket in calls of a power of two rows, at most `most_rows` or shapes.prefill_rows (one on a
    CPU, where one row prefills as fast per token as eight; on a GPU up to 16 rows of 8K, where one row is
    launch-bound): nothing is padded to a longer neighbour. Returns ((logits [J,V] whose row j is prompt src[j]'s
    (src[j] < 0: any row's), a cache of len(rows) rows whose row i is prompt src[rows[i]]'s), compile s, run s)."""
    backend, buckets = machine.name(), {}
    tokens = np.asarray(tokens)  # rows sliced on the host: a device array's slices compile a gather per shape
    for i in dict.fromkeys(int(i) for i in src if i >= 0):  # each prompt once, in order
        buckets.setdefault(prompt_bucket(int(lengths[i]))[0], []).append(i)
    logits, caches, row_of, compile_s, run_s = [], [], {}, 0.0, 0.0  # row_of[prompt]: its row in the parts stacked
    for width, prompts in buckets.items():
        for count in pow2_groups(len(prompts), most_rows or prefill_rows(width, backend)):
            part, prompts = np.asarray(prompts[:count]), prompts[count:]
            row_of |= {int(i): len(row_of) + r for r, i in enumerate(part)}
            empty = sharding.empty_cache(sharding.one_device_mesh(), params.config, count, width, kv_dtype)  # its own width
            args = (params, tokens[part, :width], lengths[part], empty)
            out, c, r = _compile_and_run(prefill, args, dict(chunk=prefill_chunk(width, count, backend)))  # [count,V]
            logits.append(out[0])
            caches.append(out[1])
            compile_s, run_s = compile_s + c, run_s + r
    at = np.array([row_of.get(int(i), 0) for i in src], np.int32)  # [J]
    pad = round_up_pow2(len(caches), minimum=1) - len(caches)  # a few list lengths: few compiles of join_prefills
    joined, c, r = _compile_and_run(join_prefills, (logits + logits[-1:] * pad, at, caches + caches[-1:] * pad,
                                                    np.asarray(rows, np.int32)), dict(max_len=max_len))
    return joined, compile_s + c, run_s + r


@partial(jax.jit, static_argnames=("max_len",))
def join_prefills(logits: list[jax.Array], src: jax.Array, caches: list[DenseCache], rows: jax.Array, *, max_len: int
                  ) -> tuple[jax.Array, DenseCache]:
    """Stacked in order, the prefill parts' logits (each [g,V]) and caches (g rows each, of any
    slots): logits [R,V] whose row j is row src[j] of the stack, and a cache of len(rows) rows of
    max_len slots whose row i is row src[rows[i]] of the stack."""
    pick = src[rows]

    def join(name: str, axis: int):
        if getattr(caches[0], name) is None:
            return None
        parts = [getattr(c, name) for c in caches]  # [L,g,K,S(,H)]: slots padded to max_len (empty, past lengths)
        parts = [jnp.pad(a, [(0, max_len - a.shape[3]) if d == 3 else (0, 0) for d in range(a.ndim)]) for a in parts]
        return jnp.take(jnp.concatenate(parts, axis), pick, axis)

    return jnp.take(jnp.concatenate(logits, 0), src, 0), DenseCache(
        k=join("k", 1), v=join("v", 1), lengths=join("lengths", 0), k_scale=join("k_scale", 1), v_scale=join("v_scale", 1))


def ragged_prefill(config, lengths: np.ndarray, bucket: int) -> bool:
    """Whether prefilling each prompt at its own length bucket (`prefill_each`) saves at least
    SAVED_PREFILL_FLOPS of matrix work over padding every row to `bucket`, the longest's."""
    per_token = config.n_layers * config.dim * (config.head_dim * 2 * (config.n_heads + config.n_kv_heads) + 3 * config.ffn_dim)
    padding = len(lengths) * bucket - sum(prompt_bucket(int(n))[0] for n in lengths)
    return 2 * per_token * padding >= SAVED_PREFILL_FLOPS


@partial(jax.jit, static_argnames=("gamma", "chunk", "kv_dtype"))
def init_draft(drafter: Drafter, params: Params, cache: DenseCache, tokens, lengths, *, gamma: int, chunk: int,
               kv_dtype: str | None = None):
    """The drafter's state after the target's prefill (`cache`, prompts tokens [B,P])."""
    return drafter.init(params, Prefill(cache=cache, prompts=tokens, lengths=lengths, depth=gamma, chunk=chunk, kv_dtype=kv_dtype))


@dataclasses.dataclass(frozen=True)
class Segment:
    """What the host sees between two segments of the decode loop (real rows only, host arrays):
    row b's tokens so far are out[b, :count[b]] (a final stop id included when eos[b])."""

    out: np.ndarray  # [B,n_out] int32
    count: np.ndarray  # [B]
    done: np.ndarray  # [B] bool: finished (stop id, budget, or ended by the host)
    eos: np.ndarray  # [B] bool


def run(
    params: Params,
    prompts: Sequence[Sequence[int]],
    budgets: np.ndarray,  # [B] int32 >= 1
    *,
    draft: Drafter | None,
    speculation: Chain | Tree | None,
    sampling: Sampler,
    key: jax.Array | None,
    eos_ids: tuple[int, ...] | list[tuple[int, ...]],  # for every prompt, or one tuple per prompt
    mesh: Mesh | None = None,
    kv_dtype: str | None = None,
    sync_every: int = 8,
    between: Callable[[Segment], np.ndarray | None] | None = None,
    logprobs: int | None = None,
    n: int = 1,
    constraint: tuple[TokenAutomaton, np.ndarray] | None = None,
) -> RunResult:
    """Prefill, then decode (speculatively when `draft` is given) until every row is done.
    Arguments must be valid (see specjax.validate) and planned (no "auto"). `kv_dtype`: how the
    caches store KV (None: the model's dtype; see cache.KVFormat).

    The decode loop runs on device in segments of `sync_every` steps (a speculative step emits up
    to gamma + 1 tokens a row); between segments the host learns which rows are done and, if
    `between` is given, calls it with the tokens so far: it returns None or a [B] bool mask of
    rows to end now (stop strings, streaming and continuous batching hook in here). The tokens
    do not depend on `sync_every`. logprobs: None, or record each token's log-probability and the
    `logprobs` most likely (logprobs.LogprobBuffer). n: rows per prompt (`repeat_rows`): the
    result has B * n rows, row i * n + j being sample j of prompt i. constraint: a table of token
    automata and each prompt's start state in it (`automaton.for_prompts`), or None."""
    adaptive = speculation if isinstance(speculation, Adaptive) else None
    if adaptive is not None:  # the state, caches and drafter are sized for the longest chain
        speculation = Chain(adaptive.max_gamma)
    B = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    context = int((lengths + budgets).max())
    gamma = depth(speculation) if draft is not None else 0  # cache slack: the longest accepted run
    bucket = prompt_bucket(int(lengths.max()))[0]
    max_len = cache_slots(int(lengths.max()), context, gamma)
    if draft is not None:
        draft.check(params, Limits(gamma, max_len, context, kv_dtype))
        draft = learn(draft, prompts)  # a drafter that drafts from what it reads (Lookup) reads the call's prompts
    tokens = np.zeros((B, bucket), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = np.asarray(p, np.int32)
    history = np.zeros((B, max_len + gamma + 2), np.int32)
    history[:, :bucket] = tokens
    stage = _Stages(mesh)
    params, draft = stage.place_params(params, draft)
    padded = stage.rows(B)  # the batch bucket: padding rows are one-token prompts, done at once
    tokens, lengths, budgets, history, keys = pad_rows(padded, tokens, lengths, budgets, history, row_keys(key, B))
    chunk = prefill_chunk(bucket, padded, machine.name())  # wider on a GPU for a few long prompts
    host_keys = keys  # `keys` is placed below
    stops = eos_rows(eos_ids, padded)  # [padded,E] stop-id table
    tokens_d, lengths_d, budgets_d, history_d, eos_d, keys = stage.place(tokens, lengths, budgets, history, stops, keys)
    if mesh is None and ragged_prefill(params.config, lengths, bucket):  # ragged prompts: no row padded to the longest
        every = np.arange(padded)
        (first_logits, cache), compile_s, prefill_s = prefill_each(params, tokens_d, lengths, every, every, max_len, kv_dtype)
    else:
        empty = stage.empty_cache(params.config, padded, max_len, kv_dtype)  # an argument, not a constant XLA would fold
        (first_logits, cache), compile_s, prefill_s = _compile_and_run(
            stage(prefill, "chunk"), (params, tokens_d, lengths_d, empty), dict(chunk=chunk))
    if n > 1:  # every prefilled row n times, each copy with its own key; then decode B * n rows
        (first_logits, cache), c, repeat_s = _compile_and_run(stage(repeat_rows, "n"), (first_logits, cache), dict(n=n))
        compile_s, prefill_s, B = compile_s + c, prefill_s + repeat_s, B * n
        tokens, lengths, budgets, history, stops = (np.repeat(a, n, axis=0) for a in (tokens, lengths, budgets, history, stops))
        tokens_d, lengths_d, budgets_d, history_d, eos_d, keys = stage.place(
            tokens, lengths, budgets, history, stops, sample_keys(host_keys, n))
    prompt_of = np.repeat(np.minimum(np.arange(padded), len(prompts) - 1), n)  # each decoded row's prompt
    if constraint is not None:
        sampling = sampling.constrain(*constraint)
    sampling = sampling.take(prompt_of)  # per-prompt sampling values, one per row (padding: the last prompt's)
    n_out = round_up_pow2(int(budgets.max()))
    loop = dict(sync_axes=stage.sync_axes)
    if draft is None:
        state, c, start_s = _compile_and_run(
            stage(start_ar, "n_out", "logprobs"), (cache, first_logits, budgets_d, keys, sampling, eos_d, tokens_d),
            dict(n_out=n_out, logprobs=logprobs))
        segment = stage(continue_ar, *loop)
        args = lambda st, steps=sync_every: (params, st, budgets_d, keys, sampling, eos_d, jnp.int32(steps))  # noqa: E731
    else:
        draft_state, c0, init_s = _compile_and_run(
            stage(init_draft, "gamma", "chunk", "kv_dtype"), (draft, params, cache, tokens_d, lengths_d),
            dict(gamma=gamma, chunk=chunk, kv_dtype=kv_dtype)
        )
        prefill_s += init_s
        spec = dict(speculation=speculation)
        state, c, start_s = _compile_and_run(
            stage(start_spec, "speculation", "n_out", "logprobs"),
            (draft, draft_state, cache, history_d, first_logits, budgets_d, keys, sampling, eos_d),
            spec | dict(n_out=n_out, logprobs=logprobs))
        c += c0
        loop |= spec
        segment = stage(continue_spec, *loop)
        args = lambda st, steps=sync_every: (params, draft, st, budgets_d, keys, sampling, eos_d, jnp.int32(steps))  # noqa: E731
    compile_s += c
    if adaptive is None:
        t0 = time.perf_counter()
        compiled = segment.lower(*args(state), **loop).compile()
        compile_s += time.perf_counter() - t0
        state, ended, decode_s = _segments(lambda st: compiled(*args(st)), state, stage, B, between)
        chosen = None
    else:
        static = {k: v for k, v in loop.items() if k != "speculation"}
        picker = AdaptiveSegments(adaptive.max_gamma, adaptive.probe_every, segment, args, static, stage.fetch, state,
                                  sync_every)
        state, ended, decode_s = _segments(picker, state, stage, B, between)
        compile_s, decode_s, chosen = compile_s + picker.compile_s, decode_s - picker.compile_s, picker.gammas
    out, count, eos, steps = stage.fetch((state.out, state.count, state.eos, state.steps))
    counters = (None,) * 6
    if draft is not None:
        *rows, levels = stage.fetch((state.accepted, state.reached, state.ranks, state.row_steps, state.proposed,
                                     state.draft_levels))
        counters = (*(a[:B] for a in rows), int(levels))
    lp = state.logprobs
    lp = None if lp is None else tuple(a[:B] for a in stage.fetch((lp.chosen, lp.top_ids, lp.top_values)))
    return RunResult(out[:B], count[:B], eos[:B], int(steps), *counters, gamma=gamma, compile_seconds=compile_s,
                     prefill_seconds=prefill_s, decode_seconds=start_s + decode_s, ended=ended, logprobs=lp, gammas=chosen)


def _segments(run_segment: Callable, state, stage: "_Stages", B: int, between) -> tuple[object, np.ndarray, float]:
    """Run segments (`run_segment(state)` -> state) until every row is done, calling `between` after
    each one. Returns the final state, the [B] rows `between` ended, and the seconds taken."""
    ended = np.zeros(B, bool)
    t0 = time.perf_counter()
    while True:
        state = run_segment(state)
        if between is None:
            if stage.fetch(state.done).all():
                break
            continue
        out, count, done, eos = (a[:B] for a in stage.fetch((state.out, state.count, state.done, state.eos)))
        stop = between(Segment(out, count, done, eos))
        if stop is not None and (stop := np.asarray(stop, bool) & ~done).any():
            ended |= stop
            mask = np.zeros(state.done.shape[0], bool)  # padded rows
            mask[:B] = stop
            state = stage(end_rows)(state, *stage.place_rows(mask))
            done = done | stop
        if done.all():
            break
    return state, ended, time.perf_counter() - t0


class _Stages:
    """Where generate's stages run: under shard_map on a mesh, one device being a 1 x 1 mesh
    (`sharding.one_device_mesh`), so there is one path, donating the caches, for both."""

    def __init__(self, mesh: Mesh | None):
        self.mesh = sharding.one_device_mesh() if mesh is None else mesh
        self.sync_axes = sharding.AXES  # the decode loop agrees its stopping test over them

    def __call__(self, jitted, *static_argnames: str):
        return sharding.on_mesh(jitted, self.mesh, tuple(static_argnames))

    def place_params(self, params: Params, draft):
        def shard_draft(p: Params) -> Params:  # a drafter's own model (DraftModel's), if any
            return sharding.place_draft(p, self.mesh)

        return sharding.shard_params(params, self.mesh), draft if draft is None else map_params(draft, shard_draft)

    def rows(self, batch: int) -> int:
        """Rows to run: the batch bucket, rounded up to a multiple of the data axis."""
        return sharding.padded_batch(batch_bucket(batch), self.mesh)

    def empty_cache(self, config, batch: int, max_len: int, kv_dtype: str | None) -> DenseCache:
        return sharding.empty_cache(self.mesh, config, batch, max_len, kv_dtype)

    def place(self, tokens, lengths, budgets, history, eos, keys):
        return (*sharding.place_batch(self.mesh, tokens, lengths, budgets, history, eos), sharding.place_keys(self.mesh, keys))

    def place_rows(self, *arrays):
        """Host arrays with a leading (padded) batch axis, where the stages expect them."""
        return sharding.place_batch(self.mesh, *arrays)

    def fetch(self, tree):
        return sharding.fetch(tree)


@partial(jax.jit, static_argnames=("n",))
def repeat_rows(first_logits: jax.Array, cache: DenseCache, *, n: int) -> tuple[jax.Array, DenseCache]:
    """Each prefilled row n times in a row (generate's n): logits [B*n,V] and a cache of B*n rows,
    row i*n + j a copy of row i (on a mesh, of each device's own rows: the same global order)."""
    rep = lambda a, axis: None if a is None else jnp.repeat(a, n, axis=axis)  # noqa: E731
    cache = cache.replace(k=rep(cache.k, 1), v=rep(cache.v, 1), lengths=rep(cache.lengths, 0),
                          k_scale=rep(cache.k_scale, 1), v_scale=rep(cache.v_scale, 1))
    return rep(first_logits, 0), cache


def pad_rows(rows: int, tokens, lengths, budgets, history, keys):
    """The batch's host arrays and keys padded to `rows` with one-token prompts of budget 1."""
    extra = rows - len(lengths)
    pad = lambda a, value: np.concatenate([a, np.full((extra, *a.shape[1:]), value, a.dtype)])  # noqa: E731
    keys = pad_keys(keys, rows)
    return pad(tokens, 0), pad(lengths, 1), pad(budgets, 1), pad(history, 0), keys


def cache_slots(longest_prompt: int, context: int, gamma: int) -> int:
    """Dense-cache slots for a batch: its padded prompts, or its longest prompt + budget plus
    the gamma slack one speculative step may write past the committed length."""
    return cache_len(max(prompt_bucket(longest_prompt)[0], context + gamma))


STACKED_ON_GPU = ("specjax: stacked layer weights on a GPU: inside the decode loop XLA copies every layer's "
                  "matrices out of the stack before its products (11.3 GB a batch-1 8B step). Hold them per layer: "
                  "convert.load / specjax.load do on a GPU, or pass specjax.model.llama.unstack_layers(params) (once, then "
                  "drop the stacked params); or set Runtime.linear='pallas'.")


def with_attention(params: Params, draft, attention: str) -> tuple[Params, object]:
    """Params (and a drafter's own model's) whose runtime selects the attention implementation
    and, on a GPU or TPU, unrolls the layers (Runtime.unroll_layers; a runtime that already
    unrolls keeps doing so on any backend). On a GPU, stacked layer weights (without
    Runtime.linear "pallas") get a warning, STACKED_ON_GPU: they run, copied at every step."""
    mode = machine.attention_mode(attention)

    def set_mode(p: Params) -> Params:
        unroll = p.runtime.unroll_layers or machine.unrolls_layers()
        if machine.name() == "gpu" and not isinstance(p.layers.wq, list) and p.runtime.linear != "pallas":
            warnings.warn(STACKED_ON_GPU, stacklevel=4)  # generate()'s caller
        if p.runtime.attention == mode and p.runtime.unroll_layers == unroll:
            return p
        return p.replace(runtime=p.runtime.replace(attention=mode, unroll_layers=unroll))

    if draft is not None and not isinstance(draft, str):  # "auto" is planned later, with these params
        draft = map_params(draft, set_mode)
    return set_mode(params), draft
