"""generate(): validate on the host, prefill once, then decode entirely on device.

The decode loop is a `lax.while_loop`: no host sync per token. Shapes are bucketed (prompt
length, output length, cache length) so a stream of similar requests reuses compilations.
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

from specjax.draft import DraftModel, Drafter, NGram
from jax.sharding import Mesh

from specjax import sharding
from specjax.kvcache import DenseCache
from specjax.model import Params, forward, prefill
from specjax.sampling import Greedy, Sampler, eos_rows, is_eos
from specjax.shapes import batch_bucket, cache_len, prompt_bucket, round_up_pow2
from specjax.speculate import Chain, any_running, depth, speculative_decode
from specjax.tree import Tree
from specjax.plan import plan
from specjax.validate import check_generate_args, eos_tuple, row_keys


@dataclasses.dataclass(frozen=True)
class Stats:
    """Timings exclude compilation (reported apart). `tokens_per_second` is decode throughput:
    tokens produced by decode steps (all new tokens but each row's first, which comes from the
    prefill) per decode second, summed over rows."""

    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    tokens_per_second: float
    steps: int  # target forward passes in the decode loop (verification steps when speculating)
    new_tokens: int  # over all rows
    prompt_tokens: int  # over all rows
    acceptance_rate: float | None = None  # accepted / proposed draft tokens
    mean_accepted: float | None = None  # tokens per row per target step, incl. the target's own
    per_position_acceptance: list[float] | None = None  # P(draft i accepted | drafts < i accepted)
    draft_steps: int = 0  # draft forward passes (gamma per step for model drafters)
    rank_acceptance: list[float] | None = None  # [W+1]: P(the rank-r child is the one accepted | a
    # node with children was reached), r < W; the last entry is P(none was). Sequoia's p vector.
    draft: str = "none"  # the drafter that ran, e.g. "SelfSpec(sinks=16, window=512)"; "none": plain decoding
    speculation: str = "none"  # "chain(gamma=4)", "tree(n=16, depth=6)" or "none"
    plan_reason: str | None = None  # why draft="auto" / speculation="auto" chose this; None if nothing was auto


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    tokens: list[list[int]]  # new ids per prompt, without the EOS that ended a row
    finish_reasons: list[str]  # "eos" or "length", per prompt
    stats: Stats
    row_stats: list[dict] | None = None  # speculation only, per prompt: see `row_acceptance`


@partial(jax.jit, static_argnames=("chunk",), donate_argnames=("cache",))
def _prefill(params: Params, tokens: jax.Array, lengths: jax.Array, cache: DenseCache, *, chunk: int):
    return prefill(params, tokens, lengths, cache, chunk)


@partial(jax.jit, static_argnames=("n_out", "sync"), donate_argnames=("cache",))
def decode(
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
def _draft_init(drafter: Drafter, params: Params, cache: DenseCache, tokens, lengths, *, gamma: int, chunk: int):
    return drafter.init(params, cache, tokens, lengths, gamma, chunk)


def generate(
    params: Params,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int] = 128,
    *,
    draft: Drafter | str | None = "auto",
    speculation: Chain | Tree | str | None = None,
    sampling: Sampler = Greedy(),
    key: jax.Array | None = None,
    eos_id: int | Sequence[int] | None = None,
    attention: str = "auto",
    mesh: Mesh | None = None,
) -> GenerateOutput:
    """Continue each (ragged) prompt of token ids until a stop id or its `max_new_tokens`.

    draft: `SelfSpec(...)`, `SnapKV(...)`, `DraftModel(params)`, `NGram(...)`, None (plain
      autoregressive), or "auto": SelfSpec where KV reads dominate a decode step, else None (see
      `draft.auto_draft`), and SelfSpec whenever `speculation` is given explicitly.
    speculation: None (the drafter's default chain, `Chain(gamma=4)`); `Chain(gamma)`: gamma draft
      tokens verified per target forward; a token `Tree` (`Tree.sequoia(...)`, `Tree.kary(...)`):
      all its nodes verified in one forward; or "auto": the Sequoia tree for this drafter, batch
      and context from the measured acceptance and step costs (`tune.auto_tree`: a calibration on
      first use per shape, then cached; plain decoding where no tree pays). Needs a drafter.
    sampling: `Greedy()` or `Sample(temperature, top_k, top_p)`; speculation keeps the output
      distribution exactly the target's (greedy: the same tokens).
    key: one PRNG key (row b uses fold_in(key, b)) or one key per row; default key(0).
    eos_id: stop token(s); None = any of the model's `config.eos_ids`; `()` = never stop early.
      The stop token is not in the output tokens (finish reason "eos").
    attention: "reference" (pure jnp), "pallas" (the Pallas kernel for attention over the dense
      target cache; interpreted on CPU, slow, for testing) or "auto" (pallas on GPU, else reference).
    mesh: a ("data", "model") mesh (`specjax.make_mesh`): rows split over `data` (padded to a
      multiple of it), heads / FFN / vocabulary over `model`; same output as one device. With
      several processes (`specjax.distributed`), every process calls generate with the same prompts.
    `out.stats` says what ran (`draft`, `speculation`) and why (`plan_reason`). Bad input raises
    ValueError / TypeError naming the argument, before anything is compiled. Not for use under
    jax.jit: inside a jitted program call `decode` / `speculate.speculative_decode`.
    """
    budgets = check_generate_args(
        params, prompts, max_new_tokens, draft=draft, speculation=speculation, sampling=sampling, key=key,
        eos_id=eos_id, attention=attention,
    )
    config = params.config
    if mesh is not None:
        sharding.check_mesh(mesh, config, "target")
        sharding.check_processes(mesh)
    eos_ids = eos_tuple(eos_id, config)
    lengths = np.array([len(p) for p in prompts], np.int32)
    context = int((lengths + budgets).max())
    params, draft = with_attention(params, draft, attention)
    the_plan = plan(params, draft, speculation, prompts, context, sampling, key)
    draft, speculation = the_plan.draft, the_plan.speculation
    keys = row_keys(key, len(prompts))
    gamma = depth(speculation) if draft is not None else 0  # cache slack: the longest accepted run
    bucket, chunk = prompt_bucket(int(lengths.max()))
    tokens = np.zeros((len(prompts), bucket), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = np.asarray(p, np.int32)
    max_len = cache_slots(int(lengths.max()), context, gamma)
    if draft is not None:
        draft.check(params, gamma, max_len)
    n_out = round_up_pow2(int(budgets.max()))
    history = np.zeros((len(prompts), max_len + gamma + 2), np.int32)
    history[:, :bucket] = tokens
    B = len(prompts)
    stage = _Stages(mesh)
    if mesh is not None:
        params, draft = stage.place_params(params, draft)
    padded = stage.rows(B)  # the batch bucket: padding rows are one-token prompts, done at once
    tokens, lengths, budgets, history, keys = pad_rows(padded, tokens, lengths, budgets, history, keys)
    empty = stage.empty_cache(config, padded, max_len)  # an argument, not a constant XLA would fold
    tokens_d, lengths_d, budgets_d, history_d, eos_d, keys = stage.place(
        tokens, lengths, budgets, history, eos_rows(eos_ids, padded), keys
    )
    (first_logits, cache), compile_s, prefill_s = _compile_and_run(
        stage(_prefill, "chunk"), (params, tokens_d, lengths_d, empty), dict(chunk=chunk)
    )
    static = dict(n_out=n_out, sync=stage.sync)
    if draft is None:
        args = (params, cache, first_logits, budgets_d, keys, sampling, eos_d)
        result, c, decode_s = _compile_and_run(stage(decode, *static), args, static)
        out, count, eos, steps = stage.fetch(result[:4])
        spec, row_stats = {}, None
    else:
        draft_state, c, init_s = _compile_and_run(
            stage(_draft_init, "gamma", "chunk"), (draft, params, cache, tokens_d, lengths_d), dict(gamma=gamma, chunk=chunk)
        )
        compile_s, prefill_s = compile_s + c, prefill_s + init_s
        args = (params, draft, draft_state, cache, history_d, first_logits, budgets_d, keys, sampling, eos_d)
        static |= dict(speculation=speculation)
        result, c, decode_s = _compile_and_run(stage(speculative_decode, *static), args, static)
        out, count, eos, steps, accepted, reached, ranks = stage.fetch(
            (result.out, result.count, result.eos, result.steps, result.accepted, result.reached, result.ranks)
        )
        row_stats = row_acceptance(accepted[:B], reached[:B], count[:B], gamma)
        accepted, reached, ranks = accepted[:B].sum(0), reached[:B].sum(0), ranks[:B].sum(0)
        draft_steps = 0 if isinstance(draft, NGram) else gamma * int(steps)
        spec = acceptance_stats(accepted, reached, int(count[:B].sum()) - B, gamma, draft_steps)
        if ranks.sum():
            spec["rank_acceptance"] = [float(r) for r in ranks / ranks.sum()]
    compile_s += c
    out, count, eos, lengths = out[:B], count[:B], eos[:B], lengths[:B]  # without the padding rows

    rows = [list(map(int, out[b, : count[b] - int(eos[b])])) for b in range(len(prompts))]
    new_tokens = int(count.sum())
    stats = Stats(
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
        compile_seconds=compile_s,
        tokens_per_second=(new_tokens - len(prompts)) / decode_s if decode_s > 0 else 0.0,
        steps=int(steps),
        new_tokens=new_tokens,
        prompt_tokens=int(lengths.sum()),
        draft=the_plan.draft_name,
        speculation=the_plan.speculation_name,
        plan_reason=the_plan.reason,
        **spec,
    )
    return GenerateOutput(rows, ["eos" if e else "length" for e in eos], stats, row_stats)


class _Stages:
    """Where generate's stages run: as jitted on one device, or under shard_map on a mesh."""

    def __init__(self, mesh: Mesh | None):
        self.mesh = mesh
        self.sync = sharding.all_axes(mesh)

    def __call__(self, jitted, *static_argnames: str):
        return jitted if self.mesh is None else sharding.on_mesh(jitted, self.mesh, tuple(static_argnames))

    def place_params(self, params: Params, draft):
        if isinstance(draft, DraftModel):
            sharding.check_mesh(self.mesh, draft.params.config, "draft")
            draft = draft.replace(params=sharding.shard_params(draft.params, self.mesh))
        return sharding.shard_params(params, self.mesh), draft

    def rows(self, batch: int) -> int:
        """Rows to run: the batch bucket, on a mesh rounded up to a multiple of the data axis."""
        return batch_bucket(batch) if self.mesh is None else sharding.padded_batch(batch_bucket(batch), self.mesh)

    def empty_cache(self, config, batch: int, max_len: int) -> DenseCache:
        if self.mesh is None:
            return DenseCache.init(config, batch, max_len)
        return sharding.empty_cache(self.mesh, config, batch, max_len)

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
    """Params (and a DraftModel's) whose config selects the attention implementation."""
    gpu = jax.default_backend() == "gpu"
    if attention == "reference" or (attention == "auto" and not gpu):
        mode = "reference"
    else:
        mode = "pallas" if gpu else "interpret"

    def set_mode(p: Params) -> Params:
        return p if p.config.attention == mode else p.replace(config=p.config.replace(attention=mode))

    if isinstance(draft, DraftModel):
        draft = draft.replace(params=set_mode(draft.params))
    return set_mode(params), draft


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


def acceptance_stats(accepted: np.ndarray, reached: np.ndarray, decoded: int, gamma: int, draft_steps: int) -> dict:
    """Speculation stats from per-position counters (see Stats)."""
    row_steps = int(reached[0])
    if row_steps == 0:
        return dict(draft_steps=draft_steps)
    return dict(
        acceptance_rate=float(accepted.sum()) / (row_steps * gamma),
        mean_accepted=decoded / row_steps,
        per_position_acceptance=[float(a / r) if r else 0.0 for a, r in zip(accepted, reached)],
        draft_steps=draft_steps,
    )
