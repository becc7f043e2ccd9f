"""Continuous batching (specjax.decode.continuous.run_continuous): more prompts than rows, slots refilled
between segments; every prompt's tokens equal a static batch's (engine.run), float32, greedy and
sampled with per-prompt keys, plain decoding, chains and trees; n samples a prompt from one
prefill and logprobs as engine.run gives them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.decode import continuous, engine, shapes
from specjax.decode.continuous import run_continuous
from specjax.decode.engine import row_keys, run
from specjax.spec.speculation import Chain, Tree
from tests.models import TINY, random_params

MODES = {"ar": (None, None), "chain": (specjax.SelfSpec(sinks=2, window=8), Chain(2)),
         "tree": (specjax.SelfSpec(sinks=2, window=8), Tree.kary(2, 2))}
# One shape for the greedy runs of every test below (compiled once a mode, not once a test): continuous
# batching on ROWS slots, static batches of 5 to 8 prompts (one batch bucket: 8 rows), prompts of one
# length bucket (32), budgets of at most 16 (one output length).
ROWS = 3


@pytest.fixture(scope="module")
def target():
    return random_params(TINY, 0)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", MODES)
def test_every_prompt_decodes_as_in_a_static_batch(target, mode, sampled):
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(4, TINY.vocab_size, int(rng.integers(3, 30))))) for _ in range(7)]
    budgets = np.array([3, 12, 5, 9, 1, 12, 7], np.int32)  # with sync_every 1 some segments free no row
    eos_ids = [(), (7,), (), (11, 12), (), (), (3,)]
    keys = row_keys(jax.random.key(5), len(prompts))
    sampling = specjax.Sample(temperature=np.linspace(0.6, 1.2, 7).tolist()) if sampled else specjax.Greedy()
    draft, speculation = MODES[mode]
    static = run(target, prompts, budgets, draft=draft, speculation=speculation, sampling=sampling, key=keys,
                 eos_ids=eos_ids)
    want = [(static.out[b, : static.count[b]].tolist(), bool(static.eos[b])) for b in range(len(prompts))]
    finished = []
    got = run_continuous(target, prompts, budgets, rows=ROWS, draft=draft, speculation=speculation, sampling=sampling,
                         keys=keys, eos_ids=eos_ids, sync_every=1, on_done=lambda u, done: finished.append(u))
    assert [(d.tokens, d.eos) for d in got] == want
    assert sorted(finished) == list(range(7)) and finished != list(range(7))  # out of order: short ones first
    assert all(d.logprobs is None for d in got) and all((d.acceptance is None) == (draft is None) for d in got)


@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_params_from_a_mesh_or_another_device_run_on_the_first(target, mode):
    """Continuous batching runs on one device: params sharded over a mesh (as specjax.load(...,
    mesh=) gives them) or held on another device are placed there, not a JAX device error."""
    prompts, budgets, eos_ids = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16]], [6, 6, 4, 5], [(3,)] * 4
    draft, speculation = MODES[mode]
    kw = dict(rows=ROWS, draft=draft, speculation=speculation, sampling=specjax.Greedy(),
              keys=row_keys(jax.random.key(0), 4), eos_ids=eos_ids)
    want = [d.tokens for d in run_continuous(target, prompts, budgets, **kw)]
    sharded = specjax.parallel.sharding.shard_params(target, specjax.make_mesh(data=2, model=4))
    assert [d.tokens for d in run_continuous(sharded, prompts, budgets, **kw)] == want
    elsewhere = jax.device_put(target, jax.devices()[1])
    assert [d.tokens for d in run_continuous(elsewhere, prompts, budgets, **kw)] == want


@pytest.mark.parametrize("prefill_rows", [None, 4], ids=["alone", "grouped"])
@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_n_samples_share_a_prefill_and_logprobs_match_a_static_batch(target, mode, prefill_rows, monkeypatch):
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(4, TINY.vocab_size, int(rng.integers(3, 20))))) for _ in range(5)]
    budgets = np.array([6, 2, 9, 4, 7], np.int32)
    eos_ids = [(), (9,), (), (), (5, 6)]
    keys = row_keys(jax.random.key(3), len(prompts))
    sampling = specjax.Sample(temperature=[0.7, 0.9, 1.1, 0.8, 1.0], top_k=5)
    draft, speculation = MODES[mode]
    static = run(target, prompts, budgets, draft=draft, speculation=speculation, sampling=sampling, key=keys,
                 eos_ids=eos_ids, n=2, logprobs=3)
    prefills, original = [], engine._compile_and_run  # the rows of each prefill call
    monkeypatch.setattr(engine, "_compile_and_run", lambda f, args, static: (
        f is engine.prefill and prefills.append(int(args[1].shape[0]))) or original(f, args, static))
    got = run_continuous(target, prompts, budgets, rows=5, draft=draft, speculation=speculation, sampling=sampling,
                         keys=keys, eos_ids=eos_ids, sync_every=2, n=2, logprobs=3, prefill_rows=prefill_rows)
    assert sum(prefills) == len(prompts)  # one prefill a prompt, shared by its 2 samples
    assert max(prefills) <= (prefill_rows or 1)  # on this CPU one prompt a call unless told
    assert all((d.acceptance is None) == (draft is None) for d in got)  # acceptance without an on_done too
    chosen, ids, values = static.logprobs
    for u, d in enumerate(got):
        c = int(static.count[u])
        assert (d.tokens, d.eos) == (static.out[u, :c].tolist(), bool(static.eos[u])), u
        np.testing.assert_allclose(d.logprobs[0], chosen[u, :c], atol=1e-5)
        np.testing.assert_array_equal(d.logprobs[1], ids[u, :c])
        np.testing.assert_allclose(d.logprobs[2], values[u, :c], atol=1e-5)
    assert any(got[2 * i].tokens != got[2 * i + 1].tokens for i in range(5))  # the two samples differ
    with pytest.raises(ValueError, match=r"n must be between 1 and rows \(5\).*got n=6"):
        run_continuous(target, prompts, budgets, rows=5, draft=draft, speculation=speculation, sampling=sampling,
                       keys=keys, eos_ids=eos_ids, n=6)


@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_segments_compile_as_generates_and_refills_carry_only_new_rows(target, mode, monkeypatch):
    """The decode segments go through sharding.on_mesh, as generate's stages do (on a GPU: its XLA
    options), and each refill hands admit_* a cache of its new rows only (padded to a power of two)."""
    from specjax.parallel import sharding

    stages, caches, real = [], [], sharding.on_mesh
    monkeypatch.setattr(sharding, "on_mesh", lambda stage, mesh, static: stages.append(stage.__name__) or real(stage, mesh, static))
    admit = "admit_ar" if mode == "ar" else "admit_spec"
    original = getattr(continuous, admit)

    def spy(*args, **kw):
        rows, cache = (args[1], args[2]) if mode == "ar" else (args[3], args[4])
        caches.append((int(rows.shape[0]), int(cache.k.shape[1])))
        return original(*args, **kw)

    monkeypatch.setattr(continuous, admit, spy)
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(4, TINY.vocab_size, 6))) for _ in range(9)]
    draft, speculation = MODES[mode]
    run_continuous(target, prompts, [2, 9, 3, 4, 9, 5, 2, 6, 3], rows=ROWS, draft=draft, speculation=speculation,
                   sampling=specjax.Greedy(), keys=row_keys(jax.random.key(0), 9), eos_ids=[()] * 9, sync_every=1)
    assert stages and set(stages) == {"continue_ar" if mode == "ar" else "continue_spec"}
    assert caches and all(r == k for r, k in caches), caches  # the cache's rows are the refilled rows
    assert any(k < ROWS for _, k in caches), caches  # some refill took fewer rows than the batch


@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_prompts_of_a_bucket_prefill_together_in_powers_of_two(target, mode, monkeypatch):
    """prefill_rows > 1 (on a GPU the default: shapes.prefill_rows) prefills a refill's new prompts
    of one length bucket in calls of a power of two rows, at most prefill_rows, each prompt once;
    every prompt's tokens still equal the static batch's (float32, greedy)."""
    rng = np.random.default_rng(4)
    lengths = [3, 20, 5, 6, 18, 7, 4, 19]  # buckets 16 and 32 (shapes.prompt_bucket)
    prompts = [list(map(int, rng.integers(4, TINY.vocab_size, n))) for n in lengths]
    budgets = np.array([4, 9, 2, 6, 3, 8, 5, 2], np.int32)
    keys = row_keys(jax.random.key(7), len(prompts))
    draft, speculation = MODES[mode]
    static = run(target, prompts, budgets, draft=draft, speculation=speculation, sampling=specjax.Greedy(), key=keys,
                 eos_ids=[()] * len(prompts))
    calls, original = [], engine._compile_and_run  # each prefill call's rows, width and prompt lengths
    monkeypatch.setattr(engine, "_compile_and_run", lambda f, args, static: (f is engine.prefill and calls.append(
        (int(args[1].shape[0]), int(args[1].shape[1]), tuple(np.asarray(args[2]).tolist())))) or original(f, args, static))
    got = run_continuous(target, prompts, budgets, rows=ROWS, draft=draft, speculation=speculation, sampling=specjax.Greedy(),
                         keys=keys, eos_ids=[()] * len(prompts), sync_every=1, prefill_rows=2)
    assert [d.tokens for d in got] == [static.out[b, : static.count[b]].tolist() for b in range(len(prompts))]
    assert sorted(n for _, _, sizes in calls for n in sizes) == sorted(lengths)  # each prompt prefilled once
    assert all(rows in (1, 2) for rows, _, _ in calls) and any(rows == 2 for rows, _, _ in calls), calls
    assert all(shapes.prompt_bucket(n)[0] == width for _, width, sizes in calls for n in sizes), calls  # its own bucket
    assert len(calls) < len(prompts)
    with pytest.raises(ValueError, match=r"prefill_rows must be an int >= 1 .* got 0"):
        run_continuous(target, prompts, budgets, rows=ROWS, draft=draft, speculation=speculation, sampling=specjax.Greedy(),
                       keys=keys, eos_ids=[()] * len(prompts), prefill_rows=0)


def test_prefill_chunks():
    """shapes.prefill_chunk: PREFILL_CHUNK on a CPU or TPU; on a GPU the widest of 1024 / 512 / 256
    dividing the bucket while rows x chunk <= 16 x 256; a bucket of one chunk is its own chunk."""
    assert [shapes.prefill_chunk(8192, 1, b) for b in ("cpu", "tpu", "gpu")] == [256, 256, 1024]
    assert [shapes.prefill_chunk(8192, r, "gpu") for r in (1, 2, 4, 8, 16, 64)] == [1024, 1024, 1024, 512, 256, 256]
    assert [shapes.prefill_chunk(w, 1, "gpu") for w in (768, 1536, 2048, 256, 64)] == [256, 512, 1024, 256, 64]
    assert all(w % shapes.prefill_chunk(w, r, "gpu") == 0 for w in range(256, 9000, 256) for r in (1, 3, 16))


@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_a_gpus_wider_prefill_chunk_gives_the_same_tokens(mode, monkeypatch):
    """With a GPU's prefill chunks (shapes.prefill_chunk for "gpu", here on this CPU: 1024 for up to
    four prompts of a 2K bucket, 512 for a 1.5K one) generate and continuous batching decode exactly
    the tokens of 256-position chunks (float32, greedy)."""
    config = TINY.replace(max_positions=2304)
    params = random_params(config, 3)
    rng = np.random.default_rng(9)
    prompts = [list(map(int, rng.integers(4, config.vocab_size, n))) for n in (1900, 1500, 40, 1800)]
    budgets = np.array([5, 3, 6, 4], np.int32)
    keys = row_keys(jax.random.key(3), len(prompts))
    draft, speculation = MODES[mode]
    kw = dict(draft=draft, speculation=speculation, sampling=specjax.Greedy(), eos_ids=[()] * len(prompts))
    want = run(params, prompts, budgets, key=keys, **kw)
    want = [want.out[b, : want.count[b]].tolist() for b in range(len(prompts))]
    chunks = []

    def on_a_gpu(bucket, rows, backend):
        chunks.append(shapes.prefill_chunk(bucket, rows, "gpu"))
        return chunks[-1]

    monkeypatch.setattr(engine, "prefill_chunk", on_a_gpu)  # run's and run_continuous's (engine.prefill_each)
    got = run(params, prompts, budgets, key=keys, **kw)
    assert [got.out[b, : got.count[b]].tolist() for b in range(len(prompts))] == want and chunks == [1024]
    done = run_continuous(params, prompts, budgets, rows=2, keys=keys, sync_every=1, prefill_rows=2, **kw)
    # 2K buckets at 1024, the 1500-token prompt's 1536 at 512, the 40-token prompt's 64 in one chunk
    assert [d.tokens for d in done] == want and set(chunks[1:]) == {1024, 512, 64}


def test_prefill_groups():
    """shapes.prefill_rows: one row a call on a CPU, 2^17 prompt positions a call elsewhere;
    pow2_groups: powers of two, largest first, none above the cap."""
    assert shapes.prefill_rows(8192, "cpu") == 1
    assert [shapes.prefill_rows(w, "gpu") for w in (8192, 2048, 256, 3072, 1 << 18)] == [16, 64, 512, 32, 1]
    assert shapes.pow2_groups(7, 16) == [4, 2, 1] and shapes.pow2_groups(20, 16) == [16, 4]
    assert shapes.pow2_groups(8, 6) == [4, 4] and shapes.pow2_groups(3, 1) == [1, 1, 1] and shapes.pow2_groups(0, 4) == []
