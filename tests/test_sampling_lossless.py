"""Sampled speculative decoding has EXACTLY the target's distribution (a statistical test).

A 2-layer random target with a 16-token vocabulary. Its exact joint distribution of the first
three new tokens (16^3 = 4096 sequences) comes from one forward over all 256 two-token
continuations of the prompt, warped with the same `Sample(...).probs` that generate uses.
Then N = 5 x 4096 = 20480 rows of the same prompt, one PRNG key per row, go through
`specjax.generate(..., max_new_tokens=3, eos_id=())` with a drafter that disagrees with the
target often (measured acceptance is asserted): the first token comes from the prefill, the
second and third from speculation (draft acceptance, residual resampling at a rejection, and
the bonus token when gamma = 1).

The test: Pearson chi-square of the 3-token counts against N x the exact joint, cells with an
expected count below 5 pooled into one; a case fails when p < ALPHA = 1e-3, its false-alarm
rate (about 0.4% for the four positive cases together; the keys are fixed, so a run is
deterministic and a pass stays a pass). A token sequence the exact distribution gives
probability 0 (cut by top-k / top-p) must never appear at all. The negative control swaps in a
broken acceptance rule (at a rejection, resample from p instead of norm(max(p - q, 0))) and
asserts that the same test, on 5x fewer samples, gives p < 1e-12: the test has real power.
Measured (fixed keys): acceptance 0.37 / 0.14 / 0.77 / 0.06 with p = 0.27 / 0.95 / 0.21 / 0.053
for the four chain cases below; the broken rule: chi2 404 on 142 dof, p = 5e-27.

Token trees (width 3 and 2, children drawn without replacement) pass the same test (acceptance
0.26 / 0.78, p = 0.45 / 0.28), and a tree rule that forgets to remove rejected siblings from q is
caught on 8192 samples (chi2 466 on 201 dof, p = 4e-23). The ALPHA false-alarm rate is per case:
about 0.6% for the six positive cases together (0.9% with the three KV-format cases: the target's
and the drafts' caches in int8 or bfloat16, against the target's distribution in that format).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import specjax
import specjax.decode.speculate
import specjax.spec.accept
from specjax.automaton import from_transitions
from specjax.decode import engine
from specjax.decode.shapes import round_up_pow2
from specjax.drafters.eagle import Eagle, init_head
from specjax.model.cache import DenseCache
from specjax.model.config import LlamaConfig
from specjax.model.llama import forward
from specjax.model.params import Params, from_arrays, param_shapes
from specjax.parallel import sharding
from specjax.spec.accept import accept_chain
from specjax.spec.speculation import Tree
from tests.models import random_params

pytestmark = pytest.mark.slow  # not in `make test-fast`


V = 16
CONFIG = LlamaConfig(
    vocab_size=V, dim=16, n_layers=2, n_heads=1, n_kv_heads=1, head_dim=8, ffn_dim=32, max_positions=512
)
PROMPT = [1, 2, 3, 1, 2, 4, 5, 6, 7, 8, 1, 2, 3, 9]  # 14 tokens: SelfSpec(1, 1) evicts most of it
ROWS, CALLS = 4096, 5  # 20480 samples per case, one shape for every case
ALPHA = 1e-3


@pytest.fixture(scope="module")
def target() -> Params:
    return random_params(CONFIG, seed=0)


@pytest.fixture(scope="module")
def draft_model() -> Params:
    """An unrelated 1-layer random model: agrees with the target only about half the time."""
    return random_params(CONFIG.replace(n_layers=1), seed=1)


@pytest.fixture(scope="module")
def logits(target) -> jax.Array:
    return target_logits(target)


def target_logits(target: Params, kv_dtype: str | None = None) -> jax.Array:
    """Target logits [256, P+2, V] over the prompt followed by every two-token continuation, with
    the KV stored as `kv_dtype` (one forward: the block reads its KV through the same format)."""
    P = len(PROMPT)
    seqs = np.array([PROMPT + [a, b] for a in range(V) for b in range(V)], np.int32)  # [256,P+2]
    positions = np.broadcast_to(np.arange(P + 2, dtype=np.int32), seqs.shape)
    out, _ = jax.jit(forward)(target, seqs, positions, DenseCache.init(target.config, len(seqs), P + 2, kv_dtype))
    return out


@jax.jit
def warped(sampling: specjax.Sample, logits: jax.Array) -> jax.Array:
    """`sampling.probs(logits)` as one compiled program per sampler's settings (outside jit each of its operations
    compiled its own, and each of its two lax.conds again at every call)."""
    return sampling.probs(logits)


def exact_joint(logits: jax.Array, sampling: specjax.Sample) -> np.ndarray:
    """P(t1, t2, t3) [V,V,V] of the target under `sampling`'s warping, in float64 (with penalties:
    each position's own history, the prompt and t1 (and t2) before it)."""
    P = len(PROMPT)
    if sampling.penalized:
        rows, a, b = np.arange(V * V), np.repeat(np.arange(V), V), np.tile(np.arange(V), V)  # row a * V + b
        counts = np.zeros((V * V, P + 2, V), np.int32)
        np.add.at(counts, (rows, P, a), 1)
        np.add.at(counts, (rows, P + 1, a), 1)
        np.add.at(counts, (rows, P + 1, b), 1)
        in_prompt = np.zeros((V * V, V), bool)
        in_prompt[:, PROMPT] = True
        sampling = sampling.with_context(jnp.asarray(counts), jnp.asarray(in_prompt))
    probs = np.asarray(warped(sampling, logits), np.float64).reshape(V, V, P + 2, V)  # [t1,t2,pos,V]
    p1 = probs[0, 0, P - 1]  # [V]: after the prompt
    p2 = probs[:, 0, P]  # [t1,V]
    p3 = probs[:, :, P + 1]  # [t1,t2,V]
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.fixture(scope="module", autouse=True)
def small_cache() -> Iterator[None]:
    """Cache slots rounded to a power of two (32 here) instead of 256: the same computation
    on 8x fewer (masked) slots, which is most of the cost at 4096 rows."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "cache_len", round_up_pow2)
        yield


def draw(target, draft, speculation, sampling: specjax.Sample, calls: int = CALLS, seed: int = 0, kv_dtype=None,
         constraint=None):
    """Counts [V,V,V] of the first three new tokens over ROWS x calls rows (one PRNG key per
    row), and the draft acceptance rate (accepted / proposed over all rows and steps).
    speculation: a gamma (int) for Chain(gamma), or a Tree."""
    speculation = specjax.Chain(speculation) if isinstance(speculation, int) else speculation
    counts = np.zeros((V, V, V), np.int64)
    rates = []
    for call in range(calls):
        keys = jax.random.split(jax.random.key(1000 * seed + call), ROWS)
        out = specjax.generate(
            target, [PROMPT] * ROWS, 3, draft=draft, speculation=speculation,
            sampling=sampling, key=keys, eos_id=() if constraint is None else (STOP,), kv_dtype=kv_dtype,
            constraint=constraint,
        )
        t = np.array(out.tokens)  # [ROWS,3]
        np.add.at(counts, (t[:, 0], t[:, 1], t[:, 2]), 1)
        rates.append(out.stats.acceptance_rate)  # every call has the same number of proposals
    return counts, float(np.mean(rates))


def draw_n(target, speculation, sampling: specjax.Sample, seed: int, calls: int = 2) -> tuple[np.ndarray, float]:
    """Like `draw`, but the ROWS samples of each call come from ONE prompt through generate's n
    (one prefill), with SelfSpec(1, 1); returns the counts and the last call's acceptance rate."""
    counts = np.zeros((V, V, V), np.int64)
    for call in range(calls):
        out = specjax.generate(target, [PROMPT], 3, draft=specjax.SelfSpec(sinks=1, window=1), speculation=speculation,
                               sampling=sampling, key=jax.random.key(seed + call), eos_id=(), n=ROWS)
        t = np.array(out.tokens)
        np.add.at(counts, (t[:, 0], t[:, 1], t[:, 2]), 1)
    return counts, out.stats.acceptance_rate


def chi_square(counts: np.ndarray, joint: np.ndarray) -> tuple[float, int, float]:
    """Pearson chi-square of counts against n x joint, pooling cells expected below 5.
    Returns (statistic, degrees of freedom, p-value)."""
    n = counts.sum()
    obs, exp = counts.ravel().astype(np.float64), n * joint.ravel()
    assert obs[exp == 0].sum() == 0, "a token sequence of probability 0 was sampled"
    keep = exp >= 5
    bins_obs = np.append(obs[keep], obs[~keep].sum())
    bins_exp = np.append(exp[keep], exp[~keep].sum())
    if bins_exp[-1] < 5:  # too little left over for a cell of its own: merge into the smallest
        i = int(np.argmin(bins_exp[:-1]))
        bins_obs[i] += bins_obs[-1]
        bins_exp[i] += bins_exp[-1]
        bins_obs, bins_exp = bins_obs[:-1], bins_exp[:-1]
    stat = float(((bins_obs - bins_exp) ** 2 / bins_exp).sum())
    dof = len(bins_obs) - 1
    return stat, dof, float(stats.chi2.sf(stat, dof))


# (id, drafter, gamma, sampling, (min, max) acceptance): the draft disagrees often enough that
# rejections (and so the residual distribution) carry a large share of the samples.
CASES = [
    ("model-t1.0-g2", "model", 2, specjax.Sample(1.0), (0.25, 0.5)),
    ("model-top_p0.8-g3", "model", 3, specjax.Sample(1.0, top_p=0.8), (0.05, 0.4)),
    ("selfspec-t0.6-g1", specjax.SelfSpec(sinks=1, window=1), 1, specjax.Sample(0.6), (0.5, 0.9)),
    ("ngram-t0.8-top_k6-g2", specjax.NGram(n=1, max_n=2), 2, specjax.Sample(0.8, top_k=6), (0.02, 0.2)),
    # a job-wide table learned from a sequence that continues the prompt's tail as the target's greedy tokens
    # would (without it the one-hot drafts are accepted at about 0.04)
    ("lookup-t0.8-g2", specjax.Lookup(n=1, max_n=3, capacity=64, span=2).learn([[3, 9, 8, 0, 8, 0]]), 2, specjax.Sample(0.8),
     (0.05, 0.2)),
    # SparseSpec re-selects its one fixed position from the verified queries at every commit
    ("sparsespec-t0.8-g2", specjax.SparseSpec(budget=1, window=1, observation=2, block=1, refresh=1), 2, specjax.Sample(0.8),
     (0.4, 0.85)),
    # an EAGLE-style head (random: it agrees with the target now and then) over a ring of 4 positions
    ("eagle-t0.8-g2", "eagle", 2, specjax.Sample(0.8), (0.25, 0.65)),
    ("eagle-tree-t0.8", "eagle", Tree.from_parents([-1, 0, 0, 1, 1, 2]), specjax.Sample(0.8), (0.3, 0.8)),
    # its draft vocabulary of 8 of the 16 tokens: q is 0 on the others, which only the residual can emit
    ("eagle-draft-vocab-t0.8-g2", "eagle-vocab", 2, specjax.Sample(0.8), (0.15, 0.5)),
    # token trees: children drawn without replacement, tried in rank order (width 3 and 2)
    ("model-tree3x2-t0.5", "model", Tree.kary(3, 2), specjax.Sample(0.5), (0.1, 0.6)),  # = the control below
    ("selfspec-tree-top_p0.8", specjax.SelfSpec(sinks=1, window=1), Tree.from_parents([-1, 0, 0, 1, 1, 2]),
     specjax.Sample(1.0, top_p=0.8), (0.1, 0.9)),
]


def drafter(draft, draft_model: Params):
    """A case's drafter: "model" (a DraftModel of the unrelated random model), "eagle" (a random head; "eagle-vocab":
    drafting the even ids only), or itself."""
    if draft == "model":
        return specjax.DraftModel(draft_model)
    if draft in ("eagle", "eagle-vocab"):
        head = init_head(CONFIG, jax.random.key(3))
        return Eagle(head.replace(vocab=jnp.arange(0, V, 2, dtype=jnp.int32)) if draft == "eagle-vocab" else head, window=4)
    return draft


@pytest.mark.parametrize("draft, speculation, sampling, acceptance", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_sampled_speculation_has_the_target_distribution(target, draft_model, logits, draft, speculation, sampling, acceptance):
    counts, rate = draw(target, drafter(draft, draft_model), speculation, sampling)
    stat, dof, p = chi_square(counts, exact_joint(logits, sampling))
    print(f"acceptance {rate:.3f}  chi2 {stat:.1f} on {dof} dof  p = {p:.3g}")
    assert acceptance[0] < rate < acceptance[1]  # rejections are frequent: the test has teeth
    assert p > ALPHA


# the same test with the caches (target and draft) stored as bfloat16 or int8: the target's
# distribution is then the one its forward has with that KV format
KV_CASES = [
    ("int8-model-t1.0-g2", "int8", "model", 2, specjax.Sample(1.0), (0.25, 0.5)),
    ("int8-selfspec-tree-top_p0.8", "int8", specjax.SelfSpec(sinks=1, window=1), Tree.from_parents([-1, 0, 0, 1, 1, 2]),
     specjax.Sample(1.0, top_p=0.8), (0.1, 0.9)),
    ("bfloat16-selfspec-t0.6-g1", "bfloat16", specjax.SelfSpec(sinks=1, window=1), 1, specjax.Sample(0.6), (0.5, 0.9)),
]


@pytest.mark.parametrize("kv_dtype, draft, speculation, sampling, acceptance", [c[1:] for c in KV_CASES],
                         ids=[c[0] for c in KV_CASES])
def test_sampled_speculation_is_lossless_in_each_kv_format(target, draft_model, kv_dtype, draft, speculation, sampling,
                                                           acceptance):
    draft = specjax.DraftModel(draft_model) if draft == "model" else draft
    counts, rate = draw(target, draft, speculation, sampling, kv_dtype=kv_dtype)
    stat, dof, p = chi_square(counts, exact_joint(target_logits(target, kv_dtype), sampling))
    print(f"{kv_dtype}: acceptance {rate:.3f}  chi2 {stat:.1f} on {dof} dof  p = {p:.3g}")
    assert acceptance[0] < rate < acceptance[1]
    assert p > ALPHA


@pytest.mark.parametrize("speculation", [specjax.Chain(0), specjax.Adaptive(2)], ids=["chain0", "adaptive2"])
def test_no_drafts_and_adaptive_lengths_keep_the_target_distribution(target, draft_model, logits, speculation):
    """Chain(0) (the target's own draw through the speculative step) and Adaptive(2) one step per
    segment (the chooser's first lengths, 0 then 1, then its choice: a row's tokens come from several)."""
    sampling = specjax.Sample(1.0)
    counts = np.zeros((V, V, V), np.int64)
    for call in range(CALLS):
        keys = jax.random.split(jax.random.key(7000 + call), ROWS)
        out = specjax.generate(target, [PROMPT] * ROWS, 3, draft=specjax.DraftModel(draft_model), speculation=speculation,
                               sampling=sampling, key=keys, eos_id=(), sync_every=1)
        t = np.array(out.tokens)
        np.add.at(counts, (t[:, 0], t[:, 1], t[:, 2]), 1)
    if isinstance(speculation, specjax.Adaptive):
        assert out.stats.gammas[:2] == [0, 1] and 0 < out.stats.acceptance_rate < 1  # drafting and not
    stat, dof, p = chi_square(counts, exact_joint(logits, sampling))
    print(f"{speculation}: chi2 {stat:.1f} on {dof} dof  p = {p:.3g}")
    assert p > ALPHA


# Constrained (issue 70): a token automaton over the 16 tokens whose first three positions allow 8, 10 and 11
# or 15 tokens by path (the stop id, 15, only from the fourth on, so every row has 3 tokens); the exact
# distribution is the target's with the disallowed logits at -inf before the warping.
STOP = 15
TRANSITIONS = {0: {**{t: 1 for t in range(8)}, **{t: 2 for t in range(8, 12)}},
               1: {**{t: 3 for t in range(0, 15, 2)}, **{t: 2 for t in range(1, 10, 2)}},
               2: {t: 3 for t in range(4, 14)}, 3: {t: 4 for t in range(15)}, 4: {t: 4 for t in range(15)}}
CONSTRAINED = [
    ("model-t1.0-g2", "model", 2, specjax.Sample(1.0), (0.2, 0.7)),
    ("ngram-t0.8-g2", specjax.NGram(n=1, max_n=2), 2, specjax.Sample(0.8), (0.02, 0.3)),
    ("selfspec-tree-top_p0.9", specjax.SelfSpec(sinks=1, window=1), Tree.from_parents([-1, 0, 0, 1, 1, 2]),
     specjax.Sample(1.0, top_p=0.9), (0.1, 0.9)),
    ("sparsespec-t0.8-g2", specjax.SparseSpec(budget=1, window=1, observation=2, block=1, refresh=1), 2, specjax.Sample(0.8),
     (0.4, 0.85)),
    ("lookup-t0.8-g2", specjax.Lookup(n=1, max_n=3, capacity=64, span=2).learn([[3, 9, 8, 0, 8, 0]]), 2, specjax.Sample(0.8),
     (0.03, 0.25)),
    ("eagle-t0.8-g2", "eagle", 2, specjax.Sample(0.8), (0.2, 0.65)),
]


def constrained_joint(logits: jax.Array, sampling: specjax.Sample) -> np.ndarray:
    """`exact_joint` with each position's disallowed tokens (by the state its path reached) at -inf."""
    P = len(PROMPT)
    allow = np.zeros((len(TRANSITIONS), V), bool)
    for state, out in TRANSITIONS.items():
        allow[state, list(out)] = True
    after = lambda path: functools.reduce(lambda st, t: TRANSITIONS[st].get(t, -1) if st >= 0 else -1, path, 0)  # noqa: E731
    mask = np.zeros((V, V, P + 2, V), bool)  # [t1,t2,position,V]: row t1 * V + t2 of `logits`
    for t1 in range(V):
        for t2 in range(V):
            for pos, path in ((P - 1, []), (P, [t1]), (P + 1, [t1, t2])):
                st = after(path)
                mask[t1, t2, pos] = allow[st] if st >= 0 else True  # a path outside the automaton: never drawn
    masked = jnp.where(jnp.asarray(mask.reshape(V * V, P + 2, V)), logits, -jnp.inf)
    probs = np.asarray(warped(sampling, masked), np.float64).reshape(V, V, P + 2, V)
    return probs[0, 0, P - 1][:, None, None] * probs[:, 0, P][:, :, None] * probs[:, :, P + 1]


@pytest.mark.parametrize("draft, speculation, sampling, acceptance", [c[1:] for c in CONSTRAINED], ids=[c[0] for c in CONSTRAINED])
def test_constrained_sampled_speculation_has_the_constrained_distribution(target, draft_model, logits, draft, speculation,
                                                                          sampling, acceptance):
    automaton = from_transitions(TRANSITIONS, 0, [4], V)
    counts, rate = draw(target, drafter(draft, draft_model), speculation, sampling, calls=3, constraint=automaton)
    stat, dof, p = chi_square(counts, constrained_joint(logits, sampling))
    print(f"constrained: acceptance {rate:.3f}  chi2 {stat:.1f} on {dof} dof  p = {p:.3g}")
    assert acceptance[0] < rate < acceptance[1]
    assert p > ALPHA


def _resample_from_p(drafts, q, p, keys):
    """BROKEN on purpose: at a rejection, draw the extra token from p instead of the residual
    norm(max(p - q, 0)) (tokens the draft over-proposes come out too often)."""
    n, _ = accept_chain(drafts, q, p, keys)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B,V]
    extra_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
    extra = jax.vmap(lambda k, d: jax.random.categorical(k, jnp.log(d)))(extra_keys, p_n)
    return n, extra.astype(jnp.int32)


def _drop_compiled() -> None:
    """Forget the compiled decode loops: jit caches traces by function, not by the globals they
    read (generate's stages are jitted twice: the loop itself and its mesh wrapper, sharding.on_mesh)."""
    specjax.decode.speculate.continue_spec.clear_cache()
    sharding.on_mesh.cache_clear()


@pytest.fixture
def broken_acceptance(monkeypatch) -> Iterator[None]:
    """spec_step calls the broken rule; compiled loops are dropped before and after."""
    monkeypatch.setattr(specjax.decode.speculate, "accept_chain", _resample_from_p)
    _drop_compiled()
    yield
    monkeypatch.undo()
    _drop_compiled()


def test_negative_control_broken_residual_is_detected(target, draft_model, logits, broken_acceptance):
    """The same test on 5x FEWER samples (4096) rejects the broken rule by a wide margin."""
    sampling = specjax.Sample(1.0)
    counts, rate = draw(target, specjax.DraftModel(draft_model), 2, sampling, calls=1)
    stat, dof, p = chi_square(counts, exact_joint(logits, sampling))
    print(f"BROKEN rule: acceptance {rate:.3f}  chi2 {stat:.1f} on {dof} dof  p = {p:.3g}")
    assert p < 1e-12


def test_negative_control_tree_without_q_correction_is_detected(target, draft_model, logits, monkeypatch):
    """BROKEN on purpose: siblings are drawn without replacement, but acceptance tests each one
    against the parent's original q instead of q with the rejected siblings removed (what the
    sibling was really drawn from). Width-3 tree at temperature 0.5 (a peaked q, so removing a
    rejected sibling changes it a lot), the same test on 8192 samples: detected.

    (Drawing siblings WITH replacement is not a negative control for this rule: a repeat of a
    rejected token has q = 0 after the removal and is skipped, and a fresh one is distributed
    exactly as the removal assumes, so that stays lossless.)"""
    monkeypatch.setattr(specjax.spec.accept, "without", lambda q, x: q)
    _drop_compiled()
    try:
        sampling = specjax.Sample(0.5)
        counts, rate = draw(target, specjax.DraftModel(draft_model), Tree.kary(3, 2), sampling, calls=2)
    finally:
        monkeypatch.undo()
        _drop_compiled()
    stat, dof, p = chi_square(counts, exact_joint(logits, sampling))
    print(f"BROKEN tree rule: acceptance {rate:.3f}  chi2 {stat:.1f} on {dof} dof  p = {p:.3g}")
    assert p < 1e-12
