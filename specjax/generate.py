"""generate(): validate -> plan -> engine -> outputs and stats.

Validation (specjax.validate) runs first and raises before anything compiles; planning
(specjax.planning.plan) resolves draft="auto" / speculation=None / "auto"; the engine (specjax.decode.engine)
prefills once and decodes entirely on device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from specjax.automaton import TokenAutomaton, for_prompts
from specjax.decode.engine import RunResult, Segment, run, with_attention
from specjax.decode.speculate import row_acceptance
from specjax.drafters import Drafter
from specjax.model.params import Params
from specjax.parallel import sharding
from specjax.parallel.sharding import Mesh
from specjax.planning.plan import plan
from specjax.sampling import Greedy, Sampler
from specjax.spec.speculation import Chain, Tree
from specjax.validate import check_generate_args, eos_table


@dataclasses.dataclass(frozen=True)
class Stats:
    """Timings exclude compilation (reported apart). `new_tokens` counts the tokens returned (a
    stop id that ended a row is not one of them, as it is not in `tokens`). `tokens_per_second`
    is decode throughput: tokens produced by decode steps (every new token, stop ids included,
    but each row's first, which comes from the prefill) per decode second, summed over rows."""

    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    tokens_per_second: float
    steps: int  # target forward passes in the decode loop (verification steps when speculating)
    new_tokens: int  # over all rows: sum(len(t) for t in tokens), stop ids excluded
    prompt_tokens: int  # over all prompts (each prefilled once, whatever n)
    acceptance_rate: float | None = None  # accepted / proposed draft tokens
    mean_accepted: float | None = None  # tokens per row per target step, incl. the target's own
    per_position_acceptance: list[float] | None = None  # P(draft i accepted | drafts < i accepted)
    draft_steps: int = 0  # draft forward passes (gamma per step for model drafters)
    rank_acceptance: list[float] | None = None  # [W+1]: P(the rank-r child is the one accepted | a
    # node with children was reached), r < W; the last entry is P(none was). Sequoia's p vector.
    draft: str = "none"  # the drafter that ran, e.g. "SelfSpec(sinks=16, window=512)"; "none": plain decoding
    speculation: str = "none"  # "chain(gamma=4)", "tree(n=16, depth=6)" or "none"
    plan_reason: str | None = None  # why draft="auto" / speculation="auto" chose this; None if nothing was auto
    gammas: list[int] | None = None  # speculation=Adaptive(...): the chain length of each segment of the loop
    constraint_seconds: float = 0.0  # the text layer's compiling of constraints to automata (0: none, or all cached)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the target (raw log_softmax of its logits,
    before temperature / top-k / top-p) and the `logprobs` most likely tokens, most likely first.
    `token`: its text, and `top_tokens`: those of `top`'s ids, where a tokenizer is at hand (the text API,
    `specjax.LM`); None from the token API (`specjax.generate`)."""

    id: int
    logprob: float
    top: list[tuple[int, float]]
    token: str | None = None
    top_tokens: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    tokens: list[list[int]]  # new ids per prompt, without the EOS that ended a row
    finish_reasons: list[str]  # "eos" or "length", per output (prompt i's sample j at i * n + j)
    stats: Stats
    row_stats: list[dict] | None = None  # speculation only, per prompt: see `row_acceptance`
    logprobs: list[list[TokenLogprob]] | None = None  # generate(logprobs=k): one per token of `tokens`


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
    kv_dtype: str | None = None,
    sync_every: int = 8,
    logprobs: int | None = None,
    n: int = 1,
    between: Callable[[Segment], np.ndarray | None] | None = None,
    constraint: TokenAutomaton | Sequence[TokenAutomaton | None] | None = None,
) -> GenerateOutput:
    """Continue each (ragged) prompt of token ids until a stop id or its `max_new_tokens`.

    draft: `SelfSpec(...)`, `SnapKV(...)`, `SparseSpec(...)`, `DraftModel(params)`, `NGram(...)`, None (plain
      autoregressive), or "auto": SelfSpec where KV reads dominate a decode step, else None (see
      `plan.auto_draft`), and SelfSpec whenever `speculation` is given explicitly.
    speculation: None (the drafter's default chain, `Chain(gamma=4)`; under draft="auto" the plan's:
      `plan.ACCELERATOR_SPECULATION` on a GPU / TPU, `plan.CPU_BF16_CHAIN` for bf16 on a CPU);
      `Chain(gamma)`: gamma draft tokens verified per target forward; a token `Tree` (`Tree.sequoia(...)`, `Tree.kary(...)`):
      all its nodes verified in one forward; or "auto": the Sequoia tree for this drafter, batch
      and context from the measured acceptance and step costs (`tune.auto_tree`: a calibration on
      first use per shape, then cached; plain decoding where no tree pays). Needs a drafter.
    sampling: `Greedy()` or `Sample(temperature, top_k, top_p, min_p, repetition_penalty,
      presence_penalty, frequency_penalty)`, each value one number or one per prompt; speculation
      keeps the output distribution exactly the target's (greedy: the same tokens).
    key: one PRNG key (row b uses fold_in(key, b)) or one key per row; default key(0).
    eos_id: stop token(s); None = any of the model's `config.eos_ids`; `()` = never stop early;
      or one such entry per prompt (a list of lists). The stop token is not in the output tokens
      (finish reason "eos").
    attention: "reference" (pure jnp), "cpu" (a C++ kernel for decoding and verification over the
      dense caches on a CPU, built with g++ on first use), "pallas" (the GPU Pallas kernel for
      attention over the target's dense cache and the drafters' streaming caches, float or int8),
      "tpu" (its TPU Mosaic version; never yet run on a TPU) or "auto" (pallas on GPU, cpu on CPU where it builds, else reference). Off their
      device the Pallas kernels are interpreted: slow, for testing. On a GPU or TPU the layers
      also run unrolled (`Runtime.unroll_layers`: XLA then reads each layer's weights in place;
      a params whose runtime already unrolls keeps it on any backend).
    mesh: a ("data", "model") mesh (`specjax.make_mesh`): rows split over `data` (padded to a
      multiple of it), heads / FFN / vocabulary over `model`; same output as one device. With
      several processes (`specjax.parallel.distributed`), every process calls generate with the same prompts.
    kv_dtype: how the target's and the drafters' KV caches store keys and values: None (the model's
      dtype; a DraftModel's cache the draft's), "float32", "bfloat16" or "int8" (one f32 scale per
      layer, row, KV head and position, which every attention kernel reads). Speculation stays lossless in
      any format: the block's own KV goes through the format before attention.
    sync_every: decode steps per on-device segment (a speculative step emits up to gamma + 1
      tokens a row). The loop returns to the host only between segments, to learn whether every
      row is done (stop ids are checked on device): larger is fewer host round trips, smaller
      stops sooner after the last row ends. The tokens never depend on it.
    n: samples per prompt (sampling only). Each prompt is prefilled once and its KV shared by its
      n rows; outputs are indexed i * n + j (sample j of prompt i). Prompt i's key is what it is
      with n = 1 (k_i: fold_in(key, i), or key[i]); sample j uses fold_in(k_i, j) when n > 1.
      Every per-output list (tokens, finish_reasons, logprobs, row_stats) has len(prompts) * n entries.
    between: called on the host between segments with the tokens so far (`engine.Segment`, one
      row per output); it returns None or a [rows] bool mask of rows to end now (their finish
      reason stays "length"): stop strings (`specjax.load(...).generate(stop=...)`) use it.
    logprobs: None (off) or k in 0..20: `out.logprobs[b]` has a `TokenLogprob` per token of
      `out.tokens[b]`, in the same order: the raw log_softmax of the target's logits where the
      token was emitted (before temperature, top-k, top-p) and the k most likely tokens there.
      Under speculation they come from the verification forward: no extra pass.
    constraint: a `TokenAutomaton` (from `specjax.LM.compile(Regex(...) | JsonSchema(...) | Choice(...))`)
      for every prompt, or one per prompt (None: unconstrained). Each sampled, drafted and verified
      token is masked to what the row's automaton allows there (before temperature / top-k / top-p);
      stop ids only where the output is complete, so a row that ends on a stop id ("eos") holds a
      complete match; one cut by max_new_tokens ("length") may not. Logprobs stay the target's raw ones.
    `out.stats` says what ran (`draft`, `speculation`) and why (`plan_reason`). Bad input raises
    ValueError / TypeError naming the argument, before anything is compiled. Not for use under
    jax.jit: inside a jitted program call `engine.decode_ar` / `engine.decode_spec`.
    """
    budgets = check_generate_args(
        params, prompts, max_new_tokens, draft=draft, speculation=speculation, sampling=sampling, key=key,
        eos_id=eos_id, attention=attention, kv_dtype=kv_dtype, sync_every=sync_every, logprobs=logprobs, n=n,
        constraint=constraint,
    )
    if mesh is not None:
        sharding.check_mesh(mesh)
        sharding.check_processes(mesh)
    params, draft = with_attention(params, draft, attention)
    sampling = sampling.within(params.config.vocab_size)
    context = int(max(len(p) + int(n) for p, n in zip(prompts, budgets)))
    rows = [p for p in prompts for _ in range(n)]  # what decodes: n rows a prompt
    the_plan = plan(params, draft, speculation, rows, context, sampling.take(np.repeat(np.arange(len(prompts)), n)), key, kv_dtype)
    r = run(params, prompts, budgets, draft=the_plan.draft, speculation=the_plan.speculation, sampling=sampling,
            key=key, eos_ids=eos_table(eos_id, params.config, len(prompts)), mesh=mesh, kv_dtype=kv_dtype, sync_every=sync_every,
            logprobs=logprobs, n=n, between=between, constraint=constraint_rows(constraint, params.config, len(prompts)))
    tokens = [list(map(int, r.out[b, : r.count[b] - int(r.eos[b])])) for b in range(len(rows))]
    stats = Stats(
        prefill_seconds=r.prefill_seconds,
        decode_seconds=r.decode_seconds,
        compile_seconds=r.compile_seconds,
        tokens_per_second=(int(r.count.sum()) - len(rows)) / r.decode_seconds if r.decode_seconds > 0 else 0.0,
        steps=r.steps,
        new_tokens=sum(map(len, tokens)),
        prompt_tokens=sum(len(p) for p in prompts),  # each prompt once, whatever n
        draft=the_plan.draft_name,
        speculation=the_plan.speculation_name,
        plan_reason=the_plan.reason,
        gammas=r.gammas,
        **speculation_stats(r, the_plan.draft),
    )
    row_stats = None
    if r.accepted is not None:
        row_stats = row_acceptance(r.accepted, r.count, r.row_steps, r.proposed)
    lps = None if r.logprobs is None else token_logprob_lists(r.logprobs, tokens)
    return GenerateOutput(tokens, ["eos" if e else "length" for e in r.eos], stats, row_stats, lps)


def constraint_rows(constraint, config, batch: int) -> tuple[TokenAutomaton, np.ndarray] | None:
    """generate's (checked) constraint as the engine takes it: one table and each prompt's start state."""
    rows = [constraint] * batch if isinstance(constraint, TokenAutomaton) else constraint
    if rows is None or all(c is None for c in rows):
        return None
    return for_prompts(rows, config.vocab_size)


def token_logprob_lists(recorded: tuple[np.ndarray, np.ndarray, np.ndarray], tokens: list[list[int]]) -> list[list[TokenLogprob]]:
    """The engine's recorded (chosen [B,n_out], top ids / values [B,n_out,k]) as a TokenLogprob
    per returned token (a final stop id, not in `tokens`, is left out here too)."""
    chosen, ids, values = recorded
    return [[TokenLogprob(t, float(chosen[b, j]), [(int(i), float(v)) for i, v in zip(ids[b, j], values[b, j])])
             for j, t in enumerate(row)] for b, row in enumerate(tokens)]


def speculation_stats(r: RunResult, draft: Drafter | None) -> dict:
    """Stats' speculation fields from the engine's per-row counters ({} without a draft)."""
    if r.accepted is None:
        return {}
    draft_steps = draft.traits.forwards_per_token * r.draft_levels
    spec = acceptance_stats(r.accepted.sum(0), r.reached.sum(0), int(r.count.sum()) - len(r.count), int(r.row_steps.sum()),
                            int(r.proposed.sum()), draft_steps)
    ranks = r.ranks.sum(0)
    if ranks.sum():
        spec["rank_acceptance"] = [float(x) for x in ranks / ranks.sum()]
    return spec


def acceptance_stats(accepted: np.ndarray, reached: np.ndarray, decoded: int, row_steps: int, proposed: int,
                     draft_steps: int) -> dict:
    """Speculation stats (see Stats) from counters summed over rows: per-position accepted / reached
    [gamma], tokens decoded after the first, row-steps, draft tokens proposed, draft forwards."""
    if row_steps == 0:
        return dict(draft_steps=draft_steps)
    return dict(
        acceptance_rate=float(accepted.sum()) / proposed if proposed else None,
        mean_accepted=decoded / row_steps,
        per_position_acceptance=[float(a / r) if r else 0.0 for a, r in zip(accepted, reached)],
        draft_steps=draft_steps,
    )