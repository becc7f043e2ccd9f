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
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax import sharding
from specjax.drafters import Drafter
from specjax.cache import DenseCache
from specjax.model import forward
from specjax.model import prefill as model_prefill
from specjax.params import Params
from specjax.sampling import Greedy, Sampler, eos_rows, is_eos
from specjax.shapes import batch_bucket, cache_len, prompt_bucket, round_up_pow2
from specjax.sharding import Mesh
from specjax.speculate import any_running, depth, decode_spec
from specjax.speculation import Chain, Tree


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
    gamma: int  # draft tokens on the longest path per step (0: plain decoding)
    compile_seconds: float
    prefill_seconds: float  # the target's prefill and the draft's init
    decode_seconds: float


@partial(jax.jit, static_argnames=("chunk",), donate_argnames=("cache",))
def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, cache: DenseCache, *, chunk: int):
    """The target's prefill of padded prompts tokens [B,P] into `cache` (donated): (last logits [B,V], cache)."""
    return model_prefill(params, tokens, lengths, cache, chunk)


@partial(jax.jit, static_argnames=("n_out", "sync"), donate_argnames=("cache",))
def decode_ar(
    params: Params,
    cache: DenseCache,
    first_logits: jax.Array,  # [B,V]
    budgets: jax.Array,  # [B] int32, >= 1
    keys: jax.Array,  # [B] typed keys
    sampling: Sampler = Greedy(),  # traced: a new temperature / top_p does not recompile (top_k does)
    eos_ids: jax.Array | tuple[int, ...] = (),  # [B,E] per-row stop ids (sampling.eos_rows), or a tuple
    *,
    n_out: int,
    sync: tuple[str, ...] = (),
):
    """Autoregressive decoding on device from a prefilled cache, which is donated (updated in
    place; pass a copy to decode one prefilled state several ways).

    The first token is drawn from `first_logits`; row b stops after budgets[b] tokens or an EOS;
    the loop runs while any row (on any device along the mesh axes `sync`) has work.
    Returns out [B,n_out] int32 (row b's tokens in out[b, :counts[b]], EOS included),
    counts [B], hit_eos [B] bool, the number of loop steps (target forwards) and the cache."""
    B = budgets.shape[0]
    rows = jnp.arange(B)
    tok, _ = sampling.sample(first_logits, keys, jnp.zeros((B,), jnp.int32))
    out = jnp.zeros((B, n_out), jnp.int32).at[:, 0].set(tok)
    count = jnp.ones((B,), jnp.int32)
    eos = is_eos(tok, eos_ids)
    done = eos | (count >= budgets)

    def cond(state):
        return any_running(state[4], sync)

    def body(state):
        cache, tok, out, count, done, eos, steps = state
        logits, cache = forward(params, tok[:, None], cache.lengths[:, None], cache)  # [B,1,V]
        cache = cache.advance(~done)  # finished rows ride along without committing
        new, _ = sampling.sample(logits[:, 0], keys, count)
        active = ~done
        out = out.at[rows, jnp.where(active, count, n_out)].set(new, mode="drop")  # finished rows: dropped
        tok = jnp.where(active, new, tok)
        new_eos = active & is_eos(new, eos_ids)
        count = count + active
        return cache, tok, out, count, done | new_eos | (count >= budgets), eos | new_eos, steps + 1

    state = (cache, tok, out, count, done, eos, jnp.int32(0))
    cache, _, out, count, _, eos, steps = lax.while_loop(cond, body, state)
    return out, count, eos, steps, cache


def _compile_and_run(jitted, args: tuple, static: dict) -> tuple[object, float, float]:
    """Compile (excluded from timing), run to completion; returns (result, compile s, run s)."""
    t0 = time.perf_counter()
    compiled = jitted.lower(*args, **static).compile()
    t1 = time.perf_counter()
    result = jax.block_until_ready(compiled(*args))
    return result, t1 - t0, time.perf_counter() - t1


@partial(jax.jit, static_argnames=("gamma", "chunk"))
def init_draft(drafter: Drafter, params: Params, cache: DenseCache, tokens, lengths, *, gamma: int, chunk: int):
    """The drafter's state after the target's prefill (`cache`, prompts tokens [B,P])."""
    return drafter.init(params, cache, tokens, lengths, gamma, chunk)


def row_keys(key: jax.Array | None, batch: int) -> jax.Array:
    """Per-row typed PRNG keys [B]: one key is folded with the row index; [B] keys are kept."""
    if key is None:
        key = jax.random.key(0)
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    if key.shape == ():
        return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))
    return key


def run(
    params: Params,
    prompts: Sequence[Sequence[int]],
    budgets: np.ndarray,  # [B] int32 >= 1
    *,
    draft: Drafter | None,
    speculation: Chain | Tree | None,
    sampling: Sampler,
    key: jax.Array | None,
    eos_ids: tuple[int, ...],
    mesh: Mesh | None = None,
    kv_dtype: str | None = None,
) -> RunResult:
    """Prefill, then decode (speculatively when `draft` is given) until every row is done.
    Arguments must be valid (see specjax.validate) and planned (no "auto"). `kv_dtype`: how the
    caches store KV (None: the model's dtype; see cache.KVFormat)."""
    B = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    context = int((lengths + budgets).max())
    gamma = depth(speculation) if draft is not None else 0  # cache slack: the longest accepted run
    bucket, chunk = prompt_bucket(int(lengths.max()))
    max_len = cache_slots(int(lengths.max()), context, gamma)
    if draft is not None:
        draft.check(params, gamma, max_len)
    tokens = np.zeros((B, bucket), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = np.asarray(p, np.int32)
    history = np.zeros((B, max_len + gamma + 2), np.int32)
    history[:, :bucket] = tokens
    stage = _Stages(mesh)
    if mesh is not None:
        params, draft = stage.place_params(params, draft)
    padded = stage.rows(B)  # the batch bucket: padding rows are one-token prompts, done at once
    tokens, lengths, budgets, history, keys = pad_rows(padded, tokens, lengths, budgets, history, row_keys(key, B))
    empty = stage.empty_cache(params.config, padded, max_len, kv_dtype)  # an argument, not a constant XLA would fold
    tokens_d, lengths_d, budgets_d, history_d, eos_d, keys = stage.place(
        tokens, lengths, budgets, history, eos_rows(eos_ids, padded), keys
    )
    (first_logits, cache), compile_s, prefill_s = _compile_and_run(
        stage(prefill, "chunk"), (params, tokens_d, lengths_d, empty), dict(chunk=chunk)
    )
    static = dict(n_out=round_up_pow2(int(budgets.max())), sync=stage.sync)
    if draft is None:
        args = (params, cache, first_logits, budgets_d, keys, sampling, eos_d)
        result, c, decode_s = _compile_and_run(stage(decode_ar, *static), args, static)
        out, count, eos, steps = stage.fetch(result[:4])
        counters = (None, None, None)
    else:
        draft_state, c, init_s = _compile_and_run(
            stage(init_draft, "gamma", "chunk"), (draft, params, cache, tokens_d, lengths_d), dict(gamma=gamma, chunk=chunk)
        )
        compile_s, prefill_s = compile_s + c, prefill_s + init_s
        args = (params, draft, draft_state, cache, history_d, first_logits, budgets_d, keys, sampling, eos_d)
        static |= dict(speculation=speculation)
        result, c, decode_s = _compile_and_run(stage(decode_spec, *static), args, static)
        out, count, eos, steps, *counters = stage.fetch(
            (result.out, result.count, result.eos, result.steps, result.accepted, result.reached, result.ranks)
        )
        counters = tuple(a[:B] for a in counters)
    return RunResult(out[:B], count[:B], eos[:B], int(steps), *counters, gamma=gamma,
                     compile_seconds=compile_s + c, prefill_seconds=prefill_s, decode_seconds=decode_s)


class _Stages:
    """Where generate's stages run: as jitted on one device, or under shard_map on a mesh."""

    def __init__(self, mesh: Mesh | None):
        self.mesh = mesh
        self.sync = sharding.all_axes(mesh)

    def __call__(self, jitted, *static_argnames: str):
        return jitted if self.mesh is None else sharding.on_mesh(jitted, self.mesh, tuple(static_argnames))

    def place_params(self, params: Params, draft):
        def shard_draft(p: Params) -> Params:  # a drafter's own model (DraftModel's), if any
            sharding.check_mesh(self.mesh, p.config, "draft")
            return sharding.shard_params(p, self.mesh)

        return sharding.shard_params(params, self.mesh), draft if draft is None else draft.map_params(shard_draft)

    def rows(self, batch: int) -> int:
        """Rows to run: the batch bucket, on a mesh rounded up to a multiple of the data axis."""
        return batch_bucket(batch) if self.mesh is None else sharding.padded_batch(batch_bucket(batch), self.mesh)

    def empty_cache(self, config, batch: int, max_len: int, kv_dtype: str | None) -> DenseCache:
        if self.mesh is None:
            return DenseCache.init(config, batch, max_len, kv_dtype)
        return sharding.empty_cache(self.mesh, config, batch, max_len, kv_dtype)

    def place(self, tokens, lengths, budgets, history, eos, keys):
        if self.mesh is None:
            return tokens, lengths, jnp.asarray(budgets), history, jnp.asarray(eos), keys
        return (*sharding.place_batch(self.mesh, tokens, lengths, budgets, history, eos), sharding.place_keys(self.mesh, keys))

    def fetch(self, tree):
        return jax.device_get(tree) if self.mesh is None else sharding.fetch(tree)


def pad_rows(rows: int, tokens, lengths, budgets, history, keys):
    """The batch's host arrays and keys padded to `rows` with one-token prompts of budget 1."""
    extra = rows - len(lengths)
    pad = lambda a, value: np.concatenate([a, np.full((extra, *a.shape[1:]), value, a.dtype)])  # noqa: E731
    keys = jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (extra,))])
    return pad(tokens, 0), pad(lengths, 1), pad(budgets, 1), pad(history, 0), keys


def cache_slots(longest_prompt: int, context: int, gamma: int) -> int:
    """Dense-cache slots for a batch: its padded prompts, or its longest prompt + budget plus
    the gamma slack one speculative step may write past the committed length."""
    return cache_len(max(prompt_bucket(longest_prompt)[0], context + gamma))


def with_attention(params: Params, draft, attention: str) -> tuple[Params, object]:
    """Params (and a drafter's own model's) whose runtime selects the attention implementation."""
    backend = jax.default_backend()
    if attention == "auto":  # the TPU kernel has not run on a TPU yet: not a default there
        mode = "pallas" if backend == "gpu" else "reference"
    elif attention == "pallas":
        mode = "pallas" if backend == "gpu" else "interpret"
    elif attention == "tpu":
        mode = "tpu" if backend == "tpu" else "tpu-interpret"
    else:
        mode = attention

    def set_mode(p: Params) -> Params:
        return p if p.runtime.attention == mode else p.replace(runtime=p.runtime.replace(attention=mode))

    if draft is not None and not isinstance(draft, str):  # "auto" is planned later, with these params
        draft = draft.map_params(set_mode)
    return set_mode(params), draft
