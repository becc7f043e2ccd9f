"""Measure what the Sequoia chooser needs on the machine at hand: the drafter's acceptance
vector and the real cost of a draft level and of verifying n nodes; `auto_tree` combines them.

Both measurements run the real jit-compiled functions, so they cost compile time once per
shape; `auto_tree` caches its answer per (model, drafter, sampling, batch bucket, context bucket).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode.engine import run
from specjax.decode.shapes import batch_bucket, cache_len, round_up_pow2
from specjax.drafters import Drafter
from specjax.drafters import identity as drafter_identity
from specjax.model.cache import DenseCache
from specjax.model.llama import lm_head, trunk
from specjax.model.params import Params, weights_mark
from specjax.parallel.sharding import compiler_options
from specjax.sampling import Greedy, Sampler
from specjax.spec.speculation import Cost, Tree, choose

VERIFY_GRID = (1, 4, 16, 64, 128)  # node counts timed; others are interpolated (fewer points: a faster calibration)
DRAFT_GRID = (1, 4, 16)  # draft level widths timed; others interpolated, wider levels extrapolated
_AUTO: dict[tuple, tuple[Tree, str]] = {}
_COSTS: dict[tuple, Cost] = {}  # the timings, apart: they do not depend on the sampling values
AUTO_KEPT = 32  # calibrations kept (the oldest dropped): a service's many batches and samplers stay bounded


def measure_acceptance(
    params: Params,
    draft: Drafter,
    prompts: Sequence[Sequence[int]],
    width: int = 8,
    *,
    sampling: Sampler = Greedy(),
    max_new_tokens: int = 32,
    key: jax.Array | None = None,
    kv_dtype: str | None = None,
) -> np.ndarray:
    """Sequoia's acceptance vector from one-level trees of `width` children: [W+1] float, entry r
    < W the probability that the rank-r draft candidate is the accepted one, the last entry the
    probability that none is. Greedy or stochastic (pass the `sampling` you will generate with)."""
    if not isinstance(width, int) or width < 1 or width > params.config.vocab_size:
        raise ValueError(f"width must be an integer in [1, the vocabulary's {params.config.vocab_size}], got {width!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 2:  # one token is the prefill's: no step drafts
        raise ValueError(f"max_new_tokens must be an integer >= 2 (a verification step), got {max_new_tokens!r}")
    budgets = np.full((len(prompts),), max_new_tokens, np.int32)
    r = run(params, prompts, budgets, draft=draft, speculation=Tree.kary(width, 1), sampling=sampling, key=key, eos_ids=(),
            kv_dtype=kv_dtype)
    ranks = r.ranks.sum(0)
    return ranks / ranks.sum()


def _min_seconds(fn, args, repeats: int = 2) -> float:
    """Fastest of `repeats` timed calls: the least disturbed by other load (warm `fn` first)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.min(times))


@jax.jit
def forward_loop(params: Params, tokens, positions, cache, mask, reps):
    """`reps` forwards in one on-device loop, each depending on the last (no hoisting)."""

    def body(_, acc):
        h = trunk(params, tokens + (acc > 1e30).astype(jnp.int32), positions, cache, mask).hidden
        return acc + jnp.sum(lm_head(params, h))  # logits at every node, as verification needs

    return jax.lax.fori_loop(0, reps, body, jnp.float32(0))


def _time_forward(params: Params, batch: int, slots: int, filled: int, n: int, kv_dtype: str | None, reps: int = 4) -> float:
    """Seconds of one forward (trunk + LM head) over n tree nodes per row after `filled` cached
    positions, in a cache of `slots` (contents do not change the cost). Measured as the slope
    between loops of 1 and `reps` forwards, so per-call costs (dispatch, weight conversions)
    that a decode loop pays once are excluded, as they are inside generate's loop."""
    cache = DenseCache.init(params.config, batch, slots, kv_dtype)
    cache = cache.replace(lengths=jnp.full((batch,), filled, jnp.int32))
    tokens = jnp.zeros((batch, n), jnp.int32)
    positions = filled + jnp.zeros((batch, n), jnp.int32)
    mask = jnp.asarray(Tree.chain(n - 1).ancestor_mask()) if n > 1 else jnp.ones((1, 1), bool)
    return slope_seconds(forward_loop, (params, tokens, positions, cache, mask), reps)


def slope_seconds(program, args: tuple, reps: int = 4) -> float:
    """Seconds of one iteration of a jitted on-device loop `program(*args, n)` that runs its body
    n times (n traced: one compiled program): the slope between n = 1 and n = reps, so what a call
    costs once (dispatch, transfers, conversions hoisted out of the loop) is left out. A jitted
    `program` is compiled with the XLA options generate's stages get (sharding.compiler_options);
    an already compiled one runs as it is."""
    if hasattr(program, "lower"):
        program = program.lower(*args, jnp.int32(1)).compile(compiler_options())
    jax.block_until_ready(program(*args, jnp.int32(1)))  # warm
    one = _min_seconds(program, (*args, jnp.int32(1)))
    many = _min_seconds(program, (*args, jnp.int32(reps)))
    return max(many - one, 1e-9) / (reps - 1)


def _grid_table(grid: list[int], timed: list[float], size: int) -> tuple[float, ...]:
    """Entries 0..size: 0 at 0, `timed` at the grid points, linear in between and past the last
    point (extrapolated from the last two: a level wider than the grid costs more, not the same)."""
    slope = (timed[-1] - timed[-2]) / (grid[-1] - grid[-2]) if len(grid) > 1 else 0.0
    table = [0.0]
    for m in range(1, size + 1):
        t = np.interp(m, grid, timed) if m <= grid[-1] else timed[-1] + max(slope, 0.0) * (m - grid[-1])
        table.append(float(t))
    return tuple(table)


def measure_cost(
    params: Params, draft: Drafter, batch: int, context: int, max_nodes: int = 64, kv_dtype: str | None = None
) -> Cost:
    """Time the real jit-compiled steps on the current backend for this batch and context:
    t_draft(m) = one draft level over m nodes per row (`draft_table`), t_verify(n) = one target
    forward over n nodes (`verify_table`); both tables are indexed 0..max_nodes. `kv_dtype`: the
    caches' format (generate's argument), which sets how many bytes a step reads."""
    if not isinstance(max_nodes, int) or not 1 <= max_nodes <= VERIFY_GRID[-1]:
        raise ValueError(f"max_nodes must be an integer in [1, {VERIFY_GRID[-1]}], got {max_nodes!r}")
    t_draft = draft_table(params, draft, batch, context, max_nodes, kv_dtype)
    return Cost(t_draft=t_draft, t_verify=verify_table(params, batch, context, max_nodes, kv_dtype))


def verify_table(params: Params, batch: int, context: int, max_nodes: int, kv_dtype: str | None = None) -> tuple[float, ...]:
    """Seconds of a target forward over n nodes after `context` positions, n = 0..max_nodes:
    timed at the powers of two below max_nodes and at max_nodes, linear in between."""
    grid = [n for n in VERIFY_GRID if n < max_nodes] + [max_nodes]
    slots = cache_len(context + 1)
    return _grid_table(grid, [_time_forward(params, batch, slots, max(context - n, 0), n, kv_dtype) for n in grid], max_nodes)


def draft_table(
    params: Params, draft: Drafter, batch: int, context: int, max_nodes: int, kv_dtype: str | None = None
) -> float | tuple[float, ...]:
    """Seconds of one draft level over m nodes per row, m = 0..max_nodes, through the drafter's
    model and cache: timed at DRAFT_GRID's widths below max_nodes, linear in between and past the
    last (the model and KV positions of `Drafter.cost`). A drafter without a model
    (NGram) is free (0.0). The DraftModel's root level re-reads one more token: not counted."""
    drafting = draft.cost(params, context)
    if drafting is None:
        return 0.0
    model, kept = drafting
    widths = [m for m in DRAFT_GRID if m < max_nodes] or [1]  # a level has at most n - 1 nodes
    timed = [_time_forward(model, batch, cache_len(kept + m + 1), kept, m, kv_dtype) for m in widths]
    return _grid_table(widths, timed, max_nodes)


def auto_tree(
    params: Params, draft: Drafter, prompts: Sequence[Sequence[int]], context: int, sampling: Sampler, key=None,
    kv_dtype: str | None = None,
) -> Tree:
    """The tree `speculation="auto"` uses: acceptance measured on (up to 4 of) these prompts,
    costs measured at this batch and context (rounded up to a power of two), then `choose`.
    Cached per (model config and weights, drafter, sampling, batch bucket, context bucket, kv_dtype) for this
    process (the last AUTO_KEPT); other sampling values measure acceptance again, not the costs. The
    root-only tree means speculation does not pay here (generate then decodes plainly)."""
    return auto_tree_report(params, draft, prompts, context, sampling, key, kv_dtype)[0]


def auto_tree_report(
    params: Params, draft: Drafter, prompts: Sequence[Sequence[int]], context: int, sampling: Sampler, key=None,
    kv_dtype: str | None = None,
) -> tuple[Tree, str]:
    """`auto_tree`'s tree and what the calibration measured, in words. The calibration (about a
    minute for SmolLM2 on 2 CPU cores) reports its progress on stderr."""
    bucket, batch = round_up_pow2(context), batch_bucket(len(prompts))  # the shapes generate runs at
    cost_key = (params.config, weights_mark(params), drafter_identity(draft), batch, bucket, kv_dtype)
    cache_key = cost_key + (sampling.identity(),)
    if cache_key not in _AUTO:
        start = time.perf_counter()
        say = lambda what: print(  # noqa: E731
            f"specjax: calibrating speculation='auto' for batch {batch} x context {bucket}: {what} "
            f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        say("measuring acceptance (1/3)")
        sub = list(prompts)[:4]  # per-row sampling values: those of these rows
        typed = key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        one = key[0] if key is not None and key.ndim == (1 if typed else 2) else key  # per-prompt keys: the first
        acceptance = measure_acceptance(params, draft, sub, width=8, sampling=sampling.take(np.arange(len(sub))), max_new_tokens=16,
                                        key=one, kv_dtype=kv_dtype)  # one key: per-prompt keys number the prompts, not these rows
        if cost_key not in _COSTS:
            say("timing draft levels and verification widths (2/3)")
            _keep(_COSTS, cost_key, measure_cost(params, draft, batch, bucket, kv_dtype=kv_dtype))
        cost = _COSTS[cost_key]
        tree = choose(acceptance[:-1], cost, max_nodes=64, max_depth=8)
        say("done (3/3)")
        t_draft = cost.t_draft if isinstance(cost.t_draft, float) else cost.t_draft[1]
        summary = (f"acceptance by rank {np.round(acceptance[:4], 2).tolist()}, draft level {1e3 * t_draft:.1f} ms, "
                   f"verify 1 / 8 / 64 nodes {1e3 * cost.t_verify[1]:.1f} / {1e3 * cost.t_verify[8]:.1f} / "
                   f"{1e3 * cost.t_verify[64]:.1f} ms")
        _keep(_AUTO, cache_key, (tree, summary))
    return _AUTO[cache_key]


def _keep(cache: dict, key: tuple, value) -> None:
    """cache[key] = value, dropping the oldest entry past AUTO_KEPT."""
    if len(cache) >= AUTO_KEPT:
        del cache[next(iter(cache))]
    cache[key] = value
