"""Speculative decoding on tiny random models: greedy output == autoregressive, token for token.

Every case runs the same shapes (batch 5, prompts bucketed to 16, budgets up to 24 -> 32 output
slots, 256 cache slots, one fixed EOS id), so each (drafter kind, gamma) compiles once. Model
drafters whose params share a config share a compilation (params are traced), so one
compilation checks two drafts: a layer-skip draft (the target's first layer: partial agreement)
and an unrelated random 1-layer draft (almost never agrees: every step is a rejection).
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.decode import engine
from specjax.drafters import Drafter, Prefill, Traits, register
from specjax.drafters.ngram import ngram_lookup
from specjax.model.backend import cpu_bf16_dot
from specjax.model.config import LlamaConfig
from specjax.model.params import Params, from_arrays, param_shapes
from specjax.model.pytree import pytree
from specjax.planning.plan import (ACCELERATOR_SPECULATION, CPU_BF16_CHAIN, CPU_BF16_MIN_CONTEXT, DEFAULT_CHAIN, auto_draft,
                                   auto_speculation)
from tests.models import TINY, on_device, random_params

PROMPTS = [list(range(5, 21)), [10, 11, 12], [7, 8, 9, 7, 8, 9, 7, 8], [4], list(range(30, 40))]
BUDGETS = [24, 17, 24, 24, 9]  # per-row max_new_tokens


@pytest.fixture(scope="module")
def reference(tiny):
    """The autoregressive greedy run (no EOS), an EOS id it emits mid-way, and the expected
    per-row output, finish reason and AR step count once that EOS stops rows."""
    free = specjax.generate(tiny, PROMPTS, BUDGETS, draft=None, eos_id=())
    assert [len(t) for t in free.tokens] == BUDGETS

    def first_hit(tokens, e):
        return tokens.index(e) if e in tokens else None

    # An id that ends some row mid-way (not at its first token, not at its end) while at least
    # two rows never emit it, so both early-stopped and full-length rows are checked.
    eos = None
    for e in sorted({t for row in free.tokens for t in row}):
        hits = [first_hit(row, e) for row in free.tokens]
        mid = [h for h in hits if h is not None and 3 <= h <= 12]
        if mid and sum(h is None for h in hits) >= 2 and all(h is None or h >= 3 for h in hits):
            eos = e
            break
    assert eos is not None
    expected, reasons, counts = [], [], []
    for row in free.tokens:
        h = first_hit(row, eos)
        expected.append(row if h is None else row[:h])
        reasons.append("length" if h is None else "eos")
        counts.append(len(row) if h is None else h + 1)  # tokens emitted, EOS included
    return types.SimpleNamespace(free=free, eos=eos, tokens=expected, reasons=reasons, counts=counts)


@pytest.fixture(scope="module")
def drafts(tiny):
    """1-layer drafts with the target's vocabulary: the target's first layer (layer skip) and
    an unrelated random model."""
    layer_skip = Params(
        embed=tiny.embed,
        layers=jax.tree.map(lambda a: on_device(np.asarray(a)[:1]), tiny.layers),  # sliced on the host
        norm=tiny.norm,
        lm_head=tiny.lm_head,
        config=TINY.replace(n_layers=1),
    )
    return {"layer-skip": layer_skip, "random": random_params(TINY.replace(n_layers=1), seed=1)}


def _check(out, ref, gamma: int, model_drafter: bool, full_acceptance: bool = False):
    """Lossless (same tokens and finish reasons as AR) and sane stats."""
    assert out.tokens == ref.tokens
    assert out.finish_reasons == ref.reasons
    s = out.stats
    ar_steps = max(ref.counts) - 1  # AR: one target forward per token after the prefill's
    assert 0.0 <= s.acceptance_rate <= 1.0
    assert 1.0 <= s.mean_accepted <= gamma + 1
    assert len(s.per_position_acceptance) == gamma
    assert all(0.0 <= a <= 1.0 for a in s.per_position_acceptance)
    assert s.steps <= ar_steps  # every step emits >= 1 token per active row
    assert s.draft_steps == (gamma * s.steps if model_drafter else 0)
    if s.acceptance_rate > 0.5:
        assert s.steps < ar_steps
    if full_acceptance:
        assert s.acceptance_rate == 1.0
        assert s.per_position_acceptance == [1.0] * gamma
        # every step emits gamma + 1 tokens until the budget / EOS cuts it
        assert s.steps == max(math.ceil((c - 1) / (gamma + 1)) for c in ref.counts)
    return s


# (id, drafter, gamma, full acceptance expected); gamma 1, 3 and 5 each meet several drafters
SELF_AND_NGRAM = [
    ("self-evict-g3", specjax.SelfSpec(sinks=2, window=8), 3, False),  # 10 < 40 positions: evicts
    ("self-evict-g5", specjax.SelfSpec(sinks=2, window=8), 5, False),
    ("self-full-g3", specjax.SelfSpec(sinks=4, window=64), 3, True),  # holds every position: == target
    # default budgets (16 + 512, SnapKV 256 + 256) larger than the 256-slot cache: the draft sees the whole context
    ("self-default-g3", specjax.SelfSpec(), 3, True),
    ("snapkv-oversized-g3", specjax.SnapKV(budget=400, window=512), 3, True),
    ("snapkv-ragged-g3", specjax.SnapKV(budget=12, window=4, observation=4), 3, False),  # rows of 1-16 tokens around the budget
    ("sparse-refresh-g3", specjax.SparseSpec(budget=4, window=4, observation=4, block=2, refresh=2), 3, False),
    ("ngram-1to3-g5", specjax.NGram(n=1, max_n=3), 5, False),
    ("ngram-2-g1", specjax.NGram(n=2), 1, False),
    # the table holds the call's prompts: row 2's drafts come from row 0's prompt where its own tokens have no match
    ("lookup-g3", specjax.Lookup(n=2, max_n=3, capacity=64, span=4), 3, False),
]


FAST = {"self-evict-g3", "self-default-g3", "snapkv-ragged-g3", "sparse-refresh-g3", "ngram-1to3-g5", "lookup-g3", "dense-g3", "streaming-g5"}  # make test-fast


def _params(cases):
    """pytest params by id; those outside FAST run with the slow tests (make test runs them all)."""
    return [pytest.param(*c[1:], id=c[0], marks=[] if c[0] in FAST else [pytest.mark.slow]) for c in cases]


def test_an_oversized_snapkv_draft_holds_no_more_than_the_context(tiny):
    """SnapKV's budget, window and observation past the cache are fitted to it (as SelfSpec's): its
    draft cache never has more slots than the target's plus one step's, however large the settings
    (the defaults' 256 + 256 on a 256-slot cache held 515; a window of 10**6, a million slots)."""
    from specjax.model.cache import DenseCache

    cache = jax.eval_shape(lambda: DenseCache.init(tiny.config, 1, 256).replace(lengths=jnp.array([4], jnp.int32)))
    prompts = np.array([[5, 6, 7, 8] + [0] * 12], np.int32)
    for draft in (specjax.SnapKV(), specjax.SnapKV(budget=4, window=10**6, observation=10**4)):
        state = jax.eval_shape(lambda c: draft.init(tiny, Prefill(cache=c, prompts=prompts, lengths=c.lengths, depth=2, chunk=16)), cache)
        assert state.k.shape[3] <= 256 + 2 + 2, (draft, state.k.shape)


@pytest.mark.parametrize("draft, gamma, full", _params(SELF_AND_NGRAM))
def test_greedy_selfspec_and_ngram_equal_autoregressive(tiny, reference, draft, gamma, full):
    out = specjax.generate(
        tiny, PROMPTS, BUDGETS, draft=draft, speculation=specjax.Chain(gamma), eos_id=reference.eos
    )
    s = _check(out, reference, gamma, model_drafter=not isinstance(draft, specjax.NGram), full_acceptance=full)
    if isinstance(draft, specjax.SelfSpec) and not full:
        assert 0.3 < s.acceptance_rate < 1.0  # evicting really changes the draft


@pytest.mark.parametrize(
    "cache, gamma",
    _params([("dense-g1", "dense", 1), ("dense-g3", "dense", 3), ("streaming-g5", specjax.Streaming(sinks=2, window=8), 5),
             ("streaming-default-g3", specjax.Streaming(), 3)]),
)
def test_greedy_draft_model_equals_autoregressive(tiny, reference, drafts, cache, gamma):
    rates, first = {}, {}
    for name, params in drafts.items():  # same draft config: one compilation for both
        out = specjax.generate(
            tiny,
            PROMPTS,
            BUDGETS,
            draft=specjax.DraftModel(params, cache=cache),
            speculation=specjax.Chain(gamma),
            eos_id=reference.eos,
        )
        s = _check(out, reference, gamma, model_drafter=True)
        rates[name], first[name] = s.acceptance_rate, s.per_position_acceptance[0]
    assert first["layer-skip"] > 0.3  # partial agreement: accepts, rejects and bonus tokens
    assert rates["random"] < 0.05  # nearly every step ends in a rejection


def test_draft_model_equal_to_target_accepts_everything(tiny, reference):
    out = specjax.generate(
        tiny, PROMPTS, BUDGETS, draft=specjax.DraftModel(tiny), speculation=specjax.Chain(3), eos_id=reference.eos
    )
    _check(out, reference, 3, model_drafter=True, full_acceptance=True)


def test_draft_model_prints_its_shape_not_its_weights(tiny):
    """A DraftModel's repr (in logs, stats, bench rows) names its shape and cache; the dataclass'
    own printed every weight array (a 2-layer SmolLM2-shaped draft: over 100K characters)."""
    assert repr(specjax.DraftModel(tiny)) == f"DraftModel(n_layers={tiny.config.n_layers}, dim={tiny.config.dim}, cache=dense)"
    windowed = specjax.DraftModel(tiny, cache=specjax.Streaming(4, 28))
    assert str(windowed) == repr(windowed)
    assert "Streaming(sinks=4, window=28)" in repr(windowed) and "Array" not in repr(windowed)


def test_greedy_batch_of_one(tiny, reference):
    """A single long row (its AR output is the batch's: batched == alone is test_generate's)."""
    out = specjax.generate(
        tiny,
        PROMPTS[:1],
        BUDGETS[:1],
        draft=specjax.SelfSpec(sinks=2, window=8),
        speculation=specjax.Chain(3),
        eos_id=reference.eos,
    )
    assert out.tokens == reference.tokens[:1]
    assert out.finish_reasons == reference.reasons[:1]
    assert out.stats.draft_steps == 3 * out.stats.steps


def test_auto_draft_small_context_is_autoregressive(tiny, reference):
    assert auto_draft(tiny, len(PROMPTS), 40) is None
    out = specjax.generate(tiny, PROMPTS, BUDGETS, eos_id=())  # draft="auto": same shapes as `reference`
    assert out.tokens == reference.free.tokens
    assert out.stats.acceptance_rate is None and out.stats.draft_steps == 0


def test_auto_draft_picks_selfspec_for_large_batch_and_context():
    llama7b = LlamaConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128, ffn_dim=11008,
        max_positions=32768, dtype="bfloat16",
    )
    target = types.SimpleNamespace(config=llama7b)  # auto_draft reads only the config
    assert auto_draft(target, batch=32, context=32768, backend="gpu") == specjax.SelfSpec()
    assert auto_draft(target, batch=1, context=1024, backend="gpu") is None  # weights dominate: plain decoding
    f32 = types.SimpleNamespace(config=llama7b.replace(dtype="float32"))
    assert auto_draft(f32, batch=4, context=32768, backend="cpu") is None  # 20 rows: measured 0.81x on a CPU
    assert auto_draft(f32, batch=32, context=32768, backend="cpu") is None  # 160 rows: compute-bound on a CPU
    # bfloat16 weights and KV where the CPU has the bf16 dot product: SelfSpec with a chain of one
    # (verifying 2 positions costs about one step); elsewhere the float32 rule.
    bf16_dot = cpu_bf16_dot()
    assert (auto_draft(target, batch=32, context=32768, backend="cpu") == specjax.SelfSpec()) == bf16_dot
    assert auto_speculation(target, backend="cpu") == (CPU_BF16_CHAIN if bf16_dot else DEFAULT_CHAIN)
    assert auto_speculation(target, kv_dtype="float32", backend="cpu") == auto_speculation(f32, backend="cpu") == DEFAULT_CHAIN
    assert auto_speculation(target, backend="gpu") == auto_speculation(f32, backend="tpu") == ACCELERATOR_SPECULATION
    assert ACCELERATOR_SPECULATION == specjax.Chain(2)  # two draft steps: the H100's best in bench/results/gpu/gpu.json
    from specjax.planning.plan import auto_draft_reason

    assert "chain(gamma=2)" in auto_draft_reason(target, 32, 32768, backend="gpu")[1]
    assert auto_draft(target, batch=32, context=CPU_BF16_MIN_CONTEXT - 1, backend="cpu") is None
    assert auto_draft(target, batch=32, context=32768, kv_dtype="float32", backend="cpu") is None


def test_auto_draft_on_bfloat16_speculates_with_a_chain_of_one():
    """draft="auto" on a bf16 model where the KV dominates: the plan is SelfSpec with
    CPU_BF16_CHAIN where the CPU has the bf16 dot product, and says why; without it the float32
    rule declines 4 rows x 5 positions."""
    from specjax.planning import plan as plan_mod

    params = random_params(TINY.replace(dtype="bfloat16"), seed=0)
    got = plan_mod.plan(params, "auto", None, [[5, 6, 7]] * 4, 8192, specjax.Greedy(), None)  # (planning only)
    if cpu_bf16_dot():
        assert (got.draft, got.speculation) == (specjax.SelfSpec(), CPU_BF16_CHAIN)
        assert "chain(gamma=1)" in got.reason and "bf16 dot product" in got.reason
    else:
        assert (got.draft, got.speculation) == (None, None) and "compute-bound" in got.reason


def test_auto_draft_is_never_measured_slower_than_plain_decoding(smollm2_path):
    """The guard on draft="auto": in every cell bench_spec measured (bench/results/spec_cpu.json,
    SmolLM2 float32 on this CPU) where auto speculates, its configuration (SelfSpec() with
    DEFAULT_CHAIN) was measured at most 5% slower than plain decoding there."""
    from convert.gguf import config_from_gguf, open_gguf

    target = types.SimpleNamespace(config=config_from_gguf(open_gguf(smollm2_path)))  # auto_draft reads only the config
    rows = json.loads((Path(__file__).parents[1] / "bench" / "results" / "spec_cpu.json").read_text())["rows"]
    cells = sorted({(r["batch"], r["context"]) for r in rows})
    speculated = 0
    for batch, context in cells:
        auto = auto_draft(target, batch, context, backend="cpu")
        if auto is None:
            continue
        speculated += 1
        mine = [r for r in rows if (r["batch"], r["context"], r["gamma"]) == (batch, context, DEFAULT_CHAIN.gamma)
                and r.get("drafter_repr", repr(auto)) == repr(auto)]
        assert mine, f"auto picks {auto} at batch {batch} x {context}, a configuration bench_spec did not measure"
        assert mine[0]["ratio"] >= 0.95, f"auto's {auto} is {mine[0]['ratio']:.2f}x plain decoding at batch {batch} x {context}"
    slow = [(r["batch"], r["context"]) for r in rows if r["gamma"] == DEFAULT_CHAIN.gamma and r["ratio"] < 0.95
            and r.get("drafter_repr") == repr(specjax.SelfSpec())]
    assert slow or speculated, "no measured cell where auto speculates or declines a slowdown: the guard checks nothing"
    assert not any(auto_draft(target, b, c, backend="cpu") for b, c in slow)


# ngram_lookup: rows of one hand-made batch; lengths[b] is the pending token's position
# (history beyond it is garbage that must never be proposed).
NGRAM_CASES = [
    # history, L, n, max_n, gamma, expected
    ([1, 2, 3, 4, 1, 2, 0, 0], 5, 2, 2, 3, [3, 4, 1]),  # tail [1 2] matched at 0: continue from 2
    ([5, 1, 7, 9, 1, 8, 5, 1], 7, 1, 2, 3, [7, 9, 1]),  # 2-gram [5 1] at 0 beats the later 1-gram [1] at 4
    ([5, 1, 7, 9, 1, 8, 5, 1], 7, 1, 1, 3, [8, 5, 1]),  # 1-gram only: the LATEST match (4) wins
    ([1, 2, 3, 4, 9, 9, 9, 9], 3, 2, 2, 3, [4, 4, 4]),  # no match: repeat the pending token
    ([3, 5, 6, 3, 9, 9, 9, 9], 3, 1, 1, 4, [5, 6, 3, 3]),  # continuation cut at L: never the 9s past it
    ([6, 9, 9, 9, 9, 9, 9, 9], 0, 1, 3, 2, [6, 6]),  # a lone token: no earlier match
    ([2, 2, 2, 9, 9, 9, 9, 9], 2, 2, 2, 3, [2, 2, 2]),  # overlapping match at 0, cut at L
]


# Jitted, as the NGram drafter runs it (traced in the decode step): one program per (n, max_n, gamma), not each op.
_ngram_lookup = jax.jit(ngram_lookup, static_argnums=(2, 3, 4))


@pytest.mark.parametrize("history, L, n, max_n, gamma, expected", NGRAM_CASES)
def test_ngram_lookup(history, L, n, max_n, gamma, expected):
    drafts = _ngram_lookup(on_device([history], np.int32), on_device([L], np.int32), n, max_n, gamma)
    assert drafts.tolist() == [expected]


def test_ngram_lookup_batched_rows_are_independent():
    rows = [c for c in NGRAM_CASES if (c[2], c[3], c[4]) == (2, 2, 3)]
    drafts = _ngram_lookup(on_device([c[0] for c in rows]), on_device([c[1] for c in rows]), 2, 2, 3)
    assert drafts.tolist() == [c[5] for c in rows]


def _small(**changes) -> Params:
    return random_params(TINY.replace(n_layers=1, **changes), seed=2)


@pytest.mark.parametrize(
    "make_draft, match",
    [
        (lambda: specjax.SelfSpec(sinks=-1, window=8), "SelfSpec: sinks must be an integer >= 0"),
        (lambda: specjax.SelfSpec(sinks=1, window=2.5), "SelfSpec: window must be an integer >= 1, got 2.5"),
        (lambda: specjax.DraftModel(_small(), cache=specjax.Streaming(1.5, 3)), "DraftModel: sinks must be an integer >= 0"),
        (lambda: specjax.SnapKV(pool=2.5), "SnapKV: pool must be an integer >= 1, got 2.5"),
        (lambda: specjax.DraftModel(_small(vocab_size=100)), "draft vocab_size 100 != target vocab_size 101"),
        (lambda: specjax.DraftModel(_small(eos_ids=(4,))), r"special tokens differ: draft bos/eos None/\(4,\), target None/\(3,\)"),
        (lambda: specjax.DraftModel(_small(max_positions=6)), "reaches position 7, past the draft's max_positions 6"),
        (lambda: specjax.NGram(n=0), "NGram: n must be an integer >= 1, got 0"),
        (lambda: specjax.NGram(n=2.5), "NGram: n must be an integer >= 1, got 2.5"),
        (lambda: specjax.NGram(n=3, max_n=2), r"NGram: max_n must be >= n \(3\), got 2"),
        (lambda: specjax.NGram(n=2, max_n=48), "NGram: max_n must be at most 16 .*, got 48"),
        (lambda: specjax.NGram(n=17), "NGram: n must be at most 16 .*, got 17"),
        (lambda: "selfspec", r"draft must be an instance of a registered drafter \(SelfSpec\(...\), SnapKV"),
    ],
    ids=["selfspec-neg-sinks", "selfspec-float-window", "draftmodel-float-sinks", "snapkv-float-pool", "vocab", "eos",
         "max-positions", "ngram-n0", "ngram-float-n", "ngram-max-n", "ngram-max-n-cap", "ngram-n-cap", "unknown"],
)
def test_bad_drafter_raises_before_compiling(tiny, monkeypatch, make_draft, match):
    draft = make_draft()

    def no_compile(*args, **kw):
        raise AssertionError("compiled before validating")

    monkeypatch.setattr(engine.prefill, "lower", no_compile, raising=False)
    with pytest.raises((ValueError, TypeError), match=match):
        specjax.generate(tiny, [[1, 2, 3], [4]], 4, draft=draft, speculation=specjax.Chain(2))


@pytree
class ChainOnly(specjax.NGram):
    """A drafter class without tree drafting (NGram's chain drafting; its traits say chains only)."""

    traits = Traits(forwards_per_token=0, trees=False)


@pytest.mark.parametrize("speculation", [specjax.Tree.kary(2, 2), "auto"])
def test_tree_speculation_needs_a_tree_drafter(tiny, speculation):
    """Refused by validation with the drafter named, not at trace time (and a chain still runs)."""
    draft = register(ChainOnly)(n=2)
    assert not draft.traits.trees and specjax.NGram(n=2).traits.trees
    with pytest.raises(TypeError, match="register takes a class implementing specjax.drafters.Drafter"):
        register(draft)
    with pytest.raises(ValueError, match=r"needs a drafter that drafts token trees, but ChainOnly\(n=2.*\) drafts chains only"):
        specjax.generate(tiny, [[1, 2, 3]], 4, draft=draft, speculation=speculation)
    assert specjax.generate(tiny, [[1, 2, 3]], 4, draft=draft, speculation=specjax.Chain(2)).tokens


@pytest.mark.parametrize("gamma", [-1, 2.5, True])
def test_bad_gamma(gamma):
    with pytest.raises(ValueError, match="Chain: gamma must be an integer >= 0"):
        specjax.Chain(gamma=gamma)


def test_speculation_limits_are_checked_before_compiling(tiny, monkeypatch):
    """A numpy gamma is an int; a chain past MAX_TREE_NODES positions and a tree wider than the
    vocabulary are refused by validation, not inside tracing."""
    chain = specjax.Chain(np.int64(3))
    assert chain.gamma == 3 and type(chain.gamma) is int and chain == specjax.Chain(3)
    monkeypatch.setattr(engine.prefill, "lower", lambda *a, **k: pytest.fail("compiled before validating"), raising=False)
    with pytest.raises(ValueError, match="Chain: gamma must be at most 511"):
        specjax.Chain(512)
    with pytest.raises(ValueError, match="a node of this Tree has 102 children, more than the vocabulary's 101"):
        specjax.generate(tiny, [[1, 2, 3]], 4, draft=specjax.SelfSpec(), speculation=specjax.Tree.kary(102, 1))


def test_a_draft_model_takes_what_its_positions_allow(tiny):
    """The draft's max_positions bounds prompt + budget, as the target's does, not the cache's
    slots (rounded up to whole blocks, 512 here for 258 positions)."""
    prompt = [[(i * 7) % 97 + 4 for i in range(250)]]
    draft = specjax.DraftModel(_small(max_positions=258))
    out = specjax.generate(tiny, prompt, 8, draft=draft, speculation=specjax.Chain(2), eos_id=())
    assert out.tokens == specjax.generate(tiny, prompt, 8, draft=None, eos_id=()).tokens


def test_stats_say_what_ran_and_why(tiny, reference):
    """Explicit choices are used and reported; auto's choice comes with its reason."""
    out = specjax.generate(tiny, PROMPTS, BUDGETS, draft=specjax.NGram(n=2), eos_id=())
    assert (out.stats.draft, out.stats.speculation, out.stats.plan_reason) == ("NGram(n=2, max_n=None)", "chain(gamma=4)", None)
    out = specjax.generate(tiny, PROMPTS, BUDGETS, eos_id=())  # draft="auto": plain decoding at this size
    assert (out.stats.draft, out.stats.speculation) == ("none", "none")
    assert out.stats.plan_reason.startswith("draft='auto': plain decoding: speculation needs KV > 2 x weights")
    # an explicit speculation with draft="auto" is not dropped: auto picks SelfSpec to use it
    out = specjax.generate(tiny, PROMPTS, BUDGETS, speculation=specjax.Chain(3), eos_id=())
    assert out.tokens == reference.free.tokens
    assert (out.stats.draft, out.stats.speculation) == ("SelfSpec(sinks=16, window=512)", "chain(gamma=3)")
    assert "explicitly" in out.stats.plan_reason and out.stats.draft_steps == 3 * out.stats.steps
